"""KVTierHiCacheStorage's v2 interface: hybrid host pools (KV plus SWA, Mamba) as SGLang drives
them, against real `kvtier serve` processes.

The calls follow HybridCacheController: a backup stores the side pools' pages with
`batch_set_v2` (SWA: the node's trailing pages; Mamba: the state at the node's last page), then
the KV pages with `batch_set_v1`; a prefetch asks `batch_exists_v2` with placeholder keys whose
count is the pool's trailing window, loads the KV pages, then the side pools' pages for the hit's
trailing keys with `batch_get_v2`. The pools run SGLang's own page methods (sglang_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from testkit.servers import ServerProcess, free_port, start_server
from testkit.sglang_pool import (
    HostPoolStandIn,
    MambaPoolStandIn,
    build_backend,
    keys_for,
    sglang_api,
)
from testkit.waiting import wait_for

PAGE = 16
WINDOW = 2  # SWA pages a resume needs


@pytest.fixture(scope="module", autouse=True)
def _sglang() -> None:
    sglang_api()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the module: every test names its own pages."""
    server = start_server("--chunk-size", str(PAGE), "--l1-size", "64MiB")
    yield server
    server.close()


def api() -> Any:
    from sglang.srt.mem_cache import hicache_storage

    return hicache_storage


def kv_pool(layout: str = "page_first_direct", **kw: Any) -> HostPoolStandIn:
    return HostPoolStandIn(layout=layout, page_size=PAGE, num_pages=12, **kw)


def swa_pool(layout: str = "page_first_direct") -> HostPoolStandIn:
    return HostPoolStandIn(layout=layout, page_size=PAGE, num_pages=12, layer_num=1)


def backend(server: ServerProcess, kv: HostPoolStandIn, **kw: Any) -> Any:
    return build_backend(server.address, kv, timeout=2, retry_interval=0.2, **kw)


def side(
    name: str, keys: list[str], host: torch.Tensor | None = None, *, trailing: bool = True
) -> Any:
    h = api()
    policy = h.PoolHitPolicy.TRAILING_PAGES if trailing else h.PoolHitPolicy.ALL_PAGES
    return h.PoolTransfer(name=h.PoolName(name), host_indices=host, keys=keys, hit_policy=policy)


def query(b: Any, keys: list[str], **windows: int) -> tuple[int, dict[str, int], list[int]]:
    """batch_exists_v2 as a prefetch asks it: placeholders, as many as each pool's window."""
    transfers = [side(name, ["__placeholder__"] * n) for name, n in windows.items()]
    r = b.batch_exists_v2(keys, transfers)
    return (
        r.kv_hit_pages,
        {str(k): v for k, v in r.extra_pool_hit_pages.items()},
        r.restorable_prefix_pages,
    )


@pytest.mark.parametrize("layout", ["page_first_direct", "page_first", "layer_first"])
def test_kv_and_swa_hit_where_the_window_is_held_and_round_trip(
    server: ServerProcess, layout: str
) -> None:
    kv, swa = kv_pool(layout), swa_pool(layout)
    kv.fill_random(1)
    swa.fill_random(2)
    b = backend(server, kv, pools={"swa": swa})
    keys = keys_for(f"swa-{layout}-", 8)
    try:
        # two nodes of 4 pages each; each backup keeps the SWA pages of its node's window
        for node in (range(0, 4), range(4, 8)):
            tail = list(node)[-WINDOW:]
            swa_keys = [keys[p] for p in tail]
            assert b.batch_set_v2([side("swa", swa_keys, swa.indices(tail))]) == {
                api().PoolName.SWA: [True, True]
            }
        assert b.batch_set_v1(keys[:7], kv.indices(list(range(7)))) == [True] * 7
        # KV holds 7 pages, the window is whole only before pages 4 and 8: the hit is 4
        assert query(b, keys, swa=WINDOW) == (4, {"kv": 7, "swa": 4}, [4])
        assert b.batch_set_v1(keys[7:], kv.indices([7])) == [True]
        assert query(b, keys, swa=WINDOW) == (8, {"kv": 8, "swa": 8}, [4, 8])
        assert query(b, keys[:6], swa=WINDOW) == (4, {"kv": 6, "swa": 4}, [4])
        assert query(b, keys, swa=5) == (0, {"kv": 8}, [])  # a wider window: never whole

        # a fresh rank's pools, loaded as a prefetch of the 8-page hit does
        kv2, swa2 = kv_pool(layout), swa_pool(layout)
        reader = backend(server, kv2, pools={"swa": swa2})
        try:
            assert reader.batch_get_v1(keys, kv2.indices(list(range(8)))) == [True] * 8
            got = reader.batch_get_v2([side("swa", keys[6:8], swa2.indices([10, 11]))])
            assert got == {api().PoolName.SWA: [True, True]}
            for p in range(8):
                assert kv2.page_bytes(p * PAGE) == kv.page_bytes(p * PAGE)
            assert swa2.page_bytes(10 * PAGE) == swa.page_bytes(6 * PAGE)
            assert swa2.page_bytes(11 * PAGE) == swa.page_bytes(7 * PAGE)
            assert not swa2.get_data_page(0).view(torch.uint8).any()  # nothing else written
        finally:
            reader.close()
    finally:
        b.close()


