"""Names of stored things: `ChunkKey` for a chunk group, `ObjectKey` for one rank's shard.

Both are NamedTuples rather than dataclasses: they are dict keys on every hot path, and a tuple's
C-level hash is several times cheaper than a frozen dataclass's generated `__hash__`.
"""

from __future__ import annotations

from typing import NamedTuple


class ChunkKey(NamedTuple):
    """All tensor-parallel shards of one chunk: what a lookup asks about.

    `cache_salt` isolates tenants: keys that differ only in salt never alias.
    """

    model: str
    cache_salt: str
    world_size: int
    chunk_hash: bytes

    def shard(self, worker_id: int) -> ObjectKey:
        return ObjectKey(self.model, self.cache_salt, self.world_size, worker_id, self.chunk_hash)


class ObjectKey(NamedTuple):
    """One rank's shard of one chunk: what a storage tier holds."""

    model: str
    cache_salt: str
    world_size: int
    worker_id: int
    chunk_hash: bytes

    @property
    def chunk(self) -> ChunkKey:
        return ChunkKey(self.model, self.cache_salt, self.world_size, self.chunk_hash)

    def to_str(self) -> str:
        """A canonical, filesystem- and Redis-safe text form (model and salt are hex-encoded)."""
        return (
            f"{self.model.encode().hex()}.{self.cache_salt.encode().hex()}."
            f"{self.world_size}.{self.worker_id}.{self.chunk_hash.hex()}"
        )

    @classmethod
    def from_str(cls, text: str) -> ObjectKey:
        """Inverse of `to_str`; raises ValueError on text that is not a key."""
        parts = text.split(".")
        if len(parts) != 5:
            raise ValueError(f"not an object key: {text!r}")
        model, salt, world_size, worker_id, chunk_hash = parts
        return cls(
            bytes.fromhex(model).decode(),
            bytes.fromhex(salt).decode(),
            int(world_size),
            int(worker_id),
            bytes.fromhex(chunk_hash),
        )
