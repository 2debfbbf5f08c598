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

from lookup_table.client import PushReads, RowReader
from lookup_table.client.answers import RowGroup, UpdatedRows
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.core.segments import (
    patch_segments,
    segment_bounds,
    segment_members,
    unique_segments,
)
from lookup_table.keras.layer import DistributedEmbedding
from lookup_table.keras.tensors import aligned_empty, aligned_zeros

__all__ = [
    "WHOLE",
    "BatchPart",
    "BatchRows",
    "FedIds",
    "FedLayer",
    "Known",
    "PartialRows",
    "Prefetched",
    "RowPatch",
    "column_of",
    "fed_ids",
    "fed_ids_many",
    "lookup_batch",
    "member",
    "members",
    "patch_rows",
    "patched",
    "whole_batch",
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


def fed_ids_many(layers: Sequence[DistributedEmbedding], values: Sequence[Any]) -> list[FedIds]:
    """`fed_ids` of every layer on its column, the integer columns in one compiled pass."""
    raws = [_column_ids(v) for v in values]
    ints = [
        k
        for k, raw in enumerate(raws)
        if raw.dtype.kind in "iu" and raw.ndim == 1 and _int64_or_none(layers[k].padding_id)
    ]
    out: list[FedIds | None] = [None] * len(raws)
    if ints:
        cols = [as_ids(raws[k], table=layers[k].table) for k in ints]
        bounds = segment_bounds(c.shape[0] for c in cols)
        padding = [layers[k].padding_id for k in ints]
        pads = np.array([0 if p is None else p for p in padding], np.int64)
        padded = np.array([p is not None for p in padding], bool)
        uniq, counts, index = unique_segments(
            np.concatenate(cols) if len(cols) > 1 else cols[0], bounds, pads, padded
        )
        for j, k in enumerate(ints):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            out[k] = FedIds(uniq=uniq[lo : lo + int(counts[j])], index=index[lo:hi])
    for k, raw in enumerate(raws):
        if out[k] is None:  # strings (or a padding id of another type): one at a time
            out[k] = fed_ids(layers[k], raw)
    return cast(list[FedIds], out)


def _int64_or_none(padding: Any) -> bool:
    return padding is None or (
        isinstance(padding, int) and not isinstance(padding, bool) and -(2**63) <= padding < 2**63
    )


RowPatch = Mapping[str, tuple[IdArray, NDArray[np.float32]]]
"""Rows a push produced (its answer): table -> (sorted unique ids, rows)."""


def member(ids: IdArray, among: IdArray | None) -> NDArray[np.bool_] | None:
    """Which of `ids` are in the sorted unique `among` (None if none or no `among`)."""
    if among is None or not among.shape[0] or not ids.shape[0]:
        return None
    pos = np.minimum(np.searchsorted(among, ids), among.shape[0] - 1)
    hit: NDArray[np.bool_] = among[pos] == ids
    return hit if hit.any() else None


def members(
    ids: Sequence[IdArray], among: Sequence[IdArray | None]
) -> list[NDArray[np.bool_] | None]:
    """`member` of each of `ids` (sorted unique) in its `among`, in one compiled pass for
    the int64 ones."""
    out: list[NDArray[np.bool_] | None] = [None] * len(ids)
    both = [
        k
        for k, (i, a) in enumerate(zip(ids, among, strict=True))
        if a is not None and a.shape[0] and i.shape[0] and i.dtype == a.dtype == np.int64
    ]
    for k, (i, a) in enumerate(zip(ids, among, strict=True)):
        if a is not None and i.dtype != np.int64:
            out[k] = member(i, a)
    if not both:
        return out
    bounds = segment_bounds(ids[k].shape[0] for k in both)
    counts = np.diff(bounds)
    among_bounds = segment_bounds(cast(IdArray, among[k]).shape[0] for k in both)
    hit = segment_members(
        np.concatenate([ids[k] for k in both]),
        bounds,
        counts,
        np.concatenate([cast(IdArray, among[k]) for k in both]),
        among_bounds,
    )
    for j, k in enumerate(both):
        mine = hit[bounds[j] : bounds[j + 1]]
        out[k] = mine if mine.any() else None
    return out


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


def patch_rows(
    rows: NDArray[np.float32],
    tables: Sequence[str],
    ids: Sequence[IdArray],
    patches: Iterable[RowPatch],
) -> NDArray[np.bool_]:
    """Put into `rows` (those of `ids[s]` of table `tables[s]`, one segment after the
    other) the rows of `patches`, later patches winning, in one compiled pass per patch
    for int64 ids; returns which rows the patches brought."""
    bounds = segment_bounds(i.shape[0] for i in ids)
    brought = np.zeros(int(bounds[-1]), dtype=bool)
    ints = all(i.dtype == np.int64 for i in ids)
    every = (np.concatenate(ids) if len(ids) > 1 else ids[0]) if ints and ids else None
    empty = np.zeros(0, np.int64), np.zeros((0, rows.shape[1]), np.float32)
    for patch in patches:
        block = _block_of(patch, tables)
        if block is not None and every is not None:  # the answer's block as it came
            patch_segments(every, bounds, block.ids, block.bounds, block.rows, rows, brought)
            continue
        got = [patch.get(t) for t in tables]
        if all(g is None for g in got):
            continue
        if every is not None and all(g is None or g[0].dtype == np.int64 for g in got):
            parts = [empty if g is None else g for g in got]
            patch_bounds = segment_bounds(p[0].shape[0] for p in parts)
            patch_segments(
                every,
                bounds,
                np.concatenate([p[0] for p in parts]),
                patch_bounds,
                np.concatenate([p[1] for p in parts]),
                rows,
                brought,
            )
            continue
        for k, g in enumerate(got):  # string ids: one table at a time
            if g is not None:
                lo, hi = int(bounds[k]), int(bounds[k + 1])
                out, hit = _patch(tables[k], ids[k], rows[lo:hi], [{tables[k]: g}])
                rows[lo:hi] = out
                brought[lo:hi] |= hit
    return brought


def _block_of(patch: RowPatch, tables: Sequence[str]) -> RowGroup | None:
    """The block of `patch` that holds exactly `tables` in this order, if any."""
    if isinstance(patch, UpdatedRows):
        for block in patch.groups:
            if len(block.tables) == len(tables) and list(block.tables) == list(tables):
                return block
    return None


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


@dataclass(frozen=True, slots=True)
class BatchRows:
    """The rows of a batch lookup's entries, one array per dim (`tables`): the rows of
    that dim's entries one after the other, then a zero row (what the graph step is fed
    as is, when its layers are these entries). `self[k]` is entry k's rows (a view), or
    a `PartialRows` where it has ids `skipped`."""

    tables: Mapping[int, NDArray[np.float32]]
    dims: list[int]  # per entry
    starts: list[int]  # per entry, its first row in its dim's table
    counts: list[int]
    skipped: list[NDArray[np.bool_] | None]

    def __len__(self) -> int:
        return len(self.dims)

    def __getitem__(self, k: int) -> NDArray[np.float32] | PartialRows:
        start = self.starts[k]
        rows = self.tables[self.dims[k]][start : start + self.counts[k]]
        skip = self.skipped[k]
        return rows if skip is None else PartialRows(rows=rows, skipped=skip)


async def lookup_batch(
    store: RowReader,
    wanted: list[tuple[str, IdArray, NDArray[np.bool_] | None]],
    known: Sequence[Known | None] | None = None,
    *,
    create: bool = True,
    along: PushReads | None = None,
) -> BatchRows:
    """The rows of every (table, unique ids, skipped or None) of a batch, in one
    `lookup_many` (one request per node), written into one array per dim: skipped ids'
    rows are zeros (left to a push's answer). The `known` rows (per entry, or None) are
    not read but put in. `along`: rows read through their owners go with a push."""
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
    rows = await store.lookup_many(union, create=create, along=along) if union else {}
    dims = [store.config.table(table).dim for table, _, _ in wanted]
    counts = [int(ids.shape[0]) for _, ids, _ in wanted]
    starts: list[int] = []
    totals: dict[int, int] = {}
    for dim, count in zip(dims, counts, strict=True):
        starts.append(totals.get(dim, 0))
        totals[dim] = starts[-1] + count
    # skipped rows stay zeros: a dim's array is zeroed whole (cheaper than a masked
    # write per entry); otherwise only its last row
    zeroed = {dim for dim, (_, _, skip) in zip(dims, wanted, strict=True) if skip is not None}
    tables: dict[int, NDArray[np.float32]] = {}
    for dim, total in totals.items():
        # aligned: the graph step takes them without a copy (`as_tensor`)
        if dim in zeroed:
            tables[dim] = aligned_zeros((total + 1, dim), np.float32)
        else:
            tables[dim] = aligned_empty((total + 1, dim), np.float32)
            tables[dim][total] = 0.0
    names = [table for table, _, _ in wanted]
    if len(set(names)) == len(names):  # each table's rows read are one entry's, in order
        for dim, total in totals.items():
            _place_dim(
                tables[dim][:total],
                [
                    (counts[k], known[k], lefts[k], rows.get(names[k]))
                    for k in range(len(wanted))
                    if dims[k] == dim
                ],
            )
        return BatchRows(
            tables=tables,
            dims=dims,
            starts=starts,
            counts=counts,
            skipped=[s for _, _, s in wanted],
        )
    for k, ((table, _, _), know, left, read) in enumerate(
        zip(wanted, known, lefts, reads, strict=True)
    ):
        if not counts[k]:
            continue
        out = tables[dims[k]][starts[k] : starts[k] + counts[k]]
        every, values = union.get(table), rows.get(table)
        if left is None:  # every id read: straight into its place
            every, values = cast(IdArray, every), cast(NDArray[Any], values)
            if read is every:
                out[...] = values
            elif values.dtype == np.float32:  # `read` is in `every`: no index is clipped
                np.take(values, np.searchsorted(every, read), axis=0, out=out, mode="clip")
            else:
                out[...] = values[np.searchsorted(every, read)]
            continue
        if know is not None:
            out[know[0]] = know[1]
        if every is not None and values is not None:
            out[~left] = values if read is every else values[np.searchsorted(every, read)]
    return BatchRows(
        tables=tables, dims=dims, starts=starts, counts=counts, skipped=[s for _, _, s in wanted]
    )


def _place_dim(
    rows: NDArray[np.float32],
    parts: Sequence[tuple[int, Known | None, NDArray[np.bool_] | None, NDArray[Any] | None]],
) -> None:
    """Write into `rows` the rows of a dim's entries, one after the other: per entry
    (count, known rows, ids not read, rows read of the ids it read (all of them, in
    order)). One copy of the rows read and one of the known rows for them all; rows
    neither read nor known stay as they are."""
    read = [values for _, _, _, values in parts if values is not None]
    if all(left is None for _, _, left, _ in parts):  # every id read: straight into place
        if read:
            np.concatenate(read, out=rows, casting="unsafe")
        return
    left = np.concatenate([np.zeros(n, bool) if lf is None else lf for n, _, lf, _ in parts])
    if read:
        rows[~left] = np.concatenate(read) if len(read) > 1 else read[0]
    knows = [know for _, know, _, _ in parts if know is not None]
    if knows:
        where = np.concatenate([np.zeros(n, bool) if k is None else k[0] for n, k, _, _ in parts])
        rows[where] = np.concatenate([k[1] for k in knows]) if len(knows) > 1 else knows[0][1]


class BatchPart:
    """One layer's share of a batch lookup: `result()` as a future's."""

    def __init__(self, batch: concurrent.futures.Future[Any], position: int) -> None:
        self._batch = batch
        self._position = position

    def result(self) -> Any:
        return self._batch.result()[self._position]


def whole_batch(parts: Sequence[BatchPart]) -> BatchRows | None:
    """The batch lookup whose entries `parts` are, all of them in order; else None."""
    if not parts:
        return None
    batch = parts[0]._batch
    if any(p._batch is not batch or p._position != k for k, p in enumerate(parts)):
        return None
    got = batch.result()
    return got if isinstance(got, BatchRows) and len(got) == len(parts) else None


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
