"""Token hashing throughput: naming a 128k-token prompt's chunks, against the lineage's way.

The baseline is what kvtier's predecessors did: per chunk, `struct.pack` a slice of a Python
list big-endian and blake3 the parent plus those bytes. kvtier hashes memoryview slices of one
packed '<u4' buffer instead.
"""

from __future__ import annotations

import struct
from functools import partial

import numpy as np
from blake3 import blake3

from benchmarks.common import best_of, table
from kvtier.hashing import TokenHasher

NUM_TOKENS = 131_072
CHUNK_SIZE = 256
REPEAT = 15
GOALS = {"blake3": 2.5, "xxh3_128": 8.0}


def _baseline(token_list: list[int], none_hash: bytes) -> list[bytes]:
    """The lineage's chunk naming: struct.pack per chunk from a Python list."""
    fmt = f">{CHUNK_SIZE}I"
    parent = none_hash
    out = []
    for start in range(0, len(token_list) - CHUNK_SIZE + 1, CHUNK_SIZE):
        chunk = struct.pack(fmt, *token_list[start : start + CHUNK_SIZE])
        parent = blake3(parent + chunk).digest()
        out.append(parent)
    return out


def run() -> str:
    """Measure every algorithm on the same packed int32 prompt; return the markdown section."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 152_000, NUM_TOKENS, dtype=np.int64)
    packed = ids.astype("<i4").tobytes()  # how an engine hands tokens over
    token_list = ids.tolist()
    num_chunks = NUM_TOKENS // CHUNK_SIZE

    base_hasher = TokenHasher(CHUNK_SIZE)
    assert len(_baseline(token_list, base_hasher.none_hash)) == num_chunks
    base_s = best_of(lambda: _baseline(token_list, base_hasher.none_hash), repeat=REPEAT)

    rows: list[list[object]] = [["baseline (struct.pack + blake3)", *_cells(base_s, base_s)]]
    seconds: dict[str, float] = {}
    for name, seed in (
        ("blake3", None),
        ("xxh3_128", None),
        ("sha256", None),
        ("sha256_cbor", "0"),
    ):
        hasher = TokenHasher(CHUNK_SIZE, name, seed=seed)
        assert len(hasher.compute_chunk_hashes(packed)) == num_chunks
        repeat = 3 if name == "sha256_cbor" else REPEAT
        seconds[name] = best_of(partial(hasher.compute_chunk_hashes, packed), repeat=repeat)
        label = f"kvtier {name}" + (" (vLLM-compatible, context)" if name == "sha256_cbor" else "")
        rows.append([label, *_cells(seconds[name], base_s)])

    raw_s = best_of(lambda: blake3(packed).digest(), repeat=REPEAT)
    rows.append(["raw blake3(all bytes), one call", *_cells(raw_s, base_s)])
    list_s = best_of(lambda: base_hasher.compute_chunk_hashes(token_list), repeat=5)
    rows.append(["kvtier blake3 from a Python list (context)", *_cells(list_s, base_s)])

    lines = [
        "## Token hashing",
        "",
        f"Naming the {num_chunks} chunks of a {NUM_TOKENS}-token prompt given as packed int32"
        f" bytes (chunk size {CHUNK_SIZE}), best of {REPEAT}. Baseline: blake3 over"
        f" `struct.pack('>{CHUNK_SIZE}I', *chunk)` per chunk from a Python list.",
        "",
        table(["path", "time (ms)", "tokens/s (M)", "vs baseline"], rows),
        "",
        f"- chunked blake3 reaches {raw_s / seconds['blake3']:.0%} of raw single-call blake3"
        f" bandwidth over the same {len(packed) // 1024} KiB",
    ]
    for name, goal in GOALS.items():
        ratio = base_s / seconds[name]
        verdict = "met" if ratio >= goal else "not met"
        lines.append(f"- goal {name} >= {goal}x baseline: {ratio:.1f}x, {verdict}")
    return "\n".join(lines) + "\n"


def _cells(seconds: float, base_seconds: float) -> list[str]:
    return [
        f"{seconds * 1e3:.3f}",
        f"{NUM_TOKENS / seconds / 1e6:.1f}",
        f"{base_seconds / seconds:.2f}x",
    ]


if __name__ == "__main__":
    print(run())
