"""Layer-wise loads and saves for the vLLM worker: the bookkeeping that lets a step's copies run
beside its forward pass, and the figures that say how much of them it hid.

A layer-wise load starts in `start_load_kv` on the loader thread (on a GPU the thread queues
the copies on the copy stream), one layer after another in the model's order; vLLM's
`wait_for_layer_load(layer)` waits for that layer only, so layer i's copy runs while layers
before it compute. A layer-wise save is handed to the saver thread at the step's first
`save_kv_layer` (vLLM calls `start_load_kv` after the forward pass in steps without loads to
wait for); the saver opens its slots at once and copies each layer once `save_kv_layer(layer)`
says the forward pass wrote it (`wait_for_save` releases every layer still unannounced).

Overlap: each copy's time (`copy_s`) and the part of it the forward pass waited for
(`exposed_s`: time blocked in `start_load_kv`, `wait_for_layer_load` and `wait_for_save`);
what was hidden is the rest. A whole-request load hides nothing: it runs inside
`start_load_kv`.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import KVTierError
from kvtier.integrations.vllm.metadata import Transfer
from kvtier.integrations.vllm.paged import Bytes, Copier, PagedLayout

logger = logging.getLogger(__name__)


def use_layerwise(mode: str, device_type: str) -> bool:
    """Whether loads and saves go layer by layer: "auto" turns them on for a GPU cache only (on
    the CPU the copy thread competes with the forward pass for the same cores; docs/vllm.md)."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def _number(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def forward_order(layout: PagedLayout) -> list[tuple[int, int, str]]:
    """(layout group, layer in the group, layer name) in the order the forward pass runs them:
    by the numbers in the layer names (`model.layers.3.self_attn.attn`), groups interleaved."""
    pairs = [
        (li, j, name)
        for li, group in enumerate(layout.groups)
        for j, name in enumerate(group.group.layer_names)
    ]
    return sorted(pairs, key=lambda p: (_number(p[2]), p[0], p[1]))


