"""KV compression per tier (`codec=none|zstd|fp8`), in one run: effective put and get GB/s
(decoded bytes per second) through the Redis and Mooncake tiers with each codec against `none`;
the compression of real KV from the tiny models of each family (and fp8's error on it against its
bound); a 32k-token prompt loaded from Redis with each codec against recomputing it.

The KV is real: the tiny random-weight models the engine tests use (testkit.vllm_harness), run
by transformers on a prompt, their caches' K and V (and recurrent states where transformers
keeps them) taken as bytes.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import lz4.block
import ml_dtypes
import numpy as np
import zstandard
from testkit.mooncake_pool import held_pool, pooled_tier

from benchmarks.common import Buffers, drop_redis_keys, on_threads, start_server, stop_server, table
from kvtier.client import Client
from kvtier.keys import ObjectKey
from kvtier.storage.tiers import L2Tier, codecs, fp8, open_tier

CODECS = ("none", "zstd", "fp8")
FAMILIES = ("llama", "gemma3", "gpt-oss", "deepseek-v2", "qwen3-next", "nemotron-h")
CLIENTS = 2  # threads, each with its own batches
BATCH = 8  # chunks per put_many / get_many_into
PER_CLIENT = 16  # chunks each thread moves per run
REPEAT = 3
LOOKUP_CHUNK = 256  # tokens per chunk of the 32k-token prompt
LOOKUP_TOKENS = 32768
STATE_GROUPS = (
    ("attention K, V", ("keys", "values")),
    ("recurrent + conv states", ("recurrent_states", "conv_states")),
)


# -- real KV -------------------------------------------------------------------------------------


def _states(cache: Any) -> dict[str, list[Any]]:
    """The tensors of a transformers cache by kind (keys, values, recurrent/conv states)."""
    import torch

    found: dict[str, list[Any]] = {}
    kinds = ("keys", "values", "recurrent_states", "conv_states", "ssm_states", "key_cache",
             "value_cache")  # fmt: skip
    for layer in getattr(cache, "layers", None) or [cache]:
        for kind in kinds:
            value = getattr(layer, kind, None)
            if isinstance(value, dict):
                value = list(value.values())
            for t in value if isinstance(value, list | tuple) else [value]:
                if isinstance(t, torch.Tensor) and t.numel():
                    name = {"key_cache": "keys", "value_cache": "values"}.get(kind, kind)
                    found.setdefault(name, []).append(t.detach().contiguous())
    return found


def real_kv(folder: Path, tokens: int = 512) -> dict[tuple[str, str, str], np.ndarray]:
    """{(family, dtype, kind): values} from each tiny model's cache after a prompt."""
    import torch
    from testkit.tiny_models import write_tiny_llama, write_tiny_model
    from transformers import AutoModelForCausalLM

    out: dict[tuple[str, str, str], np.ndarray] = {}
    prompt = torch.tensor([[(i * 37) % 500 + 3 for i in range(tokens)]])
    for family in FAMILIES:
        path = folder / family
        if family == "llama":
            write_tiny_llama(path, layers=4, weights=True)
        else:
            write_tiny_model(path, family)
        for dtype, np_dtype in ((torch.bfloat16, ml_dtypes.bfloat16), (torch.float32, np.float32)):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            with torch.no_grad():
                cache = model(prompt, use_cache=True).past_key_values
            for kind, tensors in _states(cache).items():
                flat = np.concatenate([t.float().reshape(-1).numpy() for t in tensors])
                out[(family, str(dtype).removeprefix("torch."), kind)] = flat.astype(np_dtype)
    return out


def _fp8_round_trip(t: Any) -> Any:
    """`t` through fp8 and back (same dtype and shape)."""
    import torch

    dtype = str(t.dtype).removeprefix("torch.")
    data = t.detach().contiguous().cpu()
    raw = memoryview(data.view(torch.uint8).numpy().reshape(-1))
    stored = fp8.encode(raw, dtype)
    assert stored is not None, f"fp8 refused {dtype}"
    out = bytearray(raw.nbytes)
    fp8.decode(memoryview(stored), memoryview(out), dtype)
    return torch.frombuffer(out, dtype=torch.uint8).view(t.dtype).reshape(t.shape)


