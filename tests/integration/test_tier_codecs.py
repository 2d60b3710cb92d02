"""Each codec (`codec=none|zstd|fp8`) on each shared tier: disk, Redis, Redis Cluster, Mooncake
Store. Lossless codecs give the bytes back exactly, fp8 within its element-wise bound; a coded
object damaged behind the tier's back is a miss, deleted and counted; a tier whose codec changed
across a restart still serves what it stored before, decoded. Last, a real server with an fp8
Redis tier: its /status and /metrics figures, and a restart with zstd."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import ml_dtypes
import numpy as np
import pytest
import redis
from testkit.admin import admin_url, metric_samples, status, written
from testkit.kv import CS, SHAPE
from testkit.mooncake_pool import MooncakeMaster
from testkit.redis_cluster import RedisCluster
from testkit.servers import REDIS_HINT, ServerProcess
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.keys import ObjectKey
from kvtier.storage.tiers import L2Tier, open_tier
from kvtier.storage.tiers import fp8 as fp8_codec
from kvtier.storage.tiers.format import Hit
from kvtier.storage.tiers.redis.verbs import RespTier

KINDS = ["disk", "redis", "redis+cluster", "mooncake"]
CODECS = ["none", "zstd", "fp8"]
#: (layout, numpy dtype) of the KV the tests store: 2 layers x 2 (K, V) x 64 tokens x 4 heads x
#: 64 (a plain attention chunk), and a packed uint8 chunk as hybrid models register theirs
FLOATS = [
    ("float16[2,2,64,4,64]", np.dtype(np.float16)),
    ("bfloat16[2,2,64,4,64]", np.dtype(ml_dtypes.bfloat16)),
    ("float32[2,2,64,4,64]", np.dtype(np.float32)),
]
PACKED = "uint8[65536]"


def key(i: int, model: str = "org/m") -> ObjectKey:
    return ObjectKey(model, "", 1, 0, hashlib.sha256(b"codec%d" % i).digest())


def kv(layout: str, dtype: np.dtype, seed: int) -> np.ndarray:
    """KV-like values: per-head scales over four orders of magnitude, some exact zeros."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in layout.partition("[")[2].rstrip("]").split(","))
    scale = 10.0 ** rng.uniform(-2, 2, size=(*shape[:-1], 1))
    values = rng.standard_normal(shape) * scale
    values[..., :3] = 0.0
    return values.astype(dtype)


@dataclass
class Tiers:
    """How to open (and reopen) one kind of tier, and damage an object behind its back."""

    open: Callable[[str], L2Tier]  # codec -> a tier over the same store
    flip_byte: Callable[[L2Tier, ObjectKey], None]


def _redis_flip(client_for: Callable[[bytes], redis.Redis]) -> Callable[[L2Tier, ObjectKey], None]:
    def flip(tier: L2Tier, k: ObjectKey) -> None:
        name = cast(RespTier, tier).redis_key(k).encode()
        client = client_for(name)
        value = bytearray(cast(bytes, client.get(name)))
        value[-1] ^= 0xFF
        client.set(name, bytes(value))

    return flip


@pytest.fixture(params=KINDS)
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tiers]:
    prefix = f"kvtier-codec-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    opened: list[L2Tier] = []

    def keep(tier: L2Tier) -> L2Tier:
        opened.append(tier)
        return tier

    if request.param == "disk":

        def flip_file(tier: L2Tier, k: ObjectKey) -> None:
            from kvtier.storage.tiers.disk import DiskTier

            path = Path(cast(DiskTier, tier)._path(k)[1])
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))

        yield Tiers(lambda c: keep(open_tier(f"disk://{tmp_path}/l2?codec={c}")), flip_file)
    elif request.param == "redis":
        plain = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=1)
        try:
            plain.ping()
        except redis.ConnectionError as exc:
            pytest.fail(f"{REDIS_HINT} ({exc})", pytrace=False)
        url = f"redis://127.0.0.1:6379/0?prefix={prefix}"
        yield Tiers(lambda c: keep(open_tier(f"{url}&codec={c}")), _redis_flip(lambda _: plain))
    elif request.param == "redis+cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        rc = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])

        def owner(name: bytes) -> redis.Redis:
            node = rc.get_node_from_key(name)
            return redis.Redis(host=node.host, port=node.port)

        url = f"{cluster.url}?prefix={prefix}"
        yield Tiers(lambda c: keep(open_tier(f"{url}&codec={c}")), _redis_flip(owner))
        rc.close()
    else:
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        # the objects live in the pool's segments: this test's tiers give none, a holder does
        holder = keep(open_tier(master.url(prefix="holder", segment="64MiB")))
        assert holder

        def flip_pooled(tier: L2Tier, k: ObjectKey) -> None:
            from kvtier.storage.tiers.mooncake import MooncakeTier

            pool = cast(MooncakeTier, tier)
            name = pool.name_of(k)
            value = bytearray(pool._store.get(name))
            value[-1] ^= 0xFF
            assert pool._store.remove(name, force=True) == 0
            assert pool._store.put(name, bytes(value)) == 0

        pooled = prefix.replace(".", "-")
        yield Tiers(
            lambda c: keep(open_tier(master.url(prefix=pooled, segment="0", codec=c))),
            flip_pooled,
        )
    for tier in reversed(opened):  # the Mooncake holder (first) clears nothing of the test's
        if tier is not opened[0] or request.param != "mooncake":
            tier.clear()
        tier.close()


