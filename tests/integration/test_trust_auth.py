"""Issue 10, findings 5 and 12: who may use the data port, and in whose name.

A real server on tcp://0.0.0.0 with a tokens file; clients with and without credentials.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit.admin import status
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess, free_port, start_server
from testkit.trust import kv_for, register, verify

from kvtier.client import Client
from kvtier.errors import (
    LayoutMismatchError,
    UnauthorizedError,
    UnknownSessionError,
)
from kvtier.storage.arena import default_arena_name

TOKEN_A = "tenant-a-scheduler-0123456789"
TOKEN_A2 = "tenant-a-worker-salted-0123456789"
TOKEN_B = "tenant-b-only-salt-b-0123456789"


def _tokens_file(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text(
        f"# token tenant [salts]\n{TOKEN_A} alpha\n{TOKEN_A2} alpha prod\n{TOKEN_B} beta b\n"
    )
    return str(path)


def test_a_tcp_address_off_loopback_requires_credentials() -> None:
    """Finding 5: the data port had no authentication. Off loopback the server refuses to
    start without a tokens file, and leaves nothing behind in /dev/shm."""
    address = f"tcp://0.0.0.0:{free_port()}"
    with pytest.raises(RuntimeError, match="auth-tokens-file"):
        start_server("--l1-size", "1MiB", address=address)
    assert not os.path.exists(f"/dev/shm/{default_arena_name(address)}")


@pytest.fixture
def authed(server_factory: Callable[..., ServerProcess], tmp_path: Path) -> str:
    port = free_port()
    server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--auth-tokens-file", _tokens_file(tmp_path),
        address=f"tcp://0.0.0.0:{port}",
    )  # fmt: skip
    return f"tcp://127.0.0.1:{port}"


def test_no_credential_no_entry(authed: str) -> None:
    with pytest.raises(UnauthorizedError, match="credential"):
        Client(authed)
    with pytest.raises(UnauthorizedError, match="not known"):
        Client(authed, token="x" * 32)


def test_tenants_cannot_poison_take_over_or_lock_out_each_other(authed: str) -> None:
    """Finding 5: any client could store under any salt (poisoning), commit or abort under
    another's client id, end anyone's session, and register a bogus layout first."""
    with Client(authed, token=TOKEN_B) as b:
        # B registers a bogus layout for "m" first: it is B's own namespace
        b.register(model="m", chunk_shape=(1, 2, 3), dtype="float32")
        with Client(authed, token=TOKEN_A) as a:
            register(a)  # not locked out
            with pytest.raises(LayoutMismatchError):
                b.register(model="m", chunk_shape=(1, 2, 4), dtype="float32")
            # B may use only salt "b": it cannot write under A's (or any other) salt
            with pytest.raises(UnauthorizedError, match="cache_salt"):
                b.lookup("r", prompt(1), model="m", cache_salt="")
            assert a.store("r", prompt(1), kv_for(1), model="m") == CS
            assert b.lookup("r", prompt(1), model="m", cache_salt="b") == 0  # not A's chunks
            # A's client id is A's: B cannot say Hello under it
            with pytest.raises(UnauthorizedError, match="client id"):
                Client(authed, token=TOKEN_B, client_id=a.client_id)
            # B cannot end A's session: same request id, different tenant
            assert a.lookup("shared-id", prompt(1), model="m") == CS
            b.lookup("shared-id", prompt(1), model="m", cache_salt="b")
            b.end_session("shared-id", cache_salt="b")
            with pytest.raises(UnknownSessionError):
                b.end_session("shared-id", cache_salt="b")
            assert verify(a, 1, 1, "shared-id") == 1  # A's session and pins intact
            a.end_session("shared-id")


def test_one_engines_scheduler_and_workers_share_a_tenant(authed: str) -> None:
    """Two tokens of one tenant: the scheduler's lookup pins are released by the worker's
    retrieve, as without authentication; a salt-bound token stays within its salts."""
    with Client(authed, token=TOKEN_A) as scheduler, Client(authed, token=TOKEN_A2) as worker:
        register(worker)
        assert worker.store("w", prompt(2), kv_for(2), model="m", cache_salt="prod") == CS
        with pytest.raises(UnauthorizedError):
            worker.store("w", prompt(3), kv_for(3), model="m", cache_salt="dev")
        assert scheduler.lookup("req", prompt(2), model="m", cache_salt="prod") == CS
        out = kv_for(0) * 0
        assert worker.retrieve("req", prompt(2), out, model="m", cache_salt="prod") == CS
        worker.end_session("req")  # the scheduler's session, ended by its worker


def test_a_second_tenant_reusing_a_request_id_keeps_the_first_ones_pins(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 12, without credentials: tenants are told apart by their cache salt."""
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(server.address) as t1, Client(server.address) as t2:
        register(t1)
        register(t2)
        t1.store("w", prompt(4), kv_for(4), model="m", cache_salt="one")
        t1.end_session("w", cache_salt="one")
        assert t1.lookup("req-1", prompt(4), model="m", cache_salt="one") == CS
        assert status(server)["l1"]["pinned_groups"] == 1
        # tenant two reuses the request id: its lookup, release and end are its own
        assert t2.lookup("req-1", prompt(4), model="m", cache_salt="two") == 0
        t2.release("req-1", cache_salt="two")
        t2.end_session("req-1", cache_salt="two")
        with pytest.raises(UnknownSessionError):
            t2.end_session("req-1")  # no salt: no such session either
        assert status(server)["l1"]["pinned_groups"] == 1
        out = kv_for(0) * 0
        assert t1.retrieve("req-1", prompt(4), out, model="m", cache_salt="one") == CS
