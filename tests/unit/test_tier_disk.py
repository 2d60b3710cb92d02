"""DiskTier, the shared object format, open_tier and parse_size, on real files under tmp_path."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from testkit.waiting import wait_for

from kvtier.keys import ObjectKey
from kvtier.storage.tiers import files as files_mod
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers import open_tier, parse_size
from kvtier.storage.tiers.disk import DiskTier

LAYOUT = "float16[2,4,8]"
SIZE = 4096 * 3 + 100  # not page-sized on purpose


def key(i: int, model: str = "llama", salt: str = "") -> ObjectKey:
    return ObjectKey(model, salt, 2, i % 2, hashlib.sha256(str(i).encode()).digest())


def payload(i: int, size: int = SIZE) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (size // 32) + bytes(size % 32)


def aligned(size: int = SIZE) -> memoryview:
    """A page-aligned writable buffer, like the L1's shared-memory views."""
    return memoryview(mmap.mmap(-1, size))


def file_of(tier: DiskTier, k: ObjectKey) -> Path:
    return Path(tier._path(k)[1])


def test_round_trip_is_byte_exact_into_page_aligned_buffer(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    out = aligned()
    assert tier.get_into(key(1), out, LAYOUT)
    assert out.tobytes() == payload(1)
    assert tier.contains(key(1)) and not tier.contains(key(2))
    assert tier.contains_many([key(2), key(1)]) == [False, True]
    s = tier.stats()
    assert s.hits == 1 and s.objects == 1 and s.used_bytes == file_of(tier, key(1)).stat().st_size
    assert not tier.get_into(key(2), aligned(), LAYOUT)
    assert tier.stats().misses == 1


def test_folder_is_created_private_and_sharded(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    tier = DiskTier(root, 0)
    assert root.stat().st_mode & 0o777 == 0o700
    tier.put(key(3), payload(3), LAYOUT)
    path = file_of(tier, key(3))
    assert path.parent.name == key(3).chunk_hash.hex()[:2]
    assert path.name == key(3).to_str()


def test_wrong_layout_or_size_is_a_miss_and_keeps_the_object(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    assert not tier.get_into(key(1), aligned(), "float16[2,4,9]")
    assert not tier.get_into(key(1), aligned(SIZE - 1), LAYOUT)
    s = tier.stats()
    assert (s.layout_mismatches, s.size_mismatches, s.corrupt) == (1, 1, 0)
    out = aligned()
    assert tier.get_into(key(1), out, LAYOUT) and out.tobytes() == payload(1)


def test_flipped_payload_byte_is_a_miss_deleted_and_counted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    path = file_of(tier, key(1))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(raw)
    out = aligned()
    assert not tier.get_into(key(1), out, LAYOUT)
    assert not path.exists() and not tier.contains(key(1))
    assert tier.stats().corrupt == 1 and tier.stats().used_bytes == 0


def test_truncated_file_is_a_miss_deleted_and_counted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    path = file_of(tier, key(1))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)
    assert not tier.get_into(key(1), aligned(), LAYOUT)
    assert not path.exists() and tier.stats().corrupt == 1


def test_valid_file_under_another_keys_name_is_a_miss_deleted_and_counted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    tier.put(key(2), payload(2), LAYOUT)
    shutil.copyfile(file_of(tier, key(2)), file_of(tier, key(1)))
    assert not tier.get_into(key(1), aligned(), LAYOUT)
    assert not file_of(tier, key(1)).exists() and tier.stats().corrupt == 1
    out = aligned()
    assert tier.get_into(key(2), out, LAYOUT) and out.tobytes() == payload(2)


def test_garbage_header_is_corrupt(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    file_of(tier, key(1)).write_bytes(b"x" * 50)
    assert not tier.get_into(key(1), aligned(), LAYOUT)
    assert tier.stats().corrupt == 1 and not file_of(tier, key(1)).exists()


def test_restart_rebuilds_index_and_serves_everything(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    long_model = "org/" + "m" * 150  # hashed file name: the key comes back from the header
    keys = [key(i) for i in range(10)] + [key(99, model=long_model, salt="tenant")]
    for i, k in enumerate(keys):
        tier.put(k, payload(i), LAYOUT)
    used = tier.stats().used_bytes
    tier.close()
    again = DiskTier(tmp_path, 0)
    assert again.stats().objects == len(keys) and again.stats().used_bytes == used
    for i, k in enumerate(keys):
        out = aligned()
        assert again.get_into(k, out, LAYOUT) and out.tobytes() == payload(i)


def test_lru_eviction_keeps_capacity_and_evicts_least_recently_used(tmp_path: Path) -> None:
    probe = DiskTier(tmp_path / "probe", 0)
    probe.put(key(0), payload(0), LAYOUT)
    one = int(probe.stats().used_bytes)
    tier = DiskTier(tmp_path / "t", 3 * one)
    for i in (1, 2, 3):
        tier.put(key(i), payload(i), LAYOUT)
    assert tier.get_into(key(1), aligned(), LAYOUT)  # 2 is now least recently used
    tier.put(key(4), payload(4), LAYOUT)
    assert tier.contains_many([key(1), key(2), key(3), key(4)]) == [True, False, True, True]
    assert not file_of(tier, key(2)).exists()
    for i in range(5, 12):
        tier.put(key(i), payload(i), LAYOUT)
        on_disk = sum(p.stat().st_size for p in (tmp_path / "t").rglob("*") if p.is_file())
        assert on_disk <= 3 * one and int(tier.stats().used_bytes) <= 3 * one
    assert tier.stats().extra["evictions"] == 8
    with pytest.raises(ValueError, match="capacity_bytes"):
        tier.put(key(50), payload(50, 4 * one), LAYOUT)


def test_restart_orders_lru_by_mtime_and_shrinks_to_capacity(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    for i in range(4):
        tier.put(key(i), payload(i), LAYOUT)
    one = int(tier.stats().used_bytes) // 4
    for age, i in enumerate((2, 0, 3, 1)):  # 2 oldest, then 0
        os.utime(file_of(tier, key(i)), (1_000_000 + age, 1_000_000 + age))
    again = DiskTier(tmp_path, 2 * one)
    assert again.contains_many([key(i) for i in range(4)]) == [False, True, False, True]
    assert again.stats().extra["evictions"] == 2


def test_leftover_temp_file_is_ignored_and_removed_at_startup(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    shard = file_of(tier, key(1)).parent
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the tier that wrote this crashed
    stale = shard / f"{files_mod.TEMP_PREFIX}{gone.pid}.deadbeef"
    stale.write_bytes(b"half a chunk")
    again = DiskTier(tmp_path, 0)
    assert not stale.exists()
    s = again.stats()
    assert s.extra["stale_temps_removed"] == 1 and s.objects == 1


def test_temp_files_of_others_are_left_alone(tmp_path: Path) -> None:
    """Finding 13: a shared folder's `.tmp.*` files of other programs, and those of a live
    kvtier process, are never removed."""
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    shard = file_of(tier, key(1)).parent
    others = [
        tmp_path / ".tmp.someone-elses",
        shard / ".tmp.1234abcd",
        shard / f"{files_mod.TEMP_PREFIX}{os.getppid()}.cafe",  # a live process's
        shard / f"{files_mod.TEMP_PREFIX}notapid.cafe",
    ]
    for path in others:
        path.write_bytes(b"not ours")
    again = DiskTier(tmp_path, 0)
    again.put(key(2), payload(2), LAYOUT)
    again.clear()
    assert all(p.read_bytes() == b"not ours" for p in others)
    assert again.stats().extra["stale_temps_removed"] == 0


def test_failed_write_leaves_nothing_under_the_real_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tmp_path, 0)
    real_writev = os.writev

    def half_then_eio(fd: int, bufs: list[memoryview]) -> int:
        real_writev(fd, [bufs[0]])
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "writev", half_then_eio)  # the os module the tier writes with
    with pytest.raises(OSError):
        tier.put(key(1), payload(1), LAYOUT)
    assert tier.put_many([(key(2), payload(2), LAYOUT)]) == 0
    monkeypatch.undo()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    s = tier.stats()
    assert s.objects == 0 and s.used_bytes == 0 and s.errors == 2
    assert not tier.get_into(key(1), aligned(), LAYOUT)


def test_clear_by_model_and_salt(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    keys = [
        key(i, model=m, salt=s)
        for i, (m, s) in enumerate([("a", "x"), ("a", "y"), ("b", "x"), ("b", "y"), ("a", "x")])
    ]
    for i, k in enumerate(keys):
        tier.put(k, payload(i), LAYOUT)
    assert tier.clear(model="a", cache_salt="x") == 2
    assert tier.contains_many(keys) == [False, True, True, True, False]
    assert tier.clear(cache_salt="y") == 2
    assert tier.clear(model="b") == 1
    assert tier.stats().objects == 0 and tier.stats().used_bytes == 0
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_delete_and_overwrite(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    tier.put(key(1), payload(2), LAYOUT)
    out = aligned()
    assert tier.get_into(key(1), out, LAYOUT) and out.tobytes() == payload(2)
    assert tier.stats().objects == 1
    assert tier.delete(key(1)) and not tier.delete(key(1))
    assert tier.stats().used_bytes == 0 and not file_of(tier, key(1)).exists()


def test_batch_verbs(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    assert tier.put_many([(key(i), payload(i), LAYOUT) for i in range(5)]) == 5
    outs = [aligned() for _ in range(6)]
    got = tier.get_many_into([(key(i), outs[i], LAYOUT) for i in range(6)])
    assert got == [True] * 5 + [False]
    assert all(outs[i].tobytes() == payload(i) for i in range(5))


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 0)
    bad: list[int] = []

    def work(base: int) -> None:
        for i in range(base, base + 20):
            tier.put(key(i), payload(i, 4096), LAYOUT)
            out = aligned(4096)
            if not tier.get_into(key(i), out, LAYOUT) or out.tobytes() != payload(i, 4096):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(b,)) for b in (0, 100, 200, 300)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and tier.stats().objects == 80


def test_open_tier_disk_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = open_tier(f"disk://{tmp_path}/abs?size=2GiB")
    assert isinstance(t, DiskTier) and t.capacity_bytes == 2 << 30
    assert t.root == tmp_path / "abs"
    monkeypatch.chdir(tmp_path)
    rel = open_tier("disk://rel/path?size=512MiB&fsync=1")
    assert isinstance(rel, DiskTier) and rel.root == tmp_path / "rel" / "path" and rel.fsync
    rel.put(key(1), payload(1), LAYOUT)
    assert rel.get_into(key(1), aligned(), LAYOUT)
    assert isinstance(open_tier(f"disk://{tmp_path}/d"), DiskTier)
    with pytest.raises(ValueError, match=r"disk://.*redis://"):
        open_tier("s3://bucket")
    with pytest.raises(ValueError, match="sise"):
        open_tier(f"disk://{tmp_path}/x?sise=1G")
    with pytest.raises(ValueError, match="not a byte size"):
        open_tier(f"disk://{tmp_path}/x?size=lots")
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(tmp_path, -1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("50GiB", 50 << 30),
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1G", 1 << 30),
        ("1GB", 10**9),
        ("4096", 4096),
        ("4096B", 4096),
        ("1.5KiB", 1536),
        (" 8 mib ", 8 << 20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-5", "1.3", "5i", "1 2"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_rewrite_with_same_bytes_is_skipped_only_when_the_stored_object_is_intact(
    tmp_path: Path,
) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    inode = file_of(tier, key(1)).stat().st_ino
    tier.put(key(1), payload(1), LAYOUT)
    s = tier.stats()
    assert s.extra["unchanged"] == 1 and s.puts == 2 and s.objects == 1
    assert file_of(tier, key(1)).stat().st_ino == inode
    # same header but a damaged payload: the put must really rewrite it
    path = file_of(tier, key(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)
    tier.put(key(1), payload(1), LAYOUT)
    assert tier.stats().extra["unchanged"] == 1
    assert file_of(tier, key(1)).stat().st_ino != inode
    out = aligned()
    assert tier.get_into(key(1), out, LAYOUT) and out.tobytes() == payload(1)
    assert tier.stats().corrupt == 0


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename"])
def test_rewrite_with_other_bytes_replaces_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(files_mod, "_renameat2", None)
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    tier.put(key(1), payload(2), LAYOUT)
    out = aligned()
    assert tier.get_into(key(1), out, LAYOUT) and out.tobytes() == payload(2)
    folder = file_of(tier, key(1)).parent
    assert [p.name for p in folder.iterdir()] == [file_of(tier, key(1)).name]
    s = tier.stats()
    assert s.extra["unchanged"] == 0 and s.objects == 1
    assert s.used_bytes == file_of(tier, key(1)).stat().st_size


def test_exchange_reports_a_missing_target_instead_of_raising(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.write_bytes(b"x")
    if files_mod._renameat2 is None:
        pytest.fail("renameat2 is missing: this Linux test needs glibc >= 2.28")
    assert not files_mod.exchange(str(a), str(tmp_path / "absent"))
    (tmp_path / "b").write_bytes(b"y")
    assert files_mod.exchange(str(a), str(tmp_path / "b"))
    assert a.read_bytes() == b"y" and (tmp_path / "b").read_bytes() == b"x"


def test_sound_object_with_longer_layout_of_same_total_size_is_a_kept_layout_miss(
    tmp_path: Path,
) -> None:
    tier = DiskTier(tmp_path, 0)
    longer = LAYOUT + "xx"  # header 2 bytes longer, payload 2 bytes shorter: same file size
    tier.put(key(1), payload(1, SIZE - 2), longer)
    assert not tier.get_into(key(1), aligned(), LAYOUT)
    s = tier.stats()
    assert s.layout_mismatches == 1 and s.corrupt == 0
    assert file_of(tier, key(1)).exists()
    out = aligned(SIZE - 2)
    assert tier.get_into(key(1), out, longer) and out.tobytes() == payload(1, SIZE - 2)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs mounted for the test (needs root: CI and these machines run as root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(
            f"cannot mount a 4 MiB tmpfs for the full-disk test ({done.stderr.strip()}); "
            "run the tests as root, as CI does",
            pytrace=False,
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_filesystem_evicts_shrinks_capacity_and_rate_limits_warnings(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 10: on a really full filesystem (a 4 MiB tmpfs, 1 GiB configured) the tier keeps
    storing by evicting, its effective capacity shrinks below the filesystem, and 200 writes log
    a handful of warnings, not 200."""
    big = 256 << 10
    tier = DiskTier(small_fs / "l2", 1 << 30)
    filler = small_fs / "someone-elses-file"
    with open(filler, "wb") as f:  # another program takes half the filesystem meanwhile
        f.write(bytes(2 << 20))
    caplog.set_level("WARNING", logger="kvtier.storage.tiers.disk")
    stored = 0
    for i in range(200):
        try:
            tier.put(key(i), payload(i, big), LAYOUT)
            stored += 1
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    s = tier.stats()
    assert stored >= 190, stored  # evictions made room for nearly every write
    assert s.extra["disk_full"] >= 1 and s.errors >= 1  # ENOSPC really happened
    assert s.extra["evictions"] >= 190 - 8 and 0 < s.objects <= 8
    assert s.extra["effective_capacity"] < 4 << 20 and s.used_bytes <= s.extra["effective_capacity"]
    assert len(caplog.records) <= 5, [r.getMessage() for r in caplog.records]
    # the newest objects read back intact; the other program's file is untouched
    latest = [i for i in range(200) if tier.contains(key(i))]
    assert latest and max(latest) == 199
    for i in latest:
        buf = aligned(big)
        assert tier.get_into(key(i), buf, LAYOUT) and buf.tobytes() == payload(i, big)
    assert filler.stat().st_size == 2 << 20
    # once the other program frees its space, the effective capacity grows back
    filler.unlink()

    fresh = iter(range(1000, 2000))  # a put of an object the tier holds already writes nothing

    def grown() -> bool:  # the tier measures the free space again (at most once a second) on a put
        tier.put(key(next(fresh)), payload(999, big), LAYOUT)
        return bool(tier.stats().extra["effective_capacity"] > s.extra["effective_capacity"])

    assert wait_for(grown, timeout=10)


def test_batch_read_of_large_objects_checks_each_digest(tmp_path: Path) -> None:
    """Objects of a block or more are read whole and hashed on the digest thread: a flipped
    byte, a truncated file, a wrong layout and a missing key are misses, the rest exact."""
    big = fmt.BLOCK + 4096 * 3
    tier = DiskTier(tmp_path, 0)
    try:
        tier.put_many([(key(i), payload(i, big), LAYOUT) for i in range(6)])
        flipped, truncated = file_of(tier, key(1)), file_of(tier, key(3))
        raw = bytearray(flipped.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        flipped.write_bytes(raw)
        with open(truncated, "r+b") as f:
            f.truncate(truncated.stat().st_size - 1)
        outs = [aligned(big) for _ in range(7)]
        items = [(key(i), outs[i], LAYOUT) for i in range(7)]
        items[4] = (key(4), outs[4], "float16[9]")
        assert tier.get_many_into(items) == [True, False, True, False, False, True, False]
        assert all(outs[i].tobytes() == payload(i, big) for i in (0, 2, 5))
        assert not flipped.exists() and not truncated.exists()
        assert tier.contains(key(4))  # a layout mismatch keeps the object
        assert tier.stats().corrupt == 2
    finally:
        tier.close()
    assert tier.get_many_into([(key(i), aligned(big), LAYOUT) for i in (0, 2)]) == [True, True]
    tier.close()


def test_payload_starts_page_aligned_and_files_from_before_alignment_still_read(
    tmp_path: Path,
) -> None:
    tier = DiskTier(tmp_path, 0)
    tier.put(key(1), payload(1), LAYOUT)
    path = file_of(tier, key(1))
    assert (path.stat().st_size - SIZE) % fmt.ALIGN == 0
    out = aligned()
    assert tier.get_into(key(1), out, LAYOUT) and out.tobytes() == payload(1)
    # an object as kvtier wrote it before the payload was aligned: no padding, flags 0
    text = key(1).to_str()
    path.write_bytes(fmt.encode_header(text, LAYOUT, payload(2)) + payload(2))
    reads: tuple[Callable[[], object], ...] = (
        lambda: tier.get_into(key(1), out, LAYOUT),
        lambda: tier.get_many_into([(key(1), out, LAYOUT), (key(1), out, LAYOUT)])[0],
    )
    for read in reads:
        out[:] = bytes(SIZE)
        assert read() and out.tobytes() == payload(2)
    assert tier.stats().corrupt == 0
    tier.close()
