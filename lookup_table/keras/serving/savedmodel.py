"""Write a Keras model and its tables' rows as a TF SavedModel that serves without this project.

Each `DistributedEmbedding` table becomes a `DenseHashTable` (id -> row index) and a
variable of its rows; every layer runs its own graph code, fed those rows; one
`serving_default` signature takes the model's Keras inputs. docs/serving.md says what
the SavedModel holds and how it serves. Nothing here reads a cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import NDArray

from lookup_table.config import TableSpec
from lookup_table.core.keys import IdArray
from lookup_table.errors import ConfigError
from lookup_table.keras.layer import DistributedEmbedding, combine_segments, distributed_layers
from lookup_table.keras.serving.memory import hash_table_buckets
from lookup_table.keras.serving.tfhash import blake2b_8_tf, check_reproducible, initial_rows_tf

__all__ = [
    "UNSEEN",
    "TableRows",
    "Unseen",
    "check_export",
    "check_rows",
    "write_saved_model",
]

UNSEEN = ("initializer", "zeros")
"""What an id the export does not hold gets: its initial row, or zeros."""

Unseen = Literal["initializer", "zeros"]

_INSERT_CHUNK = 1 << 20  # ids per insert into a hash table (bounds the temporary tensors)
_CHUNK_BYTES = 16 << 20  # rows per copy into the rows variable
_INT64_MIN = -(2**63)
# Sentinel keys of a string table's DenseHashTable: 0xFF and 0xFE never occur in UTF-8,
# so no str id can be one (a query of such bytes is answered as an unseen id). Short:
# every empty bucket of the saved table holds the empty key.
_EMPTY_STR = b"\xff"
_DELETED_STR = b"\xfe"
_UNUSED_STR = b"\xff\xfe"


# how a table's rows are held in the export: as the table stores them
_TF_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}


@dataclass(frozen=True, slots=True, kw_only=True)
class TableRows:
    """The rows of one table to export.

    Attributes:
        spec: the table (dim, id type, seed and initializer for unseen ids).
        ids: unique ids (n,): int64, or an object array of str.
        rows: float32 (n, dim), row i of ids[i].
    """

    spec: TableSpec
    ids: IdArray
    rows: NDArray[np.float32]


# ---------------------------------------------------------------- one table in the SavedModel


class _TableLookup:
    """One table in the SavedModel: id -> row index (a DenseHashTable), the rows."""

    def __init__(
        self, source: TableRows, unseen: Unseen, blake2b_8: Callable[[tf.Tensor], tf.Tensor]
    ) -> None:
        spec = source.spec
        self.spec = spec
        self.unseen = unseen
        self.count = int(source.ids.shape[0])
        self.string = spec.id_type == "string"
        self.blake2b_8 = blake2b_8
        if unseen == "initializer":
            check_reproducible(spec)
        _check_ids(source.ids, self.string, spec.name)
        if self.string:
            self.sentinels: tuple[Any, Any, Any] = (_EMPTY_STR, _DELETED_STR, _UNUSED_STR)
        else:
            self.sentinels = _int_sentinels(np.asarray(source.ids, np.int64))
        self.table = tf.lookup.experimental.DenseHashTable(
            key_dtype=tf.string if self.string else tf.int64,
            value_dtype=tf.int64,
            default_value=-1,
            empty_key=self.sentinels[0],
            deleted_key=self.sentinels[1],
            initial_num_buckets=hash_table_buckets(self.count),
            name=f"ids_{_safe_name(spec.name)}",
        )
        for start in range(0, self.count, _INSERT_CHUNK):
            stop = min(start + _INSERT_CHUNK, self.count)
            keys = _key_tensor(source.ids[start:stop], self.string)
            self.table.insert(keys, tf.range(start, stop, dtype=tf.int64))
        # The last row stays zeros. Filled in chunks with scatter_update, so the variable is
        # the only full copy TF makes (the source may be memory-mapped); a zeros initial
        # value or slice assignments cost a second copy of the rows.
        # A float16/bfloat16 table's rows are exported as they are stored (half the
        # bytes of float32) and cast to float32 at lookup: its values are exactly its
        # dtype's, so the cast gives the trainer's float32 rows back.
        stored = _TF_DTYPES[spec.dtype]
        shape = [self.count + 1, spec.dim]
        self.rows = tf.Variable(
            lambda: tf.zeros(shape, stored),
            trainable=False,
            name=f"rows_{_safe_name(spec.name)}",
        )
        step = max(1, _CHUNK_BYTES // (4 * spec.dim))
        for start in range(0, self.count, step):
            stop = min(start + step, self.count)
            chunk = tf.cast(np.asarray(source.rows[start:stop], np.float32), stored)
            self.rows.scatter_update(tf.IndexedSlices(chunk, tf.range(start, stop)))

    def ids_of(self, flat: tf.Tensor, where: str) -> tf.Tensor:
        """A layer's flat input as this table's key dtype (int64 or tf.string)."""
        if self.string:
            if flat.dtype != tf.string:
                raise ConfigError(
                    f"{where}: table {self.spec.name!r} has string ids but the layer gets "
                    f"{flat.dtype.name} ids"
                )
            return flat
        if not flat.dtype.is_integer:
            raise ConfigError(
                f"{where}: table {self.spec.name!r} has int64 ids but the layer gets "
                f"{flat.dtype.name} ids"
            )
        return tf.cast(flat, tf.int64)

    def rows_of(self, ids: tf.Tensor, wanted: tf.Tensor) -> tf.Tensor:
        """float32 (m, dim): each id's row; an unseen one's initial row (or zeros) where
        `wanted` (bool (m,)), zeros elsewhere."""
        empty, deleted, unused = (tf.constant(s, self.table.key_dtype) for s in self.sentinels)
        # the sentinels may not be looked up; they are never exported ids
        sentinel = tf.logical_or(tf.equal(ids, empty), tf.equal(ids, deleted))
        index = self.table.lookup(tf.where(sentinel, unused, ids))
        index.set_shape(ids.shape)
        found = index >= 0
        rows = tf.cast(tf.gather(self.rows, tf.where(found, index, self.count)), tf.float32)
        if self.unseen == "zeros" or self.spec.initializer.name == "zeros":
            return rows
        need = tf.logical_and(tf.logical_not(found), wanted)
        fresh = initial_rows_tf(self.spec, tf.boolean_mask(ids, need), blake2b_8=self.blake2b_8)
        if self.rows.dtype != tf.float32:  # as the table stores a new row: to nearest
            fresh = tf.cast(tf.cast(fresh, self.rows.dtype), tf.float32)
        return tf.tensor_scatter_nd_update(rows, tf.where(need), fresh)


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name) or "_"


def _check_ids(ids: IdArray, string: bool, table: str) -> None:
    want = "an object array of str" if string else "an int64 array"
    if ids.ndim != 1 or (ids.shape[0] and ids.dtype != (object if string else np.int64)):
        raise ConfigError(f"table {table!r}: ids must be {want} (n,), got {ids.dtype} {ids.shape}")


def _key_tensor(ids: IdArray, string: bool) -> tf.Tensor:
    if string:
        return tf.constant([s.encode("utf-8") for s in ids.tolist()], tf.string, shape=[len(ids)])
    return tf.constant(np.asarray(ids, np.int64))


def _int_sentinels(ids: NDArray[np.int64]) -> tuple[int, int, int]:
    """The three smallest int64 values that are not among `ids` (the hash table's empty
    and deleted keys, and the key a query of either is replaced with)."""
    taken = set(ids[ids < _INT64_MIN + ids.shape[0] + 3].tolist())
    free: list[int] = []
    value = _INT64_MIN
    while len(free) < 3:
        if value not in taken:
            free.append(value)
        value += 1
    return free[0], free[1], free[2]


# ---------------------------------------------------------------- the layers in the export


def _padding(layer: DistributedEmbedding, string: bool) -> tf.Tensor | None:
    """The layer's padding id as a constant of the table's key dtype; None if it has
    none or one of the other type (which, as in training, matches no id)."""
    pad = layer.padding_id
    if pad is None:
        return None
    if isinstance(pad, bool) or not isinstance(pad, int | np.integer | str):
        raise ConfigError(f"layer {layer.name!r}: padding_id must be an int or a str, got {pad!r}")
    if string:
        return tf.constant(pad.encode("utf-8"), tf.string) if isinstance(pad, str) else None
    return None if isinstance(pad, str) else tf.constant(int(pad), tf.int64)


def _serving_call(
    layer: DistributedEmbedding, lookup: _TableLookup, call: Callable[..., Any]
) -> Callable[..., Any]:
    """The layer's call in the export: its rows come from `lookup` (graph ops) and are fed
    to the layer's own graph code (`DistributedEmbedding.feed`), which gathers and
    combines exactly as in training."""
    where = f"layer {layer.name!r}"

    def serving_call(inputs: Any, sparse_weights: Any = None, training: bool = False) -> Any:
        if isinstance(inputs, tf.SparseTensor):
            flat = inputs.values
        elif isinstance(inputs, tf.RaggedTensor):
            flat = inputs.flat_values
        else:
            flat = tf.reshape(tf.convert_to_tensor(inputs), [-1])
        ids = lookup.ids_of(flat, where)
        size = tf.size(ids, out_type=tf.int64)
        keep = tf.ones(tf.reshape(size, [1]), tf.bool)
        pad = _padding(layer, lookup.string)
        if pad is not None:
            keep = tf.not_equal(ids, pad)
        weights = None
        if isinstance(inputs, tf.SparseTensor) and sparse_weights is not None:
            weights = tf.cast(sparse_weights.values, tf.float32)
            # as the layer: mean and sqrtn prune weights <= 0, sum only zero weights
            keep &= tf.not_equal(weights, 0.0) if layer.combiner == "sum" else weights > 0.0
        rows = lookup.rows_of(ids, keep)
        table = tf.concat([rows, tf.zeros([1, layer.dim], tf.float32)], axis=0)
        index = tf.where(keep, tf.range(size), size)
        if weights is not None:
            return _weighted_sparse(layer, inputs, weights, table, index, size)
        layer.feed(inputs, table, index)
        try:
            out = call(inputs, training=training)
        finally:
            layer.end_step()
        if not layer.fed:
            raise RuntimeError(f"{where} did not take the exported rows (a bug)")
        return out

    return serving_call


def _weighted_sparse(
    layer: DistributedEmbedding,
    inputs: tf.SparseTensor,
    weights: tf.Tensor,
    table: tf.Tensor,
    index: tf.Tensor,
    num_rows: tf.Tensor,
) -> tf.Tensor:
    """A SparseTensor with `sparse_weights`, which `feed` does not take: the same ops as
    the layer's graph code (`DistributedEmbedding._call_graph`) on the exported rows."""
    if layer.combiner is None:
        raise ConfigError(
            f"layer {layer.name!r} got a SparseTensor: pass combiner='sum', 'mean' or 'sqrtn'"
        )
    segments = inputs.indices[:, 0]
    groups = inputs.dense_shape[0]
    emb = tf.gather(table, index)
    w = weights * tf.cast(index < num_rows, tf.float32)
    return combine_segments(emb * w[:, None], w, segments, groups, layer.combiner)


