"""The scheduler half of the connector: asks kvtier for each request's hit without holding up
the scheduler loop, and plans each step's loads and saves for the workers."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.client import Client, LookupHandle
from kvtier.errors import KVTierError
from kvtier.hashing import TOKEN_DTYPE
from kvtier.integrations.seam import LazyClient, Recompute, check_chunk_blocks
from kvtier.integrations.vllm.config import ConnectorConfig, check_group_blocks
from kvtier.integrations.vllm.inputs import AdapterFingerprints, request_extra_key
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, Transfer

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """What the scheduler side remembers of one request."""

    request: Any  # vllm.v1.request.Request
    kv_request_id: str
    recompute: Recompute
    #: the request's other KV-changing inputs (inputs.py); None: not to be cached
    extra_key: bytes | None
    lookup: LookupHandle | None = None
    lookup_round: int = -1  # request.num_preemptions when `lookup` was made
    hit: int = 0  # tokens kvtier holds, block-aligned and short of the last token
    load: tuple[int, int] | None = None  # tokens [start, end) to load in the next step
    saved_end: int = 0  # tokens whose chunks are stored or planned to be
    saves_planned: bool = False  # a save went to the workers: blocks wait for get_finished
    load_failed: bool = False  # its last load failed: its next lookup is a miss, once


def _tokens(token_ids: Any, end: int) -> bytes:
    return np.asarray(token_ids[:end], dtype=TOKEN_DTYPE).tobytes()


class SchedulerSide:
    """Lookups, load and save plans, and session ends, for one vLLM scheduler."""

    def __init__(self, config: ConnectorConfig, kv_cache_manager: Any = None) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self._tag = uuid.uuid4().hex[:12]  # vLLM request ids repeat across engines
        self._requests: dict[str, _Request] = {}
        self._finished_pending: dict[str, _Request] = {}  # blocks held until saves finish
        self._loading: dict[str, tuple[_Request, frozenset[int]]] = {}  # loads of the last step
        self._async: list[str] = []  # requests whose asynchronous load this step plans
        self._adapters = AdapterFingerprints()
        self.chunk_size = 0
        self.client = LazyClient(
            config.address, timeout=config.timeout, on_connect=self._check, token=config.token
        )
        self.client.try_connect("KVTierConnector scheduler")

    def _check(self, client: Client) -> None:
        check_chunk_blocks(client.chunk_size, self.config.block_size, "vLLM's --block-size")
        check_group_blocks(self.config, client.chunk_size)
        self.chunk_size = client.chunk_size

    # -- vLLM's scheduler-side hooks ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` kvtier can load; None while the lookup is pending.

        One lookup per request (per scheduling round after a preemption): the scheduler may ask
        again and again while it waits, and each answer comes from the same lookup. Models with
        several KV cache groups load asynchronously (`ConnectorConfig.async_loads`): the request
        waits for its load in vLLM's WAITING_FOR_REMOTE_KVS, and a failed load names it.
        """
        state = self._state(request)
        if state.load_failed:  # a miss, once: vLLM never loops lookup, failed load, lookup
            state.load_failed, state.lookup, state.hit = False, None, 0
            state.lookup_round = request.num_preemptions
            return 0, False
        if state.lookup_round != request.num_preemptions:
            state.lookup_round = request.num_preemptions
            state.lookup, state.hit = None, 0
            state.recompute.reset()
            if not self._cacheable(state):
                return 0, False
            client = self.client.try_connect("KVTierConnector scheduler")
            if client is None:
                return 0, False
            tokens = request.all_token_ids[: request.num_tokens]
            handle = state.recompute.call(
                "lookup",
                None,
                client.lookup,
                state.kv_request_id,
                np.asarray(tokens, dtype=TOKEN_DTYPE),
                model=self.config.model,
                world_size=self.config.world_size,
                cache_salt=request.cache_salt or "",
                extra_key=state.extra_key or b"",
                wait=False,
                **self._readers,
                prefill_tokens_per_s=self.config.prefill_tokens_per_s,
            )
            if not isinstance(handle, LookupHandle):
                return 0, False
            state.lookup = handle
        if state.lookup is not None:
            failed: int | None = 0  # a failed poll reads as a miss, never as "pending"
            hit = state.recompute.call("lookup", failed, state.lookup.poll)
            if hit is None:
                return None, False  # L2 loads still run on the server: ask again next step
            state.lookup = None
            # keep the last token to compute (vLLM needs its logits); whole blocks only, or
            # whole chunks where a sliding window or a Mamba state is read at the hit's end
            unit = self.config.hit_unit or self.chunk_size
            usable = (request.num_tokens - 1) // unit * unit
            state.hit = min(int(hit), usable)
            state.saved_end = max(state.saved_end, int(hit))  # chunk-aligned: stored already
        new = max(0, state.hit - num_computed_tokens)
        return new, bool(new) and self.config.async_loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the load for the next step's metadata; drop pins kvtier will not need."""
        state = self._state(request)
        if num_external_tokens > 0:
            end = state.hit
            state.load = (end - num_external_tokens, end)
            if self.config.async_loads:  # not scheduled this step: planned by build_connector_meta
                self._async.append(request.request_id)
        elif state.hit > 0:
            self._quietly(
                state,
                "release",
                lambda c: c.release(state.kv_request_id, cache_salt=state.request.cache_salt or ""),
            )

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        """This step's loads (allocated blocks to fill) and saves (chunks completed by it)."""
        meta = KVTierConnectorMetadata(preempted=list(scheduler_output.preempted_req_ids or ()))
        for req_id in self._async:  # loads vLLM waits for; their steps run once they are done
            state = self._requests.get(req_id)
            if state is not None and state.load is not None:
                self._plan_load(meta, req_id, state, self._block_ids(req_id), running=0)
        self._async.clear()
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            block_ids = self._block_ids(req_id)
            if state.load is not None:
                # align mode: the step runs from the state block of its last token
                running = state.request.num_computed_tokens + num_new
                self._plan_load(meta, req_id, state, block_ids, running=running)
            if not self.chunk_size or state.recompute.last_error is not None:
                continue  # kvtier never answered, or failed this request: no saves
            if not self._cacheable(state):
                continue
            request = state.request
            computed = request.num_computed_tokens + num_new  # once this step has run
            end = min(computed, request.num_tokens) // self.chunk_size * self.chunk_size
            if end > state.saved_end:
                # a Mamba state exists at `end` only when this step ends there
                meta.saves.append(
                    self._transfer(
                        state, state.saved_end, end, block_ids, state_at_end=computed == end
                    )
                )
                state.saved_end = end
                state.saves_planned = True
        return meta

    def _plan_load(
        self,
        meta: KVTierConnectorMetadata,
        req_id: str,
        state: _Request,
        block_ids: tuple[list[int], ...],
        *,
        running: int,
    ) -> None:
        assert state.load is not None
        meta.loads.append(self._transfer(state, *state.load, block_ids, running=running))
        loaded = frozenset(b for ids in meta.loads[-1].block_ids for b in ids if b)
        self._loading[req_id] = (state, loaded)
        state.load = None

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """True (blocks held) while the workers still save the request's chunks; else the
        kvtier session ends now."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        if state.saves_planned:
            self._finished_pending[request.request_id] = state
            return True, None
        self._end(state)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Every worker finished saving these requests: end their kvtier sessions. Requests
        whose load failed (the workers reported its blocks) get a miss at their next lookup."""
        bad, failed = connector_output.invalid_block_ids, connector_output.failed_recving
        for req_id, (loading, blocks) in self._loading.items():
            loading.load_failed = bool(req_id in (failed or ()) or (bad and bad & blocks))
        self._loading.clear()
        for req_id in connector_output.finished_sending or ():
            state = self._finished_pending.pop(req_id, None)
            if state is not None:
                self._end(state)

    def has_pending_saves(self) -> bool:
        """Finished requests whose blocks wait on saves: the engine must keep stepping so the
        workers can report them, and vLLM need not preempt to free those blocks."""
        return bool(self._finished_pending)

    def shutdown(self) -> None:
        for state in [*self._requests.values(), *self._finished_pending.values()]:
            self._end(state)
        self._requests.clear()
        self._finished_pending.clear()
        self.client.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _Request(
                request,
                f"vllm-{self._tag}-{request.request_id}",
                Recompute(f"KVTierConnector request {request.request_id}"),
                request_extra_key(request, self._adapters),
            )
            self._requests[request.request_id] = state
        return state

    @staticmethod
    def _cacheable(state: _Request) -> bool:
        """Only requests whose every KV-changing input is named are looked up and saved; the
        others vLLM computes alone, never reading KV computed for other inputs."""
        return state.extra_key is not None

    @property
    def _readers(self) -> dict[str, int]:
        """MLA with several TP ranks: every rank retrieves the one shard under the pin."""
        return {"readers": self.config.readers} if self.config.readers else {}

    def _block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's blocks, one list per KV cache group."""
        assert self.kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return tuple(list(ids) for ids in self.kv_cache_manager.get_block_ids(req_id))

    def _transfer(
        self,
        state: _Request,
        start: int,
        end: int,
        block_ids: tuple[list[int], ...],
        *,
        state_at_end: bool = True,
        running: int = 0,
    ) -> Transfer:
        c = self.chunk_size
        chunk_start = start // c * c
        chunk_end = -(-end // c) * c
        per_group: list[tuple[int, ...]] = []
        for group in self.config.groups:
            ids, b = block_ids[group.index], group.block_size
            if group.kind != "mamba":
                per_group.append(tuple(ids[start // b : end // b]))
                continue
            # vLLM's Mamba block for the state after `end` tokens: in "align" mode block p
            # holds the state after (p + 1) * b tokens; in "none" mode (b past the model's
            # length) the request's one block holds its running state
            at = (end - 1) // b
            ok = state_at_end and end > 0 and at < len(ids) and ids[at] != 0
            if not ok:
                per_group.append(())
                continue
            # a load also fills the block the step runs from: in "align" mode vLLM copies
            # the state at `end` into the block of the step's last token before the forward
            # pass, and so before the connector's load has written it
            run = (running - 1) // b
            runs = run > at and run < len(ids) and ids[run] != 0
            per_group.append((ids[at], ids[run]) if runs else (ids[at],))
        return Transfer(
            request_id=state.request.request_id,
            kv_request_id=state.kv_request_id,
            tokens=_tokens(state.request.all_token_ids, chunk_end),
            cache_salt=state.request.cache_salt or "",
            extra_key=state.extra_key or b"",
            chunk_start=chunk_start,
            chunk_end=chunk_end,
            start=start,
            end=end,
            block_ids=tuple(per_group),
        )

    def _end(self, state: _Request) -> None:
        self._quietly(
            state,
            "end_session",
            lambda c: c.end_session(state.kv_request_id, cache_salt=state.request.cache_salt or ""),
        )

    def _quietly(self, state: _Request, what: str, call: Any) -> None:
        client = self.client.try_connect("KVTierConnector scheduler")
        if client is None:
            return
        try:
            call(client)
        except KVTierError as exc:
            logger.info("kvtier %s of %s failed (harmless): %s", what, state.kv_request_id, exc)
