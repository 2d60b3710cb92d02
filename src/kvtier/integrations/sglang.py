"""kvtier as an SGLang HiCache storage backend (SGLang 0.5.23, `--hicache-storage-backend dynamic`).

SGLang names its KV pages itself (a chain hash per page of `--page-size` tokens, 64 by default)
and hands the backend those names plus host-pool indices. Each page of each rank becomes one
key-addressed kvtier chunk: its name is SGLang's key, its bytes are the page's bytes in the host
pool, in the order the pool's `get_page_buffer_meta` lists them. The v1 path (`interface_v1: 1`)
copies straight between those host pages and kvtier's shared-memory arena; the plain path
(`get`/`set`/`batch_get`/`batch_set`) moves SGLang's flat data-page tensors.

- A page must hold exactly one kvtier chunk: SGLang's page size must equal the server's
  `--chunk-size`. `register_mem_pool_host` checks it and refuses to start otherwise.
- Tensor parallelism: rank r stores shard r of world size tp_size, and a page counts as present
  only when every rank's shard is, so every rank sees the same `batch_exists`. MLA models keep
  one copy of the KV for all ranks: world size 1, written by SGLang's storage writer rank.
- The kvtier model name carries a fingerprint of the weights (`fingerprint.py`), the host
  layout, the KV dtype and the path (v1 or flat) besides SGLang's model name, so pages of other
  weights or other byte orders never alias. SGLang's page keys already carry each request's
  extra key (its LoRA adapter's id) and cache salt, so nothing is added per request.
- A kvtier failure (server down, no space) is a miss or a failed write, logged, never an
  exception into SGLang; the client re-joins a restarted server by itself.

Launch (see README "Use with SGLang"):
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
      "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "address": "ipc:///tmp/kvtier.sock"}'
The extra config keys are `EXTRA_CONFIG_KEYS`; any other key is refused at start.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zmq
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvtier.client import Client, Transfer
from kvtier.copying import copy_addresses
from kvtier.errors import BadArrayError, InvalidArgumentError, KVTierError, LayoutMismatchError
from kvtier.integrations.fingerprint import model_identity
from kvtier.integrations.seam import (
    CREDENTIAL_KEYS,
    PREFILL_KEY,
    credential,
    prefill_speed,
    refuse_unknown_keys,
)
from kvtier.server.layouts import DTYPE_SIZES

__all__ = ["EXTRA_CONFIG_KEYS", "KVTierHiCacheStorage", "PageGeometry"]

logger = logging.getLogger(__name__)

_FAILURES = (KVTierError, zmq.ZMQError, OSError)
#: settings that do not fit the server: fixed by the operator, not by waiting
_MISFITS = (ValueError, BadArrayError, LayoutMismatchError)

Bytes = npt.NDArray[np.uint8]

#: the keys `--hicache-storage-backend-extra-config` may hold, with what each means
EXTRA_CONFIG_KEYS = {
    "backend_name": 'SGLang\'s name for the dynamic backend ("kvtier")',
    "module_path": "read by SGLang: kvtier.integrations.sglang",
    "class_name": "read by SGLang: KVTierHiCacheStorage",
    "interface_v1": "1: copy straight between the host pool and kvtier's arena (default 0)",
    "address": "the `kvtier serve --address` to talk to (default ipc:///tmp/kvtier.sock)",
    "model": "kvtier's namespace for this model's KV (default: SGLang's model, a fingerprint "
    "of its weights, host layout, dtype, path)",
    "cache_salt": "a namespace within the model's (default none)",
    "timeout": "seconds per request (default 5)",
    "retry_interval": "seconds between connection attempts while the server is away (default 5)",
    "transfer": "auto | shm | inline (default auto)",
    **PREFILL_KEY,
    **CREDENTIAL_KEYS,
    # SGLang's own keys; it removes them before the backend is built, this is in case not
    "prefetch_threshold": "read by SGLang",
    "prefetch_timeout_base": "read by SGLang",
    "prefetch_timeout_per_ki_token": "read by SGLang",
    "hicache_storage_pass_prefix_keys": "read by SGLang",
    "tp_lcm_size": "read by SGLang",
}


@dataclass(frozen=True)
class PageGeometry:
    """What one SGLang page is to kvtier: a chunk of `nbytes`, labelled `chunk_shape`/`dtype`.

    `element_sizes` are the byte sizes of the pieces a page is made of in the host pool (per
    layer K and V in layer_first, K and V in page_first), in the order they are concatenated.
    """

    page_size: int
    element_sizes: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: str
    model: str

    @property
    def nbytes(self) -> int:
        return sum(self.element_sizes)


def _layout_of(sizes: Sequence[int], dtype: str) -> tuple[tuple[int, ...], str]:
    """A registered chunk layout for pieces of `sizes` bytes in `dtype` (bytes if it cannot)."""
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize and len(set(sizes)) == 1 and sizes[0] % itemsize == 0:
        return (len(sizes), sizes[0] // itemsize), dtype
    return (sum(sizes),), "uint8"


class KVTierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's HiCache storage interface on a kvtier server (built as `cls(config, kwargs)`)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        settings: dict[str, Any] = {**(storage_config.extra_config or {}), **(kwargs or {})}
        refuse_unknown_keys(
            settings,
            EXTRA_CONFIG_KEYS,
            "--hicache-storage-backend-extra-config for the kvtier backend",
            ValueError,
        )
        try:
            self.token = credential(settings, "--hicache-storage-backend-extra-config")
            self.prefill_tokens_per_s = prefill_speed(
                settings, "--hicache-storage-backend-extra-config"
            )
        except InvalidArgumentError as exc:
            raise ValueError(str(exc)) from None
        if storage_config.should_split_heads or storage_config.dcp_size > 1:
            raise ValueError(
                "the kvtier HiCache backend does not support split-head (heterogeneous TP) or "
                "decode-context-parallel storage layouts yet: launch SGLang without them, or "
                "use another --hicache-storage-backend"
            )
        self.storage_config = storage_config
        self.address = str(settings.get("address", "ipc:///tmp/kvtier.sock"))
        self.explicit_model = bool(settings.get("model"))
        self.model_name = str(settings.get("model") or storage_config.model_name or "sglang")
        self.cache_salt = str(settings.get("cache_salt", ""))
        self.timeout = float(settings.get("timeout", 5.0))
        self.retry_interval = float(settings.get("retry_interval", 5.0))
        self.transfer: Transfer = settings.get("transfer", "auto")
        self.interface_v1 = bool(settings.get("interface_v1", 0))
        if storage_config.is_mla_model:  # one copy of the KV for all ranks
            self.world_size, self.worker_id = 1, 0
            self.is_writer = bool(storage_config.is_storage_writer)
        else:
            self.world_size, self.worker_id = storage_config.tp_size, storage_config.tp_rank
            self.is_writer = True
        self.geometry: PageGeometry | None = None
        self.last_error: BaseException | None = None
        self._client: Client | None = None
        self._connect_lock = threading.Lock()  # SGLang calls from its prefetch and backup threads
        self._next_attempt = 0.0
        self._failing = False
        self._disabled: str | None = None  # a configuration error found after start
        self._connect()

    # -- set-up ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page geometry and check it against the server.

        A setting that does not fit (the page size) raises, so SGLang stops at start with the
        message; a server that is away is checked when it answers.
        """
        super().register_mem_pool_host(mem_pool_host)
        self.geometry = self._geometry(mem_pool_host)
        client = self._client
        if client is None:
            return
        try:
            self._check_and_register(client)
        except _MISFITS:
            self.close()
            raise
        except _FAILURES as exc:
            self.close()  # connect again later, checking again then
            self._fail("register", exc)

    def _geometry(self, pool: Any) -> PageGeometry:
        dtype = str(pool.dtype).removeprefix("torch.")
        page_size = int(pool.page_size)
        if self.interface_v1:
            _, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
            path = "v1"
        else:
            page = pool.get_dummy_flat_data_page()
            sizes, path = [page.numel() * page.element_size()], "flat"
        element_sizes = tuple(int(s) for s in sizes)
        shape, label = _layout_of(element_sizes, dtype)
        pp = self.storage_config.pp_size
        stage = f" pp{self.storage_config.pp_rank}/{pp}" if pp > 1 else ""
        weights = "" if self.explicit_model else f" {self._weights(pool)}"
        model = f"{self.model_name} [sglang{weights} {pool.layout} {dtype} {path}{stage}]"
        return PageGeometry(page_size, element_sizes, shape, label, model)

    def _weights(self, pool: Any) -> str:
        """The fingerprint of the weights behind SGLang's model name (`fingerprint.py`), so KV
        of other weights saved at the same path is never read. SGLang may have appended its
        host pool's format tag to the name; the path is the name without it."""
        path = self.model_name
        tag = getattr(pool, "storage_format_tag", None)
        if tag and path.endswith(f"-{tag}") and not os.path.isdir(path):
            path = path[: -len(tag) - 1]
        return model_identity(path, _sglang_revision()).label

    def _check_and_register(self, client: Client) -> None:
        geometry = self.geometry
        assert geometry is not None
        if geometry.page_size != client.chunk_size:
            raise ValueError(
                f"SGLang's page size is {geometry.page_size} tokens but the kvtier server at "
                f"{self.address} stores chunks of {client.chunk_size}: start it with "
                f"`kvtier serve --chunk-size {geometry.page_size}` (or launch SGLang with "
                f"--page-size {client.chunk_size})"
            )
        client.register(
            model=geometry.model,
            world_size=self.world_size,
            worker_id=self.worker_id,
            chunk_shape=geometry.chunk_shape,
            dtype=geometry.dtype,
        )

    def _connect(self) -> Client | None:
        """The client, connecting at most every `retry_interval` while the server is away."""
        if self._client is not None or self._disabled:
            return self._client
        with self._connect_lock:
            now = time.monotonic()
            if self._client is not None or now < self._next_attempt:
                return self._client
            self._next_attempt = now + self.retry_interval
            try:
                client = Client(
                    self.address,
                    timeout=self.timeout,
                    connect_timeout=min(self.timeout, 2.0),
                    transfer=self.transfer,
                    token=self.token,
                )
            except _FAILURES as exc:
                self._fail("connect", exc)
                return None
            if self.geometry is not None:
                try:
                    self._check_and_register(client)
                except _MISFITS as exc:
                    client.close()
                    self._disabled = str(exc)  # a setting to fix, found after start: misses
                    logger.error("kvtier storage disabled: %s", exc)
                    return None
                except _FAILURES as exc:
                    client.close()
                    self._fail("connect", exc)
                    return None
            self._client = client
            return client

    def _fail(self, operation: str, exc: BaseException) -> None:
        """A failed operation costs a miss; the first of a run is a warning, the rest debug."""
        self.last_error = exc
        log = logger.debug if self._failing else logger.warning
        log("kvtier %s failed (pages count as misses): %s", operation, exc)
        self._failing = True

    def _ok(self) -> None:
        if self._failing:
            logger.info("kvtier at %s answers again", self.address)
        self._failing = False

    def _ready(self) -> tuple[Client, PageGeometry] | None:
        client = self._connect()
        if client is None or self.geometry is None:
            return None
        return client, self.geometry

    # -- existence --------------------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages every rank has stored."""
        ready = self._ready()
        if ready is None or not keys:
            return 0
        client, geometry = ready
        try:
            hit = client.exists_keys(
                keys,
                model=geometry.model,
                world_size=self.world_size,
                cache_salt=self.cache_salt,
                prefill_tokens_per_s=self.prefill_tokens_per_s,
            )
        except _FAILURES as exc:
            self._fail("batch_exists", exc)
            return 0
        self._ok()
        return hit

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v1: straight between the host pool's pages and the arena ---------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys or not self.is_writer:
            return [True] * len(keys)  # MLA: another rank writes the one shared copy
        ready = self._ready()
        if ready is None:
            return [False] * len(keys)
        client, geometry = ready
        try:
            pointers = self._page_pointers(keys, host_indices)
            with client.store_key_slots(keys, **self._layout_args(geometry)) as slots:
                copy_addresses(self._pieces(slots.targets(), pointers))
        except (*_FAILURES, ValueError) as exc:
            self._fail("batch_set_v1", exc)
            return [False] * len(keys)
        self._ok()
        return [True] * len(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        ready = self._ready()
        if ready is None or not keys:
            return [False] * len(keys)
        client, geometry = ready
        try:
            pointers = self._page_pointers(keys, host_indices)
            with client.retrieve_key_slots(keys, **self._layout_args(geometry)) as got:
                pieces = self._pieces(enumerate(got.views), pointers)
                copy_addresses([(host, slot, n) for slot, host, n in pieces])
                hit = got.num_chunks
        except (*_FAILURES, ValueError) as exc:  # a lapsed lease too: bytes not vouched for
            self._fail("batch_get_v1", exc)
            return [False] * len(keys)
        self._ok()
        return [i < hit for i in range(len(keys))]

    def _page_pointers(self, keys: list[str], host_indices: torch.Tensor) -> list[list[int]]:
        """Per page, the addresses of its pieces in the host pool, from the pool itself."""
        assert self.geometry is not None
        per_page = len(self.geometry.element_sizes)
        if host_indices.numel() != len(keys) * self.geometry.page_size:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * self.geometry.page_size} host indices, got "
                f"{host_indices.numel()}"
            )
        ptrs, _ = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return [list(ptrs[i * per_page : (i + 1) * per_page]) for i in range(len(keys))]

    def _pieces(
        self, slots: Iterable[tuple[int, Bytes]], pointers: list[list[int]]
    ) -> list[tuple[int, int, int]]:
        """(slot address, host address, size) of every piece of every page listed.

        A slot holds its page's pieces one after the other, in the pool's order.
        """
        assert self.geometry is not None
        sizes = self.geometry.element_sizes
        pieces: list[tuple[int, int, int]] = []
        for i, slot in slots:
            at = int(slot.ctypes.data)
            for ptr, size in zip(pointers[i], sizes, strict=True):
                pieces.append((at, ptr, size))
                at += size
        return pieces

    def _layout_args(self, geometry: PageGeometry) -> dict[str, Any]:
        return {
            "model": geometry.model,
            "worker_id": self.worker_id,
            "world_size": self.world_size,
            "chunk_shape": geometry.chunk_shape,
            "dtype": geometry.dtype,
            "cache_salt": self.cache_salt,
        }

    # -- plain path: SGLang's flat data-page tensors ----------------------------------------------

    def batch_set(
        self,
        keys: list[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if not keys or not self.is_writer:
            return True
        ready = self._ready()
        if ready is None or values is None or len(values) != len(keys):
            return False
        client, geometry = ready
        pages: list[int] = []
        for value in values:
            address = _flat_bytes(value, geometry.nbytes)
            if address is None:
                logger.warning("kvtier batch_set: a page is not %d CPU bytes", geometry.nbytes)
                return False
            pages.append(address)
        try:
            with client.store_key_slots(keys, **self._layout_args(geometry)) as slots:
                for i, view in slots.targets():
                    ctypes.memmove(view.ctypes.data, pages[i], geometry.nbytes)
        except _FAILURES as exc:
            self._fail("batch_set", exc)
            return False
        self._ok()
        return True

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return value is not None and self.batch_set([key], [value])

    def batch_get(
        self,
        keys: list[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Each page as a flat tensor (written into `target_locations[i]` when given), or None."""
        ready = self._ready()
        if ready is None or not keys:
            return [None] * len(keys)
        client, geometry = ready
        result: list[torch.Tensor | None] = [None] * len(keys)
        try:
            with client.retrieve_key_slots(keys, **self._layout_args(geometry)) as got:
                for i, view in enumerate(got.views):
                    target = self._target(target_locations, i)
                    address = _flat_bytes(target, geometry.nbytes)
                    if address is None:
                        break
                    ctypes.memmove(address, view.ctypes.data, geometry.nbytes)
                    result[i] = target
        except _FAILURES as exc:
            self._fail("batch_get", exc)
            return [None] * len(keys)
        self._ok()
        return result

    def _target(self, target_locations: Sequence[torch.Tensor] | None, i: int) -> torch.Tensor:
        if target_locations is not None and i < len(target_locations):
            return target_locations[i]
        return self.mem_pool_host.get_dummy_flat_data_page()

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # -- lifecycle --------------------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing: kvtier's chunks are shared and named by content (`kvtier clear` drops them)."""

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _sglang_revision() -> str | None:
    """The `--revision` SGLang was launched with, when it runs in a launched server."""
    try:
        from sglang.srt.runtime_context import get_server_args

        revision = getattr(get_server_args(), "revision", None)
    except Exception:  # no launched server (a test, a benchmark), or another SGLang
        return None
    return None if revision is None else str(revision)


def _flat_bytes(tensor: torch.Tensor, nbytes: int) -> int | None:
    """The address of a contiguous CPU tensor of exactly `nbytes`, else None."""
    if (
        tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.numel() * tensor.element_size() != nbytes
    ):
        return None
    return int(tensor.data_ptr())