class _NoRows:
    """The row source of a layer during the export: its rows come from the SavedModel."""

    def rows(self, table: str, ids: IdArray, *, training: bool) -> NDArray[np.float32]:
        raise RuntimeError(f"an exported layer of table {table!r} looked up rows (a bug)")


@contextlib.contextmanager
def _serving_layers(
    layers: Sequence[DistributedEmbedding], lookups: Mapping[str, _TableLookup]
) -> Iterator[None]:
    """While tracing the export: every layer's call reads its table's exported rows."""
    saved = [(layer, getattr(layer, "_source", None)) for layer in layers]
    try:
        for layer in layers:
            if getattr(layer, "_source", None) is None:
                layer.bind(_NoRows())  # the layer refuses to run unbound
            # an instance attribute: Keras' __call__ calls `self.call`
            object.__setattr__(
                layer, "call", _serving_call(layer, lookups[layer.table], layer.call)
            )
        yield
    finally:
        for layer, source in saved:
            if "call" in vars(layer):
                object.__delattr__(layer, "call")
            layer.bind(source)


# ---------------------------------------------------------------- the signature


@dataclass(frozen=True, slots=True)
class _Input:
    """One Keras input and the signature tensors it is sent as."""

    name: str
    kind: Literal["dense", "ragged", "sparse"]
    specs: tuple[tf.TensorSpec, ...]

    def build(self, tensors: Mapping[str, tf.Tensor]) -> Any:
        got = [tensors[s.name] for s in self.specs]
        if self.kind == "dense":
            return got[0]
        if self.kind == "ragged":
            return tf.RaggedTensor.from_row_lengths(got[0], got[1], validate=True)
        return tf.SparseTensor(got[0], got[1], got[2])


