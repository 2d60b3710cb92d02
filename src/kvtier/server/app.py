"""One `kvtier serve` process, assembled in one place from one ServerConfig.

`build_engine` builds the engine's parts (hasher, arena, L1, sessions, tiers, the lock, the
prefetch and handler threads, the write-through) and hands them to the `Engine`, then starts the
lease reaper for it. `KVTierServer` adds the admin API and the ZMQ transport, starts everything
in order and stops it in reverse. With no L2 the engine gets an empty TierManager; the few
places that skip L2 work (a lookup's prefetch, a commit's write-through, the shutdown flush)
ask `tiers.tiers`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

from kvtier.config import ConfigError, ServerConfig, admin_token_file, format_size
from kvtier.hashing import TokenHasher
from kvtier.periodic import (
    PeriodicThread,
    PeriodicThreadRegistry,
    ThreadLevel,
    create_periodic_thread,
)
from kvtier.redaction import redact
from kvtier.server.auth import Authenticator, is_local_address
from kvtier.server.descriptors import (
    ConnectionGuard,
    DescriptorBudget,
    descriptors_in_use,
    raise_limit,
)
from kvtier.server.engine import Engine, EngineParts
from kvtier.server.locking import TimedLock
from kvtier.server.observe.admin import AdminServer, check_admin_exposure, start_admin_server
from kvtier.server.observe.chunk_notes import ChunkNotes
from kvtier.server.observe.chunkmemory import ChunkMemory
from kvtier.server.observe.event_metrics import EventMetrics
from kvtier.server.observe.events import EventPublisher, open_events
from kvtier.server.observe.metrics import Metrics
from kvtier.server.transport import Transport
from kvtier.server.views import AdminViews
from kvtier.server.writethrough import WriteThrough
from kvtier.session import SessionManager
from kvtier.storage.admission import make_policy
from kvtier.storage.arena import SHM_DIR, Arena, default_arena_name
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.observers import NO_OBSERVER, Observers, StorageObserver
from kvtier.storage.prefetch import Prefetcher
from kvtier.storage.tiers.base import L2Tier, RegistersMemory
from kvtier.storage.tiers.registry import open_tier

__all__ = ["KVTierServer", "StartInterrupted", "build_engine", "build_tiers", "interrupt_start"]

logger = logging.getLogger(__name__)

_SWITCH_INTERVAL_S = 0.001

#: seconds between looks at the L2 tiers' error counters (what makes /health say degraded)
TIER_WATCH_INTERVAL_S = 2.0


class StartInterrupted(BaseException):
    """SIGINT or SIGTERM arrived while the server was starting: unwind, removing what it made.

    A BaseException, as KeyboardInterrupt is, so that no `except Exception` swallows it and
    every `finally` and `except BaseException` on the way out runs (the arena's temporary
    segment, a half-started tier).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_start_interrupted(signum: int, frame: FrameType | None) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the unwinding short
        signal.signal(s, signal.SIG_IGN)
    raise StartInterrupted(signum)


def interrupt_start() -> None:
    """Make SIGINT and SIGTERM raise StartInterrupted until `KVTierServer.run` takes them over.

    Without it the default SIGTERM action ends the process at once, in the middle of sizing a
    multi-GiB segment, and leaves it in /dev/shm. Main thread only (as `signal.signal`).
    """
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _raise_start_interrupted)


def _open_tier(url: str) -> L2Tier:
    try:
        return open_tier(url)
    except OSError as exc:  # a folder that cannot be made or written, a file that cannot be read
        where = f" {exc.filename!r}" if exc.filename else ""
        raise ConfigError(
            f"--l2: {redact(url)}:{where} {exc.strerror or exc}: give a folder this user can "
            "create and write (e.g. --l2 'disk:///var/lib/kvtier?size=50GiB'), or --l2 none"
        ) from None


