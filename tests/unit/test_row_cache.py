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

from lookup_table.core.hashing import mix64
from lookup_table.core.intmap import IntMap
from lookup_table.core.rowcache import RowCache, _TableCache

pytestmark = pytest.mark.unit

# table -> (dim, slot width): a and b share a value width (3), so one map; c is 2 + 2
WIDTH = {"a": (3, 0), "b": (3, 0), "c": (2, 2)}


def _cache(max_bytes: int) -> RowCache:
    return RowCache(WIDTH, max_bytes)


def _positions(ids: np.ndarray, tabs: np.ndarray, mask: int) -> np.ndarray:
    """Where a key's probes start, as `lookup_table.core.probing` documents it: mix64 of
    the id xor the table number times the salt, masked (numpy, not the compiled code)."""
    with np.errstate(over="ignore"):
        salt = tabs.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (mix64(ids.view(np.uint64) ^ salt) & np.uint64(mask)).astype(np.intp)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 40), st.integers(0, 2)),
        unique=True,
        max_size=150,
    ),
    st.integers(0, 6),
)
def test_probing_against_a_dict_in_a_crowded_map(keys: list[tuple[int, int]], start: int) -> None:
    """The compiled probes in a map of 64 slots: up to 150 keys, so chains run long and
    some inserts find no free slot within the probes. Every key placed is found at its
    slot with its value and stamp; every key not placed, and every key never inserted,
    is absent."""
    m = IntMap(64, 2)
    ids = np.array([k for k, _ in keys], dtype=np.int64)
    tabs = np.array([t for _, t in keys], dtype=np.int32)
    values = np.arange(2 * len(keys), dtype=np.float32).reshape(-1, 2)
    stamps = np.arange(len(keys), dtype=np.int64) + 1
    placed = np.zeros(len(keys), dtype=bool)
    for lo in range(0, len(keys), 7 + start):  # in a few batches, as the cache puts them
        hi = min(lo + 7 + start, len(keys))
        placed[lo:hi] = m.insert(ids[lo:hi], tabs[lo:hi], values[lo:hi], stamps[lo:hi])
    assert m.size == int(placed.sum()) <= 64
    pos = m.find(ids, tabs)
    assert ((pos >= 0) == placed).all()
    assert len(set(pos[placed].tolist())) == int(placed.sum())  # one slot per key
    assert (m.values[pos[placed]] == values[placed]).all()
    assert (m.stamps[pos[placed]] == stamps[placed]).all()
    got, hit, got_values, got_stamps = m.lookup(ids, tabs)
    assert (got == pos).all() and (hit == placed).all()
    assert (got_values[hit] == values[placed]).all() and (got_stamps[hit] == stamps[placed]).all()
    # the same ids in a table none of them is in, and ids nobody inserted
    assert (m.find(ids, np.full(len(keys), 3, np.int32)) == -1).all()
    if not placed.all():  # 64 probes cover the whole map: only a full one refuses a key
        assert m.size == 64


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


def test_known_many_is_get_many_of_the_wanted_ids() -> None:
    """`known_many` answers, per (table, ids), which of the wanted ids the cache holds
    and their rows (no slots), as `get_many` of those ids does; None where none is held,
    the table is not cached, or no id is wanted."""
    rng = np.random.default_rng(5)
    cache = RowCache({"a": (3, 0), "b": (3, 0), "c": (2, 0), "d": (3, 0)}, 1 << 22)
    held = {t: rng.permutation(2000)[:600].astype(np.int64) for t in "abc"}
    cache.put_many(
        [
            (
                t,
                i,
                rng.normal(size=(600, cache._where[t][2])).astype(np.float32),
                np.zeros((600, 0)),
            )
            for t, i in held.items()
        ]
    )
    asks = [("a", np.arange(0, 900)), ("c", np.arange(300)), ("b", np.arange(2000, 2100))]
    asks += [("z", np.arange(50)), ("a", np.arange(900, 2000)), ("b", np.arange(1000))]
    wanted = [rng.random(n.shape[0]) < 0.7 for _, n in asks]
    wanted[1] = None  # every id
    wanted[5] = np.zeros(1000, bool)  # none
    got = cache.known_many([(t, i) for t, i in asks], wanted)
    for (table, ids), want, known in zip(asks, wanted, got, strict=True):
        if not cache.caches(table) or (want is not None and not want.any()):
            assert known is None
            continue
        ((hit, rows, _),) = cache.get_many([(table, ids)])
        hit = hit & (True if want is None else want)
        if not hit.any():
            assert known is None
            continue
        assert known is not None
        np.testing.assert_array_equal(known[0], hit)
        assert known[1].dtype == np.float32 and known[1].tobytes() == rows[hit].tobytes()


