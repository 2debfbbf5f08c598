"""A push's answer travels as `Answer` inside the service and as its wire form outside."""

from __future__ import annotations

import numpy as np
import pytest

from lookup_table.core.wire import decode_array, decode_ids
from optimizer_service.engine.answers import Answer

pytestmark = pytest.mark.unit


def _rows(n: int, start: float) -> np.ndarray:
    return np.arange(start, start + 2 * n, dtype=np.float32).reshape(n, 2)


def test_an_answer_groups_the_tables_that_came_grouped_and_sends_the_rest_by_name() -> None:
    a_ids, b_ids, c_ids = np.array([1, 2]), np.array([7]), np.array([3, 4, 5])
    answer = Answer(
        stamp=("epoch", 12),
        updated={"a": (a_ids, _rows(2, 0)), "b": (b_ids, _rows(1, 10)), "c": (c_ids, _rows(3, 20))},
        groups=[("a", "b"), ("x", "c")],  # the second is not all there: sent by name
        dense=(4, {"w": np.ones(3, np.float32)}),
    )
    wire = answer.to_wire()
    assert list(wire) == ["stamp", "updated_groups", "updated", "dense_version", "params"]
    assert wire["stamp"] == ["epoch", 12]
    (group,) = wire["updated_groups"]
    assert group["tables"] == ["a", "b"] and group["counts"] == [2, 1]
    np.testing.assert_array_equal(decode_array(group["ids"], field="ids"), [1, 2, 7])
    np.testing.assert_array_equal(
        decode_array(group["rows"], field="rows"), np.concatenate([_rows(2, 0), _rows(1, 10)])
    )
    assert list(wire["updated"]) == ["c"]
    np.testing.assert_array_equal(decode_ids(wire["updated"]["c"]["ids"], field="ids"), c_ids)
    np.testing.assert_array_equal(
        decode_array(wire["updated"]["c"]["rows"], field="rows"), _rows(3, 20)
    )
    assert wire["dense_version"] == 4
    np.testing.assert_array_equal(decode_array(wire["params"]["w"], field="w"), np.ones(3))
    assert set(answer.updated or {}) == {"a", "b", "c"}  # to_wire leaves the answer as it was


def test_an_answer_sends_only_what_was_asked() -> None:
    assert Answer().to_wire() == {}
    assert Answer(updated={}).to_wire() == {"updated": {}}
    with pytest.raises(AttributeError):
        Answer().stamp = ("e", 1)  # type: ignore[misc]


def test_a_trainer_reads_an_answer_back_with_its_blocks_as_they_came() -> None:
    """`updated_rows` gives every table's (ids, rows) and, for one replica's group whose
    tables' ids each rise, the block itself (patches and caches take it whole); a block
    with a table out of order is only read table by table (sorted)."""
    from lookup_table.client.answers import updated_rows

    updated = {
        "a": (np.array([1, 2]), _rows(2, 0)),
        "b": (np.array([7]), _rows(1, 10)),
        "e": (np.array([], np.int64), _rows(0, 0)),
        "c": (np.array([3, 4, 5]), _rows(3, 20)),
        "d": (np.array([9, 8]), _rows(2, 30)),  # not sorted: read table by table
    }
    wire = Answer(updated=updated, groups=[("a", "b", "e", "c"), ("d", "x")]).to_wire()
    got = updated_rows([wire])
    assert set(got) == set(updated) - {"x"}
    for name, (ids, rows) in updated.items():
        order = np.argsort(ids)
        np.testing.assert_array_equal(got[name][0], ids[order])
        np.testing.assert_array_equal(got[name][1], rows[order])
    (block,) = got.groups
    assert block.tables == ("a", "b", "e", "c") and block.bounds.tolist() == [0, 2, 3, 3, 6]
    np.testing.assert_array_equal(block.ids, [1, 2, 7, 3, 4, 5])
    unsorted = Answer(updated=updated, groups=[("c", "d")]).to_wire()
    assert updated_rows([unsorted]).groups == []
    assert updated_rows([wire, unsorted]).groups == []  # two replicas: merged per table
