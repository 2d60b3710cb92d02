"""What one page of an SGLang host pool is to kvtier, and how its bytes move.

A page of a host pool (KV, SWA, Mamba, ...) is one key-addressed kvtier chunk named by SGLang's
page key, in a kvtier model of that pool's own (`PageGeometry.model`). Its bytes are the page's
pieces in the pool, one after the other, in the order SGLang's pool lists them: either the
pool's own pointers (`get_page_buffer_meta`, path "v1", copied straight between the host pool
and the arena) or the pool's flat data page (`get_data_page` / `set_from_flat_data_page`, path
"flat", for pools without zero-copy pointers).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.client import Client
from kvtier.client.copying import copy_addresses
from kvtier.layouts import DTYPE_SIZES

__all__ = ["PageGeometry", "flat_bytes", "load_pages", "page_geometry", "store_pages"]

Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class PageGeometry:
    """One pool's page as a kvtier chunk of `nbytes`, labelled `chunk_shape`/`dtype`, stored
    as shard `worker_id` of `world_size` (`writer`: this rank writes it).

    `page_size` is the host indices one page spans (a Mamba state slot is 1). `element_sizes`
    are the byte sizes of the page's pieces in the pool, in the order they are concatenated.
    """

    page_size: int
    element_sizes: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: str
    model: str
    path: str  # "v1" or "flat"
    world_size: int = 1
    worker_id: int = 0
    writer: bool = True

    @property
    def nbytes(self) -> int:
        return sum(self.element_sizes)

    def layout_args(self, cache_salt: str) -> dict[str, Any]:
        """The keyword arguments of the client's key-addressed calls for this pool."""
        return {
            "model": self.model,
            "worker_id": self.worker_id,
            "world_size": self.world_size,
            "chunk_shape": self.chunk_shape,
            "dtype": self.dtype,
            "cache_salt": cache_salt,
        }


