"""The per-layer KV cache specs vLLM's model code builds for DeepSeek Sparse Attention models
(DeepSeek-V3.2, GLM-5) and DeepSeek-V4, at tiny sizes, for the scheduler harness
(`vllm_harness.py`: vLLM's own planner groups them) and the vLLM benchmark.

They are what vLLM 0.32's workers report (`get_kv_cache_spec` of each attention layer), with
the field values these models set:
- DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, `model_executor/models/deepseek_v2.py`): per layer an
  MLA latent (`MLAAttentionSpec`, one 576-wide vector per token: kv_lora_rank 512 + rope 64)
  and its DSA indexer's keys (`DeepseekV32IndexerCache`: an `MLAAttentionSpec` with
  `cache_role` INDEXER, 128 fp8 values and a 4-byte scale per token, as uint8).
- GLM-5 (`GlmMoeDsaForCausalLM`, the same code): the same, but layers whose indexer pattern
  says "S" (shared) reuse the previous layer's top-k and have no indexer cache.
- DeepSeek-V4 (`DeepseekV4ForCausalLM`, `vllm/models/deepseek_v4`): per layer a sliding-window
  latent (`DeepseekV4SWACache`: `SlidingWindowMLASpec`, window 128, fp8_ds_mla: 584 bytes a
  token); layers with compress ratio 4 a latent compressed 4:1 (`MLAAttentionSpec`,
  `tokens_per_state` 4), its indexer's keys compressed 4:1 and the two compressors' running
  states (`SlidingWindowMLASpec`, window 8); layers with ratio 128 a latent compressed 128:1
  and their compressor's state (window 128). Captured from vLLM 0.32's CPU model code with a
  tiny config (layer compress ratios 0, 4, 128).

Every one of these caches has `max_tp_shards` 1: each TP rank holds the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: the families, their spec builders' names
FAMILIES = ("deepseek-v3.2", "glm-5", "deepseek-v4")


def dsa_specs(block_size: int, pattern: str) -> dict[str, Any]:
    """DeepSeek-V3.2 (pattern "FF..."), GLM-5 (e.g. "FSFS"): per layer an MLA latent, and for
    each "F" layer its indexer's keys."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    out: dict[str, Any] = {}
    for i, kind in enumerate(pattern):
        leader = kind == "F"
        out[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=576,
            dtype=torch.bfloat16,
            cache_dtype_str="auto",
            is_index_group_leader=leader,
        )
        if leader:
            out[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=128 + 4,  # fp8 values and one float32 scale per 128
                dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER,
            )
    return out


def deepseek_v4_specs(block_size: int = 64) -> dict[str, Any]:
    """Three layers with compress ratios 0 (sliding window only), 4 and 128."""
    import torch
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import (
        KVQuantMode,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )

    def swa() -> Any:
        return SlidingWindowMLASpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=512,
            dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
            state_content_bytes=584,
            sliding_window=128,
            cache_dtype_str="fp8_ds_mla",
            alignment=576,
            model_version="deepseek_v4",
        )

    def compressed(ratio: int, head: int, fp8: bool) -> Any:
        kw: dict[str, Any] = (
            {
                "kv_quant_mode": KVQuantMode.FP8_PER_TENSOR,
                "state_content_bytes": 584,
                "cache_dtype_str": "fp8_ds_mla",
                "model_version": "deepseek_v4",
            }
            if fp8
            else {}
        )
        return MLAAttentionSpec(
            block_size=256,  # vLLM's engine core raises the compressed group's block to 256
            block_stride_alignment=MultipleOf(256),
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head,
            dtype=torch.uint8,
            tokens_per_state=ratio,
            alignment=576,
            **kw,
        )

    def state(block: int, head: int, window: int) -> Any:
        return SlidingWindowMLASpec(
            block_size=block,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head,
            dtype=torch.float32,
            sliding_window=window,
            alignment=576,
        )

    p = "model.layers"
    return {
        f"{p}.0.attn.swa_cache": swa(),
        f"{p}.1.attn.indexer.k_cache": compressed(4, 132, fp8=False),
        f"{p}.1.attn.indexer.compressor.state_cache": state(4, 512, 8),
        f"{p}.1.attn.swa_cache": swa(),
        f"{p}.1.attn": compressed(4, 512, fp8=True),
        f"{p}.1.attn.compressor.state_cache": state(4, 2048, 8),
        f"{p}.2.attn.swa_cache": swa(),
        f"{p}.2.attn": compressed(128, 512, fp8=True),
        f"{p}.2.attn.compressor.state_cache": state(8, 1024, 128),
    }


def family_specs(family: str, block_size: int = 64) -> Callable[[int], dict[str, Any]]:
    """rank -> {layer: spec} for a family of FAMILIES (every rank alike: nothing is split over
    TP ranks)."""
    if family == "deepseek-v3.2":
        return lambda rank: dsa_specs(block_size, "FF")
    if family == "glm-5":
        return lambda rank: dsa_specs(block_size, "FSFS")
    if family == "deepseek-v4":
        return lambda rank: deepseek_v4_specs(block_size)
    raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")