def _check_shm_room(size: int) -> None:
    """Refuse an L1 that /dev/shm cannot hold before allocating any of it."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        raise ConfigError(f"--l1-size: {SHM_DIR} is not usable: {exc.strerror or exc}") from None
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ConfigError(
            f"--l1-size: {format_size(size)} does not fit in {SHM_DIR}, which has "
            f"{format_size(free)} free: give a smaller --l1-size or a larger {SHM_DIR} "
            "(docker: --shm-size)"
        )


def _arena_error(exc: OSError, size: int) -> ConfigError:
    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
        return ConfigError(
            f"--l1-size: {format_size(size)} could not be allocated in {SHM_DIR} "
            f"({exc.strerror}): give a smaller --l1-size or a larger {SHM_DIR} (docker: --shm-size)"
        )
    where = exc.filename or SHM_DIR
    if exc.errno == errno.ENOENT:  # not a permission problem: someone removed it meanwhile
        return ConfigError(
            f"--l1-size: the shared-memory segment {where!r} disappeared while this server was "
            f"creating it (another process removed it from {SHM_DIR}): start the server again"
        )
    return ConfigError(
        f"--l1-size: cannot create the shared-memory segment in {where!r}: {exc.strerror or exc}"
        f" ({SHM_DIR} must be writable by this user)"
    )


def build_tiers(
    config: ServerConfig, arena_name: str, *, observer: StorageObserver = NO_OBSERVER
) -> TierManager:
    """The L2 tiers of the config behind one TierManager (empty with no L2), not started;
    `observer` follows what the tiers, and the L1 built on them, hold.

    A tier that cannot be opened (a folder it cannot create or write) is a ConfigError naming
    --l2 and the folder.
    """
    tiers = [_open_tier(url) for url in config.l2_urls(arena_name)]
    for i, tier in enumerate(tiers):  # two tiers of one kind: disk, disk-2, ...
        if any(t.name == tier.name for t in tiers[:i]):
            tier.name = f"{tier.name}-{i + 1}"
    return TierManager(
        tiers,
        queue_size=config.l2_queue_size,
        policy="block" if config.l2_queue_policy == "block" else "drop",
        observer=observer,
    )


def build_engine(
    config: ServerConfig,
    *,
    tiers: TierManager | None = None,
    clock: Callable[[], float] = time.monotonic,
    registry: PeriodicThreadRegistry | None = None,
    start_threads: bool = True,
    auth: Authenticator | None = None,
    memory: ChunkMemory | None = None,
    notes: ChunkNotes | None = None,
) -> Engine:
    """Build every part of the engine and hand them over; `start_threads` False leaves out the
    lease reaper and session expiry threads (tests drive `reap()` and expiry by hand). `notes`
    keeps the tokens of stored chunks for the KV events (none kept without it).

    The L2 writer runs in every engine this returns (started here unless `tiers` runs it
    already): a committed group stays unevictable until its write ends, so an engine whose
    writer never ran would hold its first `--l2-queue-size` groups for good.
    """
    registry = registry or PeriodicThreadRegistry.get_instance()
    arena_name = config.arena_name or default_arena_name(config.address[0])
    built_tiers = tiers is None  # closed here when the build fails; else the caller's
    if memory is None:  # a given `tiers` feeds it only if its observer has it
        memory = ChunkMemory(config.miss_memory)
    if tiers is None:
        tiers = build_tiers(config, arena_name, observer=Observers(memory))
    hasher = TokenHasher(config.chunk_size, config.hash_algorithm, seed=config.hash_seed)
    try:
        if not tiers.running:
            tiers.start()  # RuntimeError for a closed TierManager: no engine without a writer
        arena = Arena.create(arena_name, config.l1_size, prefault=config.prefault)
    except BaseException:
        if built_tiers:
            tiers.close()
        raise
    try:
        for tier in tiers.tiers:  # Mooncake moves bytes in place between slots and its pool
            if isinstance(tier, RegistersMemory):
                tier.register_memory(arena.buffer)
        l1 = L1Store(
            arena.size,
            clock=clock,
            observer=tiers.observer,
            admission=make_policy(config.policy),
        )
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
                chunk_size=config.chunk_size,
            ),
            write_through=WriteThrough(tiers),
            handlers=ThreadPoolExecutor(
                max_workers=config.handler_threads, thread_name_prefix="kvtier-handler"
            ),
            metrics=Metrics(),
            registry=registry,
            memory=memory,
            auth=auth if auth is not None else Authenticator.from_file(config.auth_tokens_file),
            notes=notes if notes is not None else ChunkNotes(),
        )
        engine = Engine(config, parts, clock=clock)
        if isinstance(tiers.observer, Observers):  # which hand-off chunks reach a shared tier
            tiers.observer.add(engine.handoffs)
    except BaseException:  # a server that fails at start leaves no segment in /dev/shm
        arena.close()
        if built_tiers:
            tiers.close()
        raise
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


def _read_auth(path: str | None) -> Authenticator:
    try:
        return Authenticator.from_file(path)
    except OSError as exc:
        raise ConfigError(
            f"--auth-tokens-file: cannot read {path!r}: {exc.strerror or exc} (give a file of "
            "'TOKEN TENANT' lines, e.g. --auth-tokens-file /etc/kvtier/tokens)"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"--auth-tokens-file: {exc}") from None


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
        auth = _read_auth(config.auth_tokens_file)
        exposed = [a for a in config.address if not is_local_address(a)]
        if exposed and not auth.required:
            raise ValueError(
                f"{', '.join(exposed)} is reachable from other machines: give "
                "--auth-tokens-file so that only clients with a credential get in"
            )
        if config.admin_port >= 0:
            # Refused before anything on the machine is touched (segments, files, sockets).
            check_admin_exposure(config.admin_host, config.admin_token)
        self.token_file: Path | None = None
        # Descriptors first: every socket below is capped from what the limit leaves.
        limit = raise_limit()
        self.guard = ConnectionGuard()
        config.arena_name = config.arena_name or default_arena_name(config.address[0])
        _check_shm_room(config.l1_size)
        # Whoever follows what the tiers hold (the chunk memory behind the miss reasons, the KV
        # events) is added before the tiers start, so that it hears what survived a restart.
        memory = ChunkMemory(config.miss_memory)
        observers = Observers(memory)
        self.tiers = build_tiers(config, config.arena_name, observer=observers)
        self.events: EventPublisher | None = None
        try:
            if config.kv_events_endpoint is not None:
                self.events = open_events(config, self.tiers.tiers)
                observers.add(self.events)
                self.events.start()
            self.tiers.start()
            notes = self.events.notes if self.events is not None else None
            self.engine = build_engine(
                config, tiers=self.tiers, auth=auth, notes=notes, memory=memory
            )
        except OSError as exc:
            self._close_early()
            raise _arena_error(exc, config.l1_size) from None
        except BaseException:
            self._close_early()
            raise
        # The admin views (status, health, sessions, clear) over the engine; the tier watch
        # turns failing L2 tiers into degraded health, recent errors and a rate-limited log line.
        self.views = AdminViews(self.engine)
        if self.events is not None:
            self.engine.metrics.registry.register(EventMetrics(self.events))
            self.engine.handshake.on_kv_groups = self.events.learn_groups
        if self.tiers.tiers:
            watch: PeriodicThread = create_periodic_thread(
                f"tier-watch-{config.arena_name}",
                TIER_WATCH_INTERVAL_S,
                self.views.check_tiers,
                ThreadLevel.LOW,
                start=True,
            )
            self.engine.threads.append(watch)  # the engine stops it at close
        self.budget = DescriptorBudget.plan(
            limit,
            descriptors_in_use(),
            admin=config.max_admin_connections if config.admin_port >= 0 else 0,
            events=config.kv_events_max_connections,
            events_sockets=len(self.events.sockets()) if self.events is not None else 0,
        )
        if self.budget.shrunk:
            logger.warning(
                "ulimit -n %d is too small for --max-admin-connections %d and "
                "--kv-events-max-connections %d beside the engines: holding %d and %d",
                limit,
                config.max_admin_connections,
                config.kv_events_max_connections,
                self.budget.admin,
                self.budget.events,
            )
        try:
            if config.admin_port >= 0:
                self.admin = self._start_admin()
            try:
                self.transport = Transport(
                    self.engine, config.address, max_frame_bytes=config.max_frame_bytes
                )
            except OSError as exc:
                raise ConfigError(
                    f"--address: {exc}: give an address this user can listen on (the folder of "
                    "an ipc:// socket must exist; a tcp:// port must be free)"
                ) from None
            transport = self.transport
            self.guard.watch(transport.socket, self.budget.tcp_data, "data", transport.addresses)
            if self.events is not None:
                for name, sock, endpoints in self.events.sockets():
                    self.guard.watch(sock, self.budget.events, name, endpoints)
            self.guard.start()
        except BaseException:
            self.close()
            raise

    def _close_early(self) -> None:
        """Close what a failed start opened before the engine existed."""
        self.tiers.close()
        if self.events is not None:
            self.events.close()

    def _start_admin(self) -> AdminServer | None:
        """The admin API; a port already in use costs the API, never the cache service."""
        cfg = self.config
        try:
            admin = start_admin_server(
                self.views,
                host=cfg.admin_host,
                port=cfg.admin_port,
                token=cfg.admin_token,
                max_connections=self.budget.admin,
            )
        except OSError as exc:
            reason = exc.strerror or exc
            self.admin_error = f"disabled: {reason}"
            logger.error("admin API disabled: %s", reason)
            return None
        if cfg.admin_token is None:
            # Changes (clear, end a session) need a credential even on loopback: a token only
            # this user can read, which `kvtier clear` picks up by the admin port.
            try:
                path = admin_token_file(admin.port, create_dir=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    os.fchmod(f.fileno(), 0o600)
                    f.write(admin.token + "\n")
                self.token_file = path
            except (OSError, ValueError) as exc:
                logger.error("admin token file not written (%s): pass --admin-token", exc)
        return admin

    def run(self) -> None:
        """Serve until a signal (or `stop_event`) says stop, then shut down cleanly."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        assert self.transport is not None
        cfg = self.config
        l2 = ", ".join(cfg.l2_display(self.engine.arena.name)) or "none"
        print(f"kvtier: listening on {', '.join(self.transport.addresses)}", flush=True)
        print(
            f"kvtier: L1 {format_size(self.engine.arena.size)} in /dev/shm/{self.engine.arena.name}"
            f"; L2: {l2}; chunk {cfg.chunk_size} tokens, "
            f"{cfg.hash_algorithm}",
            flush=True,
        )
        if self.events is not None:
            replay = cfg.kv_events_replay_endpoint or "none"
            print(
                f"kv events: {cfg.kv_events_endpoint} (replay: {replay}; topic prefix "
                f"{cfg.kv_events_topic!r})",
                flush=True,
            )
        if self.admin is not None:
            where = f" (token for changes: {self.token_file})" if self.token_file else ""
            print(f"admin: {self.admin.url}{where}", flush=True)
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
        self.guard.close()  # its monitors, before the sockets they watch
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        if self.token_file is not None:
            with contextlib.suppress(OSError):
                self.token_file.unlink()
            self.token_file = None
        self.engine.close()
        if self.events is not None:  # after the tiers, so their last reports are published
            self.events.close()