def test_a_block_of_several_tables_is_put_as_put_many_puts_them() -> None:
    """`put_block` (one answer's block of tables, one after the other) remembers what
    `put_many` of each table's part does; not at all where a table is not cached or
    has another width."""
    rng = np.random.default_rng(3)
    ids = rng.permutation(1000)[:300].astype(np.int64)
    rows = rng.normal(size=(300, 3)).astype(np.float32)
    bounds = np.array([0, 100, 180, 300])
    names = ("a", "b", "a")  # a table in two parts (of other ids)
    block, many = _cache(1 << 22), _cache(1 << 22)
    assert block.put_block(names, bounds, ids, rows)
    many.put_many(
        [
            (n, ids[lo:hi], rows[lo:hi], rows[lo:hi, :0])
            for n, lo, hi in zip(names, bounds, bounds[1:], strict=False)
        ]
    )
    asks = [("a", np.arange(1000)), ("b", np.arange(1000))]
    for (h1, r1, _), (h2, r2, _) in zip(block.get_many(asks), many.get_many(asks), strict=True):
        np.testing.assert_array_equal(h1, h2)
        assert h1.any() and r1[h1].tobytes() == r2[h2].tobytes()
    assert not block.put_block(("a", "c"), np.array([0, 1, 2]), ids[:2], rows[:2])  # c: 2+2
    assert not block.put_block(("a", "z"), np.array([0, 1, 2]), ids[:2], rows[:2])


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
    assert cache.nbytes() == 2 * (1 << 14) * (4 * 4 + 24)  # both generations at the bound
    hit, _ = cache.get(ids, _tabs(ids.size))
    assert not hit.any()


