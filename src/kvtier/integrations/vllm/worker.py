"""The worker half of the connector: registers this rank's paged layout with kvtier, loads
chunks from the arena into vLLM's blocks before the forward pass, and saves full chunks from
vLLM's blocks into arena slots on a background thread, so a save never holds up the forward
pass. A failed load reports its blocks to vLLM, which recomputes them."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Mapping

import numpy as np
import torch

from kvtier.client import Client
from kvtier.errors import KVTierError
from kvtier.hashing import TOKEN_DTYPE
from kvtier.integrations.seam import LazyClient, Recompute, check_chunk_blocks
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, Transfer
from kvtier.integrations.vllm.paged import Copier, PagedLayout, copier_for

logger = logging.getLogger(__name__)

SHUTDOWN_FLUSH_S = 60.0  # how long a clean shutdown waits for saves in flight


class WorkerSide:
    """One tensor-parallel rank's loads and saves."""

    def __init__(self, config: ConnectorConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.recompute = Recompute(f"KVTierConnector worker {rank}")
        self._kv_caches: Mapping[str, torch.Tensor] | None = None
        self.layout: PagedLayout | None = None
        self._copier: Copier | None = None
        self._load_errors: set[int] = set()
        # saves: one background thread; counts of queued saves per vLLM request id
        self._jobs: queue.Queue[Transfer | None] = queue.Queue()
        self._pending: dict[str, int] = {}
        self._finishing: set[str] = set()  # finished requests whose saves may still run
        self._saved_any: set[str] = set()  # requests this worker was told to save
        self._cond = threading.Condition()
        self._saver = threading.Thread(
            target=self._save_loop, name=f"kvtier-vllm-saver-{rank}", daemon=True
        )
        self._saver.start()
        self._closed = False
        atexit.register(self.shutdown)
        self.client = LazyClient(
            config.address, timeout=config.timeout, on_connect=self._setup, token=config.token
        )

    # -- registration ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer KV views and register this rank's chunk layout with kvtier."""
        self._kv_caches = kv_caches
        client = self.client.try_connect(f"KVTierConnector worker {self.rank}")
        if client is not None and self.layout is None:
            self._setup(client)

    def _setup(self, client: Client) -> None:
        """On each new connection: check the chunk size, build the layout, register it."""
        check_chunk_blocks(client.chunk_size, self.config.block_size, "vLLM's --block-size")
        if self._kv_caches is None:
            return
        if self.layout is None:
            self.layout = PagedLayout.from_kv_caches(
                self._kv_caches, self.config.layer_names, self.config.block_size, client.chunk_size
            )
            self._copier = copier_for(self.layout, client.arena_bytes)  # pinned for GPU copies
        client.register(
            model=self.config.model,
            world_size=self.config.world_size,
            worker_id=self.rank,
            chunk_shape=self.layout.chunk_shape,
            dtype=self.layout.dtype_name,
        )

    def _ready(self) -> tuple[Client, PagedLayout, Copier] | None:
        client = self.client.try_connect(f"KVTierConnector worker {self.rank}")
        if client is None or self.layout is None or self._copier is None:
            return None
        return client, self.layout, self._copier

    # -- loads ------------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        """Copy this step's loads from the arena into vLLM's blocks before the forward pass."""
        for load in meta.loads:
            t0 = time.perf_counter()
            ok = self._load(load)
            if not ok:
                self._load_errors.update(load.block_ids)
            logger.info(
                "kvtier load of %s: %d tokens %s in %.2f ms",
                load.request_id,
                load.end - load.start,
                "copied" if ok else "failed",
                (time.perf_counter() - t0) * 1e3,
            )

    def _load(self, load: Transfer) -> bool:
        ready = self._ready()
        if ready is None:
            return False
        client, layout, copier = ready
        c, kb = layout.chunk_size, layout.kernel_block_size
        pages = layout.pages(load.block_ids)
        try:
            with client.retrieve_slots(
                load.kv_request_id,
                np.frombuffer(load.tokens, dtype=TOKEN_DTYPE),
                model=self.config.model,
                worker_id=self.rank,
                start=load.chunk_start,
                end=load.chunk_end,
                chunk_shape=layout.chunk_shape,
                dtype=layout.dtype_name,
                cache_salt=load.cache_salt,
                extra_key=load.extra_key,
                world_size=self.config.world_size,
            ) as got:
                wanted = (load.chunk_end - load.chunk_start) // c
                if got.num_chunks < wanted:
                    logger.warning(
                        "kvtier holds %d of the %d chunks planned for %s (evicted since the "
                        "lookup?): vLLM recomputes them",
                        got.num_chunks,
                        wanted,
                        load.request_id,
                    )
                    return False  # a load is all or nothing: its blocks are recomputed
                for k in range(wanted):
                    chunk0 = load.chunk_start + k * c
                    t0, t1 = max(load.start, chunk0), min(load.end, chunk0 + c)
                    copier.load(
                        got.views[k],
                        (t0 - chunk0) // kb,
                        pages[(t0 - load.start) // kb : (t1 - load.start) // kb],
                    )
                copier.sync()
        except KVTierError as exc:  # a lapsed lease, the server gone: the bytes are not vouched
            self.recompute.fail(f"load of {load.request_id}", exc)
            return False
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call: vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ------------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        """Queue this step's saves; the saver thread copies them while the next steps run."""
        with self._cond:
            for save in meta.saves:
                self._pending[save.request_id] = self._pending.get(save.request_id, 0) + 1
                self._saved_any.add(save.request_id)
        for save in meta.saves:
            self._jobs.put(save)

    def handle_preemptions(self, meta: KVTierConnectorMetadata) -> None:
        """Preempted requests' blocks are about to be reused: their saves finish first."""
        with self._cond:
            self._cond.wait_for(lambda: not any(self._pending.get(r) for r in meta.preempted))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Finished requests whose saves are all done: vLLM may free their blocks now."""
        with self._cond:
            self._finishing.update(r for r in finished_req_ids if r in self._saved_any)
            done = {r for r in self._finishing if not self._pending.get(r)}
            self._finishing -= done
            self._saved_any -= done
            for r in done:
                self._pending.pop(r, None)
        return (done or None), None

    def _save_loop(self) -> None:
        while True:
            save = self._jobs.get()
            if save is None:
                return
            try:
                self._save(save)
            except Exception:  # a bug must not kill the saver: vLLM waits on get_finished
                logger.exception("kvtier save of %s failed", save.request_id)
            finally:
                with self._cond:
                    self._pending[save.request_id] -= 1
                    self._cond.notify_all()

    def _save(self, save: Transfer) -> None:
        ready = self._ready()
        if ready is None:
            return
        client, layout, copier = ready
        per_chunk = layout.chunk_size // layout.kernel_block_size
        pages = layout.pages(save.block_ids)
        try:
            with client.store_slots(
                save.kv_request_id,
                np.frombuffer(save.tokens, dtype=TOKEN_DTYPE),
                model=self.config.model,
                worker_id=self.rank,
                start=save.chunk_start,
                end=save.chunk_end,
                chunk_shape=layout.chunk_shape,
                dtype=layout.dtype_name,
                cache_salt=save.cache_salt,
                extra_key=save.extra_key,
                world_size=self.config.world_size,
            ) as slots:
                for i, view in slots.targets():
                    copier.save(view, pages[i * per_chunk : (i + 1) * per_chunk])
                copier.sync()
        except KVTierError as exc:
            self.recompute.fail(f"save of {save.request_id}", exc)

    # -- lifecycle --------------------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not any(self._pending.values()), timeout)

    def shutdown(self) -> None:
        """Flush the saves in flight (a clean engine exit leaves finished requests stored)."""
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        if not self.wait_idle(SHUTDOWN_FLUSH_S):
            logger.warning("kvtier: saves still running after %.0fs at shutdown", SHUTDOWN_FLUSH_S)
        self._jobs.put(None)
        self._saver.join(timeout=max(0.1, SHUTDOWN_FLUSH_S - (time.monotonic() - t0)))
        self.client.close()
        atexit.unregister(self.shutdown)
