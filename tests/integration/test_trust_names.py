"""Names a client cannot forge or mix up, and session bounds one tenant cannot spend for
another: real `kvtier serve` processes, real client processes, the real Redis.

- a chunk's name comes from the exact tokens of the request that stores, retrieves or looks it
  up, even while another request of the same id sets another prompt;
- composed names: two servers on one Redis, and anonymous session ids, reach nobody else's;
- per-tenant shares of the session bounds: a tenant sheds its own sessions, never another's;
- session-token counting stays exact under concurrent requests of one session;
- a refused layout is never recorded.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from testkit.admin import status
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess, free_port, start_redis
from testkit.trust import SHAPE, SPAWN, kv_for
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.errors import (
    BadArrayError,
    KVTierError,
    NoSpaceError,
    NotRegisteredError,
    UnknownSessionError,
)

TINY = (1, CS, 2)  # 64 bytes a chunk in float16: long prompts, little memory
LONG = 4096  # tokens: a prompt this long is hashed on a handler thread, concurrently
TOKEN_A = "tenant-a-0123456789abcdef0123456789"
TOKEN_B = "tenant-b-0123456789abcdef0123456789"
TOKEN_C = "tenant-c-0123456789abcdef0123456789"
TOKEN_BX = "tenant-bx-0123456789abcdef012345678"


def _tokens_file(tmp_path: Path, lines: str) -> str:
    path = tmp_path / "tokens"
    path.write_text(lines)
    return str(path)


def _sessions(server: ServerProcess) -> list[dict[str, Any]]:
    assert server.admin_url is not None
    reply = httpx.get(server.admin_url + "/sessions?limit=1000", timeout=5)
    return reply.json()["sessions"]  # type: ignore[no-any-return]


# -- one request id, two prompts at once ---------------------------------------------------------


def _long_prompt(which: int, i: int) -> list[int]:
    base = (which * 100_000 + i) * LONG
    return list(range(base, base + LONG))


def _hammer(address: str, which: int, seconds: float, queue: Any) -> None:
    """Store then retrieve a new prompt per step under the one request id "shared", checking
    every byte and every lookup, until `seconds` pass; reports the counts."""
    result: dict[str, Any] = {
        "which": which,
        "steps": 0,
        "checked": 0,
        "wrong": 0,
        "short_lookups": 0,
    }
    try:
        with Client(address) as c:
            c.register(model="m", chunk_shape=TINY, dtype="float16")
            deadline = time.monotonic() + seconds
            i = 0
            while time.monotonic() < deadline:
                tokens = _long_prompt(which, i)
                kv = kv_for(which * 100_000 + i, LONG // CS, TINY)
                c.store("shared", tokens, kv, model="m")
                # just stored, and the L1 holds every step's chunks: a full hit, or the lookup
                # named another prompt's chunks
                if c.lookup("shared", tokens, model="m") != LONG:
                    result["short_lookups"] += 1
                out = np.zeros_like(kv)
                got = c.retrieve("shared", tokens, out, model="m") // CS
                result["checked"] += got
                result["wrong"] += sum(1 for k in range(got) if not np.array_equal(out[k], kv[k]))
                result["steps"] += 1
                i += 1
    except Exception as exc:  # reported, so the test shows why rather than a hang
        result["error"] = repr(exc)
    queue.put(result)


def test_one_request_id_with_two_prompts_at_once_never_mixes_their_names(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Two honest clients that number requests from one counter send the same request id with
    different prompts at once. Setting a session's tokens and reading its hashes were two holds
    of its lock: a store between them committed its KV under the other prompt's names (wrong
    bytes for whoever read those), a retrieve or lookup read the other's chunks. Each name now
    comes from its request's own tokens: 0 wrong chunks, every lookup a full hit."""
    server = server_factory("--l1-size", "256MiB", "--chunk-size", str(CS))
    queue = SPAWN.Queue()
    procs = [SPAWN.Process(target=_hammer, args=(server.address, w, 10.0, queue)) for w in (1, 2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
    for r in results:
        assert "error" not in r, r
        assert r["steps"] > 10 and r["checked"] > 0, r
    assert [(r["wrong"], r["short_lookups"]) for r in results] == [(0, 0), (0, 0)], results
    assert "Traceback" not in server.output


# -- composed names -------------------------------------------------------------------------------


def test_two_servers_on_one_redis_keep_a_tenants_chunks_from_anonymous_clients(
    server_factory: Callable[..., ServerProcess],
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
) -> None:
    """Server 1 authenticates tenant B; server 2, on the same Redis, is anonymous. Tier keys
    held B's model and salt as the joined strings `B\\0llama` and `B\\0`, so an anonymous
    client of server 2 naming exactly those read B's chunks. Composed names spell no one
    else's: the chunks are in Redis, and the anonymous client finds none of them."""
    import redis

    l2 = f"{redis_url}?prefix={redis_prefix}"
    tokens_file = _tokens_file(tmp_path, f"{TOKEN_B} B\n")
    one = server_factory(
        "--l1-size", "4MiB", "--chunk-size", str(CS), "--auth-tokens-file", tokens_file,
        "--l2", l2,
    )  # fmt: skip
    two = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS), "--l2", l2)
    tokens, kv = prompt(7, 3), kv_for(7, 3)
    with Client(one.address, token=TOKEN_B) as b:
        b.register(model="llama", chunk_shape=SHAPE, dtype="float16")
        assert b.store("w", tokens, kv, model="llama") == 3 * CS
    r = redis.Redis.from_url(redis_url)
    assert wait_for(lambda: len(list(r.scan_iter(match=f"{redis_prefix}:*"))) >= 3)
    with Client(two.address) as anon:
        anon.register(model="B\0llama", chunk_shape=SHAPE, dtype="float16")
        assert anon.lookup("r", tokens, model="B\0llama", cache_salt="B\0") == 0
        out = np.zeros_like(kv)
        assert anon.retrieve("r", tokens, out, model="B\0llama", cache_salt="B\0") == 0
        assert not out.any()


