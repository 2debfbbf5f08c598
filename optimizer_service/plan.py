"""What one push writes, as absolute values: computed once, journaled, then written.

A `WritePlan` holds the new rows and slots of every table of a push (and the new dense
parameters and version, where it has them). Its values are absolute, not deltas, so
writing one plan twice, as a journal replay may, is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray

__all__ = ["DenseWrite", "TableUpdate", "WritePlan"]

DenseWrite = tuple[dict[str, NDArray[np.float32]], dict[str, NDArray[np.float32]]]
"""The new dense parameters and their optimizer slots, by parameter name."""


@dataclass(slots=True)
class TableUpdate:
    """The new rows (n, dim) and slots (n, slot width) of the unique ids (n,) of one table."""

    table: str
    ids: IdArray
    rows: NDArray[np.float32]
    slots: NDArray[np.float32]


@dataclass(slots=True)
class WritePlan:
    """Everything one push writes: absolute values, so writing it twice is harmless."""

    push_id: str
    updates: list[TableUpdate]
    version: int | None = None  # the replica's new version (sync mode, or dense updates)
    dense: DenseWrite | None = None