def _check(codec: str, layout: str, got: bytes, sent: np.ndarray) -> None:
    decoded = np.frombuffer(got, sent.dtype).reshape(sent.shape)
    if codec != "fp8" or not layout.startswith(("float", "bfloat")):
        assert got == sent.tobytes(), f"{codec} must give {layout} back byte for byte"
        return
    original = sent.astype(np.float64).reshape(-1)
    error = np.abs(decoded.astype(np.float64).reshape(-1) - original)
    bound = fp8_codec.error_bound(sent, layout.partition("[")[0])
    worst = int(np.argmax(error - bound))
    assert (error <= bound).all(), (
        f"fp8 {layout}: element {worst} = {original[worst]} decoded with error {error[worst]} "
        f"> bound {bound[worst]}"
    )
    assert np.array_equal(np.signbit(decoded[sent == 0]), np.signbit(sent[sent == 0]))


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_round_trips_on_each_tier(tiers: Tiers, codec: str) -> None:
    tier = tiers.open(codec)
    items = [(layout, kv(layout, dtype, i)) for i, (layout, dtype) in enumerate(FLOATS)]
    packed = np.frombuffer(kv("float16[2,2,64,4,64]", np.dtype(np.float16), 9).tobytes(), np.uint8)
    items.append((PACKED, packed))
    written = tier.put_many(
        [(key(i), a.view(np.uint8).data, layout) for i, (layout, a) in enumerate(items)]
    )
    assert written == len(items)
    outs = [memoryview(bytearray(a.nbytes)) for _, a in items]
    hits = tier.get_many_into([(key(i), outs[i], layout) for i, (layout, _) in enumerate(items)])
    assert hits == [Hit.RESUMABLE] * len(items)
    for (layout, sent), got in zip(items, outs, strict=True):
        _check(codec, layout, bytes(got), sent)
    # one at a time too (the single-object read path)
    single = memoryview(bytearray(items[0][1].nbytes))
    assert tier.get_into(key(0), single, items[0][0])
    _check(codec, items[0][0], bytes(single), items[0][1])

    stats = tier.stats().codec
    raw = sum(a.nbytes for _, a in items)
    assert stats.name == codec and stats.raw_bytes == raw
    if codec == "none":
        assert stats.stored_bytes == raw and stats.encoded == 0 and stats.ratio == 1.0
    elif codec == "zstd":
        assert stats.encoded == len(items) and stats.stored_bytes < raw
    else:  # fp8 takes the three float chunks; the packed uint8 one is stored plain
        assert stats.encoded == 3 and stats.stored_raw == 1
        sizes = [fp8_codec.encoded_size(a.nbytes, lay.partition("[")[0]) for lay, a in items[:3]]
        assert stats.stored_bytes == sum(s or 0 for s in sizes) + packed.nbytes
        assert stats.ratio == raw / stats.stored_bytes > 1.9
    if codec != "none":  # every coded object read, the first one twice
        assert stats.decoded == stats.encoded + 1
        assert stats.decoded_bytes > 0 and stats.decode_s > 0 and stats.encode_s > 0


@pytest.mark.parametrize("codec", ["zstd", "fp8"])
def test_a_damaged_coded_object_is_a_miss_deleted_and_counted(tiers: Tiers, codec: str) -> None:
    tier = tiers.open(codec)
    layout, dtype = FLOATS[0]
    sent = kv(layout, dtype, 1)
    tier.put(key(1), sent.view(np.uint8).data, layout)
    assert tier.stats().codec.encoded == 1
    tiers.flip_byte(tier, key(1))
    out = memoryview(bytearray(sent.nbytes))
    assert not tier.get_into(key(1), out, layout)
    s = tier.stats()
    assert s.corrupt == 1 and s.misses == 1 and s.hits == 0 and s.codec.decoded == 0
    assert not tier.contains(key(1))


