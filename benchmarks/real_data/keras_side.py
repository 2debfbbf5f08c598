"""The reference side: a plain tf.keras model of the same shape, trained in this process
on the same CSV files."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.real_data import BATCH_SIZE, EMBEDDING_DIM, HIDDEN, LEARNING_RATE, SEED
from benchmarks.real_data.prep import Dataset


@dataclass
class Frame:
    """The model's columns of one CSV file: labels, text columns, numeric columns."""

    labels: np.ndarray  # float32 (n,)
    text: dict[str, np.ndarray]  # object (n,) of str
    numeric: dict[str, np.ndarray]  # float64 (n,), NaN where empty


def read_csv(path: Path, ds: Dataset) -> Frame:
    import pyarrow as pa
    from pyarrow import csv as pacsv

    text_cols = [*ds.categorical, *ds.multivalued]
    types = {c: pa.string() for c in text_cols}
    types.update({c: pa.float64() for c in ds.numeric})
    types[ds.label] = pa.float32()
    table = pacsv.read_csv(
        path,
        convert_options=pacsv.ConvertOptions(
            column_types=types,
            include_columns=[ds.label, *text_cols, *ds.numeric],
            strings_can_be_null=False,  # an empty category is the id ""
        ),
    )
    return Frame(
        labels=table[ds.label].to_numpy().astype(np.float32),
        text={c: np.asarray(table[c].to_pylist(), dtype=object) for c in text_cols},
        numeric={c: table[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in ds.numeric},
    )


def _pad_split(values: np.ndarray, sep: str) -> np.ndarray:
    """`|`-joined strings -> (n, max items) array of str padded with "" (the mask token)."""
    lists = [[p for p in v.split(sep) if p] for v in values]
    width = max(1, max(map(len, lists), default=0))
    out = np.full((len(lists), width), "", dtype=object)
    for i, items in enumerate(lists):
        out[i, : len(items)] = items
    return out


def run_keras(
    ds: Dataset, train_path: Path, eval_path: Path, *, epochs: int, seed: int = SEED
) -> dict[str, Any]:
    """Train and evaluate the plain tf.keras reference in this process."""
    import keras
    import tensorflow as tf

    from trainer.metrics import auc, logloss

    train, evals = read_csv(train_path, ds), read_csv(eval_path, ds)
    keras.backend.clear_session()  # a fresh graph per run
    tf.get_logger().setLevel("ERROR")  # predict on a new model per seed: retracing warnings
    keras.utils.set_random_seed(seed)

    def key(column: str) -> str:  # Keras input names: no dashes
        return column.replace("-", "_")

    inputs: dict[str, Any] = {}
    embedded: list[Any] = []
    x_train: dict[str, np.ndarray] = {}
    x_eval: dict[str, np.ndarray] = {}
    vocab_sizes: dict[str, int] = {}
    for column in ds.categorical:
        vocab = sorted(set(train.text[column].tolist()))
        lookup = keras.layers.StringLookup(vocabulary=vocab, num_oov_indices=1)
        inp = keras.Input(shape=(), dtype="string", name=key(column))
        inputs[key(column)] = inp
        embedded.append(
            keras.layers.Embedding(lookup.vocabulary_size(), EMBEDDING_DIM)(lookup(inp))
        )
        x_train[key(column)], x_eval[key(column)] = train.text[column], evals.text[column]
        vocab_sizes[column] = len(vocab)
    for column, sep in ds.multivalued.items():
        padded_train, padded_eval = (
            _pad_split(train.text[column], sep),
            _pad_split(evals.text[column], sep),
        )
        vocab = sorted({v for v in padded_train.reshape(-1).tolist() if v})
        lookup = keras.layers.StringLookup(vocabulary=vocab, mask_token="", num_oov_indices=1)
        inp = keras.Input(shape=(None,), dtype="string", name=key(column))
        inputs[key(column)] = inp
        ids = lookup(inp)  # 0 = padding, 1 = OOV, 2.. the vocabulary
        rows = keras.layers.Embedding(lookup.vocabulary_size(), EMBEDDING_DIM)(ids)
        mask = keras.ops.expand_dims(keras.ops.cast(keras.ops.not_equal(ids, 0), "float32"), -1)
        total = keras.ops.sum(rows * mask, axis=1)
        count = keras.ops.maximum(keras.ops.sum(mask, axis=1), 1.0)
        embedded.append(total / count)  # a row without items gives zeros
        # a 2-D object array is no valid Keras input: give it as a tf.string tensor
        x_train[key(column)] = tf.constant(padded_train.astype(str))
        x_eval[key(column)] = tf.constant(padded_eval.astype(str))
        vocab_sizes[column] = len(vocab)
    numeric_stats: dict[str, dict[str, float]] = {}
    if ds.numeric:
        means = {c: float(np.nanmean(train.numeric[c])) for c in ds.numeric}

        def matrix(frame: Frame) -> np.ndarray:
            cols = [
                np.where(np.isnan(frame.numeric[c]), means[c], frame.numeric[c]) for c in ds.numeric
            ]
            return np.stack(cols, axis=1).astype(np.float32)

        norm = keras.layers.Normalization(axis=-1)
        x_train["numeric"], x_eval["numeric"] = matrix(train), matrix(evals)
        norm.adapt(x_train["numeric"])
        numeric_stats = {
            c: {
                "mean": float(np.asarray(norm.mean).reshape(-1)[j]),
                "std": float(np.sqrt(np.asarray(norm.variance).reshape(-1)[j])),
            }
            for j, c in enumerate(ds.numeric)
        }
        inp = keras.Input(shape=(len(ds.numeric),), dtype="float32", name="numeric")
        inputs["numeric"] = inp
        embedded.append(norm(inp))
    x = keras.layers.Concatenate()(embedded)
    for width in HIDDEN:
        x = keras.layers.Dense(width, activation="relu")(x)
    out = keras.layers.Activation("sigmoid")(keras.layers.Dense(1)(x))
    model = keras.Model(inputs, out)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=LEARNING_RATE),
        loss=keras.losses.BinaryCrossentropy(),
    )

    first: dict[str, float] = {}

    def first_loss(batch: int, logs: Any = None) -> None:
        if not first and logs:
            first["loss"] = float(logs["loss"])

    start = time.perf_counter()
    history = model.fit(
        x_train,
        train.labels,
        batch_size=BATCH_SIZE,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=first_loss)],
    )
    seconds = time.perf_counter() - start
    preds = model.predict(x_eval, batch_size=8192, verbose=0).reshape(-1)
    n_train = int(train.labels.shape[0])
    return {
        "side": "keras",
        "seed": seed,
        "epochs": epochs,
        "train_examples": n_train,
        "seconds": seconds,
        "examples_per_s": epochs * n_train / seconds,
        "first_step_loss": first.get("loss"),
        "epoch_train_loss": [float(v) for v in history.history["loss"]],
        "eval_auc": auc(evals.labels, preds),
        "eval_logloss": logloss(evals.labels, preds),
        "eval_examples": int(evals.labels.shape[0]),
        "eval_mean_prediction": float(preds.mean()),
        "vocabulary_sizes": vocab_sizes,
        "numeric_stats": numeric_stats,
        "parameters": int(model.count_params()),
    }
