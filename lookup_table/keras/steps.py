"""The graph step: one `tf.function` per step, fed the rows of the layers called on a
model input as arguments (`FedBatch`), the other layers looking up inside it;
`fed_train_step` builds it, `GraphStep` runs it with a `TrainingSession`'s rows."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import tensorflow as tf
from numpy.typing import NDArray

from lookup_table.core.segments import place_segments, segment_bounds
from lookup_table.keras.layer import DistributedEmbedding, RecordedLookup
from lookup_table.keras.rows import (
    BatchRows,
    FedIds,
    FedLayer,
    RowPatch,
    column_of,
    patch_rows,
)
from lookup_table.keras.session import TrainingSession
from lookup_table.keras.tensors import aligned_empty, as_tensor, copied_tensor

__all__ = ["FedBatch", "GraphStep", "fed_train_step", "feed_layers"]


class FedBatch:
    """The fed layers' rows of one batch as graph-step arguments, and the way back from
    their gradients to (table, unique ids, summed gradient) records.

    The rows come as few tensors, whatever the number of layers (each argument costs
    TF's call path): `args` = (one table per dim: the rows of its layers one after the
    other, then a zero row; one index of every layer's positions; the bounds of each
    layer's part of it). `rows` are per layer, or the `BatchRows` of a batch lookup
    whose entries are these layers: its tables are taken as they are. `patches` (push
    answers, later winning) are put into the tables; the rows `skipped` (per layer, or
    None) must come from them.
    """

    def __init__(
        self,
        fed: Sequence[FedLayer],
        ids: Sequence[FedIds],
        rows: Sequence[NDArray[np.float32]] | BatchRows,
        *,
        patches: Sequence[RowPatch] = (),
        skipped: Sequence[NDArray[np.bool_] | None] | None = None,
    ) -> None:
        self.fed = list(fed)
        self.ids = list(ids)
        self.dims = sorted({f.layer.dim for f in fed})
        self.offsets = [0] * len(self.fed)
        zero_rows = [0] * len(self.fed)  # per layer, the zero row of its dim's table
        block = rows if isinstance(rows, BatchRows) else None
        if block is not None and not self._fits(block):
            raise RuntimeError("a batch lookup's entries are not the fed layers' (a bug)")
        tables = []
        for dim in self.dims:
            group = [k for k, f in enumerate(self.fed) if f.layer.dim == dim]
            starts = segment_bounds(self.ids[k].uniq.shape[0] for k in group)
            total = int(starts[-1])
            if block is not None:  # the lookup's table of this dim is this one already
                table = block.tables[dim]
            else:
                table = aligned_empty((total + 1, dim), np.float32)
                listed = cast(Sequence[NDArray[np.float32]], rows)
                np.concatenate([listed[k] for k in group], out=table[:total])
                table[total] = 0.0
            if patches or skipped is not None:
                self._complete(table[:total], group, patches, skipped)
            for k, start in zip(group, starts.tolist(), strict=False):
                self.offsets[k] = start
                zero_rows[k] = total
            tables.append(table)
        bounds = segment_bounds(i.index.shape[0] for i in self.ids)
        if self.ids:
            index = aligned_empty(int(bounds[-1]), np.int64)
            np.concatenate([i.index for i in self.ids], out=index)
            place_segments(
                index,
                bounds,
                np.array([i.uniq.shape[0] for i in self.ids], np.int64),
                np.array(self.offsets, np.int64),
                np.array(zero_rows, np.int64),
            )
        else:
            index = np.zeros(0, np.int64)
        # the tables and the index shared with TensorFlow, not copied: neither is written
        # to again (the bounds, a few numbers, are copied into aligned memory)
        self.args = ([as_tensor(t) for t in tables], as_tensor(index), copied_tensor(bounds))

    def _fits(self, block: BatchRows) -> bool:
        """Whether `block`'s entries are the fed layers' rows, in order (its tables are
        then the graph step's, the rows of each dim one layer after the other)."""
        return block.dims == [f.layer.dim for f in self.fed] and block.counts == [
            i.uniq.shape[0] for i in self.ids
        ]

    def _complete(
        self,
        rows: NDArray[np.float32],
        group: Sequence[int],
        patches: Sequence[RowPatch],
        skipped: Sequence[NDArray[np.bool_] | None] | None,
    ) -> None:
        """Put `patches` into the rows of the layers `group` (one after the other);
        RuntimeError where a skipped row was not brought."""
        tables = [self.fed[k].layer.table for k in group]
        uniq = [self.ids[k].uniq for k in group]
        brought = patch_rows(rows, tables, uniq, patches)
        if skipped is None or all(skipped[k] is None for k in group):
            return
        left = (
            np.concatenate(
                [
                    np.zeros(u.shape[0], bool) if skipped[k] is None else skipped[k]
                    for k, u in zip(group, uniq, strict=True)
                ]
            )
            & ~brought
        )
        if left.any():
            first = int(
                np.searchsorted(
                    np.cumsum([u.shape[0] for u in uniq]), np.flatnonzero(left)[0], side="right"
                )
            )
            raise RuntimeError(
                f"{int(left.sum())} rows of table {tables[first]!r} and others were left to "
                f"a push's answer that did not bring them (a bug)"
            )

    def records(
        self, table_grads: Sequence[Any]
    ) -> tuple[list[RecordedLookup], list[NDArray[np.float32]]]:
        """Per fed layer: (table, unique ids) and their summed gradient, from the step's
        gradients w.r.t. the tables of `args`."""
        table_np = [np.asarray(g) for g in table_grads]
        grads = [
            table_np[self.dims.index(f.layer.dim)][start : start + ids.uniq.shape[0]]
            for f, ids, start in zip(self.fed, self.ids, self.offsets, strict=True)
        ]
        records = [
            RecordedLookup(table=f.layer.table, ids=ids.uniq, rows=None)
            for f, ids in zip(self.fed, self.ids, strict=True)
        ]
        return records, grads


def feed_layers(fed: Sequence[FedLayer], inputs: Any, tables: Any, index: Any, bounds: Any) -> None:
    """(At trace time, inside `begin_step`/`end_step`.) Hand each fed layer its column,
    its table and its part of the index (see `DistributedEmbedding.feed`)."""
    dims = sorted({f.layer.dim for f in fed})
    for k, f in enumerate(fed):
        column = column_of(inputs, f.key)
        f.layer.feed(column, tables[dims.index(f.layer.dim)], index[bounds[k] : bounds[k + 1]])


def fed_train_step(
    layers: Sequence[DistributedEmbedding],
    fed: Sequence[FedLayer],
    dense_vars: Sequence[Any],
    *,
    inputs_of: Callable[[Any], Any],
    forward: Callable[[Any], tuple[Any, Any]],
    after: Callable[[Any, Any, Any], Any],
    unpack: Callable[[Any], Any] | None = None,
) -> Any:
    """A train step as one tf.function: `step(data, tables, index, bounds)` ->
    (what `after` returns, row gradients of the in-graph lookups, gradients w.r.t.
    `tables`, dense gradients).

    `forward(data)` -> (loss, state) runs under the tape, with `fed` layers fed from
    `tables` (their columns found in `inputs_of(data)`) and the others looking up inside
    the graph; `after(data, loss, state)` runs after it (e.g. Keras' metrics).
    `unpack(data)`, if given, makes the data these see of the step's argument (e.g.
    columns stacked into one tensor, as each argument costs TF's call path)."""

    @tf.function(reduce_retracing=True)
    def step(data: Any, tables: Any, index: Any, bounds: Any) -> Any:
        if unpack is not None:
            data = unpack(data)
        with tf.GradientTape() as tape:
            for layer in layers:
                layer.begin_step(tape)  # at trace time: a new trace, rows watched
            for table in tables:
                tape.watch(table)
            feed_layers(fed, inputs_of(data), tables, index, bounds)
            loss, state = forward(data)
        rows = [r for layer in layers for r in layer.graph_rows]
        n, m = len(rows), len(tables)
        grads = tape.gradient(loss, rows + list(tables) + list(dense_vars))
        for layer in layers:
            layer.end_step()
        row_grads = [
            tf.zeros_like(r) if g is None else tf.convert_to_tensor(g)
            for r, g in zip(rows + list(tables), grads[: n + m], strict=True)
        ]
        dense_grads = [
            tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
            for v, g in zip(dense_vars, grads[n + m :], strict=True)
        ]
        return after(data, loss, state), row_grads[:n], row_grads[n:], dense_grads

    return step


class _NotFlat(Exception):
    """An argument the flat call cannot take apart (it goes through the tf.function whole)."""


_TENSOR = object()  # where a tensor was, in a `_flatten` layout
_FLAT_LAYOUTS = 8  # more layouts than this: the tf.function's own call, which relaxes shapes


def _flatten(value: Any, tensors: list[Any]) -> Hashable:
    """The layout of `value` (its containers, dict keys, other leaves and where its
    tensors were), its tensors (composites' components) appended to `tensors`."""
    if isinstance(value, tf.Tensor):
        tensors.append(value)
        return _TENSOR
    kind = type(value)
    if kind is tuple or kind is list:
        return (kind, tuple(_flatten(v, tensors) for v in value))
    if kind is dict:
        return (dict, tuple((k, _flatten(v, tensors)) for k, v in value.items()))
    if isinstance(value, tf.RaggedTensor | tf.SparseTensor):
        tensors.extend(tf.nest.flatten(value, expand_composites=True))
        return (tf.TypeSpec, tf.type_spec_from_value(value))
    if value is None or kind in (str, int, float, bool, bytes):
        return (kind, value)
    raise _NotFlat


def _rebuild(layout: Any, tensors: Iterator[Any]) -> Any:
    """(In the graph.) The value of a `_flatten` layout, its tensors taken from `tensors`."""
    if layout is _TENSOR:
        return next(tensors)
    kind, inner = layout
    if kind is tuple or kind is list:
        return kind(_rebuild(v, tensors) for v in inner)
    if kind is dict:
        return {k: _rebuild(v, tensors) for k, v in inner}
    if kind is tf.TypeSpec:
        parts = [next(tensors) for _ in tf.nest.flatten(inner, expand_composites=True)]
        return tf.nest.pack_sequence_as(inner, parts, expand_composites=True)
    return inner


class GraphStep:
    """Runs a step built by `make(fed)` (see `fed_train_step`) with the session's rows:
    the fed layers' rows as arguments (`training`: a training step's, prefetched and
    patched; else read with `create=False`), the others' through in-graph lookups.

    Which candidates are really fed is known after the first trace (a layer called on a
    transformed column is not): the step is then rebuilt without the others."""

    def __init__(
        self,
        session: TrainingSession,
        candidates: Sequence[FedLayer],
        make: Callable[[list[FedLayer]], Any],
        *,
        training: bool = True,
    ) -> None:
        self.session = session
        self.fed: list[FedLayer] = list(candidates)
        self.training = training
        self._make = make
        self._fn: Any = None
        # per argument layout, the step taking its tensors alone (`_call`), and the
        # concrete function it ran last, with the specs of its inputs
        self._flat: dict[Hashable, Any] = {}
        self._last: dict[Hashable, tuple[Any, list[Any]]] = {}
        if training:
            session.fed_layers = [f.layer for f in self.fed]

    def run(self, data: Any, features: Any) -> tuple[Any, FedBatch]:
        """Run the step on `data` whose model inputs are `features`: what it returns,
        and the fed rows it was given."""
        session = self.session
        if self.training:
            ids, rows, skipped, patches = session.fed_parts(self.fed, features)
            batch = FedBatch(self.fed, ids, rows, patches=patches, skipped=skipped)
        else:
            ids, block = session.evaluation_rows(self.fed, features)
            batch = FedBatch(self.fed, ids, block)
        if self._fn is None:
            self._fn, self._flat, self._last = self._make(self.fed), {}, {}
            self._trace(data, batch.args)  # which feeds are taken
            taken = [f for f in self.fed if f.layer.fed]
            if len(taken) < len(self.fed):  # e.g. the model transforms a column first
                self.fed = taken
                if self.training:
                    session.fed_layers = [f.layer for f in taken]
                self._fn = None
                return self.run(data, features)
        with session.lookups():
            return self._call(data, batch.args), batch

    @property
    def traces(self) -> int:
        """How many times the step was traced: once for batches of one layout and size,
        whatever their counts of unique ids."""
        functions = [*self._flat.values(), *([self._fn] if self._fn is not None else [])]
        return sum(int(f.experimental_get_tracing_count()) for f in functions)

    def _flat_step(self, data: Any, args: Any) -> tuple[Any, list[Any], Hashable]:
        """The step that takes the tensors of (data, *args) alone, those tensors and their
        layout; None when they cannot be taken apart or there are too many layouts."""
        tensors: list[Any] = []
        try:
            layout = _flatten((data, args), tensors)
        except _NotFlat:
            return None, tensors, None
        known = self._flat.get(layout)
        if known is None and len(self._flat) < _FLAT_LAYOUTS:
            structured = self._fn.python_function

            @tf.function(reduce_retracing=True)
            def flat(*parts: Any) -> Any:
                data, args = _rebuild(layout, iter(parts))
                return structured(data, *args)

            self._flat[layout] = known = flat
        return known, tensors, layout

    def _trace(self, data: Any, args: Any) -> None:
        flat, tensors, _ = self._flat_step(data, args)
        if flat is None:
            self._fn.get_concrete_function(data, *args)
            return
        # one trace for every batch of this size: the row tables and the index have as
        # many rows as a batch has unique ids, so a trace of this batch's counts would fit
        # no other batch (a second trace, and TF's warning when several steps do so)
        tables, index, bounds = args  # FedBatch.args: the last tensors, in this order
        data_tensors = tensors[: len(tensors) - len(tables) - 2]
        relaxed = [tf.TensorSpec([None, *t.shape[1:]], t.dtype) for t in (*tables, index)]
        flat.get_concrete_function(*data_tensors, *relaxed, bounds)

    def _call(self, data: Any, args: Any) -> Any:
        """The step on (data, *args): their tensors alone when it can (a tf.function binds
        and converts every argument of a nest in Python, the leaves that are not tensors
        (a column's name) the dearest), else the nest."""
        flat, tensors, layout = self._flat_step(data, args)
        if flat is None:
            return self._fn(data, *args)
        last = self._last.get(layout)
        if last is not None and all(
            t.dtype == spec.dtype and spec.shape.is_compatible_with(t.shape)
            for t, spec in zip(tensors, last[1], strict=True)
        ):
            # the trace that took the last batch takes this one: its concrete function,
            # without the tf.function's look-up by the arguments' types
            return last[0](*tensors)
        out = flat(*tensors)
        concrete = flat.get_concrete_function(*tensors)
        self._last[layout] = (concrete, tf.nest.flatten(concrete.structured_input_signature))
        return out

    def __call__(
        self, data: Any, features: Any
    ) -> tuple[Any, list[RecordedLookup], list[NDArray[np.float32]], list[Any]]:
        """Run a training step (`fed_train_step`); returns (what its `after` returned,
        the lookups' records, their row gradients, the dense gradients)."""
        (out, row_grads, table_grads, dense_grads), batch = self.run(data, features)
        records: list[RecordedLookup | None] = [
            rec
            for layer in self.session.layers
            for rec in layer.graph_records[: len(layer.graph_rows)]
        ]
        if any(r is None for r in records) or len(records) != len(row_grads):
            raise RuntimeError("a lookup of the step did not record its ids (a bug)")
        fed_records, fed_grads = batch.records(table_grads)
        grads = [np.asarray(g) for g in row_grads] + fed_grads
        return out, cast(list[RecordedLookup], records) + fed_records, grads, dense_grads