@dataclass
class LayerGate:
    """Per layer: set once its bytes may be used (a load: copied or, on a GPU, queued with an
    event; a save: written by the forward pass, with the compute stream's event)."""

    names: Iterable[str]
    _flags: dict[str, threading.Event] = field(init=False)
    _events: dict[str, Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._flags = {n: threading.Event() for n in self.names}

    def open(self, name: str, event: Any = None) -> None:
        flag = self._flags.get(name)
        if flag is None or flag.is_set():
            return
        self._events[name] = event
        flag.set()

    def open_all(self, event: Any = None) -> None:
        for name in self._flags:
            self.open(name, event)

    def is_open(self, name: str) -> bool:
        flag = self._flags.get(name)
        return flag is None or flag.is_set()

    def wait(self, name: str) -> Any:
        """Wait until `name` is open; its event (None for a name not gated)."""
        flag = self._flags.get(name)
        if flag is None:
            return None
        flag.wait()
        return self._events.get(name)


@dataclass
class SaveJob:
    """One save for the saver thread: the transfer, the staged pieces, the ordering event."""

    save: Transfer
    staged: Bytes | None = None  # (chunks, tail bytes): pieces copied in wait_for_save
    event: Any = None  # GPU: recorded on the compute stream after the forward pass
    skip: bool = False  # nothing to store from this rank (only counted for get_finished)
    #: layer-wise: each layer opens once the forward pass wrote it (save_kv_layer)
    gate: LayerGate | None = None
    staged_ready: threading.Event | None = None  # layer-wise: `staged` is set
    waited: float = 0.0  # seconds the saver waited for the forward pass (not copy time)
    cancelled: bool = False  # layer-wise: the step never ended (shutdown): store nothing

    def release(self, event: Any = None) -> None:
        """Layer-wise: the forward pass is over (or never ends): every layer may be copied."""
        if self.gate is not None and self.staged_ready is not None:
            self.gate.open_all(event)
            self.staged_ready.set()


@dataclass
class StepLoads:
    """One step's layer-wise loads: the gate per layer, and each load's outcome."""

    gate: LayerGate
    loads: list[Any]  # the step's Transfers
    done: threading.Event = field(default_factory=threading.Event)
    ok: dict[str, bool] = field(default_factory=dict)  # vLLM request id -> loaded
    copy_s: float = 0.0  # the loader's time on this step
    exposed: float = 0.0  # the forward pass's time waiting for it

    def wait_layer(self, name: str) -> Any:
        """Wait until layer `name` is in place (counted as exposed); its GPU event."""
        t0 = time.perf_counter()
        event = self.gate.wait(name)
        self.exposed += time.perf_counter() - t0
        return event

    def finish(self) -> None:
        """Wait until every copy of the step is done and its slots released."""
        t0 = time.perf_counter()
        self.done.wait()
        self.exposed += time.perf_counter() - t0


def run_step_loads(
    step: StepLoads,
    order: list[tuple[int, int, str]],
    copier: Copier,
    event: Any,
    *,
    open_load: Callable[[ExitStack, Any], list[Bytes] | None],
    load_layer: Callable[[list[Bytes], int, Any, int], bool],
    on_lost: Callable[[KVTierError], None],
    hook: Callable[[str], None] | None = None,
) -> None:
    """On the loader thread: open every load's slots (`open_load`: None when kvtier no longer
    holds them all), wait for `event` (a GPU: work queued before the step), then queue each
    layer's copies for every load (`load_layer`: False fails that load) and open the layer's
    gate: on the CPU once they are done, on a GPU with the copy stream's event. The slots are
    released only once every copy is done. The gates all open, and `done` is set, whatever
    happens."""
    sw = Stopwatch()
    try:
        with sw, ExitStack() as stack:
            opened = []
            for load in step.loads:
                views = open_load(stack, load)
                step.ok[load.request_id] = views is not None
                if views is not None:
                    opened.append((load, views))
            copier.wait(event)
            try:
                for li, j, name in order:
                    for load, views in opened:
                        if step.ok[load.request_id] and not load_layer(views, li, load, j):
                            step.ok[load.request_id] = False
                    step.gate.open(name, copier.flush())
                    if hook is not None:
                        hook(name)
            finally:
                copier.sync()  # every copy is done before the slots are released
    except KVTierError as exc:  # a lapsed lease: the bytes copied are not vouched for
        on_lost(exc)
        step.ok = dict.fromkeys(step.ok, False)
    except Exception:
        step.ok = {load.request_id: False for load in step.loads}
        raise
    finally:
        step.gate.open_all()
        step.copy_s = sw.seconds
        step.done.set()


class Loader:
    """The loader thread: runs one step's loads after another."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a bug must not kill the loader: the step's gates are opened
                logger.exception("kvtier layer-wise load failed")

    def close(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


class Overlap:
    """Copy time and the part of it the forward pass waited for, loads and saves apart;
    `take()` hands over what was counted since its last call (vLLM's connector stats)."""

    KEYS = ("load_copy_s", "load_exposed_s", "loads", "save_copy_s", "save_exposed_s", "saves")

    def __init__(self, keys: tuple[str, ...] = KEYS) -> None:
        self.keys = keys
        self._lock = threading.Lock()
        self.total = dict.fromkeys(keys, 0.0)
        self._since = dict.fromkeys(keys, 0.0)

    def add(self, **values: float) -> None:
        with self._lock:
            for key, value in values.items():
                self.total[key] += value
                self._since[key] += value

    def take(self) -> dict[str, float]:
        with self._lock:
            since, self._since = self._since, dict.fromkeys(self.keys, 0.0)
        return since

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.total)


def hidden_fraction(copy_s: float, exposed_s: float) -> float:
    """The share of copy time the forward pass did not wait for (0 when nothing was copied)."""
    if copy_s <= 0:
        return 0.0
    return max(0.0, min(1.0, (copy_s - exposed_s) / copy_s))


class Stopwatch:
    """Seconds spent inside `with` blocks, summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._t0
