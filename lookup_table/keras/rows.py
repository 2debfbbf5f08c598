"""The ids and rows of a training batch, outside the graph: which layer reads which
column, the unique ids it is fed, one `lookup_many` for a batch, rows fetched ahead and
the push answers that patch them (`TrainingSession` composes these)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import tensorflow as tf
from numpy.typing import NDArray

from lookup_table.client import RowReader
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.keras.layer import DistributedEmbedding

__all__ = [
    "WHOLE",
    "BatchPart",
    "FedIds",
    "FedLayer",
    "Known",
    "PartialRows",
    "Prefetched",
    "RowPatch",
    "column_of",
    "fed_ids",
    "lookup_batch",
    "member",
    "patched",
]

WHOLE = "<the inputs themselves>"
"""A column key: the layer is called on the model's only input (not a dict of them)."""


def column_of(features: Any, key: Any) -> Any:
    """The column `key` of a batch's features (`WHOLE`: the features themselves), or
    None if the batch has no such column."""
    if key == WHOLE and not isinstance(features, Mapping):
        return features
    if isinstance(features, Mapping) and key in features:
        return features[key]
    return None


def _column_ids(value: Any) -> NDArray[Any]:
    """The flat ids of a batch column: numpy, a tf tensor, or ragged (tf or with
    `row_splits` and `values`)."""
    if isinstance(value, tf.RaggedTensor):
        return np.asarray(value.flat_values)
    if hasattr(value, "row_splits") and hasattr(value, "values"):
        return np.asarray(value.values)
    return np.asarray(value).reshape(-1)


@dataclass(frozen=True, slots=True)
class FedIds:
    """A layer's ids in one batch as the graph step is fed them: the unique contributing
    ids, and per flat position its row (u, the zero row, for a padding id)."""

    uniq: IdArray
    index: NDArray[np.int64]


def fed_ids(layer: DistributedEmbedding, value: Any) -> FedIds:
    """What the layer's py_function lookup computes in the graph, from the batch column."""
    raw = _column_ids(value)
    ids = as_ids(raw.tolist() if raw.dtype.kind in "SO" else raw, table=layer.table)
    keep = layer.not_padding(ids)
    kept = ids[keep]
    if kept.shape[0]:
        uniq_any, inverse = np.unique(kept, return_inverse=True)
        uniq = cast(IdArray, uniq_any)
    else:
        uniq, inverse = kept, np.zeros(0, dtype=np.intp)
    index = np.full(ids.shape[0], uniq.shape[0], dtype=np.int64)
    index[keep] = inverse.reshape(-1)
    return FedIds(uniq=uniq, index=index)


RowPatch = Mapping[str, tuple[IdArray, NDArray[np.float32]]]
"""Rows a push produced (its answer): table -> (sorted unique ids, rows)."""


def member(ids: IdArray, among: IdArray | None) -> NDArray[np.bool_] | None:
    """Which of `ids` are in the sorted unique `among` (None if none or no `among`)."""
    if among is None or not among.shape[0] or not ids.shape[0]:
        return None
    pos = np.minimum(np.searchsorted(among, ids), among.shape[0] - 1)
    hit: NDArray[np.bool_] = among[pos] == ids
    return hit if hit.any() else None


def _patch(
    table: str, ids: IdArray, rows: NDArray[np.float32], patches: Iterable[RowPatch]
) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
    """`rows` of `ids` with the rows of `patches` put in, later patches winning (a copy
    if anything changes), and which of `ids` the patches brought."""
    out = rows
    brought = np.zeros(ids.shape[0], dtype=bool)
    for patch in patches:
        newer = patch.get(table)
        if newer is None:
            continue
        hit = member(ids, newer[0])
        if hit is None:
            continue
        out = out.copy() if out is rows else out
        out[hit] = newer[1][np.searchsorted(newer[0], ids[hit])]
        brought |= hit
    return out, brought


def patched(
    table: str, ids: IdArray, rows: NDArray[np.float32], patches: Iterable[RowPatch]
) -> NDArray[np.float32]:
    """`rows` of `ids` with the rows of `patches` put in (see `_patch`)."""
    return _patch(table, ids, rows, patches)[0]


