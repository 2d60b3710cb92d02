"""Multi-turn chat load against OpenAI-compatible servers: the pattern `vllm bench serve` lacks.

Several users chat at once. Each conversation starts from one system prompt all users share and
grows turn by turn: every request sends the whole conversation so far (the earlier turns, the
replies the server gave, a new user message) to `/v1/chat/completions`, streamed, and the next
turn follows the reply after a think time. With several base URLs, requests go to them in
round-robin order, as behind a round-robin load balancer.

Per request it records the time to first token, the gaps between streamed tokens, the prompt
tokens and the prompt tokens the server reported as cached (`usage.prompt_tokens_details`,
given by vLLM's `--enable-prompt-tokens-details`).

    python -m benchmarks.chat_driver --base-url http://127.0.0.1:8000 --model DIR \\
        --users 8 --turns 6 --json chat.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class ChatLoad:
    users: int = 8
    turns: int = 6
    system_words: int = 512
    user_words: int = 96
    output_tokens: int = 32
    think_s: float = 0.2
    seed: int = 0


@dataclass
class Turn:
    user: int
    turn: int
    server: int  # index into the base URLs
    previous_server: int  # -1 on a conversation's first turn
    previous_tokens: int  # the last turn's prompt and reply: what a cache could reuse now
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def _text(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


async def _ask(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], turn: Turn,
    max_tokens: int,
) -> str:  # fmt: skip
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply: list[str] = []
    start = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                turn.prompt_tokens = usage["prompt_tokens"]
                turn.output_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens") or 0
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if not piece:
                    continue
                now = time.perf_counter()
                if not reply:
                    turn.ttft = now - start
                else:
                    turn.itls.append(now - last)
                last = now
                reply.append(piece)
    turn.latency = time.perf_counter() - start
    return "".join(reply)


async def run_chat(base_urls: list[str], model: str, load: ChatLoad) -> list[Turn]:
    """Every user's conversation, concurrently; the turns in the order they finished."""
    from benchmarks.traffic_model import words

    vocab = words()
    system = _text(random.Random(load.seed), vocab, load.system_words)
    servers = itertools.cycle(range(len(base_urls)))
    done: list[Turn] = []

    async def user(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(load.seed * 1000 + index + 1)
        messages = [{"role": "system", "content": system}]
        previous_server, previous_tokens = -1, 0
        await asyncio.sleep(rng.uniform(0, load.think_s))  # users do not start in lock step
        for t in range(load.turns):
            messages.append({"role": "user", "content": _text(rng, vocab, load.user_words)})
            server = next(servers)
            turn = Turn(index, t, server, previous_server, previous_tokens)
            reply = await _ask(client, base_urls[server], model, messages, turn, load.output_tokens)
            done.append(turn)
            if turn.error:
                return
            messages.append({"role": "assistant", "content": reply})
            previous_server = server
            previous_tokens = turn.prompt_tokens + turn.output_tokens
            await asyncio.sleep(load.think_s)

    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(*(user(i, client) for i in range(load.users)))
    return done


def chat(base_urls: list[str], model: str, load: ChatLoad) -> tuple[list[Turn], float]:
    """Run the load; the turns and the wall time it took."""
    start = time.perf_counter()
    turns = asyncio.run(run_chat(base_urls, model, load))
    return turns, time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chat_driver")
    parser.add_argument("--base-url", action="append", required=True, help="repeat: round-robin")
    parser.add_argument("--model", required=True)
    defaults = ChatLoad()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--json", help="write every turn's record here")
    args = parser.parse_args(argv)
    load = ChatLoad(**{k: getattr(args, k) for k in asdict(defaults)})
    turns, wall = chat(args.base_url, args.model, load)
    errors = [t.error for t in turns if t.error]
    ttfts = sorted(t.ttft for t in turns if not t.error)
    summary: dict[str, Any] = {
        "requests": len(turns),
        "errors": len(errors),
        "wall_s": wall,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else None,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "turns": [asdict(t) for t in turns]}, f)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
