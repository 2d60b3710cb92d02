"""Admission: which stored chunks L1 keeps as cache and writes on to the L2 tiers.

Most chunks of real serving traffic are never read again, and under memory pressure each one
that is kept pushes out a chunk that would have been. A policy here sees every lookup's hash
chain (`observe`) and answers, for a chunk being stored, whether it is worth keeping
(`admits`). A chunk it declines is still stored (the request that stored it reads it while it
lives), but it is kept at the cold end of L1's eviction order, is never announced in KV events
and never written to an L2 tier.

Three policies, by name (`--policy`, `KVTIER_POLICY`):

- ``lru``: store everything (least recently used evicted first): every chunk is admitted.
- ``doorkeeper``: a chunk is admitted once a lookup has seen its name before, within a ghost
  list of recently seen names four times the cache (in chunks). It keeps one-off chunks out of a
  small cache, and starves a roomy one.
- ``adaptive`` (the default): duels the two on a sample of the traffic. One chain in
  `SAMPLE` (chosen by the name of its second chunk, so a conversation's turns fall together) is
  replayed through two small shadow caches of `1/SAMPLE` the capacity, one storing everything,
  one behind the doorkeeper; chunks are admitted as the shadow with more (decayed) hits would.
  Under pressure it is the doorkeeper; with room to spare it stores everything.

Names are `Hashable` (the server passes `ChunkKey`s); sampling uses `sample_bits(name)`, which
is deterministic across processes (no Python `hash` of bytes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import msgspec

__all__ = [
    "POLICIES",
    "Adaptive",
    "AdmissionPolicy",
    "AdmissionStats",
    "Doorkeeper",
    "StoreAll",
    "make_policy",
]

#: One chain in SAMPLE feeds the shadow caches of `Adaptive`.
SAMPLE = 8
#: The ghost list holds GHOST_FACTOR times the cache's capacity in names.
GHOST_FACTOR = 4
#: The capacity (in chunks) assumed until the first stored chunk tells a chunk's size.
UNSIZED = 1 << 16
#: Each sampled lookup multiplies the shadows' earlier hit counts by DECAY.
DECAY = 0.999


class AdmissionStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy decided so far."""

    policy: str
    admitted: int  # chunks kept as cache
    declined: int  # chunks stored for their request only
    ghost_names: int  # names the policy remembers
    stores_everything: bool  # whether new chunks are admitted now (adaptive: the duel's verdict)


class _Ghost:
    """Recently seen names, bounded to `capacity` names, each with the request that saw it last
    (a request that looks up again is one sighting), and which of them two requests saw."""

    __slots__ = ("capacity", "seen", "twice")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.seen: OrderedDict[Hashable, Hashable] = OrderedDict()
        self.twice: set[Hashable] = set()

    def see(self, names: Sequence[Hashable], sighting: Hashable) -> None:
        seen, twice = self.seen, self.twice
        get, move = seen.get, seen.move_to_end
        for name in names:
            last = get(name)
            if last is None:
                seen[name] = sighting
                continue
            if last != sighting:
                seen[name] = sighting
                twice.add(name)
            move(name)
        if len(seen) > self.capacity:
            pop, discard = seen.popitem, twice.discard
            for _ in range(len(seen) - self.capacity):
                discard(pop(last=False)[0])

    def last_sighting(self, name: Hashable) -> Hashable:
        return self.seen.get(name)

    def seen_before(self, name: Hashable) -> bool:
        """Whether two requests saw `name` (the one storing it, and an earlier one)."""
        return name in self.twice


class AdmissionPolicy:
    """Store everything: the base every policy shares (counting, capacity)."""

    name = "lru"

    def __init__(self) -> None:
        self.capacity_chunks = 0  # L1's capacity in chunk groups, once a chunk's size is known
        self._admitted = 0
        self._declined = 0

    def set_capacity(self, chunks: int) -> None:
        """L1 holds about `chunks` chunk groups (its bytes over a group's)."""
        self.capacity_chunks = max(1, chunks)

    def observe(self, chain: Sequence[Hashable], sighting: Hashable = None) -> None:
        """A lookup of request `sighting` (None: a new one each time) asked for this hash
        chain, head first."""

    def stores_everything(self) -> bool:
        return True

    def _decide(self, name: Hashable) -> bool:
        return True

    def admits(self, name: Hashable) -> bool:
        """Whether a chunk being stored is kept as cache (counted)."""
        admitted = self._decide(name)
        if admitted:
            self._admitted += 1
        else:
            self._declined += 1
        return admitted

    def would_admit(self, name: Hashable) -> bool:
        """`admits` without counting: whether a declined chunk has earned its place since."""
        return self._decide(name)

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            policy=self.name,
            admitted=self._admitted,
            declined=self._declined,
            ghost_names=self._ghost_names(),
            stores_everything=self.stores_everything(),
        )

    def _ghost_names(self) -> int:
        return 0


