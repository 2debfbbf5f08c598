"""The replica's row cache (optimizer_service/cache.py) against a plain dict.

A cache may forget (that only costs a read), but whatever it returns must be the
last value put for that id and not forgotten since: checked over random sequences of
put / get / forget, with capacities small enough to force growth and generations.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer_service.cache import _IntMap, _TableCache

pytestmark = pytest.mark.unit

ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "forget"]),
        st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 1500), max_size=400),
    ),
    max_size=40,
)


@given(ops, st.sampled_from([1024, 2048, 8192]))
@settings(max_examples=150, deadline=None)
def test_the_cache_returns_only_the_last_value_put(program, max_capacity) -> None:
    cache = _TableCache(width=3, max_capacity=max_capacity)
    model: dict[int, np.ndarray] = {}
    counter = 0
    for op, raw in program:
        ids = np.unique(np.array(raw, dtype=np.int64))
        if op == "put":
            values = np.arange(counter, counter + 3 * ids.size, dtype=np.float32).reshape(-1, 3)
            counter += 3 * ids.size
            cache.put(ids, values)
            model.update(zip(ids.tolist(), values, strict=True))
        elif op == "forget":
            cache.drop(ids)
            for i in ids.tolist():
                model.pop(i, None)
        else:
            hit, values = cache.get(ids)
            for i, h, v in zip(ids.tolist(), hit, values, strict=True):
                if h:
                    assert i in model and (model[i] == v).all(), i
        assert cache.nbytes() <= 2 * max_capacity * (3 * 4 + 9)


def test_everything_put_is_found_while_it_fits_and_memory_stays_bounded() -> None:
    rng = np.random.default_rng(0)
    cache = _TableCache(width=4, max_capacity=1 << 14)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, size=6000, dtype=np.int64))
    values = rng.standard_normal((ids.size, 4)).astype(np.float32)
    for part in np.array_split(np.arange(ids.size), 6):
        cache.put(ids[part], values[part])
    hit, got = cache.get(ids)
    assert hit.all() and (got == values).all()
    for _ in range(20):  # far more ids than fit: old generations are dropped
        more = rng.integers(0, 2**62, size=4000, dtype=np.int64)
        cache.put(np.unique(more), np.zeros((np.unique(more).size, 4), np.float32))
    assert cache.nbytes() <= 2 * (1 << 14) * (4 * 4 + 9)
    hit, _ = cache.get(ids)
    assert not hit.any()


def test_a_batch_that_collides_on_one_slot_is_placed_and_found() -> None:
    m = _IntMap(1024, 1)
    # ids chosen to start at the same slot: every one but the first probes on
    from optimizer_service.cache import _positions

    rng = np.random.default_rng(1)
    pool = rng.integers(0, 2**62, size=200_000, dtype=np.int64)
    same = pool[_positions(pool, m.mask) == 7][:20]
    assert same.size == 20
    placed = m.insert(same, np.arange(20, dtype=np.float32).reshape(-1, 1))
    assert placed.all()
    pos = m.find(same)
    assert (m.values[pos, 0] == np.arange(20)).all()


def test_forgotten_ids_are_never_returned_from_either_generation_and_come_back_on_put() -> None:
    cache = _TableCache(width=1, max_capacity=1024)
    first = np.arange(500, dtype=np.int64)
    cache.put(first, np.ones((500, 1), np.float32))
    cache.put(np.arange(1000, 1100, dtype=np.int64), np.zeros((100, 1), np.float32))
    assert cache.old is not None  # 600 ids > half of 1024 slots: a new generation began
    hit, _ = cache.get(first[:10])
    assert hit.all()  # from the old generation (and moved to the young one)
    cache.drop(first[:300])
    hit, _ = cache.get(first[:300])
    assert not hit.any()
    cache.put(first[:5], np.full((5, 1), 7, np.float32))
    hit, values = cache.get(first[:5])
    assert hit.all() and (values == 7).all()
