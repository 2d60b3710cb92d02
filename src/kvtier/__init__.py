"""kvtier: a KV-cache server for LLM inference engines."""

from kvtier.keys import ChunkKey, ObjectKey

__version__ = "0.1.0"

__all__ = ["ChunkKey", "ObjectKey", "__version__"]
