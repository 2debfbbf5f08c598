"""The row cache's one-probe puts (`IntMap.upsert`, lookup_table/core/intmap.py) against
the two-pass composition they replace: find, set the held keys, insert the others.

Two caches run the same sequence of puts, initial puts, forgets, flushes, look-ups and
rotations (in maps small enough to fill, with keys that start at a few adjacent slots,
so probe sequences run out); after every step both hold the same keys in the same
slots with the same values, stamps, sizes and dirty entries.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_table.core import probing
from lookup_table.core.hashing import mix64
from lookup_table.core.intmap import IntMap
from lookup_table.core.rowcache import INITIAL, _TableCache

pytestmark = pytest.mark.unit

WIDTH = 3
MASK = 1023  # the young map of a cache of max_capacity 1024 (or before it grows)


def _positions(ids: np.ndarray, tabs: np.ndarray, mask: int) -> np.ndarray:
    """Where a key's probes start, as `probing` documents it (numpy, not compiled)."""
    with np.errstate(over="ignore"):
        salt = tabs.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (mix64(ids.view(np.uint64) ^ salt) & np.uint64(mask)).astype(np.intp)


def _colliding(n: int) -> np.ndarray:
    """`n` ids of table 0 whose probes start at slots 5..8 of a map of 1024 slots."""
    pool = np.random.default_rng(11).integers(0, 2**62, size=400_000, dtype=np.int64)
    at = _positions(pool, np.zeros(pool.size, np.int32), MASK)
    same = pool[(at >= 5) & (at <= 8)][:n]
    assert same.size == n
    return same


COLLIDING = _colliding(150)


def _two_pass_put(cache: _TableCache, ids: Any, tabs: Any, values: Any, stamp: int) -> None:
    """`_TableCache.put` as two passes: find and set the held keys, insert the rest."""
    each = np.full(ids.shape[0], stamp, dtype=np.int64)
    ids, tabs, values, each = cache._set_held(ids, tabs, values, each)
    if ids.shape[0]:
        cache._insert_new(ids, tabs, values, each)


def _two_pass_put_absent(cache: _TableCache, ids: Any, tabs: Any, values: Any, stamp: int) -> None:
    """`_TableCache.put_absent` as a find in each generation, then an insert."""
    absent = cache.young.find(ids, tabs) < 0
    if cache.old is not None and absent.any():
        at = np.flatnonzero(absent)
        absent[at[cache.old.find(ids[at], tabs[at]) >= 0]] = False
    if absent.any():
        each = np.full(int(absent.sum()), stamp, dtype=np.int64)
        cache._insert_new(ids[absent], tabs[absent], values[absent], each)


def _assert_same_maps(new: _TableCache, old: _TableCache) -> None:
    """Every map of both caches bit for bit: keys and flags, values, stamps, size and
    epoch; the slots recorded as dirty; then what `dirty()` and `unwritten()` give."""
    for which in ("young", "old", "_spare"):
        a, b = getattr(new, which), getattr(old, which)
        assert (a is None) == (b is None), which
        if a is None:
            continue
        assert (a.capacity, a.size, a.epoch) == (b.capacity, b.size, b.epoch), which
        np.testing.assert_array_equal(a.meta, b.meta, err_msg=which)
        assert a.values.tobytes() == b.values.tobytes(), which
        np.testing.assert_array_equal(a.stamps, b.stamps, err_msg=which)
        # the record's order within a put, and when it is compacted, may differ: what
        # it must hold is every dirty slot
        for m in (a, b):
            dirty = np.flatnonzero((m.stamps > 0) & ((m.meta[:, 1] & probing.VALID) != 0))
            assert np.isin(dirty, m.record[: m.logged]).all(), which
        np.testing.assert_array_equal(a.dirty_slots(), b.dirty_slots(), err_msg=which)
    got: tuple[np.ndarray, ...] = new.dirty()
    want: tuple[np.ndarray, ...] = old.dirty()
    assert [a.tobytes() for a in got] == [b.tobytes() for b in want]
    assert new.unwritten() == old.unwritten()


