"""`kvtier replay` against real servers, its figures checked against simulations written here.

The first 2,000 requests of Mooncake's conversation trace are replayed by the command through
real `kvtier serve` processes (the adaptive policy, and LRU). Every hit count it reports is
recomputed in this file, independently of the server's code and of the command's own
simulations: the server as a model (its L1 order, the admission policy's duel, declined chunks at
the cold end, pins), Belady's MIN with a sorted list and per-block occurrence lists, and the
infinite cache.
"""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.hashing import TokenHasher

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared/data/mooncake-traces/conversation_trace.jsonl"
REQUESTS = 2000
CAPACITY = 1000  # chunks: 2.6% of the 38,788 distinct blocks of the first 2,000 requests
BLOCK = 512


def _trace() -> list[dict[str, Any]]:
    if not TRACE.exists():
        pytest.fail(
            f"the Mooncake conversation trace is missing at {TRACE}: it is Mooncake's FAST'25 "
            "trace (github.com/kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0), kept in "
            "kvtier's shared data folder ../shared/data/mooncake-traces/ beside the repository",
            pytrace=False,
        )
    with TRACE.open() as f:
        return [json.loads(line) for _, line in zip(range(REQUESTS), f, strict=False)]


def _names(chains: list[list[int]]) -> list[list[bytes]]:
    """The chunk hashes a default server (blake3, no seed, 512-token chunks) gives each prompt,
    hashed here from whole prompts: a block is [id low 32 bits, id high 32 bits, 0, 1, ...]."""
    hasher = TokenHasher(BLOCK)
    tail = np.arange(BLOCK - 2, dtype=np.uint32)
    out = []
    for chain in chains:
        blocks = [np.concatenate([np.array([h % 2**32, h >> 32], np.uint32), tail]) for h in chain]
        tokens = np.concatenate(blocks) if blocks else np.empty(0, np.uint32)
        out.append(hasher.compute_chunk_hashes(tokens))
    return out


# ------------------------------------------------------------------ the server, as a model


