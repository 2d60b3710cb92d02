"""Session costs: decode-like growth of one session to 128k tokens, and SessionManager throughput.

Baselines are measured in the same run: re-hashing the whole prefix at every step (what a
session without incremental hashing does), and a naive manager that mimics the lineage (a dict
under a lock holding dataclass sessions with their own lock, token list and wall-clock
`created_at`), whose expiry scans every session under one hold of the lock.
"""

from __future__ import annotations

import gc
import importlib
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from benchmarks.common import best_of, table
from kvtier.hashing import TokenHasher, token_bytes
from kvtier.session import Session, SessionManager

CHUNK_SIZE = 256
MAX_TOKENS = 131_072
STEP = 256  # tokens added per decode-like step
NUM_SESSIONS = 100_000
LIST_LABEL = "set_tokens(list full prefix) + get_hashes(0)"
NAIVE_LIST_LABEL = "naive: convert the whole list every step, then set_tokens (kvtier before)"
MAX_LIST_GOAL_TOKENS = 32768
LINEAGE_CREATES_PER_S = 71_000.0  # the lineage's get_or_create rate on the project's machine
CREATE_GOAL = 3.0  # times the lineage's rate
HOLD_GOAL_S = 1e-3  # longest single hold of the manager's lock during cleanup
REPEAT = 3
# LMCache 0.5.6's own Session, measured side by side when it imports (it needs torch, numba and
# msgspec; on CPU: `pip install --no-deps lmcache==0.5.6 numba llvmlite` next to kvtier's venv).
LINEAGE_MODULES = ("lmcache.v1.multiprocess.session", "lmcache.v1.multiprocess.token_hasher")


# -- decode-like growth ------------------------------------------------------------------------


def _at(step_times: list[float], tokens: int) -> float:
    """Median step time over the 8 steps that end at or just before `tokens`."""
    last = tokens // STEP - 1
    return statistics.median(step_times[max(0, last - 7) : last + 1])


def _growth_section() -> list[str]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 152_000, MAX_TOKENS, dtype=np.int64)
    packed = ids.astype("<u4").tobytes()
    token_list = ids.tolist()
    # Each step's prefix is built untimed just before it (holding all 512 would take 128 MiB):
    # the engine hands each one over ready-made.
    prefix_bytes: dict[int, bytes] = {}
    prefix_list: dict[int, list[int]] = {}

    def set_bytes(session: Session, end: int) -> None:
        session.set_tokens(prefix_bytes[end])
        session.get_hashes(0)

    def append_delta(session: Session, end: int) -> None:
        session.append_tokens(deltas[end])
        session.get_hashes(0)

    def set_list(session: Session, end: int) -> None:
        session.set_tokens(prefix_list[end])
        session.get_hashes(0)

    def convert_list(session: Session, end: int) -> None:
        session.set_tokens(token_bytes(prefix_list[end]))
        session.get_hashes(0)

    hasher = TokenHasher(CHUNK_SIZE)

    def rehash(session: Session, end: int) -> None:
        hasher.compute_chunk_hashes(prefix_bytes[end])

    deltas = {end: packed[(end - STEP) * 4 : end * 4] for end in range(STEP, MAX_TOKENS + 1, STEP)}
    results: dict[str, list[float]] = {}
    for label, fn, source in (
        ("set_tokens(packed full prefix) + get_hashes(0)", set_bytes, "bytes"),
        ("append_tokens(packed 256-token delta) + get_hashes(0)", append_delta, None),
        (LIST_LABEL, set_list, "list"),
        (NAIVE_LIST_LABEL, convert_list, "list"),
        ("baseline: re-hash the whole prefix every step", rehash, "bytes"),
    ):
        results[label] = _grow(fn, source, packed, token_list, prefix_bytes, prefix_list)
    base_total = sum(results["baseline: re-hash the whole prefix every step"])
    rows = []
    for label, times in results.items():
        total = sum(times)
        at_8k, at_128k = _at(times, 8192), _at(times, MAX_TOKENS)
        rows.append(
            [
                label,
                f"{total * 1e3:.1f}",
                f"{at_8k * 1e6:.1f}",
                f"{at_128k * 1e6:.1f}",
                f"{at_128k / at_8k:.1f}x",
                f"{base_total / total:.1f}x",
            ]
        )
    main = results["set_tokens(packed full prefix) + get_hashes(0)"]
    flat = _at(main, MAX_TOKENS) / _at(main, 8192)
    at_32k = MAX_LIST_GOAL_TOKENS // STEP
    list_32k = sum(results[LIST_LABEL][:at_32k])
    naive_32k = sum(results[NAIVE_LIST_LABEL][:at_32k])
    speedup = naive_32k / list_32k
    return [
        f"One session grown {STEP} tokens per step to {MAX_TOKENS} tokens"
        f" ({MAX_TOKENS // STEP} steps, chunk size {CHUNK_SIZE}, blake3), each step timed alone,"
        f" best of {REPEAT} per step; per-step figures are the median of the 8 steps ending at"
        " that length. Prefixes are built outside the timed region.",
        "",
        table(
            [
                "path",
                "total (ms)",
                "step at 8k (us)",
                "step at 128k (us)",
                "128k / 8k",
                "total vs re-hash baseline",
            ],
            rows,
        ),
        "",
        f"- set_tokens(full prefix) step cost grows {flat:.1f}x from 8k to 128k tokens: the"
        " remaining growth is one memcmp of the hashed prefix per step (needed to detect a"
        " changed prompt); hashing itself is per new chunk only",
        f"- set_tokens(list full prefix) to 32k: {list_32k * 1e3:.1f} ms vs the naive whole-list"
        f" conversion {naive_32k * 1e3:.1f} ms = {speedup:.1f}x. The prefix check is exact: the"
        " previous list, kept, is extended by the tail and compared whole (one memcmp of the"
        " two lists' item pointers when they hold the same int objects, else ==;"
        " `kvtier.samelist`)",
        *_lineage_list_lines(list_32k, naive_32k, token_list),
    ]