def _layout_of(sizes: Sequence[int], dtype: str) -> tuple[tuple[int, ...], str]:
    """A registered chunk layout for pieces of `sizes` bytes in `dtype` (bytes if it cannot)."""
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize and len(set(sizes)) == 1 and sizes[0] % itemsize == 0:
        return (len(sizes), sizes[0] // itemsize), dtype
    return (sum(sizes),), "uint8"


def page_geometry(
    pool: Any,
    *,
    v1: bool,
    label: str,
    stage: str,
    world_size: int,
    worker_id: int,
    writer: bool,
) -> PageGeometry:
    """The geometry of `pool`'s pages. The kvtier model is `label` (the model, the pool, the
    layout), the dtype(s), the path and the pipeline `stage`. With `v1`, the pool's pointers
    when it has them."""
    dtypes = [str(pool.dtype).removeprefix("torch.")]
    temporal = getattr(pool, "temporal_dtype", None)  # a Mamba pool: conv and temporal dtypes
    if temporal is not None and temporal != pool.dtype:
        dtypes.append(str(temporal).removeprefix("torch."))
    page_size = int(pool.page_size)
    sizes: Sequence[int] | None = None
    if v1:
        try:
            _, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        except NotImplementedError:  # e.g. a Mamba pool with side states: whole pages only
            sizes = None
    if sizes is not None:
        path = "v1"
    else:
        page = pool.get_dummy_flat_data_page()
        sizes, path = [page.numel() * page.element_size()], "flat"
    element_sizes = tuple(int(s) for s in sizes)
    shape, dtype = _layout_of(element_sizes, dtypes[0] if len(dtypes) == 1 else "uint8")
    return PageGeometry(
        page_size,
        element_sizes,
        shape,
        dtype,
        f"{label} {'/'.join(dtypes)} {path}{stage}]",
        path,
        world_size,
        worker_id,
        writer,
    )


def page_starts(geometry: PageGeometry, num_keys: int, host_indices: torch.Tensor) -> list[int]:
    """The host index each page starts at; ValueError unless there are page_size per key."""
    if host_indices.numel() != num_keys * geometry.page_size:
        raise ValueError(
            f"{num_keys} keys need {num_keys * geometry.page_size} host indices, got "
            f"{host_indices.numel()}"
        )
    return [int(i) for i in host_indices.reshape(-1).tolist()[:: geometry.page_size]]


def _pointers(
    pool: Any, geometry: PageGeometry, num_keys: int, host_indices: torch.Tensor
) -> list[list[int]]:
    """Per page, the addresses of its pieces in the host pool, from the pool itself."""
    page_starts(geometry, num_keys, host_indices)
    per_page = len(geometry.element_sizes)
    ptrs, _ = pool.get_page_buffer_meta(host_indices)
    return [list(ptrs[i * per_page : (i + 1) * per_page]) for i in range(num_keys)]


def _pieces(
    geometry: PageGeometry, slots: Iterable[tuple[int, Bytes]], pointers: list[list[int]]
) -> list[tuple[int, int, int]]:
    """(slot address, host address, size) of every piece of every page listed: a slot holds
    its page's pieces one after the other, in the pool's order."""
    pieces: list[tuple[int, int, int]] = []
    for i, slot in slots:
        at = int(slot.ctypes.data)
        for ptr, size in zip(pointers[i], geometry.element_sizes, strict=True):
            pieces.append((at, ptr, size))
            at += size
    return pieces


def store_pages(
    client: Client,
    geometry: PageGeometry,
    pool: Any,
    keys: list[str],
    host_indices: torch.Tensor,
    cache_salt: str,
) -> None:
    """Store the pages at `host_indices` under `keys` (all or none; a kvtier error raises)."""
    if geometry.path == "v1":
        pointers = _pointers(pool, geometry, len(keys), host_indices)
        with client.store_key_slots(keys, **geometry.layout_args(cache_salt)) as slots:
            copy_addresses(_pieces(geometry, slots.targets(), pointers))
        return
    starts = page_starts(geometry, len(keys), host_indices)
    with client.store_key_slots(keys, **geometry.layout_args(cache_salt)) as slots:
        for i, view in slots.targets():
            page = pool.get_data_page(starts[i], flat=True).contiguous()
            address = flat_bytes(page, geometry.nbytes)
            if address is None:
                raise ValueError(f"a {geometry.model} page is not {geometry.nbytes} CPU bytes")
            ctypes.memmove(view.ctypes.data, address, geometry.nbytes)


def load_pages(
    client: Client,
    geometry: PageGeometry,
    pool: Any,
    keys: list[str],
    host_indices: torch.Tensor,
    cache_salt: str,
) -> int:
    """Load the leading stored pages of `keys` into `host_indices`; how many loaded."""
    if geometry.path == "v1":
        pointers = _pointers(pool, geometry, len(keys), host_indices)
        with client.retrieve_key_slots(keys, **geometry.layout_args(cache_salt)) as got:
            pieces = _pieces(geometry, enumerate(got.views), pointers)
            copy_addresses([(host, slot, n) for slot, host, n in pieces])
            return got.num_chunks
    starts = page_starts(geometry, len(keys), host_indices)
    with client.retrieve_key_slots(keys, **geometry.layout_args(cache_salt)) as got:
        for i, view in enumerate(got.views):
            page = pool.get_dummy_flat_data_page()
            address = flat_bytes(page, geometry.nbytes)
            if address is None:
                raise ValueError(f"a {geometry.model} page is not {geometry.nbytes} CPU bytes")
            ctypes.memmove(address, view.ctypes.data, geometry.nbytes)
            pool.set_from_flat_data_page(starts[i], page)
        return got.num_chunks


def flat_bytes(tensor: torch.Tensor, nbytes: int) -> int | None:
    """The address of a contiguous CPU tensor of exactly `nbytes`, else None."""
    if (
        tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.numel() * tensor.element_size() != nbytes
    ):
        return None
    return int(tensor.data_ptr())
