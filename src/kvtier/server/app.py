"""One `kvtier serve` process, assembled in one place from one ServerConfig.

`build_engine` builds the engine's parts (hasher, arena, L1, sessions, tiers, the lock, the
prefetch and handler threads, the write-through) and hands them to the `Engine`, then starts the
lease reaper for it. `KVTierServer` adds the admin API and the ZMQ transport, starts everything
in order and stops it in reverse. With no L2 the engine gets an empty TierManager: nothing
anywhere asks whether there is one.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

from kvtier.config import ServerConfig, format_size
from kvtier.hashing import TokenHasher
from kvtier.metrics import Metrics
from kvtier.periodic import PeriodicThreadRegistry, ThreadLevel, create_periodic_thread
from kvtier.server.admin import AdminServer, start_admin_server
from kvtier.server.engine import Engine, EngineParts
from kvtier.server.locking import TimedLock
from kvtier.server.transport import Transport
from kvtier.server.writethrough import WriteThrough
from kvtier.session import SessionManager
from kvtier.storage.arena import Arena, default_arena_name
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.prefetch import Prefetcher
from kvtier.storage.tiers.base import open_tier

__all__ = ["KVTierServer", "build_engine", "build_tiers"]

logger = logging.getLogger(__name__)

_SWITCH_INTERVAL_S = 0.001


def build_tiers(config: ServerConfig, arena_name: str) -> TierManager:
    """The L2 tiers of the config behind one TierManager (empty with no L2), not started."""
    tiers = [open_tier(url) for url in config.l2_urls(arena_name)]
    for i, tier in enumerate(tiers):  # two tiers of one kind: disk, disk-2, ...
        if any(t.name == tier.name for t in tiers[:i]):
            tier.name = f"{tier.name}-{i + 1}"
    return TierManager(
        tiers,
        queue_size=config.l2_queue_size,
        policy="block" if config.l2_queue_policy == "block" else "drop",
    )


def build_engine(
    config: ServerConfig,
    *,
    tiers: TierManager | None = None,
    clock: Callable[[], float] = time.monotonic,
    registry: PeriodicThreadRegistry | None = None,
    start_threads: bool = True,
) -> Engine:
    """Build every part of the engine and hand them over; `start_threads` False leaves out the
    lease reaper and session expiry threads (tests drive `reap()` and expiry by hand)."""
    registry = registry or PeriodicThreadRegistry.get_instance()
    arena_name = config.arena_name or default_arena_name(config.address[0])
    tiers = tiers if tiers is not None else build_tiers(config, arena_name)
    hasher = TokenHasher(config.chunk_size, config.hash_algorithm, seed=config.hash_seed)
    arena = Arena.create(arena_name, config.l1_size, prefault=config.prefault)
    try:
        l1 = L1Store(arena.size, clock=clock)
        lock = TimedLock()
        sessions = SessionManager(
            hasher,
            ttl=config.session_ttl,
            cleanup_interval=config.session_cleanup_interval if start_threads else None,
            registry=registry,
        )
        parts = EngineParts(
            hasher=hasher,
            arena=arena,
            l1=l1,
            tiers=tiers,
            sessions=sessions,
            lock=lock,
            prefetcher=Prefetcher(
                l1,
                arena,
                tiers,
                lambda: lock.hold("L2 prefetch"),
                max_jobs=config.max_prefetch_jobs,
                lease_s=config.staging_lease,
            ),
            write_through=WriteThrough(tiers),
            handlers=ThreadPoolExecutor(
                max_workers=config.handler_threads, thread_name_prefix="kvtier-handler"
            ),
            metrics=Metrics(),
            registry=registry,
        )
    except BaseException:
        arena.close()
        raise
    engine = Engine(config, parts, clock=clock)
    if start_threads:
        engine.threads.append(
            create_periodic_thread(
                f"lease-reaper-{arena_name}",
                config.reap_interval,
                engine.reap,
                ThreadLevel.CRITICAL,
                registry=registry,
                start=True,
            )
        )
    return engine


class KVTierServer:
    """The assembled server; `run()` serves in the foreground until SIGINT or SIGTERM."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # A thread holding the engine lock that loses the GIL keeps everyone waiting until it
        # gets it back: switch more often than the default 5 ms (this process is the server).
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        self.stop_event = threading.Event()
        self.admin: AdminServer | None = None
        self.transport: Transport | None = None
        self.admin_error = ""
        config.arena_name = config.arena_name or default_arena_name(config.address[0])
        self.tiers = build_tiers(config, config.arena_name)
        self.tiers.start()
        try:
            self.engine = build_engine(config, tiers=self.tiers)
        except BaseException:
            self.tiers.close()
            raise
        try:
            if config.admin_port >= 0:
                self.admin = self._start_admin()
            self.transport = Transport(self.engine, config.address)
        except BaseException:
            self.close()
            raise

    def _start_admin(self) -> AdminServer | None:
        """The admin API; a port already in use costs the API, never the cache service."""
        cfg = self.config
        try:
            return start_admin_server(
                self.engine, host=cfg.admin_host, port=cfg.admin_port, token=cfg.admin_token
            )
        except OSError as exc:
            self.admin_error = f"disabled: {exc}"
            logger.error("admin API disabled: %s (choose another --admin-port)", exc)
            return None

    def run(self) -> None:
        """Serve until a signal (or `stop_event`) says stop, then shut down cleanly."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        assert self.transport is not None
        cfg = self.config
        l2 = ", ".join(cfg.l2_urls(self.engine.arena.name)) or "none"
        print(f"kvtier: listening on {', '.join(self.transport.addresses)}", flush=True)
        print(
            f"kvtier: L1 {format_size(self.engine.arena.size)} in /dev/shm/{self.engine.arena.name}"
            f"; L2: {l2}; chunk {cfg.chunk_size} tokens, "
            f"{cfg.hash_algorithm}",
            flush=True,
        )
        if self.admin is not None:
            print(f"admin: {self.admin.url}", flush=True)
        elif self.admin_error:
            print(f"admin: {self.admin_error}", flush=True)
        print("kvtier: ready", flush=True)
        try:
            self.transport.serve_forever(self.stop_event)
        finally:
            self.close()
            print("kvtier: stopped", flush=True)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_event.set()

    def close(self) -> None:
        """Stop everything that started; idempotent."""
        self.stop_event.set()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        self.engine.close()
