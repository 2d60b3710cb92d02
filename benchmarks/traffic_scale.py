"""The sizes of one traffic run (`benchmarks.bench_traffic`): `FULL` for `make bench`, `SMOKE`
for the test suite."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.chat_driver import ChatLoad


@dataclass(frozen=True)
class Scale:
    """The sizes of one run; `FULL` for `make bench`, `SMOKE` for the test suite."""

    repeats: int = 3
    max_model_len: int = 2048
    cache_blocks: int = 65  # vLLM's KV cache in blocks of 32 tokens (one is its null block)
    chat: ChatLoad = field(
        default_factory=lambda: ChatLoad(
            users=8, turns=8, system_words=256, user_words=160, output_tokens=16
        )
    )
    doc_len: int = 1024
    doc_question: int = 128
    docs: int = 6
    doc_prompts: int = 48
    doc_output: int = 16
    # no reuse: two requests at a time fit vLLM's cache, so that no request is preempted (kvtier
    # would win back a preempted request's prefill, which is not what this scenario asks)
    random_len: int = 896
    random_prompts: int = 32
    random_output: int = 16
    random_concurrency: int = 2
    concurrency: int = 4
    replica_repeats: int = 2
    restarts: int = 2
    restart_docs: int = 8
    restart_doc_len: int = 1792
    eager: bool = False  # skip vLLM's torch.compile warm-up (about 40 s a start on this CPU)
    block_size: int = 32  # vLLM's --block-size (tokens); cache_blocks counts these


FULL = Scale()
SMOKE = Scale(
    repeats=1,
    max_model_len=1024,
    cache_blocks=33,
    chat=ChatLoad(users=4, turns=2, system_words=256, user_words=300, output_tokens=4),
    random_len=256,
    random_prompts=4,
    random_output=4,
    concurrency=2,
    restarts=1,
    restart_docs=2,
    restart_doc_len=600,
    eager=True,
)
