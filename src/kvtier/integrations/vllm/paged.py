"""Copies between vLLM's paged KV cache and kvtier chunk slots, with no contiguous staging copy.

vLLM (0.32 and 0.33) hands each layer's KV to a connector as a logical view
`[num_blocks, heads, block, content]`: for attention layers `content` is a token's K then V for
one head (MLA: one latent vector, heads 1), for Mamba / linear-attention layers the view is
`[num_blocks, 1, 1, state bytes]` of int8, one padded state page per block. With vLLM's hybrid
KV cache manager all groups share one buffer (a block id belongs to one group at a time), each
group with its own block table.

A worker packs every group's piece of a chunk into its one slot, group after group, each piece
layer by layer, each layer's pages in token order:

    piece = (num_layers, pages kept per chunk, heads, block, content)

where a full-attention or MLA group keeps every page of the chunk, a sliding-window group its
trailing window pages, a Mamba group the one state page at the chunk's end
(`CacheGroup.kept_blocks`). A group whose layers differ in shape (DeepSeek-V3.2's and GLM-5's
MLA latents beside their indexer keys; DeepSeek-V4's latents compressed 4:1 and 128:1, whose
page holds one state per 4 or 128 tokens) packs one such piece per shape. The groups saved
from blocks vLLM frees soon (sliding window, Mamba) come last, so their pieces are one
contiguous tail a save stages while vLLM still holds the blocks. A plain full-attention model's
chunk is that one piece, registered with its 5-d shape and dtype; any other model registers the
packed bytes as a flat uint8 chunk.

On vLLM's CPU layout every page is contiguous, so a copy is a memcpy of whole pages (runs of
consecutive pages at once) straight between vLLM's blocks and the arena slot; other layouts are
copied through their strides. On a GPU the same copies go through the arena registered as pinned
host memory, asynchronously on a side stream (see `GpuCopier`); the CPU path is `CpuCopier`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.client.copying import copy_addresses, copy_threads
from kvtier.errors import InvalidArgumentError
from kvtier.integrations.vllm.config import CacheGroup

Bytes = npt.NDArray[np.uint8]

NULL_BLOCK = 0  # vLLM's null block: stands for blocks a group does not hold (outside a window)
SKIP = -1  # a page index never copied (a null block's page)

#: groups whose blocks vLLM frees soon after computing them: saved in the step that wrote them
STAGED_KINDS = ("sliding", "mamba")


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group's views and its piece of a chunk slot."""

    group: CacheGroup
    layers: tuple[torch.Tensor, ...]  # each [pages, heads, kernel block, content]
    pages_per_block: int  # view pages per vLLM block (1 for Mamba)
    kept_pages: int  # pages of a chunk the piece holds
    offset: int  # byte offset of the piece in a chunk slot
    chunk_blocks: int  # blocks of a whole chunk in the group's block table (1 for Mamba)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return tuple(self.layers[0].shape[1:])

    @property
    def page_bytes(self) -> int:
        first = self.layers[0]
        return int(np.prod(first.shape[1:])) * int(first.element_size())

    @property
    def nbytes(self) -> int:
        return len(self.layers) * self.kept_pages * self.page_bytes

    def pages(self, block_ids: Sequence[int]) -> list[int]:
        """The views' page indices for vLLM blocks, in token order; a null block's pages are
        SKIP (never read, never written)."""
        r = self.pages_per_block
        return [SKIP if b == NULL_BLOCK else b * r + i for b in block_ids for i in range(r)]