class _Seen:
    """Recently looked-up names: whether two different requests saw each, and who saw it last."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.names: OrderedDict[bytes, list[Any]] = OrderedDict()

    def look(self, chain: list[bytes], who: object) -> None:
        for name in chain:
            entry = self.names.pop(name, None)
            self.names[name] = [False, who] if entry is None else [entry[0] or entry[1] != who, who]
        while len(self.names) > self.size:
            self.names.popitem(last=False)

    def twice(self, name: bytes) -> bool:
        return name in self.names and self.names[name][0]


class _Mirror:
    """A names-only cache of the sampled chains: all-storing, or behind a `_Seen` doorkeeper."""

    def __init__(self, gated: bool) -> None:
        self.gated = gated
        self.size = 1
        self.held: OrderedDict[bytes, None] = OrderedDict()
        self.seen = _Seen(4)

    def shrink(self, size: int) -> None:
        self.size = max(1, size)
        self.seen.size = 4 * self.size
        while len(self.held) > self.size:
            self.held.popitem(last=False)

    def play(self, chain: list[bytes]) -> int:
        n = 0
        while n < len(chain) and chain[n] in self.held:
            n += 1
        self.seen.look(chain, object())
        for name in chain:
            if name in self.held or (self.gated and not self.seen.twice(name)):
                continue
            self.held[name] = None
            if len(self.held) > self.size:
                self.held.popitem(last=False)
        for name in chain[::-1]:
            if name in self.held:
                self.held.move_to_end(name)
        return n


class _Policy:
    """The cache policies as documented: lru admits everything; adaptive admits everything while
    the all-storing mirror of one chain in 8 scores at least the doorkeeper's, else a name two
    requests looked up (within 4x the capacity)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen = _Seen(4 << 16)
        self.all, self.gated = _Mirror(False), _Mirror(True)
        self.score_all = self.score_gated = 0.0

    def sized(self, chunks: int) -> None:
        self.seen.size = 4 * chunks
        self.all.shrink(chunks // 8)
        self.gated.shrink(chunks // 8)

    def looked_up(self, chain: list[bytes], who: str) -> None:
        if self.name == "lru" or (chain and self.seen.names.get(chain[-1], [0, None])[1] == who):
            return
        self.seen.look(chain, who)
        if chain and int.from_bytes(chain[min(1, len(chain) - 1)][:8], "little") % 8 == 0:
            self.score_all = 0.999 * self.score_all + self.all.play(chain)
            self.score_gated = 0.999 * self.score_gated + self.gated.play(chain)

    def keeps(self, name: bytes) -> bool:
        return self.name == "lru" or self.score_all >= self.score_gated or self.seen.twice(name)


def server_model(names: list[list[bytes]], capacity: int, policy: str) -> list[int]:
    """Hit blocks per request of a kvtier server with an L1 of `capacity` chunks, replaying
    lookup, store of the whole prompt and session end per request."""
    rule = _Policy(policy)
    kept: dict[bytes, bool] = {}  # chunks in L1 -> admitted by the policy
    cold_first: OrderedDict[bytes, None] = OrderedDict()  # evictable chunks, evicted first first
    sized = False
    hits = []

    def settle(name: bytes) -> None:  # back into the eviction order: admitted hot, else cold
        cold_first[name] = None
        if not kept[name]:
            cold_first.move_to_end(name, last=False)

    for index, chain in enumerate(names):
        rule.looked_up(chain, str(index))
        for name in chain:  # a declined chunk a lookup now finds worth keeping is admitted
            if name in kept and not kept[name] and rule.keeps(name):
                kept[name] = True
        hit = 0
        while hit < len(chain) and chain[hit] in kept:
            hit += 1
        hits.append(hit)
        for name in chain[:hit]:  # pinned for the request
            del cold_first[name]
        staged: list[tuple[bytes, bool]] = []
        failed = False
        for name in chain:
            if name in kept:
                continue
            if len(kept) + len(staged) >= capacity:
                if not cold_first:
                    failed = True
                    break
                del kept[cold_first.popitem(last=False)[0]]
            if not sized:
                rule.sized(capacity)
                sized = True
            staged.append((name, rule.keeps(name)))
        declined = []
        if staged and not failed:
            for name, admitted in staged:
                kept[name] = admitted
                settle(name)
                if not admitted:
                    declined.append(name)
            for name in declined:  # held for the request that stored them
                del cold_first[name]
            for name in chain[::-1]:
                if name in cold_first and kept[name]:
                    cold_first.move_to_end(name)
        for pinned in (chain[:hit], declined):  # the session ends: its two pins released
            # declined chunks head first to the cold end (the tail ends coldest), then the
            # admitted ones tail first (the head ends most recent)
            for name in [n for n in pinned if not kept[n]] + [n for n in pinned[::-1] if kept[n]]:
                settle(name)
    return hits


# ------------------------------------------------------------------ Belady, another way


def belady_hits(chains: list[list[int]], capacity: int) -> list[int]:
    """Belady's MIN, prefix hits: cached blocks kept in a sorted list by (next use, depth); a
    block not cached is stored unless it is never used again or every cached block is used
    again before it (by next use, then depth), else the last of the list makes room."""
    where: dict[int, list[int]] = {}
    for index, chain in enumerate(chains):
        for block in chain:
            where.setdefault(block, []).append(index)
    never = float("inf")

    def after(block: int, index: int) -> float:
        uses = where[block]
        k = bisect.bisect_right(uses, index)
        return uses[k] if k < len(uses) else never

    ranked: list[tuple[float, int, int]] = []
    rank_of: dict[int, tuple[float, int, int]] = {}
    hits = []
    for index, chain in enumerate(chains):
        n = 0
        for block in chain:
            if block not in rank_of:
                break
            n += 1
        hits.append(n)
        for depth, block in enumerate(chain):
            entry = (after(block, index), depth, block)
            old = rank_of.pop(block, None)
            if old is not None:
                del ranked[bisect.bisect_left(ranked, old)]
            elif entry[0] == never:
                continue
            elif len(ranked) >= capacity:
                if ranked[-1][:2] <= entry[:2]:
                    continue
                del rank_of[ranked.pop()[2]]
            bisect.insort(ranked, entry)
            rank_of[block] = entry
    return hits


# ------------------------------------------------------------------ the tests


def _rates(trace: list[dict[str, Any]], hits: list[int]) -> tuple[float, float]:
    blocks = sum(len(r["hash_ids"]) for r in trace)
    tokens = sum(r["input_length"] for r in trace)
    hit_tokens = sum(min(h * BLOCK, r["input_length"]) for r, h in zip(trace, hits, strict=True))
    return sum(hits) / blocks, hit_tokens / tokens


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_replay_matches_the_servers_model_and_an_independent_belady(tmp_path: Path) -> None:
    trace = _trace()
    out = tmp_path / "replay.json"
    done = _kvtier(
        "replay", str(TRACE), "--limit", str(REQUESTS), "--l1-chunks", str(CAPACITY),
        "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(out.read_text())
    assert report["requests"] == REQUESTS and report["capacity_chunks"] == CAPACITY
    for role in ("policy", "lru", "belady", "infinite"):
        assert 0.0 <= report[role]["block_hit_rate"] <= 1.0
        assert 0.0 <= report[role]["token_hit_rate"] <= 1.0
    assert report["policy"]["name"] == "adaptive"
    assert report["policy"]["source"] == report["lru"]["source"] == "server"

    chains = [r["hash_ids"] for r in trace]
    names = _names(chains)
    expected = {
        "policy": server_model(names, CAPACITY, "adaptive"),
        "lru": server_model(names, CAPACITY, "lru"),
        "belady": belady_hits(chains, CAPACITY),
    }
    seen: set[int] = set()
    expected["infinite"] = []
    for chain in chains:
        n = next((i for i, block in enumerate(chain) if block not in seen), len(chain))
        expected["infinite"].append(n)
        seen.update(chain)
    for role, hits in expected.items():
        assert report[role]["hit_blocks"] == sum(hits), role
        block_rate, token_rate = _rates(trace, hits)
        assert report[role]["block_hit_rate"] == pytest.approx(block_rate, abs=1e-12), role
        assert report[role]["token_hit_rate"] == pytest.approx(token_rate, abs=1e-12), role
    # the model is not trivially equal to LRU here: the policy declined chunks under pressure
    assert sum(expected["policy"]) != sum(expected["lru"])
    assert report["policy"]["l1_declined_evictions"] > 0 == report["lru"]["l1_declined_evictions"]
    assert report["policy"]["store_errors"] == report["lru"]["store_errors"] == 0
    assert "adaptive (the policy)" in done.stdout and "belady" in done.stdout


def test_replay_refuses_an_unknown_policy_and_a_missing_trace(tmp_path: Path) -> None:
    bogus = _kvtier("replay", str(tmp_path / "none.jsonl"), "--policy", "bogus")
    assert bogus.returncode == 2
    assert "unknown cache policy 'bogus'" in bogus.stderr and "adaptive" in bogus.stderr
    missing = _kvtier("replay", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "cannot read the trace" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": "x"}\n')
    refused = _kvtier("replay", str(bad))
    assert refused.returncode == 2 and f"{bad}:1" in refused.stderr
