"""The hit contract, with real processes: what a lookup reports stays loadable while the client
that asked lives (past --pin-lease, with the L1 under eviction pressure); a dead client's pins
lapse; and /metrics counts every load that fell short of its lookup's report, by reason."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from testkit.admin import metric_samples, status, written
from testkit.kv import CS, SHAPE, kv_for
from testkit.servers import ServerProcess
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.errors import NoSpaceError

PIN_LEASE = 2.0
# A small L1 (128 pages; a chunk's shard takes one) that a short pin lease and a fast reaper
# would empty of unpinned chunks within seconds of pressure. Heartbeats come every second: a
# client timeout of 3 s keeps a live client alive on a loaded machine.
ARGS = (
    "--chunk-size", str(CS), "--l1-size", "512KiB", "--pin-lease", str(PIN_LEASE),
    "--reap-interval", "0.2", "--client-timeout", "3",
)  # fmt: skip


def failed_loads(server: ServerProcess) -> dict[str, float]:
    assert server.admin_url is not None
    samples = metric_samples(httpx.get(server.admin_url + "/metrics", timeout=5).text)
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in samples.items()
        if name == "kvtier_failed_loads_total"
    }


def _pressure(c: Client, seed: int) -> None:
    """Fill the L1 several times over with other chunks: whatever is not pinned is evicted.
    (With an L2, chunks are held until written there: a store that finds no room waits.)"""
    for i in range(24):
        tokens = list(range(seed + i * 1000, seed + i * 1000 + 16 * CS))

        def stored(i: int = i, tokens: list[int] = tokens) -> bool:
            try:
                c.store(f"pressure-{seed}-{i}", tokens, kv_for(seed + i, 16), model="m")
            except NoSpaceError:
                return False
            return True

        if not wait_for(stored, timeout=10, interval=0.05):
            raise AssertionError("the L1 never had room for the pressure's stores")
        c.end_session(f"pressure-{seed}-{i}")


def test_a_live_clients_hit_stays_loadable_past_the_pin_lease_under_eviction_pressure(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    disk = ("--l2", f"disk://{tmp_path}/l2?size=64MiB")
    from_l2 = list(range(50_000, 50_000 + 4 * CS))
    kv_l2 = kv_for(39, 4)
    first = server_factory(*ARGS, *disk)
    with Client(first.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("w", from_l2, kv_l2, model="m")
        assert wait_for(lambda: written(first, 4))
    first.stop()
    server = server_factory(*ARGS, *disk)  # the same L2; an empty L1
    tokens = list(range(100_000, 100_000 + 4 * CS))
    kv = kv_for(40, 4)
    with Client(server.address) as scheduler, Client(server.address) as worker:
        worker.register(model="m", chunk_shape=SHAPE, dtype="float16")
        worker.store("w", tokens, kv, model="m")
        assert scheduler.lookup("req", tokens, model="m") == 4 * CS
        # an asynchronous lookup: its chunks load from L2 while the scheduler goes on
        handle = scheduler.lookup("req-l2", from_l2, model="m", wait=False)
        assert handle.result(timeout=20) == 4 * CS
        # both requests wait (queued) for three pin leases while the L1 churns; the
        # scheduler's client heartbeats all along
        _pressure(worker, 200_000)
        # on purpose, not a synchronization: what is tested is that three pin leases pass
        # (the L1 churning) without the live client's hits being dropped: nothing to poll for
        time.sleep(3 * PIN_LEASE)
        _pressure(worker, 300_000)
        # the pressure's own chunks are held until the disk tier has them: wait for the writer
        assert wait_for(lambda: status(server)["l1"]["pinned_groups"] == 8, timeout=60)
        for rid, prompt, expected in (("req", tokens, kv), ("req-l2", from_l2, kv_l2)):
            out = np.zeros_like(expected)
            assert worker.retrieve(rid, prompt, out, model="m") == 4 * CS
            assert np.array_equal(out, expected)
        assert status(server)["l1"]["pinned_groups"] == 0  # retrieved: released
    assert failed_loads(server) == dict.fromkeys(failed_loads(server), 0.0)
    assert set(failed_loads(server)) == {"short", "pin_lapsed", "no_lookup", "lease_expired"}


_LOOKUP_THEN_HANG = textwrap.dedent(
    """
    import sys, time
    from kvtier.client import Client
    c = Client(sys.argv[1])
    print(c.lookup("dead-req", list(range(400_000, 400_000 + 4 * {cs})), model="m"), flush=True)
    time.sleep(600)  # on purpose: a client that looked up, then hangs until killed
    """
).format(cs=CS)


def test_a_dead_clients_pins_lapse_and_the_short_load_is_counted(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory(*ARGS)
    tokens = list(range(400_000, 400_000 + 4 * CS))
    kv = kv_for(41, 4)
    with Client(server.address) as worker:
        worker.register(model="m", chunk_shape=SHAPE, dtype="float16")
        worker.store("w", tokens, kv, model="m")
        worker.end_session("w")
        proc = subprocess.Popen(
            [sys.executable, "-c", _LOOKUP_THEN_HANG, server.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == str(4 * CS)
            assert status(server)["l1"]["pinned_groups"] == 4
            proc.kill()  # the engine died between its lookup and the load
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        # no heartbeat: the pins lapse a lease after its last sign of life
        assert wait_for(lambda: status(server)["l1"]["pinned_groups"] == 0, timeout=20)
        _pressure(worker, 500_000)
        out = np.zeros_like(kv)
        assert worker.retrieve("dead-req", tokens, out, model="m") < 4 * CS
    assert failed_loads(server)["pin_lapsed"] == 1


def test_a_load_after_the_server_restarted_is_counted(
    server_factory: Callable[..., ServerProcess],
) -> None:
    first = server_factory(*ARGS)
    tokens = list(range(600_000, 600_000 + 2 * CS))
    kv = kv_for(42, 2)
    with Client(first.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("w", tokens, kv, model="m")
        assert c.lookup("req", tokens, model="m") == 2 * CS
        first.stop()
        second = server_factory(*ARGS, address=first.address)
        # the client re-joins the new server, which never saw this lookup: nothing loads
        assert c.retrieve("req", tokens, np.zeros_like(kv), model="m") == 0
        # a retrieve that asks for more than its lookup's hit is no failed load
        assert c.lookup("req2", tokens, model="m") == 0
        assert c.retrieve("req2", tokens, np.zeros_like(kv), model="m") == 0
    assert failed_loads(second) == {
        "short": 0.0,
        "pin_lapsed": 0.0,
        "no_lookup": 1.0,
        "lease_expired": 0.0,
    }
