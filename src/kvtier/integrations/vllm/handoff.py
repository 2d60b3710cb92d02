"""Prefill/decode hand-offs: what a `kv_producer` stores for a `kv_consumer`, under which
names, and what the two say to each other through vLLM's `kv_transfer_params`.

A request asks a producer for a hand-off with `kv_transfer_params` `{"do_remote_decode": true}`
(what vLLM's own P/D proxies, llm-d and Dynamo send) or `{"kvtier_handoff": "<id>"}`. The
producer stores the whole prompt of n tokens as hand-off objects: the full chunks
`[i*C, (i+1)*C)` and, when n is not a multiple of C, one tail: the chunk-sized span of blocks
that ends at the prompt's last block, `[nb - C, nb)` with nb = n rounded up to whole blocks
(blocks before 0 are empty). The tail's sliding-window piece so ends where the decoder resumes.
The finished request's `kv_transfer_params` name the hand-off; given to a consumer, it loads all
but the last prompt token from it and computes that one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.names import MAX_NAME_BYTES

#: the keys of `kv_transfer_params` a hand-off travels under
HANDOFF_KEY = "kvtier_handoff"
TOKENS_KEY = "kvtier_tokens"
MODEL_KEY = "kvtier_model"
WORLD_KEY = "kvtier_world_size"
CHUNK_KEY = "kvtier_chunk_size"

MAX_HANDOFF_ID = MAX_NAME_BYTES - 16


@dataclass(frozen=True)
class HandoffObject:
    """One stored object of a hand-off: chunk-sized span [chunk_start, chunk_end) of blocks,
    whose tokens from `first` on are the decoder's to load (before: another object's)."""

    index: int
    chunk_start: int  # may be negative for a short prompt's tail
    chunk_end: int
    first: int


def objects(num_tokens: int, chunk_size: int, block_size: int) -> list[HandoffObject]:
    """The objects of a hand-off of `num_tokens` tokens, in order."""
    c = chunk_size
    full = num_tokens // c * c
    out = [HandoffObject(i, i * c, (i + 1) * c, i * c) for i in range(full // c)]
    if num_tokens > full:
        end = -(-num_tokens // block_size) * block_size
        out.append(HandoffObject(len(out), end - c, end, full))
    return out


def name(handoff_id: str, index: int) -> bytes:
    return f"{handoff_id}/{index}".encode()


def names(handoff_id: str, num_tokens: int, chunk_size: int, block_size: int) -> list[bytes]:
    return [name(handoff_id, o.index) for o in objects(num_tokens, chunk_size, block_size)]


def window_blocks(ids: list[int], first_block: int, count: int) -> tuple[int, ...]:
    """Blocks `first_block`.. of a block table, `count` of them; 0 (vLLM's null block) for
    those before the table's start or past its end."""
    return tuple(
        ids[b] if 0 <= b < len(ids) else 0 for b in range(first_block, first_block + count)
    )


def wanted(params: Any) -> str | None:
    """The hand-off id a producer's request asks for: its `kvtier_handoff`, "" for a
    `do_remote_decode` request (the producer names it), None for none."""
    if not isinstance(params, dict):
        return None
    given = params.get(HANDOFF_KEY)
    if isinstance(given, str) and given:
        return given
    return "" if params.get("do_remote_decode") else None


def produced(
    handoff_id: str, num_tokens: int, model: str, world_size: int, chunk_size: int
) -> dict[str, Any]:
    """The `kv_transfer_params` a producer's finished request returns for its decoder."""
    return {
        HANDOFF_KEY: handoff_id,
        TOKENS_KEY: num_tokens,
        MODEL_KEY: model,
        WORLD_KEY: world_size,
        CHUNK_KEY: chunk_size,
    }


def given(params: Any) -> dict[str, Any] | None:
    """A consumer request's hand-off params (None: it names none)."""
    if isinstance(params, dict) and params.get(HANDOFF_KEY) and TOKENS_KEY in params:
        return params
    return None


def refusal(
    params: dict[str, Any], num_tokens: int, model: str, world_size: int, chunk_size: int
) -> str | None:
    """Why this decode instance cannot read the hand-off (None: it can)."""
    handoff_id = params.get(HANDOFF_KEY)
    if not isinstance(handoff_id, str) or len(handoff_id.encode()) > MAX_HANDOFF_ID:
        return f"{HANDOFF_KEY} must be a string of at most {MAX_HANDOFF_ID} bytes"
    if params.get(WORLD_KEY) != world_size:
        return (
            f"the prefill instance stored it over {params.get(WORLD_KEY)} ranks and this decode "
            f"instance reads {world_size}: run prefill and decode instances with the same "
            "tensor- and pipeline-parallel sizes"
        )
    if params.get(MODEL_KEY) != model:
        return (
            f"the prefill instance's model is {params.get(MODEL_KEY)!r} and this decode "
            f"instance's is {model!r}: run the same model, dtype and --block-size on both"
        )
    if params.get(CHUNK_KEY) != chunk_size:
        return (
            f"the prefill instance's kvtier chunk is {params.get(CHUNK_KEY)} tokens and this "
            f"decode instance's is {chunk_size}: their kvtier servers must share --chunk-size"
        )
    if params.get(TOKENS_KEY) != num_tokens:
        return (
            f"it holds {params.get(TOKENS_KEY)} prompt tokens and this request has {num_tokens}: "
            "send the decode instance the same prompt"
        )
    return None