def _inputs(model: keras.Model) -> list[_Input]:
    keras_inputs = getattr(model, "inputs", None)
    if not keras_inputs:
        raise ConfigError(
            f"model {model.name!r} has no known inputs: export a functional or Sequential "
            f"model built from keras.Input"
        )
    out: list[_Input] = []
    for kt in keras_inputs:
        name, dtype = kt.name, tf.as_dtype(kt.dtype)
        shape = tuple(kt.shape)
        if getattr(kt, "sparse", False):
            rank = len(shape)
            specs: tuple[tf.TensorSpec, ...] = (
                tf.TensorSpec([None, rank], tf.int64, name=f"{name}_indices"),
                tf.TensorSpec([None], dtype, name=f"{name}_values"),
                tf.TensorSpec([rank], tf.int64, name=f"{name}_dense_shape"),
            )
            out.append(_Input(name, "sparse", specs))
        elif getattr(kt, "ragged", False):
            specs = (
                tf.TensorSpec([None, *shape[2:]], dtype, name=f"{name}_values"),
                tf.TensorSpec([None], tf.int64, name=f"{name}_row_lengths"),
            )
            out.append(_Input(name, "ragged", specs))
        else:
            out.append(_Input(name, "dense", (tf.TensorSpec(shape, dtype, name=name),)))
    names = [s.name for i in out for s in i.specs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ConfigError(
            f"the signature's inputs {clash} clash (a ragged or sparse input sends "
            f"<name>_values, ...): rename the Keras inputs"
        )
    return out


def _outputs(model: keras.Model, result: Any) -> dict[str, tf.Tensor]:
    if isinstance(result, Mapping):
        named = dict(result)
    else:
        flat = keras.tree.flatten(result)
        names = list(getattr(model, "output_names", None) or [])
        if len(names) != len(flat) or len(set(names)) != len(names):
            names = [f"output_{i}" for i in range(len(flat))]
        named = dict(zip(names, flat, strict=True))
    for name, value in named.items():
        if not isinstance(value, tf.Tensor):
            raise ConfigError(
                f"model output {name!r} is a {type(value).__name__}; a SavedModel signature "
                f"returns dense tensors (e.g. use a combiner, or .to_tensor())"
            )
    return named


# ---------------------------------------------------------------- the export


def check_export(model: keras.Model, path: str | os.PathLike[str], *, unseen: Unseen) -> Path:
    """The refusals an export makes before it reads a row: `unseen`, a target that
    exists and is not empty, a model without the inputs a signature needs.

    Returns:
        The target directory.

    Raises:
        ConfigError: saying which, and what to do.
    """
    if unseen not in UNSEEN:
        raise ConfigError(f"unseen must be 'initializer' or 'zeros', got {unseen!r}")
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"{target} already exists and is not an empty directory; export into a new one "
            f"(e.g. the next version number for TF Serving)"
        )
    _inputs(model)
    return target


