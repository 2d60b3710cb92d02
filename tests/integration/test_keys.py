"""Key-addressed chunks end to end: a real server, real clients, shared memory and inline frames."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from testkit.admin import status
from testkit.raw_peer import RawPeer
from testkit.servers import ServerProcess
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import Client
from kvtier.errors import BadArrayError, InvalidArgumentError
from kvtier.hashing import TokenHasher
from kvtier.names import MAX_NAME_BYTES, MAX_NAMES

CS = 16
SHAPE = (2, 64)  # 256 bytes per chunk in float16


def chunks(seed: int, n: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float16)


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(n)]


def connect(server: ServerProcess, transfer: str = "auto", world_size: int = 1) -> Client:
    c = Client(server.address, timeout=10, transfer=transfer)  # type: ignore[arg-type]
    for rank in range(world_size):
        c.register(
            model="m", world_size=world_size, worker_id=rank, chunk_shape=SHAPE, dtype="float16"
        )
    return c


@pytest.mark.parametrize("transfer", ["shm", "inline"])
def test_put_exists_get_round_trip(server: ServerProcess, transfer: str) -> None:
    keys = names(f"rt-{transfer}", 6)
    data = chunks(1, 6)
    with connect(server, transfer) as c:
        assert c.transfer == transfer
        assert c.exists_keys(keys, model="m") == 0
        assert c.put_keys(keys[:4], data[:4], model="m") == 4
        assert c.exists_keys(keys, model="m") == 4
        out = np.zeros_like(data)
        assert c.get_keys(keys, out, model="m") == 4
        assert out[:4].tobytes() == data[:4].tobytes()
        assert not out[4:].any()  # nothing written past the first missing name
        # bytes and str names are the same name
        assert c.exists_keys([k.encode() for k in keys], model="m") == 4
        # storing again is a no-op that reports them stored
        assert c.put_keys(keys[:4], chunks(2, 4), model="m") == 4
        assert c.get_keys(keys[:4], out, model="m") == 4
        assert out[:4].tobytes() == data[:4].tobytes()


def test_shared_memory_and_inline_clients_see_each_others_chunks(server: ServerProcess) -> None:
    data = chunks(3, 3)
    with connect(server, "shm") as local, connect(server, "inline") as remote:
        assert local.put_keys(names("a", 3), data, model="m") == 3
        out = np.zeros_like(data)
        assert remote.get_keys(names("a", 3), out, model="m") == 3
        assert out.tobytes() == data.tobytes()
        assert remote.put_keys(names("b", 3), data[::-1].copy(), model="m") == 3
        assert local.get_keys(names("b", 3), out, model="m") == 3
        assert out.tobytes() == data[::-1].tobytes()


def test_a_prefix_counts_only_leading_names(server: ServerProcess) -> None:
    keys = names("p", 5)
    with connect(server) as c:
        c.put_keys([keys[0], keys[1], keys[3]], chunks(4, 3), model="m")
        assert c.exists_keys(keys, model="m") == 2
        assert c.exists_keys(keys[2:], model="m") == 0
        assert c.exists_keys(keys[3:], model="m") == 1
        assert c.exists_keys([], model="m") == 0
        out = np.zeros((5, *SHAPE), np.float16)
        assert c.get_keys(keys, out, model="m") == 2


def test_bad_names_are_refused_by_the_client_and_the_server(server: ServerProcess) -> None:
    good = names("keep", 2)
    data = chunks(5, 2)
    with connect(server) as c:
        c.put_keys(good, data, model="m")
        too_long = "x" * (MAX_NAME_BYTES + 1)
        for bad in ([""], [too_long], [42], [None], "one-name-not-a-list", b"raw-bytes"):
            with pytest.raises(InvalidArgumentError):
                c.exists_keys(bad, model="m")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError):
                c.put_keys(bad, data[:1], model="m")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=str(MAX_NAME_BYTES)):
            c.exists_keys([too_long], model="m")
        with pytest.raises(BadArrayError):
            c.put_keys(names("n", 3), data, model="m")  # 3 names, 2 chunks
    # a client that skips the checks meets the same limits in the server
    raw = RawPeer(server.address)
    try:
        raw.hello()
        too_long_b = b"x" * (MAX_NAME_BYTES + 1)
        assert raw.error(b"s1", p.encode(p.ExistsKeys([b""], "m"))) == InvalidArgumentError.code
        assert raw.error(b"s2", p.encode(p.ExistsKeys([too_long_b], "m"))) == (
            InvalidArgumentError.code
        )
        # (an inline store: slots go only to clients whose process the server watches)
        store = p.StoreKeysInline([b"a", b"b"], "m", 1, 0, list(SHAPE), "float16", 3)
        assert raw.error(b"s3", p.encode(store)) == BadArrayError.code
        assert raw.error(b"s4", p.encode(p.ExistsKeys([b"a"], "m", 0))) == (
            InvalidArgumentError.code
        )
    finally:
        raw.close()
    with connect(server) as c:  # what was stored is intact
        out = np.zeros_like(data)
        assert c.get_keys(good, out, model="m") == 2
        assert out.tobytes() == data.tobytes()


def test_huge_batches_are_refused_whole(server: ServerProcess) -> None:
    huge = names("h", MAX_NAMES + 1)
    with connect(server) as c:
        with pytest.raises(InvalidArgumentError, match=str(MAX_NAMES)):
            c.exists_keys(huge, model="m")
        with pytest.raises(InvalidArgumentError, match=str(MAX_NAMES)):
            c.put_keys(huge, np.zeros((len(huge), *SHAPE), np.float16), model="m")
        # the largest allowed batch works
        full = names("f", MAX_NAMES)
        assert c.exists_keys(full, model="m") == 0
    raw = RawPeer(server.address)
    try:
        raw.hello()
        msg = p.ExistsKeys([n.encode() for n in huge], "m")
        assert raw.error(b"s1", p.encode(msg)) == InvalidArgumentError.code
    finally:
        raw.close()
    assert status(server)["l1"]["ready_groups"] == 0


def test_another_salt_model_or_world_size_never_sees_them(server: ServerProcess) -> None:
    keys = names("t", 3)
    data = chunks(6, 3)
    with connect(server) as c:
        c.register(model="other", chunk_shape=SHAPE, dtype="float16")
        assert c.put_keys(keys, data, model="m", cache_salt="tenant-a") == 3
        assert c.exists_keys(keys, model="m", cache_salt="tenant-a") == 3
        assert c.exists_keys(keys, model="m", cache_salt="tenant-b") == 0
        assert c.exists_keys(keys, model="m") == 0
        assert c.exists_keys(keys, model="other", cache_salt="tenant-a") == 0
        assert c.exists_keys(keys, model="m", world_size=2, cache_salt="tenant-a") == 0
        out = np.zeros_like(data)
        assert c.get_keys(keys, out, model="m", cache_salt="tenant-b") == 0
        assert not out.any()
        # tenant-b stores its own bytes under the same names: tenant-a's stay as they were
        c.put_keys(keys, chunks(7, 3), model="m", cache_salt="tenant-b")
        assert c.get_keys(keys, out, model="m", cache_salt="tenant-a") == 3
        assert out.tobytes() == data.tobytes()


def test_named_and_token_chunks_live_side_by_side(server: ServerProcess) -> None:
    tokens = list(range(2 * CS))
    token_kv = chunks(8, 2)
    hasher = TokenHasher(CS)
    token_names = [bytes(h) for h in hasher.compute_chunk_hashes(tokens)]
    with connect(server) as c:
        assert c.store("r", tokens, token_kv, model="m") == 2 * CS
        # a name equal to a token chunk's hash is another chunk
        assert c.exists_keys(token_names, model="m") == 0
        named_kv = chunks(9, 2)
        assert c.put_keys(token_names, named_kv, model="m") == 2
        out = np.zeros_like(token_kv)
        assert c.retrieve("r", tokens, out, model="m") == 2 * CS
        assert out.tobytes() == token_kv.tobytes()
        assert c.get_keys(token_names, out, model="m") == 2
        assert out.tobytes() == named_kv.tobytes()
    assert status(server)["l1"]["ready_groups"] == 4


def test_a_group_counts_when_every_rank_stored_its_shard(server: ServerProcess) -> None:
    keys = names("tp", 3)
    with connect(server, world_size=2) as rank0, connect(server, world_size=2) as rank1:
        shard = {0: chunks(10, 3), 1: chunks(11, 3)}
        assert rank0.put_keys(keys, shard[0], model="m", worker_id=0) == 3
        assert rank0.exists_keys(keys, model="m", world_size=2) == 0
        out = np.zeros_like(shard[0])
        assert rank0.get_keys(keys, out, model="m", worker_id=0) == 0
        assert rank1.put_keys(keys[:2], shard[1][:2], model="m", worker_id=1) == 2
        assert rank0.exists_keys(keys, model="m", world_size=2) == 2
        assert rank1.exists_keys(keys, model="m", world_size=2) == 2
        for rank, c in ((0, rank0), (1, rank1)):
            out[:] = 0
            assert c.get_keys(keys, out, model="m", worker_id=rank) == 2
            assert out[:2].tobytes() == shard[rank][:2].tobytes()
        # per name, past the missing one too: whole groups only
        gap = names("tp-gap", 2)
        assert rank0.put_keys(gap, shard[0][:2], model="m", worker_id=0) == 2
        assert rank1.put_keys(gap[1:], shard[1][:1], model="m", worker_id=1) == 1
        for c in (rank0, rank1):
            each = c.exists_each_key([*keys, *gap], model="m", world_size=2)
            assert each == [True, True, False, False, True]
        assert rank0.exists_each_key([], model="m", world_size=2) == []
        assert rank0.exists_each_key(gap[1:], model="m") == [False]  # another world size


def test_slots_abort_on_an_exception_and_store_nothing(server: ServerProcess) -> None:
    keys = names("ab", 2)
    with connect(server) as c:
        with (
            pytest.raises(RuntimeError),
            c.store_key_slots(keys, model="m", chunk_shape=SHAPE, dtype="float16") as slots,
        ):
            for _, view in slots.targets():
                view[:] = 1
            raise RuntimeError("the engine failed mid-copy")
        assert c.exists_keys(keys, model="m") == 0
        with c.store_key_slots(keys, model="m", chunk_shape=SHAPE, dtype="float16") as slots:
            assert [i for i, _ in slots.targets()] == [0, 1]
            for i, view in slots.targets():
                view[:] = i + 1
        assert slots.stored_chunks == 2
        with c.retrieve_key_slots(keys, model="m", chunk_shape=SHAPE, dtype="float16") as got:
            assert got.num_chunks == 2
            assert [int(v[0]) for v in got.views] == [1, 2]
            assert not got.views[0].flags.writeable


def test_named_chunks_come_back_from_the_disk_tier(
    server_factory: Callable[..., ServerProcess], tmp_path: object
) -> None:
    server = server_factory(
        "--chunk-size", str(CS), "--l1-size", "1MiB", "--l2", f"disk://{tmp_path}?size=64MiB"
    )
    shape = (64, 1024)  # 128 KiB per chunk: 1 MiB of L1 holds fewer than 8
    keys = names("disk", 24)
    data = chunks(12, 24, shape)
    with Client(server.address, timeout=10) as c:
        c.register(model="m", chunk_shape=shape, dtype="float16")
        for i in range(0, 24, 4):  # in batches; once written to disk, L1 may evict the oldest
            assert c.put_keys(keys[i : i + 4], data[i : i + 4], model="m") == 4
            assert wait_for(lambda n=i + 4: bool(status(server)["l2"]["written"] >= n))
        assert status(server)["l1"]["ready_groups"] < 24  # the first ones left L1
        assert c.exists_keys(keys[:4], model="m") == 4  # loaded back from disk
        out = np.zeros((4, *shape), np.float16)
        assert c.get_keys(keys[:4], out, model="m") == 4
        assert out.tobytes() == data[:4].tobytes()
        # past a name no tier holds, the ones only the disk holds are loaded back too
        sparse = [keys[4], "never-stored", keys[5], keys[6]]  # long evicted from L1
        loaded = status(server)["prefetch"]["loaded_groups"]
        assert c.exists_each_key(sparse, model="m") == [True, False, True, True]
        assert status(server)["prefetch"]["loaded_groups"] == loaded + 3
        assert c.get_keys(sparse[2:], out[:2], model="m") == 2
        assert out[:2].tobytes() == data[5:7].tobytes()