@dataclass(frozen=True)
class PagedLayout:
    """One worker's paged KV cache: every group's views and how a chunk slot packs them."""

    groups: tuple[GroupLayout, ...]  # in slot order: full attention and MLA, then the rest
    chunk_size: int
    plain: bool  # one full-attention group: the 5-d chunk shape of such models

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        groups: Sequence[CacheGroup],
        chunk_size: int,
        num_blocks: int = 0,
    ) -> PagedLayout:
        """The layers of `groups` (config.cache_groups) in `kv_caches`; refuses views it cannot
        copy. A group whose layers differ in shape (an MLA latent beside a DSA indexer's keys, a
        DeepSeek-V4 latent compressed 4:1 beside one compressed 128:1) is packed as one piece
        per shape, all on the group's block table. `num_blocks` (vLLM's, 0: unknown) gives a
        layer's pages per block, which a compressed layer's view does not show in tokens."""
        ordered = sorted(groups, key=lambda g: g.kind in STAGED_KINDS)
        layouts: list[GroupLayout] = []
        offset = 0
        for group in ordered:
            for layers in _group_views(kv_caches, group):
                per_block = _pages_per_block(layers[0], group, chunk_size, num_blocks)
                kept = group.kept_blocks(chunk_size) * per_block
                blocks = 1 if group.kind == "mamba" else chunk_size // group.block_size
                layout = GroupLayout(group, layers, per_block, kept, offset, blocks)
                layouts.append(layout)
                offset += layout.nbytes
        plain = len(layouts) == 1 and layouts[0].group.kind == "full"
        return cls(tuple(layouts), chunk_size, plain)

    @property
    def chunk_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def staged_offset(self) -> int:
        """Where the pieces saved in the step that wrote them begin (chunk_bytes: none)."""
        staged = [g.offset for g in self.groups if g.group.kind in STAGED_KINDS]
        return min(staged, default=self.chunk_bytes)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        if not self.plain:
            return (self.chunk_bytes,)
        (g,) = self.groups
        return (len(g.layers), g.kept_pages, *g.page_shape)

    @property
    def dtype_name(self) -> str:
        if not self.plain:
            return "uint8"
        return str(self.groups[0].layers[0].dtype).removeprefix("torch.")

    @property
    def device(self) -> torch.device:
        return self.groups[0].layers[0].device


def _pages_per_block(
    first: torch.Tensor, group: CacheGroup, chunk_size: int, num_blocks: int
) -> int:
    """View pages per vLLM block of a layer: vLLM may split a block into kernel blocks."""
    if group.kind == "mamba":
        return 1
    pages = int(first.shape[0])
    if num_blocks > 0 and pages % num_blocks == 0:
        per_block = pages // num_blocks
    else:  # tokens per page: a state per token (no compressed layer without num_blocks)
        kernel = int(first.shape[2])
        per_block = group.block_size // kernel if kernel and group.block_size % kernel == 0 else 0
    if per_block < 1 or group.block_size % per_block or chunk_size % group.block_size:
        raise InvalidArgumentError(
            f"a {group.kind} layer's view {tuple(first.shape)} does not split block_size="
            f"{group.block_size} into whole pages, or kvtier's chunk size {chunk_size} is not a "
            "multiple of block_size"
        )
    return per_block


def _group_views(
    kv_caches: Mapping[str, torch.Tensor], group: CacheGroup
) -> list[tuple[torch.Tensor, ...]]:
    """The group's layer views, split into runs of alike layers (one run for most models),
    in the group's layer order."""
    missing = [n for n in group.layer_names if n not in kv_caches]
    if missing:
        raise InvalidArgumentError(
            f"register_kv_caches got no KV for layers {missing[:3]}: KVTierConnector needs "
            f"every layer of each KV cache group ({group.kind})"
        )
    shapes: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for name in group.layer_names:
        t = kv_caches[name]
        if t.dim() != 4:
            raise InvalidArgumentError(
                f"KVTierConnector expects vLLM's logical per-layer KV view [blocks, heads, "
                f"block_size, content] (vLLM >= 0.32); got shape {tuple(t.shape)} for {name!r}"
            )
        shapes.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)
    devices = {device for _, _, device in shapes}
    if len(devices) > 1:
        raise InvalidArgumentError(
            f"the {group.kind} layers' KV is on {sorted(map(str, devices))}: KVTierConnector "
            "needs every layer of a KV cache group on one device"
        )
    return [tuple(layers) for layers in shapes.values()]


