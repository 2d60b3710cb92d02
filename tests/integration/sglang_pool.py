"""A stand-in for SGLang's host KV pool, with real page buffers, for the HiCache backend tests.

SGLang's host pool modules do not import without its CUDA stack, so this mirrors what
`MHATokenToKVPoolHost` and `MLATokenToKVPoolHost` (SGLang 0.5.23, `mem_cache/pool_host/`) expose to
a storage backend: `page_size`, `layout`, `dtype`, `size`, `kv_buffer` shaped as theirs,
`get_page_buffer_meta(indices)` with the same pointer arithmetic, and the flat data-page
methods the plain path uses (`get_data_page`, `get_dummy_flat_data_page`,
`set_from_flat_data_page`).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.integrations.sglang_cpu import import_sglang_storage


def sglang_api() -> None:
    """Import SGLang's storage interface (fails with the install command when it is missing)."""
    import pytest

    try:
        import_sglang_storage()
    except ImportError as exc:
        pytest.fail(str(exc), pytrace=False)


class HostPoolStandIn:
    """An MHA host pool (`mla=False`, K and V per layer) or an MLA one (one latent per layer)."""

    def __init__(
        self,
        *,
        layout: str = "page_first",
        page_size: int = 64,
        num_pages: int = 16,
        layer_num: int = 2,
        head_num: int = 2,
        head_dim: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        mla: bool = False,
    ) -> None:
        self.layout = layout
        self.page_size = page_size
        self.page_num = num_pages
        self.size = num_pages * page_size
        self.layer_num = layer_num
        self.head_num = 1 if mla else head_num
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = "cpu"
        self.mla = mla
        kv = () if mla else (2,)
        if layout == "layer_first":
            dims = (*kv, layer_num, self.size, self.head_num, head_dim)
        elif layout == "page_first":
            dims = (*kv, self.size, layer_num, self.head_num, head_dim)
        else:
            raise ValueError(f"the stand-in has no layout {layout!r}")
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill_random(self, seed: int) -> None:
        """Random bytes in every page (NaN patterns included: comparisons are on bytes)."""
        g = torch.Generator().manual_seed(seed)
        raw = self.kv_buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def page_bytes(self, index: int) -> bytes:
        """The bytes of the page starting at token `index`, in data-page order."""
        return bytes(self.get_data_page(index).contiguous().view(torch.uint8).numpy())

    def indices(self, pages: list[int]) -> torch.Tensor:
        """Host indices of these pages, as SGLang passes them (page_size per page)."""
        return torch.cat(
            [torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        )

    # -- what SGLang's host pool exposes to storage backends -----------------------------------

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        starts = indices.tolist()[:: self.page_size]
        token = self.head_num * self.head_dim * item  # one token of one layer (K or latent)
        v_offset = self.layer_num * self.size * token
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for index in starts:
                for layer in range(self.layer_num):
                    k = base + index * token + layer * self.size * token
                    ptrs += [k] if self.mla else [k, k + v_offset]
            size = item * self.page_size * self.head_num * self.head_dim
        else:
            for index in starts:
                k = base + index * self.layer_num * token
                ptrs += [k] if self.mla else [k, k + v_offset]
            size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        span = slice(index, index + self.page_size)
        if self.layout == "layer_first":
            page = self.kv_buffer[:, span] if self.mla else self.kv_buffer[:, :, span]
        else:
            page = self.kv_buffer[span] if self.mla else self.kv_buffer[:, span]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.get_data_page(0))

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))


def build_backend(
    address: str,
    pool: HostPoolStandIn,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    v1: bool = True,
    model_name: str = "test-model",
    **extra: Any,
) -> Any:
    """Build the backend as SGLang does: the factory's "dynamic" path, then the pool (the tests
    and the benchmark share it)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvtier.integrations.sglang import KVTierHiCacheStorage

    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name=model_name,
        extra_config={
            "backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KVTierHiCacheStorage",
            "interface_v1": int(v1),
            "address": address,
            **extra,
        },
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(backend, KVTierHiCacheStorage)
    backend.register_mem_pool_host(pool)  # what cache_controller does right after
    return backend
