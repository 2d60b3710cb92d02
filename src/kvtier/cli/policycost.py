"""The time a cache policy itself takes on a trace: its own work, measured in this process.

The server asks its policy two things (`storage/admission.py`): each lookup's chain is observed
(`observe`), and each chunk a store adds is decided on (`admits`). Here the policy, fresh and
sized to the L1, is asked exactly that for every request of the trace, under the names the
server gives the trace's blocks, and timed: observing per lookup, and deciding on every chunk of
the prompt per store (more than the server asks, which decides only on the chunks it did not
hold: an upper bound).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.cli.trace import BLOCK_TOKENS, TraceRequest, block_tokens
from kvtier.hashing import TokenHasher
from kvtier.keys import ChunkKey
from kvtier.storage.admission import make_policy

__all__ = ["chain_names", "policy_time"]


def chain_names(
    requests: Sequence[TraceRequest], model: str = "replay", hasher: TokenHasher | None = None
) -> list[list[ChunkKey]]:
    """The names a server with 512-token chunks (blake3, no seed: the defaults) gives each
    request's chunks, as `trace.prompt_tokens` spells them; each block hashed once."""
    hasher = hasher or TokenHasher(BLOCK_TOKENS)
    named: dict[int, ChunkKey] = {}
    out = []
    for request in requests:
        keys: list[ChunkKey] = []
        parent: bytes | None = None
        for block in request.hash_ids:
            key = named.get(block)
            if key is None:
                digest = hasher.hash_tokens(block_tokens(block), prefix_hash=parent)
                key = named[block] = ChunkKey(model, "", 1, digest)
            keys.append(key)
            parent = key.chunk_hash
        out.append(keys)
    return out


def policy_time(
    requests: Sequence[TraceRequest], policy: str, capacity_chunks: int
) -> dict[str, float]:
    """Microseconds the policy takes per lookup (observing its chain) and per store (deciding
    on each of its chunks), averaged over the requests."""
    names = chain_names(requests)
    chosen = make_policy(policy)
    chosen.set_capacity(capacity_chunks)
    observe_s = decide_s = 0.0
    clock = time.perf_counter
    for index, keys in enumerate(names):
        t0 = clock()
        chosen.observe(keys, str(index))
        t1 = clock()
        for key in keys:
            chosen.admits(key)
        decide_s += clock() - t1
        observe_s += t1 - t0
    n = max(1, len(names))
    return {"observe_us_per_lookup": 1e6 * observe_s / n, "decide_us_per_store": 1e6 * decide_s / n}
