"""The local side: the same model with a `keras.layers.Embedding` per column, trained
with plain Keras in this process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.data import HIDDEN, MODEL_SEED
from benchmarks.train.steps import LocalRound, run_in_process
from trainer.data import Batch

VOCABULARY = 100_000  # rows per local Keras table
EMBEDDING_LR = 0.01  # deploy/demo.toml: C1..C26 Adam 0.01
DENSE_LR = 0.001  # deploy/demo.toml: [optimizer] Adam 0.001


def build_local_model(schema: Any, dims: Mapping[str, int], seed: int = MODEL_SEED) -> Any:
    """`build_model("mlp")` with a `keras.layers.Embedding(VOCABULARY, dim)` per column,
    its initial weights drawn with `seed`."""
    import keras
    from keras import ops

    keras.utils.set_random_seed(seed)
    inputs: dict[str, Any] = {}
    embedded = []
    for column in schema.categorical:
        inputs[column] = keras.Input(shape=(), dtype="int64", name=column)
        bucket = ops.mod(inputs[column], VOCABULARY)  # ids are mixed already: a fixed hash
        layer = keras.layers.Embedding(VOCABULARY, dims[column], name=f"embedding_{column}")
        embedded.append(layer(bucket))
    numeric = []
    for column in schema.numeric:
        inputs[column] = keras.Input(shape=(), dtype="float32", name=column)
        numeric.append(ops.expand_dims(inputs[column], -1))
    x = ops.concatenate(embedded + [ops.concatenate(numeric, axis=-1)], axis=-1)
    for width in HIDDEN:
        x = keras.layers.Dense(width, activation="relu")(x)
    out = keras.layers.Activation("sigmoid")(keras.layers.Dense(1)(x))
    return keras.Model(inputs, out, name="mlp_local")


def dense_weights(model: Any) -> list[Any]:
    """The trainable weights that are not embedding tables, in creation order."""
    return [w for w in model.trainable_weights if "embedding" not in w.path]


def assign_dense(model: Any, values: Sequence[np.ndarray]) -> None:
    """Give `model` the initial dense weights `values` (shapes checked)."""
    weights = dense_weights(model)
    shapes = [tuple(w.shape) for w in weights]
    if shapes != [v.shape for v in values]:
        raise RuntimeError(
            f"the model's dense weights {shapes} differ from build_model('mlp')'s "
            f"{[v.shape for v in values]}"
        )
    for w, v in zip(weights, values, strict=True):
        w.assign(v)


def initial_tables(r: LocalRound) -> list[np.ndarray]:
    """Each categorical column's initial rows (VOCABULARY, dim), in the schema's order: the
    local Keras model's, drawn with the round's seed, for a baseline that owns its tables."""
    model = build_local_model(r.schema, r.dims, r.seed)
    by_column = {w.path.split("/")[0].removeprefix("embedding_"): w for w in model.weights}
    return [np.asarray(by_column[c].numpy()) for c in r.schema.categorical]


def save_weights(path: Path, values: Sequence[np.ndarray]) -> None:
    np.savez(path, *values)


def load_weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def run_local(r: LocalRound) -> dict[str, Any]:
    """Train the local Keras model on `train` in this process; time, CPU, eval."""
    import keras
    import tensorflow as tf

    model = build_local_model(r.schema, r.dims, r.seed)
    assign_dense(model, r.initial_dense)
    dense_vars = dense_weights(model)
    emb_vars = [w for w in model.trainable_weights if "embedding" in w.path]
    emb_opt = keras.optimizers.Adam(learning_rate=EMBEDDING_LR)
    dense_opt = keras.optimizers.Adam(learning_rate=DENSE_LR)
    emb_opt.build(emb_vars)
    dense_opt.build(dense_vars)
    loss_fn = keras.losses.BinaryCrossentropy()
    names = [t.name for t in model.inputs]
    n_emb = len(emb_vars)

    @tf.function(reduce_retracing=True)
    def step(inputs: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            preds = model(inputs, training=True)
            loss = loss_fn(tf.reshape(labels, (-1, 1)), tf.reshape(preds, (-1, 1)))
        grads = tape.gradient(loss, emb_vars + dense_vars)
        emb_opt.apply_gradients(zip(grads[:n_emb], emb_vars, strict=True))
        dense_opt.apply_gradients(zip(grads[n_emb:], dense_vars, strict=True))
        return loss

    @tf.function(reduce_retracing=True)
    def predict(inputs: Any) -> Any:
        return model(inputs, training=False)

    def tensors(batch: Batch) -> dict[str, Any]:
        return {n: tf.constant(np.asarray(batch.features[n])) for n in names}

    return run_in_process("local", step, predict, tensors, r)
