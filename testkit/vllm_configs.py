"""The vLLM configuration objects the scheduler harness (`vllm_harness.py`) and the vLLM
benchmark build: a `VllmConfig` with KVTierConnector, and KV cache configs, full-attention or
planned by vLLM for hybrid models."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def vllm_config(
    model_dir: Path,
    *,
    address: str,
    block_size: int = 32,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    rank: int = 0,
    max_num_batched_tokens: int = 4096,
    max_model_len: int = 4096,
    extra: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "recompute",
    kv_role: str = "kv_both",
    mamba_cache_mode: str = "none",
    enable_prefix_caching: bool = True,
    speculative: dict[str, Any] | None = None,
    layout: str = "LBHNC",
) -> Any:
    """`speculative`: vLLM's --speculative-config (method, model, num_speculative_tokens)."""
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    cache_config.kv_cache_layout = layout
    cache_config.mamba_cache_mode = mamba_cache_mode
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    parallel = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size
    )
    parallel.rank = rank
    kv_transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role=kv_role,
        kv_connector_extra_config={"address": address, "timeout": 2.0, **(extra or {})},
        kv_load_failure_policy=kv_load_failure_policy,
    )
    spec = None
    if speculative is not None:
        spec = SpeculativeConfig(
            **speculative, target_model_config=model_config, target_parallel_config=parallel
        )
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=parallel,
        kv_transfer_config=kv_transfer,
        speculative_config=spec,
    )


def kv_cache_config(
    *,
    layers: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    dtype: Any,
    first_layer: int = 0,
) -> Any:
    """One full-attention group over `layers` layers from `first_layer` on (a pipeline stage's),
    each layer's pages in one region."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(first_layer, first_layer + layers)]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * layers,
        layers=names,
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def hybrid_kv_cache_config(vllm_cfg: Any, specs: dict[str, Any], num_blocks: int) -> Any:
    """The KVCacheConfig vLLM builds for these per-layer specs (its hybrid KV cache manager's
    grouping, shared buffer and block strides), sized to `num_blocks` blocks. vLLM 0.32 keeps
    the planner in kv_cache_utils; 0.33 moved it to kv_cache_planning, where the engine core
    computes the groups first."""
    vllm_cfg.cache_config.num_gpu_blocks_override = num_blocks
    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        (config,) = get_kv_cache_configs(vllm_cfg, [specs], [1 << 34])
    except ImportError:  # vLLM 0.33
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs as plan

        groups = get_global_kv_cache_groups(vllm_cfg, [specs])
        (config,) = plan(vllm_cfg, [specs], [1 << 34], groups)
    return config