def test_the_cache_takes_its_bound_once_and_rotations_allocate_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The young map starts small; once it is half full the cache allocates both
    generations at the bound, once: no later rotation allocates (and touches) a map."""
    made: list[int] = []
    real_init = IntMap.__init__

    def counted(self: IntMap, capacity: int, width: int) -> None:
        made.append(capacity)
        real_init(self, capacity, width)

    monkeypatch.setattr(IntMap, "__init__", counted)
    bound = 1 << 14
    cache = _TableCache(width=2, max_capacity=bound)
    assert made == [bound // 16] and cache.nbytes() == (bound // 16) * (2 * 4 + 24)
    tabs = np.zeros(500, dtype=np.int32)
    cache.put(np.arange(500, dtype=np.int64), tabs, np.ones((500, 2), np.float32))
    assert made == [bound // 16]  # 500 of 1,024 slots: no growth yet
    for k in range(1, 60):  # 30,000 ids: many rotations of 8,192-entry generations
        ids = np.arange(k * 500, (k + 1) * 500, dtype=np.int64)
        cache.put(ids, tabs, np.full((500, 2), k, np.float32))
        assert cache.nbytes() == 2 * bound * (2 * 4 + 24), k  # both generations held
    assert made == [bound // 16, bound, bound]  # grown once, the second map with it
    hit, got = cache.get(np.arange(59 * 500, 60 * 500, dtype=np.int64), tabs)
    assert hit.all() and (got == 59).all()


def test_a_batch_that_collides_on_one_slot_is_placed_and_found() -> None:
    m = IntMap(1024, 1)
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
    m = IntMap(1024, 1)
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


dirty_ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "dirty", "get", "forget", "flush", "written"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 20_000), max_size=300),
    ),
    max_size=60,
)


@given(dirty_ops)
@settings(max_examples=150, deadline=None)
def test_dirty_rows_survive_every_rotation_until_a_flush_marks_them_written(program) -> None:
    """Write-behind's contract: a dirty row is never forgotten by the cache itself
    (rotations move it along), `dirty()` gives exactly the rows put dirty and not
    written since, with their last values, and `clean(stamp)` marks written only what
    was put up to that snapshot (a later put stays dirty). `unwritten()` counts them
    (the replica's /metrics) at every step."""
    cache = _cache(250_000)  # small: the clean puts force growth and rotations
    assert all(cache.caches(t) for t in WIDTH)  # each width's maps at the smallest bound
    last: dict[tuple[str, int], np.ndarray] = {}
    dirty: dict[tuple[str, int], int] = {}  # key -> how many dirty puts made it dirty
    puts = 0
    snapshot: tuple[dict[tuple[str, int], int], int] | None = None
    counter = 0
    for op, table, raw in program:
        ids = np.unique(np.array(raw, dtype=np.int64))
        dim, slots = WIDTH[table]
        if op in ("put", "dirty"):
            if op == "dirty" and not cache.room_for([(table, ids.size)]):
                continue  # the updater flushes first
            values = np.arange(counter, counter + (dim + slots) * ids.size, dtype=np.float32)
            values = values.reshape(-1, dim + slots)
            counter += values.size
            cache.put_many([(table, ids, values[:, :dim], values[:, dim:])], dirty=op == "dirty")
            if op == "dirty":
                puts += 1
            for i, v in zip(ids.tolist(), values, strict=True):
                last[(table, i)] = v
                if op == "dirty":
                    dirty[(table, i)] = puts
                else:
                    dirty.pop((table, i), None)
        elif op == "forget":  # the caller wrote what supersedes them
            cache.forget([(table, ids)])
            for i in ids.tolist():
                last.pop((table, i), None)
                dirty.pop((table, i), None)
        elif op == "get":
            ((hit, rows, slot_values),) = cache.get_many([(table, ids)])
            for i, h, r, s in zip(ids.tolist(), hit, rows, slot_values, strict=True):
                if (table, i) in dirty:
                    assert h, "a dirty row was forgotten"
                if h:
                    np.testing.assert_array_equal(np.concatenate([r, s]), last[(table, i)])
        elif op == "flush":
            if snapshot is not None:  # the copy before was not written (a failed flush)
                cache.undo_dirty()
            got, stamp = cache.dirty()
            seen = {}
            for name, got_ids, rows, slot_values in got:
                for i, r, s in zip(got_ids.tolist(), rows, slot_values, strict=True):
                    assert (name, i) not in seen
                    seen[(name, i)] = np.concatenate([r, s])
            assert set(seen) == set(dirty)
            for key, value in seen.items():
                np.testing.assert_array_equal(value, last[key])
            assert stamp == puts
            snapshot = (dict(dirty), stamp)
        elif snapshot is not None:  # "written": the snapshot's rows are stored now
            taken, stamp = snapshot
            cache.clean(stamp)
            for key, made in list(dirty.items()):
                if key in taken and made == taken[key]:
                    del dirty[key]
            snapshot = None
        assert cache.unwritten() == len(dirty), op
    got, _ = cache.dirty()
    assert {(n, i) for n, ids, _, _ in got for i in ids.tolist()} == set(dirty)


def test_a_dirty_row_outlives_rotations_that_drop_every_clean_row_around_it() -> None:
    cache = _TableCache(width=2, max_capacity=1024)
    tabs = np.zeros(10, dtype=np.int32)
    dirty_ids = np.arange(10, dtype=np.int64)
    cache.put(dirty_ids, tabs, np.full((10, 2), 5, np.float32), 1)
    for start in range(1000, 9000, 400):  # 20 batches of 400 new ids: many rotations
        ids = np.arange(start, start + 400, dtype=np.int64)
        cache.put(ids, np.zeros(400, np.int32), np.zeros((400, 2), np.float32))
    hit, values = cache.get(dirty_ids, tabs)
    assert hit.all() and (values == 5).all()
    assert not cache.get(np.arange(1000, 1010, dtype=np.int64), tabs)[0].any()  # clean: gone
    assert cache.unwritten() == 10  # each once, though the get moved them to the young map
    ids, _, got = cache.dirty()
    assert sorted(ids.tolist()) == list(range(10)) and (got == 5).all()
    cache.clean(1)
    assert cache.dirty()[0].size == 0 and cache.unwritten() == 0


def test_initial_entries_are_told_apart_never_flushed_and_never_replace_a_held_key() -> None:
    """An initial entry (an id memcached holds no row for, with its initial values) is a
    hit that `lookup_many` marks initial; it is clean (never in `dirty()`); any later put
    replaces it; and it only goes where neither generation holds the key, valid or
    forgotten: a value put since the caller read memcached is newer."""
    cache = _cache(1 << 22)
    ids = np.arange(10, dtype=np.int64)
    rows, slots = np.ones((10, 3), np.float32), np.zeros((10, 0), np.float32)
    cache.put_many([("a", ids[:4], rows[:4] * 7, slots[:4])], dirty=True)  # pushed since
    cache.put_many([("a", ids[4:6], rows[4:6] * 8, slots[4:6])])  # written since
    cache.forget([("a", ids[6:7])])  # nothing there: forgetting leaves no key
    cache.put_many([("a", ids[7:8], rows[7:8] * 9, slots[7:8])])
    cache.forget([("a", ids[7:8])])  # a key whose value is unknown: left alone
    cache.put_many([("a", ids, rows, slots)], initial=True)
    ((hit, got, _, initial),) = cache.lookup_many([("a", ids)])
    assert hit.tolist() == [True] * 7 + [False] + [True] * 2
    assert initial.tolist() == [False] * 6 + [True] + [False] + [True] * 2
    assert (got[:4] == 7).all() and (got[4:6] == 8).all() and (got[[6, 8, 9]] == 1).all()
    dirty, _ = cache.dirty()
    assert [(t, sorted(i.tolist())) for t, i, _, _ in dirty] == [("a", [0, 1, 2, 3])]
    cache.put_many([("a", ids[8:9], rows[8:9] * 5, slots[8:9])], dirty=True)  # its push
    cache.put_many([("a", ids[9:], rows[9:] * 6, slots[9:])])  # written through
    ((hit, got, _, initial),) = cache.lookup_many([("a", ids[8:])])
    assert hit.all() and not initial.any() and (got[:, 0] == [5, 6]).all()
    ((hit, _, _),) = cache.get_many([("a", ids[6:7])])  # get_many: a hit like any other
    assert hit.all()
    with pytest.raises(ValueError, match="exclude each other"):
        cache.put_many([("a", ids, rows, slots)], dirty=True, initial=True)


def test_initial_entries_move_with_rotations_and_are_dropped_like_clean_ones() -> None:
    cache = _TableCache(width=1, max_capacity=1024)
    first = np.arange(300, dtype=np.int64)
    cache.put(first, _tabs(300), np.ones((300, 1), np.float32), -1)
    cache.put(np.arange(1000, 1300, dtype=np.int64), _tabs(300), np.zeros((300, 1), np.float32))
    assert cache.old is not None
    hit, _, stamps = cache.lookup(first[:5], _tabs(5))  # from the old generation, moved
    assert hit.all() and (stamps == -1).all()
    hit, _, stamps = cache.lookup(first[:5], _tabs(5))
    assert hit.all() and (stamps == -1).all()
    for k in range(2, 6):  # generations later: gone (clean), never written anywhere
        more = np.arange(k * 1000, k * 1000 + 400, dtype=np.int64)
        cache.put(more, _tabs(400), np.zeros((400, 1), np.float32))
    assert not cache.lookup(first, _tabs(300))[0].any()
    assert cache.dirty()[0].size == 0


def test_a_dirty_entry_moved_up_as_its_generation_is_dropped_keeps_one_slot() -> None:
    """A lookup that moves dirty entries of the old generation up to the young one, when
    that young one is full, starts a new generation; the rotation carries the dropped
    generation's dirty entries along, and those moved up must not get a second slot
    (a stale twin would be flushed after the newer value)."""
    cache = _TableCache(width=1, max_capacity=1024)
    dirty = np.arange(100, dtype=np.int64)
    cache.put(dirty, _tabs(100), np.full((100, 1), 1, np.float32), 1)
    cache.put(np.arange(1000, 1400, dtype=np.int64), _tabs(400), np.zeros((400, 1), np.float32))
    cache.put(np.arange(2000, 2450, dtype=np.int64), _tabs(450), np.zeros((450, 1), np.float32))
    assert cache.old is not None and (cache.old.find(dirty, _tabs(100)) >= 0).all()
    hit, _ = cache.get(dirty, _tabs(100))  # moved up: the young map is full, so it rotates
    assert hit.all()
    cache.put(dirty, _tabs(100), np.full((100, 1), 2, np.float32), 2)  # a newer value
    ids, _, values = cache.dirty()
    assert sorted(ids.tolist()) == dirty.tolist()  # each dirty key once
    assert (values == 2).all()
    assert cache.young.size == 100


def test_dirty_entries_of_both_generations_come_by_table_each_with_its_value() -> None:
    """`dirty()` orders the dirty entries of both maps by table number (a flush splits
    them by table without sorting their values again), each key once, with its own
    value gathered from the map that holds it."""
    cache = _TableCache(width=2, max_capacity=1024)
    old_ids = np.arange(300, dtype=np.int64)
    old_tabs = (old_ids % 3).astype(np.int32)
    cache.put(old_ids, old_tabs, np.stack([old_ids, old_tabs], 1).astype(np.float32), 1)
    cache.put(np.arange(1000, 1300, dtype=np.int64), _tabs(300), np.zeros((300, 2), np.float32))
    assert cache.old is not None and (cache.old.find(old_ids, old_tabs) >= 0).all()
    young_ids = np.arange(5000, 5100, dtype=np.int64)
    young_tabs = (young_ids % 4).astype(np.int32)
    cache.put(young_ids, young_tabs, np.stack([young_ids, young_tabs], 1).astype(np.float32), 2)
    newer = old_ids[:50]  # written again since: the young map's value counts
    cache.put(newer, old_tabs[:50], np.full((50, 2), -1, np.float32), 3)
    ids, tabs, values = cache.dirty()
    assert (np.diff(tabs) >= 0).all()
    expected = {(int(i), int(t)) for i, t in zip(old_ids, old_tabs, strict=True)}
    expected |= {(int(i), int(t)) for i, t in zip(young_ids, young_tabs, strict=True)}
    assert sorted(zip(ids.tolist(), tabs.tolist(), strict=True)) == sorted(expected)
    again = np.isin(ids, newer)
    assert (values[again] == -1).all()
    assert (values[~again, 0] == ids[~again]).all() and (values[~again, 1] == tabs[~again]).all()


def test_the_compiled_probes_get_shapes_checked_first() -> None:
    """The compiled loops do not check bounds: a table number missing for an id, or
    values of another width, is a ValueError before any of them runs."""
    m = IntMap(1024, 3)
    ids = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="table numbers"):
        m.find(ids, _tabs(3))
    with pytest.raises(ValueError, match="table numbers"):
        m.lookup(ids, _tabs(5))
    with pytest.raises(ValueError, match="width 3"):
        m.insert(ids, _tabs(4), np.zeros((4, 2), np.float32))
    # the compiled gathers and scatters: slots within the map, values of its width
    with pytest.raises(ValueError, match="outside a map of 1024"):
        m.values_at(np.array([0, 1024], dtype=np.intp))
    with pytest.raises(ValueError, match="outside a map of 1024"):
        m.set(np.array([-1], dtype=np.intp), np.zeros((1, 3), np.float32), 0)
    with pytest.raises(ValueError, match="width 3"):
        m.set(np.array([5], dtype=np.intp), np.zeros((1, 4), np.float32), 0)
    with pytest.raises(ValueError, match="table numbers"):
        m.insert(ids, _tabs(2), np.zeros((4, 3), np.float32))
    assert m.size == 0 and not (m.meta[:, 1] != 0).any()  # nothing was written


