"""The row cache's record of dirty slots (lookup_table/core/rowcache.py) against a scan.

Each map records the slots its puts make dirty, so `dirty()`, `clean()` and
`unwritten()` cost what is dirty, not the map's size. Checked here: after any sequence
of puts (by key and where located), forgets, flushes taken, written or failed, and the
rotations a small budget forces, every map's `dirty_slots()` is exactly what a scan of
its stamps finds, and the flush copies every row put dirty and not written since.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_table.core import probing
from lookup_table.core.intmap import IntMap
from lookup_table.core.rowcache import RowCache, _TableCache

pytestmark = pytest.mark.unit

WIDTH = {"a": (3, 0), "b": (3, 0), "c": (2, 2)}  # a and b share one map


def _scanned(m: IntMap) -> np.ndarray:
    """The dirty slots whose values are known, by a scan of the whole map."""
    valid = (m.meta[:, 1] & probing.VALID) != 0
    return np.flatnonzero((m.stamps > 0) & valid)


def _check_records(cache: RowCache) -> None:
    for group in cache._groups.values():
        for m in group._maps():
            want = _scanned(m)
            # every dirty slot is recorded (the record may also hold stale ones)
            assert np.isin(want, m.record[: m.logged]).all()
            np.testing.assert_array_equal(m.dirty_slots(), want)


def _values(counter: int, n: int, width: int) -> np.ndarray:
    return np.arange(counter, counter + n * width, dtype=np.float32).reshape(n, width)


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["put", "dirty", "items", "clean_items", "forget", "flush", "written", "failed"]
        ),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 200) | st.integers(0, 6_000), max_size=300),
    ),
    max_size=60,
)


@given(ops)
@settings(max_examples=150, deadline=None)
def test_the_record_finds_what_a_scan_of_the_stamps_finds(
    program: list[tuple[str, str, list[int]]],
) -> None:
    """Dirty puts by key (`put_many`) and where located (`put_items`, also of slots
    dirty already), clean puts over dirty keys, forgets of dirty keys and puts of them
    again, flushes written (`clean`, with puts between the copy and the write) or not
    (`undo_dirty`), rotations: the record and a scan agree at every step, and the
    flush's copy holds exactly the keys put dirty since their last written copy, each
    once, with its last value."""
    cache = RowCache(WIDTH, 250_000)  # small: rotations
    last: dict[tuple[str, int], np.ndarray] = {}
    dirty: dict[tuple[str, int], int] = {}  # key -> the stamp of its last dirty put
    stamp = 0
    taken: tuple[dict[tuple[str, int], int], int] | None = None
    counter = 0
    for op, table, raw in program:
        ids = np.unique(np.array(raw, dtype=np.int64))
        dim, slot_width = WIDTH[table]
        width = dim + slot_width
        values = _values(counter, ids.size, width)
        counter += values.size
        if op in ("put", "dirty", "items", "clean_items"):
            is_dirty = op in ("dirty", "items")
            if is_dirty and not cache.room_for([(table, ids.size)]):
                continue  # the updater flushes first
            if op in ("put", "dirty"):
                cache.put_many([(table, ids, values[:, :dim], values[:, dim:])], dirty=is_dirty)
            else:
                (located,) = cache.locate_many([(table, ids)])
                cache.put_items(located.spots, located.at, [(table, ids)], values, dirty=is_dirty)
            if is_dirty:
                stamp += 1
            for i, v in zip(ids.tolist(), values, strict=True):
                last[(table, i)] = v
                if is_dirty:
                    dirty[(table, i)] = stamp
                else:
                    dirty.pop((table, i), None)
        elif op == "forget":
            cache.forget([(table, ids)])
            for i in ids.tolist():
                last.pop((table, i), None)
                dirty.pop((table, i), None)
        elif op == "flush":
            if taken is not None:
                cache.undo_dirty()
            got, upto = cache.dirty()
            seen: dict[tuple[str, int], np.ndarray] = {}
            for name, got_ids, rows, slots in got:
                for i, r, s in zip(got_ids.tolist(), rows, slots, strict=True):
                    assert (name, i) not in seen
                    seen[(name, i)] = np.concatenate([r, s])
            assert set(seen) == set(dirty)
            for key, value in seen.items():
                np.testing.assert_array_equal(value, last[key])
            taken = (dict(dirty), upto)
        elif op == "written" and taken is not None:
            was, upto = taken
            cache.clean(upto)
            for key, made in list(dirty.items()):
                if was.get(key) == made:
                    del dirty[key]
            taken = None
        elif op == "failed" and taken is not None:
            cache.undo_dirty()
            taken = None
        _check_records(cache)
        assert cache.unwritten() == len(dirty), op


def test_a_slot_put_dirty_again_and_again_is_recorded_once() -> None:
    cache = RowCache({"a": (1, 1)}, 100_000)
    ids = np.arange(100, dtype=np.int64)
    cache.put_many([("a", ids, np.zeros((100, 1), np.float32), np.zeros((100, 1), np.float32))])
    for k in range(50):
        (located,) = cache.locate_many([("a", ids)])
        items = np.full((100, 2), k, dtype=np.float32)
        cache.put_items(located.spots, located.at, [("a", ids)], items, dirty=True)
    (group,) = cache._groups.values()
    assert group.young.logged == 100  # appended as each slot turned dirty, not per put
    ((name, got, rows, slots),), _ = cache.dirty()
    assert (
        name == "a" and (np.sort(got) == ids).all() and (rows == 49).all() and (slots == 49).all()
    )


def test_a_dirty_row_moved_by_rotations_is_recorded_in_each_map_it_lands_in() -> None:
    """A rotation drops the old generation but moves its dirty entries to the young map:
    they are recorded there (and the reused map's record starts empty)."""
    cache = _TableCache(width=2, max_capacity=1024)
    tabs = np.zeros(10, dtype=np.int32)
    dirty_ids = np.arange(10, dtype=np.int64)
    cache.put(dirty_ids, tabs, np.full((10, 2), 5, np.float32), 1)
    for start in range(1000, 9000, 400):  # many rotations of clean rows
        ids = np.arange(start, start + 400, dtype=np.int64)
        cache.put(ids, np.zeros(400, np.int32), np.zeros((400, 2), np.float32))
        for m in cache._maps():
            np.testing.assert_array_equal(m.dirty_slots(), _scanned(m))
            assert m.logged <= 10  # only dirty slots: the clean puts record nothing
    ids, _, values = cache.dirty()
    assert (np.sort(ids) == dirty_ids).all() and (values == 5).all()
    assert cache.unwritten() == 10


def test_puts_during_a_flush_stay_dirty_after_it_is_written_or_not() -> None:
    """`clean(stamp)` marks written only what the copy holds: a key put dirty again
    after the copy was taken stays dirty (and recorded); after a failed flush
    (`undo_dirty`) every key is still dirty and the next copy holds them all."""
    cache = RowCache({"a": (1, 1)}, 100_000)
    ids = np.arange(40, dtype=np.int64)

    def push(some: np.ndarray, value: float) -> None:
        (located,) = cache.locate_many([("a", some)])
        items = np.full((some.shape[0], 2), value, dtype=np.float32)
        cache.put_items(located.spots, located.at, [("a", some)], items, dirty=True)

    push(ids, 1)
    _, upto = cache.dirty()
    push(ids[:10], 2)  # while the copy is being written
    push(np.arange(100, 105, dtype=np.int64), 3)  # new keys, by key
    cache.undo_dirty()  # not written
    ((_, got, rows, _),), upto = cache.dirty()
    assert set(got.tolist()) == set(range(40)) | set(range(100, 105))
    assert (rows[np.isin(got, ids[:10])] == 2).all()
    push(ids[30:], 4)  # during the second flush
    cache.clean(upto)  # written
    ((_, got, rows, _),), _ = cache.dirty()
    assert (np.sort(got) == ids[30:]).all() and (rows == 4).all()
    (group,) = cache._groups.values()
    assert group.young.logged == 10


def test_a_dirty_key_forgotten_and_put_again_is_flushed_once() -> None:
    cache = RowCache({"a": (1, 1)}, 100_000)
    ids = np.arange(20, dtype=np.int64)
    zeros = np.zeros((20, 1), np.float32)
    (group,) = cache._groups.values()
    for k in range(10):
        cache.put_many([("a", ids, zeros, zeros)], dirty=True)
        if k == 1:  # the forgotten slots' stale entries stay, until the record is full
            assert group.young.logged == 40
        cache.forget([("a", ids)])
    assert group.young.logged <= 64  # then compacted, not grown
    cache.put_many([("a", ids, zeros + 1, zeros)], dirty=True)
    ((_, got, rows, _),), _ = cache.dirty()
    assert (np.sort(got) == ids).all() and (rows == 1).all()
    assert group.young.logged == 20


def test_rows_only_lookups_give_the_rows_hits_and_initial_entries_of_a_full_one() -> None:
    """`lookup_many(rows_only=True)` (a replica's answer reads) copies the rows alone,
    also of tables of one value width with different dims (one map, one gather)."""
    widths = {"a": (3, 1), "b": (1, 3), "c": (2, 2)}  # one width: 4
    cache = RowCache(widths, 1 << 20)
    rng = np.random.default_rng(5)
    parts = []
    for name, (dim, slot_width) in widths.items():
        ids = rng.permutation(500)[:200].astype(np.int64)
        values = rng.normal(size=(200, dim + slot_width)).astype(np.float32)
        cache.put_many([(name, ids[:120], values[:120, :dim], values[:120, dim:])])
        cache.put_many(
            [(name, ids[100:150], values[100:150, :dim], values[100:150, dim:])], initial=True
        )
        parts.append((name, ids))
    full = cache.lookup_many(parts)
    rows_only = cache.lookup_many(parts, rows_only=True)
    for (name, _), (hit, rows, _, initial), got in zip(parts, full, rows_only, strict=True):
        got_hit, got_rows, got_slots, got_initial = got
        dim = widths[name][0]
        assert hit[:150].all() and not hit[150:].any() and initial[120:150].all()
        np.testing.assert_array_equal(got_hit, hit)
        np.testing.assert_array_equal(got_initial, initial)
        assert got_rows.shape == (200, dim) and got_slots.shape == (200, 0)
        np.testing.assert_array_equal(got_rows[hit], rows[hit])
