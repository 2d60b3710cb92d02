"""The scheduler half of the connector: asks kvtier for each request's hit without holding up
the scheduler loop, and plans each step's loads and saves for the workers."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvtier.client import Client, LookupHandle
from kvtier.errors import KVTierError
from kvtier.hashing import TOKEN_DTYPE
from kvtier.integrations.seam import LazyClient, Recompute, check_chunk_blocks
from kvtier.integrations.vllm import handoff
from kvtier.integrations.vllm.config import ConnectorConfig, check_group_blocks
from kvtier.integrations.vllm.drafting import hit_point
from kvtier.integrations.vllm.inputs import AdapterFingerprints, request_extra_key
from kvtier.integrations.vllm.layerwise import Overlap
from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, Transfer

logger = logging.getLogger(__name__)

_POLL_S = 0.002  # a consumer asks about a hand-off still being saved at most this often

#: the scheduler's counters in vLLM's connector stats: lookups (and polls) sent, seconds in them
LOOKUP_KEYS = ("lookups", "lookup_s")


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
    # a kv_producer's hand-off: its id, the full chunks planned so far, whether all of it is
    handoff_out: str | None = None
    handoff_end: int = 0
    handoff_done: bool = False
    # a kv_consumer's hand-off: its params, until when to wait for it, whether it was seen
    # complete (or given up on), whether the server was told it is read
    handoff_in: dict[str, Any] | None = None
    handoff_deadline: float = 0.0
    handoff_known: bool = False
    handoff_ended: bool = False
    handoff_polled: float = 0.0


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
        self.timing = Overlap(LOOKUP_KEYS)
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
        if state.handoff_in is not None and not state.handoff_ended:
            return self._handoff_match(state, request, num_computed_tokens)
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
            started = time.perf_counter()
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
            self.timing.add(lookups=1, lookup_s=time.perf_counter() - started)
            if not isinstance(handle, LookupHandle):
                return 0, False
            state.lookup = handle
        if state.lookup is not None:
            failed: int | None = 0  # a failed poll reads as a miss, never as "pending"
            started = time.perf_counter()
            known = state.lookup.known
            hit = state.recompute.call("lookup", failed, state.lookup.poll)
            if not known:  # a round trip asked the server
                self.timing.add(lookups=1, lookup_s=time.perf_counter() - started)
            if hit is None:
                return None, False  # L2 loads still run on the server: ask again next step
            state.lookup = None
            # keep the last token to compute (vLLM needs its logits); whole blocks only, or
            # whole chunks where a sliding window or a Mamba state is read at the hit's end;
            # short of the draft KV that read tokens past what kvtier matched (drafting.py)
            unit = self.config.hit_unit or self.chunk_size
            state.hit = hit_point(int(hit), request.num_tokens, unit, self.config.draft_lookahead)
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
            if self.config.role == "kv_consumer":
                continue  # a decode instance never stores
            request = state.request
            computed = request.num_computed_tokens + num_new  # once this step has run
            if state.handoff_out is not None and not state.handoff_done:
                self._plan_handoff_saves(meta, state, block_ids, computed)
            if not self._cacheable(state):
                continue
            # multi-module MTP computes the draft KV of a step's last tokens again: not final
            final = computed - self.config.draft_reprefill
            end = min(final, request.num_tokens) // self.chunk_size * self.chunk_size
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
        if state.handoff_in is not None and not state.handoff_ended:
            planned = self._handoff_loads(state, *state.load, block_ids)
        else:
            planned = [self._transfer(state, *state.load, block_ids, running=running)]
        meta.loads.extend(planned)
        loaded = frozenset(b for t in planned for ids in t.block_ids for b in ids if b)
        self._loading[req_id] = (state, loaded)
        state.load = None

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """True (blocks held) while the workers still save the request's chunks; else the
        kvtier session ends now. A producer's hand-off is named in the params returned."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        params = None
        if state.handoff_out is not None and state.handoff_done:
            params = handoff.produced(
                state.handoff_out,
                request.num_prompt_tokens,
                self.config.model,
                self.config.world_size,
                self.chunk_size,
            )
        self._end_handoff(state)
        if state.saves_planned:
            self._finished_pending[request.request_id] = state
            return True, params
        self._end(state)
        return False, params

    def update_connector_output(self, connector_output: Any) -> None:
        """Every worker finished saving these requests: end their kvtier sessions. Requests
        whose load failed (the workers reported its blocks) get a miss at their next lookup."""
        bad, failed = connector_output.invalid_block_ids, connector_output.failed_recving
        for req_id, (loading, blocks) in self._loading.items():
            loading.load_failed = bool(req_id in (failed or ()) or (bad and bad & blocks))
            self._end_handoff(loading)  # read (or failed): the server frees it
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

    # -- hand-offs (handoff.py) ------------------------------------------------------------------

    def _handoff_match(
        self, state: _Request, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A consumer's request names a hand-off: every prompt token but the last comes from
        it. While the producer still saves it, ask again later (None), until `handoff_wait`;
        then claim it all the same: its load fails, and vLLM's kv_load_failure_policy
        recomputes the request or fails it."""
        target = request.num_prompt_tokens - 1
        if state.load_failed or target <= num_computed_tokens:
            return 0, False
        if not state.handoff_known:
            client = self.client.try_connect("KVTierConnector scheduler")
            if client is None or not self.chunk_size:
                return 0, False  # no server: nothing to wait for; vLLM computes the prompt
            params = state.handoff_in
            assert params is not None
            why = handoff.refusal(
                params,
                request.num_prompt_tokens,
                self.config.model,
                self.config.world_size,
                self.chunk_size,
            )
            if why is not None:
                logger.error(
                    "KVTierConnector refuses hand-off %r: %s", params.get("kvtier_handoff"), why
                )
                state.handoff_known = True  # its load fails: the policy decides
            else:
                now = time.monotonic()
                if now - state.handoff_polled < _POLL_S:
                    return None, False
                state.handoff_polled = now
                names = self._handoff_names(state)
                found = state.recompute.call(
                    "hand-off lookup",
                    0,
                    client.exists_keys,
                    names,
                    model=self.config.model,
                    world_size=self.config.world_size,
                    cache_salt=request.cache_salt or "",
                )
                failed = state.recompute.last_error is not None
                if found < len(names) and now < state.handoff_deadline and not failed:
                    return None, False  # the producer still saves it
                if found < len(names):
                    logger.warning(
                        "KVTierConnector: hand-off %r holds %d of its %d chunks after %.1fs; its "
                        "load fails (vLLM's kv_load_failure_policy decides)",
                        params.get("kvtier_handoff"),
                        found,
                        len(names),
                        self.config.handoff_wait,
                    )
                state.handoff_known = True
        state.hit = target
        return target - num_computed_tokens, self.config.async_loads

    def _handoff_names(self, state: _Request) -> list[bytes]:
        params = state.handoff_in
        assert params is not None
        return handoff.names(
            str(params[handoff.HANDOFF_KEY]),
            int(params[handoff.TOKENS_KEY]),
            self.chunk_size,
            self.config.block_size,
        )

    def _handoff_loads(
        self, state: _Request, start: int, end: int, block_ids: tuple[list[int], ...]
    ) -> list[Transfer]:
        """A consumer's load of tokens [start, end) from its hand-off's objects; the blocks
        are whole, so the one holding the last prompt token is filled too (vLLM then writes
        that token's KV over it)."""
        params = state.handoff_in
        assert params is not None
        hid, n = str(params[handoff.HANDOFF_KEY]), int(params[handoff.TOKENS_KEY])
        b = self.config.block_size
        end = -(-end // b) * b
        out: list[Transfer] = []
        full = [o for o in handoff.objects(n, self.chunk_size, b) if o.chunk_start == o.first]
        tail = [o for o in handoff.objects(n, self.chunk_size, b) if o.chunk_start != o.first]
        spans = []
        if full:
            lo = max(start, full[0].first)
            first = [o for o in full if o.chunk_end > lo]
            if first:
                spans.append((first, first[0].chunk_start, first[-1].chunk_end, lo))
        spans.extend(([o], o.chunk_start, o.chunk_end, max(start, o.first)) for o in tail)
        for objs, chunk_start, chunk_end, lo in spans:
            hi = min(end, chunk_end)
            if hi <= lo:
                continue
            t = self._transfer(state, lo, hi, block_ids)
            out.append(
                replace(
                    t,
                    tokens=b"",
                    chunk_start=chunk_start,
                    chunk_end=chunk_end,
                    names=tuple(handoff.name(hid, o.index) for o in objs),
                )
            )
        return out

    def _plan_handoff_saves(
        self,
        meta: KVTierConnectorMetadata,
        state: _Request,
        block_ids: tuple[list[int], ...],
        computed: int,
    ) -> None:
        """A producer's hand-off saves this step: the full chunks it completes (or, in its
        first step, already holds), and with the prompt's last token, the tail."""
        assert state.handoff_out is not None
        c, n = self.chunk_size, state.request.num_prompt_tokens
        hid = state.handoff_out
        full = min(computed, n) // c * c
        if full > state.handoff_end:
            t = self._transfer(state, state.handoff_end, full, block_ids)
            meta.saves.append(
                replace(
                    t,
                    tokens=b"",
                    names=tuple(handoff.name(hid, i) for i in range(t.chunk_start // c, full // c)),
                    handoff=hid,
                )
            )
            state.handoff_end = full
            state.saves_planned = True
        if computed < n:
            return
        state.handoff_done = True
        objs = handoff.objects(n, c, self.config.block_size)
        if not objs or objs[-1].chunk_start == objs[-1].first:
            return  # a multiple of the chunk size: no tail
        tail = objs[-1]
        per_group = tuple(
            handoff.window_blocks(
                block_ids[g.index], tail.chunk_start // g.block_size, c // g.block_size
            )
            for g in self.config.groups
        )
        meta.saves.append(
            Transfer(
                request_id=state.request.request_id,
                kv_request_id=state.kv_request_id,
                tokens=b"",
                cache_salt=state.request.cache_salt or "",
                extra_key=b"",
                chunk_start=tail.chunk_start,
                chunk_end=tail.chunk_end,
                start=tail.chunk_start,
                end=tail.chunk_end,
                block_ids=per_group,
                names=(handoff.name(hid, tail.index),),
                handoff=hid,
            )
        )
        state.saves_planned = True

    def _end_handoff(self, state: _Request) -> None:
        """A consumer read its hand-off (or gave up on it): the server frees it."""
        if state.handoff_in is None or state.handoff_ended or not self.chunk_size:
            return
        state.handoff_ended = True
        names = self._handoff_names(state)
        self._quietly(
            state,
            "end of hand-off",
            lambda c: c.end_handoff(
                str(state.handoff_in[handoff.HANDOFF_KEY]) if state.handoff_in else "",
                names,
                model=self.config.model,
                world_size=self.config.world_size,
                cache_salt=state.request.cache_salt or "",
            ),
        )

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
            params = getattr(request, "kv_transfer_params", None)
            if self.config.role == "kv_producer":
                wanted = handoff.wanted(params)
                if wanted is not None:
                    state.handoff_out = wanted or f"{self._tag}-{request.request_id}"
            elif self.config.role == "kv_consumer":
                state.handoff_in = handoff.given(params)
                state.handoff_deadline = time.monotonic() + self.config.handoff_wait
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
