"""The model zoo: `mlp` and `deepfm` over the columns of a data source.

One `DistributedEmbedding` per categorical column, on the table of the same name
(the cluster file must define it); multivalued columns are combined with "mean".
Numeric columns enter as the source gives them: `lookup-table-train` standardizes
them with the training rows' statistics (`trainer.numeric`), the same for every
worker; no batch statistics, which N trainers could not share. `serving_model`
puts that transform in front of a trained model, for a model file that takes the
raw columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras
from keras import ops

from lookup_table.config import ClusterConfig
from lookup_table.errors import ConfigError
from lookup_table.keras import DistributedEmbedding

if TYPE_CHECKING:
    from trainer.numeric import NumericStats

__all__ = ["MODELS", "build_model", "serving_model"]

MODELS = ("mlp", "deepfm")


def _table(config: ClusterConfig, column: str, id_type: str) -> Any:
    try:
        spec = config.table(column)
    except ConfigError:
        raise ConfigError(
            f"the data has the categorical column {column!r} but the cluster file has no table "
            f'{column!r}; add [[tables]] name = "{column}", dim = 16'
            + (', id_type = "string"' if id_type == "string" else "")
        ) from None
    if spec.id_type != id_type:
        raise ConfigError(
            f"column {column!r} has {id_type} ids but table {column!r} has id_type="
            f'{spec.id_type!r}; set id_type = "{id_type}" for it in the cluster file'
        )
    return spec


def build_model(
    name: str,
    schema: Any,
    config: ClusterConfig,
    *,
    hidden: Sequence[int] = (256, 128),
    seed: int = 0,
) -> keras.Model:
    """Build `name` ("mlp" or "deepfm") for `schema` (trainer.data.Schema)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    keras.utils.set_random_seed(seed)
    inputs: dict[str, Any] = {}
    embedded: list[Any] = []
    for column, id_type in schema.categorical.items():
        spec = _table(config, column, id_type)
        dtype = "int64" if id_type == "int64" else "string"
        inputs[column] = keras.Input(shape=(), dtype=dtype, name=column)
        embedded.append(DistributedEmbedding(spec, feature=column)(inputs[column]))
    for column, id_type in schema.multivalued.items():
        spec = _table(config, column, id_type)
        dtype = "int64" if id_type == "int64" else "string"
        inputs[column] = keras.Input(shape=(None,), dtype=dtype, name=column, ragged=True)
        embedded.append(DistributedEmbedding(spec, combiner="mean", feature=column)(inputs[column]))
    numeric = []
    for column in schema.numeric:
        inputs[column] = keras.Input(shape=(), dtype="float32", name=column)
        numeric.append(ops.expand_dims(inputs[column], -1))
    dense_in = numeric and (ops.concatenate(numeric, axis=-1) if len(numeric) > 1 else numeric[0])

    def mlp(x: Any) -> Any:
        for width in hidden:
            x = keras.layers.Dense(width, activation="relu")(x)
        return keras.layers.Dense(1)(x)

    if name == "mlp":
        x = ops.concatenate(embedded + ([dense_in] if numeric else []), axis=-1)
        out = keras.layers.Activation("sigmoid")(mlp(x))
        return keras.Model(inputs, out, name="mlp")

    # DeepFM (Guo et al., 2017): each table row holds the k factors and, last, the
    # first-order weight of its id, so FM needs no extra tables (dim = k + 1).
    factors = [e[:, :-1] for e in embedded]
    first_order = ops.sum(ops.stack([e[:, -1] for e in embedded], axis=-1), axis=-1, keepdims=True)
    stacked = ops.stack(factors, axis=1)  # (batch, fields, k)
    square_of_sum = ops.square(ops.sum(stacked, axis=1))
    sum_of_square = ops.sum(ops.square(stacked), axis=1)
    fm = 0.5 * ops.sum(square_of_sum - sum_of_square, axis=-1, keepdims=True)
    deep_in = ops.concatenate(factors + ([dense_in] if numeric else []), axis=-1)
    logit = first_order + fm + mlp(deep_in)
    if numeric:
        logit = logit + keras.layers.Dense(1, use_bias=False)(dense_in)
    out = keras.layers.Activation("sigmoid")(logit)
    return keras.Model(inputs, out, name="deepfm")


def serving_model(model: keras.Model, stats: NumericStats) -> keras.Model:
    """`model` behind the numeric transform of `stats`: a model of the raw columns.

    Same inputs (names, dtypes, shapes, ragged) as `model`; each numeric column goes
    through `stats.keras_transform` first. The layers and weights are `model`'s own
    (shared, not copied), so it predicts what `model` predicts on transformed rows.
    """
    inputs: dict[str, Any] = {}
    fed: dict[str, Any] = {}
    for tensor in model.inputs:
        name = tensor.name
        inputs[name] = keras.Input(
            shape=tuple(tensor.shape[1:]),
            dtype=tensor.dtype,
            name=name,
            ragged=bool(getattr(tensor, "ragged", False)),
            sparse=bool(getattr(tensor, "sparse", False)),
        )
        fed[name] = (
            stats.keras_transform(inputs[name], name) if name in stats.columns else inputs[name]
        )
    return keras.Model(inputs, model(fed), name=f"{model.name}_raw")