def page_runs(pages: Sequence[int], merge: bool = True) -> list[tuple[int, int, int]]:
    """(offset in `pages`, first page, count) for each run of consecutive page indices: a run
    is copied as one slice (a fresh engine's blocks are mostly consecutive). SKIP pages are
    left out; `merge=False` makes every page its own run."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if page == SKIP:
            continue
        if merge and runs and runs[-1][1] + runs[-1][2] == page and runs[-1][0] + runs[-1][2] == i:
            offset, first, count = runs[-1]
            runs[-1] = (offset, first, count + 1)
        else:
            runs.append((i, page, 1))
    return runs


class CpuCopier:
    """Page copies on the CPU: one memcpy per run of consecutive pages and layer, gathered by
    `save` / `load` as (dst, src, size) addresses and run by `sync` (kvtier.client.copying).

    On vLLM's CPU layouts every page is contiguous, so a copy is named by address arithmetic
    instead of numpy slices (a 16k-token transfer is thousands of page runs: slicing them cost
    about a tenth of the copy time); consecutive pages merge into one run where the cache holds
    them back to back (attention pages; Mamba state pages are padded, one run each). Other
    layouts are copied through their strides at once. A large transfer is split over `threads`
    (default: `copy_threads()`, KVTIER_COPY_THREADS). With the native helper the threads take
    its runs one by one, so one whose core is busy with the forward pass copies fewer runs
    instead of holding the transfer up, and large transfers bypass the caches (streaming stores:
    page-sized memcpy otherwise runs at about half the speed of one large one). Torch's
    `index_select` / `index_copy_` are not used: their OpenMP threads lose badly to a busy
    forward pass on the same cores."""

    def __init__(self, layout: PagedLayout, threads: int | None = None) -> None:
        self.layout = layout
        self.threads = copy_threads() if threads is None else max(1, threads)
        self._groups = [_CpuGroup(g) for g in layout.groups]
        self._local = threading.local()  # each thread's gathered copies (loads, the saver)

    def mark(self) -> None:
        """Nothing to order on the CPU: the forward pass has written the blocks on return."""
        return None

    def save(
        self,
        slot: Bytes,
        group: int,
        first: int,
        pages: Sequence[int],
        at: int = 0,
        layers: Sequence[int] | None = None,
    ) -> None:
        """Copy `pages` (SKIP: left as they are) of layout group `group` into its piece's pages
        [first, first + len(pages)); `slot` holds a chunk's bytes from byte `at` on. `layers`:
        the group's layers to copy (default: all)."""
        g = self._groups[group]
        base = g.check(slot, first, pages, at)
        if g.addresses is None:
            g.copy_strided(slot, first, pages, at, save=True, layers=layers)
            return
        pending, pb, pitch = self._pending(), g.page_bytes, g.pitch
        for layer in range(len(g.addresses)) if layers is None else layers:
            address = g.addresses[layer]
            dst = int(slot.ctypes.data) + base + (layer * g.kept + first) * pb
            pending.extend((dst + o * pb, address + p * pitch, n * pb) for o, p, n in g.runs(pages))

    def load(
        self,
        slot: Bytes,
        group: int,
        first: int,
        pages: Sequence[int],
        at: int = 0,
        layers: Sequence[int] | None = None,
    ) -> None:
        """Copy the piece's pages [first, first + len(pages)) into vLLM's `pages` (SKIP pages
        are not written); `layers` as for `save`."""
        g = self._groups[group]
        base = g.check(slot, first, pages, at)
        if g.addresses is None:
            g.copy_strided(slot, first, pages, at, save=False, layers=layers)
            return
        pending, pb, pitch = self._pending(), g.page_bytes, g.pitch
        for layer in range(len(g.addresses)) if layers is None else layers:
            address = g.addresses[layer]
            src = int(slot.ctypes.data) + base + (layer * g.kept + first) * pb
            pending.extend((address + p * pitch, src + o * pb, n * pb) for o, p, n in g.runs(pages))

    def wait(self, event: None) -> None:
        return None

    def sync(self) -> None:
        """Run the gathered copies; they are done when this returns."""
        pending, self._local.pending = self._pending(), []
        copy_addresses(pending, threads=self.threads)

    def flush(self) -> None:
        """Run the gathered copies (a layer's, in a layer-wise load): done on return, so the
        layer needs no event."""
        self.sync()

    def wait_compute(self, event: None) -> None:
        """Nothing to order on the CPU: a flushed copy is done."""
        return None

    def _pending(self) -> list[tuple[int, int, int]]:
        """(dst address, src address, bytes) runs this thread gathered since its last `sync`."""
        pending: list[tuple[int, int, int]] | None = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        return pending