def test_a_codec_change_across_a_restart_serves_what_was_stored(tiers: Tiers) -> None:
    """Objects stored under each codec in turn, each by a tier opened anew with that codec over
    the same store (a disk tier reindexes its folder): every object reads back (lossless ones
    exactly, fp8 ones within the bound) whatever the tier's codec now, since each object
    records its own."""
    layout, dtype = FLOATS[1]  # bfloat16
    sent = [kv(layout, dtype, 10 + i) for i in range(len(CODECS))]
    for i, codec in enumerate(CODECS):
        tier = tiers.open(codec)
        assert tier.put_many([(key(i), sent[i].view(np.uint8).data, layout)]) == 1
    for reader in CODECS:  # a fresh tier with each codec reads all three
        tier = tiers.open(reader)
        outs = [memoryview(bytearray(a.nbytes)) for a in sent]
        hits = tier.get_many_into([(key(i), outs[i], layout) for i in range(len(CODECS))])
        assert hits == [Hit.RESUMABLE] * len(CODECS), reader
        for writer, got, original in zip(CODECS, outs, sent, strict=True):
            _check(writer, layout, bytes(got), original)
        assert tier.stats().codec.decoded == 2  # the zstd and fp8 objects


def _store(address: str, tokens: list[int], values: np.ndarray) -> int:
    with Client(address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        return c.store("writer", tokens, values, model="m")


def _retrieve(address: str, tokens: list[int], like: np.ndarray) -> tuple[int, np.ndarray]:
    with Client(address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        hit = c.lookup("reader", tokens, model="m")
        out = np.zeros_like(like)
        got = c.retrieve("reader", tokens, out, model="m") if hit else 0
        return got, out


def test_a_server_restarted_with_another_codec_serves_what_it_stored(
    server_factory: Callable[..., ServerProcess], redis_url: str, redis_prefix: str
) -> None:
    """A server writes through to Redis with codec=fp8 and shows the codec's figures on /status
    and /metrics; restarted with codec=zstd over the same keys, it loads those chunks (decoded
    within fp8's bound) into a fresh L1, then stores new ones with zstd."""
    tier = f"{redis_url}?prefix={redis_prefix}"
    args = ("--chunk-size", str(CS), "--l1-size", "16MiB", "--l2")
    tokens = list(range(6 * CS))
    values = np.random.default_rng(3).standard_normal((6, *SHAPE)).astype(np.float16)
    first = server_factory(*args, f"{tier}&codec=fp8")
    assert _store(first.address, tokens, values) == 6 * CS
    assert wait_for(lambda: written(first, 6))
    row = status(first)["l2"]["tiers"][0]
    stored = 6 * (fp8_codec.encoded_size(values[0].nbytes, "float16") or 0)
    assert row["codec"]["name"] == "fp8" and row["codec"]["encoded"] == 6
    assert (row["codec"]["raw_bytes"], row["codec"]["stored_bytes"]) == (values.nbytes, stored)
    metrics = metric_samples(httpx.get(admin_url(first) + "/metrics", timeout=5).text)
    ratio = metrics[("kvtier_l2_compression_ratio", (("tier", "redis"),))]
    assert ratio == pytest.approx(values.nbytes / stored) and ratio > 1.9
    encode = (("operation", "encode"), ("tier", "redis"))
    assert metrics[("kvtier_l2_codec_seconds_total", encode)] > 0
    assert first.stop() == 0

    second = server_factory(*args, f"{tier}&codec=zstd")
    got, out = _retrieve(second.address, tokens, values)
    assert got == 6 * CS
    bound = fp8_codec.error_bound(values, "float16").reshape(values.shape)
    assert (np.abs(out.astype(np.float64) - values) <= bound).all()
    row = status(second)["l2"]["tiers"][0]
    assert row["codec"]["name"] == "zstd" and row["codec"]["decoded"] == 6
    more = list(range(10_000, 10_000 + 2 * CS))
    assert _store(second.address, more, values[:2]) == 2 * CS
    assert wait_for(lambda: written(second, 2))
    assert status(second)["l2"]["tiers"][0]["codec"]["encoded"] == 2
