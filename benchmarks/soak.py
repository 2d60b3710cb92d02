"""A bounded chaos run (`make soak`): verified load while clients, the server, Redis and the
disk misbehave. Not a benchmark and not part of `make test`: it takes minutes and mounts a tmpfs.

Client processes loop over lookups, stores and retrieves of a fixed set of prompts whose KV
bytes are a pure function of the prompt, so every byte any client retrieves is checked against
what it must be. Meanwhile a chaos loop, one action every couple of seconds:

- pauses a client (SIGSTOP for 1-5 s, past the 2 s staging lease, then SIGCONT),
- kills a client (SIGKILL) and starts a fresh one,
- kills the server (SIGKILL) and restarts it on the same address and the same disk tier,
- stops its private Redis (SIGKILL) and starts it again a few seconds later,
- fills the disk tier's filesystem (a small tmpfs) with a filler file, and frees it later.

With `--attackers`, another tenant attacks all the while (`soak_attacks.py`: a flooding tenant,
one that lies about its pid, one that floods connections, echoed frames and registrations, one
that floods the KV events with subscriptions and unread replays). In every run two of every four
honest clients share a small pool of request ids, so one id is used at once for two prompts.
`--compare` runs the same seed without and then with the attackers and compares the honest
clients' latency: each honest client's p99 must stay within 1.5x of its p99 in the run without
them.

Server kills stop at 60% of the run, so the last server lives long enough to measure drift.
It prints operations, bytes verified, wrong bytes, acknowledged chunks lost (a store said
"stored" but a lookup right after it, on the same server, missed them), L2 drops, and the RSS
and fd drift of the last server and of the clients that lived through the run.

The honest clients are `soak_clients.py`, the processes and places a run owns `soak_parts.py`,
the attackers `soak_attacks.py`.

    python -m benchmarks.soak --duration 120 --compare
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.soak_attacks import KINDS, attacker
from benchmarks.soak_clients import SHAPE, worker
from benchmarks.soak_parts import Parts, rss_and_fds

SPAWN = mp.get_context("spawn")


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Run:
    parts: Parts
    duration: float
    num_clients: int
    rng: random.Random
    attackers: bool = False
    out: Any = field(default_factory=lambda: SPAWN.Queue())
    stop: Any = field(default_factory=lambda: SPAWN.Event())
    clients: dict[int, Any] = field(default_factory=dict)
    totals: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    chaos: Counter[str] = field(default_factory=Counter)
    next_wid: int = 0
    server_samples: list[tuple[float, int, int]] = field(default_factory=list)
    # the last /status of each server incarnation (counters restart with the server)
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)
    last_status_at: float = 0.0
    client_samples: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    latencies: dict[int, list[float]] = field(default_factory=dict)
    attacker_procs: list[Any] = field(default_factory=list)
    attacker_totals: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)

    def spawn_client(self) -> None:
        wid = self.next_wid
        self.next_wid += 1
        seed = self.rng.randrange(2**32)
        # clients 0 and 1 of every four share one pool of request ids, in both runs of a
        # comparison: their own collisions (an id ended by the other) cost both runs alike
        shared = wid % 4 < 2
        proc = SPAWN.Process(
            target=worker, args=(self.parts.address, wid, seed, self.out, self.stop, shared)
        )
        proc.start()
        self.clients[wid] = proc

    def spawn_attackers(self) -> None:
        ports = {
            "admin": int(self.parts.admin.rsplit(":", 1)[1]),
            "events": self.parts.events_port,
            "replay": self.parts.replay_port,
        }
        for i, kind in enumerate(KINDS):
            proc = SPAWN.Process(
                target=attacker,
                args=(self.parts.address, kind, 1000 + i, self.out, self.stop, SHAPE, ports),
            )
            proc.start()
            self.attacker_procs.append(proc)

    def drain(self) -> None:
        while True:
            try:
                who, pid, counts, *rest = self.out.get_nowait()
            except Exception:
                return
            if isinstance(who, str):  # an attacker
                self.attacker_totals[who, pid] = counts
                continue
            self.totals[who, pid] = counts
            self.latencies.setdefault(who, []).extend(rest[0])

    def sample(self) -> None:
        if self.parts.server is not None and time.monotonic() - self.last_status_at > 2:
            self.last_status_at = time.monotonic()
            with contextlib.suppress(Exception):
                self.statuses[self.parts.server.pid] = self.parts.status()
        if self.parts.server is not None:
            with contextlib.suppress(OSError, StopIteration):
                rss, fds = rss_and_fds(self.parts.server.pid)
                self.server_samples.append((time.monotonic(), rss, fds))
        for wid, proc in self.clients.items():
            with contextlib.suppress(OSError, StopIteration):
                self.client_samples.setdefault(wid, []).append(rss_and_fds(proc.pid))

    def chaos_step(self, elapsed: float) -> None:
        actions = ["pause", "pause", "kill_client", "redis", "disk"]
        if elapsed < 0.6 * self.duration:
            actions.append("kill_server")
        action = self.rng.choice(actions)
        self.chaos[action] += 1
        if action == "pause":
            wid = self.rng.choice(list(self.clients))
            pid = self.clients[wid].pid
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(self.rng.uniform(1, 5), _cont, args=(pid,)).start()
        elif action == "kill_client":
            wid = self.rng.choice(list(self.clients))
            self.clients.pop(wid).kill()
            self.client_samples.pop(wid, None)
            self.spawn_client()
        elif action == "kill_server":
            self.parts.kill_server()
            time.sleep(self.rng.uniform(0.2, 1.5))
            self.parts.start_server()
            self.server_samples.clear()  # drift is measured over the last server's lifetime
        elif action == "redis":
            self.parts.stop_redis()
            threading.Timer(self.rng.uniform(2, 6), self._restart_redis).start()
        elif action == "disk":
            filler = self.parts.disk / f"filler-{uuid.uuid4().hex}"
            with contextlib.suppress(OSError), open(filler, "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
            free_later = threading.Timer(
                self.rng.uniform(3, 8), filler.unlink, kwargs={"missing_ok": True}
            )
            free_later.start()

    def _restart_redis(self) -> None:
        if self.parts.redis is None:
            self.parts.start_redis()


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _drift(samples: list[tuple[int, int]], warmup: float = 0.2) -> tuple[float, int]:
    """(RSS drift as a fraction, fd drift) from the first sample after warm-up to the last."""
    if len(samples) < 3:
        return 0.0, 0
    first = samples[int(len(samples) * warmup)]  # skip the warm-up
    last = samples[-1]
    return (last[0] - first[0]) / first[0], last[1] - first[1]


def soak(
    duration: float, num_clients: int, seed: int, disk_size: str, attackers: bool = False
) -> dict[str, Any]:
    parts = Parts(Path(tempfile.mkdtemp(prefix="kvtier-soak-")))
    run = Run(parts, duration, num_clients, random.Random(seed), attackers)
    try:
        parts.mount_disk(disk_size)
        parts.start_redis()
        time.sleep(0.3)
        parts.start_server()
        for _ in range(num_clients):
            run.spawn_client()
        if attackers:
            run.spawn_attackers()
        t0 = time.monotonic()
        next_chaos = t0 + 3
        while (elapsed := time.monotonic() - t0) < duration:
            run.drain()
            run.sample()
            if time.monotonic() >= next_chaos and elapsed < duration - 5:
                run.chaos_step(elapsed)
                next_chaos = time.monotonic() + run.rng.uniform(1.5, 3.5)
            time.sleep(0.5)
        if parts.redis is None:
            parts.start_redis()
        for proc in run.clients.values():
            _cont(proc.pid)  # a paused one must see the stop event too
        time.sleep(3)
        final_status = parts.status()
        assert parts.server is not None
        run.statuses[parts.server.pid] = final_status
        run.stop.set()
        for proc in [*run.clients.values(), *run.attacker_procs]:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
        run.drain()
    finally:
        run.stop.set()
        for proc in [*run.clients.values(), *run.attacker_procs]:
            if proc.is_alive():
                _cont(proc.pid)
                proc.kill()
        parts.close()
    totals: Counter[str] = Counter()
    for counts in run.totals.values():
        totals.update(counts)
    # Under attack the last server first fills what the attackers may make it hold (sessions
    # until they expire, client ids until swept, pins and staging up to their shares): its
    # warm-up is the first half of its life; see server_rss_mib_trend for the whole of it.
    warmup = 0.5 if attackers else 0.2
    server_rss, server_fds = _drift([(r, f) for _, r, f in run.server_samples], warmup)
    client_drifts = [_drift(s) for s in run.client_samples.values() if len(s) > 10]
    summed: Counter[str] = Counter()
    for st in run.statuses.values():
        for section in ("l2", "fencing"):
            for key, value in (st.get(section) or {}).items():
                if isinstance(value, int) and key not in ("queue_capacity",):
                    summed[f"{section}.{key}"] += value
    attacks: Counter[str] = Counter()
    for counts in run.attacker_totals.values():
        attacks.update(counts)
    pooled = [x for lat in run.latencies.values() for x in lat]
    return {
        "duration_s": duration,
        "clients": num_clients,
        "attackers": list(KINDS) if attackers else [],
        "operations": totals["ops"],
        "lookups": totals["lookups"],
        "retrieves": totals["retrieves"],
        "stores": totals["stores"],
        "bytes_verified": totals["bytes_verified"],
        "wrong_bytes": totals["wrong_bytes"],
        "acknowledged_chunks": totals["acked_chunks"],
        "acknowledged_chunks_lost": totals["acked_lost"],
        "discarded_bytes": totals["discarded_bytes"],
        "discarded_wrong_bytes": totals["discarded_wrong_bytes"],
        "client_errors": {k[6:]: v for k, v in sorted(totals.items()) if k.startswith("error:")},
        "chaos": dict(run.chaos),
        "server_incarnations": len(run.statuses),
        "l2_submitted": summed["l2.submitted"],
        "l2_written": summed["l2.written"],
        "l2_dropped": summed["l2.dropped"],
        "l2_write_errors": summed["l2.write_errors"],
        "lease_expired_answers": summed["fencing.lease_expired"],
        "server_rss_drift": round(server_rss, 4),
        "server_fd_drift": server_fds,
        "server_samples": len(run.server_samples),
        # the last server's RSS over its life (MiB, every tenth sample): a leak keeps rising,
        # state filling up to its bounds levels off
        "server_rss_mib_trend": [round(r / 2**20, 1) for _, r, _ in run.server_samples[::10]],
        "client_rss_drift_max": round(max((d[0] for d in client_drifts), default=0.0), 4),
        "client_fd_drift_max": max((d[1] for d in client_drifts), default=0),
        "traceback_in_server_log": any("Traceback" in line for line in parts.log),
        "honest_p50_ms": round(_quantile(pooled, 0.50) * 1e3, 3),
        "honest_p99_ms": round(_quantile(pooled, 0.99) * 1e3, 3),
        "honest_p99_ms_by_client": {
            str(wid): round(_quantile(lat, 0.99) * 1e3, 3)
            for wid, lat in sorted(run.latencies.items())
            if len(lat) >= 100
        },
        "attacks": dict(sorted(attacks.items())),
    }


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else 0.0


def _passed(result: dict[str, Any]) -> bool:
    return bool(
        result["wrong_bytes"] == 0
        and result["discarded_wrong_bytes"] == 0
        and result["acknowledged_chunks_lost"] == 0
        and result["server_rss_drift"] <= 0.10
        and result["attacks"].get("liar_granted_slots", 0) == 0
    )


def compare(quiet: dict[str, Any], attacked: dict[str, Any]) -> dict[str, Any]:
    """Each honest client's p99 with the attackers over its p99 without them (same seed, so
    the same clients meet the same chaos), and the pooled ratio."""
    before, after = quiet["honest_p99_ms_by_client"], attacked["honest_p99_ms_by_client"]
    ratios = {w: after[w] / before[w] for w in sorted(set(before) & set(after)) if before[w]}
    return {
        "p99_ratio_by_client": {w: round(r, 3) for w, r in ratios.items()},
        "p99_ratio_max": round(max(ratios.values(), default=0.0), 3),
        "p99_ratio_pooled": round(attacked["honest_p99_ms"] / max(quiet["honest_p99_ms"], 1e-9), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of chaos")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--disk-size", default="6m", help="size of the disk tier's tmpfs")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--attackers", action="store_true", help="mix in the tenant attacks")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run without, then with the attackers (same seed), and compare honest p99s",
    )
    args = parser.parse_args()
    runs = [False, True] if args.compare else [args.attackers]
    results = {}
    for attacked in runs:
        name = "attacked" if attacked else "quiet"
        print(f"soak: {name} run, {args.duration:g} s", flush=True)
        results[name] = soak(args.duration, args.clients, args.seed, args.disk_size, attacked)
        for key, value in results[name].items():
            print(f"{key:28} {value}")
    ok = all(_passed(r) for r in results.values())
    if args.compare:
        results["comparison"] = compare(results["quiet"], results["attacked"])
        for key, value in results["comparison"].items():
            print(f"{key:28} {value}")
        ok = ok and results["comparison"]["p99_ratio_max"] <= 1.5
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print("soak:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
