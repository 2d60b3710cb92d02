"""The processes and places one soak run owns (`benchmarks.soak`): a private Redis, the disk
tier's tmpfs (mounting it needs root), `kvtier serve` on a fixed address, and its /status; and
the RSS and open files of a process, for the drift the soak reports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.soak_attacks import HONEST_TOKEN, TOKENS_FILE
from benchmarks.soak_clients import CS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Parts:
    """The processes and places one soak run owns; all removed at the end."""

    root: Path
    redis_port: int = field(default_factory=free_port)
    redis: subprocess.Popen[bytes] | None = None
    server: subprocess.Popen[str] | None = None
    address: str = ""
    admin: str = ""
    log: list[str] = field(default_factory=list)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)

    @property
    def disk(self) -> Path:
        return self.root / "disk"

    @property
    def tokens_file(self) -> Path:
        path = self.root / "tokens"
        if not path.exists():
            path.write_text(TOKENS_FILE)
            path.chmod(0o600)
        return path

    def start_redis(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            sys.exit("soak: redis-server is not on PATH (apt-get install redis-server)")
        self.redis = subprocess.Popen(
            [exe, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait()
            self.redis = None

    def mount_disk(self, size: str) -> None:
        self.disk.mkdir(parents=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.disk)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            sys.exit(
                f"soak: cannot mount a {size} tmpfs for the disk tier ({done.stderr.strip()}); "
                "run it as root (or with CAP_SYS_ADMIN)"
            )

    def start_server(self) -> None:
        self.address = self.address or f"ipc://{self.root}/kvtier.sock"
        argv = [
            sys.executable, "-m", "kvtier.cli", "serve", "--address", self.address,
            "--admin-port", "0", "--l1-size", "8MiB", "--chunk-size", str(CS),
            "--auth-tokens-file", str(self.tokens_file),
            # sessions a flooding tenant never ends expire, so what it may hold reaches its
            # steady state early and the RSS drift measures leaks, not that state filling up
            "--session-ttl", "15",
            # two tenants: each may hold at most half of L1 unevictable, as docs/security.md
            # advises (pinned + quarantine shares under 1 over the tenants)
            "--tenant-pinned-share", "0.25", "--tenant-quarantine-share", "0.25",
            "--tenant-staging-share", "0.25",
            "--staging-lease", "2", "--client-timeout", "3", "--reap-interval", "0.5",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{self.events_port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{self.replay_port}",
            "--max-registrations-per-client", "256",
            "--l2", f"disk://{self.disk}?size=64MiB",
            "--l2", f"redis://127.0.0.1:{self.redis_port}/0?timeout=0.5&connect_timeout=0.5",
        ]  # fmt: skip
        self.server = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.server.stdout is not None
        for line in self.server.stdout:
            self.log.append(line)
            if line.startswith("admin: http"):
                self.admin = line.split()[1]
            if line.startswith("kvtier: ready"):
                break
        else:
            sys.exit("soak: the server did not start:\n" + "".join(self.log[-30:]))
        proc = self.server

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.log.append(line)

        threading.Thread(target=pump, daemon=True).start()

    def kill_server(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
            self.server = None

    def status(self) -> dict[str, Any]:
        import httpx

        reply = httpx.get(
            self.admin + "/status", timeout=5, headers={"Authorization": f"Bearer {HONEST_TOKEN}"}
        )
        return reply.json()  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.server is not None:
            self.server.send_signal(signal.SIGINT)
            try:
                self.server.wait(15)
            except subprocess.TimeoutExpired:
                self.server.kill()
        self.stop_redis()
        subprocess.run(["umount", "-l", str(self.disk)], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def rss_and_fds(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))
