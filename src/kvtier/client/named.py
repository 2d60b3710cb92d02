"""The client's calls on key-addressed chunks: chunks the caller names itself (SGLang's page
hashes, a prefill instance's hand-off), rather than by a prompt's tokens and a range.

`NamedChunkCalls` is a base of `Client`, over the client's connection and the world sizes its
workers registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier import protocol as p
from kvtier.client.arrays import chunk_rows
from kvtier.client.connection import Connection, reply_as
from kvtier.client.copying import copy_pairs
from kvtier.client.slots import RetrievedSlots, StoreSlots
from kvtier.errors import BadArrayError, ProtocolVersionError
from kvtier.names import ChunkName, check_names

__all__ = ["NamedChunkCalls"]


class NamedChunkCalls:
    """Exists, store, retrieve and hand-off calls on chunks named by the caller."""

    _connection: Connection
    _world_sizes: dict[str, int]  # per model, as registered: a call's default world size

    def exists_keys(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        prefill_tokens_per_s: float = 0.0,
    ) -> int:
        """How many leading named chunks every rank has stored (L2 hits are loaded into L1;
        with `prefill_tokens_per_s`, as for `lookup`, not those slower to load than recompute)."""
        names = check_names(names)
        msg = p.ExistsKeys(
            names,
            model,
            world_size,
            cache_salt,
            extra_key,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        raw, _ = self._connection.call(msg)
        return reply_as(raw, p.ExistsReply, "ExistsKeys").num_chunks

    def exists_each_key(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
    ) -> list[bool]:
        """Per named chunk, whether every rank has stored it (past a missing one too; L2 hits
        are loaded into L1)."""
        names = check_names(names)
        request = p.ExistsKeys(names, model, world_size, cache_salt, extra_key, each=True)
        raw, _ = self._connection.call(request)
        present = reply_as(raw, p.ExistsReply, "ExistsKeys").present
        if len(present) != len(names):
            raise ProtocolVersionError(
                f"the server answered {len(present)} flags for {len(names)} names: it predates "
                "ExistsKeys.each (upgrade the server)"
            )
        return present

    def store_key_slots(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        handoff: str = "",
    ) -> StoreSlots:
        """Slots to write this rank's named chunks into; `with` commits them.

        As `store_slots`, with `targets()` indexing into `names` and `stored_chunks` counting
        the named chunks stored after the commit. `handoff`: the chunks are (part of) hand-off
        object `handoff` for one reader, pinned until `end_handoff` or the server's
        --handoff-lease (never subject to the cache policy).
        """
        fields = self._key_fields(
            names, model, worker_id, chunk_shape, dtype, cache_salt, extra_key, world_size
        )
        if handoff:
            fields.update(request_id=handoff, handoff=True)
        return StoreSlots(
            self._connection, fields, reserve=p.ReserveKeys, store_inline=p.StoreKeysInline
        )

    def retrieve_key_slots(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> RetrievedSlots:
        """Read-only views of this rank's leading stored named chunks (as `retrieve_slots`)."""
        fields = self._key_fields(
            names, model, worker_id, chunk_shape, dtype, cache_salt, extra_key, world_size
        )
        return RetrievedSlots(self._connection, fields, retrieve=p.RetrieveKeys)

    def put_keys(
        self,
        names: Sequence[ChunkName],
        chunks: Any,
        *,
        model: str,
        worker_id: int = 0,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> int:
        """Store this rank's named chunks from `chunks` (len(names), *chunk_shape).

        Returns how many of them are now stored (written now or already present).
        """
        names = check_names(names)
        rows, shape, dtype = chunk_rows(chunks, "chunks", writable=False)
        if rows.shape[0] != len(names):
            raise BadArrayError(f"{len(names)} names but {rows.shape[0]} chunks in the array")
        if self._connection.arena_bytes is None:  # inline: the rows themselves, no staging copy
            fields = self._key_fields(
                names, model, worker_id, shape, dtype, cache_salt, extra_key, world_size
            )
            raw, _ = self._connection.call(
                p.StoreKeysInline(**fields), p.inline_frames(rows[i] for i in range(len(rows)))
            )
            return reply_as(raw, p.StoreReply, "StoreKeysInline").stored_chunks
        slots = self.store_key_slots(
            names,
            model=model,
            worker_id=worker_id,
            chunk_shape=shape,
            dtype=dtype,
            cache_salt=cache_salt,
            extra_key=extra_key,
            world_size=world_size,
        )
        with slots:
            copy_pairs([(view, rows[i]) for i, view in slots.targets()])
        return slots.stored_chunks

    def get_keys(
        self,
        names: Sequence[ChunkName],
        out: Any,
        *,
        model: str,
        worker_id: int = 0,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> int:
        """Copy this rank's leading stored named chunks into `out` (>= len(names), *chunk_shape).

        Returns how many leading names were copied: it stops at the first one not stored.
        """
        names = check_names(names)
        rows, shape, dtype = chunk_rows(out, "out", writable=True)
        if rows.shape[0] < len(names):
            raise BadArrayError(f"out holds {rows.shape[0]} chunks, fewer than {len(names)} names")
        with self.retrieve_key_slots(
            names,
            model=model,
            worker_id=worker_id,
            chunk_shape=shape,
            dtype=dtype,
            cache_salt=cache_salt,
            extra_key=extra_key,
            world_size=world_size,
        ) as got:
            copy_pairs([(rows[i], view) for i, view in enumerate(got.views)])
        return got.num_chunks

    def _key_fields(
        self,
        names: Sequence[ChunkName],
        model: str,
        worker_id: int,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str,
        extra_key: bytes,
        world_size: int | None,
    ) -> dict[str, Any]:
        """The fields of a KeyRequest, names validated here before anything is sent."""
        checked = check_names(names)
        return {
            "names": checked,
            "model": model,
            "world_size": world_size or self._world_sizes.get(model, 1),
            "worker_id": worker_id,
            "chunk_shape": [int(d) for d in chunk_shape],
            "dtype": str(dtype).removeprefix("torch."),
            "num_chunks": len(checked),
            "cache_salt": cache_salt,
            "extra_key": extra_key,
        }

    def end_handoff(
        self,
        handoff: str,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
    ) -> None:
        """The reader has hand-off `handoff` (its chunks `names`): the server frees them from L1
        and deletes them from its L2 tiers."""
        checked = check_names(names)
        msg = p.EndHandoff(handoff, checked, model, world_size, cache_salt, extra_key)
        self._connection.call(msg)
