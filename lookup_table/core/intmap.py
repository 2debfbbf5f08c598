"""`IntMap`: one open-addressing map of (table number, int64 id) -> a row of floats, the
row cache's building block (`rowcache` keeps two generations of them per value width);
its probes are `probing`'s compiled loops."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core import probing

__all__ = ["ENTRY_OVERHEAD", "IntMap", "check_keys", "intp_slots"]

_MIN_RECORD = 64  # slots of a map's record of dirty slots, at first (it grows as needed)
# bytes per slot besides the values: the key row (id, table and flags) and the stamp
ENTRY_OVERHEAD = 2 * np.dtype(np.int64).itemsize + np.dtype(np.int64).itemsize
# a key row's second word: the table number in the low 32 bits, then two flags
_TAB_BITS = np.int64(probing.TAB_BITS)
_USED = np.int64(probing.USED)  # the slot holds a key
_VALID = np.int64(probing.VALID)  # its value is known (False: forgotten)


def intp_slots(slots: NDArray[np.intp], capacity: int) -> NDArray[np.intp]:
    """Slots as the compiled loops take them: C-contiguous intp, each within the map
    (they index without bounds checks)."""
    slots = np.ascontiguousarray(slots, dtype=np.intp)
    if slots.shape[0] and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise ValueError(
            f"slots {int(slots.min())}..{int(slots.max())} outside a map of {capacity}"
        )
    return slots


def check_keys(ids: NDArray[np.int64], tabs: NDArray[np.int32]) -> None:
    """The compiled probes index without bounds checks: one table number per id."""
    if ids.ndim != 1 or tabs.shape != ids.shape:
        raise ValueError(f"ids {ids.shape} and table numbers {tabs.shape} must be (n,) each")


class IntMap:
    """(table number, int64 id) -> a float32 value of `width` floats; open addressing,
    no deletions.

    A slot's key is one 16-byte row of `meta`: the id, then the table number (low 32
    bits) with a used and a valid flag, so a probe of a map far larger than the CPU's
    caches waits for one cache line, not one per array (id, table, used, valid).

    `record[:logged]` holds every slot whose stamp is > 0 (a dirty entry; also slots
    cleaned or forgotten since, and a slot twice once forgotten and put again), so what
    is dirty is found without a scan of the map. The compiled puts append a slot as its
    stamp turns > 0; `clean` and `dirty_slots` keep only the dirty ones."""

    def __init__(self, capacity: int, width: int) -> None:
        self.mask = capacity - 1
        self.meta = np.zeros((capacity, 2), dtype=np.int64)
        self.values = np.zeros((capacity, width), dtype=np.float32)
        self.stamps = np.zeros(capacity, dtype=np.int64)  # > 0: dirty, put by that stamp
        for arr in (self.meta, self.values, self.stamps):
            arr.fill(0)  # touch every page now: `nbytes` is what the cache holds resident
        self.record = np.empty(0, dtype=np.intp)  # allocated by the first dirty put
        self.logged = 0
        self.size = 0
        self.epoch = 0  # how many times it was cleared: a `Spots` of an older epoch is void

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.meta, self.values, self.stamps, self.record))

    def _room(self, each: NDArray[np.int64]) -> NDArray[np.intp]:
        """The record, with room for the slots a put of these stamps may make dirty: its
        stale entries dropped first where it is full, then grown."""
        n = each.shape[0] if each.shape[0] and int(each.max()) > 0 else 0
        if self.logged + n > self.record.shape[0]:
            self._compact()
            if self.logged + n > self.record.shape[0]:
                size = max(2 * self.record.shape[0], self.logged + n, _MIN_RECORD)
                grown = np.empty(size, dtype=np.intp)
                grown[: self.logged] = self.record[: self.logged]
                self.record = grown
        return self.record

    def _compact(self) -> NDArray[np.intp]:
        """Keep only the dirty slots in the record, once each, in slot order; returns them."""
        out = np.empty(self.logged, dtype=np.intp)
        bits = np.zeros((self.capacity + 63) // 64, dtype=np.uint64)
        n = probing.dirty_slots(self.meta, self.stamps, self.record[: self.logged], bits, out)
        self.record[:n] = out[:n]
        self.logged = n
        return out[:n]

    def clear(self) -> None:
        """Empty the map, keeping its memory: only the used flag says what a slot holds,
        so the ids and values need no zeroing (a rotation would otherwise allocate and
        touch a whole new map)."""
        self.meta[:, 1] = 0
        self.stamps.fill(0)
        self.logged = 0
        self.size = 0
        self.epoch += 1

    @property
    def capacity(self) -> int:
        return self.mask + 1

    def find(self, ids: NDArray[np.int64], tabs: NDArray[np.int32]) -> NDArray[np.intp]:
        """The slot of each id, -1 where it is absent (a slot may hold a forgotten value)."""
        check_keys(ids, tabs)
        out = np.empty(ids.shape[0], dtype=np.intp)
        probing.find(self.meta, self.mask, ids, tabs, out)
        return out

    def lookup(
        self, ids: NDArray[np.int64], tabs: NDArray[np.int32]
    ) -> tuple[NDArray[np.intp], NDArray[np.bool_], NDArray[np.float32], NDArray[np.int64]]:
        """(slot, hit, values, stamps) of each id: `find`'s slot; hit where its value is
        known; garbage values and stamps where not hit."""
        check_keys(ids, tabs)
        n = ids.shape[0]
        out = np.empty(n, dtype=np.intp)
        hit = np.empty(n, dtype=bool)
        probing.find_known(self.meta, self.mask, ids, tabs, out, hit)
        # one gather of every id's slot, no masks (an absent id reads slot 0: garbage,
        # which a miss may hold)
        values, stamps = self._gathered(np.maximum(out, 0))
        return out, hit, values, stamps

    def _gathered(
        self, slots: NDArray[np.intp], cols: int | None = None
    ) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        """Copies of the values (their first `cols` floats: all by default) and stamps of
        these slots (compiled, the slots ahead asked for early: a batch's slots are random
        lines of a map far larger than the caches)."""
        width = self.values.shape[1] if cols is None else min(cols, self.values.shape[1])
        values = np.empty((slots.shape[0], width), dtype=np.float32)
        stamps = np.empty(slots.shape[0], dtype=np.int64)
        probing.gather(self.values, self.stamps, intp_slots(slots, self.capacity), values, stamps)
        return values, stamps

    def values_at(self, slots: NDArray[np.intp]) -> NDArray[np.float32]:
        """A copy of the values of these slots."""
        return self._gathered(slots)[0]

    def set(
        self, slots: NDArray[np.intp], values: NDArray[np.float32], stamps: Any, since: int = 0
    ) -> int:
        """New values (and stamps: each one's, or one for all) of the keys these slots
        hold, known from now on (compiled, as `_gathered`). Returns how many of the slots
        were dirty by a stamp > `since` before."""
        slots = intp_slots(slots, self.capacity)
        if values.shape != (slots.shape[0], self.values.shape[1]):
            raise ValueError(
                f"values {values.shape} for {slots.shape[0]} slots of width {self.values.shape[1]}"
            )
        each = np.broadcast_to(np.asarray(stamps, dtype=np.int64), slots.shape)
        record = self._room(each)
        self.logged, again = probing.scatter(
            self.meta, self.values, self.stamps, slots, values, each, record, self.logged, since
        )
        return int(again)

    def forget(self, slots: NDArray[np.intp]) -> None:
        """Forget the values of these slots (their keys stay: no deletions)."""
        self.meta[slots, 1] &= ~_VALID
        self.stamps[slots] = 0

    def keys_at(self, slots: NDArray[np.intp]) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
        """The ids and table numbers of these slots."""
        rows = np.take(self.meta, slots, axis=0)
        return rows[:, 0], (rows[:, 1] & _TAB_BITS).astype(np.int32)

    def live_slots(self) -> NDArray[np.intp]:
        """The slots whose values are known."""
        return np.flatnonzero((self.meta[:, 1] & (_USED | _VALID)) == (_USED | _VALID))

    def dirty_slots(self) -> NDArray[np.intp]:
        """The slots of the dirty entries whose values are known, in slot order."""
        return self._compact()

    def clean(self, upto: int) -> None:
        """Mark clean the dirty entries put with a stamp <= `upto`."""
        self.logged = probing.clean(self.stamps, self.record, self.logged, upto)

    def insert(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        stamps: NDArray[np.int64] | int = 0,
    ) -> NDArray[np.bool_]:
        """Put absent, unique keys (`stamps`: each one's, or one for all: 0 clean);
        False where no free slot was found within the probes (`upsert`, whose first free
        slot ends each of these keys' probes)."""
        return self.upsert(ids, tabs, values, stamps)[0]

    def upsert(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        stamps: NDArray[np.int64] | int = 0,
        *,
        since: int = 0,
        keep: bool = False,
    ) -> tuple[NDArray[np.bool_], int]:
        """`set` for the keys the map holds (left as they are where `keep`), `insert`
        for the others, one probe sequence per key (a key given twice is inserted, then
        set). Returns where each key was found or placed (False: neither within the
        probes, nothing done), and how many held keys were dirty by a stamp > `since`
        before."""
        check_keys(ids, tabs)
        if values.shape != (ids.shape[0], self.values.shape[1]):
            raise ValueError(
                f"values {values.shape} for {ids.shape[0]} keys of width {self.values.shape[1]}"
            )
        each = np.broadcast_to(np.asarray(stamps, dtype=np.int64), ids.shape)
        placed = np.empty(ids.shape[0], dtype=bool)
        record = self._room(each)
        count, self.logged, again = probing.upsert(
            self.meta,
            self.mask,
            self.values,
            self.stamps,
            ids,
            tabs,
            values,
            each,
            keep,
            placed,
            record,
            self.logged,
            since,
        )
        self.size += count
        return placed, int(again)
