"""Names of stored things: `ChunkKey` for a chunk group, `ObjectKey` for one rank's shard.

Both are NamedTuples rather than dataclasses: they are dict keys on every hot path, and a tuple's
C-level hash is several times cheaper than a frozen dataclass's generated `__hash__`.
"""

from __future__ import annotations

from typing import NamedTuple

from blake3 import blake3

__all__ = ["ChunkKey", "ObjectKey", "compose", "decompose", "shown", "with_extra_key"]

_EXTRA_KEY_CONTEXT = "kvtier 2026-12 chunk hash under an extra key v1"


def compose(*parts: str) -> str:
    """One string for a tuple of strings, built so that no choice of parts names another tuple.

    Each part is length-prefixed (`compose("a:b", "c")` is `"3:a:b1:c"`, `compose("a", "b:c")`
    is `"1:a3:b:c"`): a composite name (a tenant's model or salt, a session's id) never
    collides with another, whatever strings a client sends. Joining
    with a separator would let a client that puts the separator in a name reach another's key.
    """
    return "".join([f"{len(part)}:{part}" for part in parts])


def decompose(text: str) -> list[str]:
    """The parts `compose` joined; raises ValueError on text it did not build."""
    parts: list[str] = []
    i = 0
    while i < len(text):
        colon = text.find(":", i)
        if colon <= i or not (text[i:colon].isascii() and text[i:colon].isdigit()):
            raise ValueError(f"not a composed name: {text[:64]!r}")
        end = colon + 1 + int(text[i:colon])
        if end > len(text):
            raise ValueError(f"not a composed name: {text[:64]!r}")
        parts.append(text[colon + 1 : end])
        i = end
    return parts


def shown(text: str) -> str:
    """A tenant's composed model as people read it in metrics and logs, one label per name.

    The anonymous tenant's name is shown as it is (`llama`); another tenant's as
    `@tenant/name`, its tenant with `%`, `/` and `@` percent-escaped. An anonymous name that
    starts with `@` gets one more in front (`@@...`), so no anonymous name can pass for a
    tenant's label (`B/llama`, `@B/llama`) and no two (tenant, name) pairs share one. Text
    `compose` did not build is kept.
    """
    try:
        parts = decompose(text)
    except ValueError:
        return text
    if len(parts) != 2:
        return text
    tenant, name = parts
    if not tenant:
        return "@" + name if name.startswith("@") else name
    escaped = tenant.replace("%", "%25").replace("/", "%2F").replace("@", "%40")
    return f"@{escaped}/{name}"


def with_extra_key(chunk_hash: bytes, extra_key: bytes) -> bytes:
    """The hash a chunk is stored under when its request carries `extra_key`.

    An extra key stands for whatever besides the tokens changes their KV (a LoRA adapter,
    multimodal inputs): the same tokens under two extra keys are two chunks. Unchanged for the
    empty key; otherwise a BLAKE3 of the length-prefixed key and the hash, in a key-derivation
    context of its own (32 bytes), so it aliases neither a token chunk's hash nor a named one's.
    The extra key goes into every chunk's hash rather than into the salt, so clearing or
    counting by salt still covers all of a salt's chunks.
    """
    if not extra_key:
        return chunk_hash
    material = len(extra_key).to_bytes(2, "big") + extra_key + chunk_hash
    return blake3(material, derive_key_context=_EXTRA_KEY_CONTEXT).digest()


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
