"""kvtier as an SGLang HiCache storage backend (SGLang 0.5.23, `--hicache-storage-backend dynamic`).

SGLang names its KV pages itself (a chain hash per page of `--page-size` tokens, 64 by default)
and hands the backend those names plus host-pool indices. Each page of each rank becomes one
key-addressed kvtier chunk: its name is SGLang's key, its bytes are the page's bytes in the host
pool (`sglang_pages.py`). The v1 path (`interface_v1: 1`) copies straight between those host
pages and kvtier's shared-memory arena; the plain path (`get`/`set`/`batch_get`/`batch_set`)
moves SGLang's flat data-page tensors.

- A page must hold exactly one kvtier chunk: SGLang's page size must equal the server's
  `--chunk-size`. `register_mem_pool_host` checks it and refuses to start otherwise.
- Hybrid models (SWA, Mamba): SGLang's v2 interface. Every host pool registered with
  `register_mem_host_pool_v2` gets a kvtier model of its own (the KV model's name plus the
  pool's name), so a page's piece in each pool is its own chunk under the page's key.
  `batch_exists_v2` counts the KV pages every rank stored, asks each other pool which pages'
  pieces it holds, and reports the prefixes every pool can resume from under its hit rule
  (`ALL_PAGES`: every page before the point; `TRAILING_PAGES`: the last n, `seam.resume_points`).
  The hit is the longest common one: never a prefix one pool cannot restore.
- Tensor parallelism: rank r stores shard r of world size tp_size, and a page counts as present
  only when every rank's shard is, so every rank sees the same `batch_exists`. MLA models keep
  one copy of the KV (and of every pool but Mamba, whose state is split across ranks) for all
  ranks: world size 1, written by SGLang's storage writer rank.
- The kvtier model name carries a fingerprint of the weights (`fingerprint.py`), the host
  layout, the KV dtype and the path (v1 or flat) besides SGLang's model name, so pages of other
  weights or other byte orders never alias. SGLang's page keys already carry each request's
  extra key (its LoRA adapter's id) and cache salt, so nothing is added per request.
- A kvtier failure (server down, no space) is a miss or a failed write, logged once per outage,
  never an exception into SGLang (`seam.Recompute`). The connection is the seam's `LazyClient`:
  opened at start, tried again every `retry_interval` while the server is away, and it re-joins
  a restarted server by itself. A setting found not to fit once SGLang runs (a late server with
  another chunk size) turns the backend off: misses, the reason logged as an error.

Launch (see docs/sglang.md):
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
      "class_name": "KVTierHiCacheStorage", "interface_v1": 1, "address": "ipc:///tmp/kvtier.sock"}'
The extra config keys are `EXTRA_CONFIG_KEYS`; any other key is refused at start.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.client import Client, Transfer
from kvtier.errors import BadArrayError, InvalidArgumentError, KVTierError, LayoutMismatchError
from kvtier.integrations.fingerprint import model_identity
from kvtier.integrations.seam import (
    CREDENTIAL_KEYS,
    PREFILL_KEY,
    LazyClient,
    Recompute,
    common_resume_points,
    credential,
    prefill_speed,
    refuse_unknown_keys,
    resume_points,
)
from kvtier.integrations.sglang_pages import (
    PageGeometry,
    flat_bytes,
    load_pages,
    page_geometry,
    store_pages,
)

__all__ = ["EXTRA_CONFIG_KEYS", "KVTierHiCacheStorage", "PageGeometry"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: settings that do not fit the server: fixed by the operator, not by waiting
_MISFITS = (ValueError, BadArrayError, LayoutMismatchError)
#: pools whose pieces are split across TP ranks even when the KV is one shared MLA copy
_RANK_SHARDED_POOLS = frozenset({str(PoolName.MAMBA)})

#: `_set` / `_get`: (client, geometry, host pool, keys, host indices, operation) -> per page ok
_Move = Callable[[Client, PageGeometry, Any, list[str], torch.Tensor, str], list[bool]]

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
        self.geometry: PageGeometry | None = None  # the KV pool's
        self.pool_geometry: dict[str, PageGeometry] = {}  # the other v2 pools', by name
        self._host_pools: dict[str, Any] = {}  # those pools, by name
        self._label = ""
        # every SGLang call stands alone: each is attempted, an outage is logged once
        self.recompute = Recompute(f"kvtier HiCache backend at {self.address}", per_unit=False)
        self.client = LazyClient(
            self.address,
            timeout=self.timeout,
            connect_timeout=min(self.timeout, 2.0),
            transfer=self.transfer,
            token=self.token,
            retry_s=self.retry_interval,
            on_connect=self._on_connect,
            refused=_MISFITS,
        )
        self._disabled: str | None = None  # a configuration error found after start
        self._connect()

    @property
    def last_error(self) -> KVTierError | None:
        """The kvtier failure the last miss or failed write came from."""
        return self.recompute.last_error

    # -- set-up ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the KV pool's page geometry and check it against the server.

        A setting that does not fit (the page size) raises, so SGLang stops at start with the
        message; a server that is away is checked when it answers.
        """
        super().register_mem_pool_host(mem_pool_host)
        self._label = self._label_of(mem_pool_host)
        self.geometry = self._geometry(mem_pool_host, str(PoolName.KV))
        self._register_now()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Learn one more host pool of a hybrid model (SWA, Mamba, ...): its pages are chunks of
        a kvtier model of its own. The KV pool is the one `register_mem_pool_host` took."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            return
        kv = self.geometry
        if kv is None:
            raise ValueError("SGLang registered a v2 host pool before the KV host pool")
        geometry = self._geometry(host_pool, name)
        if geometry.page_size not in (kv.page_size, 1):
            raise ValueError(
                f"SGLang's {name} host pool has pages of {geometry.page_size} host indices; the "
                f"kvtier backend stores pools whose page is a KV page ({kv.page_size}) or one "
                "state slot (1)"
            )
        self.pool_geometry[name] = geometry
        self._host_pools[name] = host_pool
        self._register_now()

    def _register_now(self) -> None:
        client = self.client.connected
        if client is None:
            return  # registered on connect
        try:
            self._check_and_register(client)
        except _MISFITS:
            self.close()
            raise
        except KVTierError as exc:
            self.close()  # connect again later, checking again then
            self.recompute.fail("register", exc)

    def _label_of(self, kv_pool: Any) -> str:
        weights = "" if self.explicit_model else f" {self._weights(kv_pool)}"
        return f"{self.model_name} [sglang{weights}"

    def _geometry(self, pool: Any, name: str) -> PageGeometry:
        """A pool's geometry; the KV pool's model name has no pool name (older names hold)."""
        config = self.storage_config
        pp = config.pp_size
        if config.is_mla_model and name not in _RANK_SHARDED_POOLS:  # one copy for all ranks
            world_size, worker_id, writer = 1, 0, bool(config.is_storage_writer)
        else:
            world_size, worker_id, writer = config.tp_size, config.tp_rank, True
        pool_label = "" if name == str(PoolName.KV) else f" {name}"
        return page_geometry(
            pool,
            v1=self.interface_v1,
            label=f"{self._label}{pool_label} {pool.layout}",
            stage=f" pp{config.pp_rank}/{pp}" if pp > 1 else "",
            world_size=world_size,
            worker_id=worker_id,
            writer=writer,
        )

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
        for g in (geometry, *self.pool_geometry.values()):
            client.register(
                model=g.model,
                world_size=g.world_size,
                worker_id=g.worker_id,
                chunk_shape=g.chunk_shape,
                dtype=g.dtype,
            )

    def _on_connect(self, client: Client) -> None:
        """On each new connection, once SGLang registered its pools: check and register them."""
        if self.geometry is not None:
            self._check_and_register(client)

    def _connect(self) -> Client | None:
        """The client; None (a miss) while kvtier is away or once a setting was found not to fit
        (after start: SGLang runs on without the backend, the error logged)."""
        if self._disabled is not None:
            return None
        try:
            return self.client.try_connect("kvtier HiCache backend", self.recompute)
        except _MISFITS as exc:
            self._disabled = str(exc)
            logger.error("kvtier storage disabled: %s", exc)
            return None

    def _attempt(self, operation: str, fallback: T, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, or `fallback` (a miss, a failed write): a kvtier failure is the seam's
        (logged once per outage, kept in `last_error`); a request this backend cannot serve
        (a pool it does not know, pages that are not the pool's) is logged as an error."""
        try:
            return self.recompute.call(operation, fallback, fn, *args)
        except ValueError as exc:
            logger.error("kvtier %s: %s", operation, exc)
            return fallback

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
        return self._attempt("batch_exists", 0, self._count, client, geometry, keys)

    def _count(self, client: Client, geometry: PageGeometry, keys: list[str]) -> int:
        return client.exists_keys(
            keys,
            model=geometry.model,
            world_size=geometry.world_size,
            cache_salt=self.cache_salt,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- v1: straight between the host pool's pages and the arena ---------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not self._writes_kv():
            return [True] * len(keys)  # MLA: another rank writes the one shared copy
        ready = self._ready()
        if ready is None:
            return [False] * len(keys)
        client, geometry = ready
        return self._set(client, geometry, self.mem_pool_host, keys, host_indices, "batch_set_v1")

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
        return self._get(client, geometry, self.mem_pool_host, keys, host_indices, "batch_get_v1")

    def _writes_kv(self) -> bool:
        return self.geometry is None or self.geometry.writer

    def _set(
        self,
        client: Client,
        geometry: PageGeometry,
        pool: Any,
        keys: list[str],
        host_indices: torch.Tensor,
        operation: str,
    ) -> list[bool]:
        if not keys or not geometry.writer:
            return [True] * len(keys)  # MLA: another rank writes the one shared copy

        def store() -> bool:
            store_pages(client, geometry, pool, keys, host_indices, self.cache_salt)
            return True

        return [self._attempt(operation, False, store)] * len(keys)

    def _get(
        self,
        client: Client,
        geometry: PageGeometry,
        pool: Any,
        keys: list[str],
        host_indices: torch.Tensor,
        operation: str,
    ) -> list[bool]:
        # a lapsed lease fails too: bytes kvtier no longer vouches for are misses
        hit = self._attempt(
            operation, 0, load_pages, client, geometry, pool, keys, host_indices, self.cache_salt
        )
        return [i < hit for i in range(len(keys))]

    # -- v2: hybrid host pools (KV plus SWA, Mamba, ...) ------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV prefix every pool can resume from under its hit rule, and each one's own.

        `restorable_prefix_pages` lists every such prefix (a trailing pool leaves holes), so
        SGLang can intersect the ranks' lists; every rank asks about whole chunk groups, all
        ranks' shards, so the lists agree unless pages leave kvtier between the ranks' calls.
        """
        ready = self._ready()
        if ready is None or not keys:
            return PoolTransferResult(0, {}, [])
        client, kv = ready

        def hits() -> PoolTransferResult:
            kv_pages = self._count(client, kv, keys)
            pool_hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
            parts = [list(range(1, kv_pages + 1))]
            for transfer in (pool_transfers or []) if kv_pages else []:
                points = self._resume_points(client, transfer, keys[:kv_pages])
                if points:
                    pool_hits[transfer.name] = points[-1]
                parts.append(points)
            restorable = common_resume_points(kv_pages, parts)
            return PoolTransferResult(restorable[-1] if restorable else 0, pool_hits, restorable)

        # a pool or hit rule this backend does not know is a miss too
        return self._attempt("batch_exists_v2", PoolTransferResult(0, {}, []), hits)

    def _resume_points(self, client: Client, transfer: PoolTransfer, keys: list[str]) -> list[int]:
        """The prefixes of `keys` (in pages) the transfer's pool holds what a resume needs."""
        geometry, _ = self._pool(transfer.name)
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            held = self._count(client, geometry, keys)
            return resume_points([i < held for i in range(len(keys))])
        if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            present = client.exists_each_key(
                keys,
                model=geometry.model,
                world_size=geometry.world_size,
                cache_salt=self.cache_salt,
            )
            return resume_points(present, trailing=max(1, len(transfer.keys or ())))
        raise ValueError(
            f"the {transfer.name} pool's hit rule {transfer.hit_policy} is not one kvtier "
            "serves (all_pages, trailing_pages): its pages count as misses"
        )

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[Any, list[bool]]:
        """Store each transfer's pages from its pool; per pool, which pages are stored."""
        return self._batch_v2(transfers, self._set, "batch_set_v2")

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[Any, list[bool]]:
        """Load each transfer's leading stored pages into its pool; per pool, which loaded."""
        return self._batch_v2(transfers, self._get, "batch_get_v2")

    def _batch_v2(
        self, transfers: list[PoolTransfer], move: _Move, operation: str
    ) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        client = self._connect()
        for transfer in transfers:
            keys = list(transfer.keys or [])
            try:
                geometry, pool = self._pool(transfer.name)
            except ValueError as exc:
                logger.error("kvtier %s: %s", operation, exc)
                results[transfer.name] = [False] * len(keys)
                continue
            if client is None or transfer.host_indices is None:
                results[transfer.name] = [False] * len(keys)
                continue
            results[transfer.name] = move(
                client, geometry, pool, keys, transfer.host_indices, operation
            )
        return results

    def _pool(self, name: Any) -> tuple[PageGeometry, Any]:
        """A registered pool's geometry and host pool; ValueError for one never registered."""
        if str(name) == str(PoolName.KV) and self.geometry is not None:
            return self.geometry, self.mem_pool_host
        geometry = self.pool_geometry.get(str(name))
        if geometry is None:
            raise ValueError(f"SGLang's {name} host pool was never registered with the backend")
        return geometry, self._host_pools[str(name)]

    # -- plain path: SGLang's flat data-page tensors ----------------------------------------------

    def batch_set(
        self,
        keys: list[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if not keys or not self._writes_kv():
            return True
        ready = self._ready()
        if ready is None or values is None or len(values) != len(keys):
            return False
        client, geometry = ready
        pages: list[int] = []
        for value in values:
            address = flat_bytes(value, geometry.nbytes)
            if address is None:
                logger.warning("kvtier batch_set: a page is not %d CPU bytes", geometry.nbytes)
                return False
            pages.append(address)

        def store() -> bool:
            with client.store_key_slots(keys, **geometry.layout_args(self.cache_salt)) as slots:
                for i, view in slots.targets():
                    ctypes.memmove(view.ctypes.data, pages[i], geometry.nbytes)
            return True

        return self._attempt("batch_set", False, store)

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

        def load() -> list[torch.Tensor | None]:
            result: list[torch.Tensor | None] = [None] * len(keys)
            with client.retrieve_key_slots(keys, **geometry.layout_args(self.cache_salt)) as got:
                for i, view in enumerate(got.views):
                    target = self._target(target_locations, i)
                    address = flat_bytes(target, geometry.nbytes)
                    if address is None:
                        break
                    ctypes.memmove(address, view.ctypes.data, geometry.nbytes)
                    result[i] = target
            return result

        return self._attempt("batch_get", [None] * len(keys), load)

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
        self.client.close()


def _sglang_revision() -> str | None:
    """The `--revision` SGLang was launched with, when it runs in a launched server."""
    try:
        from sglang.srt.runtime_context import get_server_args

        revision = getattr(get_server_args(), "revision", None)
    except Exception:  # no launched server (a test, a benchmark), or another SGLang
        return None
    return None if revision is None else str(revision)
