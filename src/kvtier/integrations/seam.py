"""The policy every engine adapter shares: the connection opens lazily and is retried while
kvtier is away, a kvtier failure costs a recompute, tensor-parallel ranks split KV heads evenly
and agree on one reuse span, a chunk is whole blocks, and a hit ends only where every part of
the KV can resume.

The transformers adapter (`integrations.transformers`), the vLLM connector
(`integrations.vllm`) and the SGLang backend (`integrations.sglang`) go through this module, so
the rules live once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from kvtier.client import Client, Transfer
from kvtier.errors import InvalidArgumentError, KVTierError, NotConnectedError

__all__ = [
    "LazyClient",
    "Recompute",
    "agree_min",
    "check_chunk_blocks",
    "common_resume_points",
    "credential",
    "head_range",
    "prefill_speed",
    "refuse_unknown_keys",
    "resume_points",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def head_range(num_kv_heads: int, world_size: int, worker_id: int) -> slice:
    """The KV heads rank `worker_id` of `world_size` owns; they must split evenly."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if not 0 <= worker_id < world_size:
        raise ValueError(f"worker_id={worker_id} must be in [0, world_size={world_size})")
    if num_kv_heads % world_size:
        raise ValueError(
            f"world_size={world_size} does not divide the model's {num_kv_heads} KV heads"
        )
    per_rank = num_kv_heads // world_size
    return slice(worker_id * per_rank, (worker_id + 1) * per_rank)


def agree_min(counts: Iterable[int]) -> int:
    """The span every rank can reuse: the smallest of the ranks' token counts."""
    return min(int(c) for c in counts)


def resume_points(present: Sequence[bool], trailing: int | None = None) -> list[int]:
    """The prefix lengths (in pages) one part of the KV can resume from, given which pages
    it holds a piece of (`present[i]`: page i's).

    `trailing` None: every page before the point is needed (full attention). `trailing` n: only
    the last n pages before it (a sliding window: the pages it still sees; a recurrent state,
    n=1: the state after the point's last page), so the points can have holes.
    """
    points: list[int] = []
    run = 0  # present pages ending at the current one
    for page, ok in enumerate(present):
        run = run + 1 if ok else 0
        if trailing is None and not ok:
            break
        if run >= (page + 1 if trailing is None else min(trailing, page + 1)):
            points.append(page + 1)
    return points


def common_resume_points(num_pages: int, parts: Iterable[Sequence[int]]) -> list[int]:
    """The prefix lengths in 1..num_pages every part can resume from, ascending; a hit is the
    last (none: a miss). One part missing a piece never yields a point it cannot restore."""
    common = set(range(1, num_pages + 1))
    for points in parts:
        common.intersection_update(points)
    return sorted(common)


def check_chunk_blocks(chunk_size: int, block_size: int, knob: str) -> int:
    """Blocks per kvtier chunk; refuses a chunk that is not whole engine blocks.

    A chunk is copied block by block into the engine's paged cache, so a block never straddles
    two chunks. `knob` names the engine setting to change.
    """
    if block_size < 1 or chunk_size % block_size:
        raise InvalidArgumentError(
            f"kvtier's chunk size ({chunk_size} tokens, `kvtier serve --chunk-size`) must be a "
            f"multiple of the engine's block size ({block_size} tokens, {knob}): change one"
        )
    return chunk_size // block_size


def refuse_unknown_keys(
    settings: Mapping[str, object],
    known: Mapping[str, str],
    what: str,
    error: type[Exception] = InvalidArgumentError,
) -> None:
    """An adapter's config keys are a table: a key not in it (a typo) is refused with the list
    of valid ones, never ignored. `error` is what the engine stops on at start."""
    unknown = sorted(str(k) for k in set(settings) - set(known))
    if unknown:
        valid = "; ".join(f"{k}: {v}" for k, v in known.items())
        raise error(f"{what} has unknown key(s) {unknown}; it takes {valid}")


#: the credential keys every adapter's config takes
CREDENTIAL_KEYS = {
    "token": "the credential for a server started with --auth-tokens-file",
    "token_file": "a file holding that credential (its first line; instead of `token`)",
}


#: the key an engine states its prefill speed under, and what it means
PREFILL_KEY = {
    "prefill_tokens_per_s": "this engine's prefill speed in tokens per second: kvtier then "
    "reports no chunk whose load from an L2 tier would take longer than recomputing it "
    "(default 0: unknown, every cached chunk is reported)",
}


def prefill_speed(settings: Mapping[str, object], what: str) -> float:
    """The engine's stated prefill speed (`prefill_tokens_per_s`; 0 when not given), sent with
    each lookup so the server leaves out loads slower than recomputing."""
    raw = settings.get("prefill_tokens_per_s", 0.0)
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(
            f"{what}: prefill_tokens_per_s={raw!r} must be >= 0 tokens per second (0: unknown)"
        )
    return value


