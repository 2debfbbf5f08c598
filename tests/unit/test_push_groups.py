"""Tables sent as groups (`groups: [{tables, counts, ids, grads}]` in a push, `{tables,
counts, ids}` in a read): parsed into exactly what the same tables sent one by one give,
and every malformed group refused with a message that names what is wrong."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_table.config import ClusterConfig, parse_config
from lookup_table.core.wire import encode_array, encode_ids, pack, unpack
from optimizer_service.errors import BadRequestError, NotOwnerError
from optimizer_service.push import Push, parse_push, parse_rows_request

pytestmark = pytest.mark.unit

NAMES = ("a", "b", "c")


def _config(replicas: int = 1) -> ClusterConfig:
    return parse_config(
        {
            "namespace": "g",
            "memcached": ["127.0.0.1:1"],
            "optimizers": [f"http://127.0.0.1:{2 + k}" for k in range(replicas)],
            "optimizer": {"name": "adam", "learning_rate": 0.001},
            "tables": [
                *({"name": n, "dim": 4} for n in NAMES),
                {"name": "wide", "dim": 8},
                {"name": "s", "dim": 4, "id_type": "string"},
            ],
        }
    )


def _group(tables: dict[str, tuple[np.ndarray, np.ndarray]], *, grads: bool = True) -> dict:
    group: dict[str, Any] = {
        "tables": list(tables),
        "counts": [int(ids.shape[0]) for ids, _ in tables.values()],
        "ids": encode_array(np.concatenate([ids for ids, _ in tables.values()])),
    }
    if grads:
        group["grads"] = encode_array(np.concatenate([g for _, g in tables.values()]))
    return group


def _push(singles: dict[str, Any] | None = None, groups: Any = None) -> dict:
    """A push body as the service gets it (packed and unpacked, as on the wire)."""
    body: dict[str, Any] = {"push_id": "p", "tables": singles or {}}
    if groups is not None:
        body["groups"] = groups
    return _wire(body)


def _wire(body: dict) -> dict:
    decoded: dict = unpack(pack(body))
    return decoded


def _one_by_one(tables: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    return {n: {"ids": encode_ids(i), "grads": encode_array(g)} for n, (i, g) in tables.items()}


def _same(a: Push, b: Push) -> None:
    assert [t.table for t in a.tables] == [t.table for t in b.tables]
    for x, y in zip(a.tables, b.tables, strict=True):
        np.testing.assert_array_equal(x.ids, y.ids)
        assert x.ids.dtype == y.ids.dtype == np.int64
        np.testing.assert_array_equal(x.grads, y.grads)  # bit for bit: the same sums


_table = st.integers(0, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(-(2**40), 2**40), min_size=n, max_size=n),
        st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=4 * n, max_size=4 * n),
    )
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_table, min_size=3, max_size=3), st.booleans())
def test_a_group_parses_to_what_its_tables_one_by_one_give(raw: list, unique: bool) -> None:
    """Duplicate and unsorted ids included (summed as for a table alone), empty tables
    too; the trainer's ids (unique, ascending) take the fast path."""
    tables = {}
    for name, (ids, values) in zip(NAMES, raw, strict=True):
        id_array = np.array(ids, dtype=np.int64)
        grads = np.array(values, dtype=np.float32).reshape(-1, 4)
        if unique:
            id_array, first = np.unique(id_array, return_index=True)
            grads = grads[first]
        tables[name] = (id_array, grads)
    config = _config()
    grouped = parse_push(_push(groups=[_group(tables)]), config=config)
    alone = parse_push(_push(_one_by_one(tables)), config=config)
    _same(grouped, alone)
    assert grouped.groups == (NAMES,) and alone.groups == ()
    read = parse_rows_request(
        _wire({"tables": {}, "groups": [_group(tables, grads=False)]}), config=config
    )
    assert read.groups == (NAMES,)
    for (name, ids), t in zip(read.reads, alone.tables, strict=True):
        assert name == t.table
        np.testing.assert_array_equal(ids, t.ids)


def test_groups_and_single_tables_mix_and_the_group_owns_its_copy() -> None:
    config = _config()
    rng = np.random.default_rng(0)
    tables = {
        n: (np.arange(5, dtype=np.int64) * (k + 1), rng.random((5, 4), np.float32))
        for k, n in enumerate(NAMES[:2])
    }
    wide = (np.array([3, 9], dtype=np.int64), rng.random((2, 8), np.float32))
    push = parse_push(_push(_one_by_one({"wide": wide}), [_group(tables)]), config=config)
    assert [t.table for t in push.tables] == ["wide", "a", "b"]
    assert push.groups == (("a", "b"),)
    a = push.tables[1]
    assert a.grads.flags.writeable and a.ids.flags.writeable  # not the body's bytes


def _bad(body: dict, pattern: str, *, reason: str | None = None, replicas: int = 1) -> None:
    with pytest.raises(BadRequestError, match=pattern) as info:
        parse_push(body, config=_config(replicas))
    if reason is not None:
        assert info.value.reason == reason


