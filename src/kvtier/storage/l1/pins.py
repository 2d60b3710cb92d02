"""The L1's holds against eviction: a lookup's pins (leased, released per rank or when their
owner is gone) and anonymous holds (an L2 write-through in flight)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

from kvtier.errors import UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.storage.l1.index import L1Index
from kvtier.storage.l1.records import Group, Held, Pin

#: (pin holder, its owner) -> when the owner was last seen (the L1's clock), None when gone
OwnerSeen = Callable[[str, str], float | None]


def stored_holder(request_id: str) -> str:
    """The pin holder of the chunks a request stored that the cache policy declined (they stay
    readable for the request while it lives)."""
    return request_id + "\x00stored"


class L1Pins(L1Index):
    """Pins by holder, on a deadline heap, and anonymous holds (see `L1Store`)."""

    def pin(
        self,
        holder: str,
        keys: Sequence[ChunkKey],
        *,
        ranks: Iterable[int],
        lease_s: float,
        tenant: str = "",
        max_bytes: int | None = None,
        owner: str = "",
    ) -> int:
        """Pin the groups of `keys` that are in L1 for `holder`, replacing its previous pin;
        returns how many groups it pins. `owner`: the client it is pinned for (see
        `reclaim_pins`).

        A group's bytes count once against the pinned bytes of the tenant that pinned it first,
        however many of its pins hold it. With `max_bytes`, only the leading groups that keep
        `tenant`'s pinned bytes within it are pinned (groups it pins already cost nothing).
        `ranks` are the workers that still have to retrieve; the pin is released when all of
        them called `mark_retrieved`, by `unpin`, or when the lease expires (`reclaim_pins`).
        """
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        pending = set(ranks)
        get = self._groups.get
        groups = [g for g in map(get, keys) if g is not None and not g.doomed]
        if max_bytes is not None:
            room = max_bytes - self._usage_of(tenant).pinned
            for n, group in enumerate(groups):
                if group.pins == 0:  # not yet charged to anyone
                    room -= group.nbytes
                    if room < 0:
                        del groups[n:]
                        break
        deadline = self._clock() + lease_s
        old = self._pins.get(holder)
        if old is not None and old.groups == groups:
            # A repeated lookup of the same prompt (the common case): the same groups are held
            # already, so only the pending ranks and the lease start over.
            old.ranks, old.readers = pending, len(pending)
            old.owner, old.lease_s = owner, lease_s
            self._set_deadline(holder, old, deadline)
            return len(groups)
        self._hold_pinned(groups, tenant)
        # Release the old groups after taking the new ones, so groups in both stay held.
        if old is None:
            pin = self._pins[holder] = Pin(groups, pending, deadline, tenant, owner, lease_s)
            heapq.heappush(self._pin_heap, (deadline, next(self._pin_seq), holder, pin))
            self._compact_pin_heap()
        else:
            released, old.groups, old.ranks = old.groups, groups, pending
            old.readers, old.owner, old.lease_s = len(pending), owner, lease_s
            self._set_deadline(holder, old, deadline)
            self._release_groups(released)
        return len(groups)

    def mark_retrieved(self, holder: str, worker_id: int) -> bool:
        """Rank `worker_id` finished retrieving; True when that released the holder's pin."""
        pin = self._pins.get(holder)
        if pin is None:
            return False
        pin.ranks.discard(worker_id)
        if pin.ranks:
            return False
        del self._pins[holder]
        self._release_pin(pin)
        return True

    def pin_readers(self, holder: str) -> int:
        """How many ranks the holder's pin was made for (0: it holds none)."""
        pin = self._pins.get(holder)
        return 0 if pin is None else pin.readers

    def unpin(self, holder: str) -> bool:
        """Release the holder's pin; False when it holds none."""
        pin = self._pins.pop(holder, None)
        if pin is None:
            return False
        self._release_pin(pin)
        return True

    def renew(self, holder: str, lease_s: float) -> None:
        """Extend the holder's pin to `lease_s` from now; UnknownReservationError if it has none."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        pin = self._pins.get(holder)
        if pin is None:
            raise UnknownReservationError(f"holder {holder!r} has no pin (expired or released)")
        self._set_deadline(holder, pin, self._clock() + lease_s)

    def reclaim_pins(self, owner_seen: OwnerSeen | None = None) -> list[str]:
        """Release every pin whose lease expired; returns their holders.

        The lease counts from the owner's last sign of life: for a pin whose lease ran out,
        `owner_seen(holder, owner)` tells when its owner was last seen (None: gone), and a pin
        whose owner was seen less than its lease ago is kept until a lease after that. So what
        a lookup reported stays pinned while the client that asked lives, however long the
        request waits; a dead client's pins lapse a lease after its last sign of life.

        Costs the heap entries that came due (expired pins, renewed ones put back, released
        ones dropped), not the number of pins.
        """
        now = self._clock()
        heap = self._pin_heap
        lapsed: list[str] = []
        while heap and heap[0][0] <= now:
            due, _, holder, pin = heapq.heappop(heap)
            if self._pins.get(holder) is not pin or due != pin.queued:
                continue  # released or replaced, or a duplicate entry of a shortened lease
            if pin.deadline <= now and owner_seen is not None and pin.owner:
                seen = owner_seen(holder, pin.owner)
                if seen is not None:
                    pin.deadline = max(pin.deadline, seen + pin.lease_s)
            if pin.deadline <= now:
                del self._pins[holder]
                self._release_pin(pin)
                lapsed.append(holder)
            else:  # renewed since: due again at its new deadline
                pin.queued = pin.deadline
                heapq.heappush(heap, (pin.deadline, next(self._pin_seq), holder, pin))
        return lapsed

    def _set_deadline(self, holder: str, pin: Pin, deadline: float) -> None:
        pin.deadline = deadline
        if deadline < pin.queued:  # earlier than its heap entry says: a new entry
            pin.queued = deadline
            heapq.heappush(self._pin_heap, (deadline, next(self._pin_seq), holder, pin))

    def _compact_pin_heap(self) -> None:
        """Drop the entries of released pins once they outnumber the live ones (amortized)."""
        if len(self._pin_heap) <= 2 * len(self._pins) + 1024:
            return
        self._pin_heap = [
            entry
            for entry in self._pin_heap
            if self._pins.get(entry[2]) is entry[3] and entry[0] == entry[3].queued
        ]
        heapq.heapify(self._pin_heap)

    def pinned_keys(self, holder: str) -> list[ChunkKey]:
        """The keys the holder's pin actually holds (those that were in L1 when pinned)."""
        pin = self._pins.get(holder)
        return [] if pin is None else [group.key for group in pin.groups]

    def acquire(self, key: ChunkKey) -> Held:
        """Take an anonymous hold on a group (e.g. an L2 write-through in flight); give it back
        with `release(held)`. The hold names the group, not its key: should the group be
        cleared meanwhile and its key stored again, the release still ends this group's."""
        group = self._groups.get(key)
        if group is None:
            raise KeyError(f"cannot acquire {key}: not in L1")
        group.refs += 1
        self._hold(group)
        return group

    def release(self, held: Held) -> None:
        """Drop one anonymous hold taken by `acquire`."""
        if held.refs == 0 or (held.doomed and held not in self._doomed):
            raise ValueError(f"release of {held.key} without a matching acquire")
        if not held.doomed and self._groups.get(held.key) is not held:
            raise ValueError(f"release of {held.key} without a matching acquire")
        held.refs -= 1
        self._unhold(held)

    def _release_pin(self, pin: Pin) -> None:
        self._release_groups(pin.groups)

    def _release_groups(self, groups: list[Group]) -> None:
        # Admitted groups reversed, so the chain head is released last and ends most recent
        # (see `touch`); declined ones go to the cold end head first, so their tail ends
        # coldest and leaves first there too.
        order = [g for g in groups if not g.admitted]
        order += [g for g in reversed(groups) if g.admitted]
        for group in order:
            group.pins -= 1
            if group.pins == 0:
                self._usage_of(group.pin_tenant).pinned -= group.charged
                group.charged = 0
            self._unhold(group)

    def _hold_pinned(self, groups: list[Group], tenant: str) -> None:
        """Hold each group for one more pin (as `_hold`); one no pin held yet is charged to
        `tenant`. One loop without calls: a lookup pins every chunk of its prompt (64 groups for
        16k tokens), and two calls per group were a third of its pinning time."""
        usage = self._usage_of(tenant)
        discard = self._lru.pop
        for group in groups:
            if group.holds == 0:
                self._held_groups += 1
                if discard(group.key, None) is not None:
                    self._lru_bytes -= group.nbytes
            group.holds += 1
            if group.pins == 0:
                group.pin_tenant = tenant
                group.charged = group.nbytes
                usage.pinned += group.nbytes
            group.pins += 1
