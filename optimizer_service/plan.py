"""What one push writes, as absolute values: computed once, journaled, then written.

A `WritePlan` holds the new rows and slots of every table of a push, and where it has
them the replica's new version and the dense parameters' update. Its values are
absolute, not deltas, so writing one plan twice, as a journal replay may, is harmless.

The dense update is journaled as a switch of the `current` pointer (`DenseSwitch`), not
as values: the new generation's chunks (`WritePlan.dense_generation`) are written before
the journal header, so a replay needs only the pointer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
from lookup_table.dense import DenseGeneration

__all__ = ["DenseSwitch", "DenseWrite", "TableUpdate", "WritePlan"]

DenseWrite = tuple[dict[str, NDArray[np.float32]], dict[str, NDArray[np.float32]]]
"""The new dense parameters and their optimizer slots, by parameter name."""


@dataclass(slots=True)
class TableUpdate:
    """The new rows (n, dim) and slots (n, slot width) of the unique ids (n,) of one table."""

    table: str
    ids: IdArray
    rows: NDArray[np.float32]
    slots: NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class DenseSwitch:
    """Point the dense parameters' `current` at `current` (a generation whose chunks are
    written), then delete the generation of `previous`, the pointer it replaces."""

    current: dict[str, Any]
    previous: dict[str, Any] | None


@dataclass(slots=True)
class WritePlan:
    """Everything one push writes: absolute values, so writing it twice is harmless.

    Of the dense update only `dense_switch` is journaled. `dense` (the new values, for
    the in-memory copy) and `dense_generation` (its chunks) live in the replica that
    computed the plan; a journal of an older service carries `dense` and no switch.
    """

    push_id: str
    updates: list[TableUpdate]
    version: int | None = None  # the replica's new version (sync mode, or dense updates)
    dense: DenseWrite | None = None
    dense_switch: DenseSwitch | None = None
    dense_generation: DenseGeneration | None = None
