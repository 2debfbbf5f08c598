"""Rows of float16 and bfloat16 tables rounded once, after their step, to what is stored.

A step runs in float32; its new rows are rounded right after it (stochastically, keyed
by the table's seed, the id and the row's step), before anything holds them: the row
cache, the journal, the push's answer and memcached all get the same stored values, and
a replay that recomputes the step rounds it to the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import TableSpec
from lookup_table.core.hashing import id_hashes
from lookup_table.core.keys import IdArray
from lookup_table.core.optimizers import Optimizer, step_slot
from lookup_table.core.precision import round_to, rounding_keys
from lookup_table.core.rows import value_hashes

__all__ = ["RowRounder"]


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
        steps: NDArray[np.integer[Any]] = (
            old_slots[:, self.step_column].astype(np.int64)
            if self.step_column is not None
            else value_hashes(new_slots)
        )
        keys = rounding_keys(self.seed, id_hashes(ids), steps)
        return round_to(
            new_rows, self.dtype, rounding="stochastic", keys=keys, table=self.table, ids=ids
        )
