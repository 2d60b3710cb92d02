"""Reuse kvtier-cached KV in a Hugging Face transformers causal LM, so prefill computes only the
tokens kvtier does not hold.

A chunk's KV travels as one contiguous array of shape
`(num_layers, 2, chunk_size, num_kv_heads_of_this_rank, head_dim)` (index 0 of the second axis is
K, 1 is V) in the model's dtype; a rank of a tensor-parallel group holds the KV heads
`[r * h / world_size, (r + 1) * h / world_size)`.
"""

from __future__ import annotations

import inspect
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    import torch
    from transformers import DynamicCache, PreTrainedModel
except ModuleNotFoundError as exc:  # the core package never installs torch or transformers
    raise ModuleNotFoundError(
        f"kvtier.integrations.transformers needs torch and transformers ({exc.name} is "
        "missing): install the transformers extra, pip install '.[transformers]' in the kvtier "
        "clone",
        name=exc.name,
    ) from None

from kvtier import hashing
from kvtier.client import ChunkRange, Client
from kvtier.errors import KVTierError
from kvtier.integrations.seam import Recompute, agree_min, head_range

TOKEN_DTYPE = hashing.TOKEN_DTYPE

logger = logging.getLogger(__name__)

# All-gather across the ranks of a tensor-parallel group: every rank passes a tensor of the same
# shape and gets back all ranks' tensors in rank order (e.g. built on torch.distributed).
Exchange = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV cache: what a chunk of it looks like."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> KVGeometry:
        """Reads the geometry from a transformers model's (text) config and parameters."""
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        dtype = next(model.parameters()).dtype
        return cls(int(text.num_hidden_layers), int(kv_heads), int(head_dim), dtype)

    def chunk_shape(self, chunk_size: int, world_size: int = 1) -> tuple[int, int, int, int, int]:
        """One rank's chunk: (num_layers, 2, chunk_size, kv_heads // world_size, head_dim)."""
        heads = head_range(self.num_kv_heads, world_size, 0)
        return (self.num_layers, 2, chunk_size, heads.stop - heads.start, self.head_dim)

    @property
    def dtype_name(self) -> str:
        """The dtype as kvtier names it: 'float32', 'bfloat16', ..."""
        return str(self.dtype).removeprefix("torch.")


def split_heads(chunks: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Cuts chunks `(N, L, 2, C, H, D)` into `world_size` contiguous head shards, rank order."""
    heads = chunks.shape[-2]
    return [
        chunks[..., head_range(heads, world_size, r), :].contiguous() for r in range(world_size)
    ]


def merge_heads(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_heads`: joins rank-ordered head shards into full chunks."""
    if not shards:
        raise ValueError("merge_heads needs at least one shard")
    return torch.cat(list(shards), dim=-2)


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.54


def cache_to_chunks(
    cache: Any,
    start: int,
    end: int,
    chunk_size: int,
    *,
    heads: slice | None = None,
) -> torch.Tensor:
    """Copies tokens [start, end) of a transformers cache (batch 1) into chunks
    `(N, L, 2, C, H, D)`, keeping only `heads` of the KV heads when given."""
    if start % chunk_size or end % chunk_size or not 0 <= start <= end:
        raise ValueError(f"token range [{start}, {end}) is not aligned to chunk_size={chunk_size}")
    if end > cache.get_seq_length():
        raise ValueError(f"end={end} is past the cache's {cache.get_seq_length()} tokens")
    num_layers = len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)
    keys0, _ = _layer_kv(cache, 0)
    if keys0.shape[0] != 1:
        raise ValueError(f"only batch size 1 is supported, the cache has {keys0.shape[0]}")
    heads = heads or slice(0, keys0.shape[1])
    num_heads = heads.stop - heads.start
    num_chunks = (end - start) // chunk_size
    out = torch.empty(
        (num_chunks, num_layers, 2, chunk_size, num_heads, keys0.shape[-1]), dtype=keys0.dtype
    )
    for layer in range(num_layers):
        for kv, tensor in enumerate(_layer_kv(cache, layer)):
            # (H, T, D) -> (H, N, C, D) -> (N, C, H, D)
            part = tensor[0, heads, start:end].reshape(num_heads, num_chunks, chunk_size, -1)
            out[:, layer, kv].copy_(part.permute(1, 2, 0, 3))
    return out