def store_kv(b: Any, kv: HostPoolStandIn, keys: list[str], v1: bool) -> bool:
    """The KV pages 0.. under `keys`, as SGLang's page_set_func does on each path."""
    if v1:
        return all(b.batch_set_v1(keys, kv.indices(list(range(len(keys))))))
    return bool(b.batch_set(keys, [kv.get_data_page(p * PAGE) for p in range(len(keys))]))


def load_kv(b: Any, kv: HostPoolStandIn, keys: list[str], v1: bool) -> int:
    """Load `keys` into pages 0.., as SGLang's page_get_func does on each path."""
    if v1:
        return sum(b.batch_get_v1(keys, kv.indices(list(range(len(keys))))))
    pages = b.batch_get(keys, [kv.get_dummy_flat_data_page() for _ in keys])
    for p, page in enumerate(pages):
        if page is None:
            return p
        kv.set_from_flat_data_page(p * PAGE, page)
    return len(keys)


@pytest.mark.parametrize("v1", [True, False])
def test_kv_and_mamba_hit_only_at_a_stored_state_and_round_trip(
    server: ServerProcess, v1: bool
) -> None:
    kv, mamba = kv_pool(), MambaPoolStandIn()
    kv.fill_random(3)
    mamba.fill_random(4)
    b = backend(server, kv, pools={"mamba": mamba}, v1=v1)
    keys = keys_for(f"mamba-{v1}-", 8)
    try:
        assert store_kv(b, kv, keys, v1)
        assert query(b, keys, mamba=1) == (0, {"kv": 8}, [])  # no state anywhere: a miss
        # states at the ends of nodes [0, 3) and [3, 6), in slots 1 and 5
        for page, slot in ((2, 1), (5, 5)):
            stored = b.batch_set_v2([side("mamba", [keys[page]], mamba.indices([slot]))])
            assert stored == {api().PoolName.MAMBA: [True]}
        assert query(b, keys, mamba=1) == (6, {"kv": 8, "mamba": 6}, [3, 6])
        assert query(b, keys[:5], mamba=1) == (3, {"kv": 5, "mamba": 3}, [3])

        kv2, mamba2 = kv_pool(), MambaPoolStandIn()
        reader = backend(server, kv2, pools={"mamba": mamba2}, v1=v1)
        try:
            assert load_kv(reader, kv2, keys[:6], v1) == 6
            got = reader.batch_get_v2([side("mamba", [keys[5]], mamba2.indices([7]))])
            assert got == {api().PoolName.MAMBA: [True]}
            assert mamba2.page_bytes(7) == mamba.page_bytes(5)
            assert all(not any(mamba2.page_bytes(s)) for s in range(7))  # nothing else
            for p in range(6):
                assert kv2.page_bytes(p * PAGE) == kv.page_bytes(p * PAGE)
            # a state never stored loads nothing
            assert reader.batch_get_v2([side("mamba", [keys[4]], mamba2.indices([0]))]) == {
                api().PoolName.MAMBA: [False]
            }
        finally:
            reader.close()
    finally:
        b.close()


