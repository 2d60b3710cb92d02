"""The notes KV events take from stores: which parent and tokens each recently stored chunk
came with (`ChunkNotes`), so that the publisher can tell a router a chunk's chain and tokens, as
vLLM does, and which chunks (a hand-off's) it must never publish."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

from kvtier.keys import ChunkKey

__all__ = ["NO_STORE", "ChunkNotes", "Note", "StoreNote"]

_MAX_HIDDEN = 1 << 16  # hand-off chunks kept unpublished (oldest forgotten first)
_MAX_TOLD = 256  # stores' notes waiting to be filed; past it, the request that notes files them


class StoreNote(NamedTuple):
    """What one store told of the consecutive chunks it named."""

    keys: tuple[ChunkKey, ...]
    parent: bytes | None  # the chunk before keys[0] (None: they start the prompt)
    tokens: bytes  # their token ids, packed uint32, chunk after chunk
    extra: bytes = b""  # the extra key the store named them under (in every chunk's hash)


NO_STORE = StoreNote((), None, b"")

#: where a chunk's note is: the store that named it last, and the chunk's place in it
Note = tuple[StoreNote, int]


class ChunkNotes:
    """The parent and tokens of the most recently stored chunks (about `capacity`, whole stores
    forgotten oldest first; 0 keeps none, for a server without KV events), taken from the
    stores that named them. A store is kept as it came, once: a note costs the request that
    makes it one append (what it told, as it told it); the reader (the publishing thread)
    files it, one dict entry per chunk, before it reads, and encodes the tokens.
    Thread-safe; each call holds its lock briefly."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._where: dict[ChunkKey, Note] = {}
        self._stores: deque[StoreNote] = deque()
        self._chunks = 0  # chunks of the stores kept
        self._lock = threading.Lock()
        # notes made and not filed yet, as their stores told them (appended without a lock:
        # a deque's append and popleft are atomic); the reader files them (`file`)
        self._told: deque[tuple[tuple[ChunkKey, ...], bytes | None, bytes, int, bytes]] = deque()
        # hand-off chunks: never published (a late report of one forgotten would be)
        self._hidden: OrderedDict[ChunkKey, None] = OrderedDict()
        self.hides = False  # whether any chunk was hidden (`shown` has work to do)

    def note(
        self,
        keys: Sequence[ChunkKey],
        parent: bytes | None,
        tokens: bytes,
        chunk_size: int,
        extra_key: bytes = b"",
    ) -> None:
        """`keys` name consecutive chunks of `tokens` (packed uint32, starting at the first
        key's chunk), after the chunk named `parent` (None: they start the prompt). Only kept
        for the reader to file (`file`): the request that notes pays one append."""
        if self._capacity:
            self._told.append((tuple(keys), parent, tokens, chunk_size, extra_key))
            if len(self._told) > _MAX_TOLD:  # no reader for that long: file them here
                self.file()

    def file(self) -> None:
        """File the notes told since the last call, in the order they were told (the
        publishing thread calls it every round, and before it reads)."""
        told = self._told
        while told:
            with self._lock:  # one note at a time: a reader of the notes waits for one only
                if told:
                    self._file_one(*told.popleft())

    def _file_one(
        self,
        keys: tuple[ChunkKey, ...],
        parent: bytes | None,
        tokens: bytes,
        chunk_size: int,
        extra_key: bytes,
    ) -> None:
        """One store's note (under `_lock`)."""
        step = 4 * chunk_size
        n = min(len(keys), len(tokens) // step)  # only chunks whose every token came
        first = max(0, n - self._capacity)  # more than all we keep: the last ones
        if first == n:
            return
        if first:
            parent = keys[first - 1].chunk_hash
        store = StoreNote(keys[first:n], parent, tokens[first * step : n * step], extra_key)
        places = zip(itertools.repeat(store), range(n - first), strict=False)
        self._where.update(zip(store.keys, places, strict=False))
        self._stores.append(store)
        self._chunks += len(store.keys)
        while self._chunks > self._capacity:
            old = self._stores.popleft()
            self._chunks -= len(old.keys)
            for key in old.keys:
                if self._where.get(key, (None,))[0] is old:  # not named again since
                    del self._where[key]

    def __bool__(self) -> bool:
        """Whether notes are kept at all (a server without KV events keeps none)."""
        return self._capacity > 0

    def hide(self, keys: Sequence[ChunkKey]) -> None:
        """`keys` are a hand-off's chunks, no prefix-cache entries: never publish them (the
        last `_MAX_HIDDEN` hidden are remembered)."""
        if not self:
            return
        with self._lock:
            self.hides = True
            for key in keys:
                self._hidden[key] = None
                self._hidden.move_to_end(key)
            while len(self._hidden) > _MAX_HIDDEN:
                self._hidden.popitem(last=False)

    def shown(self, keys: Sequence[ChunkKey]) -> Sequence[ChunkKey]:
        """`keys` less the hidden ones."""
        if not self._hidden:
            return keys
        with self._lock:
            return [key for key in keys if key not in self._hidden]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[Note | None]:
        """Where each of `keys` was noted (None: not noted, or forgotten)."""
        if self._told:
            self.file()
        get = self._where.get
        with self._lock:
            return [get(key) for key in keys]
