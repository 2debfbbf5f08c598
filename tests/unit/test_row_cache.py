"""The row cache (lookup_table/core/rowcache.py) against a plain dict.

A cache may forget (that only costs a read), but whatever it returns must be the
last value put for that (table, id) and not forgotten since: checked over random
sequences of put / get / forget on three tables (two share a value width, so one
map, where the same id in two tables must stay two entries), with a budget small
enough to force growth and new generations.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_table.core.rowcache import RowCache, _IntMap, _positions, _TableCache

pytestmark = pytest.mark.unit

# table -> (dim, slot width): a and b share a value width (3), so one map; c is 2 + 2
WIDTH = {"a": (3, 0), "b": (3, 0), "c": (2, 2)}


def _cache(max_bytes: int) -> RowCache:
    return RowCache(WIDTH, max_bytes)


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "forget"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 1500), max_size=400),
    ),
    max_size=40,
)


@given(ops, st.sampled_from([300_000, 600_000]))
@settings(max_examples=120, deadline=None)
def test_the_cache_returns_only_the_last_value_put(program, max_bytes) -> None:
    cache = _cache(max_bytes)
    assert cache.caches("a") and cache.caches("c") and not cache.caches("s")  # not given
    model: dict[tuple[str, int], np.ndarray] = {}
    counter = 0
    for op, table, raw in program:
        ids = np.unique(np.array(raw, dtype=np.int64))
        dim, slots = WIDTH[table]
        if op == "put":
            values = np.arange(counter, counter + (dim + slots) * ids.size, dtype=np.float32)
            values = values.reshape(-1, dim + slots)
            counter += values.size
            cache.put_many([(table, ids, values[:, :dim], values[:, dim:])])
            model.update(((table, i), v) for i, v in zip(ids.tolist(), values, strict=True))
        elif op == "forget":
            cache.forget([(table, ids)])
            for i in ids.tolist():
                model.pop((table, i), None)
        else:
            ((hit, rows, slot_values),) = cache.get_many([(table, ids)])
            got = np.concatenate([rows, slot_values], axis=1)
            for i, h, v in zip(ids.tolist(), hit, got, strict=True):
                if h:
                    assert (table, i) in model and (model[table, i] == v).all(), (table, i)
        assert cache.nbytes() <= max_bytes


def test_one_batch_of_several_tables_finds_each_tables_own_rows() -> None:
    cache = _cache(1 << 22)
    ids = np.arange(100, dtype=np.int64)
    cache.put_many(
        [
            ("a", ids, np.full((100, 3), 1, np.float32), np.zeros((100, 0), np.float32)),
            ("b", ids, np.full((100, 3), 2, np.float32), np.zeros((100, 0), np.float32)),
            ("c", ids[:50], np.full((50, 2), 3, np.float32), np.full((50, 2), 4, np.float32)),
        ]
    )
    (ha, ra, _), (hb, rb, _), (hc, rc, sc) = cache.get_many([("a", ids), ("b", ids), ("c", ids)])
    assert ha.all() and hb.all() and (ra == 1).all() and (rb == 2).all()
    assert hc[:50].all() and not hc[50:].any()
    assert (rc[:50] == 3).all() and (sc[:50] == 4).all()
    cache.forget([("a", ids[:10])])
    (ha, _, _), (hb, _, _) = cache.get_many([("a", ids), ("b", ids)])
    assert not ha[:10].any() and ha[10:].all() and hb.all()  # b's rows are not a's
    cache.forget()
    assert not any(h.any() for h, _, _ in cache.get_many([("a", ids), ("c", ids)]))


def _tabs(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.int32)


def test_everything_put_is_found_while_it_fits_and_memory_stays_bounded() -> None:
    rng = np.random.default_rng(0)
    cache = _TableCache(width=4, max_capacity=1 << 14)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, size=6000, dtype=np.int64))
    values = rng.standard_normal((ids.size, 4)).astype(np.float32)
    for part in np.array_split(np.arange(ids.size), 6):
        cache.put(ids[part], _tabs(part.size), values[part])
    hit, got = cache.get(ids, _tabs(ids.size))
    assert hit.all() and (got == values).all()
    for _ in range(20):  # far more ids than fit: old generations are dropped
        more = np.unique(rng.integers(0, 2**62, size=4000, dtype=np.int64))
        cache.put(more, _tabs(more.size), np.zeros((more.size, 4), np.float32))
    assert cache.nbytes() <= 2 * (1 << 14) * (4 * 4 + 14)
    hit, _ = cache.get(ids, _tabs(ids.size))
    assert not hit.any()


def test_a_batch_that_collides_on_one_slot_is_placed_and_found() -> None:
    m = _IntMap(1024, 1)
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 2**62, size=200_000, dtype=np.int64)
    same = pool[_positions(pool, _tabs(pool.size), m.mask) == 7][:20]
    assert same.size == 20  # ids that start at the same slot: all but one probe on
    placed = m.insert(same, _tabs(20), np.arange(20, dtype=np.float32).reshape(-1, 1))
    assert placed.all()
    pos = m.find(same, _tabs(20))
    assert (m.values[pos, 0] == np.arange(20)).all()


def test_forgotten_ids_are_never_returned_from_either_generation_and_come_back_on_put() -> None:
    cache = _TableCache(width=1, max_capacity=1024)
    first = np.arange(500, dtype=np.int64)
    cache.put(first, _tabs(500), np.ones((500, 1), np.float32))
    cache.put(np.arange(1000, 1100, dtype=np.int64), _tabs(100), np.zeros((100, 1), np.float32))
    assert cache.old is not None  # 600 ids > half of 1024 slots: a new generation began
    hit, _ = cache.get(first[:10], _tabs(10))
    assert hit.all()  # from the old generation (and moved to the young one)
    cache.drop(first[:300], _tabs(300))
    hit, _ = cache.get(first[:300], _tabs(300))
    assert not hit.any()
    cache.put(first[:5], _tabs(5), np.full((5, 1), 7, np.float32))
    hit, values = cache.get(first[:5], _tabs(5))
    assert hit.all() and (values == 7).all()


def test_one_id_in_two_tables_is_two_keys_even_on_one_probe_chain() -> None:
    m = _IntMap(1024, 1)
    pool = np.random.default_rng(2).integers(0, 2**62, size=200_000, dtype=np.int64)
    ones = np.ones(pool.size, dtype=np.int32)
    same = pool[_positions(pool, _tabs(pool.size), m.mask) == _positions(pool, ones, m.mask)]
    x = same[:1]  # starts at the same slot in table 0 and table 1
    assert x.size == 1
    m.insert(x, _tabs(1), np.array([[5.0]], np.float32))
    assert m.find(x, np.ones(1, np.int32))[0] == -1
    m.insert(x, np.ones(1, np.int32), np.array([[6.0]], np.float32))
    assert m.values[m.find(x, _tabs(1))[0], 0] == 5.0
    assert m.values[m.find(x, np.ones(1, np.int32))[0], 0] == 6.0


def test_a_rotation_reuses_the_dropped_generations_memory_and_forgets_its_entries() -> None:
    """A new generation takes the memory of the one dropped (no allocation and page
    touching per rotation), and nothing of what that one held is found again."""
    cache = _TableCache(width=2, max_capacity=1024)
    tabs = np.zeros(400, dtype=np.int32)
    batches = [np.arange(k * 400, (k + 1) * 400, dtype=np.int64) for k in range(8)]
    maps = set()
    for k, ids in enumerate(batches):
        cache.put(ids, tabs, np.full((400, 2), k, dtype=np.float32))
        maps.add(id(cache.young))
    assert cache.young.capacity == 1024 and len(maps) <= 4  # grown once, then recycled
    for k, ids in enumerate(batches):
        hit, values = cache.get(ids, tabs)
        assert (values[hit] == k).all()  # whatever is found is the last value put
        if k < 6:
            assert not hit.any(), k  # dropped with their generation, not resurrected
        else:
            assert hit.all(), k  # the young and the old generation
