"""What an engine adapter puts in a model's kvtier name so that KV computed with other weights
is never served: a cheap fingerprint of a checkpoint folder, or of a Hugging Face revision.

A fingerprint reads file metadata and headers, never the tensors, so it costs milliseconds even
for a model of many gigabytes:

- every file at the folder's top level (hidden ones aside): its name and size, and what tells
  one version of its bytes from another: the blob name when the file is a link into a Hugging
  Face cache (a blob is named by the hash of its content), else its modification time;
- of each `.safetensors` file, its header (the 8-byte length and the JSON that lists every
  tensor's dtype, shape and offsets).

Modification times are in it because a re-save of the same architecture with other values
keeps every name, size and header: without the times, the new weights would read the old
weights' KV. The cost is the other way round and harmless: a copy that does not keep times
(`cp` without `-p`) is named anew and starts cold.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import msgspec

__all__ = [
    "ModelIdentity",
    "adapter_identity",
    "checkpoint_fingerprint",
    "model_identity",
    "safetensors_header",
]

logger = logging.getLogger(__name__)

#: the safetensors format refuses headers past 100 MB; a longer one is not read
MAX_SAFETENSORS_HEADER = 100_000_000
FINGERPRINT_HEX = 32  # 128 bits of blake3


def safetensors_header(path: str | os.PathLike[str]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file (b"" if it has none)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return raw
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_SAFETENSORS_HEADER:
            return raw  # not a header kvtier reads: the length alone goes in
        return raw + f.read(n)


def _version_of(entry: os.DirEntry[str], stat: os.stat_result) -> tuple[str, str | int]:
    """What tells this file's bytes from another version's: the blob name of a Hugging Face
    cache link (the hash of the content), else the modification time in nanoseconds."""
    if entry.is_symlink():
        target = Path(entry.path).resolve()
        if target.parent.name == "blobs":
            return ("blob", target.name)
    return ("mtime", stat.st_mtime_ns)


def checkpoint_fingerprint(folder: str | os.PathLike[str]) -> str:
    """A hex fingerprint of the checkpoint in `folder` (see the module docstring)."""
    parts: list[tuple[str, int, tuple[str, str | int], bytes]] = []
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.startswith(".") or not entry.is_file():
                continue
            stat = entry.stat()  # follows a link: the blob's size, not the link's
            header = safetensors_header(entry.path) if entry.name.endswith(".safetensors") else b""
            parts.append((entry.name, stat.st_size, _version_of(entry, stat), header))
    encoded = msgspec.msgpack.encode(["kvtier-checkpoint/1", parts])
    return blake3.blake3(encoded).hexdigest()[:FINGERPRINT_HEX]


@dataclass(frozen=True)
class ModelIdentity:
    """How an adapter names one checkpoint's weights.

    `exact` is False when the weights could not be looked at (a Hugging Face id that is not in
    the local cache): the name then says only the id and the revision asked for.
    """

    label: str
    exact: bool


def _hf_snapshot(repo_id: str, revision: str | None, probe: str) -> Path | None:
    """The local Hugging Face cache's snapshot folder of `repo_id` at `revision`, if its file
    `probe` is cached."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found: Any = try_to_load_from_cache(repo_id, probe, revision=revision)
    except Exception:  # an id the hub library refuses (a path that is not there, say)
        return None
    if not isinstance(found, str):
        return None
    return Path(found).parent


def model_identity(model: str, revision: str | None = None) -> ModelIdentity:
    """`w<fingerprint>` for a local folder; `hf@<commit>` for a Hugging Face id in the local
    cache (the files of a commit never change); else `<revision or main>`, not exact."""
    if os.path.isdir(model):
        return ModelIdentity(f"w{checkpoint_fingerprint(model)}", exact=True)
    snapshot = _hf_snapshot(model, revision, "config.json")
    if snapshot is not None:
        return ModelIdentity(f"hf@{snapshot.name}", exact=True)
    asked = revision or "main"
    logger.warning(
        "kvtier: %r is neither a local folder nor in the local Hugging Face cache; its KV is "
        "named by the id and revision %r only. Name the model explicitly (extra config "
        "`model`) if the weights behind that revision can change.",
        model,
        asked,
    )
    return ModelIdentity(f"rev@{asked}", exact=False)


def adapter_identity(path: str) -> str | None:
    """A LoRA adapter's fingerprint: its folder's, or its cached Hugging Face commit's; None
    when neither is on this machine (the request cannot be named, so it is not cached)."""
    if os.path.isdir(path):
        return f"w{checkpoint_fingerprint(path)}"
    snapshot = _hf_snapshot(path, None, "adapter_config.json")
    return None if snapshot is None else f"hf@{snapshot.name}"
