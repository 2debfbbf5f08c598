"""`DistributedEmbedding`: a Keras layer whose table lives in memcached.

Use it where you would use `keras.layers.Embedding` (dense, ragged or sparse int64 or
string ids, an optional combiner), and train with `model.fit` on a `RemoteOptimizer` or
with `trainer.Trainer`. A call looks up its unique ids' rows from its `RowSource` and
gathers from them, so a tape's gradient w.r.t. those rows is one summed gradient per
unique id. Inputs, outputs and combiners: docs/training.md.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Protocol, cast

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import NDArray

from lookup_table.config import TableSpec
from lookup_table.core.keys import IdArray, as_ids

__all__ = [
    "DistributedEmbedding",
    "RecordedLookup",
    "RowSource",
    "combine_segments",
    "distributed_layers",
]

logger = logging.getLogger(__name__)

_COMBINERS = (None, "sum", "mean", "sqrtn")


class RowSource(Protocol):
    """Where a layer's rows come from (the trainer's prefetching store client)."""

    def rows(self, table: str, ids: IdArray, *, training: bool) -> NDArray[np.float32]:
        """Rows of unique `ids`, float32 (len(ids), dim); create missing ones if training."""
        ...


@dataclass(slots=True)
class RecordedLookup:
    """One lookup of a training step: the unique ids and the watched row tensor."""

    table: str
    ids: IdArray
    rows: tf.Tensor


def _not_bound(table: str) -> str:
    return (
        f"DistributedEmbedding({table!r}) is not bound to a cluster: compile its model with "
        f"optimizer=lookup_table.keras.RemoteOptimizer(config) for model.fit / evaluate / "
        f"predict, train it with trainer.Trainer, or call layer.bind(source) first"
    )


def _to_ids(values: NDArray[Any], table: str) -> IdArray:
    if values.dtype.kind in "SO":
        return as_ids(values.tolist(), table=table)
    return as_ids(values, table=table)


def combine_segments(
    weighted: tf.Tensor, weights: tf.Tensor, segments: tf.Tensor, groups: Any, combiner: str
) -> tf.Tensor:
    """Combine the weighted rows `w_i e_i` (k, dim) of each segment (k,) into (groups, dim):
    "sum" = sum w_i e_i, "mean" = that / sum w_i, "sqrtn" = that / sqrt(sum w_i^2) (0 where
    the denominator is 0), as `tf.nn.safe_embedding_lookup_sparse` does."""
    total = tf.math.unsorted_segment_sum(weighted, segments, num_segments=groups)
    if combiner == "sum":
        return total
    if combiner == "mean":
        denom = tf.math.unsorted_segment_sum(weights, segments, num_segments=groups)
    else:
        denom = tf.sqrt(tf.math.unsorted_segment_sum(weights * weights, segments, groups))
    return tf.math.divide_no_nan(total, denom[:, None])


@keras.saving.register_keras_serializable(package="lookup_table")
class DistributedEmbedding(keras.layers.Layer):
    """An embedding layer backed by the distributed lookup table.

    Registered with Keras' serialization (as `lookup_table>DistributedEmbedding`), so
    `keras.models.load_model` reads a model that `model.save("m.keras")` wrote once
    `lookup_table.keras` is imported (it also registers `RemoteOptimizer`); the loaded
    layers are not bound: compile with a `RemoteOptimizer` or train with `trainer.Trainer`.

    Args:
        table: a `TableSpec` (dim taken from it) or a table name (then pass `dim`).
        combiner: None, "sum", "mean" or "sqrtn" (see the module docstring).
        dim: the table's dim when `table` is a name.
        padding_id: an id that contributes nothing (e.g. 0 or "").
        feature: the input feature this layer embeds; lets the trainer prefetch
            the next batch's rows while the current batch computes.
    """

    def __init__(
        self,
        table: str | TableSpec,
        combiner: str | None = None,
        *,
        dim: int | None = None,
        padding_id: int | str | None = None,
        feature: str | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(table, TableSpec):
            if dim is not None and dim != table.dim:
                raise ValueError(f"dim={dim} but table {table.name!r} has dim={table.dim}")
            dim, table = table.dim, table.name
        if not isinstance(table, str) or not table:
            raise ValueError(f"table must be a table name or a TableSpec, got {table!r}")
        if dim is None or isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(
                f"`dim` must be a positive integer for table {table!r}. Received: dim={dim!r} "
                f"(pass the TableSpec from the cluster config to take its dim)"
            )
        if combiner not in _COMBINERS:
            raise ValueError(
                f"combiner must be one of None, 'sum', 'mean', 'sqrtn'. Received: {combiner!r}"
            )
        kwargs.setdefault("name", f"embedding_{table}")
        super().__init__(trainable=False, **kwargs)
        self.table = table
        self.dim = dim
        self.combiner = combiner
        self.padding_id = padding_id
        self.feature = feature
        self._source: RowSource | None = None
        self._tape: tf.GradientTape | None = None
        self.records: list[RecordedLookup] = []
        # graph mode (inside tf.function): symbolic row tensors of the current trace, and
        # what each lookup slot fetched in the last execution (filled by py_function)
        self.graph_rows: list[tf.Tensor] = []
        self.graph_records: list[RecordedLookup | None] = []
        # rows looked up outside the graph for a call on exactly `inputs` (see `feed`)
        self._feed: tuple[Any, tf.Tensor, tf.Tensor] | None = None
        self.fed = False

    # ------------------------------------------------------------ trainer hooks

    def bind(self, source: RowSource | None) -> None:
        """Give the layer its row source (the trainer does this)."""
        self._source = source

    @property
    def source(self) -> RowSource | None:
        """The row source the layer is bound to (None: not bound)."""
        return self._source

    def begin_step(self, tape: tf.GradientTape | None) -> None:
        """Start a step: lookups are watched by `tape` and recorded in `records`.

        Inside a `tf.function` (at trace time) it also starts a new trace: the
        symbolic row tensors of the trace are collected in `graph_rows`, and each
        execution fills `graph_records` slot by slot in the same order.
        """
        self._tape = tape
        self.records = []
        if not tf.executing_eagerly():
            self.graph_rows = []
            self.graph_records = []

    def end_step(self) -> None:
        """Stop watching: lookups after this are not recorded for gradients."""
        self._tape = None
        self._feed = None

    def feed(self, inputs: Any, table: tf.Tensor, index: tf.Tensor) -> None:
        """(The trainer, at trace time, inside `begin_step`/`end_step`.) Serve a call on
        exactly the tensor `inputs` (dense or ragged ids, no sparse weights) from `table`
        (n + 1, dim): rows (of this and maybe other layers) whose last row is zeros, and
        `index`, per flat position its row in `table` (n, the zero row, for a padding
        id), both computed outside the graph as the py_function lookup would; `fed`
        tells afterwards whether a call took them. The caller watches `table` and
        pushes its gradient itself."""
        self._feed = (inputs, table, index)
        self.fed = False

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            table=self.table,
            combiner=self.combiner,
            dim=self.dim,
            padding_id=self.padding_id,
            feature=self.feature,
        )
        config.pop("trainable", None)
        return config

    # ------------------------------------------------------------ shapes

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        shape = tuple(input_shape)
        if self.combiner is None:
            return (*shape, self.dim)
        return (*shape[:-1], self.dim) if len(shape) > 1 else (shape[0], self.dim)

    # ------------------------------------------------------------ the lookup

    def _lookup(self, ids: IdArray, training: bool) -> tuple[tf.Tensor, NDArray[np.intp]]:
        """Rows tensor (u, dim) of the unique ids and the inverse index of `ids`."""
        if self._source is None:
            raise RuntimeError(_not_bound(self.table))
        if ids.shape[0] == 0:
            uniq, inverse = ids, np.zeros(0, dtype=np.intp)
        else:
            uniq_any, inverse = np.unique(ids, return_inverse=True)
            uniq = cast(IdArray, uniq_any)  # np.unique keeps the dtype: int64 or object
        rows = np.asarray(self._source.rows(self.table, uniq, training=training), np.float32)
        if rows.shape != (uniq.shape[0], self.dim):
            raise ValueError(
                f"the row source returned shape {rows.shape} for {uniq.shape[0]} ids of table "
                f"{self.table!r} (dim={self.dim})"
            )
        tensor = tf.constant(rows)
        if self._tape is not None:
            self._tape.watch(tensor)
            self.records.append(RecordedLookup(table=self.table, ids=uniq, rows=tensor))
        return tensor, inverse.reshape(-1).astype(np.intp)

    def not_padding(self, ids: IdArray) -> NDArray[np.bool_]:
        """Which of `ids` (n,) are not the padding id, bool (n,) (the trainer prefetches
        exactly these)."""
        if self.padding_id is None:
            return np.ones(ids.shape[0], dtype=bool)
        pad = self.padding_id
        return (
            np.asarray([x != pad for x in ids.tolist()], dtype=bool)
            if ids.dtype == object
            else ids != pad
        )

    def call(
        self, inputs: Any, sparse_weights: tf.SparseTensor | None = None, training: bool = False
    ) -> Any:
        if not isinstance(inputs, tf.SparseTensor) and sparse_weights is not None:
            raise ValueError("sparse_weights is only for SparseTensor inputs")
        if isinstance(inputs, tf.RaggedTensor) and inputs.ragged_rank != 1:
            raise ValueError(f"ragged ids must have ragged_rank 1, got {inputs.ragged_rank}")
        if (
            self.combiner is not None
            and not isinstance(inputs, tf.SparseTensor | tf.RaggedTensor)
            and tf.convert_to_tensor(inputs).shape.rank == 0
        ):
            raise ValueError("a combiner needs at least 1-D ids")
        if not tf.executing_eagerly():
            if self._source is None:
                raise RuntimeError(_not_bound(self.table))
            return self._call_graph(inputs, sparse_weights, bool(training))
        if isinstance(inputs, tf.SparseTensor):
            return self._call_sparse(inputs, sparse_weights, bool(training))
        if sparse_weights is not None:
            raise ValueError("sparse_weights is only for SparseTensor inputs")
        if isinstance(inputs, tf.RaggedTensor):
            return self._call_ragged(inputs, bool(training))
        return self._call_dense(tf.convert_to_tensor(inputs), bool(training))

    def _call_dense(self, inputs: tf.Tensor, training: bool) -> tf.Tensor:
        values = inputs.numpy()
        shape = values.shape
        flat = _to_ids(values.reshape(-1), self.table)
        valid = self.not_padding(flat)
        rows, inverse = self._lookup(flat[valid], training)
        if self.combiner is None:
            # padded positions gather an extra zero row (its gradient is dropped)
            index = np.full(flat.shape[0], rows.shape[0], dtype=np.int64)
            index[valid] = inverse
            table = tf.concat([rows, tf.zeros((1, self.dim), tf.float32)], axis=0)
            return tf.reshape(tf.gather(table, index), (*shape, self.dim))
        if len(shape) == 0:
            raise ValueError("a combiner needs at least 1-D ids")
        groups = int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0]
        per_group = shape[-1] if len(shape) > 1 else 1
        segments = (np.arange(flat.shape[0]) // per_group)[valid]
        out = self._combine(rows, inverse, segments, None, groups)
        return tf.reshape(out, (*shape[:-1], self.dim) if len(shape) > 1 else (shape[0], self.dim))

    def _call_ragged(self, inputs: tf.RaggedTensor, training: bool) -> Any:
        if inputs.ragged_rank != 1:
            raise ValueError(f"ragged ids must have ragged_rank 1, got {inputs.ragged_rank}")
        values = _to_ids(inputs.flat_values.numpy(), self.table)
        splits = inputs.row_splits.numpy()
        valid = self.not_padding(values)
        rows, inverse = self._lookup(values[valid], training)
        if self.combiner is None:
            index = np.full(values.shape[0], rows.shape[0], dtype=np.int64)
            index[valid] = inverse
            table = tf.concat([rows, tf.zeros((1, self.dim), tf.float32)], axis=0)
            return tf.RaggedTensor.from_row_splits(tf.gather(table, index), splits)
        segments = (np.searchsorted(splits, np.arange(values.shape[0]), side="right") - 1)[valid]
        return self._combine(rows, inverse, segments, None, splits.shape[0] - 1)

    def _call_sparse(
        self, inputs: tf.SparseTensor, weights: tf.SparseTensor | None, training: bool
    ) -> tf.Tensor:
        if self.combiner is None:
            raise ValueError(
                f"DistributedEmbedding({self.table!r}) got a SparseTensor: pass combiner="
                f"'sum', 'mean' or 'sqrtn' (as tf.nn.safe_embedding_lookup_sparse needs)"
            )
        if inputs.dense_shape.shape[0] != 2:
            raise ValueError(
                f"sparse ids must be 2-D (batch, k), got rank {inputs.dense_shape.shape[0]}"
            )
        values = _to_ids(inputs.values.numpy(), self.table)
        batch = int(inputs.dense_shape.numpy()[0])
        segments = inputs.indices.numpy()[:, 0]
        w = None
        keep = self.not_padding(values)
        if weights is not None:
            w = weights.values.numpy().astype(np.float32)
            if w.shape[0] != values.shape[0]:
                raise ValueError(
                    f"sparse_weights has {w.shape[0]} values for {values.shape[0]} ids"
                )
            # as safe_embedding_lookup_sparse: mean/sqrtn prune weights <= 0, sum keeps
            # negative weights (w * e) and only zero weights contribute nothing
            keep &= (w != 0) if self.combiner == "sum" else (w > 0)
            w = w[keep]
        rows, inverse = self._lookup(values[keep], training)
        return self._combine(rows, inverse, segments[keep], w, batch)

    def _combine(
        self,
        rows: tf.Tensor,
        inverse: NDArray[np.intp],
        segments: NDArray[Any],
        weights: NDArray[np.float32] | None,
        groups: int,
    ) -> tf.Tensor:
        seg = tf.constant(segments.astype(np.int64))
        emb = tf.gather(rows, tf.constant(inverse.astype(np.int64)))
        if weights is None:
            w = tf.ones((inverse.shape[0],), tf.float32)
        else:
            w = tf.constant(weights)
            emb = emb * w[:, None]
        if self.combiner is None:
            raise RuntimeError(f"layer {self.name!r}: combining without a combiner (a bug)")
        return combine_segments(emb, w, seg, groups, self.combiner)

    # ------------------------------------------------------------ graph mode

    def _py_lookup(
        self, slot: int | None, training: bool, ids_t: tf.Tensor, weights_t: tf.Tensor
    ) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        """Runs inside the graph (tf.py_function): rows of the unique contributing ids
        and, per flat position, its row (or u, the zero row, if it contributes nothing)."""
        ids = _to_ids(ids_t.numpy(), self.table)
        keep = self.not_padding(ids)
        weights = weights_t.numpy()
        if weights.shape[0] not in (0, ids.shape[0]):
            raise ValueError(f"sparse_weights has {weights.shape[0]} values for {ids.shape[0]} ids")
        if weights.shape[0] == ids.shape[0] and weights.shape[0]:
            keep &= (weights != 0) if self.combiner == "sum" else (weights > 0)
        if self._source is None:
            raise RuntimeError(_not_bound(self.table))
        kept = ids[keep]
        uniq: IdArray
        if kept.shape[0]:
            uniq_any, inverse = np.unique(kept, return_inverse=True)
            uniq = cast(IdArray, uniq_any)  # np.unique keeps the dtype: int64 or object
        else:
            uniq, inverse = kept, np.zeros(0, dtype=np.intp)
        rows = np.asarray(self._source.rows(self.table, uniq, training=training), np.float32)
        if rows.shape != (uniq.shape[0], self.dim):
            raise ValueError(
                f"the row source returned shape {rows.shape} for "
                f"{uniq.shape[0]} ids of table {self.table!r} (dim={self.dim})"
            )
        index = np.full(ids.shape[0], uniq.shape[0], dtype=np.int64)
        index[keep] = inverse.reshape(-1)
        if slot is not None:
            while len(self.graph_records) <= slot:
                self.graph_records.append(None)
            self.graph_records[slot] = RecordedLookup(table=self.table, ids=uniq, rows=None)
        return rows, index

    def _call_graph(
        self, inputs: Any, sparse_weights: tf.SparseTensor | None, training: bool
    ) -> Any:
        """The same lookup inside a tf.function: the fetch runs as a py_function, the
        gather and the combiner as graph ops."""

        original = inputs
        weights = tf.zeros((0,), tf.float32)
        if isinstance(inputs, tf.SparseTensor):
            if self.combiner is None:
                raise ValueError(
                    f"DistributedEmbedding({self.table!r}) got a SparseTensor: pass combiner="
                    f"'sum', 'mean' or 'sqrtn' (as tf.nn.safe_embedding_lookup_sparse needs)"
                )
            flat = inputs.values
            segments = inputs.indices[:, 0]
            groups = inputs.dense_shape[0]
            if sparse_weights is not None:
                weights = tf.cast(sparse_weights.values, tf.float32)
        elif isinstance(inputs, tf.RaggedTensor):
            flat = inputs.flat_values
            segments = inputs.value_rowids()
            groups = inputs.nrows()
        else:
            inputs = tf.convert_to_tensor(inputs)
            flat = tf.reshape(inputs, [-1])
            shape = tf.shape(inputs, out_type=tf.int64)
            rank = tf.size(shape)
            last = tf.concat([tf.ones([1], tf.int64), shape], axis=0)[-1]  # 1 if scalar
            per_group = tf.where(rank > 1, last, tf.constant(1, tf.int64))
            groups = tf.where(
                rank > 1, tf.reduce_prod(shape[:-1]), tf.size(flat, out_type=tf.int64)
            )
            segments = tf.range(tf.size(flat, out_type=tf.int64)) // tf.maximum(per_group, 1)
        feed = self._feed
        if feed is not None and original is feed[0] and sparse_weights is None:
            # rows of several layers in one table, its last row zeros (padding's)
            table, index = feed[1], feed[2]
            num_rows = tf.shape(table, out_type=tf.int64)[0] - 1
            self.fed = True
        else:
            # Only lookups under a tape (a training trace) get a slot: a predict trace must
            # not add rows to the training trace's list.
            slot = len(self.graph_rows) if self._tape is not None else None
            rows, index = tf.py_function(
                functools.partial(self._py_lookup, slot, training),
                [flat, weights],
                [tf.float32, tf.int64],
            )
            rows.set_shape([None, self.dim])
            index.set_shape(flat.shape)
            if self._tape is not None:
                self._tape.watch(rows)
                self.graph_rows.append(rows)
            table = tf.concat([rows, tf.zeros((1, self.dim), tf.float32)], axis=0)
            num_rows = tf.shape(rows, out_type=tf.int64)[0]
        emb = tf.gather(table, index)
        if self.combiner is None:
            if isinstance(inputs, tf.RaggedTensor):
                return tf.RaggedTensor.from_row_splits(emb, inputs.row_splits)
            return tf.reshape(emb, tf.concat([tf.shape(inputs), [self.dim]], axis=0))
        if _one_id_per_group(inputs):
            # each group's combination is its one row (weight 1), or for a padding id
            # the zero row it gathered (weight 0): the same floats and gradients
            # without the segment sums, which cost a step many ops per layer
            out = emb
        else:
            contributes = tf.cast(index < num_rows, tf.float32)
            weighted = isinstance(inputs, tf.SparseTensor) and sparse_weights is not None
            w = weights * contributes if weighted else contributes
            out = combine_segments(emb * w[:, None], w, segments, groups, self.combiner)
        if isinstance(inputs, tf.RaggedTensor | tf.SparseTensor) or inputs.shape.rank == 1:
            return out
        in_shape = tf.shape(inputs)
        lead = tf.cond(tf.size(in_shape) > 1, lambda: in_shape[:-1], lambda: in_shape)
        return tf.reshape(out, tf.concat([lead, [self.dim]], axis=0))


def _one_id_per_group(inputs: Any) -> bool:
    """Whether a combiner's groups of dense `inputs` hold one id each, by their static
    shape: 1-D ids, or a last axis of 1."""
    if not isinstance(inputs, tf.Tensor) or inputs.shape.rank is None:
        return False
    rank = int(inputs.shape.rank)
    return rank == 1 or (rank > 1 and inputs.shape[-1] == 1)


def distributed_layers(model: keras.Model) -> list[DistributedEmbedding]:
    """The `DistributedEmbedding` layers of `model`, in Keras' order."""
    # Keras' private walk of every tracked sublayer: the public `model.layers` lists only
    # the top level, in another order, and misses layers nested in a custom layer.
    return [
        layer
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, DistributedEmbedding)
    ]