def test_located_keys_are_hits_at_their_young_slots_with_initial_ones_told_apart() -> None:
    """`locate_many` gives each id its young-map slot where the cache holds its value
    (-1 where not: never put, or forgotten), moves keys only the old generation holds up
    first (as a lookup does), and marks initial entries; the tables of one width share
    one `Spots`."""
    cache = _cache(1 << 22)
    ids = np.arange(8, dtype=np.int64)
    rows, none = np.arange(24, dtype=np.float32).reshape(8, 3), np.zeros((8, 0), np.float32)
    cache.put_many([("a", ids[:4], rows[:4], none[:4])], dirty=True)
    cache.put_many([("a", ids[4:6], rows[4:6], none[4:6])], initial=True)
    cache.put_many([("b", ids[:2], rows[:2] + 100, none[:2])])
    cache.forget([("a", ids[3:4])])
    got_a, got_b = cache.locate_many([("a", ids), ("b", ids)])
    assert got_a.spots is got_b.spots
    assert got_a.hit.tolist() == [True] * 3 + [False] + [True] * 2 + [False] * 2
    assert got_a.initial.tolist() == [False] * 4 + [True] * 2 + [False] * 2
    assert (got_a.at[~got_a.hit] == -1).all() and (got_b.at[2:] == -1).all()
    values = cache.values_of(got_a.spots)
    assert values is not None
    assert (values[got_a.at[got_a.hit]] == rows[got_a.hit]).all()
    assert (values[got_b.at[:2]] == rows[:2] + 100).all()

    table = _TableCache(width=1, max_capacity=1024)
    old = np.arange(300, dtype=np.int64)
    table.put(old, _tabs(300), np.arange(300, dtype=np.float32)[:, None], 3)
    table.put(np.arange(1000, 1300, dtype=np.int64), _tabs(300), np.zeros((300, 1), np.float32))
    assert table.old is not None and (table.young.find(old, _tabs(300)) < 0).all()
    at, hit, initial = table.locate(old[:50], _tabs(50))
    assert hit.all() and not initial.any()
    assert (table.young.values[at, 0] == np.arange(50)).all()  # moved up, dirty as it was
    assert (table.young.stamps[at] == 3).all()


