"""KVTierHiCacheStorage through SGLang's real storage interface and backend factory.

SGLang 0.5.23's `hicache_storage` and `backend_factory` are the real modules (imported without
its CUDA stack, see testkit.sglang_cpu); the host pool is a stand-in with real page
buffers (sglang_pool.py). Servers are real `kvtier serve` processes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.admin import status
from testkit.servers import ServerProcess, free_port
from testkit.sglang_pool import HostPoolStandIn, build_backend, keys_for, sglang_api
from testkit.waiting import wait_for

PAGE = 64  # SGLang's default page size


@pytest.fixture(scope="module", autouse=True)
def _sglang() -> None:
    sglang_api()


@pytest.fixture
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return server_factory("--chunk-size", str(PAGE), "--l1-size", "64MiB", "--client-timeout", "3")


def make_backend(address: str, pool: HostPoolStandIn, **options: Any) -> Any:
    """The backend as SGLang builds it, with short timeouts so failure tests stay quick."""
    return build_backend(address, pool, **{"timeout": 2, "retry_interval": 0.2, **options})


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("transfer", ["auto", "inline"])
def test_v1_round_trip_is_byte_exact(server: ServerProcess, layout: str, transfer: str) -> None:
    src = HostPoolStandIn(layout=layout)
    src.fill_random(1)
    dst = HostPoolStandIn(layout=layout)
    writer = make_backend(server.address, src, transfer=transfer)
    reader = make_backend(server.address, dst, transfer=transfer)
    try:
        keys = keys_for(f"{layout}-{transfer}-", 5)
        assert writer.batch_set_v1(keys, src.indices([3, 0, 7, 1, 2])) == [True] * 5
        assert reader.batch_exists(keys) == 5
        assert reader.batch_get_v1(keys, dst.indices([10, 11, 12, 13, 14])) == [True] * 5
        for s, d in zip([3, 0, 7, 1, 2], [10, 11, 12, 13, 14], strict=True):
            assert dst.page_bytes(d * PAGE) == src.page_bytes(s * PAGE)
        assert not dst.get_data_page(0).view(torch.uint8).any()  # untouched pages stay zero
    finally:
        writer.close()
        reader.close()


def test_plain_path_round_trip_is_byte_exact(server: ServerProcess) -> None:
    src = HostPoolStandIn(layout="layer_first")
    src.fill_random(2)
    dst = HostPoolStandIn(layout="layer_first")
    writer = make_backend(server.address, src, v1=False)
    reader = make_backend(server.address, dst, v1=False)
    try:
        keys = keys_for("plain-", 4)
        # as SGLang's _generic_page_set / _generic_page_get do
        assert writer.batch_set(keys[:3], [src.get_data_page(p * PAGE) for p in range(3)])
        assert writer.set(keys[3], src.get_data_page(3 * PAGE))
        assert reader.exists(keys[3]) and reader.batch_exists(keys) == 4
        pages = reader.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(pages):
            assert page is not None
            dst.set_from_flat_data_page((8 + i) * PAGE, page)
            assert dst.page_bytes((8 + i) * PAGE) == src.page_bytes(i * PAGE)
        single = reader.get(keys[2])
        assert single is not None
        assert bytes(single.view(torch.uint8).numpy()) == src.page_bytes(2 * PAGE)
        assert reader.get(keys_for("never-", 1)[0]) is None
    finally:
        writer.close()
        reader.close()


def test_batch_exists_counts_the_leading_present_pages(server: ServerProcess) -> None:
    pool = HostPoolStandIn()
    pool.fill_random(3)
    backend = make_backend(server.address, pool)
    try:
        keys = keys_for("prefix-", 6)
        assert backend.batch_exists(keys) == 0
        assert all(backend.batch_set_v1([keys[i]], pool.indices([i])) for i in (0, 1, 2, 4))
        assert backend.batch_exists(keys) == 3
        assert backend.batch_exists(keys[3:]) == 0
        assert backend.batch_exists(keys[4:]) == 1
        assert backend.batch_exists([]) == 0
        assert backend.batch_get_v1(keys, pool.indices(list(range(6)))) == [True] * 3 + [False] * 3
    finally:
        backend.close()


def test_two_tp_ranks_agree_and_keep_their_own_shards(server: ServerProcess) -> None:
    pools = [HostPoolStandIn(), HostPoolStandIn()]
    for rank, pool in enumerate(pools):
        pool.fill_random(10 + rank)
    ranks = [make_backend(server.address, pools[r], tp_rank=r, tp_size=2) for r in (0, 1)]
    try:
        keys = keys_for("tp-", 4)
        assert ranks[0].batch_set_v1(keys, pools[0].indices([0, 1, 2, 3])) == [True] * 4
        assert [b.batch_exists(keys) for b in ranks] == [0, 0]  # rank 1's shards are missing
        assert ranks[1].batch_set_v1(keys[:3], pools[1].indices([0, 1, 2])) == [True] * 3
        assert [b.batch_exists(keys) for b in ranks] == [3, 3]
        fresh = [HostPoolStandIn(), HostPoolStandIn()]
        for rank in (0, 1):
            ranks[rank].register_mem_pool_host(fresh[rank])  # read into an empty pool
            got = ranks[rank].batch_get_v1(keys[:3], fresh[rank].indices([5, 6, 7]))
            assert got == [True] * 3
            for i in range(3):
                assert fresh[rank].page_bytes((5 + i) * PAGE) == pools[rank].page_bytes(i * PAGE)
    finally:
        for b in ranks:
            b.close()


def test_mla_ranks_share_one_copy_written_by_the_storage_writer(server: ServerProcess) -> None:
    pools = [HostPoolStandIn(mla=True), HostPoolStandIn(mla=True)]
    pools[0].fill_random(20)
    pools[1].fill_random(21)  # rank 1's pages differ: they must never be stored
    ranks = [make_backend(server.address, pools[r], tp_rank=r, tp_size=2, mla=True) for r in (0, 1)]
    try:
        keys = keys_for("mla-", 3)
        assert ranks[1].batch_set_v1(keys, pools[1].indices([0, 1, 2])) == [True] * 3
        assert ranks[1].batch_exists(keys) == 0  # not the writer: nothing stored
        assert ranks[0].batch_set_v1(keys, pools[0].indices([0, 1, 2])) == [True] * 3
        assert [b.batch_exists(keys) for b in ranks] == [3, 3]
        assert ranks[1].batch_get_v1(keys, pools[1].indices([4, 5, 6])) == [True] * 3
        for i in range(3):
            assert pools[1].page_bytes((4 + i) * PAGE) == pools[0].page_bytes(i * PAGE)
    finally:
        for b in ranks:
            b.close()


def test_the_page_size_must_equal_the_chunk_size(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory("--chunk-size", "256")
    with pytest.raises(ValueError, match="kvtier serve --chunk-size 64"):
        make_backend(server.address, HostPoolStandIn())


def test_a_server_restart_costs_misses_then_serves_again(
    server_factory: Callable[..., ServerProcess], tmp_path: object
) -> None:
    args = ("--chunk-size", str(PAGE), "--l1-size", "32MiB", "--l2", f"disk://{tmp_path}")
    first = server_factory(*args)
    pool = HostPoolStandIn()
    pool.fill_random(30)
    backend = make_backend(first.address, pool)
    try:
        keys = keys_for("restart-", 4)
        assert backend.batch_set_v1(keys, pool.indices([0, 1, 2, 3])) == [True] * 4
        wait_for(lambda: status(first)["l2"]["written"] >= 4, timeout=15, interval=0.05)
        first.stop(signal.SIGKILL)  # a crash
        assert backend.batch_exists(keys) == 0  # a miss, not an exception
        assert backend.batch_get_v1(keys, pool.indices([8, 9, 10, 11])) == [False] * 4
        server_factory(*args, address=first.address)
        # the client re-joins once a heartbeat gets through
        wait_for(lambda: backend.batch_exists(keys) >= 4, timeout=20, interval=0.2)
        assert backend.batch_exists(keys) == 4  # from the disk tier, into the new L1
        assert backend.batch_get_v1(keys, pool.indices([8, 9, 10, 11])) == [True] * 4
        for i in range(4):
            assert pool.page_bytes((8 + i) * PAGE) == pool.page_bytes(i * PAGE)
    finally:
        backend.close()


def test_pages_come_back_through_the_disk_tier(
    server_factory: Callable[..., ServerProcess], tmp_path: object
) -> None:
    server = server_factory(
        "--chunk-size", str(PAGE), "--l1-size", "2MiB", "--l2", f"disk://{tmp_path}?size=64MiB"
    )
    # 256 KiB per page: 2 MiB of L1 holds fewer than 8 of the 32 pages
    pool = HostPoolStandIn(num_pages=40, layer_num=8, head_num=4, head_dim=32)
    pool.fill_random(40)
    backend = make_backend(server.address, pool)
    try:
        keys = keys_for("disk-", 32)
        for start in range(0, 32, 4):
            batch = list(range(start, start + 4))
            assert backend.batch_set_v1(keys[start : start + 4], pool.indices(batch)) == [True] * 4
            wait_for(
                lambda n=start + 4: status(server)["l2"]["written"] >= n, timeout=15, interval=0.05
            )
        assert status(server)["l1"]["ready_groups"] < 32  # the first pages left L1
        assert backend.batch_exists(keys[:4]) == 4
        assert backend.batch_get_v1(keys[:4], pool.indices([32, 33, 34, 35])) == [True] * 4
        for i in range(4):
            assert pool.page_bytes((32 + i) * PAGE) == pool.page_bytes(i * PAGE)
    finally:
        backend.close()


def test_an_unreachable_server_gives_misses_never_exceptions() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    pool = HostPoolStandIn()
    pool.fill_random(50)
    t0 = time.monotonic()
    backend = make_backend(address, pool, timeout=0.5, retry_interval=60)
    try:
        keys = keys_for("down-", 3)
        assert backend.batch_exists(keys) == 0
        assert backend.exists(keys[0]) is False
        assert backend.batch_set_v1(keys, pool.indices([0, 1, 2])) == [False] * 3
        assert backend.batch_get_v1(keys, pool.indices([0, 1, 2])) == [False] * 3
        assert backend.batch_get(keys) == [None] * 3
        assert backend.get(keys[0]) is None
        assert backend.set(keys[0], pool.get_data_page(0)) is False
        assert backend.last_error is not None
        # one failed connection attempt, then misses at once until retry_interval has passed
        assert time.monotonic() - t0 < 5
    finally:
        backend.close()


def test_a_server_that_dies_mid_run_gives_misses(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory("--chunk-size", str(PAGE))
    pool = HostPoolStandIn()
    pool.fill_random(60)
    backend = make_backend(server.address, pool, timeout=1)
    try:
        keys = keys_for("dies-", 2)
        assert backend.batch_set_v1(keys, pool.indices([0, 1])) == [True] * 2
        server.stop(signal.SIGKILL)
        t0 = time.monotonic()
        for _ in range(5):
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, pool.indices([2, 3])) == [False] * 2
            assert backend.batch_set_v1(keys, pool.indices([2, 3])) == [False] * 2
        assert time.monotonic() - t0 < 5  # one timeout, then the client fails fast
    finally:
        backend.close()


def test_a_server_started_after_sglang_is_used_once_it_answers(
    server_factory: Callable[..., ServerProcess],
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    pool = HostPoolStandIn()
    pool.fill_random(70)
    backend = make_backend(address, pool)  # nothing there yet: SGLang starts anyway
    try:
        keys = keys_for("late-", 2)
        assert backend.batch_set_v1(keys, pool.indices([0, 1])) == [False] * 2
        server_factory("--chunk-size", str(PAGE), address=address)
        assert wait_for(
            lambda: all(backend.batch_set_v1(keys, pool.indices([0, 1]))), timeout=15, interval=0.2
        ), backend.last_error
        assert backend.batch_get_v1(keys, pool.indices([4, 5])) == [True] * 2
        assert pool.page_bytes(4 * PAGE) == pool.page_bytes(0)
    finally:
        backend.close()


def test_a_late_server_with_another_chunk_size_disables_the_backend(
    server_factory: Callable[..., ServerProcess],
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    pool = HostPoolStandIn()
    backend = make_backend(address, pool)
    try:
        server_factory("--chunk-size", "16", address=address)

        def disabled() -> bool:
            if backend._disabled is not None:
                return True
            assert backend.batch_exists(keys_for("x-", 1)) == 0
            return False

        assert wait_for(disabled, timeout=15, interval=0.2), backend.last_error
        assert "--chunk-size 64" in backend._disabled
        assert backend.batch_set_v1(keys_for("x-", 1), pool.indices([0])) == [False]
    finally:
        backend.close()


def test_layouts_kvtier_cannot_store_are_refused_at_start() -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvtier.integrations.sglang import KVTierHiCacheStorage

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="m",
        should_split_heads=True,
        extra_config={"address": "ipc:///tmp/kvtier-never.sock"},
    )
    with pytest.raises(ValueError, match="split-head"):
        KVTierHiCacheStorage(config, {})


# -- configuration, credentials, the weights in the name -----------------------------------------


def test_unknown_config_keys_are_refused_with_the_valid_ones(server: ServerProcess) -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['adress'\].*address.*token_file"):
        make_backend(server.address, HostPoolStandIn(), adress="ipc:///tmp/elsewhere.sock")
    with pytest.raises(ValueError, match="not both"):
        make_backend(server.address, HostPoolStandIn(), token="x", token_file="/etc/hostname")
    with pytest.raises(ValueError, match="prefill_tokens_per_s='fast' must be"):
        make_backend(server.address, HostPoolStandIn(), prefill_tokens_per_s="fast")


TOKEN = "sglang-credential-0123456789"


def test_token_and_token_file_reach_a_server_with_an_auth_tokens_file(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} sglang-tenant\n")
    port = free_port()
    server_factory(
        "--chunk-size", str(PAGE), "--l1-size", "64MiB", "--auth-tokens-file", str(tokens),
        address=f"tcp://0.0.0.0:{port}",
    )  # fmt: skip
    address = f"tcp://127.0.0.1:{port}"
    credential = tmp_path / "credential"
    credential.write_text(TOKEN + "\n")
    src, dst = HostPoolStandIn(), HostPoolStandIn()
    src.fill_random(50)
    writer = make_backend(address, src, token=TOKEN)
    reader = make_backend(address, dst, token_file=str(credential))
    stranger = make_backend(address, HostPoolStandIn())
    try:
        keys = keys_for("auth-", 3)
        assert writer.batch_set_v1(keys, src.indices([0, 1, 2])) == [True] * 3
        assert reader.batch_exists(keys) == 3
        assert reader.batch_get_v1(keys, dst.indices([5, 6, 7])) == [True] * 3
        for s, d in zip([0, 1, 2], [5, 6, 7], strict=True):
            assert dst.page_bytes(d * PAGE) == src.page_bytes(s * PAGE)
        assert stranger.batch_exists(keys) == 0  # no credential: misses, never an exception
        assert "credential" in str(stranger.last_error)
    finally:
        for backend in (writer, reader, stranger):
            backend.close()


def test_new_weights_at_the_model_path_never_read_the_old_pages(
    server: ServerProcess, tmp_path: Path
) -> None:
    from testkit.tiny_models import write_tiny_llama

    model = write_tiny_llama(tmp_path / "model", layers=1, hidden=64, weights=True, seed=0)
    pool = HostPoolStandIn()
    pool.fill_random(60)
    keys = keys_for("weights-", 3)
    old = make_backend(server.address, pool, model_name=str(model))
    same = make_backend(server.address, HostPoolStandIn(), model_name=str(model))
    try:
        assert old.batch_set_v1(keys, pool.indices([0, 1, 2])) == [True] * 3
        assert same.batch_exists(keys) == 3  # the same weights share their pages
    finally:
        old.close()
        same.close()
    # other values, same architecture; SGLang's page keys hash tokens only, so they repeat
    write_tiny_llama(model, layers=1, hidden=64, weights=True, seed=1)
    new = make_backend(server.address, HostPoolStandIn(), model_name=str(model))
    explicit = make_backend(server.address, HostPoolStandIn(), model_name=str(model), model="m")
    try:
        assert new.batch_exists(keys) == 0
        assert new.geometry.model != old.geometry.model
        assert "m [sglang " in explicit.geometry.model  # a named model: the operator's promise
    finally:
        new.close()
        explicit.close()