def chunks_to_cache(chunks: torch.Tensor, cache: Any) -> Any:
    """Appends chunks `(N, L, 2, C, H, D)` to an empty transformers cache (batch 1); returns it."""
    if chunks.dim() != 6 or chunks.shape[2] != 2:
        raise ValueError(f"chunks of shape {tuple(chunks.shape)} are not (N, L, 2, C, H, D)")
    if cache.get_seq_length() != 0:
        raise ValueError("chunks_to_cache fills an empty cache only")
    num_chunks, num_layers, _, chunk_size, num_heads, head_dim = chunks.shape
    tokens = num_chunks * chunk_size
    for layer in range(num_layers):
        # (N, C, H, D) -> (H, N, C, D) -> (1, H, T, D)
        k, v = (
            chunks[:, layer, kv].permute(2, 0, 1, 3).reshape(1, num_heads, tokens, head_dim)
            for kv in (0, 1)
        )
        cache.update(k, v, layer)
    return cache


def new_cache(model: PreTrainedModel) -> Any:
    """An empty DynamicCache laid out for `model` (sliding layers and all, where supported)."""
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers versions whose DynamicCache takes no config
        return DynamicCache()


def as_token_array(input_ids: Any) -> npt.NDArray[np.uint32]:
    """One sequence of token ids (list, numpy or torch, shape (T,) or (1, T)) as '<u4' numpy."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().cpu().numpy()
    array = np.asarray(input_ids)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise ValueError(f"input_ids of shape {array.shape} must be one sequence: (T,) or (1, T)")
    if array.size == 0:
        raise ValueError("input_ids is empty: there is nothing to prefill")
    if array.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be integer token ids, got dtype {array.dtype}")
    return hashing.as_token_array(array)  # range-checked: a negative id is an error, not a wrap


class ModelRunner:
    """Calls a transformers causal LM on a span of tokens with an explicit cache and positions,
    whatever the installed version names the cache argument."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._cache_position = "cache_position" in params
        self._logits_arg = next(
            (n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None
        )

    def forward(self, tokens: npt.NDArray[np.uint32], start: int, cache: Any) -> torch.Tensor:
        """Runs `tokens` at positions start.. on top of `cache` (holding `start` tokens);
        returns the last position's logits (vocab,)."""
        assert cache.get_seq_length() == start
        device = next(self.model.parameters()).device
        ids = torch.from_numpy(tokens.astype(np.int64)).to(device).unsqueeze(0)
        positions = torch.arange(start, start + len(tokens), device=device)
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "position_ids": positions.unsqueeze(0),
            self._cache_arg: cache,
            "use_cache": True,
        }
        if self._cache_position:
            kwargs["cache_position"] = positions
        if self._logits_arg:
            kwargs[self._logits_arg] = 1
        with torch.no_grad():
            out = self.model(**kwargs)
        logits: torch.Tensor = out.logits[0, -1]
        return logits


def full_prefill(model: PreTrainedModel, input_ids: Any) -> tuple[torch.Tensor, Any]:
    """Prefill without kvtier: the baseline kvtier's reuse must match. Returns (logits, cache)."""
    tokens = as_token_array(input_ids)
    cache = new_cache(model)
    return ModelRunner(model).forward(tokens, 0, cache), cache


