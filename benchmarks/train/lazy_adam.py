"""The strong local baseline: the same model trained in this process by one
`tf.function` step that gathers only the batch's unique rows of each table and applies
Adam to those rows alone, each with its own step count: the optimizer service's math
(docs/optimizers.md#adam) in TensorFlow ops. `floor=True` trains the MLP alone on
embeddings held constant: the compute floor of the step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.train.local import (
    DENSE_LR,
    EMBEDDING_LR,
    VOCABULARY,
    assign_dense,
    build_local_model,
    dense_weights,
)
from benchmarks.train.steps import LocalRound, run_in_process, stacked_columns
from trainer.data import Batch

# deploy/demo.toml's tables: Adam with Keras' defaults but the learning rate
BETA_1 = 0.9
BETA_2 = 0.999
EPSILON = 1e-7


def lazy_adam_rows(
    w: Any,
    m: Any,
    v: Any,
    steps: Any,
    g: Any,
    *,
    learning_rate: float = EMBEDDING_LR,
    beta_1: float = BETA_1,
    beta_2: float = BETA_2,
    epsilon: float = EPSILON,
) -> tuple[Any, Any, Any, Any]:
    """One Adam step of rows `w` (n, dim) with slots `m`, `v` (n, dim) and `steps` (n,)
    by their summed gradients `g`: the new rows, m, v and steps, Keras' float32
    operations in Keras' order with each row's own `t` (lookup_table's `Adam`)."""
    import tensorflow as tf

    f32 = tf.float32
    t = steps + 1.0

    def power(beta: float) -> Any:
        # float32 beta**t correctly rounded, as the C library's powf gives it: float64 pow
        # of the float32 values, rounded once (1 - beta_2**t cancels: an ulp here shows)
        beta_32 = float(np.float32(beta))
        return tf.cast(tf.pow(tf.constant(beta_32, tf.float64), tf.cast(t, tf.float64)), f32)

    # scalars as Keras casts them: 1 - beta computed in float64, rounded to float32 once
    alpha = tf.constant(learning_rate, f32) * tf.sqrt(1.0 - power(beta_2)) / (1.0 - power(beta_1))
    m_new = (g - m) * tf.constant(1 - beta_1, f32) + m
    v_new = (g * g - v) * tf.constant(1 - beta_2, f32) + v
    w_new = w - (m_new * alpha[:, None]) / (tf.sqrt(v_new) + tf.constant(epsilon, f32))
    return w_new, m_new, v_new, t


class LazyAdamTables:
    """Tables of one `dim`, stacked in one tf.Variable of items (row, m, v, step: the
    service's layout), table k's row i at k * vocabulary + i: one unique, one gather and
    one scatter a step for all of them. m = v = 0 and step 0 at the start."""

    def __init__(
        self, initial: Sequence[Any], *, vocabulary: int, learning_rate: float = EMBEDDING_LR
    ) -> None:
        import tensorflow as tf

        rows = tf.concat([tf.convert_to_tensor(t, tf.float32) for t in initial], axis=0)
        self.count = len(initial)
        self.dim = int(rows.shape[1])
        self.vocabulary = vocabulary
        self.learning_rate = learning_rate
        slots = tf.zeros((rows.shape[0], 2 * self.dim + 1), tf.float32)
        self.items = tf.Variable(tf.concat([rows, slots], axis=1), trainable=False)

    def places(self, ids: Any) -> tuple[Any, Any]:
        """The distinct items the (batch, tables) ids hit, and each id's position among them."""
        import tensorflow as tf

        offsets = tf.range(self.count, dtype=tf.int64) * self.vocabulary
        flat = tf.reshape(tf.math.floormod(ids, self.vocabulary) + offsets, [-1])
        unique, at = tf.unique(flat)
        return unique, tf.reshape(at, tf.shape(ids))

    def rows(self, unique: Any) -> Any:
        import tensorflow as tf

        return tf.gather(self.items, unique)[:, : self.dim]

    def lookup(self, ids: Any) -> Any:
        """(batch, tables * dim): each table's row of each id, side by side."""
        import tensorflow as tf

        unique, at = self.places(ids)
        return tf.reshape(tf.gather(self.rows(unique), at), [-1, self.count * self.dim])

    def apply(self, unique: Any, grads: Any) -> None:
        """Adam on the items `unique` (distinct) by their rows' summed gradients `grads`;
        every other item stays as it is."""
        import tensorflow as tf

        d = self.dim
        items = tf.gather(self.items, unique)
        w, m, v, t = lazy_adam_rows(
            items[:, :d],
            items[:, d : 2 * d],
            items[:, 2 * d : 3 * d],
            items[:, 3 * d],
            grads,
            learning_rate=self.learning_rate,
        )
        self.items.scatter_nd_update(unique[:, None], tf.concat([w, m, v, t[:, None]], axis=1))


def run_lazy_adam(r: LocalRound, *, floor: bool = False) -> dict[str, Any]:
    """Train with lazy Adam on the tables (or, `floor`, the MLP alone on constant
    embeddings) in this process; time, CPU, eval, as `run_local`."""
    import keras
    import tensorflow as tf

    # the local Keras model gives the dense layers (and their initial weights) and the
    # tables' initial rows; the lazy tables then own the rows
    model = build_local_model(r.schema, r.dims, r.seed)
    assign_dense(model, r.initial_dense)
    dense_vars = dense_weights(model)
    layers = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    schema, dims = r.schema, r.dims
    columns = list(schema.categorical)
    numeric = list(schema.numeric)
    if len({dims[c] for c in columns}) != 1:
        raise ValueError(f"the lazy Adam baseline stacks tables of one dim; got {dict(dims)}")
    by_column = {w.path.split("/")[0].removeprefix("embedding_"): w for w in model.weights}
    tables = LazyAdamTables([by_column[c].value for c in columns], vocabulary=VOCABULARY)
    del by_column
    dense_opt = keras.optimizers.Adam(learning_rate=DENSE_LR)
    dense_opt.build(dense_vars)
    loss_fn = keras.losses.BinaryCrossentropy()

    def mlp(embedded: Any, numbers: Any) -> Any:
        x = tf.concat([embedded, numbers], axis=-1)
        for layer in layers:
            x = layer(x)
        return tf.sigmoid(x)

    @tf.function(reduce_retracing=True)
    def step(inputs: Any, labels: Any) -> Any:
        ids, numbers = inputs
        unique, at = tables.places(ids)
        rows = tables.rows(unique)
        with tf.GradientTape() as tape:
            tape.watch(rows)
            embedded = tf.reshape(tf.gather(rows, at), [-1, tables.count * tables.dim])
            preds = mlp(embedded, numbers)
            loss = loss_fn(tf.reshape(labels, (-1, 1)), tf.reshape(preds, (-1, 1)))
        grads = tape.gradient(loss, dense_vars if floor else [rows, *dense_vars])
        if not floor:
            tables.apply(unique, tf.convert_to_tensor(grads[0]))
            grads = grads[1:]
        dense_opt.apply_gradients(zip(grads, dense_vars, strict=True))
        return loss

    @tf.function(reduce_retracing=True)
    def predict(inputs: Any) -> Any:
        ids, numbers = inputs
        return mlp(tables.lookup(ids), numbers)

    def tensors(batch: Batch) -> tuple[Any, Any]:
        # two tensors, as the PyTorch baselines take them: 39 tensors a step would cost
        # the step call ~2 ms in Python
        ids, numbers = stacked_columns(batch, columns, numeric)
        return tf.constant(ids), tf.constant(numbers)

    method = "mlp_floor" if floor else "lazy_adam"
    return run_in_process(method, step, predict, tensors, r)
