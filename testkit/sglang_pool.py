"""Host KV pools for the HiCache backend tests, with real page buffers and SGLang's own page code.

SGLang's host pool modules (`mem_cache/pool_host/`) do not import without its CUDA stack, but the
methods a storage backend calls on a pool (`get_page_buffer_meta`, `get_data_page`,
`get_dummy_flat_data_page`, `set_from_flat_data_page`) need only torch. `sglang_methods` compiles
those methods from SGLang 0.5.23's installed source, so the MHA pools (KV, SWA) and the Mamba
pool below run SGLang's pointer arithmetic and page copies themselves, over buffers shaped as
SGLang's `init_kv_buffer` shapes them. The MLA pool's methods are a mirror of
`MLATokenToKVPoolHost`'s (its methods read a dozen more attributes).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from testkit.sglang_cpu import import_sglang_storage

_PAGE_METHODS = (
    "get_page_buffer_meta",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
)


@cache
def sglang_methods(module: str, class_name: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The methods `names` of SGLang's `class_name`, compiled from `sglang/srt/mem_cache/
    pool_host/{module}.py` as installed (fails with the install command when it is not)."""
    sglang_api()
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "srt/mem_cache/pool_host" / f"{module}.py"
    tree = ast.parse(path.read_text(), str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    defs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {d.name for d in defs}
    assert not missing, f"SGLang's {class_name} has no {sorted(missing)} any more"
    namespace: dict[str, Any] = {"torch": torch, "np": np}
    body: list[ast.stmt] = list(defs)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}


def keys_for(prefix: str, n: int) -> list[str]:
    """`n` distinct page keys starting with `prefix` (SGLang's keys are 64 hex characters)."""
    return [f"{prefix}{i:060d}" for i in range(n)]


def sglang_api() -> None:
    """Import SGLang's storage interface (fails with the install command when it is missing)."""
    import pytest

    try:
        import_sglang_storage()
    except ImportError as exc:
        pytest.fail(str(exc), pytrace=False)


class HostPoolStandIn:
    """An MHA host pool (`mla=False`, K and V per layer: KV or SWA), SGLang's page methods and
    all, or an MLA one (one latent per layer)."""

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
        self.pin_memory = False
        self.mla = mla
        kv = () if mla else (2,)
        if layout == "layer_first":
            dims = (*kv, layer_num, self.size, self.head_num, head_dim)
        elif layout == "page_first":
            dims = (*kv, self.size, layer_num, self.head_num, head_dim)
        elif layout == "page_first_direct" and not mla:
            dims = (2, num_pages, layer_num, page_size, self.head_num, head_dim)
        else:
            raise ValueError(f"the stand-in has no layout {layout!r}")
        self.kv_buffer = torch.zeros(dims, dtype=dtype)
        if not mla:
            methods = sglang_methods("mha", "MHATokenToKVPoolHost", _PAGE_METHODS)
            for name, method in methods.items():
                setattr(self, name, method.__get__(self))

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

    # -- an MLA pool's page methods (an MHA pool has SGLang's own, bound in __init__) ---------

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert self.mla and len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        starts = indices.tolist()[:: self.page_size]
        token = self.head_dim * item  # one token of one layer's latent
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for index in starts:
                ptrs += [
                    base + index * token + layer * self.size * token
                    for layer in range(self.layer_num)
                ]
            size = item * self.page_size * self.head_dim
        else:
            ptrs = [base + index * self.layer_num * token for index in starts]
            size = self.layer_num * item * self.page_size * self.head_dim
        return ptrs, [size] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        assert self.mla
        span = slice(index, index + self.page_size)
        page = self.kv_buffer[:, span] if self.layout == "layer_first" else self.kv_buffer[span]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.get_data_page(0))

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))


class MambaPoolStandIn:
    """SGLang's Mamba host pool (`MambaPoolHost`, page-first layouts): one state slot per
    page, a temporal (SSM) state and conv states per layer, SGLang's page methods and all."""

    get_data_page: Callable[..., torch.Tensor]  # SGLang's own, bound in __init__

    def __init__(
        self,
        *,
        layout: str = "page_first_direct",
        num_slots: int = 8,
        layer_num: int = 2,
        temporal_shape: tuple[int, ...] = (2, 8, 4),
        conv_shapes: tuple[tuple[int, ...], ...] = ((6, 3),),
        temporal_dtype: torch.dtype = torch.float32,
        conv_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        assert layout in ("page_first", "page_first_direct")
        self.layout = layout
        self.page_size = 1
        self.size = num_slots
        self.device = "cpu"
        self.pin_memory = False
        self.num_mamba_layers = layer_num
        self.temporal_state_shape = temporal_shape
        self.temporal_state_elem_size = int(np.prod(temporal_shape))
        self.conv_state_shapes = list(conv_shapes)
        self.conv_state_elem_sizes = [int(np.prod(shape)) for shape in conv_shapes]
        self.temporal_dtype = temporal_dtype
        self.conv_dtype = self.dtype = conv_dtype
        self.slot_state_device_tensors: list[torch.Tensor] = []
        self.slot_state_buffers: list[torch.Tensor] = []
        self.temporal_buffer = torch.zeros(
            (num_slots, layer_num, 1, *temporal_shape), dtype=temporal_dtype
        )
        self.conv_buffer = [
            torch.zeros((num_slots, layer_num, 1, *shape), dtype=conv_dtype)
            for shape in conv_shapes
        ]
        self.size_per_token = layer_num * (
            self.temporal_state_elem_size * temporal_dtype.itemsize
            + sum(self.conv_state_elem_sizes) * conv_dtype.itemsize
        )
        names = (*_PAGE_METHODS, "_iter_page_tensors")
        for name, method in sglang_methods("mamba", "MambaPoolHost", names).items():
            setattr(self, name, method.__get__(self))
        flatten = sglang_methods("mamba", "MambaPoolHost", ("_flatten_tensor_bytes",))
        self._flatten_tensor_bytes = flatten["_flatten_tensor_bytes"].__func__

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for buf in (self.temporal_buffer, *self.conv_buffer):
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def page_bytes(self, slot: int) -> bytes:
        """The bytes of one state slot, in data-page order."""
        return bytes(self.get_data_page(slot).numpy())

    def indices(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64)


def build_backend(
    address: str,
    pool: HostPoolStandIn,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    v1: bool = True,
    model_name: str = "test-model",
    pools: dict[str, Any] | None = None,
    **extra: Any,
) -> Any:
    """Build the backend as SGLang does: the factory's "dynamic" path, then the KV pool, then
    (a hybrid model) every host pool by name, the KV pool first, as HybridCacheController's
    attach does (the tests and the benchmark share it)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
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
    if pools is not None:
        for name, host_pool in {"kv": pool, **pools}.items():
            backend.register_mem_host_pool_v2(host_pool, PoolName(name))
        backend.on_host_pools_registered()
    return backend