class _CpuGroup:
    """One group's layers as bytes, and the checks that keep raw addresses in bounds."""

    def __init__(self, layout: GroupLayout) -> None:
        self.layout = layout
        # each layer as bytes: [pages, heads, kernel block, content bytes], any strides
        self.layers = [kv.view(torch.uint8).numpy() for kv in layout.layers]
        self.kept = layout.kept_pages
        self.page_bytes = layout.page_bytes
        self.num_pages = int(self.layers[0].shape[0])
        first = self.layers[0]
        self.pitch = int(first.strides[0])
        dense = all(kv[0].flags.c_contiguous and kv.strides[0] == self.pitch for kv in self.layers)
        self.addresses = [int(kv.ctypes.data) for kv in self.layers] if dense else None
        self.merge = self.pitch == self.page_bytes

    def runs(self, pages: Sequence[int]) -> list[tuple[int, int, int]]:
        return page_runs(pages, merge=self.merge)

    def check(self, slot: Bytes, first: int, pages: Sequence[int], at: int) -> int:
        """Raw addresses must stay inside the slot and the KV cache: check before copying.
        Returns the piece's offset in `slot`."""
        base = self.layout.offset - at
        if base < 0 or slot.nbytes < base + self.layout.nbytes:
            raise InvalidArgumentError(
                f"a chunk slot of {slot.nbytes} bytes (from byte {at}) does not hold the "
                f"{self.layout.group.kind} piece at bytes {self.layout.offset}.."
                f"{self.layout.offset + self.layout.nbytes}"
            )
        if not 0 <= first <= first + len(pages) <= self.kept:
            raise InvalidArgumentError(
                f"pages [{first}, {first + len(pages)}) are outside a piece of {self.kept} pages"
            )
        real = [p for p in pages if p != SKIP]
        if real and not (min(real) >= 0 and max(real) < self.num_pages):
            raise InvalidArgumentError(
                f"block pages {min(real)}..{max(real)} are outside vLLM's KV cache of "
                f"{self.num_pages} pages"
            )
        return base

    def copy_strided(
        self,
        slot: Bytes,
        first: int,
        pages: Sequence[int],
        at: int,
        *,
        save: bool,
        layers: Sequence[int] | None = None,
    ) -> None:
        base = self.layout.offset - at
        piece = slot[base : base + self.layout.nbytes].reshape(
            (len(self.layers), self.kept, *self.layers[0].shape[1:])
        )
        for layer in range(len(self.layers)) if layers is None else layers:
            kv = self.layers[layer]
            for offset, p, count in page_runs(pages):
                i = first + offset
                if save:
                    np.copyto(piece[layer, i : i + count], kv[p : p + count])
                else:
                    np.copyto(kv[p : p + count], piece[layer, i : i + count])


