"""`kvtier demo`: time-to-first-token of a real transformers model with and without kvtier, on a
multi-turn chat and on questions about one shared document; prints a table and writes a plot.

The model has random weights built from a config (nothing is downloaded): TTFT depends on the
model's shape, not on what it has learnt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

#: how to get what this module needs beyond kvtier's core
EXTRA_HINT = (
    "install the transformers extra: pip install '.[transformers]' in the kvtier clone "
    "(or `make demo`, which does)"
)

try:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
        Qwen2Config,
        Qwen2ForCausalLM,
    )
except ModuleNotFoundError as exc:  # the core package never installs torch or transformers
    raise ModuleNotFoundError(
        f"kvtier's demo and transformers integration need torch and transformers "
        f"({exc.name} is missing): {EXTRA_HINT}",
        name=exc.name,
    ) from None

# After the check above, so that a missing torch is reported there, with the extra to install.
from kvtier.client import Client  # noqa: E402
from kvtier.integrations.transformers import KVTierCache, full_prefill  # noqa: E402

ARCHITECTURES = ("llama", "qwen2")


def random_model(
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 256,
    max_positions: int = 1024,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PreTrainedModel:
    """A causal LM with seeded random weights (same arguments, same weights), in eval mode."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "max_position_embeddings": max_positions,
    }
    torch.manual_seed(seed)
    model: PreTrainedModel
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"arch={arch!r} is not one of {ARCHITECTURES}")
    # Through nn.Module: transformers wraps `to` and `eval` in decorators mypy cannot see through.
    torch.nn.Module.to(model, dtype)
    torch.nn.Module.eval(model)
    return model


@dataclass(frozen=True)
class DemoSize:
    """How big the demo's model and prompts are."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    system_tokens: int
    turn_tokens: int
    reply_tokens: int
    turns: int
    document_tokens: int
    question_tokens: int
    questions: int
    chunk_size: int  # for a server the demo starts itself


FULL = DemoSize(1024, 4096, 2, 8, 512, 192, 24, 6, 3072, 48, 4, 256)
QUICK = DemoSize(64, 128, 2, 4, 48, 24, 4, 3, 96, 8, 2, 16)


@dataclass(frozen=True)
class DemoStep:
    """One prompt of a scenario, timed with and without kvtier."""

    scenario: str
    step: str
    prompt_tokens: int
    hit_tokens: int
    ttft_baseline: float
    ttft_kvtier: float


@contextlib.contextmanager
def serve(chunk_size: int, l1_size: str = "512MiB", *extra: str) -> Iterator[str]:
    """Runs a private kvtier server subprocess, yields its address once it answers and stops it
    with SIGINT on exit. `extra` options replace the default `--l2 none --admin-port -1`."""
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        address = f"ipc://{tmp}/kvtier.sock"
        argv = [sys.executable, "-m", "kvtier.cli", "serve", "--address", address]
        argv += ["--l1-size", l1_size, "--chunk-size", str(chunk_size)]
        argv += ["--l2", "none", "--admin-port", "-1"] if not extra else list(extra)
        log = Path(tmp) / "server.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            connect(address, server=proc, log=log).close()
            yield address
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def connect(
    address: str,
    *,
    wait: float = 60.0,
    server: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> Any:
    """A `kvtier.Client` for `address`, retrying while a just-started `server` comes up."""
    deadline = time.monotonic() + wait
    while True:
        if server is not None and server.poll() is not None:
            output = log.read_text(errors="replace")[-2000:] if log else ""
            raise RuntimeError(f"kvtier serve exited with {server.returncode}:\n{output}")
        try:
            return Client(address, timeout=2.0)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def plot_ttft(
    lengths: Sequence[int],
    baseline: Sequence[float],
    kvtier: Sequence[float],
    path: Path,
    *,
    title: str,
) -> Path:
    """Writes a PNG of TTFT (ms) against prompt length, full recompute against kvtier reuse."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = np.asarray(lengths)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    series = (
        (baseline, "o", "C0", "full recompute (no kvtier)"),
        (kvtier, "s", "C1", "kvtier: reuse cached prefix"),
    )
    for values, marker, color, label in series:
        ys = np.asarray(values) * 1e3
        # every call is a point; the line joins the median per length (several questions about
        # one document share a length, and the first of them is a cold miss)
        ax.scatter(xs, ys, marker=marker, color=color, alpha=0.6)
        ux = np.unique(xs)
        ax.plot(ux, [np.median(ys[xs == x]) for x in ux], "-", marker=marker, color=color,
                label=label)  # fmt: skip
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> npt.NDArray[np.int64]:
    return rng.integers(0, vocab, n, dtype=np.int64)