def test_an_all_pages_pool_must_hold_every_page_before_the_hit(server: ServerProcess) -> None:
    kv, mamba, indexer = kv_pool(), MambaPoolStandIn(), kv_pool(layer_num=1, head_num=1)
    pools: tuple[HostPoolStandIn | MambaPoolStandIn, ...] = (kv, mamba, indexer)
    for i, pool in enumerate(pools):
        pool.fill_random(10 + i)
    b = backend(server, kv, pools={"mamba": mamba, "indexer": indexer})
    keys = keys_for("all-", 8)
    try:
        assert b.batch_set_v1(keys, kv.indices(list(range(8)))) == [True] * 8
        for page in (2, 5, 7):
            b.batch_set_v2([side("mamba", [keys[page]], mamba.indices([page]))])
        got = b.batch_set_v2(
            [side("indexer", keys[:6], indexer.indices(list(range(6))), trailing=False)]
        )
        assert got == {api().PoolName.INDEXER: [True] * 6}
        transfers = [
            side("mamba", ["__placeholder__"]),
            side("indexer", ["__placeholder__"] * 8, trailing=False),
        ]
        r = b.batch_exists_v2(keys, transfers)
        # KV 8, Mamba states after pages 3, 6, 8, the indexer's first 6 pages: 6
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (6, [3, 6])
        assert {str(k): v for k, v in r.extra_pool_hit_pages.items()} == {
            "kv": 8,
            "mamba": 8,
            "indexer": 6,
        }
    finally:
        b.close()


def test_two_tp_ranks_agree_and_a_state_counts_only_when_every_rank_stored_it(
    server: ServerProcess,
) -> None:
    pools = [(kv_pool(), MambaPoolStandIn()) for _ in range(2)]
    for rank, (kv, mamba) in enumerate(pools):
        kv.fill_random(20 + rank)
        mamba.fill_random(30 + rank)
    ranks = [
        backend(server, kv, tp_rank=r, tp_size=2, pools={"mamba": mamba})
        for r, (kv, mamba) in enumerate(pools)
    ]
    keys = keys_for("tp-hybrid-", 6)
    try:
        for rank, (kv, mamba) in enumerate(pools):
            assert ranks[rank].batch_set_v1(keys, kv.indices(list(range(6)))) == [True] * 6
            for page in (2, 5) if rank == 0 else (2,):  # rank 1's state after page 6 is missing
                ranks[rank].batch_set_v2([side("mamba", [keys[page]], mamba.indices([page]))])
        assert [query(b, keys, mamba=1) for b in ranks] == [(3, {"kv": 6, "mamba": 3}, [3])] * 2
        ranks[1].batch_set_v2([side("mamba", [keys[5]], pools[1][1].indices([5]))])
        assert [query(b, keys, mamba=1)[0] for b in ranks] == [6, 6]
        for rank, (kv, mamba) in enumerate(pools):
            kv2, mamba2 = kv_pool(), MambaPoolStandIn()
            ranks[rank].register_mem_pool_host(kv2)
            ranks[rank].register_mem_host_pool_v2(mamba2, api().PoolName.MAMBA)
            assert ranks[rank].batch_get_v1(keys, kv2.indices(list(range(6)))) == [True] * 6
            assert ranks[rank].batch_get_v2([side("mamba", [keys[5]], mamba2.indices([0]))])[
                api().PoolName.MAMBA
            ] == [True]
            assert mamba2.page_bytes(0) == mamba.page_bytes(5)  # this rank's own shard
            assert kv2.page_bytes(5 * PAGE) == kv.page_bytes(5 * PAGE)
    finally:
        for b in ranks:
            b.close()


