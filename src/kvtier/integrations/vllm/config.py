"""What the connector reads from vLLM's config: `kv_connector_extra_config`, the parallel
layout, and the KV cache groups it serves (full attention, sliding window, MLA and its
DeepSeek-V3.2 / V4 and GLM-5 variants, Mamba / linear attention; anything else is refused at
start, naming what to use instead)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvtier.errors import InvalidArgumentError
from kvtier.integrations.fingerprint import model_identity
from kvtier.integrations.seam import (
    CREDENTIAL_KEYS,
    PREFILL_KEY,
    credential,
    prefill_speed,
    refuse_unknown_keys,
)
from kvtier.integrations.vllm.drafting import drafting

DEFAULT_ADDRESS = "ipc:///tmp/kvtier.sock"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_HANDOFF_WAIT_S = 10.0

Role = Literal["kv_both", "kv_producer", "kv_consumer"]
ROLES: tuple[Role, ...] = ("kv_both", "kv_producer", "kv_consumer")

#: the keys `kv_connector_extra_config` may hold, with what each means
EXTRA_CONFIG_KEYS = {
    "address": f"the `kvtier serve --address` to talk to (default {DEFAULT_ADDRESS})",
    "model": "kvtier's namespace for this model's KV (default: vLLM's model, a fingerprint of "
    "its weights, dtypes, block size)",
    "timeout": f"seconds a kvtier call may take before it counts as failed (default "
    f"{DEFAULT_TIMEOUT_S:g})",
    "handoff_wait": "a kv_consumer: seconds a request waits for its hand-off while the prefill "
    f"instance still saves it, then its load fails (default {DEFAULT_HANDOFF_WAIT_S:g})",
    "layerwise": "true: copy loads and saves layer by layer beside the forward pass; false: "
    'each step\'s loads before it, its saves after it; "auto" (default): layer-wise where '
    "the KV cache is on a GPU",
    **PREFILL_KEY,
    **CREDENTIAL_KEYS,
}

#: `kv_connector_extra_config` "layerwise": on, off, or "auto" (on where the KV is on a GPU)
LAYERWISE_VALUES = {True: "on", False: "off", "on": "on", "off": "off", "auto": "auto"}


def layerwise_mode(value: Any) -> str:
    """ "on", "off" or "auto" from the config value (true, false, "auto"); "" for another."""
    try:
        return LAYERWISE_VALUES[value]
    except (KeyError, TypeError):
        return ""


GroupKind = Literal["full", "sliding", "mla", "mamba"]


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups, as the connector stores it."""

    kind: GroupKind
    layer_names: tuple[str, ...]
    block_size: int  # tokens per vLLM block of this group (a Mamba block: one state)
    index: int  # the group's index in vLLM's KV cache config (its block ids' list)
    sliding_window: int = 0  # tokens, for kind "sliding"
    #: the same bytes on every TP rank (MLA latents, DSA indexer keys, DeepSeek-V4's caches:
    #: vLLM's `max_tp_shards` 1): stored once, by TP rank 0, and read by every rank
    replicated: bool = False
    #: vLLM's name for the group's kind in its KV events ("full_attention", "mamba", ...)
    spec_kind: str = ""

    def kept_blocks(self, chunk_size: int) -> int:
        """The blocks of a chunk its piece holds: every block for full attention and MLA, the
        trailing min(C/B, cdiv(W-1, B) + 1) for a sliding window (what a resume at the chunk's
        end reads, as vLLM's SlidingWindowManager counts it), one state for Mamba."""
        if self.kind == "mamba":
            return 1
        per_chunk = chunk_size // self.block_size
        if self.kind == "sliding":
            return min(per_chunk, -(-(self.sliding_window - 1) // self.block_size) + 1)
        return per_chunk


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, checked once at start."""

    address: str
    model: str
    timeout: float
    token: str  # the credential for a server with --auth-tokens-file ("" for none)
    block_size: int  # vLLM's scheduler block size (--block-size)
    tp_size: int
    pp_size: int
    groups: tuple[CacheGroup, ...]  # vLLM's KV cache groups, in vLLM's order
    prefill_tokens_per_s: float = 0.0  # stated to kvtier with each lookup (0 = unknown)
    role: Role = "kv_both"  # vLLM's kv_role: kv_producer stores hand-offs, kv_consumer reads
    handoff_wait: float = DEFAULT_HANDOFF_WAIT_S  # kv_consumer: bounded wait for a hand-off
    layerwise: str = "auto"  # "on", "off", "auto" (layerwise.use_layerwise)
    #: speculative decoding (drafting.py): tokens past a position that the drafter's KV at that
    #: position reads (EAGLE, EAGLE-3, MTP: 1, multi-module MTP: its modules; 0: none), and
    #: the trailing computed tokens vLLM prefills again (their draft KV is not final yet)
    draft_lookahead: int = 0
    draft_reprefill: int = 0

    num_blocks: int = 0  # blocks in vLLM's KV cache (0: unknown); a layer's pages per block

    @property
    def mla(self) -> bool:
        """Every group is the same on every TP rank (MLA and its DeepSeek-V3.2 / V4 and GLM-5
        caches): a chunk is one shard, stored once by TP rank 0 and read by every rank."""
        return all(g.replicated for g in self.groups)

    @property
    def plain(self) -> bool:
        """One full-attention group: chunks keep the 5-d layout and names of such models."""
        return len(self.groups) == 1 and self.groups[0].kind == "full"

    @property
    def hit_unit(self) -> int:
        """What a hit is cut to: whole vLLM blocks for full attention and MLA; whole chunks
        when a sliding window or a Mamba state must be read at the hit's end (0: chunk size)."""
        return self.block_size if all(g.kind in ("full", "mla") for g in self.groups) else 0

    @property
    def async_loads(self) -> bool:
        """Loads are reported to vLLM as asynchronous when the model has several KV cache groups:
        vLLM maps failed blocks back to requests only for one group, so a failed load must name
        its request (`failed_recving`), which only an asynchronous load can."""
        return len(self.groups) > 1

    @property
    def world_size(self) -> int:
        """The shards a chunk is split over: each pipeline stage its own layers, each TP rank
        its heads; MLA stages store one shard, read by all their TP ranks."""
        return self.pp_size if self.mla else self.tp_size * self.pp_size

    @property
    def readers(self) -> int:
        """Ranks that retrieve under a lookup's pin (0: world_size, one per shard)."""
        return self.tp_size * self.pp_size if self.mla and self.tp_size > 1 else 0

    def worker_id(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank if self.mla else pp_rank * self.tp_size + tp_rank

    def stores(self, tp_rank: int) -> bool:
        """Whether this rank writes its shard (MLA: TP rank 0 only; the others hold a copy)."""
        return tp_rank == 0 or not self.mla

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
        groups = cache_groups(kv_cache_config, int(parallel.tensor_parallel_size))
        block_size = int(vllm_config.cache_config.block_size)
        model = extra.get("model") or default_model_name(vllm_config, block_size)
        timeout = float(extra.get("timeout", DEFAULT_TIMEOUT_S))
        if not timeout > 0:
            raise InvalidArgumentError(
                f"kv_connector_extra_config timeout={extra['timeout']!r} must be > 0 seconds"
            )
        prefill = prefill_speed(extra, "kv_connector_extra_config")
        role = vllm_config.kv_transfer_config.kv_role or "kv_both"
        if role not in ROLES:
            raise InvalidArgumentError(
                f"kv_role={role!r}: KVTierConnector takes one of {', '.join(ROLES)}"
            )
        wait = float(extra.get("handoff_wait", DEFAULT_HANDOFF_WAIT_S))
        if not wait >= 0:
            raise InvalidArgumentError(
                f"kv_connector_extra_config handoff_wait={extra['handoff_wait']!r} must be >= 0 "
                "seconds"
            )
        layerwise = layerwise_mode(extra.get("layerwise", "auto"))
        if not layerwise:
            raise InvalidArgumentError(
                f"kv_connector_extra_config layerwise={extra['layerwise']!r} must be true, false "
                'or "auto"'
            )
        if role != "kv_both" and any(g.kind == "mamba" for g in groups):
            raise InvalidArgumentError(
                f"kv_role={role}: KVTierConnector hands off full-attention, sliding-window and "
                "MLA KV caches; a Mamba / linear-attention state exists only at the prompt's "
                "end, not one token before it, where the decode instance resumes: run this "
                "model with kv_role kv_both"
            )
        draft = drafting(vllm_config)
        return cls(
            address=str(extra.get("address", DEFAULT_ADDRESS)),
            model=str(model) + draft.name_suffix(explicit=bool(extra.get("model"))),
            timeout=timeout,
            token=token,
            block_size=block_size,
            tp_size=int(parallel.tensor_parallel_size),
            pp_size=int(getattr(parallel, "pipeline_parallel_size", 1)),
            groups=groups,
            prefill_tokens_per_s=prefill,
            role=role,
            handoff_wait=wait,
            layerwise=layerwise,
            draft_lookahead=draft.lookahead,
            draft_reprefill=draft.reprefill,
            num_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0),
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


#: vLLM's KV-event kind names for the connector's kinds, where vLLM names none itself
_EVENT_KINDS = {
    "full": "full_attention",
    "mla": "mla_attention",
    "sliding": "sliding_window",
    "mamba": "mamba",
}


def _spec_kind(spec: Any, kind: GroupKind) -> str:
    """The kind vLLM's own KV events give a group of `spec` (`get_kv_cache_spec_kind`)."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
    except ImportError:  # a vLLM that labels no event kinds: the connector's own kind
        return _EVENT_KINDS[kind]
    return str(get_kv_cache_spec_kind(spec).value)


def cache_groups(kv_cache_config: Any, tp_size: int = 1) -> tuple[CacheGroup, ...]:
    """The model's KV cache groups as the connector stores them; refuses the kinds it cannot
    store, naming what to use instead.

    A group whose layers differ in shape (vLLM's `UniformTypeKVCacheSpecs`: DeepSeek-V3.2's and
    GLM-5's MLA latents beside their indexer keys, DeepSeek-V4's compressed latents beside
    their indexer) is one group here: its layers share one block table, and the worker packs
    each shape's layers apart (`paged.PagedLayout`). vLLM's scheduler sees such a group through
    one layer's spec, its workers through every layer's; both read the same kind here."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups: list[CacheGroup] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = tuple(group.layer_names)
        what = f"KV cache group {index} ({type(spec).__name__}, layers {list(names[:2])})"
        if isinstance(spec, UniformTypeKVCacheSpecs):
            layers = [_layer_kind(s, what) for s in spec.kv_cache_specs.values()]
        else:
            layers = [_layer_kind(spec, what)]
        kinds = {kind for kind, _, _ in layers}
        windows = {window for _, window, _ in layers}
        replicated = {rep for _, _, rep in layers}
        if (len(kinds) > 1 and kinds != {"full", "mla"}) or len(windows) > 1:
            raise InvalidArgumentError(
                f"{what}: KVTierConnector stores a KV cache group whose layers keep the same "
                f"blocks; this one mixes {sorted(kinds)} (windows {sorted(windows)}): run this "
                "model without --kv-transfer-config"
            )
        if len(replicated) > 1 and tp_size > 1:
            raise InvalidArgumentError(
                f"{what}: its layers mix caches that every TP rank holds whole with caches "
                "split over TP ranks; KVTierConnector stores a group one way or the other: run "
                "this model with --tensor-parallel-size 1, or without --kv-transfer-config"
            )
        if not getattr(group, "enable_kv_transfer", True):
            continue  # a replica vLLM rebuilds from another group after a load
        kind: GroupKind = "mla" if "mla" in kinds else next(iter(kinds))
        groups.append(
            CacheGroup(
                kind,
                names,
                int(spec.block_size),
                index,
                windows.pop(),
                all(replicated),
                _spec_kind(spec, kind),
            )
        )
    if not groups:
        raise InvalidArgumentError(
            "this model has no KV cache groups KVTierConnector can store (attention-free?): run "
            "it without --kv-transfer-config"
        )
    return tuple(groups)


def _layer_kind(spec: Any, what: str) -> tuple[GroupKind, int, bool]:
    """(kind, sliding window, replicated over TP ranks) of one layer's spec."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    one_shard = getattr(spec, "max_tp_shards", None) == 1
    tokens_per_state = 1 if type(spec) is MambaSpec else getattr(spec, "tokens_per_state", 1)
    if not isinstance(tokens_per_state, int) or tokens_per_state < 1:
        raise InvalidArgumentError(
            f"{what}: KVTierConnector stores caches whose states cover whole tokens, not "
            f"{tokens_per_state} tokens per state; run this model without --kv-transfer-config"
        )
    if type(spec) is MLAAttentionSpec:  # a latent, or a DSA indexer's keys (cache_role)
        return "mla", 0, True
    if type(spec) is FullAttentionSpec:
        # a sliding window folded into a full-attention spec (HMA off) keeps every block
        return "full", 0, one_shard
    if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
        if getattr(spec, "extra_retained_tokens", 0):
            raise InvalidArgumentError(
                f"{what}: KVTierConnector does not store sliding windows that retain extra "
                "tokens; run this model without --kv-transfer-config"
            )
        if not getattr(spec, "prefix_cacheable", True):
            raise InvalidArgumentError(
                f"{what}: this sliding window is replayed, not cached (vLLM's bounded replay), "
                "so no prefix can resume from it; run this model without --kv-transfer-config"
            )
        mla = type(spec) is SlidingWindowMLASpec
        return "sliding", int(spec.sliding_window), mla or one_shard
    if type(spec) is MambaSpec:
        if spec.num_speculative_blocks:
            raise InvalidArgumentError(
                f"{what}: KVTierConnector stores one Mamba state per chunk, not speculative "
                "decoding's extra state blocks (a hybrid Mamba / linear-attention model "
                "with --speculative-config); run this model without --speculative-config, "
                "or without --kv-transfer-config"
            )
        return "mamba", 0, bool(getattr(spec, "tp_replicated", False))
    raise InvalidArgumentError(
        f"{what}: KVTierConnector stores full-attention, sliding-window, MLA (with DSA "
        f"indexers and DeepSeek-V4's compressed caches) and Mamba / linear-attention KV "
        f"caches, not {type(spec).__name__}; run this model without --kv-transfer-config"
    )


def check_group_blocks(config: ConnectorConfig, chunk_size: int) -> None:
    """Every attention group's block must divide kvtier's chunk (a Mamba group's "block" is a
    state: in vLLM's `align` mode its block is the attention block, and chunks must be whole
    such blocks for a state to exist at a chunk's end)."""
    for g in config.groups:
        if g.kind == "mamba" and g.block_size > chunk_size:
            continue  # mamba_cache_mode "none": one running state per request
        if chunk_size % g.block_size:
            raise InvalidArgumentError(
                f"kvtier's chunk size ({chunk_size} tokens, `kvtier serve --chunk-size`) must be "
                f"a multiple of every KV cache group's block ({g.kind} layers: {g.block_size} "
                "tokens; vLLM's --block-size, or the attention block vLLM picks for hybrid "
                "models): change one"
            )