# a batch: ids start..start+n of one table, then colliding ids first..last (table 0),
# in an order drawn by a seed
batches = st.tuples(
    st.integers(0, 1500),
    st.integers(0, 450),
    st.integers(0, 2),
    st.integers(0, COLLIDING.size),
    st.integers(0, COLLIDING.size),
    st.integers(0, 2**32 - 1),
)
ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "dirty", "initial", "forget", "clean", "get", "rotate"]),
        batches,
    ),
    max_size=40,
)


def _batch(
    start: int, n: int, tab: int, first: int, last: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([np.arange(start, start + n), COLLIDING[first:last]]).astype(np.int64)
    tabs = np.concatenate([np.full(n, tab), np.zeros(ids.size - n)]).astype(np.int32)
    order = np.random.default_rng(seed).permutation(ids.size)
    return ids[order], tabs[order]


@given(ops, st.sampled_from([1024, 4096]))
@settings(max_examples=200, deadline=None)
def test_one_probe_puts_leave_the_maps_the_two_pass_puts_leave(
    program: list[tuple[str, tuple[int, int, int, int, int, int]]], bound: int
) -> None:
    """Clean and dirty puts of keys held (valid, forgotten, dirty, initial, only in the
    old generation) and new, initial puts, forgets, flushes written, look-ups (which
    move keys up from the old generation) and rotations, also with batches that fill
    the map (the two-pass path) and keys on one long probe chain (probes run out: a
    fresh generation for the rest)."""
    new, old = _TableCache(WIDTH, bound), _TableCache(WIDTH, bound)
    stamp = 0
    counter = 0
    for op, batch in program:
        ids, tabs = _batch(*batch)
        values = np.arange(counter, counter + ids.size * WIDTH, dtype=np.float32).reshape(-1, WIDTH)
        counter += values.size
        if op in ("put", "dirty"):
            stamp += op == "dirty"
            put = stamp if op == "dirty" else 0
            new.put(ids, tabs, values, put)
            _two_pass_put(old, ids, tabs, values, put)
        elif op == "initial":
            new.put_absent(ids, tabs, values, INITIAL)
            _two_pass_put_absent(old, ids, tabs, values, INITIAL)
        elif op == "forget":
            new.drop(ids, tabs)
            old.drop(ids, tabs)
        elif op == "clean":
            new.clean(stamp)
            old.clean(stamp)
        elif op == "get":
            got: tuple[np.ndarray, ...] = new.lookup(ids, tabs)
            want: tuple[np.ndarray, ...] = old.lookup(ids, tabs)
            assert [a.tobytes() for a in got] == [b.tobytes() for b in want]
        else:
            new._rotate()
            old._rotate()
        _assert_same_maps(new, old)


def test_a_put_whose_probes_run_out_puts_the_rest_in_a_fresh_generation() -> None:
    """70 keys starting at 4 adjacent slots fill more than the 64 slots a probe sequence
    covers: the put takes the one-probe path (the load allows every key), and the keys
    left over go to a new generation, as the two-pass put does; none is lost."""
    new, old = _TableCache(1, 1024), _TableCache(1, 1024)
    ids, tabs = COLLIDING[:70], np.zeros(70, np.int32)
    values = np.arange(70, dtype=np.float32).reshape(-1, 1)
    placed, _ = IntMap(1024, 1).upsert(ids, tabs, values)
    assert 0 < int(placed.sum()) < 70  # some ran out
    new.put(ids, tabs, values, 1)
    _two_pass_put(old, ids, tabs, values, 1)
    assert new.old is not None
    _assert_same_maps(new, old)
    dirty_ids, _, got = new.dirty()
    order = np.argsort(dirty_ids)
    np.testing.assert_array_equal(dirty_ids[order], np.sort(ids))
    np.testing.assert_array_equal(got[order, 0], values[np.argsort(ids), 0])


def test_upsert_sets_held_keys_as_set_does_and_inserts_the_others_as_insert_does() -> None:
    """On one map: the same slots, values, stamps, size, record (in order, where no
    compaction intervenes) and count of slots dirty since a stamp."""
    rng = np.random.default_rng(4)
    a, b = IntMap(4096, 2), IntMap(4096, 2)
    first = rng.permutation(5000)[:1000].astype(np.int64)
    zeros = np.zeros(1000, np.int32)
    for m in (a, b):
        m.insert(first, zeros, np.ones((1000, 2), np.float32), np.arange(1000) % 3)
    ids = np.concatenate([first[::2], rng.permutation(np.arange(5000, 9000))[:600]])
    ids = rng.permutation(ids).astype(np.int64)
    tabs = np.zeros(ids.size, np.int32)
    values = rng.normal(size=(ids.size, 2)).astype(np.float32)
    each = rng.integers(0, 4, size=ids.size).astype(np.int64)

    placed, again = a.upsert(ids, tabs, values, each, since=1)
    pos = b.find(ids, tabs)
    held = pos >= 0
    want_again = b.set(pos[held], values[held], each[held], since=1)
    b.insert(ids[~held], tabs[~held], values[~held], each[~held])

    assert placed.all() and again == want_again > 0
    assert a.size == b.size == 1000 + 600
    for x, y in ((a.meta, b.meta), (a.values, b.values), (a.stamps, b.stamps)):
        assert x.tobytes() == y.tobytes()
    assert sorted(a.record[: a.logged].tolist()) == sorted(b.record[: b.logged].tolist())


def test_upsert_keeping_puts_only_the_absent_keys() -> None:
    m = IntMap(1024, 1)
    m.insert(np.arange(10, dtype=np.int64), np.zeros(10, np.int32), np.ones((10, 1), np.float32))
    m.forget(m.find(np.arange(5, dtype=np.int64), np.zeros(5, np.int32)))
    ids = np.arange(20, dtype=np.int64)
    placed, again = m.upsert(
        ids, np.zeros(20, np.int32), np.full((20, 1), 7, np.float32), INITIAL, keep=True
    )
    assert placed.all() and again == 0 and m.size == 20
    _, hit, got, stamps = m.lookup(ids, np.zeros(20, np.int32))
    assert not hit[:5].any()  # forgotten: held, so kept as they are
    assert (got[5:10] == 1).all() and (stamps[5:10] == 0).all()
    assert (got[10:] == 7).all() and (stamps[10:] == INITIAL).all()


def test_a_key_given_twice_in_one_put_keeps_its_last_value_once() -> None:
    """`put` takes unique keys (every caller's are); a repeated one is still found once,
    with the last of its values, whether it was held or new."""
    cache = _TableCache(1, 1024)
    held = np.array([1, 2], dtype=np.int64)
    cache.put(held, np.zeros(2, np.int32), np.zeros((2, 1), np.float32))
    ids = np.array([1, 3, 1, 3, 2], dtype=np.int64)
    cache.put(ids, np.zeros(5, np.int32), np.arange(5, dtype=np.float32).reshape(-1, 1), 1)
    assert cache.young.size == 3
    hit, got = cache.get(np.array([1, 2, 3], dtype=np.int64), np.zeros(3, np.int32))
    assert hit.all() and got[:, 0].tolist() == [2, 4, 3]
    dirty_ids, _, _ = cache.dirty()
    assert sorted(dirty_ids.tolist()) == [1, 2, 3]  # each once: no stale twin


def test_upsert_refuses_keys_and_values_that_do_not_match_and_changes_nothing() -> None:
    m = IntMap(1024, 2)
    before = (m.meta.copy(), m.values.copy(), m.stamps.copy())
    ids = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match=r"values \(4, 3\) for 4 keys of width 2"):
        m.upsert(ids, np.zeros(4, np.int32), np.zeros((4, 3), np.float32), 1)
    with pytest.raises(ValueError, match=r"ids \(4,\) and table numbers \(3,\)"):
        m.upsert(ids, np.zeros(3, np.int32), np.zeros((4, 2), np.float32), 1)
    after: tuple[np.ndarray, ...] = (m.meta, m.values, m.stamps)
    assert [a.tobytes() for a in after] == [b.tobytes() for b in before]
    assert m.size == 0 and m.logged == 0
