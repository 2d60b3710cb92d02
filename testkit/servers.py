"""Real `kvtier serve` processes and free loopback ports, for the tests and the benchmarks; the
real Redis the Redis tests share, and private redis-servers for tests that stop one."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from testkit.kv_servers import start_kv_server

REDIS_URL = os.environ.get("KVTIER_TEST_REDIS", "redis://127.0.0.1:6379/0")
REDIS_HINT = (
    "these tests need the Redis at 127.0.0.1:6379; start it with: redis-server --daemonize yes "
    '--bind 127.0.0.1 --port 6379 --save "" --appendonly no'
)


#: the ports `free_port` handed out in this process: the kernel may offer a port it just freed
#: again, and two picks that are used together (a master's RPC and HTTP ports) must differ
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and that this process has not
    been handed before."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def memory_of(pid: int, figure: str = "VmRSS") -> int:
    """A process's memory figure from /proc/<pid>/status, in bytes: VmRSS (resident now) or
    VmHWM (the peak resident)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{figure}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {figure} in /proc/{pid}/status")


def start_redis(port: int) -> subprocess.Popen[bytes]:
    """A private redis-server on `port` (tests that stop and restart Redis use it)."""
    return start_kv_server("redis", port)


@dataclass
class ServerProcess:
    """A `kvtier serve` child process and what it printed at start."""

    proc: subprocess.Popen[str]
    address: str
    admin_url: str | None
    args: list[str]
    log: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        """Stop the server (Ctrl-C by default) and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.log)

    def close(self) -> None:
        """Stop the server, and remove the shared-memory segment a crash (a test's SIGKILL)
        left behind: a test machine must not fill /dev/shm run after run."""
        self.stop()
        for line in self.log:
            if line.startswith("kvtier: L1 ") and "/dev/shm/" in line:
                segment = line.split("/dev/shm/")[1].split(";")[0].split()[0]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{segment}")
                break


def start_server(
    *args: str, address: str | None = None, timeout: float = 30.0, nofile: int | None = None
) -> ServerProcess:
    """Start `kvtier serve` in its own process and wait until it says it is ready; `nofile`
    sets its descriptor limit (soft and hard, RLIMIT_NOFILE).

    Without an explicit `--l2`, the server gets none: the embedded default (a disk folder that
    outlives the test) would let one test's chunks leak into another.
    """
    if "--l2" not in args:
        args = (*args, "--l2", "none")
    address = address or f"ipc:///tmp/kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    argv = [
        sys.executable, "-m", "kvtier.cli", "serve", "--address", address,
        "--admin-port", "0", *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    limit = (nofile, nofile) if nofile is not None else None
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit)) if limit else None,
    )
    server = ServerProcess(proc, address, None, argv)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        server.log.append(line)
        m = re.match(r"admin: (\S+)", line)
        if m:
            server.admin_url = m.group(1)
        if line.startswith("kvtier: ready"):
            _drain(server)
            return server
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"kvtier serve did not start: {' '.join(argv)}\n{server.output}")


def _drain(server: ServerProcess) -> None:
    """Keep reading the server's output in the background so its pipe never fills."""

    def pump() -> None:
        assert server.proc.stdout is not None
        for line in server.proc.stdout:
            server.log.append(line)

    threading.Thread(target=pump, daemon=True).start()
