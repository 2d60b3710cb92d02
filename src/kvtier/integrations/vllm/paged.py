"""Copies between vLLM's paged KV cache and kvtier chunk slots, with no contiguous staging copy.

vLLM (0.32 and 0.33) hands each layer's KV to a connector as a logical view
`[num_blocks, num_heads, block_size, content]`, where `content` is a token's K then V for one
head, whatever the physical layout (strides) underneath. A kvtier chunk of `C` tokens is that
view's pages for the chunk's blocks, layer by layer:

    chunk = (num_layers, C // block_size, num_heads, block_size, content)

so on the head-major layout vLLM's CPU backend uses (LBHNC) each (layer, block) of a chunk is one
contiguous page, and a copy is a memcpy of whole pages (runs of consecutive pages at once)
straight between vLLM's blocks and the arena slot. Other layouts are copied through their
strides.

On a GPU the same copies go through the arena registered as pinned host memory, asynchronously
on a side stream (see `GpuCopier`); the CPU path is `CpuCopier`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvtier.errors import InvalidArgumentError

Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class PagedLayout:
    """One worker's paged KV cache: its layers' logical views and a chunk's shape."""

    layers: tuple[torch.Tensor, ...]  # each [num_blocks, heads, kernel_block_size, content]
    block_size: int  # vLLM's block (the scheduler's unit)
    kernel_block_size: int  # tokens per page of the views (divides block_size)
    chunk_size: int

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        layer_names: Sequence[str],
        block_size: int,
        chunk_size: int,
    ) -> PagedLayout:
        """The layers of `kv_caches` in `layer_names` order; refuses views it cannot copy."""
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise InvalidArgumentError(
                f"register_kv_caches got no KV for layers {missing[:3]}: KVTierConnector needs "
                "every layer of the full-attention group"
            )
        layers = tuple(kv_caches[n] for n in layer_names)
        first = layers[0]
        if first.dim() != 4:
            raise InvalidArgumentError(
                f"KVTierConnector expects vLLM's logical per-layer KV view [blocks, heads, "
                f"block_size, K+V] (vLLM >= 0.32); got shape {tuple(first.shape)}"
            )
        for name, t in zip(layer_names, layers, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise InvalidArgumentError(
                    f"layer {name!r} KV is {tuple(t.shape)} {t.dtype} on {t.device}, unlike "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: KVTierConnector "
                    "needs every layer alike"
                )
        kernel = int(first.shape[2])
        if block_size % kernel or chunk_size % block_size:
            raise InvalidArgumentError(
                f"block_size={block_size} must be a multiple of the kernel block {kernel}, and "
                f"kvtier's chunk size {chunk_size} a multiple of block_size"
            )
        return cls(layers, block_size, kernel, chunk_size)

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        _, heads, kernel, content = self.layers[0].shape
        return (len(self.layers), self.chunk_size // kernel, heads, kernel, content)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def pages(self, block_ids: Sequence[int]) -> list[int]:
        """The views' page indices for vLLM blocks, in token order."""
        r = self.pages_per_block
        if r == 1:
            return list(block_ids)
        return [b * r + i for b in block_ids for i in range(r)]

    def chunk_view(self, slot: Bytes) -> torch.Tensor:
        """A chunk slot's bytes as a tensor of `chunk_shape` (no copy)."""
        with warnings.catch_warnings():  # retrieved views are read-only; loads only read them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(slot)
        return flat.view(self.dtype).view(self.chunk_shape)


def page_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(offset in `pages`, first page, count) for each run of consecutive page indices: a run
    is copied as one slice (a fresh engine's blocks are mostly consecutive)."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            offset, first, count = runs[-1]
            runs[-1] = (offset, first, count + 1)
        else:
            runs.append((i, page, 1))
    return runs


class CpuCopier:
    """Page copies on the CPU as numpy byte copies: one memcpy per run of consecutive pages
    and layer. Single-threaded on purpose: torch's parallel gather spins OpenMP threads that
    lose badly to a busy forward pass on the same cores, and numpy releases the GIL."""

    def __init__(self, layout: PagedLayout) -> None:
        self.layout = layout
        # each layer as bytes: [pages, heads, kernel_block_size, content bytes], any strides
        self._layers = [kv.view(torch.uint8).numpy() for kv in layout.layers]
        _, pages, heads, kernel, _ = layout.chunk_shape
        self._chunk_shape = (len(self._layers), pages, heads, kernel, self._layers[0].shape[-1])

    def save(self, slot: Bytes, pages: Sequence[int]) -> None:
        """Copy a whole chunk's pages (in token order) into the arena slot."""
        chunk = slot.reshape(self._chunk_shape)
        runs = page_runs(pages)
        for layer, kv in enumerate(self._layers):
            dst = chunk[layer]
            for offset, first, count in runs:
                np.copyto(dst[offset : offset + count], kv[first : first + count])

    def load(self, slot: Bytes, first_page: int, pages: Sequence[int]) -> None:
        """Copy the chunk's pages [first_page, first_page + len(pages)) into vLLM's `pages`."""
        chunk = slot.reshape(self._chunk_shape)
        runs = page_runs(pages)
        for layer, kv in enumerate(self._layers):
            src = chunk[layer]
            for offset, first, count in runs:
                at = first_page + offset
                np.copyto(kv[first : first + count], src[at : at + count])

    def sync(self) -> None:
        """Copies are done when the calls return on the CPU."""


class GpuCopier:
    """Page copies between GPU blocks and the arena, which is registered as pinned host memory
    so the copies run asynchronously on a side stream; `sync()` waits for them.

    Not exercised by `make test` (there is no GPU there): the GPU check runs it.
    """

    def __init__(self, layout: PagedLayout, arena: Bytes | None) -> None:
        self.layout = layout
        self.stream = torch.cuda.Stream(device=layout.device)
        if arena is not None:
            pin_host_memory(arena)

    def save(self, slot: Bytes, pages: Sequence[int]) -> None:
        chunk = self.layout.chunk_view(slot)
        index = torch.tensor(pages, dtype=torch.int64, device=self.layout.device)
        with torch.cuda.stream(self.stream):
            for layer, kv in enumerate(self.layout.layers):
                chunk[layer].copy_(torch.index_select(kv, 0, index), non_blocking=True)

    def load(self, slot: Bytes, first_page: int, pages: Sequence[int]) -> None:
        chunk = self.layout.chunk_view(slot)
        index = torch.tensor(pages, dtype=torch.int64, device=self.layout.device)
        stop = first_page + len(pages)
        with torch.cuda.stream(self.stream):
            for layer, kv in enumerate(self.layout.layers):
                src = chunk[layer, first_page:stop].to(kv.device, non_blocking=True)
                kv.index_copy_(0, index, src)

    def sync(self) -> None:
        self.stream.synchronize()


_PINNED: set[int] = set()


def pin_host_memory(buffer: Bytes) -> None:
    """Register a host buffer (the shared-memory arena) with CUDA as pinned memory, once."""
    address = int(buffer.ctypes.data)
    if address in _PINNED:
        return
    err = torch.cuda.cudart().cudaHostRegister(address, int(buffer.nbytes), 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of kvtier's arena failed: {err}")
    _PINNED.add(address)


Copier = CpuCopier | GpuCopier


def copier_for(layout: PagedLayout, arena: Bytes | None) -> Copier:
    """The copier for the device the KV cache lives on."""
    if layout.device.type == "cuda":
        return GpuCopier(layout, arena)
    if layout.device.type != "cpu":
        raise InvalidArgumentError(
            f"KVTierConnector copies KV on CPU or CUDA devices; this cache is on {layout.device}"
        )
    return CpuCopier(layout)