def check_rows(wanted: Sequence[str], rows: Mapping[str, TableRows], *, unseen: Unseen) -> None:
    """Refuse `rows` that lack a table of `wanted`, or whose rows do not fit their ids and
    dim, or (with `unseen="initializer"`) whose initial rows TF ops cannot compute.

    Raises:
        ConfigError: naming the table.
    """
    missing = [t for t in wanted if t not in rows]
    if missing:
        raise ConfigError(f"the model's tables {missing} are not in rows (it has {sorted(rows)})")
    for name in wanted:
        got = rows[name]
        if got.rows.shape != (got.ids.shape[0], got.spec.dim):
            raise ConfigError(
                f"table {name!r}: rows of shape {got.rows.shape} for {got.ids.shape[0]} "
                f"ids of dim {got.spec.dim}"
            )
    if unseen == "initializer":
        for t in wanted:
            check_reproducible(rows[t].spec)


def write_saved_model(
    model: keras.Model,
    path: str | os.PathLike[str],
    rows: Mapping[str, TableRows],
    *,
    unseen: Unseen = "initializer",
) -> dict[str, Any]:
    """Write `model` as a TF SavedModel, the rows of its `DistributedEmbedding` tables
    from `rows` and its dense weights as they are.

    The memory the export needs is the caller's to check (`estimate_export_bytes`,
    `check_export_memory`), before it loads the rows.

    Args:
        model: a functional or Sequential Keras model (built from `keras.Input`).
        path: the SavedModel directory to create (e.g. `models/ctr/1` for TF Serving);
            it must not exist, or be empty. Written to a temporary sibling and renamed.
        rows: table -> `TableRows`, every table of the model's layers.
        unseen: "initializer" (an unseen id gets its table's initial row, as the
            cluster answers with `create=False`) or "zeros".

    Returns:
        {"path", "bytes", "tables": {table: rows}, "inputs": [...], "outputs": [...]}.

    Raises:
        ConfigError: a bad argument, a table missing from `rows`, a layer whose dim or
            id type does not fit its table, a target that exists.
    """
    target = check_export(model, path, unseen=unseen)
    layers = distributed_layers(model)
    inputs = _inputs(model)
    wanted = sorted({layer.table for layer in layers})
    check_rows(wanted, rows, unseen=unseen)
    for layer in layers:
        spec = rows[layer.table].spec
        if spec.dim != layer.dim:
            raise ConfigError(
                f"layer {layer.name!r} expects dim={layer.dim} but table {layer.table!r} "
                f"has dim={spec.dim}"
            )
    # one string hash for every table: its loop is in the SavedModel once
    blake2b_8 = tf.function(
        blake2b_8_tf, input_signature=[tf.TensorSpec([None], tf.string)], autograph=False
    )
    lookups = {name: _TableLookup(rows[name], unseen, blake2b_8) for name in wanted}
    holder = tf.Module(name="lookup_tables")  # what the SavedModel saves of them
    holder.hash_tables = [lookups[name].table for name in wanted]
    holder.rows = [lookups[name].rows for name in wanted]
    names = [s.name for i in inputs for s in i.specs]
    output_names: list[str] = []

    def serve(*args: tf.Tensor) -> dict[str, tf.Tensor]:
        tensors = dict(zip(names, args, strict=True))
        built = {i.name: i.build(tensors) for i in inputs}
        structure = keras.tree.map_structure(lambda kt: built[kt.name], model.input)
        with _serving_layers(layers, lookups):
            result = _outputs(model, model(structure, training=False))
        output_names[:] = sorted(result)
        return result

    specs = [s for i in inputs for s in i.specs]
    created = [p for p in target.parents if not p.exists()]  # innermost first
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        archive = keras.export.ExportArchive()
        # The layers, not the model: tracking a model traces its default signature with
        # the layers' own lookups. Their variables, and resources such as a StringLookup's
        # table, are what the SavedModel needs of them.
        for layer in model._flatten_layers(include_self=False):
            if not isinstance(layer, keras.Model) and layer not in layers:
                archive.track(layer)
        archive.track(holder)
        archive.add_endpoint("serving_default", serve, input_signature=specs)
        archive.write_out(str(tmp), verbose=False)
        if target.exists():
            target.rmdir()  # checked empty above
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return {
        "path": str(target),
        "bytes": size,
        "tables": {name: lookups[name].count for name in wanted},
        "inputs": names,
        "outputs": output_names,
    }