def test_mla_keeps_one_kv_copy_but_every_rank_stores_its_mamba_state(
    server: ServerProcess,
) -> None:
    pools = [(HostPoolStandIn(mla=True, page_size=PAGE), MambaPoolStandIn()) for _ in range(2)]
    for rank, (kv, mamba) in enumerate(pools):
        kv.fill_random(40 + rank)
        mamba.fill_random(50 + rank)
    ranks = [
        backend(
            server, kv, tp_rank=r, tp_size=2, mla=True, pools={"mamba": mamba}, model_name="mla"
        )
        for r, (kv, mamba) in enumerate(pools)
    ]
    keys = keys_for("mla-hybrid-", 3)
    try:
        for rank, (kv, mamba) in enumerate(pools):
            assert ranks[rank].batch_set_v1(keys, kv.indices([0, 1, 2])) == [True] * 3
            assert ranks[rank].batch_set_v2([side("mamba", [keys[2]], mamba.indices([1]))]) == {
                api().PoolName.MAMBA: [True]
            }
        assert [query(b, keys, mamba=1) for b in ranks] == [(3, {"kv": 3, "mamba": 3}, [3])] * 2
        kv1 = HostPoolStandIn(mla=True, page_size=PAGE)
        mamba1 = MambaPoolStandIn()
        ranks[1].register_mem_pool_host(kv1)
        ranks[1].register_mem_host_pool_v2(mamba1, api().PoolName.MAMBA)
        assert ranks[1].batch_get_v1(keys, kv1.indices([0, 1, 2])) == [True] * 3
        assert kv1.page_bytes(2 * PAGE) == pools[0][0].page_bytes(2 * PAGE)  # rank 0's copy
        ranks[1].batch_get_v2([side("mamba", [keys[2]], mamba1.indices([0]))])
        assert mamba1.page_bytes(0) == pools[1][1].page_bytes(1)  # rank 1's own state
    finally:
        for b in ranks:
            b.close()


def test_pools_and_rules_kvtier_cannot_serve_are_refused_or_missed(server: ServerProcess) -> None:
    kv = kv_pool()
    kv.fill_random(60)
    with pytest.raises(ValueError, match="pages of 8 host indices"):
        backend(server, kv, pools={"swa": HostPoolStandIn(page_size=8, num_pages=4)})
    b = backend(server, kv, pools={"swa": swa_pool()})
    keys = keys_for("refused-", 2)
    try:
        assert b.batch_set_v1(keys, kv.indices([0, 1])) == [True, True]
        # a pool never registered: its pages are not stored, never an exception
        assert b.batch_set_v2([side("mamba", keys[1:], torch.tensor([0]))]) == {
            api().PoolName.MAMBA: [False]
        }
        assert query(b, keys, mamba=1) == (0, {}, [])
        block = side("swa", ["__placeholder__"])
        block.hit_policy = api().PoolHitPolicy.BLOCK_GROUPS
        assert b.batch_exists_v2(keys, [block]).kv_hit_pages == 0
        # host indices that do not match the keys: nothing is written
        assert b.batch_set_v2([side("swa", keys, swa_pool().indices([0]))]) == {
            api().PoolName.SWA: [False, False]
        }
    finally:
        b.close()


def test_a_server_started_after_sglang_learns_every_pool_when_it_answers(
    server_factory: Callable[..., ServerProcess],
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    kv, mamba = kv_pool(), MambaPoolStandIn()
    kv.fill_random(70)
    mamba.fill_random(71)
    # nothing there yet: SGLang starts anyway (test_sglang shows its writes fail meanwhile)
    b = build_backend(address, kv, timeout=1, retry_interval=0.2, pools={"mamba": mamba})
    keys = keys_for("late-hybrid-", 2)
    try:
        server_factory("--chunk-size", str(PAGE), address=address)
        assert wait_for(
            lambda: all(b.batch_set_v1(keys, kv.indices([0, 1]))), timeout=15, interval=0.2
        ), b.last_error
        assert b.batch_set_v2([side("mamba", keys[1:], mamba.indices([3]))]) == {
            api().PoolName.MAMBA: [True]
        }
        assert query(b, keys, mamba=1) == (2, {"kv": 2, "mamba": 2}, [2])
        got = b.batch_get_v2([side("mamba", keys[1:], mamba.indices([6]))])
        assert got == {api().PoolName.MAMBA: [True]}
        assert mamba.page_bytes(6) == mamba.page_bytes(3)
    finally:
        b.close()