def _perturbed(cache: Any, kinds: tuple[str, ...]) -> Any:
    """A copy of `cache` whose tensors of `kinds` went through fp8."""
    import copy

    import torch

    cache = copy.deepcopy(cache)
    for layer in cache.layers:
        for kind in kinds:
            value = getattr(layer, kind, None)
            if isinstance(value, dict):
                for k, t in value.items():
                    if isinstance(t, torch.Tensor) and t.numel():
                        value[k] = _fp8_round_trip(t)
            elif isinstance(value, torch.Tensor) and value.numel():
                setattr(layer, kind, _fp8_round_trip(value))
    return cache


def fp8_effect(folder: Path, tokens: int = 512, more: int = 32) -> list[list[object]]:
    """Per family (float32 weights and cache): a prompt's cache, then `more` tokens run on it
    as is and with its attention KV, or its recurrent (and conv) states, through fp8: the
    largest |logprob difference| of the reference's top token, and how often the top token
    stays the same."""
    import torch
    from transformers import AutoModelForCausalLM

    rows: list[list[object]] = []
    prompt = torch.tensor([[(i * 37) % 500 + 3 for i in range(tokens)]])
    follow = torch.tensor([[(i * 11) % 500 + 3 for i in range(more)]])
    for family in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(folder / family, dtype=torch.float32)
        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
            ref = model(follow, past_key_values=_perturbed(cache, ())).logits[0].log_softmax(-1)
            top = ref.argmax(-1)
            kinds = _states(cache)
            for label, group in STATE_GROUPS:
                if not any(k in kinds for k in group):
                    continue
                got = model(follow, past_key_values=_perturbed(cache, group)).logits[0]
                got = got.log_softmax(-1)
                diff = (got.gather(-1, top[:, None]) - ref.gather(-1, top[:, None])).abs().max()
                same = float((got.argmax(-1) == top).float().mean())
                rows.append([family, label, f"{float(diff):.1e}", f"{same:.2f}"])
    return rows


def _ratios(kv: dict[tuple[str, str, str], np.ndarray]) -> list[list[object]]:
    rows: list[list[object]] = []
    for (family, dtype, kind), values in kv.items():
        data = values.view(np.uint8).data
        plain = len(zstandard.ZstdCompressor(level=codecs.ZSTD_LEVEL).compress(data))
        zstd = len(codecs.CODECS["zstd"].encode(data, dtype) or b"")
        fast = len(lz4.block.compress(data, store_size=False))
        stored = fp8.encode(data, dtype) or b""
        out = bytearray(values.nbytes)
        fp8.decode(memoryview(stored), memoryview(out), dtype)
        decoded = np.frombuffer(out, values.dtype).astype(np.float64)
        error = np.abs(decoded - values.astype(np.float64))
        worst = float((error / fp8.error_bound(values, dtype)).max())
        scale = float(np.abs(values.astype(np.float64)).max()) or 1.0
        rows.append([
            family, dtype, kind, f"{values.nbytes / 1024:.0f}",
            f"{values.nbytes / zstd:.3f}", f"{values.nbytes / plain:.3f}",
            f"{values.nbytes / fast:.3f}", f"{values.nbytes / len(stored):.2f}",
            f"{float(error.max()) / scale:.1e}", f"{worst:.2f}",
        ])  # fmt: skip
    return rows


