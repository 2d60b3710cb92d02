"""LMCache 0.5.6's multiprocess server, driven as a measured peer by kvtier's benchmarks.

Everything here goes through LMCache's own modules, as shipped; nothing of it is copied.

- Server: `python -m lmcache.v1.multiprocess.server` in its own process (`LMCacheServer`). With no
  accelerator LMCache runs on its CPU device (StubCPUDevice). The request transport is ZMQ on
  127.0.0.1; L1 is a non-lazy DRAM pool in a POSIX shared-memory segment (`--shm-name`), LRU
  eviction; `--supported-transfer-mode engine_driven` is the CPU path whose KV bytes move
  through that shared memory (the default, lmcache_driven, expects the engine's KV to live in
  shared memory and copies server-side). Usage telemetry and observability are switched off.
- Client: one simulated vLLM worker (`EngineDrivenWorker`), built the way LMCache's own
  `lmcache bench server --mode cpu` builds it: paged per-layer KV tensors of shape
  (2, num_blocks, block_size, num_heads, head_size) in the NHD layout, an
  `EngineDrivenTransferContext` registered with the server, which maps the server's pool
  (`EngineDrivenContextShm`; a fallback to pickle transport is an error here). A store is
  `submit_store`: PREPARE_STORE (the server reserves L1 slots in the pool), LMCache's torch
  gather of the blocks into those slots, COMMIT_STORE. A retrieve is `submit_retrieve`:
  PREPARE_RETRIEVE, LMCache's torch scatter from the slots into the blocks, COMMIT_RETRIEVE; the
  LOOKUP that takes the read locks before it is the scheduler's step in vLLM, a separate call
  here (`lookup`). The copies use torch's intra-op threads (`torch.get_num_threads()`). On CPU,
  LMCache 0.5.6's gather fills a newly allocated tensor per chunk and then copies it into the
  slot (two copies per store); its scatter reads the slot directly (one copy per retrieve).
- Stopping: SIGINT (the server's own shutdown closes and unlinks its pool), SIGKILL if it does
  not exit in time, then the pool segment is unlinked here if it is still in /dev/shm.

Install beside kvtier (CPU): `pip install --no-deps lmcache==0.5.6 numba llvmlite`, plus torch.
"""

from __future__ import annotations

import collections
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any

INSTALL_HINT = "pip install --no-deps lmcache==0.5.6 numba llvmlite"
VERSION = "0.5.6"
MODEL = "kvtier-bench"
INSTANCE_ID = 1000  # as LMCache's own bench numbers its simulated workers
_READY = "LMCache cache server is running..."
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CLIENT_MODULES = (
    "torch",
    "zmq",
    "lmcache.utils",
    "lmcache.v1.multiprocess.custom_types",
    "lmcache.v1.multiprocess.transfer_context",
    "lmcache.v1.multiprocess.transport.factory",
)


def unavailable() -> str | None:
    """None when LMCache's MP client imports here at the expected version, else why not.

    LMCache logs every call at INFO in the client process; unless LMCACHE_LOG_LEVEL says
    otherwise, only its warnings are shown here.
    """
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        for name in _CLIENT_MODULES:
            importlib.import_module(name)
        version = metadata.version("lmcache")
    except Exception as exc:  # ImportError, or a dependency failing at import
        return f"{type(exc).__name__}: {exc}"
    if version != VERSION:
        return f"lmcache {version} is installed, this comparison is written for {VERSION}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LMCacheServer:
    """LMCache's MP server on CPU in its own process, engine-driven transfer through SHM.

    Use as a context manager: the process is always stopped and its pool segment removed.
    """

    def __init__(self, *, l1_size_gib: float, chunk_size: int = 256, timeout: float = 180) -> None:
        self.l1_size_gib = l1_size_gib
        self.chunk_size = chunk_size
        self.timeout = timeout
        self.port = _free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        # LMCache prefixes the name it is given with lmcache_l1_pool_ (unless already there)
        self.shm_name = f"lmcache_l1_pool_kvtier_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._proc: subprocess.Popen[str] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._ready = threading.Event()
        self._drain: threading.Thread | None = None

    def __enter__(self) -> LMCacheServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def log_tail(self, lines: int = 10) -> str:
        """The server's last output lines, without their colour codes."""
        return "".join(_ANSI.sub("", line) for line in list(self._tail)[-lines:])

    def start(self) -> None:
        # INFO: its readiness line is logged at that level
        env = {
            **os.environ,
            "LMCACHE_TRACK_USAGE": "false",
            "DO_NOT_TRACK": "1",
            "LMCACHE_LOG_LEVEL": "INFO",
        }
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.multiprocess.server",
             "--host", "127.0.0.1", "--port", str(self.port),
             "--chunk-size", str(self.chunk_size),
             "--l1-size-gb", str(self.l1_size_gib), "--no-l1-use-lazy",
             "--eviction-policy", "LRU",
             "--supported-transfer-mode", "engine_driven",
             "--shm-name", self.shm_name,
             "--disable-observability"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        # The server logs every store and retrieve: keep reading, or a full pipe stalls it.
        self._drain = threading.Thread(target=self._read_output, daemon=True)
        self._drain.start()
        deadline = time.monotonic() + self.timeout
        while not self._ready.wait(0.2):
            exited = self._proc.poll() is not None
            if exited or time.monotonic() > deadline:
                why = (
                    f"it exited with code {self._proc.returncode}"
                    if exited
                    else f"not ready after {self.timeout:.0f} s"
                )
                raise RuntimeError(
                    f"LMCache's server did not start ({why}); its last lines:\n{self.log_tail()}"
                )

    def _read_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._tail.append(line)
            if _READY in line:
                self._ready.set()

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        if self._drain is not None:
            self._drain.join(10)
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)


