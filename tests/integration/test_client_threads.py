"""One Client shared by many threads, against a real server: threads that come and go leave no
socket behind, and close() while other threads are mid-call ends each of their calls with
NotConnectedError, at once, whether the server answers or is stalled."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from testkit.kv import CS, SHAPE, kv_for
from testkit.servers import ServerProcess
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.errors import NotConnectedError


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_threads(target: Callable[[int], object], n: int) -> list[tuple[type, str] | None]:
    """Run `target(i)` on `n` threads at once; each thread's exception type and message, or
    None (not the exception: its traceback would keep the threads' views of the arena alive)."""
    errors: list[tuple[type, str] | None] = [None] * n

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:
            errors[i] = (type(exc), str(exc))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a client call hung"
    return errors


def test_threads_that_end_leave_no_socket_behind(server: ServerProcess) -> None:
    tokens = list(range(100, 100 + 2 * CS))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("w", tokens, kv_for(40, 2), model="m")

        def work(i: int) -> None:
            assert c.lookup(f"r{i}", tokens, model="m") == 2 * CS
            c.end_session(f"r{i}")

        def work_in_batch(batch: int, i: int) -> None:
            work(batch * 4 + i)

        assert run_threads(work, 4) == [None] * 4  # the pool grows to the calls in flight
        before = open_fds()
        for batch in range(50):  # 200 threads, 4 at a time, each gone when its batch ends
            errors = run_threads(partial(work_in_batch, batch), 4)
            assert errors == [None] * 4
        grown = open_fds() - before
        assert grown <= 8, f"{grown} more open files after 200 threads came and went"
    assert open_fds() <= before - 1  # close() closed every socket it opened


def test_close_while_threads_wait_on_a_stalled_server_ends_their_calls_at_once(
    server: ServerProcess,
) -> None:
    tokens = list(range(200, 200 + 2 * CS))
    before = open_fds()
    c = Client(server.address, timeout=20)
    c.register(model="m", chunk_shape=SHAPE, dtype="float16")
    results: list[type | int | None] = [None] * 6
    ended = [threading.Event() for _ in results]

    def call(i: int) -> None:
        try:
            results[i] = c.lookup(f"r{i}", tokens, model="m")
        except BaseException as exc:
            results[i] = type(exc)
        ended[i].set()

    os.kill(server.proc.pid, signal.SIGSTOP)  # the server answers nothing from here
    try:
        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        # every call holds a socket of the pool: sent (or shaking hands), waiting for its reply
        assert wait_for(lambda: c.connection._busy >= 6, timeout=10)
        assert not any(e.is_set() for e in ended)
        t0 = time.monotonic()
        closer = threading.Thread(target=c.close, daemon=True)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close() hung"
        for e in ended:
            assert e.wait(5), "a call kept waiting after close()"
        took = time.monotonic() - t0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert all(r is NotConnectedError for r in results), results
    assert took < 5.0  # the goodbye's 0.5 s and the wake-up, not the calls' 20 s timeout
    assert open_fds() <= before  # every socket closed, the context ended


def test_close_while_threads_store_and_retrieve_ends_them_with_not_connected(
    server: ServerProcess,
) -> None:
    before = open_fds()
    c = Client(server.address)
    c.register(model="m", chunk_shape=SHAPE, dtype="float16")
    stop = threading.Event()
    calls = [0] * 6

    def work(i: int) -> None:
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * CS))
        kv = kv_for(50 + i, 2)
        out = np.zeros_like(kv)
        while not stop.is_set():
            c.store(f"w{i}", tokens, kv, model="m")
            c.retrieve(f"r{i}", tokens, out, model="m")
            calls[i] += 1
        raise AssertionError("the thread was never stopped by close()")

    threads_errors: list[tuple[type, str] | None] = []
    runner = threading.Thread(
        target=lambda: threads_errors.extend(run_threads(work, 6)), daemon=True
    )
    runner.start()
    assert wait_for(lambda: min(calls) >= 3, timeout=20, interval=0.05), calls
    c.close()  # the threads are mid-call, or between calls
    runner.join(30)
    stop.set()
    assert not runner.is_alive()
    assert all(e is not None and e[0] is NotConnectedError for e in threads_errors), threads_errors
    assert open_fds() <= before  # every socket closed, the context ended, the arena unmapped
