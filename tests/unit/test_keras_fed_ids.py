"""A batch's id columns made unique at once (lookup_table.keras.rows.fed_ids_many,
members): exactly what numpy gives column by column."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_table.core.segments import place_segments, segment_bounds
from lookup_table.keras.rows import FedIds, fed_ids_many, member, members, patch_rows, patched

pytestmark = pytest.mark.unit


class _Layer:
    """What `fed_ids` reads of a layer: its table and padding id."""

    def __init__(self, padding_id: Any = None) -> None:
        self.table = "t"
        self.padding_id = padding_id

    def not_padding(self, ids: Any) -> Any:
        if self.padding_id is None:
            return np.ones(ids.shape[0], dtype=bool)
        return np.asarray([x != self.padding_id for x in ids.tolist()], dtype=bool)


def _numpy(ids: np.ndarray, pad: Any) -> FedIds:
    """One column with numpy: the sorted unique ids that are not padding, and per
    position its row (len(uniq) for padding)."""
    keep = np.ones(ids.shape[0], bool) if pad is None else ids != pad
    uniq, inverse = np.unique(ids[keep], return_inverse=True)
    index = np.full(ids.shape[0], uniq.shape[0], np.int64)
    index[keep] = inverse
    return FedIds(uniq=uniq.astype(np.int64), index=index)


_columns = st.lists(
    st.tuples(
        st.lists(st.integers(-5, 5) | st.integers(-(2**63), 2**63 - 1), max_size=40),
        st.none() | st.integers(-5, 5),
        st.sampled_from(["int64", "int32", "uint16"]),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(_columns)
def test_fed_ids_many_is_numpys_unique_per_column(columns: list[Any]) -> None:
    layers, values, expected = [], [], []
    for ids, pad, dtype in columns:
        info = np.iinfo(dtype)
        arr = np.array([i for i in ids if info.min <= i <= info.max], dtype=dtype)
        layers.append(_Layer(pad))
        values.append(arr)
        expected.append(_numpy(arr.astype(np.int64), pad))
    got = fed_ids_many(layers, values)  # type: ignore[arg-type]
    for g, e in zip(got, expected, strict=True):
        assert g.uniq.dtype == np.int64 and g.index.dtype == np.int64
        np.testing.assert_array_equal(g.uniq, e.uniq)
        np.testing.assert_array_equal(g.index, e.index)


def test_long_columns_of_few_and_of_many_distinct_ids() -> None:
    rng = np.random.default_rng(7)
    values = [
        rng.integers(0, 100, 5000),
        rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64),
        np.zeros(0, np.int64),
        np.array([5]),
        (rng.integers(0, 2**20, 4096) << 20).astype(np.int64),  # equal low bits
    ]
    pads = [3, None, None, 5, None]
    got = fed_ids_many([_Layer(p) for p in pads], values)  # type: ignore[arg-type]
    for g, v, pad in zip(got, values, pads, strict=True):
        e = _numpy(v.astype(np.int64), pad)
        np.testing.assert_array_equal(g.uniq, e.uniq)
        np.testing.assert_array_equal(g.index, e.index)


def test_string_columns_and_padding_go_column_by_column() -> None:
    layers = [_Layer(""), _Layer(0), _Layer()]
    values = [np.array(["b", "", "a", "b"], object), np.array([[3, 0], [3, 1]]), np.zeros(0, int)]
    got = fed_ids_many(layers, values)  # type: ignore[arg-type]
    assert got[0].uniq.tolist() == ["a", "b"] and got[0].index.tolist() == [1, 2, 0, 1]
    assert got[1].uniq.tolist() == [1, 3] and got[1].index.tolist() == [1, 2, 1, 0]
    assert got[2].uniq.shape == (0,) and got[2].index.shape == (0,)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sets(st.integers(-20, 20), max_size=15),
            st.none() | st.sets(st.integers(-20, 20), max_size=15),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_members_is_member_per_column(pairs: list[Any]) -> None:
    ids = [np.array(sorted(i), np.int64) for i, _ in pairs]
    among = [None if a is None else np.array(sorted(a), np.int64) for _, a in pairs]
    for g, i, a in zip(members(ids, among), ids, among, strict=True):
        e = member(i, a)
        assert (g is None) == (e is None)
        if e is not None:
            np.testing.assert_array_equal(g, e)


_tables = st.lists(
    st.tuples(
        st.sets(st.integers(-30, 30), max_size=12),  # a table's ids in the batch
        st.lists(st.none() | st.sets(st.integers(-30, 30), max_size=12), max_size=2),  # patches
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(_tables)
def test_patch_rows_puts_in_what_patched_puts_in_per_table(tables: list[Any]) -> None:
    """Every table's rows patched at once, as `patched` patches each table's, later
    patches winning; `brought` marks exactly the rows the patches had."""
    rng = np.random.default_rng(0)
    names = [f"t{k}" for k in range(len(tables))]
    ids = [np.array(sorted(i), np.int64) for i, _ in tables]
    rows = [rng.normal(size=(i.shape[0], 3)).astype(np.float32) for i in ids]
    patches: list[dict[str, Any]] = [{}, {}]
    for name, (_, mine) in zip(names, tables, strict=True):
        for p, got in zip(patches, mine, strict=False):
            if got is not None:
                pid = np.array(sorted(got), np.int64)
                p[name] = (pid, rng.normal(size=(pid.shape[0], 3)).astype(np.float32))
    every = np.concatenate(rows)
    brought = patch_rows(every, names, ids, patches)
    expected = np.concatenate(
        [patched(n, i, r, patches) for n, i, r in zip(names, ids, rows, strict=True)]
    )
    assert every.tobytes() == expected.tobytes()
    hit = np.concatenate(
        [
            np.isin(i, np.concatenate([p[n][0] for p in patches if n in p] or [np.zeros(0)]))
            for n, i in zip(names, ids, strict=True)
        ]
    )
    np.testing.assert_array_equal(brought, hit)


def test_place_segments_moves_each_columns_rows_and_its_padding() -> None:
    """Per column, its rows among its own unique ids move by its offset, and its padding
    (the row just past them) to its zero row: numpy's where, column by column."""
    rng = np.random.default_rng(2)
    counts = np.array([5, 0, 3, 7], np.int64)
    columns = [rng.integers(0, n + 1, size=int(rng.integers(0, 20))) for n in counts]
    offsets, zero_rows = np.array([0, 5, 5, 0], np.int64), np.array([8, 8, 8, 7], np.int64)
    expected = np.concatenate(
        [
            np.where(c < n, c + o, z)
            for c, n, o, z in zip(columns, counts, offsets, zero_rows, strict=True)
        ]
    )
    index = np.concatenate(columns).astype(np.int64)
    place_segments(index, segment_bounds(c.shape[0] for c in columns), counts, offsets, zero_rows)
    np.testing.assert_array_equal(index, expected)