def _chunk(kv: dict[tuple[str, str, str], np.ndarray], nbytes: int) -> np.ndarray:
    """`nbytes` of bfloat16 K and V of the tiny Llama (repeated where the prompt's are fewer)."""
    parts = [kv[("llama", "bfloat16", kind)] for kind in ("keys", "values")]
    values = np.concatenate(parts)
    reps = -(-nbytes // values.nbytes)
    return np.tile(values, reps)[: nbytes // 2].copy()


# -- tier throughput -----------------------------------------------------------------------------


def _one_run(tier: L2Tier, buf: Buffers, layout: str, run: int) -> tuple[float, float]:
    """(put, get) effective GB/s: decoded bytes moved per second by CLIENTS threads."""
    keys = [
        [ObjectKey("bench", "", 1, 0, (run << 64 | c << 32 | i).to_bytes(32, "big"))
         for i in range(PER_CLIENT)]
        for c in range(CLIENTS)
    ]  # fmt: skip

    def put(c: int) -> None:
        for i in range(0, PER_CLIENT, BATCH):
            items = [(k, buf.chunk, layout) for k in keys[c][i : i + BATCH]]
            assert tier.put_many(items) == len(items), f"{tier.name} refused a put"

    def get(c: int) -> None:
        for i in range(0, PER_CLIENT, BATCH):
            items = [(k, buf.outs[c][j], layout) for j, k in enumerate(keys[c][i : i + BATCH])]
            assert all(tier.get_many_into(items)), f"{tier.name} missed a chunk it holds"

    volume = CLIENTS * PER_CLIENT * buf.size
    try:
        put_s = on_threads(put, CLIENTS)
        get_s = on_threads(get, CLIENTS)
    finally:
        tier.clear()
    return volume / put_s / 1e9, volume / get_s / 1e9


def _throughput(
    tiers: dict[tuple[str, str], L2Tier], buf: Buffers, layout: str
) -> dict[tuple[str, str], dict[str, list[float]]]:
    rates: dict[tuple[str, str], dict[str, list[float]]] = {
        case: {"put": [], "get": []} for case in tiers
    }
    for tier in tiers.values():  # one untimed pass each: first writes fault pages in
        _one_run(tier, buf, layout, 99)
    for run in range(REPEAT):  # every case once per round, so load changes hit all alike
        for case, tier in tiers.items():
            put, get = _one_run(tier, buf, layout, run)
            rates[case]["put"].append(put)
            rates[case]["get"].append(get)
    return rates


# -- a 32k-token prompt: load from Redis with each codec, against recomputing it ----------------


def _lookup(tier_url: str, kv: np.ndarray, shape: tuple[int, ...]) -> float:
    """Seconds a fresh server (empty L1) takes to answer a lookup of the prompt by loading its
    chunks from the tier another server stored them in."""
    tokens = np.arange(LOOKUP_TOKENS, dtype="<u4").tobytes()
    args = ("--l1-size", "256MiB", "--chunk-size", str(LOOKUP_CHUNK), "--l2", tier_url)
    proc, address = start_server(*args)
    try:
        with Client(address) as c:
            c.register(model="l2", chunk_shape=shape, dtype="bfloat16")
            c.store("w", tokens, kv, model="l2")
    finally:
        stop_server(proc)  # flushes the write-through queue
    proc, address = start_server(*args)
    try:
        with Client(address) as c:
            c.register(model="l2", chunk_shape=shape, dtype="bfloat16")
            t0 = time.perf_counter()
            hit = c.lookup("from-l2", tokens, model="l2")
            seconds = time.perf_counter() - t0
            assert hit == LOOKUP_TOKENS, f"only {hit} tokens came back from {tier_url}"
    finally:
        stop_server(proc)
    return seconds


def _recompute_s(folder: Path) -> tuple[float, int]:
    """Seconds the tiny Llama (transformers, this CPU) takes to prefill 4096 tokens, and 4096."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder / "llama", dtype=torch.bfloat16)
    prompt = torch.tensor([[(i * 37) % 500 + 3 for i in range(4096)]])
    best = float("inf")
    with torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            model(prompt, use_cache=True)
            best = min(best, time.perf_counter() - t0)
    return best, 4096


def run() -> str:
    load_before = os.getloadavg()
    folder = Path(tempfile.mkdtemp(prefix="kvtier-bench-codecs-"))
    kv = real_kv(folder)
    ratio_rows = _ratios(kv)
    effect_rows = fp8_effect(folder)
    chunk = _chunk(kv, 4 << 20)
    layout = f"bfloat16[{chunk.size}]"
    buf = Buffers(chunk.view(np.uint8).tobytes(), CLIENTS, BATCH)
    prefix = f"bench-codecs-{uuid.uuid4().hex[:8]}"
    tiers: dict[tuple[str, str], L2Tier] = {}
    try:
        with held_pool() as master:
            for codec in CODECS:
                tiers[("Mooncake (TCP)", codec)] = pooled_tier(
                    master, buf.view, prefix=f"{prefix}-{codec}", timeout="10", codec=codec
                )
                url = f"redis://127.0.0.1:6379/0?prefix={prefix}-{codec}&timeout=10&codec={codec}"
                tiers[("Redis", codec)] = open_tier(url)
            try:
                rates = _throughput(tiers, buf, layout)
                figures = {case: tier.stats().codec for case, tier in tiers.items()}
            finally:
                for tier in tiers.values():
                    tier.close()
            lookup_shape = (4, 2, LOOKUP_CHUNK, 2, 64)  # the tiny Llama's: 1 MiB per chunk (bf16)
            n = LOOKUP_TOKENS // LOOKUP_CHUNK
            per_chunk = int(np.prod(lookup_shape))
            prompt_kv = np.resize(chunk, n * per_chunk).reshape(n, *lookup_shape)
            lookups = {codec: float("inf") for codec in CODECS}
            for _ in range(2):
                for codec in CODECS:
                    url = f"redis://127.0.0.1:6379/0?prefix={prefix}-l{codec}&codec={codec}"
                    lookups[codec] = min(lookups[codec], _lookup(url, prompt_kv, lookup_shape))
            prefill_s, prefill_tokens = _recompute_s(folder)
    finally:
        drop_redis_keys(prefix)
    load_after = os.getloadavg()
    best = {case: {verb: max(r[verb]) for verb in r} for case, r in rates.items()}
    rows: list[list[object]] = []
    goal = {}
    for tier_name in ("Redis", "Mooncake (TCP)"):
        base = best[(tier_name, "none")]
        for codec in CODECS:
            b = best[(tier_name, codec)]
            c = figures[(tier_name, codec)]
            put_x, get_x = b["put"] / base["put"], b["get"] / base["get"]
            if codec == "fp8":
                goal[tier_name] = (put_x, get_x)
            rows.append([
                tier_name, codec, f"{c.ratio:.2f}", f"{b['put']:.2f}", f"{b['get']:.2f}",
                f"{put_x:.2f}", f"{get_x:.2f}",
                f"{c.raw_bytes / c.encode_s / 1e9:.2f}" if c.encode_s else "",
                f"{c.decoded_bytes / c.decode_s / 1e9:.2f}" if c.decode_s else "",
                ", ".join(f"{x:.2f}" for x in rates[(tier_name, codec)]["get"]),
            ])  # fmt: skip
    recompute_32k = prefill_s / prefill_tokens * LOOKUP_TOKENS
    lookup_rows = [
        [codec, f"{lookups[codec] * 1e3:.0f}", f"{lookups['none'] / lookups[codec]:.2f}",
         f"{recompute_32k / lookups[codec]:.1f}"]
        for codec in CODECS
    ]  # fmt: skip
    met = all(min(x) >= 1.8 for x in goal.values())
    return "\n".join(
        [
            "## KV compression per tier",
            "",
            f"Put and get of 4 MiB chunks of real bfloat16 KV (the tiny Llama's K and V after a "
            f"512-token prompt, as one chunk) through the Redis tier (127.0.0.1:6379) and the "
            f"Mooncake tier (a `mooncake_master` and a `kvtier serve` holding a 1 GiB segment, "
            f"loopback TCP), each with `codec=none`, `zstd` and `fp8`: {CLIENTS} client threads, "
            f"{CLIENTS * PER_CLIENT} chunks per run, batches of {BATCH}, best of {REPEAT} rounds "
            "(each round runs every case once in turn, after one untimed pass each). GB/s are "
            "effective: decoded bytes (what L1 holds) per second, encoding and decoding "
            "included. Codec GB/s: the codec alone, in the same runs (decoded bytes per second "
            f"of codec time). Load average before {load_before[0]:.1f}, after "
            f"{load_after[0]:.1f}, on {len(os.sched_getaffinity(0))} cores.",
            "",
            table(
                [
                    "tier",
                    "codec",
                    "ratio",
                    "put GB/s",
                    "get GB/s",
                    "put / none",
                    "get / none",
                    "encode GB/s",
                    "decode GB/s",
                    "get GB/s, each run",
                ],
                rows,
            ),
            "",
            f"- goal fp8 >= 1.8x on put and get through both tiers: "
            f"{'met' if met else 'not met'} (Redis {goal['Redis'][0]:.2f}x / "
            f"{goal['Redis'][1]:.2f}x, Mooncake {goal['Mooncake (TCP)'][0]:.2f}x / "
            f"{goal['Mooncake (TCP)'][1]:.2f}x). On this machine the tiers run over loopback "
            "on the same two cores as the codec, so a byte saved in transfer is cheap and a "
            "byte encoded or decoded in numpy is not: a codec pays where its decode GB/s is "
            "well above what the tier moves (a network link, a busy pool).",
            "",
            "Compression of real KV from the tiny model of each family (transformers, a "
            "512-token prompt; K and V of all layers, and the recurrent states transformers "
            "keeps for the linear-attention and Mamba layers), bytes in per byte stored: "
            "`zstd` as kvtier runs it (byte planes, level 1), zstd on the bytes as they are, "
            "lz4 (block), and fp8; fp8's largest error relative to the largest value, and "
            "relative to its stated bound (at most 1.00):",
            "",
            table(
                [
                    "family",
                    "dtype",
                    "state",
                    "KiB",
                    "zstd",
                    "zstd (no planes)",
                    "lz4",
                    "fp8",
                    "fp8 max error / max |value|",
                    "fp8 max error / bound",
                ],
                ratio_rows,
            ),
            "",
            "lz4 stores float KV at about 1.0 (it has no entropy coder: the low mantissa bytes "
            "never repeat), so kvtier offers zstd only.",
            "",
            "What fp8 does to the next tokens (transformers, float32, each tiny model): a "
            "512-token prompt's cache, then 32 more tokens run on it as is and with one kind of "
            "state through fp8 (the rest exact). Largest |logprob difference| of the "
            "reference's top token over the 32 positions, and the share of positions whose top "
            "token stayed the same. These random-weight models have nearly flat logits (a top "
            "token often leads the next by less than 0.1), so a flip here is easier than in a "
            "trained model:",
            "",
            table(["family", "through fp8", "max |logprob diff|", "top token kept"], effect_rows),
            "",
            f"A 32k-token prompt (128 chunks of {LOOKUP_CHUNK} tokens, the tiny Llama's bfloat16 "
            "KV geometry: 1 MiB per chunk) stored by one server and looked up on a fresh one "
            "(empty L1) through the Redis tier with each codec, best of 2 alternated runs; "
            f"recompute is the tiny Llama's prefill on this CPU (transformers, {prefill_tokens} "
            f"tokens in {prefill_s:.2f} s, scaled to 32k linearly: a lower bound, attention "
            f"grows faster): {recompute_32k:.1f} s.",
            "",
            table(
                ["codec", "lookup from Redis (ms)", "none / codec", "recompute / load"], lookup_rows
            ),
        ]
    )