def test_malformed_groups_are_refused_naming_what_is_wrong() -> None:
    ids = np.array([1, 2, 3], dtype=np.int64)
    g4 = np.ones((3, 4), np.float32)
    ok = {"a": (ids, g4), "b": (ids, g4)}
    _bad(_push(groups={"a": 1}), "groups: expected a list")
    _bad(
        _push(groups=[[1]]), r"groups\[0\]: expected a map with exactly tables, counts, ids, grads"
    )
    no_grads = _group(ok, grads=False)
    _bad(_push(groups=[no_grads]), r"groups\[0\]: expected a map with exactly")
    _bad(_push(groups=[{**_group(ok), "tables": []}]), r"groups\[0\].tables: expected a non-empty")
    _bad(_push(groups=[{**_group(ok), "tables": ["a", "nope"]}]), "unknown table 'nope'")
    _bad(_push(groups=[{**_group(ok), "tables": ["a", "a"]}]), "table 'a' comes twice")
    _bad(_push(_one_by_one({"a": (ids, g4)}), [_group(ok)]), "table 'a' comes twice")
    _bad(
        _push(groups=[{**_group(ok), "tables": ["a", "wide"]}]),
        "a group's tables have one dim; 'a' has 4, 'wide' has 8",
        reason="shape",
    )
    _bad(
        _push(groups=[{**_group(ok), "tables": ["a", "s"]}]), "'s' has string ids", reason="id_type"
    )
    _bad(_push(groups=[{**_group(ok), "counts": [3]}]), r"counts: expected 2 non-negative ints")
    _bad(_push(groups=[{**_group(ok), "counts": [3, -1]}]), r"counts: expected 2 non-negative")
    _bad(_push(groups=[{**_group(ok), "counts": [3, True]}]), r"counts: expected 2 non-negative")
    _bad(_push(groups=[{**_group(ok), "counts": [2, 2]}]), "they sum to 4, but ids has 6")
    _bad(
        _push(groups=[{**_group(ok), "grads": encode_array(np.ones((6, 3), np.float32))}]),
        r"grads: expected shape \(6, 4\)",
        reason="shape",
    )
    _bad(
        _push(groups=[{**_group(ok), "ids": encode_array(np.ones(6))}]),
        r"ids.dtype: expected '<i8'",
    )
    nan = g4.copy()
    nan[1, 2] = np.nan
    _bad(
        _push(groups=[_group({"a": (ids, g4), "b": (ids, nan)})]),
        r"tables.b: gradient is not finite: nan at row 1, column 2",
        reason="nan",
    )
    big = np.full((3, 4), 3e38, np.float32)
    _bad(
        _push(groups=[_group({"a": (ids, g4), "b": (np.array([7, 7, 7]), big)})]),
        r"tables.b \(summed over duplicate ids\): gradient is not finite",
        reason="nan",
    )


def test_a_group_of_another_replicas_rows_is_refused() -> None:
    ids = np.arange(40, dtype=np.int64)
    body = _push(
        groups=[
            _group(
                {
                    "a": (ids, np.ones((40, 4), np.float32)),
                    "b": (ids[:1], np.ones((1, 4), np.float32)),
                }
            )
        ]
    )
    with pytest.raises(NotOwnerError, match=r"tables.a.ids: \d+ of 40 rows belong to other"):
        parse_push(body, config=_config(replicas=2), replica=0)


def test_a_read_group_takes_no_grads() -> None:
    ids = np.array([1, 2], dtype=np.int64)
    group = _group(
        {"a": (ids, np.ones((2, 4), np.float32)), "b": (ids, np.ones((2, 4), np.float32))}
    )
    with pytest.raises(
        BadRequestError, match=r"groups\[0\]: expected a map with exactly tables, counts, ids, got"
    ):
        parse_rows_request(_wire({"tables": {}, "groups": [group]}), config=_config())
    with pytest.raises(BadRequestError, match="with tables \\(and groups\\)"):
        parse_rows_request({"groups": []}, config=_config())


@given(st.lists(st.integers(0, 5), min_size=2, max_size=6), st.integers(1, 3))
def test_a_groups_tables_are_stacked_back_without_a_copy(counts: list[int], dim: int) -> None:
    """`stacked` gives the tables' rows one after another: a view of the group's array
    when they are its consecutive blocks (as a push of a group is parsed), a copy when
    they are not (other blocks, another order, arrays of their own), equal either way."""
    from lookup_table.core.rows import blocks
    from optimizer_service.engine.plan import stacked

    group = np.arange(sum(counts) * dim, dtype=np.float32).reshape(-1, dim)
    parts = blocks(group, counts)
    joined = stacked(parts)
    assert np.array_equal(joined, group)
    assert np.shares_memory(joined, group) or not group.size
    own = [p.copy() for p in parts]
    assert not np.shares_memory(stacked(own), group) and np.array_equal(stacked(own), group)
    swapped = [parts[-1], *parts[:-1]]
    if counts[-1] and sum(counts[:-1]):  # a block out of its place: copied, in that order
        assert not np.shares_memory(stacked(swapped), group)
        assert np.array_equal(stacked(swapped), np.concatenate(swapped))
    ids = np.arange(sum(counts), dtype=np.int64)
    assert np.array_equal(stacked(blocks(ids, counts)), ids)