def _baseline_ttft(model: PreTrainedModel, prompt: npt.NDArray[np.int64]) -> float:
    t0 = time.perf_counter()
    full_prefill(model, prompt)
    return time.perf_counter() - t0


def _chat(
    model: PreTrainedModel, kv: KVTierCache, size: DemoSize, rng: np.random.Generator
) -> Iterator[DemoStep]:
    """Each turn resends the whole history plus a new user message; replies are generated."""
    vocab = int(model.config.vocab_size)
    history = _tokens(rng, size.system_tokens, vocab)
    for turn in range(size.turns):
        prompt = np.concatenate([history, _tokens(rng, size.turn_tokens, vocab)])
        baseline = _baseline_ttft(model, prompt)
        out = kv.generate(prompt, max_new_tokens=size.reply_tokens)
        yield DemoStep(
            "chat",
            f"turn {turn + 1}",
            len(prompt),
            kv.last_hit_tokens,
            baseline,
            kv.last_timings["ttft"],
        )
        history = out[0].numpy()


def _document(
    model: PreTrainedModel, kv: KVTierCache, size: DemoSize, rng: np.random.Generator
) -> Iterator[DemoStep]:
    """Several questions, each appended to the same long document."""
    vocab = int(model.config.vocab_size)
    document = _tokens(rng, size.document_tokens, vocab)
    for q in range(size.questions):
        prompt = np.concatenate([document, _tokens(rng, size.question_tokens, vocab)])
        baseline = _baseline_ttft(model, prompt)
        kv.prefill(prompt)
        yield DemoStep(
            "document",
            f"Q{q + 1}",
            len(prompt),
            kv.last_hit_tokens,
            baseline,
            kv.last_timings["ttft"],
        )


@dataclass(frozen=True)
class StepSummary:
    """One prompt of a scenario over every repeat: medians and the spread (min, max)."""

    scenario: str
    step: str
    prompt_tokens: int
    hit_tokens: int  # the median over repeats (every repeat starts cold, so they agree)
    baseline: tuple[float, float, float]  # (median, min, max) seconds
    kvtier: tuple[float, float, float]

    @property
    def speedup(self) -> float | None:
        """Median full TTFT over median kvtier TTFT; None where nothing was reused (a miss is
        the same computation both ways: any ratio there is noise)."""
        if self.hit_tokens == 0:
            return None
        return self.baseline[0] / self.kvtier[0]


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    return float(np.median(values)), float(min(values)), float(max(values))


def summarize(runs: Sequence[Sequence[DemoStep]]) -> list[StepSummary]:
    """Steps of several runs of the same prompts, grouped by (scenario, step), in run order."""
    out = []
    for steps in zip(*runs, strict=True):
        first = steps[0]
        out.append(
            StepSummary(
                first.scenario,
                first.step,
                first.prompt_tokens,
                int(np.median([s.hit_tokens for s in steps])),
                _spread([s.ttft_baseline for s in steps]),
                _spread([s.ttft_kvtier for s in steps]),
            )
        )
    return out


def _ms(spread: tuple[float, float, float]) -> str:
    """The median on one line, the min-max range under it: every cell stays whole at 80
    columns (the range never wraps mid-number)."""
    median, lo, hi = (v * 1e3 for v in spread)
    return f"{median:.1f} ms\n{lo:.3g}-{hi:.3g}"


def _table(rows: Sequence[StepSummary], repeats: int) -> Table:
    table = Table(
        title=f"TTFT, full recompute against kvtier: median (min-max) of "
        f"{repeats} run{'s' if repeats > 1 else ''}",
    )
    for name in ("scenario", "step", "prompt", "hit", "hit %", "full", "kvtier", "speedup"):
        table.add_column(
            name, justify="left" if name in ("scenario", "step") else "right", no_wrap=True
        )
    for r in rows:
        speedup = r.speedup
        table.add_row(
            r.scenario,
            r.step,
            str(r.prompt_tokens),
            str(r.hit_tokens),
            f"{r.hit_tokens / r.prompt_tokens:.0%}",
            _ms(r.baseline),
            _ms(r.kvtier),
            f"{speedup:.1f}x" if speedup is not None else "- (miss)",
        )
    return table


