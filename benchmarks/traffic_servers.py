"""The traffic benchmarks' processes: `kvtier serve`, one vLLM OpenAI server per arm (a way of
serving: vLLM alone, with kvtier, on a GPU with other connectors and their sidecar servers),
started and stopped together, and vLLM's prefix-cache counters read from their /metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit import vllm_threads

from benchmarks.common import start_server, stop_server
from benchmarks.traffic_scale import Scale

CHUNK = 256  # kvtier's chunk size (its default), in tokens


@dataclass(frozen=True)
class Arm:
    """One way of serving: a name and the `--kv-transfer-config` it adds (None: vLLM alone)."""

    name: str
    kv_transfer_config: dict[str, Any] | None = None
    sidecar: tuple[str, ...] = ()  # a cache server this arm's connector talks to


def kvtier_arm(address: str) -> Arm:
    config = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": address},
    }
    return Arm("kvtier", config)


ALONE = Arm("vLLM alone")


# -- processes -------------------------------------------------------------------------------------


@contextmanager
def kvtier_server(l1_size: str = "2GiB", *options: str) -> Iterator[str]:
    """`kvtier serve` (L1 only, with these further options) until the block exits; its address."""
    proc, address = start_server("--l1-size", l1_size, *options)
    try:
        yield address
    finally:
        stop_server(proc)


@dataclass
class VLLM:
    arm: Arm
    port: int
    log: Path
    proc: subprocess.Popen[str] | None = None
    cores: str = "?"  # the cores its compute threads are bound to, from its log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_command(model: Path, port: int, arm: Arm, scale: Scale, device: str) -> list[str]:
    """The OpenAI server's command line: the README's, plus this run's cache size."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--block-size", str(scale.block_size),
        "--max-model-len", str(scale.max_model_len), "--dtype", "float32",
        "--enable-prompt-tokens-details", "--seed", "0",
    ]  # fmt: skip
    # VLLM_CPU_KVCACHE_SPACE counts whole GiB (its least, 1 GiB, holds 131k tokens of this
    # model): the block count sets a cache smaller than the working set
    cmd += ["--num-gpu-blocks-override", str(scale.cache_blocks)]
    if device == "cuda":  # the arms' servers share the GPU
        cmd += ["--gpu-memory-utilization", "0.2"]
    if scale.eager:
        cmd += ["--enforce-eager"]
    if arm.kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(arm.kv_transfer_config)]
    return cmd


def start_vllm(server: VLLM, model: Path, scale: Scale, device: str) -> None:
    # the same compute threads in every arm (vllm-cpu reserves a core more for a connector)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **vllm_threads.env()}
    log = open(server.log, "a")  # noqa: SIM115 (the child holds it; closed with the process)
    server.proc = subprocess.Popen(
        vllm_command(model, server.port, server.arm, scale, device),
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    log.close()


def wait_vllm(server: VLLM, timeout: float = 600) -> None:
    assert server.proc is not None
    _wait_http(f"{server.url}/health", server.proc, server.log, timeout)
    server.cores = vllm_threads.cores(server.log)


def stop_vllm(server: VLLM) -> None:
    if server.proc is not None:
        stop_process(server.proc, group=True)
        server.proc = None


@contextmanager
def vllm_servers(
    arms: Sequence[Arm], model: Path, scale: Scale, workdir: Path, device: str
) -> Iterator[list[VLLM]]:
    """One OpenAI server per arm, started together, stopped when the block exits."""
    servers: list[VLLM] = []
    for arm in arms:
        name = re.sub(r"\W+", "-", arm.name)
        servers.append(VLLM(arm, free_port(), workdir / f"vllm-{name}-{len(servers)}.log"))
    try:
        for s in servers:
            start_vllm(s, model, scale, device)
        for s in servers:
            wait_vllm(s)
        if device == "cpu":  # vllm-cpu logs its thread binding; the arms' must match
            vllm_threads.same_cores({f"{s.arm.name} ({s.log.name})": s.log for s in servers})
        yield servers
    finally:
        for s in servers:
            stop_vllm(s)


def _wait_http(url: str, proc: subprocess.Popen[str], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{_tail(log)}")


def stop_process(proc: subprocess.Popen[str], *, group: bool = False) -> None:
    if proc.poll() is None:
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait(10)


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- vLLM's counters -------------------------------------------------------------------------------

COUNTERS = {
    "vllm:prefix_cache_hits_total": "local_hits",
    "vllm:prefix_cache_queries_total": "local_queries",
    "vllm:external_prefix_cache_hits_total": "external_hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:num_preemptions_total": "preemptions",
    # where a request's time goes (sums over the requests; the connector's only with kvtier)
    "vllm:time_to_first_token_seconds_sum": "ttft_s",
    "vllm:time_to_first_token_seconds_count": "first_tokens",
    "vllm:request_queue_time_seconds_sum": "queue_s",
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_prefill_time_seconds_count": "prefills",
    "vllm:kvtier_lookup_seconds_total": "lookup_s",
    "vllm:kvtier_load_copy_seconds_total": "load_copy_s",
    "vllm:kvtier_load_waited_seconds_total": "load_waited_s",
    "vllm:kvtier_save_copy_seconds_total": "save_copy_s",
    "vllm:kvtier_save_waited_seconds_total": "save_waited_s",
}


def vllm_counters(server: VLLM) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens) and time sums (seconds) from its /metrics."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            out[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


# -- a GPU's other arms ----------------------------------------------------------------------------


def extra_arms(device: str) -> list[Arm]:
    """On a GPU, the other CPU-memory KV caches for vLLM: LMCache's multiprocess server (its
    `LMCacheMPConnector`) and vLLM's own `OffloadingConnector`. Both need CUDA."""
    if device != "cuda":
        return []
    port = free_port()
    lmcache = Arm(
        "LMCache MP",
        {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": port,
            },
        },
        sidecar=(
            sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
            "--port", str(port), "--chunk-size", str(CHUNK), "--l1-size-gb", "2",
            "--eviction-policy", "LRU", "--disable-observability",
        ),
    )  # fmt: skip
    offloading = Arm(
        "vLLM OffloadingConnector",
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},  # as kvtier's L1
        },
    )
    return [lmcache, offloading]


@contextmanager
def sidecars(arms: Sequence[Arm], workdir: Path) -> Iterator[None]:
    """The arms' own cache servers, running until the block exits."""
    procs = []
    try:
        for i, arm in enumerate(arms):
            if arm.sidecar:
                log = open(workdir / f"sidecar-{i}.log", "w")  # noqa: SIM115
                procs.append(
                    subprocess.Popen(arm.sidecar, stdout=log, stderr=subprocess.STDOUT, text=True)
                )
                log.close()
        time.sleep(5 if procs else 0)  # LMCache's server has no readiness endpoint to ask
        yield
    finally:
        for proc in procs:
            stop_process(proc)