def test_an_anonymous_request_id_cannot_spell_another_salts_session(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """An anonymous client with no salt naming `victim\\0req-1` reached salt `victim`'s
    session `req-1` (session ids were the joined string): it could release its pins and end
    it. Session ids are composed: that name is a session of its own, which does not exist."""
    server = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS))
    tokens = prompt(3)
    with Client(server.address) as victim, Client(server.address) as other:
        victim.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert victim.store("w", tokens, kv_for(3), model="m", cache_salt="victim") == CS
        assert victim.lookup("req-1", tokens, model="m", cache_salt="victim") == CS
        for call in (other.release, other.end_session):
            with pytest.raises(UnknownSessionError):
                call("victim\0req-1")
        pinned = [s for s in _sessions(server) if s["request_id"] == "req-1"]
        assert [(s["cache_salt"], s["pinned_chunks"]) for s in pinned] == [("victim", 1)]
        victim.end_session("req-1", cache_salt="victim")


def test_metric_labels_of_two_tenants_models_never_collide(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """A model's metric label joined tenant and model with "/": tenant `B`'s model `x/llama`
    and tenant `B/x`'s model `llama` shared the label `B/x/llama` and its counts. Labels are
    built so that no two (tenant, model) pairs share one."""
    tokens_file = _tokens_file(tmp_path, f"{TOKEN_B} B\n{TOKEN_BX} B/x\n")
    server = server_factory(
        "--l1-size", "4MiB", "--chunk-size", str(CS), "--auth-tokens-file", tokens_file
    )
    with Client(server.address, token=TOKEN_B) as b, Client(server.address, token=TOKEN_BX) as bx:
        b.lookup("r", prompt(1), model="x/llama")
        bx.lookup("r", prompt(1), model="llama")
        bx.lookup("r2", prompt(1), model="llama")
    models = {m["model"]: m["lookups"] for m in status(server)["models"]}
    assert len(models) == 2 and sorted(models.values()) == [1, 2], models


# -- per-tenant shares of the session bounds ------------------------------------------------------


def test_a_tenant_over_its_share_sheds_its_own_sessions_never_anothers(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """One tenant's many sessions shed another tenant's longest-idle sessions and released
    their pins. Each tenant now holds at most its share of the bounds (--tenant-session-share,
    half by default) and sheds its own longest-idle sessions."""
    tokens_file = _tokens_file(tmp_path, f"{TOKEN_A} A\n{TOKEN_B} B\n")
    server = server_factory(
        "--l1-size", "4MiB", "--chunk-size", str(CS), "--auth-tokens-file", tokens_file,
        "--max-sessions", "40",
    )  # fmt: skip
    with Client(server.address, token=TOKEN_B) as b, Client(server.address, token=TOKEN_A) as a:
        b.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert b.store("w", prompt(1), kv_for(1), model="m") == CS
        for i in range(5):  # the victim's sessions, pinning its chunk, idle from now on
            assert b.lookup(f"v{i}", prompt(1), model="m") == CS
        for i in range(300):
            a.lookup(f"s{i}", prompt(i + 2), model="m")
        counts = status(server)["sessions"]
        assert counts["shed"] >= 280, counts
        mine = [s for s in _sessions(server) if s["tenant"] == "B"]
        assert sorted((s["request_id"], s["pinned_chunks"]) for s in mine) == [
            *((f"v{i}", 1) for i in range(5)),
            ("w", 0),
        ]
        theirs = [s for s in _sessions(server) if s["tenant"] == "A"]
        assert 0 < len(theirs) <= 20  # A's share: half of --max-sessions
        for i in range(5):
            b.end_session(f"v{i}")  # each still there


def test_a_tenant_at_a_full_server_is_refused_rather_than_shedding_others(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """When the others' shares fill the server, a tenant with no idle session of its own to end
    gets a typed error naming the bounds; the others keep every session."""
    tokens_file = _tokens_file(tmp_path, f"{TOKEN_A} A\n{TOKEN_B} B\n{TOKEN_C} C\n")
    server = server_factory(
        "--l1-size", "4MiB", "--chunk-size", str(CS), "--auth-tokens-file", tokens_file,
        "--max-sessions", "10",
    )  # fmt: skip
    with (
        Client(server.address, token=TOKEN_A) as a,
        Client(server.address, token=TOKEN_B) as b,
        Client(server.address, token=TOKEN_C) as c,
    ):
        for i in range(5):  # A's and B's shares: 5 each, 10 in all
            a.lookup(f"a{i}", prompt(1), model="m")
            b.lookup(f"b{i}", prompt(1), model="m")
        with pytest.raises(NoSpaceError, match="--max-sessions"):
            c.lookup("c0", prompt(1), model="m")
        held = sorted(s["request_id"] for s in _sessions(server))
        assert held == sorted([f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)])
        assert status(server)["sessions"]["shed"] == 0
        a.end_session("a0")
        assert c.lookup("c0", prompt(1), model="m") == 0  # room again: C gets its session


# -- exact session-token counting -----------------------------------------------------------------


def _one_session(address: str, which: int, rounds: int, go: Any, queue: Any) -> None:
    """Retrieve and look up this process's own prompt (its own length) under the one request
    id "one", `rounds` times, starting together with the other processes: requests of one
    session overlap, each replacing the others' tokens (and hashing its own anew)."""
    errors: list[str] = []
    num_tokens = (which + 1) * LONG
    tokens = list(range(which * 1_000_000, which * 1_000_000 + num_tokens))
    out = np.zeros((num_tokens // CS, *TINY), dtype=np.float16)
    with Client(address) as c:
        c.register(model="m", chunk_shape=TINY, dtype="float16")
        go.wait(30)
        for _ in range(rounds):
            try:
                c.retrieve("one", tokens, out, model="m")
                c.lookup("one", tokens, model="m")
            except KVTierError as exc:  # counted, and the rounds go on
                errors.append(repr(exc))
    queue.put(errors)


def test_session_tokens_are_counted_exactly_under_concurrent_requests_of_one_session(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Counting a session's tokens read them without the lock and added the change under it:
    concurrent requests of one session each added the same change, for good (and past 90% of
    --max-session-tokens every request shed every other session). After concurrent requests
    end, the count equals what the session holds, and 0 once it ends."""
    server = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS))
    num_procs, rounds = 4, 150
    go, queue = SPAWN.Barrier(num_procs), SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_one_session, args=(server.address, w, rounds, go, queue))
        for w in range(num_procs)
    ]
    for proc in procs:
        proc.start()
    errors = [e for _ in procs for e in queue.get(timeout=240)]
    for proc in procs:
        proc.join(30)
    [held] = _sessions(server)
    assert held["num_tokens"] in {(w + 1) * LONG for w in range(num_procs)}
    assert status(server)["sessions"]["tokens"] == held["num_tokens"]
    assert errors == []
    with Client(server.address) as c:
        c.end_session("one")
    counts = status(server)["sessions"]
    assert (counts["active"], counts["tokens"], counts["shed"]) == (0, 0, 0)


# -- layouts --------------------------------------------------------------------------------------


def test_a_refused_layout_is_never_recorded(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Register recorded a layout before refusing it (one chunk larger than the L1): every later,
    correct registration of the model was a LAYOUT_MISMATCH until a restart."""
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(server.address) as c:
        with pytest.raises(NoSpaceError, match="--l1-size"):
            c.register(model="m", chunk_shape=(1024, CS, 64), dtype="float32")  # 4 MiB
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("w", prompt(1), kv_for(1), model="m") == CS


def test_a_refused_store_leaves_no_session_behind(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A store of an array the model's layout refuses made the request's session and counted
    its tokens before refusing it; the layout is now checked first."""
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(server.address) as c:
        with pytest.raises(NotRegisteredError):
            c.store("w", prompt(1, 2), kv_for(1, 2), model="never-registered")
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        with pytest.raises(BadArrayError):
            c.store("w2", prompt(1), kv_for(1, 1, TINY), model="m")
    counts = status(server)["sessions"]
    assert (counts["active"], counts["tokens"]) == (0, 0), counts


def test_a_lookup_never_reports_another_prompts_load_under_its_request_id(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """One request id, two prompts: while the first prompt's chunks load from a stalled L2,
    a lookup of the second prompt under the same id is answered about its own chunks at once,
    never with the first prompt's hit when that load ends."""
    port = free_port()
    redis = start_redis(port)
    try:
        l2 = f"redis://127.0.0.1:{port}/0?prefix=kvtier-join-{uuid.uuid4().hex[:8]}&timeout=20"
        first = server_factory("--chunk-size", str(CS), "--l2", l2)
        long_prompt, short_prompt = prompt(71, 8), prompt(72, 2)
        with Client(first.address) as c:
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
            assert c.store("w", long_prompt, kv_for(71, 8), model="m") == 8 * CS
            assert wait_for(lambda: status(first)["l2"]["written"] >= 8)
        first.stop()
        second = server_factory("--chunk-size", str(CS), "--l2", l2)  # an empty L1
        with Client(second.address) as c:
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
            redis.send_signal(signal.SIGSTOP)  # the long prompt's loads wait on Redis
            handle = c.lookup("shared", long_prompt, model="m", wait=False)
            assert handle.poll() is None
            t0 = time.monotonic()
            hit = c.lookup("shared", short_prompt, model="m")
            assert hit == 0 and time.monotonic() - t0 < 5  # its own chunks: none stored
            redis.send_signal(signal.SIGCONT)
            assert handle.result(timeout=30) == 8 * CS
    finally:
        redis.send_signal(signal.SIGCONT)
        redis.kill()
        redis.wait()