def test_keys_made_dirty_again_take_no_more_of_the_flush_budget() -> None:
    """`room_for` bounds the entries made dirty since the last `dirty()` by a quarter of
    a map's slots. A push puts back its ids where it located them (`put_items`): the ids
    dirty since the last flush already (a popular id, in push after push) take no new
    room; ids put dirty for the first time since then do, and so do all of them again
    once a flush took them (written or not: an unwritten copy gives its count back)."""
    cache = RowCache({"a": (1, 1)}, 100_000)  # maps of 1024 slots at most: a budget of 256
    budget = 1024 // 4

    def push(ids: np.ndarray) -> None:
        (located,) = cache.locate_many([("a", ids)])
        items = np.ones((ids.shape[0], 2), dtype=np.float32)
        cache.put_items(located.spots, located.at, [("a", ids)], items, dirty=True)

    popular = np.arange(200, dtype=np.int64)
    cache.put_many([("a", popular, np.zeros((200, 1), np.float32), np.zeros((200, 1), np.float32))])
    for _ in range(10):  # 2,000 puts of 200 keys: room left for 56 more
        push(popular)
    assert cache.room_for([("a", budget - 200)]) and not cache.room_for([("a", budget - 199)])
    push(np.arange(1000, 1050, dtype=np.int64))  # new keys, by key: they count
    assert cache.room_for([("a", budget - 250)]) and not cache.room_for([("a", budget - 249)])
    taken, stamp = cache.dirty()
    assert sum(ids.shape[0] for _, ids, _, _ in taken) == 250
    assert cache.room_for([("a", budget)])
    push(popular)  # dirty again after the copy was taken: they count in the new window
    assert not cache.room_for([("a", budget - 199)])
    cache.undo_dirty()  # the copy was not written: its 250 count again
    assert cache.room_for([("a", budget - 450)]) and not cache.room_for([("a", budget - 449)])
    taken, stamp = cache.dirty()
    cache.clean(stamp)
    push(popular)
    assert not cache.room_for([("a", budget - 199)]) and cache.room_for([("a", budget - 200)])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 700), min_size=0, max_size=6),
    st.booleans(),
    st.integers(0, 2),
)
def test_items_put_back_where_located_land_on_their_keys_whatever_happened_between(
    between: list[int], dirty: bool, forget_all: int
) -> None:
    """A push locates its ids, reads their items in place and puts new ones back with
    `put_items`. Meanwhile other pushes put other ids (new generations: the map located
    in may be the old one, or dropped and reused) or the whole cache is forgotten (a
    node's sentinel changed). While `values_of` gives the map, the located slots still
    hold the ids' values; once it gives None they are reused. Either way the new items
    end up on their own keys, found by the next lookup, and dirty ones are flushed."""
    cache = RowCache({"a": (1, 1), "b": (1, 1)}, 100_000)  # maps of 1024 slots at most
    ids = np.arange(60, dtype=np.int64)
    first = np.stack([ids, ids + 0.5], axis=1).astype(np.float32)
    cache.put_many([("a", ids[:40], first[:40, :1], first[:40, 1:])])
    cache.put_many([("b", ids[40:], first[40:, :1], first[40:, 1:])], dirty=True)
    parts = [("a", ids[:50]), ("b", ids[40:])]
    la, lb = cache.locate_many(parts)
    at = np.concatenate([la.at, lb.at])
    start = 10_000
    for k, count in enumerate(between):  # other pushes' rows
        other = np.arange(start, start + count, dtype=np.int64)
        start += count
        cache.put_many(
            [("a", other, np.zeros((count, 1), np.float32), np.zeros((count, 1), np.float32))]
        )
        if forget_all == 1 and k == 0:
            cache.forget()
    if forget_all == 2:
        cache.forget()
    values = cache.values_of(la.spots)
    want = np.concatenate([first[:50], first[40:]])
    held = at >= 0
    if values is not None:
        assert (values[at[held]] == want[held]).all()
    new = -np.arange(at.shape[0] * 2, dtype=np.float32).reshape(-1, 2) - 1
    cache.put_items(la.spots, at, parts, new, dirty=dirty)
    (ha, ra, sa, _), (hb, rb, sb, _) = cache.lookup_many(parts)
    assert ha.all() and hb.all()
    assert (np.concatenate([ra, rb]) == new[:, :1]).all()
    assert (np.concatenate([sa, sb]) == new[:, 1:]).all()
    flushed, _ = cache.dirty()
    keys = {(t, i) for t, got, _, _ in flushed for i in got.tolist()}
    if dirty:
        assert keys >= {("a", i) for i in range(50)} | {("b", i) for i in range(40, 60)}
    else:
        assert not keys & {("a", i) for i in range(50)}
