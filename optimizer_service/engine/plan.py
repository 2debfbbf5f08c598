"""What one push writes: computed once, journaled, then written.

A `WritePlan` holds a push's new rows and slots per table and, where it has them, the
replica's new version and the dense update: absolute values, so writing one twice is
harmless. The journal keeps gradients and change witnesses instead of the values
(`TableUpdate.witness`, `TableRedo`); docs/service.md says how a replay uses them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
from lookup_table.core.rows import blocks

__all__ = [
    "Applied",
    "DenseSwitch",
    "DenseWrite",
    "TableRedo",
    "TableStep",
    "TableUpdate",
    "WritePlan",
    "shares",
    "stacked",
]

DenseWrite = tuple[dict[str, NDArray[np.float32]], dict[str, NDArray[np.float32]]]
"""The new dense parameters and their optimizer slots, by parameter name."""


@dataclass(slots=True)
class TableUpdate:
    """The new rows (n, dim) and slots (n, slot width) of the unique ids (n,) of one table."""

    table: str
    ids: IdArray
    rows: NDArray[np.float32]
    slots: NDArray[np.float32]
    # the summed gradients of `ids`: what a journal of rows written behind keeps (with
    # each row's step before the push); `Journal.write` without `seq` journals them with
    # the new values' hashes when the plan has no `steps` (how an older service
    # journaled a push; tests write such journals)
    grads: NDArray[np.float32] | None = None
    # Admission (`admit_after`): the gradients of ids without a row are dropped, so `ids`
    # lacks them; `answer` is then (every unique id of the push, its row after the push:
    # the initial value for a dropped one), and `dropped` how many were dropped.
    answer: tuple[IdArray, NDArray[np.float32]] | None = None
    dropped: int = 0
    # what the journal keeps to tell the item written from the item not yet written:
    # `rows.change_witnesses` of each unique id of the push's table (also of ids admission
    # dropped: `NOT_UPDATED`), in the order of `answer`'s ids when it has them, else `ids`
    witness: NDArray[np.int64] | None = None
    # how many of `ids` had no row (their initial value was stepped): the push creates them
    created: int = 0


@dataclass(slots=True)
class TableStep:
    """One table's optimizer step, known before the optimizer runs: the unique ids (n,)
    it updates, their summed gradients (n, dim), and their rows (n, dim) and slots
    (n, slot width) before the push. The arrays are not written afterwards. (An older
    journal format keeps a hash of each id's item from here: `journal_format.encode_journal`
    still writes it, for the tests of its replay.)"""

    table: str
    ids: IdArray
    grads: NDArray[np.float32]
    rows: NDArray[np.float32]
    slots: NDArray[np.float32]


def stacked(arrays: Sequence[NDArray[Any]]) -> NDArray[Any]:
    """The arrays' rows one after another: the tables of a push that are worked as one
    batch. No copy when there is one array, or when they are consecutive blocks of one
    (a group's tables as the push was parsed: `blocks`); then a view: read it only."""
    if len(arrays) == 1:
        return arrays[0]
    joined = _joined_blocks(arrays)
    return np.concatenate(arrays) if joined is None else joined


def _joined_blocks(arrays: Sequence[NDArray[Any]]) -> NDArray[Any] | None:
    """The view of one array that `arrays` are consecutive C-contiguous blocks of, in
    order; None when they are not."""
    first = arrays[0]
    base = first.base
    if base is None:
        return None
    at = first.__array_interface__["data"][0]
    for a in arrays:
        if a.dtype != first.dtype or a.shape[1:] != first.shape[1:]:
            return None
        if not a.size:  # an empty block may point anywhere
            continue
        if a.base is not base or not a.flags.c_contiguous or a.__array_interface__["data"][0] != at:
            return None
        at += a.nbytes
    rows = sum(a.shape[0] for a in arrays)
    view: NDArray[Any] = np.lib.stride_tricks.as_strided(
        first, shape=(rows, *first.shape[1:]), writeable=first.flags.writeable
    )
    return view


def shares(values: NDArray[Any], steps: Sequence[TableStep]) -> list[NDArray[Any]]:
    """`values`, a row per id of `steps` stacked, cut back into each step's rows (views)."""
    return blocks(values, [s.ids.shape[0] for s in steps])


@dataclass(slots=True)
class TableRedo:
    """A journaled table update: the unique ids (n,), their summed gradients (n, dim),
    and per id its item's change witness (`witness`, (n,) int64: `rows.change_witnesses`).
    Journals of older services have instead the `value_hashes` of each item before the
    push (`old_hashes`, (n,) uint64), or the hashes of the new rows and of the new slots
    (`row_hashes`, `slot_hashes`). A journal of rows written behind has `steps`: each
    row's step count before the push ((n,) float32, `optimizers.step_slot`)."""

    table: str
    ids: IdArray
    grads: NDArray[np.float32]
    witness: NDArray[np.int64] | None = None
    steps: NDArray[np.float32] | None = None
    old_hashes: NDArray[np.uint64] | None = None
    row_hashes: NDArray[np.uint64] | None = None
    slot_hashes: NDArray[np.uint64] | None = None


@dataclass(frozen=True, slots=True)
class DenseSwitch:
    """Point the dense parameters' `current` at `current` (a generation whose chunks are
    written), then delete the generation of `previous`, the pointer it replaces."""

    current: dict[str, Any]
    previous: dict[str, Any] | None


@dataclass(slots=True)
class WritePlan:
    """Everything one push writes: absolute values, so writing it twice is harmless.

    Of the tables, a push's journal carries the push's gradients (written first, by
    `Journal.write_start`) and its updates' `witness`es (`Journal.write_end`).
    `Journal.write` writes the formats of older services, for the tests of their
    replay: `steps` with the hashes of the rows before the push, else the updates' new
    values' hashes, or their values when they have no gradients.
    Of the dense update only `dense_logged` is journaled (its gradients are in the log of
    `version`). `dense` (the new values, for the in-memory state) lives in the replica
    that computed the plan; a journal of an older service carries `dense` and no log, or
    a `dense_switch`.
    """

    push_id: str
    updates: list[TableUpdate]
    steps: list[TableStep] = field(default_factory=list)  # `Journal.write`'s older format
    redo: list[TableRedo] = field(default_factory=list)  # a journal's: values to recompute
    version: int | None = None  # the replica's new version (sync mode, or dense updates)
    dense: DenseWrite | None = None
    dense_switch: DenseSwitch | None = None  # a journal of the previous service
    dense_logged: bool = False  # the dense update to `version` is in its log
    seq: int | None = None  # a live push's: the replica's how-manieth change of its rows
    journal_seq: int = 0  # a journal of values written behind: its place in their order


@dataclass(frozen=True, slots=True)
class Applied:
    """What `Updater.apply` returns: whether this call applied the push (else it is a
    duplicate), the push's rows, the replica's version after it, and the rows it created
    per table (counted once: told only to the call that applied it). `plan` is the write
    plan of the push this call applied (its answer reads it); it is never sent."""

    applied: bool
    duplicate: bool
    rows: int
    version: int
    plan: WritePlan | None = None
    created: Mapping[str, int] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The outcome as the service sends it: `{applied, duplicate, rows, version}`, and
        `created` when the push created rows."""
        out: dict[str, Any] = {
            "applied": self.applied,
            "duplicate": self.duplicate,
            "rows": self.rows,
            "version": self.version,
        }
        if self.created:
            out["created"] = dict(self.created)
        return out