def plot_scenarios(rows: Sequence[StepSummary], path: Path, *, title: str) -> Path:
    """A PNG with one panel per scenario: median TTFT per step, whiskers from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4.2), dpi=120,
                             squeeze=False)  # fmt: skip
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        mine = [r for r in rows if r.scenario == scenario]
        xs = np.arange(len(mine))
        series = (
            ("baseline", "o", "C0", "full recompute (no kvtier)"),
            ("kvtier", "s", "C1", "kvtier: reuse cached prefix"),
        )
        for attr, marker, color, label in series:
            spreads = np.asarray([getattr(r, attr) for r in mine]) * 1e3
            median = spreads[:, 0]
            err = np.vstack([median - spreads[:, 1], spreads[:, 2] - median])
            ax.errorbar(xs, median, yerr=err, fmt="-" + marker, color=color, capsize=3,
                        label=label)  # fmt: skip
        ax.set_xticks(xs, [f"{r.step}\n{r.prompt_tokens} tok" for r in mine], fontsize=8)
        ax.set_title(scenario)
        ax.set_ylabel("time to first token (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _progress(console: Console) -> Progress:
    """The bar people expect from a long run: done/total, elapsed and time left."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("prompts"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def run_demo(
    address: str | None,
    output_dir: Path,
    *,
    quick: bool = False,
    repeats: int = 5,
    console: Console | None = None,
) -> Path:
    """Runs both scenarios `repeats` times against the server at `address` (or one started here
    when None), prints the TTFT table of medians and returns the path of the PNG plot it writes
    in `output_dir`. Each repeat uses a fresh model name, so each one starts cold."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    console = console or Console()
    size = QUICK if quick else FULL
    runs: list[list[DemoStep]] = []
    with contextlib.ExitStack() as stack:
        if address is None:
            address = stack.enter_context(serve(size.chunk_size))
            console.print(f"started a kvtier server at {address}")
        client: Client = connect(address)
        console.print(
            f"building a random-weight Llama ({size.num_layers} layers, hidden "
            f"{size.hidden_size}) and warming it up"
        )
        stack.callback(client.close)
        model = random_model(
            "llama",
            hidden_size=size.hidden_size,
            intermediate_size=size.intermediate_size,
            num_layers=size.num_layers,
            num_heads=size.num_heads,
            num_kv_heads=max(1, size.num_heads // 2),
            head_dim=64 if not quick else None,
            vocab_size=1024,
            max_positions=8192,
        )
        full_prefill(model, np.arange(64))  # warm-up: first calls pay one-time setup
        total = (size.turns + size.questions) * repeats
        chunk_size = client.chunk_size
        console.print(
            f"timing {total} prompts ({size.turns} chat turns and {size.questions} questions, "
            f"{repeats} run{'s' if repeats > 1 else ''}), each with and without kvtier"
        )
        with _progress(console) as progress:
            task = progress.add_task("run 1", total=total)
            for run in range(repeats):
                # A fresh name per run: every run starts cold, even against a long-lived server.
                name = f"kvtier-demo-{uuid.uuid4().hex[:8]}"
                kv = KVTierCache(model, client, name, store_generated=True)
                rng = np.random.default_rng(0)  # the same prompts in every run
                steps: list[DemoStep] = []
                for scenario in (_chat(model, kv, size, rng), _document(model, kv, size, rng)):
                    for step in scenario:
                        steps.append(step)
                        progress.update(task, advance=1, description=f"run {run + 1}/{repeats}")
                        if not console.is_terminal:  # no live bar: one line per prompt
                            done = len(steps) + run * (size.turns + size.questions)
                            console.print(
                                f"[{done}/{total}] run {run + 1}/{repeats} {step.scenario} "
                                f"{step.step}: {step.prompt_tokens} tokens, "
                                f"{step.hit_tokens} from kvtier"
                            )
                runs.append(steps)
    rows = summarize(runs)
    console.print(_table(rows, repeats))
    console.print(
        f"TTFT: time to first token. Model: random-weight Llama, {size.num_layers} layers, "
        f"hidden {size.hidden_size}; chunk size {chunk_size} tokens; a speedup is shown only "
        "where kvtier had a hit."
    )
    if quick:
        console.print(
            "--quick runs a tiny model on short prompts: recomputing them costs about as much as "
            "a round trip to kvtier, so a speedup near or under 1x is expected here. Without "
            "--quick the model and prompts are big enough for reuse to pay."
        )
    path = plot_scenarios(
        rows,
        Path(output_dir) / "kvtier-demo-ttft.png",
        title=f"kvtier demo: time to first token (median, min-max of {repeats} runs)",
    )
    console.print(f"wrote the TTFT plot to {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvtier.integrations.demo [--quick] [--address A] [--output-dir D]`."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", default=None)
    parser.add_argument("--output-dir", type=Path, default=Path(os.getcwd()))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    run_demo(args.address, args.output_dir, quick=args.quick, repeats=args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