StoreAll = AdmissionPolicy


class Doorkeeper(AdmissionPolicy):
    """Admit a chunk whose name an earlier lookup saw (within the ghost list)."""

    name = "doorkeeper"

    def __init__(self) -> None:
        super().__init__()
        self._ghost = _Ghost(GHOST_FACTOR * UNSIZED)

    def set_capacity(self, chunks: int) -> None:
        super().set_capacity(chunks)
        self._ghost.capacity = GHOST_FACTOR * self.capacity_chunks

    def observe(self, chain: Sequence[Hashable], sighting: Hashable = None) -> None:
        self._ghost.see(chain, object() if sighting is None else sighting)

    def stores_everything(self) -> bool:
        return False

    def _decide(self, name: Hashable) -> bool:
        return self._ghost.seen_before(name)

    def _ghost_names(self) -> int:
        return len(self._ghost.seen)


class _Shadow:
    """A names-only cache that replays sampled chains: prefix hits, then every name stored
    (or, behind a doorkeeper, the names seen before), heads most recent."""

    __slots__ = ("capacity", "ghost", "held", "store_all")

    def __init__(self, store_all: bool) -> None:
        self.capacity = 1
        self.store_all = store_all
        self.held: OrderedDict[Hashable, None] = OrderedDict()
        self.ghost = _Ghost(GHOST_FACTOR)

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.ghost.capacity = GHOST_FACTOR * self.capacity
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)

    def replay(self, chain: Sequence[Hashable]) -> int:
        held = self.held
        hit = 0
        for name in chain:
            if name not in held:
                break
            hit += 1
        self.ghost.see(chain, object())
        for name in chain:
            if name not in held and (self.store_all or self.ghost.seen_before(name)):
                held[name] = None
                if len(held) > self.capacity:
                    held.popitem(last=False)
        for name in reversed(chain):
            if name in held:
                held.move_to_end(name)
        return hit


def sample_bits(name: Hashable) -> int:
    """A number that stands for `name` the same way in every process."""
    digest = getattr(name, "chunk_hash", name)
    if isinstance(digest, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(digest[:8]), "little")
    if isinstance(digest, int):
        return (digest * 0x9E3779B97F4A7C15) >> 16 & 0xFFFFFFFFFFFF
    raise TypeError(f"cannot sample a name of type {type(name).__name__}")


class Adaptive(Doorkeeper):
    """The doorkeeper or store-everything, whichever scores more hits on sampled chains."""

    name = "adaptive"

    def __init__(self) -> None:
        super().__init__()
        self._all = _Shadow(store_all=True)
        self._gated = _Shadow(store_all=False)
        self._score_all = 0.0
        self._score_gated = 0.0

    def set_capacity(self, chunks: int) -> None:
        super().set_capacity(chunks)
        shadow = max(1, self.capacity_chunks // SAMPLE)
        self._all.resize(shadow)
        self._gated.resize(shadow)

    def observe(self, chain: Sequence[Hashable], sighting: Hashable = None) -> None:
        if sighting is None:
            sighting = object()
        elif chain and self._ghost.last_sighting(chain[-1]) == sighting:
            return  # the same request looking up the same chain again: one sighting
        super().observe(chain, sighting)
        if not chain or sample_bits(chain[min(1, len(chain) - 1)]) % SAMPLE:
            return
        self._score_all = self._score_all * DECAY + self._all.replay(chain)
        self._score_gated = self._score_gated * DECAY + self._gated.replay(chain)

    def stores_everything(self) -> bool:
        return self._score_all >= self._score_gated

    def _decide(self, name: Hashable) -> bool:
        return self.stores_everything() or self._ghost.seen_before(name)


#: Policy names (`--policy`) and what makes each.
POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    "adaptive": Adaptive,
    "doorkeeper": Doorkeeper,
    "lru": StoreAll,
}


def make_policy(name: str) -> AdmissionPolicy:
    """The policy called `name`; ValueError naming the choices for any other."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
