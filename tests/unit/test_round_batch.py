"""`round_batch`: the new rows of several tables rounded at once, bit for bit as each
table's own `RowRounder.round`, and the same RowOverflowError for the table that does
not fit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lookup_table.config import parse_config
from lookup_table.core.optimizers import make_optimizer
from lookup_table.errors import RowOverflowError
from optimizer_service.engine.rounding import RowRounder, round_batch


def _rounders(tables: list[dict[str, Any]]) -> list[RowRounder]:
    raw = {"namespace": "n", "memcached": ["127.0.0.1:1"], "tables": tables}
    specs = parse_config(raw, env={}).tables
    return [RowRounder(s, make_optimizer(s.optimizer)) for s in specs]


def _ids(rng: np.random.Generator, n: int, string: bool) -> Any:
    ids = rng.choice(2**40, n, replace=False).astype(np.int64) - 2**39
    return np.array([f"w{i}" for i in ids], dtype=object) if string else ids


def _batch(
    rng: np.random.Generator, optimizer: dict[str, Any], n_tables: int
) -> tuple[list[RowRounder], list[Any], np.ndarray, np.ndarray, np.ndarray]:
    """Tables of one optimizer (one batch) with random seeds, dtypes, roundings and id
    types; their ids, new rows (some exactly halfway, some tiny), old and new slots."""
    tables: list[dict[str, Any]] = []
    for k in range(n_tables):
        dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
        table = {"name": f"t{k}", "dim": 8, "seed": int(rng.integers(0, 2**31))}
        table |= {"dtype": dtype, "optimizer": optimizer}
        if dtype != "float32":
            table["rounding"] = str(rng.choice(["stochastic", "nearest"]))
        if rng.random() < 0.2:
            table["id_type"] = "string"
        tables.append(table)
    rounders = _rounders(tables)
    ids = [_ids(rng, int(rng.integers(0, 40)), t.get("id_type") == "string") for t in tables]
    n = sum(len(i) for i in ids)
    rows = (rng.standard_normal((n, 8)) * 10.0 ** rng.integers(-9, 3, (n, 1))).astype(np.float32)
    rows[::7, 0] = np.float32(1 + 2**-11)  # a float16 tie
    spec = parse_config(
        {"namespace": "n", "memcached": ["127.0.0.1:1"], "tables": tables[:1]}, env={}
    ).tables[0]
    width = make_optimizer(spec.optimizer).slot_width(8)
    old_slots = rng.uniform(0, 1, (n, width)).astype(np.float32)
    if rounders[0].step_column is not None:
        old_slots[:, rounders[0].step_column] = rng.integers(0, 2**24, n)
    new_slots = old_slots + np.float32(0.5)
    return rounders, ids, rows, old_slots, new_slots


def _counts(rounder: RowRounder, old_slots: np.ndarray, new_slots: np.ndarray) -> Any:
    from lookup_table.core.rows import value_hashes

    if rounder.step_column is not None:
        return lambda: old_slots[:, rounder.step_column].astype(np.int64)
    return lambda: value_hashes(new_slots)


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "adam"},
        {"name": "rowwise_adam"},
        {"name": "rowwise_adagrad"},
        {"name": "sgd", "momentum": 0.9},
        {"name": "sgd"},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
@pytest.mark.parametrize("seed", range(8))
def test_a_batch_rounds_each_table_as_its_own_rounder_does(
    optimizer: dict[str, Any], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rounders, ids, rows, old_slots, new_slots = _batch(rng, optimizer, int(rng.integers(1, 7)))
    want = []
    start = 0
    for rounder, table_ids in zip(rounders, ids, strict=True):
        stop = start + len(table_ids)
        want.append(
            rounder.round(table_ids, old_slots[start:stop], rows[start:stop], new_slots[start:stop])
        )
        start = stop
    got = rows.copy()
    round_batch(
        list(zip(rounders, ids, strict=True)), got, _counts(rounders[0], old_slots, new_slots)
    )
    expected = np.concatenate(want) if want else rows
    assert got.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes()


def test_a_batch_with_a_row_beyond_its_dtype_says_which_table_as_its_rounder_does() -> None:
    rounders = _rounders(
        [
            {"name": "wide", "dim": 4, "dtype": "bfloat16"},
            {"name": "small", "dim": 4, "dtype": "float16"},
            {"name": "later", "dim": 4, "dtype": "float16"},
        ]
    )
    ids = [np.arange(3, dtype=np.int64), np.arange(10, 14, dtype=np.int64), np.arange(2)]
    rows = np.ones((9, 4), dtype=np.float32)
    rows[1, 2] = 1e6  # fits bfloat16: no error for "wide"
    rows[5, 1] = 7e4  # "small"'s id 12: beyond float16's largest
    rows[8, 0] = 1e9  # "later" too, but the first table that does not fit is named
    old_slots = np.zeros((9, 9), dtype=np.float32)
    new_slots = old_slots + 1
    with pytest.raises(RowOverflowError) as batch:
        round_batch(
            list(zip(rounders, ids, strict=True)),
            rows.copy(),
            _counts(rounders[0], old_slots, new_slots),
        )
    with pytest.raises(RowOverflowError) as own:
        rounders[1].round(ids[1], old_slots[3:7], rows[3:7], new_slots[3:7])
    assert str(batch.value) == str(own.value)
    assert "table 'small'" in str(batch.value) and "(id 12)" in str(batch.value)


def test_the_compiled_keys_are_the_rule_in_numpy_and_each_tables_own() -> None:
    from lookup_table.core.hashing import mix64
    from lookup_table.core.precision import rounding_keys, rounding_salt, salted_rounding_keys

    rng = np.random.default_rng(9)
    seeds = [0, 7, 2**63 + 5, -3]
    hashes = rng.integers(0, 2**64, 400, dtype=np.uint64)
    steps = rng.integers(0, 2**63, 400, dtype=np.int64)
    steps[:50] = rng.integers(0, 2**24, 50)
    salts = np.repeat(np.array([rounding_salt(s) for s in seeds]), 100)
    tag = np.uint64(0x726F756E642D7372)
    want = [mix64(np.array([(s ^ int(tag)) & (2**64 - 1)], dtype=np.uint64))[0] for s in seeds]
    assert [int(w) for w in want] == [int(s) for s in salts[::100]]
    with np.errstate(over="ignore"):
        counter = (steps.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        numpy_rule = mix64(mix64(hashes ^ salts) + counter)
    got = salted_rounding_keys(salts, hashes, steps)
    assert got.tobytes() == numpy_rule.tobytes()
    for k, seed in enumerate(seeds):
        part = slice(100 * k, 100 * (k + 1))
        assert rounding_keys(seed, hashes[part], steps[part]).tobytes() == got[part].tobytes()
    assert (
        rounding_keys(7, hashes[:3], 5).tobytes()
        == salted_rounding_keys(salts[100:103], hashes[:3], np.full(3, 5)).tobytes()
    )