@dataclass(frozen=True, slots=True)
class PartialRows:
    """Rows of the ids not skipped; the skipped ones must come from a push's answer."""

    rows: NDArray[np.float32]  # (len(ids), dim); skipped rows are zeros until completed
    skipped: NDArray[np.bool_]

    def complete(
        self, table: str, ids: IdArray, patches: Iterable[RowPatch]
    ) -> NDArray[np.float32]:
        out, brought = _patch(table, ids, self.rows, patches)
        left = self.skipped & ~brought
        if left.any():
            raise RuntimeError(
                f"{int(left.sum())} rows of table {table!r} were left to a push's answer "
                f"that did not bring them (a bug)"
            )
        return out


Known = tuple[NDArray[np.bool_], NDArray[np.float32]]
"""Rows of a batch's ids known without a read: which ids, and their rows in that order."""


async def lookup_batch(
    store: RowReader,
    wanted: list[tuple[str, IdArray, NDArray[np.bool_] | None]],
    known: Sequence[Known | None] | None = None,
    *,
    create: bool = True,
) -> list[NDArray[np.float32] | PartialRows]:
    """The rows of every (table, unique ids, skipped or None) of a batch, in one
    `lookup_many` (one request per node): full rows, or a `PartialRows` where ids are
    skipped (left to a push's answer). The `known` rows (per entry, or None) are not
    read but put in."""
    known = known if known is not None else [None] * len(wanted)
    lefts: list[NDArray[np.bool_] | None] = []  # per entry, the ids not read
    for (_, _, skip), know in zip(wanted, known, strict=True):
        lefts.append(skip if know is None else know[0] if skip is None else skip | know[0])
    reads = [
        ids if left is None else ids[~left] for (_, ids, _), left in zip(wanted, lefts, strict=True)
    ]
    parts: dict[str, list[IdArray]] = {}
    for (table, _, _), read in zip(wanted, reads, strict=True):
        if read.shape[0]:
            parts.setdefault(table, []).append(read)
    union = {
        table: got[0] if len(got) == 1 else cast(IdArray, np.unique(np.concatenate(got)))
        for table, got in parts.items()
    }
    rows = await store.lookup_many(union, create=create) if union else {}
    out: list[NDArray[np.float32] | PartialRows] = []
    for (table, ids, skip), know, left, read in zip(wanted, known, lefts, reads, strict=True):
        if table in union:
            every, values = union[table], rows[table]
            mine = values if read is every else values[np.searchsorted(every, read)]
        else:
            mine = np.empty((0, store.config.table(table).dim), np.float32)
        if left is None:
            out.append(mine)
            continue
        full = np.zeros((ids.shape[0], mine.shape[1]), np.float32)
        if know is not None:
            full[know[0]] = know[1]
        full[~left] = mine
        out.append(full if skip is None else PartialRows(rows=full, skipped=skip))
    return out


class BatchPart:
    """One layer's share of a batch lookup: `result()` as a future's."""

    def __init__(self, batch: concurrent.futures.Future[Any], position: int) -> None:
        self._batch = batch
        self._position = position

    def result(self) -> Any:
        return self._batch.result()[self._position]


class Prefetched:
    """Rows fetched ahead for one step: table -> [(unique ids, future rows)].

    `newer` lists the answers of the pushes that may have changed rows after the fetch
    was sent (the push of the step during which it was sent, and one whose answer came
    but whose writes had not landed yet); their rows replace the fetched ones.
    """

    def __init__(self) -> None:
        self.entries: dict[str, list[tuple[IdArray, BatchPart]]] = {}
        self.newer: list[RowPatch] = []
        self.from_answers = 0  # rows taken from earlier pushes' answers
        # per layer (by position in TrainingSession.layers): its ids as the graph step
        # is fed them
        self.fed: dict[int, tuple[FedIds, BatchPart]] = {}

    def find(self, table: str, ids: IdArray) -> BatchPart | None:
        for uniq, fut in self.entries.get(table, []):
            if uniq.shape == ids.shape and np.array_equal(uniq, ids):
                return fut
        return None


@dataclass(frozen=True, slots=True)
class FedLayer:
    """A layer whose rows the graph step gets as arguments, and the column it is called
    on (a key of the step's input dict, or `WHOLE`)."""

    layer: DistributedEmbedding
    key: Any
