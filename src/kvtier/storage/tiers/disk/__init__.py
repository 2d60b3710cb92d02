"""The local-disk L2 tier: one file per object in a folder, with its own byte capacity and LRU.

Layout: `<root>/<first 2 hex chars of the chunk hash>/<key.to_str()>` (a 256-way shard keeps
folders small). A name longer than `MAX_NAME` is replaced by "h-" + the xxh3-128 hex of the key
text; the key is recovered from the file's header on restart.

Writes are atomic: the object goes to `.tmp.kvtier.<pid>.<random>` in the destination folder and
is renamed onto its real name, so a crash never leaves half an object under a real name. At
startup only temp files named so by a process that no longer runs are removed: the tier never
touches files it did not make (another program's `.tmp.*` in a shared folder is left alone).
fsync is off by default: this is a cache, so losing the last writes in a
power cut costs only misses, and a torn file that survives one is caught by the header digest
and deleted on read. `fsync=True` adds a file and folder fsync per write for a durable cache.

Replacing a file by renaming onto it makes ext4 (auto_da_alloc) start writeback of the new file
at once, which doubled the cost of a rewrite; so a rewrite swaps the two names atomically with
renameat2(RENAME_EXCHANGE) where Linux offers it and then unlinks the old file under the temp
name. A rewrite whose object is already stored intact (same header, payload digest checked) is
skipped and counted as `unchanged`.

What the tier loses on its own (an eviction, a corrupt file deleted on read), what it deletes
or clears, and at start what its folder holds, it reports to the observer the tier manager
hands it (`kvtier.storage.observers`).

The index (key -> file size, in LRU order) lives in memory and is rebuilt from the folder at
startup, ordered by file mtime; a read refreshes an mtime older than a second so the rebuilt
order follows reads too. One lock guards the index; file data is read and written outside it.
Only metadata operations (rename, unlink) run under it, so an eviction can never remove a newer
file that a concurrent put renamed onto the same name.

A full filesystem does not stop the tier: the effective capacity is at most what the tier holds
plus the filesystem's free space (checked at most once a second), and a write that still fails
with ENOSPC or EDQUOT shrinks the effective capacity to 90% of what the tier holds, evicts down
to it and retries once. Repeated warnings are rate-limited (`accounting.WARN_EVERY_S`).

Its parts: `index` (the folder, its in-memory index, capacity and eviction, the index verbs),
`writes`, `reads` and `tier` (`DiskTier`, all of them together, opened from a URL).
"""

from kvtier.storage.tiers.disk.tier import DEFAULT_CAPACITY, OPTIONS, DiskTier

__all__ = ["DEFAULT_CAPACITY", "OPTIONS", "DiskTier"]