class KVTierCache:
    """Prefill and greedy generation for one transformers model that reuse the KV kvtier holds
    for a prompt's leading chunks and store back the chunks they compute."""

    def __init__(
        self,
        model: PreTrainedModel,
        client: Client,
        model_name: str,
        *,
        cache_salt: str = "",
        world_size: int = 1,
        worker_id: int = 0,
        store_generated: bool = False,
        exchange: Exchange | None = None,
    ) -> None:
        """With world_size > 1, `exchange` all-gathers across the group's ranks: each rank
        stores and retrieves its own KV heads and assembles all heads from its peers."""
        if world_size > 1 and exchange is None:
            raise ValueError(
                f"world_size={world_size} needs exchange=, an all-gather across the ranks"
            )
        self.model = model
        self.client = client
        self.model_name = model_name
        self.cache_salt = cache_salt
        self.world_size = world_size
        self.worker_id = worker_id
        self.store_generated = store_generated
        self.exchange = exchange
        self.geometry = KVGeometry.from_model(model)
        self.heads = head_range(self.geometry.num_kv_heads, world_size, worker_id)
        self.chunk_size = int(client.chunk_size)
        self.runner = ModelRunner(model)
        self.last_timings: dict[str, float] = {}
        self.last_hit_tokens = 0
        self._recompute = Recompute("transformers KVTierCache")
        client.register(
            model=model_name,
            world_size=world_size,
            worker_id=worker_id,
            chunk_shape=self.geometry.chunk_shape(self.chunk_size, world_size),
            dtype=self.geometry.dtype_name,
        )

    def prefill(self, input_ids: Any) -> tuple[torch.Tensor, Any]:
        """Prefill reusing kvtier's cached leading chunks; returns the last position's logits
        (vocab,) and the model's filled cache. Timings land in `last_timings`."""
        tokens = as_token_array(input_ids)
        request_id = uuid.uuid4().hex
        self._recompute.reset()
        timings = {k: 0.0 for k in ("lookup", "retrieve", "copy", "compute", "store")}
        c = self.chunk_size
        try:
            t0 = time.perf_counter()
            hit = self._or_zero(
                "lookup",
                self.client.lookup,
                request_id,
                tokens,
                model=self.model_name,
                world_size=self.world_size,
                cache_salt=self.cache_salt,
            )
            hit = self._agree(hit)
            # Keep at least one token to compute, or there would be no logits.
            planned = reuse = min(hit, (len(tokens) - 1) // c * c)
            t1 = time.perf_counter()
            timings["lookup"] = t1 - t0
            cache = new_cache(self.model)
            if reuse:
                chunks = self._retrieve(request_id, tokens, reuse)
                reuse = chunks.shape[0] * c
                t2 = time.perf_counter()
                timings["retrieve"] = t2 - t1
                if reuse:
                    chunks_to_cache(chunks, cache)
                del chunks
                timings["copy"] = time.perf_counter() - t2
            self._or_zero("release", self.client.release, request_id, cache_salt=self.cache_salt)
            t3 = time.perf_counter()
            logits = self.runner.forward(tokens[reuse:], reuse, cache)
            t4 = time.perf_counter()
            timings["compute"] = t4 - t3
            # Chunks below `hit` are stored already unless a retrieve came back short.
            stored_from = hit if reuse == planned else reuse
            self._store(request_id, tokens, cache, stored_from)
            timings["store"] = time.perf_counter() - t4
        finally:
            self._or_zero(
                "end_session", self.client.end_session, request_id, cache_salt=self.cache_salt
            )
        timings["ttft"] = sum(timings[k] for k in ("lookup", "retrieve", "copy", "compute"))
        timings["total"] = timings["ttft"] + timings["store"]
        self.last_timings = timings
        self.last_hit_tokens = reuse
        return logits, cache

    def generate(self, input_ids: Any, max_new_tokens: int = 32) -> torch.Tensor:
        """Greedy decoding after a kvtier-backed prefill; returns prompt and new ids, (1, T + n)
        like `model.generate`. With store_generated, the new tokens' full chunks are stored."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        tokens = as_token_array(input_ids)
        logits, cache = self.prefill(tokens)
        prefill_timings = self.last_timings
        generated: list[int] = []
        for step in range(max_new_tokens):
            generated.append(int(torch.argmax(logits)))
            if step + 1 < max_new_tokens:
                position = len(tokens) + step
                new = np.array(generated[-1:], dtype=TOKEN_DTYPE)
                logits = self.runner.forward(new, position, cache)
        everything = np.concatenate([tokens, np.array(generated, dtype=TOKEN_DTYPE)])
        if self.store_generated:
            t0 = time.perf_counter()
            start = len(tokens) // self.chunk_size * self.chunk_size
            # not self.store(): a kvtier failure during the prefill must not be retried here
            self._store_new(everything[: cache.get_seq_length()], cache, start)
            prefill_timings["store_generated"] = time.perf_counter() - t0
        self.last_timings = prefill_timings
        return torch.from_numpy(everything.astype(np.int64)).unsqueeze(0)

    def store(self, input_ids: Any, cache: Any, *, start: int = 0) -> int:
        """Stores the full chunks of a filled cache from token `start` on (e.g. after a prefill
        done without kvtier); returns the tokens stored."""
        self._recompute.reset()
        return self._store_new(as_token_array(input_ids), cache, start)

    def _store_new(self, tokens: npt.NDArray[np.uint32], cache: Any, start: int) -> int:
        request_id = uuid.uuid4().hex
        stored = self._store(request_id, tokens, cache, start)
        if self._full_end(tokens, cache) > start:  # only a store call opens a session
            self._or_zero(
                "end_session", self.client.end_session, request_id, cache_salt=self.cache_salt
            )
        return stored

    def _full_end(self, tokens: npt.NDArray[np.uint32], cache: Any) -> int:
        """Where the last full chunk of what both the tokens and the cache hold ends."""
        return min(len(tokens), int(cache.get_seq_length())) // self.chunk_size * self.chunk_size

    def _store(
        self, request_id: str, tokens: npt.NDArray[np.uint32], cache: Any, start: int
    ) -> int:
        c = self.chunk_size
        if start % c:
            raise ValueError(f"start={start} is not aligned to chunk_size={c}")
        end = self._full_end(tokens, cache)
        stored = 0
        if end > start:
            stored = self._or_zero(
                "store",
                self.client.store,
                self._chunks(request_id, tokens, start, end),
                cache_to_chunks(cache, start, end, c, heads=self.heads),
            )
        # A barrier: no rank of a group looks up again before every rank's shards are stored.
        self._agree(0)
        return stored

    def _retrieve(self, request_id: str, tokens: npt.NDArray[np.uint32], end: int) -> torch.Tensor:
        """This rank's chunks [0, end), merged with the other ranks' heads; may come back short."""
        c = self.chunk_size
        shape = self.geometry.chunk_shape(c, self.world_size)
        out = torch.empty((end // c, *shape), dtype=self.geometry.dtype)
        got = self._or_zero(
            "retrieve", self.client.retrieve, self._chunks(request_id, tokens, 0, end), out
        )
        got = self._agree(got)
        out = out[: got // c]
        if self.exchange is None:
            return out
        return merge_heads(self.exchange(out.contiguous()))

    def _chunks(
        self, request_id: str, tokens: npt.NDArray[np.uint32], start: int, end: int
    ) -> ChunkRange:
        """This rank's chunks [start, end) of the request's tokens, as kvtier names them."""
        return ChunkRange(
            request_id,
            tokens[:end],
            model=self.model_name,
            start=start,
            end=end,
            worker_id=self.worker_id,
            cache_salt=self.cache_salt,
        )

    @property
    def last_error(self) -> KVTierError | None:
        """The kvtier error the last call worked around (it then computed without the cache)."""
        return self._recompute.last_error

    def _or_zero(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        """A kvtier call whose failure costs a recompute, never the request (the seam's rule):
        it reads as 0 tokens, and every rank still reaches the next `_agree`, so a
        tensor-parallel group stays in step and agrees on the smaller span."""
        return int(self._recompute.call(what, 0, call, *args, **kwargs) or 0)

    def _agree(self, tokens: int) -> int:
        """The smallest of the ranks' token counts, so every rank reuses the same span."""
        if self.exchange is None:
            return tokens
        return agree_min(t.item() for t in self.exchange(torch.tensor([tokens], dtype=torch.int64)))