def _lineage_list_lines(list_32k: float, naive_32k: float, token_list: list[int]) -> list[str]:
    """LMCache 0.5.6's Session on the list pattern to 32k, same steps, or why it was not run."""
    try:
        session_mod, hasher_mod = (importlib.import_module(m) for m in LINEAGE_MODULES)
    except Exception as exc:  # ImportError, or a dependency failing at import
        return [
            f"- LMCache 0.5.6 not measured ({type(exc).__name__}: {exc}); install it beside"
            " kvtier with `pip install --no-deps lmcache==0.5.6 numba llvmlite` to compare"
        ]
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    best: list[float] = []
    for _ in range(REPEAT):
        session = session_mod.Session("bench", hasher_mod.TokenHasher(CHUNK_SIZE, "blake3"))
        times = []
        for end in range(STEP, MAX_LIST_GOAL_TOKENS + 1, STEP):
            prefix = token_list[:end]
            t0 = time.perf_counter()
            session.set_tokens(prefix)
            session.get_hashes(0)
            times.append(time.perf_counter() - t0)
        best = times if not best else [min(a, b) for a, b in zip(best, times, strict=True)]
    lineage_32k = sum(best)
    ratio = lineage_32k / list_32k
    return [
        f"- LMCache 0.5.6's Session, same pattern and steps to 32k (measured in this run; its"
        f" set_tokens stores the list without any check): {lineage_32k * 1e3:.1f} ms, so kvtier"
        f" runs at {ratio:.2f}x its speed ({naive_32k / lineage_32k:.1f}x faster than the naive"
        f" conversion here) — goal >= 1.0x {'met' if ratio >= 1.0 else 'NOT met'}",
    ]


