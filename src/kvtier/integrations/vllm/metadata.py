"""What the scheduler-side connector tells the workers each step: which token ranges to load
into which blocks, which full chunks to save from which blocks, which requests were preempted.

Ranges are in tokens and block-aligned. `block_ids` has one tuple per KV cache group (in the
connector config's group order): for an attention group `block_ids[g][i]` holds tokens
`[start + i * B, start + (i + 1) * B)` at the group's block size B (a sliding-window group's
list keeps its length, with vLLM's null block 0 for blocks outside the window); for a Mamba group
it is the one block holding the recurrent state at `end`, or empty where no state exists there;
a load's Mamba tuple may name a second block, the one its step runs from (vLLM's `align` mode
copies the state at `end` there before the forward pass, so before the connector's load).
Loads and saves name whole kvtier chunks `[chunk_start, chunk_end)`; a load may skip the leading
blocks of its first chunk that vLLM's own prefix cache already holds (`start > chunk_start`).
A hand-off's transfers name their chunks (`names`); its tail's span may start before token 0
(its block ids there are the null block 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class Transfer:
    """One request's load or save of tokens [start, end) in one step."""

    request_id: str  # vLLM's request id
    kv_request_id: str  # the request's name in kvtier (unique across engines)
    tokens: bytes  # the request's token ids up to chunk_end, packed '<u4'
    cache_salt: str
    extra_key: bytes  # the request's other KV-changing inputs (inputs.py); b"" for none
    chunk_start: int  # first token of the first chunk involved
    chunk_end: int  # end of the last chunk involved
    start: int  # first token copied (>= chunk_start)
    end: int  # end of the tokens copied (<= chunk_end)
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group: blocks of [start, end)
    #: a hand-off's objects (handoff.py): the chunks' names, in order (empty: token-addressed)
    names: tuple[bytes, ...] = ()
    handoff: str = ""  # a producer's save: the hand-off id the objects are pinned under


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, built by the scheduler side and bound on every worker."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    #: vLLM ids of requests preempted this step: their pending saves finish first
    preempted: list[str] = field(default_factory=list)