class EngineDrivenWorker:
    """One simulated vLLM worker on LMCache's engine-driven CPU path, its KV in paged tensors.

    `kv_caches` maps layer names to CPU tensors of shape (2, num_blocks, block_size, heads,
    head_size); a store gathers `block_ids` of every layer, a retrieve scatters into them.
    """

    def __init__(
        self, url: str, kv_caches: dict[str, Any], *, block_size: int, timeout: float = 120
    ) -> None:
        zmq = importlib.import_module("zmq")
        utils = importlib.import_module("lmcache.utils")
        transfer = importlib.import_module("lmcache.v1.multiprocess.transfer_context")
        factory = importlib.import_module("lmcache.v1.multiprocess.transport.factory")
        self._key_type = importlib.import_module(
            "lmcache.v1.multiprocess.custom_types"
        ).IPCCacheServerKey
        self.kv_caches = kv_caches
        self.timeout = timeout
        self._zmq: Any = zmq.Context()
        self._zmq.setsockopt(zmq.LINGER, 0)
        self._client: Any = None
        self._transfer: Any = None
        try:
            self._client = factory.RequestClientFactory.create(url, context=self._zmq)
            self.chunk_size = int(self._client.get_chunk_size().result(timeout=timeout))
            if self.chunk_size % block_size:
                raise ValueError(f"chunk size {self.chunk_size} is not a multiple of {block_size}")
            self.blocks_in_chunk = self.chunk_size // block_size
            self._transfer = transfer.EngineDrivenTransferContext(INSTANCE_ID, self._client)
            self._transfer.register(
                kv_caches,
                MODEL,
                1,
                self.blocks_in_chunk,
                timeout,
                layout_hints={"kv_layout": "NHD"},
                engine_type=utils.EngineType.VLLM,
            )
            context = self._transfer.engine_driven_context
            if not isinstance(context, transfer.EngineDrivenContextShm):
                raise RuntimeError(
                    f"LMCache's worker context is {type(context).__name__}, not the SHM one"
                )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> EngineDrivenWorker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _key(self, token_ids: tuple[int, ...], request_id: str) -> Any:
        return self._key_type(
            model_name=MODEL,
            world_size=1,
            worker_id=0,
            token_ids=token_ids,
            start=0,
            end=len(token_ids),
            request_id=request_id,
            num_kv_readers=1,
        )

    def store(self, token_ids: tuple[int, ...], request_id: str, block_ids: list[int]) -> None:
        """PREPARE_STORE, gather into the SHM slots, COMMIT_STORE."""
        self._transfer_chunks(
            self._transfer.submit_store, "store", token_ids, request_id, block_ids
        )

    def lookup(self, token_ids: tuple[int, ...], request_id: str) -> int:
        """LOOKUP (read-locks the hit prefix for the retrieve); the number of chunks hit."""
        key = self._key(token_ids, request_id)
        self._client.lookup(key, 1).result(timeout=self.timeout)
        deadline = time.monotonic() + self.timeout
        while True:
            hit = self._client.query_prefetch_status(request_id).result(timeout=self.timeout)
            if hit is not None:
                return int(hit)
            if time.monotonic() > deadline:
                raise TimeoutError("LMCache's lookup did not finish")
            time.sleep(0.001)

    def retrieve(self, token_ids: tuple[int, ...], request_id: str, block_ids: list[int]) -> None:
        """PREPARE_RETRIEVE, scatter from the SHM slots, COMMIT_RETRIEVE (after `lookup`)."""
        self._transfer_chunks(
            self._transfer.submit_retrieve, "retrieve", token_ids, request_id, block_ids
        )

    def _transfer_chunks(
        self,
        submit: Any,
        what: str,
        token_ids: tuple[int, ...],
        request_id: str,
        block_ids: list[int],
    ) -> None:
        """One store or retrieve of the blocks through LMCache's transfer context, waited for."""
        key = self._key(token_ids, request_id)
        future = submit(request_id, key, self.kv_caches, [block_ids], None, self.blocks_in_chunk)
        if not future.result(timeout=self.timeout):
            raise RuntimeError(f"LMCache's {what} failed")

    def end_session(self, request_id: str) -> None:
        self._client.end_session(request_id).result(timeout=self.timeout)

    def clear(self) -> None:
        """Drop every stored object (the server's /cache/clear)."""
        self._client.clear(False).result(timeout=self.timeout)

    def close(self) -> None:
        if self._transfer is not None:
            try:
                future = self._transfer.unregister()
                if future is not None:
                    future.result(timeout=self.timeout)
            finally:
                self._transfer.close()
                self._transfer = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
