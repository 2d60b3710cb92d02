"""One slow client or tier never holds up the others, against real servers and a real Redis."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import numpy as np
from testkit.admin import status
from testkit.kv import CS, SHAPE, kv_for
from testkit.servers import ServerProcess, free_port, start_redis
from testkit.waiting import wait_for

from kvtier.client import Client


def test_a_hung_redis_under_the_block_policy_stalls_only_its_writer(
    server_factory: Callable[..., ServerProcess],
) -> None:
    port = free_port()
    redis_proc = start_redis(port)
    try:
        server = server_factory(
            "--chunk-size", str(CS),
            "--l2", f"redis://127.0.0.1:{port}/0?timeout=30",
            "--l2-queue-policy", "block",
            "--l2-queue-size", "2",
        )  # fmt: skip
        redis_proc.send_signal(signal.SIGSTOP)  # hung: connections accepted, nothing answered
        writer_took: list[float] = []

        def writer() -> None:
            with Client(server.address) as c:
                c.register(model="m", chunk_shape=SHAPE, dtype="float16")
                for r in range(3):  # the first batch hangs the L2 writer, the rest fill the queue
                    tokens = list(range(r * 10**5, r * 10**5 + 4 * CS))
                    t0 = time.monotonic()
                    assert c.store(f"w{r}", tokens, kv_for(40 + r, 4), model="m") == 4 * CS
                    writer_took.append(time.monotonic() - t0)

        thread = threading.Thread(target=writer)
        thread.start()
        # a store answered only after the block timeout (1 s) had a commit parked: the queue is
        # full, and stays full while the tier hangs (the server's own figures would ask the hung
        # tier, so the writer's timings are what says so)
        assert wait_for(lambda: any(took > 1.0 for took in writer_took), timeout=30)
        t0 = time.monotonic()
        with Client(server.address) as other:  # a handshake while the queue is full
            other.register(model="m", chunk_shape=SHAPE, dtype="float16")
            # a prompt in L1 hits at once; a miss asks the hung tier on a prefetch job, so a
            # non-blocking lookup answers "pending" at once too
            assert other.lookup("o", list(range(4 * CS)), model="m") == 4 * CS
            handle = other.lookup(
                "o2", list(range(7 * 10**5, 7 * 10**5 + 2 * CS)), model="m", wait=False
            )
            assert handle.poll() is None
            out = np.zeros_like(kv_for(50, 4))
            assert other.retrieve("o", list(range(4 * CS)), out, model="m") == 4 * CS
            assert np.array_equal(out, kv_for(40, 4))
        others_took = time.monotonic() - t0
        thread.join(60)
        assert not thread.is_alive()
        assert others_took < 1.0, f"another client waited {others_took:.2f}s on a full queue"
        assert max(writer_took) > 1.0  # the writer did wait for room (then its shards dropped)
        redis_proc.send_signal(signal.SIGCONT)  # the status asks the tier for its stats
        assert status(server)["l2"]["dropped"] > 0
    finally:
        redis_proc.send_signal(signal.SIGCONT)
        redis_proc.kill()
        redis_proc.wait()


def test_the_longest_lock_hold_per_operation_is_reported(server: ServerProcess) -> None:
    tokens = list(range(64 * 1024))  # a 64k-token prompt: hashed outside the lock
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.lookup("big", tokens, model="m")
        c.store("big", tokens[: 4 * CS], kv_for(51, 4), model="m")
    holds = status(server)["lock_hold"]
    assert {"Hello", "Register", "Lookup", "Reserve", "Commit"} <= set(holds)
    for op, stats in holds.items():
        assert stats["count"] >= 1
        assert stats["max_s"] < 0.05, f"{op} held the engine lock for {stats['max_s']:.3f}s"