class GpuCopier:
    """Page copies between GPU blocks and the arena, which is registered as pinned host memory
    so the copies run asynchronously on a side stream.

    Ordering, by construction: `mark()` records an event on the compute stream when vLLM's
    `wait_for_save` runs (after the forward pass that wrote the blocks was queued); the saver's
    `wait(event)` makes the copy stream wait on it before any save copy starts (layer-wise: an
    event per layer, recorded in `save_kv_layer`). Whole-request loads are queued on the copy
    stream and `sync()` waits for them before `start_load_kv` returns; layer-wise, `flush()`
    records an event after each layer's loads and `wait_for_layer_load` makes the compute
    stream wait on it (`wait_compute`), so attention never reads a block a load is still
    writing. Not exercised by `make test` (there
    is no GPU there): `make gpu-check` runs the connector tests on a CUDA machine.
    """

    def __init__(self, layout: PagedLayout, arena: Bytes | None) -> None:
        self.layout = layout
        self.stream = torch.cuda.Stream(device=layout.device)
        if arena is not None:
            pin_host_memory(arena)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.layout.device))
        return event

    def wait(self, event: Any) -> None:
        if event is not None:
            self.stream.wait_event(event)

    def _piece(self, slot: Bytes, group: GroupLayout, at: int) -> torch.Tensor:
        base = group.offset - at
        with warnings.catch_warnings():  # retrieved views are read-only; loads only read them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(slot[base : base + group.nbytes])
        return flat.view(len(group.layers), group.kept_pages, group.page_bytes)

    def save(
        self,
        slot: Bytes,
        group: int,
        first: int,
        pages: Sequence[int],
        at: int = 0,
        layers: Sequence[int] | None = None,
    ) -> None:
        """Queue device-to-pinned-host copies of `pages` into the piece (run by `sync`)."""
        g = self.layout.groups[group]
        chosen = range(len(g.layers)) if layers is None else layers
        piece = self._piece(slot, g, at)
        device = g.layers[0].device
        with torch.cuda.stream(self.stream):
            for offset, count, index in _segments(pages, device):
                rows = slice(first + offset, first + offset + count)
                for layer in chosen:
                    kv = g.layers[layer]
                    got = torch.index_select(kv, 0, index).view(torch.uint8)
                    piece[layer, rows].copy_(got.view(count, g.page_bytes), non_blocking=True)

    def load(
        self,
        slot: Bytes,
        group: int,
        first: int,
        pages: Sequence[int],
        at: int = 0,
        layers: Sequence[int] | None = None,
    ) -> None:
        """Queue pinned-host-to-device copies of the piece's pages into `pages` (by `sync`)."""
        g = self.layout.groups[group]
        chosen = range(len(g.layers)) if layers is None else layers
        piece = self._piece(slot, g, at)
        device = g.layers[0].device
        with torch.cuda.stream(self.stream):
            for offset, count, index in _segments(pages, device):
                rows = slice(first + offset, first + offset + count)
                for layer in chosen:
                    kv = g.layers[layer]
                    src = piece[layer, rows].to(device, non_blocking=True)
                    kv.index_copy_(0, index, src.view(kv.dtype).view(count, *g.page_shape))

    def sync(self) -> None:
        self.stream.synchronize()

    def flush(self) -> Any:
        """An event recorded on the copy stream after the copies queued so far (a layer's, in
        a layer-wise load); `wait_compute` makes the compute stream wait for it."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_compute(self, event: Any) -> None:
        """The compute stream waits for `event` (a layer's loads) before its next kernels."""
        if event is not None:
            torch.cuda.current_stream(self.layout.device).wait_event(event)


def _segments(pages: Sequence[int], device: torch.device) -> list[tuple[int, int, torch.Tensor]]:
    """(offset in `pages`, count, page indices on `device`) for each stretch without SKIP."""
    out: list[tuple[int, int, torch.Tensor]] = []
    start = None
    for i, page in enumerate([*pages, SKIP]):
        if page != SKIP and start is None:
            start = i
        elif page == SKIP and start is not None:
            index = torch.tensor(list(pages[start:i]), dtype=torch.int64, device=device)
            out.append((start, i - start, index))
            start = None
    return out


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
