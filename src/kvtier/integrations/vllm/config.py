"""What the connector reads from vLLM's config: `kv_connector_extra_config`, the parallel
layout, and the KV cache groups it can serve (one full-attention group, refused otherwise)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidArgumentError
from kvtier.integrations.fingerprint import model_identity
from kvtier.integrations.seam import (
    CREDENTIAL_KEYS,
    PREFILL_KEY,
    credential,
    prefill_speed,
    refuse_unknown_keys,
)

DEFAULT_ADDRESS = "ipc:///tmp/kvtier.sock"
DEFAULT_TIMEOUT_S = 5.0

#: the keys `kv_connector_extra_config` may hold, with what each means
EXTRA_CONFIG_KEYS = {
    "address": f"the `kvtier serve --address` to talk to (default {DEFAULT_ADDRESS})",
    "model": "kvtier's namespace for this model's KV (default: vLLM's model, a fingerprint of "
    "its weights, dtypes, block size)",
    "timeout": f"seconds a kvtier call may take before it counts as failed (default "
    f"{DEFAULT_TIMEOUT_S:g})",
    **PREFILL_KEY,
    **CREDENTIAL_KEYS,
}


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, checked once at start."""

    address: str
    model: str
    timeout: float
    token: str  # the credential for a server with --auth-tokens-file ("" for none)
    block_size: int
    world_size: int  # tensor-parallel size: the ranks a chunk is split over
    layer_names: tuple[str, ...]  # the full-attention layers, in the model's order
    prefill_tokens_per_s: float = 0.0  # stated to kvtier with each lookup (0 = unknown)

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any) -> ConnectorConfig:
        """Reads and checks the settings; raises InvalidArgumentError naming the knob."""
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        refuse_unknown_keys(
            extra,
            EXTRA_CONFIG_KEYS,
            "kv_connector_extra_config for KVTierConnector (cache_salt comes from each request)",
        )
        token = credential(extra, "kv_connector_extra_config")
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "pipeline_parallel_size", 1)) != 1:
            raise InvalidArgumentError(
                f"KVTierConnector supports tensor parallelism only; pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size} (--pipeline-parallel-size) must be 1"
            )
        layer_names = check_kv_cache_groups(kv_cache_config)
        block_size = int(vllm_config.cache_config.block_size)
        model = extra.get("model") or default_model_name(vllm_config, block_size)
        timeout = float(extra.get("timeout", DEFAULT_TIMEOUT_S))
        if not timeout > 0:
            raise InvalidArgumentError(
                f"kv_connector_extra_config timeout={extra['timeout']!r} must be > 0 seconds"
            )
        prefill = prefill_speed(extra, "kv_connector_extra_config")
        return cls(
            address=str(extra.get("address", DEFAULT_ADDRESS)),
            model=str(model),
            timeout=timeout,
            token=token,
            block_size=block_size,
            world_size=int(parallel.tensor_parallel_size),
            layer_names=layer_names,
            prefill_tokens_per_s=prefill,
        )


def default_model_name(vllm_config: Any, block_size: int) -> str:
    """`vllm:<model>:<weights>:<dtype>[/kv<kv dtype>][:q<quantization>]:b<block size>`.

    A chunk's bytes are whole vLLM pages of KV computed by these weights in these dtypes, so
    engines that differ in any of them never share chunks. `<weights>` is the checkpoint's
    fingerprint (`fingerprint.model_identity`): new weights saved at the same path get a new
    name, and the old weights' KV (kept by the disk tier across restarts) is never read.
    """
    model_config = vllm_config.model_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype not in (None, "auto"):
        dtype = f"{dtype}/kv{kv_dtype}"
    quantization = getattr(model_config, "quantization", None)
    quant = f":q{quantization}" if quantization else ""
    weights = model_identity(str(model_config.model), getattr(model_config, "revision", None))
    return f"vllm:{model_config.model}:{weights.label}:{dtype}{quant}:b{block_size}"


def check_kv_cache_groups(kv_cache_config: Any) -> tuple[str, ...]:
    """The layer names of the one full-attention KV group; refuses any other model."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise InvalidArgumentError(
            f"KVTierConnector supports models with one full-attention KV cache group; this "
            f"model has {len(groups)} ({', '.join(kinds)}: hybrid, sliding-window or "
            "linear-attention layers). Run it without --kv-transfer-config."
        )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, MLAAttentionSpec):
        raise InvalidArgumentError(
            "KVTierConnector does not support MLA (latent) KV caches yet: run this model "
            "without --kv-transfer-config"
        )
    if type(spec) is not FullAttentionSpec or getattr(spec, "sliding_window", None):
        raise InvalidArgumentError(
            f"KVTierConnector supports full-attention KV caches only; this model's is "
            f"{type(spec).__name__} (sliding_window={getattr(spec, 'sliding_window', None)})"
        )
    return tuple(groups[0].layer_names)
