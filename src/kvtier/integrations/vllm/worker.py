"""The worker half of the connector: registers this rank's paged layout with kvtier, loads
chunks from the arena into vLLM's blocks before the forward pass (or layer by layer beside it:
layerwise.py), and saves full chunks from vLLM's blocks into arena slots on a background
thread, so a save never holds up the forward pass. A failed load reports its blocks to vLLM
(one KV cache group) or its request (several groups, whose loads vLLM waits for
asynchronously); vLLM then fails the request or recomputes, as its `kv_load_failure_policy`
says."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from kvtier.client import ChunkRange, Client, RetrievedSlots, StoreSlots
from kvtier.errors import KVTierError
from kvtier.hashing import TOKEN_DTYPE
from kvtier.integrations.amx import request_amx_tiles
from kvtier.integrations.seam import LazyClient, Recompute, check_chunk_blocks
from kvtier.integrations.vllm.config import CacheGroup, ConnectorConfig, check_group_blocks
from kvtier.integrations.vllm.layerwise import (
    LayerGate,
    Loader,
    Overlap,
    SaveJob,
    StepLoads,
    Stopwatch,
    forward_order,
    run_step_loads,
    use_layerwise,
)
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, Transfer
from kvtier.integrations.vllm.paged import (
    SKIP,
    STAGED_KINDS,
    Bytes,
    Copier,
    GroupLayout,
    PagedLayout,
    copier_for,
)
from kvtier.protocol import KVGroup

logger = logging.getLogger(__name__)

SHUTDOWN_FLUSH_S = 60.0  # how long a clean shutdown waits for saves in flight


class WorkerSide:
    """One rank's loads and saves: its tensor-parallel heads of its pipeline stage's layers (MLA:
    the stage's latent cache, the same on every TP rank, stored by TP rank 0 only)."""

    def __init__(self, config: ConnectorConfig, rank: int, pp_rank: int = 0) -> None:
        self.config = config
        self.rank = rank  # tensor-parallel rank
        self.worker_id = config.worker_id(rank, pp_rank)
        self.reader = pp_rank * config.tp_size + rank  # this rank's mark on a lookup's pin
        self.recompute = Recompute(f"KVTierConnector worker {self.worker_id}")
        self._kv_caches: Mapping[str, torch.Tensor] | None = None
        self.layout: PagedLayout | None = None
        self._copier: Copier | None = None
        self._load_errors: set[int] = set()
        self._received: set[str] = set()  # asynchronous loads done since get_finished
        self._failed: set[str] = set()  # ... and those of them that failed
        # saves: one background thread; counts of queued saves per vLLM request id
        self._jobs: queue.Queue[SaveJob | None] = queue.Queue()
        self._pending: dict[str, int] = {}
        self._finishing: set[str] = set()  # finished requests whose saves may still run
        self._saved_any: set[str] = set()  # requests this worker was told to save
        self._cond = threading.Condition()
        self._saver = threading.Thread(
            target=self._save_loop, name=f"kvtier-vllm-saver-{self.worker_id}", daemon=True
        )
        self._saver.start()
        self._closed = False
        # layer-wise loads and saves (layerwise.py), resolved once the layout is known
        self.overlap = Overlap()
        self.layerwise = False
        self._order: list[tuple[int, int, str]] = []  # (layout group, layer, name), forward order
        self._loader: Loader | None = None
        self._load_copier: Copier | None = None
        self._step: StepLoads | None = None  # this step's layer-wise loads
        self._step_saves: list[SaveJob] = []  # this step's layer-wise saves, queued early
        self._saves_begun = False  # this step's saves were queued by save_kv_layer
        #: called on the loader thread once a layer's loads are in place (observes the order)
        self.layer_hook: Callable[[str], None] | None = None
        self.layer_calls = {"wait": 0, "save": 0}  # vLLM's per-layer calls met with copies
        atexit.register(self.shutdown)
        self.client = LazyClient(
            config.address, timeout=config.timeout, on_connect=self._setup, token=config.token
        )

    # -- registration ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer KV views and register this rank's chunk layout with kvtier.
        On the CPU, first ask Linux for AMX tiles for this worker process (see
        `kvtier.integrations.amx`): a first step that only finishes a loaded prompt may reach
        vLLM's AMX attention before anything else asked."""
        if any(kv.device.type == "cpu" for kv in kv_caches.values()):
            who = f"KVTierConnector worker {self.worker_id}"
            tiles = request_amx_tiles(who)
            if not tiles.offered and torch.cpu._is_amx_tile_supported():  # vLLM's own test
                logger.warning(
                    "%s: the CPU reports AMX but Linux offers no AMX tiles to processes: "
                    "vLLM's bfloat16 attention may stop the worker with SIGILL (--dtype "
                    "float32 does without them)",
                    who,
                )
        self._kv_caches = kv_caches
        client = self.client.try_connect(f"KVTierConnector worker {self.worker_id}")
        if client is not None and self.layout is None:
            self._setup(client)

    def _setup(self, client: Client) -> None:
        """On each new connection: check the chunk size, build the layout, register it."""
        check_chunk_blocks(client.chunk_size, self.config.block_size, "vLLM's --block-size")
        check_group_blocks(self.config, client.chunk_size)
        if self._kv_caches is None:
            return
        if self.layout is None:
            self.layout = PagedLayout.from_kv_caches(
                self._kv_caches, self.config.groups, client.chunk_size, self.config.num_blocks
            )
            self._copier = copier_for(self.layout, client.arena_bytes)  # pinned for GPU copies
            self._order = forward_order(self.layout)
            self.layerwise = use_layerwise(self.config.layerwise, self.layout.device.type)
            if self.layerwise and self._loader is None:
                self._loader = Loader(f"kvtier-vllm-loader-{self.worker_id}")
                # a GPU: a copy stream of the loads' own, so a load never queues behind a save
                # waiting for the forward pass to write its layer
                self._load_copier = copier_for(self.layout, client.arena_bytes)
        client.register(
            model=self.config.model,
            world_size=self.config.world_size,
            worker_id=self.worker_id,
            chunk_shape=self.layout.chunk_shape,
            dtype=self.layout.dtype_name,
            role="" if self.config.role == "kv_both" else self.config.role,
            kv_groups=[KVGroup(g.index, g.spec_kind, g.sliding_window) for g in self.config.groups],
        )

    def _ready(self) -> tuple[Client, PagedLayout, Copier] | None:
        client = self.client.try_connect(f"KVTierConnector worker {self.worker_id}")
        if client is None or self.layout is None or self._copier is None:
            return None
        return client, self.layout, self._copier

    def _chunks(self, transfer: Transfer) -> ChunkRange:
        """This rank's chunks of a load or save, as kvtier names them."""
        return ChunkRange(
            transfer.kv_request_id,
            np.frombuffer(transfer.tokens, dtype=TOKEN_DTYPE),
            model=self.config.model,
            start=transfer.chunk_start,
            end=transfer.chunk_end,
            worker_id=self.worker_id,
            world_size=self.config.world_size,
            cache_salt=transfer.cache_salt,
            extra_key=transfer.extra_key,
        )

    def _retrieving(
        self, client: Client, layout: PagedLayout, load: Transfer, reader: int
    ) -> RetrievedSlots:
        """The slots of a load: a prompt's chunks, or a hand-off's named objects."""
        if load.names:
            return client.retrieve_key_slots(
                load.names,
                model=self.config.model,
                worker_id=self.worker_id,
                chunk_shape=layout.chunk_shape,
                dtype=layout.dtype_name,
                cache_salt=load.cache_salt,
                world_size=self.config.world_size,
            )
        return client.retrieve_slots(
            self._chunks(load),
            chunk_shape=layout.chunk_shape,
            dtype=layout.dtype_name,
            reader=reader,
        )

    def _storing(
        self, client: Client, layout: PagedLayout, save: Transfer, resumable: list[bool]
    ) -> StoreSlots:
        """The slots of a save: a prompt's chunks, or a hand-off's named objects."""
        if save.names:
            return client.store_key_slots(
                save.names,
                model=self.config.model,
                worker_id=self.worker_id,
                chunk_shape=layout.chunk_shape,
                dtype=layout.dtype_name,
                cache_salt=save.cache_salt,
                world_size=self.config.world_size,
                handoff=save.handoff,
            )
        return client.store_slots(
            self._chunks(save),
            chunk_shape=layout.chunk_shape,
            dtype=layout.dtype_name,
            resumable=resumable,
        )

    def _group_index(self, group: CacheGroup) -> int:
        """A group's position in the config (the index of its block ids in a Transfer)."""
        return self.config.groups.index(group)

    # -- loads ------------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVTierConnectorMetadata) -> None:
        """Whole-request: copy this step's loads into vLLM's blocks. Layer-wise: start them on
        the loader thread (wait_for_layer_load waits per layer). Asynchronous loads (several KV
        cache groups) are done within the step; get_finished reports them."""
        ready = self._ready() if self.layerwise and meta.loads else None
        if ready is not None:
            client, layout, _ = ready
            with Stopwatch() as sw:
                self._start_step_loads(meta.loads, client, layout, self._load_copier or ready[2])
            if self._step is not None:
                self._step.exposed += sw.seconds
            return
        for load in meta.loads:
            t0 = time.perf_counter()
            ok = self._load(load)
            seconds = time.perf_counter() - t0
            self._loaded(load, ok, seconds)
            self.overlap.add(load_copy_s=seconds, load_exposed_s=seconds, loads=1)

    def _loaded(self, load: Transfer, ok: bool, seconds: float) -> None:
        """Report a load's outcome to vLLM (through get_finished or the blocks with errors)."""
        if self.config.async_loads:
            self._received.add(load.request_id)
            if not ok:
                self._failed.add(load.request_id)
        elif not ok:
            self._load_errors.update(b for ids in load.block_ids for b in ids if b)
        logger.info("kvtier load of %s: %d tokens %s in %.2f ms", load.request_id,
                    load.end - load.start, "copied" if ok else "failed", seconds * 1e3)  # fmt: skip

    def _start_step_loads(
        self, loads: list[Transfer], client: Client, layout: PagedLayout, copier: Copier
    ) -> None:
        """Hand this step's loads to the loader thread (layerwise.run_step_loads)."""
        step = StepLoads(LayerGate([name for _, _, name in self._order]), loads)
        event = copier.mark()  # GPU: the blocks may be in use by work queued before this step

        def load_layer(views: list[Bytes], li: int, load: Transfer, layer: int) -> bool:
            ids = load.block_ids[self._group_index(layout.groups[li].group)]
            return self._load_group(copier, views, li, layout.groups[li], load, ids, [layer])

        assert self._loader is not None
        self._loader.submit(lambda: run_step_loads(
            step, self._order, copier, event,
            open_load=lambda stack, load: self._open_load(stack, client, layout, load),
            load_layer=load_layer, hook=self.layer_hook,
            on_lost=lambda exc: self.recompute.fail("layer-wise load", exc),
        ))  # fmt: skip
        self._step = step

    def _open_load(
        self, stack: ExitStack, client: Client, layout: PagedLayout, load: Transfer
    ) -> list[Bytes] | None:
        """A load's chunk views, held open by `stack`; None when kvtier lacks some (recompute)."""
        reader = self.reader if self.config.readers else -1  # -1: this rank's worker_id
        try:
            got = stack.enter_context(self._retrieving(client, layout, load, reader))
        except KVTierError as exc:
            self.recompute.fail(f"load of {load.request_id}", exc)
            return None
        wanted = (load.chunk_end - load.chunk_start) // layout.chunk_size
        if got.num_chunks < wanted:
            logger.warning(
                "kvtier holds %d of the %d chunks planned for %s (evicted since the lookup?): "
                "vLLM recomputes them",
                got.num_chunks,
                wanted,
                load.request_id,
            )
            return None
        return list(got.views)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: wait until this layer's loads are in place (a GPU: queued, with the
        compute stream waiting for them); other layers may still copy."""
        if self._step is not None and self._load_copier is not None:
            self.layer_calls["wait"] += 1
            self._load_copier.wait_compute(self._step.wait_layer(layer_name))

    def _finish_step_loads(self) -> None:
        """End of the forward pass: wait for the rest of this step's loads, report them."""
        step, self._step = self._step, None
        if step is not None:
            step.finish()
            for load in step.loads:
                self._loaded(load, step.ok.get(load.request_id, False), step.copy_s)
            self.overlap.add(
                load_copy_s=step.copy_s, load_exposed_s=step.exposed, loads=len(step.loads)
            )

    def _load(self, load: Transfer) -> bool:
        ready = self._ready()
        if ready is None:
            return False
        client, layout, copier = ready
        try:
            with ExitStack() as stack:
                views = self._open_load(stack, client, layout, load)
                if views is None:
                    return False  # a load is all or nothing: its blocks are recomputed
                # GPU: the blocks may have been another request's, still in use by queued work
                copier.wait(copier.mark())
                for li, group in enumerate(layout.groups):
                    ids = load.block_ids[self._group_index(group.group)]
                    if not self._load_group(copier, views, li, group, load, ids):
                        return False
                copier.sync()
        except KVTierError as exc:  # a lapsed lease, the server gone: the bytes are not vouched
            self.recompute.fail(f"load of {load.request_id}", exc)
            return False
        return True

    def _load_group(
        self,
        copier: Copier,
        views: list[Bytes],
        li: int,
        group: GroupLayout,
        load: Transfer,
        block_ids: Sequence[int],
        layers: Sequence[int] | None = None,
    ) -> bool:
        """Queue one group's copies of a load (of `layers` of the group; default: all); False
        where a block vLLM allocated has no stored page (the load then fails, and vLLM
        recomputes)."""
        c = self.layout.chunk_size if self.layout is not None else 0
        if group.group.kind == "mamba":
            if not block_ids:
                logger.warning("no Mamba state block for the load of %s", load.request_id)
                return False
            for block in block_ids:  # the state at the end, into each block that holds it
                copier.load(views[-1], li, 0, group.pages([block]), layers=layers)
            return True
        kb = group.group.block_size // group.pages_per_block
        pages = group.pages(block_ids)
        all_pages = group.chunk_blocks * group.pages_per_block
        dropped = all_pages - group.kept_pages  # leading pages a sliding piece does not hold
        for k, view in enumerate(views):
            chunk0 = load.chunk_start + k * c
            t0, t1 = max(load.start, chunk0), min(load.end, chunk0 + c)
            if t1 <= t0:
                continue
            mine = pages[(t0 - load.start) // kb : (t1 - load.start) // kb]
            first = (t0 - chunk0) // kb - dropped
            if first < 0:  # pages before the piece: vLLM must not hold blocks there
                if any(p != SKIP for p in mine[:-first]):
                    logger.warning(
                        "vLLM allocated %s blocks outside the stored window for %s",
                        group.group.kind,
                        load.request_id,
                    )
                    return False
                mine, first = mine[-first:], 0
            copier.load(view, li, first, mine, layers=layers)
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (one KV cache group only)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call; get_finished reports
        them as received too, in the same call or an earlier one."""
        failed, self._failed = self._failed, set()
        return failed

    # -- saves ------------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVTierConnectorMetadata) -> None:
        """Queue this step's saves for the saver thread (layer-wise: queued at the first
        save_kv_layer; here every layer is released), after this step's layer-wise loads. The
        pieces of groups whose blocks vLLM frees soon (sliding window, Mamba state) are staged
        here: the next schedule may free or overwrite those blocks."""
        self._finish_step_loads()
        with Stopwatch() as sw:
            jobs, self._step_saves = self._step_saves, []
            begun, self._saves_begun = self._saves_begun, False
            if begun:
                ready = self._ready()
                for job in jobs:
                    if ready is not None:
                        _, layout, copier = ready
                        job.event = copier.mark()
                        job.staged = self._stage(layout, copier, job.save, job.event)
                    job.cancelled = ready is None  # nothing staged: store nothing
                    job.release(job.event)
            else:
                self._queue_saves(meta, early=False)
        if meta.saves:
            self.overlap.add(save_exposed_s=sw.seconds, saves=len(meta.saves))

    def save_kv_layer(self, layer_name: str, meta: KVTierConnectorMetadata) -> None:
        """Layer-wise: the forward pass wrote this layer; its saves may copy it. The step's first
        call queues them (vLLM may call start_load_kv only after the forward pass)."""
        if not self.layerwise:
            return
        if not self._saves_begun:
            self._saves_begun = True
            self._queue_saves(meta, early=True)
        if not self._step_saves or self._copier is None:
            return
        self.layer_calls["save"] += 1
        event = self._copier.mark()  # GPU: after the layer's writes were queued
        for job in self._step_saves:
            assert job.gate is not None
            job.gate.open(layer_name, event)

    def _queue_saves(self, meta: KVTierConnectorMetadata, *, early: bool) -> None:
        """Hand this step's saves to the saver: after the forward pass (pieces staged here) or
        during it (layer-wise: each job waits for its layers)."""
        with self._cond:
            for save in meta.saves:
                self._pending[save.request_id] = self._pending.get(save.request_id, 0) + 1
                self._saved_any.add(save.request_id)
        ready = self._ready() if meta.saves and self.config.stores(self.rank) else None
        names = [name for _, _, name in self._order]
        for save in meta.saves:
            job = SaveJob(save)
            if ready is None:
                job.skip = True  # no server, or another TP rank stores this MLA shard
            elif early:
                job.gate, job.staged_ready = LayerGate(names), threading.Event()
                self._step_saves.append(job)
            else:
                _, layout, copier = ready
                job.event = copier.mark()
                job.staged = self._stage(layout, copier, save, job.event)
            self._jobs.put(job)

    def _stage(self, layout: PagedLayout, copier: Copier, save: Transfer, event: Any) -> Bytes:
        """(chunks, tail bytes): each chunk's sliding-window and Mamba pieces, copied now.
        Pages vLLM no longer holds (null blocks) stay zero."""
        tail = layout.chunk_bytes - layout.staged_offset
        num = (save.chunk_end - save.chunk_start) // layout.chunk_size
        staged = np.zeros((num, tail), dtype=np.uint8)
        if not tail:
            return staged
        copier.wait(event)
        for li, group in enumerate(layout.groups):
            if group.group.kind not in STAGED_KINDS:
                continue
            ids = save.block_ids[self._group_index(group.group)]
            if group.group.kind == "mamba":
                if ids:  # the state at the save's end: the last chunk's
                    copier.save(staged[-1], li, 0, group.pages(ids), at=layout.staged_offset)
                continue
            pages, per = group.pages(ids), group.chunk_blocks * group.pages_per_block
            for k in range(num):
                kept = pages[k * per : (k + 1) * per][per - group.kept_pages :]
                copier.save(staged[k], li, 0, kept, at=layout.staged_offset)
        copier.sync()
        return staged

    def handle_preemptions(self, meta: KVTierConnectorMetadata) -> None:
        """Preempted requests' blocks are about to be reused: their saves finish first."""
        with self._cond:
            self._cond.wait_for(lambda: not any(self._pending.get(r) for r in meta.preempted))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose saves are all done: vLLM may free their blocks now,
        requests whose asynchronous load is done)."""
        with self._cond:
            self._finishing.update(r for r in finished_req_ids if r in self._saved_any)
            done = {r for r in self._finishing if not self._pending.get(r)}
            self._finishing -= done
            self._saved_any -= done
            for r in done:
                self._pending.pop(r, None)
        received, self._received = self._received, set()
        return (done or None), (received or None)

    def _save_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if not job.skip:
                    with Stopwatch() as sw:
                        self._save(job)
                    self.overlap.add(save_copy_s=sw.seconds - job.waited)
            except Exception:  # a bug must not kill the saver: vLLM waits on get_finished
                logger.exception("kvtier save of %s failed", job.save.request_id)
            finally:
                with self._cond:
                    self._pending[job.save.request_id] -= 1
                    self._cond.notify_all()

    def _resumable(self, save: Transfer, num: int) -> list[bool]:
        """Which chunks of a save a request can resume from: all, unless a Mamba group's state
        exists only at the save's end (and only when the step ended there)."""
        mamba = [i for i, g in enumerate(self.config.groups) if g.kind == "mamba"]
        if not mamba:
            return [True] * num
        last = all(save.block_ids[i] for i in mamba)
        return [False] * (num - 1) + [last]

    def _save_group(
        self,
        copier: Copier,
        slots: StoreSlots,
        li: int,
        save: Transfer,
        layers: Sequence[int] | None = None,
    ) -> None:
        """Queue a group's copies of a save (`layers` of it; default: all), unless staged."""
        assert self.layout is not None
        group = self.layout.groups[li]
        if group.group.kind in STAGED_KINDS:
            return
        pages = group.pages(save.block_ids[self._group_index(group.group)])
        per = group.chunk_blocks * group.pages_per_block
        for i, view in slots.targets():
            copier.save(view, li, 0, pages[i * per : (i + 1) * per], layers=layers)

    def _save(self, job: SaveJob) -> None:
        ready = self._ready()
        if ready is None:
            return
        client, layout, copier = ready
        save, tail_at = job.save, layout.staged_offset
        num = (save.chunk_end - save.chunk_start) // layout.chunk_size
        flags = self._resumable(save, num)
        resumable = [] if all(flags) else flags  # empty: every chunk is
        try:
            with self._storing(client, layout, save, resumable) as slots:
                if job.gate is None:
                    copier.wait(job.event)
                    for li in range(len(layout.groups)):
                        self._save_group(copier, slots, li, save)
                else:
                    for li, j, name in self._order:  # each layer once the forward wrote it
                        if layout.groups[li].group.kind in STAGED_KINDS:
                            continue
                        t0 = time.perf_counter()
                        event = job.gate.wait(name)
                        job.waited += time.perf_counter() - t0
                        copier.wait(event)
                        self._save_group(copier, slots, li, save, [j])
                        copier.flush()
                    assert job.staged_ready is not None
                    t0 = time.perf_counter()
                    job.staged_ready.wait()
                    job.waited += time.perf_counter() - t0
                    if job.cancelled:  # the forward pass may not have written every layer
                        raise KVTierError("the engine shut down during the step")
                copier.sync()
                if job.staged is not None and job.staged.shape[1]:
                    for i, view in slots.targets():
                        np.copyto(view[tail_at:], job.staged[i])
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
        for job in self._step_saves:  # a step that never reached wait_for_save
            job.cancelled = True
            job.release()
        t0 = time.monotonic()
        if not self.wait_idle(SHUTDOWN_FLUSH_S):
            logger.warning("kvtier: saves still running after %.0fs at shutdown", SHUTDOWN_FLUSH_S)
        self._jobs.put(None)
        self._saver.join(timeout=max(0.1, SHUTDOWN_FLUSH_S - (time.monotonic() - t0)))
        if self._loader is not None:
            self._loader.close(timeout=5.0)
        self.client.close()
        atexit.unregister(self.shutdown)