def credential(settings: Mapping[str, object], what: str) -> str:
    """The credential from `token` or `token_file` (one of them at most); "" when neither.

    A file is read once, at start; its first line is the credential, surrounding blanks
    aside, so a file written with `echo` works.
    """
    token, token_file = settings.get("token"), settings.get("token_file")
    if token and token_file:
        raise InvalidArgumentError(
            f"{what}: give `token` or `token_file`, not both (token_file={token_file!r})"
        )
    if token_file:
        try:
            with open(str(token_file), encoding="utf-8") as f:
                value = f.readline().strip()
        except OSError as exc:
            raise InvalidArgumentError(
                f"{what}: token_file={token_file!r} cannot be read: {exc.strerror}"
            ) from None
        if not value:
            raise InvalidArgumentError(f"{what}: token_file={token_file!r} holds no credential")
        return value
    if token is not None and not isinstance(token, str):
        raise InvalidArgumentError(f"{what}: token must be a string, got {type(token).__name__}")
    return token or ""


class Recompute:
    """Runs kvtier calls under one rule: a `KVTierError` is logged, kept in `last_error`, and
    the call reads as its fallback (0 tokens, nothing loaded): the engine recomputes.

    Once a call failed, later calls until `reset()` return their fallback at once, so one
    request does not wait on an unreachable server again and again.

    An engine whose calls each stand alone (no request or step to reset at) passes
    `per_unit=False`: every call is attempted (the client itself fails fast while the server
    is away), and an outage is logged once: its first failure as a warning, the failures
    after it at debug level, and the first success after it at info level.
    """

    def __init__(self, what: str, *, per_unit: bool = True) -> None:
        self.what = what
        self.per_unit = per_unit
        self.last_error: KVTierError | None = None
        self._failing = False  # per_unit=False: an outage is under way

    def reset(self) -> None:
        """Start a new unit of work (a request, a step): calls are attempted again."""
        self.last_error = None

    def call(self, name: str, fallback: T, fn: Callable[..., T], *args: object, **kw: object) -> T:
        """`fn(*args, **kw)`, or `fallback` when kvtier failed (now or earlier in this unit)."""
        if self.per_unit and self.last_error is not None:
            return fallback
        try:
            result = fn(*args, **kw)
        except KVTierError as exc:
            self.fail(name, exc)
            return fallback
        if self._failing:
            logger.info("%s: kvtier answers again", self.what)
            self._failing = False
        return result

    def fail(self, name: str, exc: KVTierError) -> None:
        """Record a kvtier failure that the caller handled itself."""
        log = logger.debug if self._failing else logger.warning
        log("%s: kvtier %s failed, recomputing instead: %s", self.what, name, exc)
        self.last_error = exc
        self._failing = not self.per_unit


class _NotYet(NotConnectedError):
    """The last connect failed moments ago; the next attempt waits for `retry_s`."""


class LazyClient:
    """A `Client` an engine process opens on first use and re-opens after a failed connect.

    An engine must start (and recompute) while kvtier is down: a connect that fails is logged
    and retried on a later use, at most every `retry_s` seconds. `on_connect` runs on each new
    client (registration, checks); an error it raises other than a `KVTierError` (a refused
    configuration) propagates. `try_connect` lets the `refused` errors propagate too: settings
    the operator must fix, never waited out. `timeout`, `connect_timeout`, `transfer` and `token`
    are the `Client`'s.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        on_connect: Callable[[Client], None] | None = None,
        retry_s: float = 5.0,
        token: str = "",
        connect_timeout: float = 2.0,
        transfer: Transfer = "auto",
        refused: tuple[type[Exception], ...] = (InvalidArgumentError,),
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.transfer: Transfer = transfer
        self._token = token
        self.on_connect = on_connect
        self.retry_s = retry_s
        self.refused = refused
        self._client: Client | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def get(self) -> Client:
        """The connected client; NotConnectedError while kvtier cannot be reached."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                raise _NotYet(
                    f"kvtier at {self.address} was unreachable; retrying in "
                    f"{self._next_try - now:.1f}s"
                )
            self._next_try = now + self.retry_s
            client = Client(
                self.address,
                timeout=self.timeout,
                connect_timeout=self.connect_timeout,
                transfer=self.transfer,
                token=self._token,
            )
            try:
                if self.on_connect is not None:
                    self.on_connect(client)
            except BaseException:
                client.close()
                raise
            self._client = client
            return client

    @property
    def connected(self) -> Client | None:
        """The client when one is connected, else None; never connects."""
        return self._client

    def try_connect(self, what: str, recompute: Recompute | None = None) -> Client | None:
        """`get()`, or None when kvtier cannot be reached now: logged, or with `recompute`,
        recorded there as a failed connect (its log, its `last_error`)."""
        try:
            return self.get()
        except self.refused:
            raise  # a refused configuration is the operator's to fix, not a recompute
        except _NotYet:
            return None  # said once, when the attempt failed
        except KVTierError as exc:
            if recompute is not None:
                recompute.fail("connect", exc)
            else:
                logger.warning(
                    "%s: kvtier at %s is not reachable, recomputing: %s", what, self.address, exc
                )
            return None

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
