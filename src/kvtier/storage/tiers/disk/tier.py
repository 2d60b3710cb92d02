"""`DiskTier`: the disk tier's index, writes and reads together, opened from a URL."""

from __future__ import annotations

import os

from kvtier.storage.tiers.codecs import parse_codec
from kvtier.storage.tiers.disk.reads import DiskReads
from kvtier.storage.tiers.disk.writes import DiskWrites
from kvtier.storage.tiers.options import PARSERS, parse_url

DEFAULT_CAPACITY = 10 << 30  # for a URL without ?size=
OPTIONS = {"size": PARSERS["size"], "fsync": PARSERS["bool"], "codec": parse_codec}


class DiskTier(DiskWrites, DiskReads):
    """An L2 tier of files under `path`, at most `capacity_bytes` in all (0 = unbounded)."""

    @classmethod
    def from_url(cls, url: str) -> DiskTier:
        """A tier from "disk:///abs/path?size=50GiB&fsync=1&codec=zstd" or "disk://relative/path".

        In "disk://relative/path" everything after "//" is a path relative to the current
        working directory when the tier is opened; "disk:///abs" (three slashes) is absolute and
        "disk://~/x" is under the home folder. `size` defaults to 10GiB; "0" means unbounded.
        `codec` (none, zstd, fp8; see `codecs`) is how new objects are stored.
        """
        parts, options = parse_url(url, OPTIONS, tier="disk")
        if parts.scheme.lower() != "disk":
            raise ValueError(f"not a disk tier URL: {url!r}")
        path = parts.netloc + parts.path
        if not path:
            raise ValueError(f"disk tier URL without a path: {url!r}")
        size = options.get("size", DEFAULT_CAPACITY)
        fsync = options.get("fsync", False)
        codec = options.get("codec", "none")
        return cls(os.path.abspath(os.path.expanduser(path)), size, fsync=fsync, codec=codec)
