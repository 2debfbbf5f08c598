"""Rows (and slots) by table and int64 id, kept in memory: bounded, vectorized.

Two users, one structure: the optimizer replica's row cache (the rows and slots it last
wrote, with the dirty, initial and located entries of rows written behind) and a
trainer's answered rows. Two generations of open-addressing maps per value width bound
the memory (an approximate LRU). docs/service.md#row-cache says why a replica may trust
what it wrote and how the entries work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.core import probing
from lookup_table.core.intmap import ENTRY_OVERHEAD, IntMap, check_keys, intp_slots
from lookup_table.core.keys import IdArray
from lookup_table.core.segments import segment_bounds

__all__ = ["INITIAL", "Located", "RowCache", "Spots"]

INITIAL = -1  # the stamp of an initial entry (see the module's doc)

_MIN_CAPACITY = 1024


def _int_ids(ids: IdArray) -> NDArray[np.int64]:
    if ids.dtype != np.int64:
        raise TypeError(f"the row cache holds int64 ids, got {ids.dtype}")
    return cast("NDArray[np.int64]", ids)


def _by_table(tabs: NDArray[np.int32]) -> NDArray[np.intp]:
    """A stable order of entries by table number: numpy's radix sort where the numbers fit
    in 16 bits (int32's is a merge sort, several times slower)."""
    if tabs.shape[0] and int(tabs.max()) < 1 << 15:
        return np.argsort(tabs.astype(np.int16), kind="stable")
    return np.argsort(tabs, kind="stable")


class _TableCache:
    """Two generations of `IntMap` of up to `max_capacity` slots each.

    The young map starts at 1/16 of the bound. Once that is half full, the cache takes its
    whole bound at once: the young map grows to `max_capacity` and the second
    generation's map is allocated beside it (`_spare`, which the first rotation takes).
    A cache that is needed at all soon holds that much; this way its memory is allocated
    and touched once (the first touch of memory is the expensive part), with one
    rehash, early, and no later rotation stops the service to allocate."""

    def __init__(self, width: int, max_capacity: int) -> None:
        self.width = width
        self.max_capacity = max_capacity
        self.young = IntMap(max(min(_MIN_CAPACITY, max_capacity), max_capacity // 16), width)
        self.old: IntMap | None = None
        self._spare: IntMap | None = None  # the second generation's map, until it is used

    def nbytes(self) -> int:
        spare = [] if self._spare is None else [self._spare]
        return sum(m.nbytes() for m in [*self._maps(), *spare])

    def get(
        self, ids: NDArray[np.int64], tabs: NDArray[np.int32]
    ) -> tuple[NDArray[np.bool_], NDArray[np.float32]]:
        """(hit, values) of each key; garbage where not hit."""
        hit, values, _ = self.lookup(ids, tabs)
        return hit, values

    def lookup(
        self, ids: NDArray[np.int64], tabs: NDArray[np.int32], cols: int | None = None
    ) -> tuple[NDArray[np.bool_], NDArray[np.float32], NDArray[np.int64]]:
        """(hit, values (their first `cols` floats: all by default), stamps) of each key;
        garbage where not hit. A key only the old map holds moves to the young one first
        (`_found`)."""
        at, hit = self._found(ids, tabs)
        # one gather of every id's slot, no masks (an absent id reads slot 0: garbage,
        # which a miss may hold)
        values, stamps = self.young._gathered(np.maximum(at, 0), cols)
        return hit, values, stamps

    def locate(
        self, ids: NDArray[np.int64], tabs: NDArray[np.int32]
    ) -> tuple[NDArray[np.intp], NDArray[np.bool_], NDArray[np.bool_]]:
        """(at, hit, initial) of each key: its slot in the young map where its value is
        known (-1 elsewhere), and whether that is an initial entry. As `lookup`, a key
        only the old map holds moves to the young one first."""
        at, hit = self._found(ids, tabs)
        at[~hit] = -1
        initial = np.empty(hit.shape[0], dtype=bool)
        probing.stamped(self.young.stamps, np.maximum(at, 0), hit, INITIAL, initial)
        return at, hit, initial

    def _found(
        self, ids: NDArray[np.int64], tabs: NDArray[np.int32]
    ) -> tuple[NDArray[np.intp], NDArray[np.bool_]]:
        """(slot, hit) of each key in the young map (`find_known`), after the keys only
        the old map holds moved up to it: used again, they stay young (dirty, initial or
        not, as they were). A key the young map holds, forgotten, is not looked up in the
        old one (the young map says its value is unknown)."""
        check_keys(ids, tabs)
        n = ids.shape[0]
        at = np.empty(n, dtype=np.intp)
        hit = np.empty(n, dtype=bool)
        for _ in range(3):  # a move may rotate: the keys just found move again, once
            young = self.young
            probing.find_known(young.meta, young.mask, ids, tabs, at, hit)
            absent = at < 0
            if self.old is None or not absent.any():
                return at, hit
            miss = np.flatnonzero(absent)
            _, found, old_values, old_stamps = self.old.lookup(ids[miss], tabs[miss])
            if not found.any():
                return at, hit
            got = miss[found]
            self._insert_new(ids[got], tabs[got], old_values[found], old_stamps[found])
        young = self.young
        probing.find_known(young.meta, young.mask, ids, tabs, at, hit)
        return at, hit

    def put(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        stamps: NDArray[np.int64] | int = 0,
    ) -> None:
        """Put values of unique keys (`stamps` > 0: dirty, see the module's doc; 0: what
        memcached holds). Where every key may be new without making room, one probe
        sequence per key sets or inserts it (`IntMap.upsert`)."""
        each = np.broadcast_to(np.asarray(stamps, dtype=np.int64), ids.shape)
        if self._put_once(ids, tabs, values, each, keep=False):
            return
        ids, tabs, values, each = self._set_held(ids, tabs, values, each)
        if ids.shape[0]:
            self._insert_new(ids, tabs, values, each)

    def _insert_new(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        stamps: NDArray[np.int64],
    ) -> None:
        """Put keys the young map does not hold. Making room for them may start a new
        generation, which takes along the dirty entries of the one it drops (`_rotate`):
        keys among those are set there, never inserted a second time (a stale twin in
        another slot would be flushed too)."""
        young = self.young
        if self._crowded(ids.shape[0]):
            self._make_room(ids.shape[0])
            if self.young is not young:
                ids, tabs, values, stamps = self._set_held(ids, tabs, values, stamps)
        placed = self.young.insert(ids, tabs, values, stamps)
        self._insert_left(ids, tabs, values, stamps, placed)

    def _put_once(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        each: NDArray[np.int64],
        *,
        keep: bool,
    ) -> bool:
        """One probe sequence per key (`IntMap.upsert`; `keep`: held keys left as they
        are) where the young map has room for every key as a new one; the keys whose
        probes ran out go to a fresh generation. False, nothing done, where it has not."""
        if self._crowded(ids.shape[0]):
            return False
        placed, _ = self.young.upsert(ids, tabs, values, each, keep=keep)
        self._insert_left(ids, tabs, values, each, placed)
        return True

    def _crowded(self, incoming: int) -> bool:
        """Whether `incoming` new keys would fill the young map past half: probe
        sequences stay short below that load."""
        return 2 * (self.young.size + incoming) > self.young.capacity

    def _insert_left(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        stamps: NDArray[np.int64],
        placed: NDArray[np.bool_],
    ) -> None:
        """Put the keys not `placed` (their probe sequences ran out), if any, in a fresh
        generation, as `_insert_new` puts keys."""
        if placed.all():
            return
        left = ~placed
        self._rotate()
        ids, tabs, values, stamps = self._set_held(
            ids[left], tabs[left], values[left], stamps[left]
        )
        self.young.insert(ids, tabs, values, stamps)

    def _set_held(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        stamps: NDArray[np.int64],
    ) -> tuple[NDArray[np.int64], NDArray[np.int32], NDArray[np.float32], NDArray[np.int64]]:
        """Set the keys the young map holds to these values; the others, to insert."""
        pos = self.young.find(ids, tabs)
        held = pos >= 0
        if held.all():  # the usual case of a warm cache: one scatter, no masks
            self.young.set(pos, values, stamps)
            return ids[:0], tabs[:0], values[:0], stamps[:0]
        if not held.any():
            return ids, tabs, values, stamps
        self.young.set(pos[held], values[held], stamps[held])
        rest = ~held
        return ids[rest], tabs[rest], values[rest], stamps[rest]

    def put_absent(
        self,
        ids: NDArray[np.int64],
        tabs: NDArray[np.int32],
        values: NDArray[np.float32],
        stamp: int,
    ) -> None:
        """Put the unique keys that neither generation holds (valid or forgotten); the
        others keep what they have. The old map is asked first, so that the young one
        is probed once per key where the load allows (`IntMap.upsert`, keeping)."""
        if self.old is not None:
            new = self.old.find(ids, tabs) < 0
            if not new.all():
                ids, tabs, values = ids[new], tabs[new], values[new]
        each = np.full(ids.shape[0], stamp, dtype=np.int64)
        if self._put_once(ids, tabs, values, each, keep=True):
            return
        absent = self.young.find(ids, tabs) < 0
        if absent.any():
            self._insert_new(ids[absent], tabs[absent], values[absent], each[absent])

    def drop(self, ids: NDArray[np.int64], tabs: NDArray[np.int32]) -> None:
        """Forget the values of these keys (what is stored for them is not known any more;
        a dirty one is not written: the caller wrote what supersedes it)."""
        for m in self._maps():
            pos = m.find(ids, tabs)
            m.forget(pos[pos >= 0])

    def _maps(self) -> list[IntMap]:
        return [self.young] if self.old is None else [self.young, self.old]

    def dirty(self) -> tuple[NDArray[np.int64], NDArray[np.int32], NDArray[np.float32]]:
        """Copies of the keys and values of every dirty entry, by table number (an old
        map's only where the young map does not hold the key: it has the newer value).
        Each map's values are read in slot order straight into their places by table:
        one copy of the values (a flush's are megabytes), no masks."""
        at = self.young.dirty_slots()
        ids, tabs = self.young.keys_at(at)
        maps: list[tuple[IntMap, NDArray[np.intp]]] = [(self.young, at)]
        if self.old is not None:
            old_at = self.old.dirty_slots()
            if old_at.shape[0]:
                old_ids, old_tabs = self.old.keys_at(old_at)
                older = self.young.find(old_ids, old_tabs) < 0
                maps.append((self.old, old_at[older]))
                ids = np.concatenate([ids, old_ids[older]])
                tabs = np.concatenate([tabs, old_tabs[older]])
        order = _by_table(tabs)
        place = np.empty_like(order)  # where each entry goes: `order` inverted
        place[order] = np.arange(order.shape[0])
        values = np.empty((ids.shape[0], self.width), dtype=np.float32)
        start = 0
        for m, slots in maps:
            stop = start + slots.shape[0]
            probing.gather_to(m.values, intp_slots(slots, m.capacity), place[start:stop], values)
            start = stop
        return ids[order], tabs[order], values

    def clean(self, upto: int) -> None:
        """Mark clean the dirty entries put with a stamp <= `upto` (they are written)."""
        for m in self._maps():
            m.clean(upto)

    def unwritten(self) -> int:
        """How many keys `dirty()` would copy (no copy made)."""
        n = int(self.young.dirty_slots().shape[0])
        if self.old is not None:
            old_at = self.old.dirty_slots()
            if old_at.shape[0]:
                n += int(np.count_nonzero(self.young.find(*self.old.keys_at(old_at)) < 0))
        return n

    def _make_room(self, incoming: int) -> None:
        if self.young.capacity < self.max_capacity:
            self._grow()
        if self._crowded(incoming):
            self._rotate()

    def _grow(self) -> None:
        """Take the whole bound: the young map at `max_capacity`, and the second
        generation's map (see the class's doc)."""
        old = self.young
        self.young = IntMap(self.max_capacity, self.width)
        live = old.live_slots()
        self.young.insert(*old.keys_at(live), old.values_at(live), old.stamps[live])
        if self.old is None:
            self._spare = IntMap(self.max_capacity, self.width)

    def _rotate(self) -> None:
        dropped = self.old
        self.old = self.young
        kept = None
        if dropped is not None:  # its dirty entries live on, unless the young has newer
            at = dropped.dirty_slots()
            ids, tabs = dropped.keys_at(at)
            gone = self.old.find(ids, tabs) < 0
            if gone.any():
                at = at[gone]
                kept = (ids[gone], tabs[gone], dropped.values_at(at), dropped.stamps[at])
        if dropped is not None and dropped.capacity == self.old.capacity:
            dropped.clear()  # its memory becomes the young map
            self.young = dropped
        elif self._spare is not None and self._spare.capacity == self.old.capacity:
            self.young, self._spare = self._spare, None
        else:
            self.young = IntMap(self.old.capacity, self.width)
        if kept is not None:
            placed = self.young.insert(*kept)
            if not placed.all():  # the caller's dirty budget keeps far below this
                raise RuntimeError(
                    f"the row cache lost {int((~placed).sum())} unwritten rows in a rotation"
                )


@dataclass(frozen=True, slots=True, eq=False)
class Spots:
    """Where `RowCache.locate_many` found a batch of keys of one value width: in `map`
    (the young map of `cache` then), while the map was at `epoch`.

    Keys never move within a map (no deletions), and a map's memory is reused only after
    `clear()` (a rotation, `epoch` + 1). So while the epoch is unchanged the slots still
    hold the values of the keys a caller has locked, even when `map` is no longer the
    young map or `cache` no longer the cache's (they are then only read: `values_of`);
    while `map` is still the young map of the cache in use, they are where new values go
    (`put_items`)."""

    cache: _TableCache
    map: IntMap
    epoch: int


@dataclass(frozen=True, slots=True)
class Located:
    """One (table, ids) of `RowCache.locate_many`: `at`, each id's slot in `spots.map`
    where the cache holds its value (-1 where not: `hit` False); `initial`, the hits that
    are initial entries (no row in memcached)."""

    spots: Spots
    at: NDArray[np.intp]
    hit: NDArray[np.bool_]
    initial: NDArray[np.bool_]


class RowCache:
    """Rows and slots (concatenated: dim + slot width floats) by table and int64 id.

    Tables of one value width share one `_TableCache` (keys: table number and id), so a
    push of many tables costs one batch of numpy operations per width, not per table.
    """

    def __init__(self, widths: Mapping[str, tuple[int, int]], max_bytes: int) -> None:
        """`widths`: table -> (dim, slot width) of the tables to cache, int64 ids only
        (the caller leaves out what must not be cached: string ids, `ttl_s`); `max_bytes`
        bounds the whole cache (<= 0: nothing is cached)."""
        self._where: dict[str, tuple[int, int, int]] = {}  # table -> (number, width, dim)
        self._names: dict[int, str] = {}  # table number -> name
        self._groups: dict[int, _TableCache] = {}
        self._stamp = 0  # of the last dirty put_many
        # entries made dirty since `dirty()`, by width: a put of a key dirty already since
        # then (its stamp after `_since`) takes no new room
        self._dirty_puts: Counter[int] = Counter()
        self._taken: Counter[int] = Counter()  # the last `dirty()`'s, until written
        self._since = 0  # the stamp `dirty()` was taken at (its entries: stamps up to it)
        self._since_before = 0  # the one before it, back if its copy is not written
        if max_bytes <= 0 or not widths:
            return
        width_of = {name: dim + slot_width for name, (dim, slot_width) in widths.items()}
        for width, count in Counter(width_of.values()).items():
            share = max_bytes * count // len(width_of)
            per_map = share // (2 * (width * 4 + ENTRY_OVERHEAD))  # two generations
            capacity = 1 << max(int(per_map).bit_length() - 1, 0)
            if capacity >= _MIN_CAPACITY:
                self._groups[width] = _TableCache(width, capacity)
        for number, (name, (dim, _)) in enumerate(widths.items()):
            if width_of[name] in self._groups:
                self._where[name] = (number, width_of[name], dim)
                self._names[number] = name

    def caches(self, table: str) -> bool:
        return table in self._where

    def get_many(
        self, parts: Sequence[tuple[str, IdArray]]
    ) -> list[tuple[NDArray[np.bool_], NDArray[np.float32], NDArray[np.float32]]]:
        """(hit, rows, slots) of each (table, unique ids); garbage where not hit. One
        batch per value width."""
        return [(hit, rows, slots) for hit, rows, slots, _ in self.lookup_many(parts)]

    def lookup_many(
        self, parts: Sequence[tuple[str, IdArray]], *, rows_only: bool = False
    ) -> list[
        tuple[NDArray[np.bool_], NDArray[np.float32], NDArray[np.float32], NDArray[np.bool_]]
    ]:
        """`get_many`'s (hit, rows, slots) and which hits are initial entries (no row
        in memcached: see the module's doc). `rows_only`: the slots are not copied (each
        table's are (n, 0)): a row's floats are a fraction of its slots' (Adam's)."""
        out: list[Any] = [None] * len(parts)
        for width, members in self._by_width([t for t, _ in parts]).items():
            ids, tabs = self._keys([parts[i] for i in members])
            dims = [self._where[parts[i][0]][2] for i in members]
            cols = max(dims) if rows_only else width
            hit, values, stamps = self._groups[width].lookup(ids, tabs, cols)
            initial = hit & (stamps == INITIAL)
            start = 0
            for i, dim in zip(members, dims, strict=True):
                stop = start + parts[i][1].shape[0]
                block = values[start:stop]
                slots = block[:, :0] if rows_only else block[:, dim:]
                out[i] = (hit[start:stop], block[:, :dim], slots, initial[start:stop])
                start = stop
        return out

    def known_many(
        self,
        parts: Sequence[tuple[str, IdArray]],
        wanted: Sequence[NDArray[np.bool_] | None],
    ) -> list[tuple[NDArray[np.bool_], NDArray[np.float32]] | None]:
        """Per (table, unique ids), which of its `wanted` ids (a mask; None: all) the
        cache holds a row for, and those rows in that order (no slots); None where
        none, or the table is not cached. One batch per value width: the ids of a
        width's parts are picked, looked up and their hits copied once for all."""
        out: list[tuple[NDArray[np.bool_], NDArray[np.float32]] | None] = [None] * len(parts)
        for width, members in self._by_width([t for t, _ in parts]).items():
            ids, tabs = self._keys([parts[i] for i in members])
            ids_total = ids.shape[0]
            dims = [self._where[parts[i][0]][2] for i in members]
            masks = [wanted[i] for i in members]
            picked: NDArray[np.intp] | None = None
            if any(m is not None for m in masks):
                picked = np.flatnonzero(
                    np.concatenate(
                        [
                            np.ones(parts[i][1].shape[0], bool) if m is None else m
                            for i, m in zip(members, masks, strict=True)
                        ]
                    )
                )
                ids, tabs = ids[picked], tabs[picked]
            got, values, _ = self._groups[width].lookup(ids, tabs, max(dims))
            if picked is None:
                hit = got
            else:
                hit = np.zeros(ids_total, bool)
                hit[picked] = got
            rows = values[got]
            # where each part's ids, and its hits' rows, start
            starts = segment_bounds(parts[i][1].shape[0] for i in members)
            before = np.zeros(hit.shape[0] + 1, np.intp)
            np.cumsum(hit, out=before[1:])
            firsts = before[starts].tolist()
            for j, i in enumerate(members):
                if firsts[j + 1] > firsts[j]:
                    out[i] = (
                        hit[starts[j] : starts[j + 1]],
                        rows[firsts[j] : firsts[j + 1], : dims[j]],
                    )
        return out

    def locate_many(self, parts: Sequence[tuple[str, IdArray]]) -> list[Located]:
        """Where the values of each (table, unique ids) of cached tables are (`Located`),
        for a caller that reads them in place (`values_of`) and puts their new values
        back there (`put_items`) while it holds the ids' locks: no gather, no second
        probe. One batch per value width (its tables' `Located` share one `Spots`)."""
        out: list[Any] = [None] * len(parts)
        for width, members in self._by_width([t for t, _ in parts]).items():
            ids, tabs = self._keys([parts[i] for i in members])
            cache = self._groups[width]
            at, hit, initial = cache.locate(ids, tabs)
            spots = Spots(cache, cache.young, cache.young.epoch)
            start = 0
            for i in members:
                stop = start + parts[i][1].shape[0]
                out[i] = Located(spots, at[start:stop], hit[start:stop], initial[start:stop])
                start = stop
        return out

    def values_of(self, spots: Spots) -> NDArray[np.float32] | None:
        """The values (items of the width) `spots`' slots index; None once its map was
        cleared since (rotated out twice): the caller locates its keys again."""
        return spots.map.values if spots.map.epoch == spots.epoch else None

    def put_items(
        self,
        spots: Spots,
        at: NDArray[np.intp],
        parts: Sequence[tuple[str, IdArray]],
        items: NDArray[np.float32],
        *,
        dirty: bool = False,
    ) -> None:
        """Remember new values of the (table, ids) of `parts` (one width, as located
        together: `spots`), `items` (n, width) in the order of their ids: set at their
        slots `at` while `spots` is the young map of the cache in use, by key where
        `at` < 0 or else (`put_many`'s semantics otherwise: `dirty` as there)."""
        stamp = self._next_stamp(dirty)
        width = spots.cache.width
        cache = self._groups.get(width)
        if cache is None:  # the cache is off
            return
        held = at >= 0
        if cache is spots.cache and cache.young is spots.map and spots.map.epoch == spots.epoch:
            every = bool(held.all())
            if every:
                again = spots.map.set(at, items, stamp, self._since)
            else:
                again = spots.map.set(at[held], items[held], stamp, self._since)
            if dirty:  # the keys held dirty since the last `dirty()` are counted already
                self._dirty_puts[width] += items.shape[0] - again
            if every:
                return
        else:
            held[:] = False
            if dirty:
                self._dirty_puts[width] += items.shape[0]
        ids, tabs = self._keys(parts)
        rest = ~held
        cache.put(ids[rest], tabs[rest], items[rest], stamp)

    def _next_stamp(self, dirty: bool) -> int:
        """The stamp of a clean put (0), or of the next dirty one."""
        if not dirty:
            return 0
        self._stamp += 1
        return self._stamp

    def put_many(
        self,
        parts: Sequence[tuple[str, IdArray, NDArray[np.float32], NDArray[np.float32]]],
        *,
        dirty: bool = False,
        initial: bool = False,
    ) -> None:
        """Remember the rows and slots of each (table, ids, rows, slots) of cached tables;
        `dirty`: memcached does not hold them yet; `initial`: memcached holds no row for
        these ids, the values are their initial ones, and only keys the cache does not
        hold are put (see the module's doc)."""
        if dirty and initial:
            raise ValueError("an initial entry is clean: dirty and initial exclude each other")
        stamp = INITIAL if initial else self._next_stamp(dirty)
        for width, members in self._by_width([p[0] for p in parts]).items():
            ids, tabs = self._keys([(parts[i][0], parts[i][1]) for i in members])
            values = np.empty((ids.shape[0], width), dtype=np.float32)
            start = 0
            for i in members:  # each table's rows, then its slots: one copy
                _, _, rows, slots = parts[i]
                stop = start + rows.shape[0]
                values[start:stop, : rows.shape[1]] = rows
                values[start:stop, rows.shape[1] :] = slots
                start = stop
            if initial:
                self._groups[width].put_absent(ids, tabs, values, stamp)
            else:
                self._groups[width].put(ids, tabs, values, stamp)
            if dirty:
                self._dirty_puts[width] += ids.shape[0]

    def put_block(
        self,
        tables: Sequence[str],
        bounds: NDArray[np.int64],
        ids: NDArray[np.int64],
        rows: NDArray[np.float32],
    ) -> bool:
        """Remember clean rows of tables without slots given as one block (the ids and
        rows `bounds[i]:bounds[i + 1]` are those of `tables[i]`), as `put_many` does;
        False (nothing put) unless every table is cached, of the block's width."""
        where = [self._where.get(t) for t in tables]
        width = rows.shape[1]
        if not all(w is not None and w[1] == w[2] == width for w in where):
            return False
        numbers = np.array([cast(tuple[int, int, int], w)[0] for w in where], dtype=np.int32)
        tabs = np.repeat(numbers, np.diff(bounds))
        self._groups[width].put(ids, tabs, rows, self._next_stamp(False))
        return True

    def dirty(
        self,
    ) -> tuple[list[tuple[str, IdArray, NDArray[np.float32], NDArray[np.float32]]], int]:
        """Copies of every dirty entry, as (table, ids, rows, slots), and the stamp they
        were taken at (for `clean`, once they are written; `undo_dirty`, if not)."""
        self._taken, self._dirty_puts = self._dirty_puts, Counter()
        self._since_before, self._since = self._since, self._stamp
        out: list[tuple[str, IdArray, NDArray[np.float32], NDArray[np.float32]]] = []
        for cache in self._groups.values():
            ids, tabs, values = cache.dirty()  # by table number
            if not ids.shape[0]:
                continue
            numbers, starts = np.unique(tabs, return_index=True)
            bounds = [*starts.tolist(), ids.shape[0]]
            for k, number in enumerate(numbers.tolist()):
                name = self._names[number]
                dim = self._where[name][2]
                block = values[bounds[k] : bounds[k + 1]]
                out.append((name, ids[bounds[k] : bounds[k + 1]], block[:, :dim], block[:, dim:]))
        return out, self._stamp

    def clean(self, upto: int) -> None:
        """Mark clean the dirty entries put by stamps <= `upto` (`dirty`'s: written)."""
        for cache in self._groups.values():
            cache.clean(upto)

    def undo_dirty(self) -> None:
        """The copy of the last `dirty()` was not written: its entries count again
        against `room_for`."""
        self._dirty_puts.update(self._taken)
        self._taken = Counter()
        self._since = self._since_before

    def room_for(self, parts: Sequence[tuple[str, int]]) -> bool:
        """Whether (table, rows) more dirty rows fit: per value width, the entries made
        dirty since the last `dirty()` stay within a quarter of a map's bound (a young map
        rotates at half full, and takes the dirty ones along). A key put dirty again
        (`put_items` at its slot) counts once: a push's popular ids, dirty since the last
        flush already, do not bring the next flush forward."""
        incoming: Counter[int] = Counter()
        for name, rows in parts:
            where = self._where.get(name)
            if where is not None:
                incoming[where[1]] += rows
        return all(
            self._dirty_puts[w] + n <= self._groups[w].max_capacity // 4
            for w, n in incoming.items()
        )

    def forget(self, tables: Iterable[tuple[str, IdArray]] | None = None) -> None:
        """Forget the given (table, ids), or everything."""
        if tables is None:
            for width, cache in list(self._groups.items()):
                self._groups[width] = _TableCache(cache.width, cache.max_capacity)
            return
        parts = list(tables)
        for width, members in self._by_width([t for t, _ in parts]).items():
            ids, tabs = self._keys([parts[i] for i in members])
            self._groups[width].drop(ids, tabs)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self._groups.values())

    def unwritten(self) -> int:
        """How many dirty entries it holds (rows memcached does not hold yet), whether a
        `dirty()` copy of them is being written or not."""
        return sum(c.unwritten() for c in self._groups.values())

    def _by_width(self, names: Sequence[str]) -> dict[int, list[int]]:
        """Positions of the cached tables among `names`, by their value width."""
        groups: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            where = self._where.get(name)
            if where is not None:
                groups.setdefault(where[1], []).append(i)
        return groups

    def _keys(
        self, parts: Sequence[tuple[str, IdArray]]
    ) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
        ids = np.concatenate([_int_ids(p[1]) for p in parts])
        numbers = np.array([self._where[p[0]][0] for p in parts], dtype=np.int32)
        tabs = np.repeat(numbers, [p[1].shape[0] for p in parts])
        return ids, tabs
