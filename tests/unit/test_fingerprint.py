"""Checkpoint fingerprints: what tells one set of weights from another without reading them."""

from __future__ import annotations

import json
import logging
import os
import random
import struct
from pathlib import Path

import pytest

from kvtier.integrations.fingerprint import (
    adapter_identity,
    checkpoint_fingerprint,
    model_identity,
    safetensors_header,
)


def save_file(tensors: dict[str, tuple[list[int], bytes]], path: str) -> None:
    """A safetensors file as the format defines it: a length, a JSON header, the F32 data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + len(data)]}
        at += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(d for _, d in tensors.values()))


def _values(
    shape: list[int], seed: int | None = None, fill: float = 0.0
) -> tuple[list[int], bytes]:
    n = 1
    for d in shape:
        n *= d
    rng = random.Random(seed)
    values = [rng.gauss(0, 1) if seed is not None else fill for _ in range(n)]
    return shape, struct.pack(f"<{n}f", *values)


def _checkpoint(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": _values([4, 4], seed)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"hidden_size": 4}')
    return folder


def test_the_same_files_give_the_same_fingerprint(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m", 0)
    assert checkpoint_fingerprint(folder) == checkpoint_fingerprint(str(folder))
    (folder / ".cache").mkdir()  # hidden entries (download bookkeeping) are not weights
    (folder / ".lock").write_text("x")
    (folder / "subdir").mkdir()
    assert checkpoint_fingerprint(folder) == checkpoint_fingerprint(str(folder))


def test_other_values_of_the_same_shapes_give_another_fingerprint(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m", 0)
    header = safetensors_header(folder / "model.safetensors")
    before = checkpoint_fingerprint(folder)
    stat = (folder / "model.safetensors").stat()
    _checkpoint(folder, 1)
    os.utime(folder / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # names, sizes and headers are all the same: only the file times tell the versions apart
    assert safetensors_header(folder / "model.safetensors") == header
    assert (folder / "model.safetensors").stat().st_size == stat.st_size
    assert checkpoint_fingerprint(folder) != before


@pytest.mark.parametrize("change", ["header", "size", "name", "new file"])
def test_any_change_of_the_files_changes_the_fingerprint(tmp_path: Path, change: str) -> None:
    folder = _checkpoint(tmp_path / "m", 0)
    weights = folder / "model.safetensors"
    before = checkpoint_fingerprint(folder)
    times = (weights.stat().st_atime_ns, weights.stat().st_mtime_ns)
    if change == "header":
        save_file({"v": _values([4, 4])}, str(weights))  # same size, another tensor name
    elif change == "size":
        save_file({"w": _values([4, 5])}, str(weights))
    elif change == "name":
        weights.rename(folder / "model-00001.safetensors")
        weights = folder / "model-00001.safetensors"
    else:
        (folder / "generation_config.json").write_text("{}")
    os.utime(weights, ns=times)  # the time alone does not carry the change
    assert checkpoint_fingerprint(folder) != before


def test_the_header_is_read_never_the_tensors(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"w": _values([1000], fill=1.0)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert safetensors_header(path) == raw[: 8 + n]
    huge = tmp_path / "huge.safetensors"  # a length past the format's limit: not read
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert safetensors_header(huge) == struct.pack("<Q", 1 << 40)


def _hf_cache(root: Path, repo: str, commit: str, blob: str) -> Path:
    """A Hugging Face cache entry laid out as huggingface_hub writes one."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "blobs").mkdir(parents=True)
    (base / "blobs" / blob).write_text('{"hidden_size": 4}')
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    snapshot = base / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(f"../../blobs/{blob}")
    return snapshot


def test_a_hugging_face_id_is_named_by_its_cached_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = _hf_cache(tmp_path, "org/tiny", commit, "b" * 64)
    assert model_identity("org/tiny") == model_identity("org/tiny", "main")
    identity = model_identity("org/tiny")
    assert identity.exact and identity.label == f"hf@{commit}"
    # a snapshot folder given as a path: its links name the blobs, whatever their times
    before = checkpoint_fingerprint(snapshot)
    os.utime(snapshot / "config.json", ns=(1, 1))
    assert checkpoint_fingerprint(snapshot) == before


def test_a_model_not_on_this_machine_is_named_by_its_revision_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        identity = model_identity("org/elsewhere", "v2")
    assert not identity.exact and identity.label == "rev@v2"
    assert "org/elsewhere" in caplog.text and "`model`" in caplog.text
    assert model_identity("org/elsewhere").label == "rev@main"
    assert adapter_identity(str(tmp_path / "no-adapter")) is None  # an adapter: not cached
    assert adapter_identity(str(_checkpoint(tmp_path / "adapter", 3))) is not None
