"""Copies between vLLM's paged KV cache and kvtier chunk slots, with no contiguous staging copy.

vLLM (0.32 and 0.33) hands each layer's KV to a connector as a logical view
`[num_blocks, num_heads, block_size, content]`, where `content` is a token's K then V for one
head, whatever the physical layout (strides) underneath. A kvtier chunk of `C` tokens is that
view's pages for the chunk's blocks, layer by layer:

    chunk = (num_layers, C // block_size, num_heads, block_size, content)

so on the head-major layout vLLM's CPU backend uses (LBHNC) each (layer, block) of a chunk is one
contiguous page, and a copy is a memcpy of whole pages (runs of consecutive pages at once)
straight between vLLM's blocks and the arena slot. Other layouts are copied
through their strides.

On a GPU the same copies go through the arena registered as pinned host memory, asynchronously
on a side stream (see `GpuCopier`); the CPU path is `CpuCopier`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvtier.copying import copy_addresses
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
    """Page copies on the CPU: one memcpy per run of consecutive pages and layer, gathered by
    `save` / `load` as (dst, src, size) addresses and run by `sync` (kvtier.copying).

    On vLLM's CPU layout every page is contiguous, so a copy is named by address arithmetic
    instead of numpy slices (a 16k-token transfer is thousands of page runs: slicing them cost
    about a tenth of the copy time). Other layouts are copied through their strides at once.
    `threads` > 1 splits the copies over a thread pool (ctypes releases the GIL); the default is
    one, on the calling thread: on this machine's shared cores a second thread did not pay, and
    the saver thread runs beside the forward pass. Torch's `index_select` / `index_copy_` are not
    used: their OpenMP threads lose badly to a busy forward pass on the same cores."""

    def __init__(self, layout: PagedLayout, threads: int = 1) -> None:
        self.layout = layout
        self.threads = max(1, threads)
        # each layer as bytes: [pages, heads, kernel_block_size, content bytes], any strides
        self._layers = [kv.view(torch.uint8).numpy() for kv in layout.layers]
        _, pages, heads, kernel, _ = layout.chunk_shape
        first = self._layers[0]
        self._chunk_shape = (len(self._layers), pages, heads, kernel, first.shape[-1])
        self._num_pages = int(first.shape[0])
        self._page_bytes = heads * kernel * int(first.shape[-1])
        contiguous = all(
            kv[0].flags.c_contiguous and kv.strides[0] == self._page_bytes for kv in self._layers
        )
        self._addresses = [int(kv.ctypes.data) for kv in self._layers] if contiguous else None
        self._local = threading.local()  # each thread's gathered copies (loads, the saver)

    def save(self, slot: Bytes, pages: Sequence[int]) -> None:
        """Copy a whole chunk's pages (in token order) into the arena slot (by `sync`)."""
        self._check(slot, 0, pages)
        if self._addresses is None:
            chunk = slot.reshape(self._chunk_shape)
            for layer, kv in enumerate(self._layers):
                for offset, first, count in page_runs(pages):
                    np.copyto(chunk[layer, offset : offset + count], kv[first : first + count])
            return
        pb, per_chunk = self._page_bytes, self._chunk_shape[1]
        base, runs, pending = int(slot.ctypes.data), page_runs(pages), self._pending()
        for layer, address in enumerate(self._addresses):
            at = base + layer * per_chunk * pb
            pending.extend((at + o * pb, address + f * pb, n * pb) for o, f, n in runs)

    def load(self, slot: Bytes, first_page: int, pages: Sequence[int]) -> None:
        """Copy the chunk's pages [first_page, first_page + len(pages)) into vLLM's `pages`
        (by `sync`)."""
        self._check(slot, first_page, pages)
        if self._addresses is None:
            chunk = slot.reshape(self._chunk_shape)
            for layer, kv in enumerate(self._layers):
                for offset, first, count in page_runs(pages):
                    at = first_page + offset
                    np.copyto(kv[first : first + count], chunk[layer, at : at + count])
            return
        pb, per_chunk = self._page_bytes, self._chunk_shape[1]
        base, runs, pending = int(slot.ctypes.data), page_runs(pages), self._pending()
        for layer, address in enumerate(self._addresses):
            at = base + (layer * per_chunk + first_page) * pb
            pending.extend((address + f * pb, at + o * pb, n * pb) for o, f, n in runs)

    def _check(self, slot: Bytes, first_page: int, pages: Sequence[int]) -> None:
        """Raw addresses must stay inside the slot and the KV cache: check before copying."""
        per_chunk = self._chunk_shape[1]
        if slot.nbytes != len(self._layers) * per_chunk * self._page_bytes:
            raise InvalidArgumentError(
                f"a chunk slot of {slot.nbytes} bytes does not hold chunk_shape "
                f"{self.layout.chunk_shape} of {self.layout.dtype_name}"
            )
        if not 0 <= first_page <= first_page + len(pages) <= per_chunk:
            raise InvalidArgumentError(
                f"pages [{first_page}, {first_page + len(pages)}) are outside a chunk of "
                f"{per_chunk} pages"
            )
        if pages and not (min(pages) >= 0 and max(pages) < self._num_pages):
            raise InvalidArgumentError(
                f"block pages {min(pages)}..{max(pages)} are outside vLLM's KV cache of "
                f"{self._num_pages} pages"
            )

    def sync(self) -> None:
        """Run the gathered copies; they are done when this returns."""
        pending, self._local.pending = self._pending(), []
        copy_addresses(pending, threads=self.threads)

    def _pending(self) -> list[tuple[int, int, int]]:
        """(dst address, src address, bytes) runs this thread gathered since its last `sync`."""
        pending: list[tuple[int, int, int]] | None = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        return pending


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
