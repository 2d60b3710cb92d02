"""`KVTierConnector`: vLLM's `KVConnectorBase_V1` on top of kvtier.

vLLM builds one instance in the scheduler process (role SCHEDULER) and one in each worker
(role WORKER); each delegates to `SchedulerSide` or `WorkerSide`. Enable it with

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"address": "ipc:///tmp/kvtier.sock"}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, stats_from
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def tensor_parallel_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank: from vLLM's process groups once they exist, else
    from the parallel config the worker was started with."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):
        parallel = vllm_config.parallel_config
        return int(parallel.rank) % int(parallel.tensor_parallel_size)


def pipeline_parallel_rank(vllm_config: Any) -> int:
    """This worker's pipeline stage: from vLLM's process groups once they exist, else from the
    parallel config (a worker's global rank is pp_rank * tp_size + tp_rank)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        parallel = vllm_config.parallel_config
        return int(parallel.rank) // int(parallel.tensor_parallel_size)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Reuses KV that kvtier holds for a prompt's leading chunks and stores the full chunks a
    request computes. A kvtier failure costs a recompute, or under vLLM's
    `kv_load_failure_policy` `fail` a failed load fails its request (docs/vllm.md).

    Declares `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on and hands the connector
    every KV cache group: full attention, sliding window, MLA, Mamba / linear attention."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.kvtier_config = ConnectorConfig.from_vllm(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.kvtier_config)
        else:
            self._worker = WorkerSide(
                self.kvtier_config,
                tensor_parallel_rank(vllm_config),
                pipeline_parallel_rank(vllm_config),
            )

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on a scheduler connector"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never a wrong answer

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: this layer's loads are in place (whole-request: they all were before
        the forward pass)."""
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Layer-wise: the forward pass wrote this layer; its saves copy it now (whole-request:
        wait_for_save queues whole chunks after the forward pass)."""
        self.worker_side.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVTierConnectorMetadata)
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves done, asynchronous loads done, and those of them that failed (vLLM fails or
        recomputes those requests, as its kv_load_failure_policy says)."""
        sending, recving = self.worker_side.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker_side.take_failed_loads(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """Since the last call: a worker's copy time and the part the forward pass waited for,
        or the scheduler's lookups and the time they took."""
        counted = self._worker.overlap if self._worker is not None else self.scheduler_side.timing
        stats = KVTierStats(data=counted.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats | None:
        return stats_from(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        """The copy seconds and the seconds waited for them, as counters in vLLM's /metrics."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _meta(self) -> KVTierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        return meta

    # -- scheduler side ---------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side.has_pending_saves()

    def has_pending_block_frees(self) -> bool:
        return self.scheduler_side.has_pending_saves()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM with its hybrid KV cache manager off (one group)."""
        return self.scheduler_side.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request)