def _grow(
    fn: Callable[[Session, int], None],
    source: str | None,
    packed: bytes,
    token_list: list[int],
    prefix_bytes: dict[int, bytes],
    prefix_list: dict[int, list[int]],
) -> list[float]:
    """Seconds per step of one session grown STEP tokens at a time to MAX_TOKENS, best of 3.

    Only the next step's prefix (of `source`) is built, untimed, so memory stays bounded.
    """
    best: list[float] = []
    for _ in range(REPEAT):
        session = Session("bench", TokenHasher(CHUNK_SIZE))
        times = []
        for end in range(STEP, MAX_TOKENS + 1, STEP):
            prefix_bytes.clear()
            prefix_list.clear()
            if source == "bytes":
                prefix_bytes[end] = packed[: end * 4]
            elif source == "list":
                prefix_list[end] = token_list[:end]
            t0 = time.perf_counter()
            fn(session, end)
            times.append(time.perf_counter() - t0)
        assert session.num_chunks_processed in (0, MAX_TOKENS // CHUNK_SIZE)
        best = times if not best else [min(a, b) for a, b in zip(best, times, strict=True)]
    return best


# -- SessionManager ----------------------------------------------------------------------------


@dataclass
class _LineageSession:
    """The lineage's session: a dataclass with its own lock, a token list and wall-clock times."""

    request_id: str
    hasher: TokenHasher
    token_ids: list[int] = field(default_factory=list)
    chunk_hashes: list[bytes] = field(default_factory=list)
    last_prefix_hash: bytes | None = None
    num_chunks_processed: int = 0
    created_at: float = field(default_factory=time.time)
    lookup_ipc_key: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _LineageManager:
    """A dict under a lock; expiry scans every session under one hold."""

    def __init__(self, hasher: TokenHasher, ttl: float) -> None:
        self.hasher = hasher
        self.ttl = ttl
        self.lock = threading.Lock()
        self.sessions: dict[str, _LineageSession] = {}

    def get_or_create(self, request_id: str) -> _LineageSession:
        with self.lock:
            session = self.sessions.get(request_id)
            if session is None:
                session = _LineageSession(request_id, self.hasher)
                self.sessions[request_id] = session
            return session

    def cleanup_expired(self, now: float) -> int:
        with self.lock:
            expired = [r for r, s in self.sessions.items() if now - s.created_at > self.ttl]
            for request_id in expired:
                del self.sessions[request_id]
        return len(expired)


class _TimingLock:
    """Wraps a lock and records how long each hold lasted."""

    def __init__(self, inner: threading.Lock) -> None:
        self._inner = inner
        self._since = 0.0
        self.holds: list[float] = []

    def __enter__(self) -> None:
        self._inner.acquire()
        self._since = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._inner.release()


class _FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _manager_section() -> list[str]:
    hasher = TokenHasher(CHUNK_SIZE)
    ids = [f"req-{i}" for i in range(NUM_SESSIONS)]

    def kvtier_creates() -> None:
        m = SessionManager(hasher, cleanup_interval=None)
        for rid in ids:
            m.get_or_create(rid)
        assert m.active_count() == NUM_SESSIONS

    def lineage_creates() -> None:
        m = _LineageManager(hasher, 600)
        for rid in ids:
            m.get_or_create(rid)
        assert len(m.sessions) == NUM_SESSIONS

    gc.collect()
    kv_s = best_of(kvtier_creates, repeat=REPEAT)
    gc.collect()
    lineage_s = best_of(lineage_creates, repeat=REPEAT)
    kv_rate, lineage_rate = NUM_SESSIONS / kv_s, NUM_SESSIONS / lineage_s

    # Expiry of NUM_SESSIONS idle sessions on a fake clock, the manager's lock timed per hold.
    # Best of REPEAT runs: on a shared machine a single hold can include a preemption.
    runs: list[tuple[float, float, list[float]]] = []
    for _ in range(REPEAT):
        clock = _FakeClock()
        m = SessionManager(hasher, ttl=600, cleanup_interval=None, clock=clock)
        for rid in ids:
            m.get_or_create(rid)
        timing = _TimingLock(m._lock)
        m._lock = timing  # type: ignore[assignment]
        clock.now += 601
        gc.collect()
        t0 = time.perf_counter()
        expired = m.cleanup_expired()
        elapsed = time.perf_counter() - t0
        assert expired == NUM_SESSIONS and m.active_count() == 0
        runs.append((max(timing.holds), elapsed, timing.holds))
    max_hold, cleanup_s, holds = min(runs)
    worst_hold = max(r[0] for r in runs)
    num_holds, median_hold = len(holds), statistics.median(holds)

    # Sweeps that find nothing due, over NUM_SESSIONS live sessions.
    for rid in ids:
        m.get_or_create(rid)
    idle_sweep_s = best_of(m.cleanup_expired, repeat=REPEAT)

    lineage = _LineageManager(hasher, 600)
    for rid in ids:
        lineage.get_or_create(rid)
    idle_lineage_s = best_of(lambda: lineage.cleanup_expired(time.time()), repeat=REPEAT)
    t0 = time.perf_counter()
    lineage_expired = lineage.cleanup_expired(time.time() + 601)
    lineage_cleanup_s = time.perf_counter() - t0  # one hold of its lock
    assert lineage_expired == NUM_SESSIONS

    create_ratio = kv_rate / LINEAGE_CREATES_PER_S
    rows = [
        [
            f"get_or_create, {NUM_SESSIONS // 1000}k new ids (per s)",
            f"{kv_rate / 1e3:.0f}k",
            f"{lineage_rate / 1e3:.0f}k",
            f"{kv_rate / lineage_rate:.1f}x",
        ],
        [
            f"cleanup_expired, {NUM_SESSIONS // 1000}k expired (ms)",
            f"{cleanup_s * 1e3:.1f}",
            f"{lineage_cleanup_s * 1e3:.1f}",
            f"{lineage_cleanup_s / cleanup_s:.1f}x",
        ],
        [
            "longest hold of the manager's lock in that cleanup (ms)",
            f"{max_hold * 1e3:.3f}",
            f"{lineage_cleanup_s * 1e3:.1f}",
            f"{lineage_cleanup_s / max_hold:.0f}x",
        ],
        [
            f"cleanup_expired, none due among {NUM_SESSIONS // 1000}k (us)",
            f"{idle_sweep_s * 1e6:.1f}",
            f"{idle_lineage_s * 1e6:.0f}",
            f"{idle_lineage_s / idle_sweep_s:.0f}x",
        ],
    ]
    return [
        f"SessionManager with `cleanup_interval=None`, best of {REPEAT}. Baseline: a naive"
        " manager written here after the lineage (a dict under a lock; dataclass sessions"
        " holding a threading.Lock, a token list and `created_at` from time.time(); expiry"
        " scans every session under one hold of the lock). Lock holds are measured by wrapping"
        " the manager's `_lock` in a timing lock.",
        "",
        table(["measure", "kvtier", "naive baseline", "kvtier vs baseline"], rows),
        "",
        f"- goal get_or_create >= {CREATE_GOAL:.0f}x the lineage's"
        f" {LINEAGE_CREATES_PER_S / 1e3:.0f}k/s: {kv_rate / 1e3:.0f}k/s = {create_ratio:.1f}x,"
        f" {'met' if create_ratio >= CREATE_GOAL else 'not met'}"
        f" ({kv_rate / lineage_rate:.1f}x the naive baseline measured here)",
        f"- goal longest lock hold during cleanup of {NUM_SESSIONS // 1000}k <="
        f" {HOLD_GOAL_S * 1e3:.0f} ms: {max_hold * 1e3:.3f} ms (best of {REPEAT} runs; worst run"
        f" {worst_hold * 1e3:.3f} ms; median hold {median_hold * 1e3:.3f} ms over {num_holds}"
        f" holds), {'met' if max_hold <= HOLD_GOAL_S else 'not met'}",
    ]


def run() -> str:
    """Measure session growth and manager throughput; return the markdown section."""
    lines = ["## Sessions", "", "### Decode-like growth", ""]
    lines += _growth_section()
    lines += ["", "### SessionManager", ""]
    lines += _manager_section()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
