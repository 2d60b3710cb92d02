"""One `kvtier serve` process: the tiers, the engine, the admin API and the ZMQ transport,
built from one ServerConfig, started in order and stopped in reverse."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from kvtier.config import ServerConfig, format_size
from kvtier.server.admin import AdminServer, start_admin_server
from kvtier.server.engine import Engine
from kvtier.server.transport import Transport
from kvtier.storage.arena import default_arena_name
from kvtier.storage.manager import TierManager
from kvtier.storage.tiers.base import open_tier

__all__ = ["KVTierServer"]

logger = logging.getLogger(__name__)


class KVTierServer:
    """The assembled server; `run()` serves in the foreground until SIGINT or SIGTERM."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.stop_event = threading.Event()
        self.admin: AdminServer | None = None
        self.transport: Transport | None = None
        self.admin_error = ""
        config.arena_name = config.arena_name or default_arena_name(config.address[0])
        tiers = [open_tier(url) for url in config.l2_urls(config.arena_name)]
        for i, tier in enumerate(tiers):  # two tiers of one kind: disk, disk-2, ...
            if any(t.name == tier.name for t in tiers[:i]):
                tier.name = f"{tier.name}-{i + 1}"
        # No L2 is an empty tier manager: the engine never asks whether there is one.
        self.tiers = TierManager(
            tiers,
            queue_size=config.l2_queue_size,
            policy="block" if config.l2_queue_policy == "block" else "drop",
        )
        self.tiers.start()
        try:
            self.engine = Engine(config, tiers=self.tiers)
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
