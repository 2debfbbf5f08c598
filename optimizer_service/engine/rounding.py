"""Rows of float16 and bfloat16 tables rounded once, after their step, to what is stored.

A step runs in float32; its new rows are rounded right after it (stochastically, keyed
by the table's seed, the id and the row's step), before anything holds them: the row
cache, the journal, the push's answer and memcached all get the same stored values, and
a replay that recomputes the step rounds it to the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import TableSpec
from lookup_table.core.hashing import id_hashes
from lookup_table.core.keys import IdArray
from lookup_table.core.optimizers import Optimizer, step_slot
from lookup_table.core.precision import (
    Rounding,
    RowDtype,
    check_values_fit,
    round_to,
    rounding_keys,
    rounding_salt,
    salted_rounding_keys,
)
from lookup_table.core.rows import value_hashes
from lookup_table.errors import RowOverflowError

__all__ = ["RowRounder", "key_counts", "round_batch"]


class RowRounder:
    """How one table's stepped rows are rounded to its dtype (float32: not at all).

    The key of a row's random bits must change from one update of the row to the next
    and be known to a replay: the row's step before the update where its optimizer
    counts steps (adam, rowwise_adam), else the hash of its new slots (they change at
    every update with a gradient: rowwise_adagrad's and adagrad's accumulators, sgd's
    momentum). SGD without momentum keeps nothing a replay knows: to nearest, as is
    every table whose `rounding` is "nearest".
    """

    def __init__(self, spec: TableSpec, optimizer: Optimizer) -> None:
        self.table = f"table {spec.name!r}"  # names the table in a RowOverflowError
        self.dtype = spec.dtype
        self.seed = spec.seed
        self.step_column = step_slot(optimizer, spec.dim)
        self.stochastic = spec.rounding == "stochastic" and (
            self.step_column is not None or optimizer.slot_width(spec.dim) > 0
        )
        self.rounding: Rounding = "stochastic" if self.stochastic else "nearest"
        self.salt = rounding_salt(self.seed)

    @property
    def rounds(self) -> bool:
        return self.dtype != "float32"

    def round(
        self,
        ids: IdArray,
        old_slots: NDArray[np.float32],
        new_rows: NDArray[np.float32],
        new_slots: NDArray[np.float32],
    ) -> NDArray[np.float32]:
        """`new_rows` as the table stores them (a new array; `new_rows` for float32).

        Raises:
            RowOverflowError: a value beyond the dtype's range (which row, which value,
                what to do); nothing is rounded.
        """
        if self.dtype == "float32" or new_rows.shape[0] == 0:
            return new_rows
        if not self.stochastic:
            return round_to(new_rows, self.dtype, table=self.table, ids=ids)
        old_steps = None if self.step_column is None else old_slots[:, self.step_column]
        keys = rounding_keys(self.seed, id_hashes(ids), key_counts(old_steps, new_slots))
        return round_to(
            new_rows, self.dtype, rounding="stochastic", keys=keys, table=self.table, ids=ids
        )


def key_counts(
    old_steps: NDArray[np.float32] | None, new_slots: NDArray[np.float32]
) -> NDArray[np.integer[Any]]:
    """What a row's rounding key counts (`RowRounder`): its step before the update where
    the optimizer counts steps (`old_steps`), else the hash of its new slots."""
    if old_steps is not None:
        return old_steps.astype(np.int64)
    return value_hashes(new_slots)


def round_batch(
    members: Sequence[tuple[RowRounder, IdArray]],
    rows: NDArray[np.float32],
    counts: Callable[[], NDArray[np.integer[Any]]],
) -> None:
    """Round the new rows of one batch's tables in place, bit for bit as each table's
    `RowRounder.round`: `members` (a table's rounder and ids) in the order of their
    rows in `rows`. `counts()` gives every row's key count, as `round` takes it: the
    old step where the batch's optimizer counts steps, else the hash of the new slots.
    The keys come from one pass over all rows, and each (dtype, rounding) group of
    tables is rounded by one `round_to` call.

    Raises:
        RowOverflowError: as `round` raises it for the first table (in `members`' order)
            with a value beyond its dtype's range.
    """
    bounds = np.cumsum([0, *(ids.shape[0] for _, ids in members)])
    groups: dict[tuple[RowDtype, Rounding], list[int]] = {}
    for k, (rounder, _) in enumerate(members):
        if rounder.rounds and bounds[k + 1] > bounds[k]:
            groups.setdefault((rounder.dtype, rounder.rounding), []).append(k)
    if not groups:
        return
    every = len(groups) == 1 and sum(map(len, groups.values())) == len(members)
    row_counts = counts() if any(rounding == "stochastic" for _, rounding in groups) else None
    try:
        for (dtype, rounding), ks in groups.items():
            at: slice | NDArray[np.intp] = (
                slice(None)
                if every
                else np.concatenate([np.arange(bounds[k], bounds[k + 1]) for k in ks])
            )
            keys = None
            if rounding == "stochastic" and row_counts is not None:
                sizes = [int(bounds[k + 1] - bounds[k]) for k in ks]
                salts = np.repeat(np.array([members[k][0].salt for k in ks]), sizes)
                hashes = _hashes([members[k][1] for k in ks])
                keys = salted_rounding_keys(salts, hashes, row_counts[at])
            if every and rows.flags.c_contiguous:
                round_to(rows, dtype, rounding=rounding, keys=keys, out=rows)
            else:  # a copy of the group's rows (or a view of rows not in C order)
                rows[at] = round_to(rows[at], dtype, rounding=rounding, keys=keys)
    except RowOverflowError:
        # the error of the table that does not fit, as its own `round` says it
        for rounder, ids in members:
            k = len(ids)
            if rounder.rounds:
                check_values_fit(rows[:k], rounder.dtype, rounder.table, ids)
            rows = rows[k:]
        raise


def _hashes(ids: Sequence[IdArray]) -> NDArray[np.uint64]:
    """`id_hashes` of several tables' ids, one after another (int ids in one pass)."""
    if all(i.dtype == np.int64 for i in ids):
        joined = ids[0] if len(ids) == 1 else np.concatenate(ids)
        return id_hashes(np.asarray(joined, dtype=np.int64))  # int64 already: no copy
    return np.concatenate([id_hashes(i) for i in ids])
