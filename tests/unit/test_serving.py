"""The SavedModel export's pure parts: initial rows in TF ops, memory checks, refusals.

The export against a real cluster, served in a process that cannot import the
project, is tests/integration/test_serving.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from lookup_table import ConfigError, ExportTooLargeError, LookupTableError
from lookup_table.config import TableSpec
from lookup_table.core.hashing import id_hashes
from lookup_table.core.initializers import InitializerSpec, initial_rows
from lookup_table.keras import DistributedEmbedding, export_saved_model
from lookup_table.keras.serving import (
    TableRows,
    available_memory_bytes,
    check_export_memory,
    estimate_export_bytes,
    id_hashes_tf,
    initial_rows_tf,
    write_saved_model,
)

pytestmark = pytest.mark.unit

INT_IDS = np.concatenate(
    [
        np.array([0, 1, -1, 7, -(2**63), 2**63 - 1, 2**62 + 12345], np.int64),
        np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64),
    ]
)
_RNG = np.random.default_rng(2)
_ALPHABET = list("abcXYZ019 /%\t\x00ünï日本😀")
STR_IDS = np.array(
    ["", "a", "7", "ünï", "nul\x00", "x" * 126, "x" * 127, "x" * 128, "y" * 255, "😀" * 70]
    + ["".join(_RNG.choice(_ALPHABET, int(_RNG.integers(0, 300)))) for _ in range(400)],
    dtype=object,
)


def _bits(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _graph(fn: Any, ids: np.ndarray) -> np.ndarray:
    """`fn(ids)` as a tf.function: the export runs these ops in a graph."""
    dtype = tf.string if ids.dtype == object else tf.int64
    traced = tf.function(fn, input_signature=[tf.TensorSpec([None], dtype)], autograph=False)
    value = [s.encode("utf-8") for s in ids.tolist()] if ids.dtype == object else ids
    return np.asarray(traced(tf.constant(value, dtype)))


@pytest.mark.parametrize("ids", [INT_IDS, STR_IDS], ids=["int64", "string"])
def test_id_hashes_in_tf_ops_equal_the_stores(ids: np.ndarray) -> None:
    """mix64 and (for strings, of every length around BLAKE2b's 128-byte blocks) BLAKE2b."""
    assert np.array_equal(_graph(id_hashes_tf, ids), id_hashes(ids))


@pytest.mark.parametrize(
    ("initializer", "dim"),
    [
        ({"name": "uniform"}, 16),
        ({"name": "uniform", "minval": -1.0, "maxval": 3.5}, 3),
        ({"name": "constant", "value": 0.25}, 4),
        ({"name": "zeros"}, 2),
    ],
    ids=["uniform", "uniform-wide", "constant", "zeros"],
)
@pytest.mark.parametrize("ids", [INT_IDS, STR_IDS], ids=["int64", "string"])
def test_initial_rows_in_tf_ops_equal_the_stores_bit_for_bit(
    initializer: dict[str, Any], dim: int, ids: np.ndarray
) -> None:
    """What an unseen id is served is what `store.lookup(create=False)` answers for it."""
    id_type = "string" if ids.dtype == object else "int64"
    spec = TableSpec(
        name="t",
        dim=dim,
        seed=11,
        id_type=id_type,
        initializer=InitializerSpec.from_dict(initializer),
    )
    want = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=dim)
    got = _graph(lambda x: initial_rows_tf(spec, x), ids)
    assert got.shape == (ids.shape[0], dim)
    assert np.array_equal(_bits(got), _bits(want))
    assert initializer["name"] != "uniform" or np.unique(want[:, 0]).size > 100


def test_the_normal_initializers_are_refused_in_tf_ops() -> None:
    for name in ("normal", "truncated_normal"):
        spec = TableSpec(
            name="t", dim=4, seed=1, initializer=InitializerSpec.from_dict({"name": name})
        )
        with pytest.raises(ConfigError, match="unseen='zeros'"):
            initial_rows_tf(spec, tf.constant([1], tf.int64))


def test_memory_check_names_both_sizes_and_is_a_memory_error() -> None:
    check_export_memory(1000, limit_bytes=1000)
    with pytest.raises(ExportTooLargeError) as info:
        check_export_memory(123_456_789, limit_bytes=1_000_000, what="exporting x")
    message = str(info.value)
    assert "123,456,789 bytes" in message and "1,000,000 bytes" in message
    assert "exporting x" in message and "nothing was written" in message
    assert isinstance(info.value, MemoryError) and isinstance(info.value, LookupTableError)
    assert (info.value.needed_bytes, info.value.limit_bytes) == (123_456_789, 1_000_000)


def test_the_estimate_grows_with_rows_dim_and_string_ids() -> None:
    small = estimate_export_bytes(count=1000, dim=16, id_type="int64")
    assert small > 1000 * 16 * 4
    assert estimate_export_bytes(count=2000, dim=16, id_type="int64") > small
    assert estimate_export_bytes(count=1000, dim=64, id_type="int64") > small
    assert estimate_export_bytes(count=1000, dim=16, id_type="string", id_bytes=20_000) > small


def test_available_memory_is_read() -> None:
    available = available_memory_bytes()
    assert available is not None and available > 0


# ---------------------------------------------------------------- exports of rows given in memory

USER = TableSpec(name="user", dim=4, seed=1)
WORD = TableSpec(
    name="word",
    dim=3,
    seed=2,
    id_type="string",
    initializer=InitializerSpec.from_dict({"name": "normal"}),
)


def _rows(spec: TableSpec, ids: list[Any]) -> TableRows:
    id_array = np.array(ids, dtype=np.int64 if spec.id_type == "int64" else object)
    values = np.arange(len(ids) * spec.dim, dtype=np.float32).reshape(-1, spec.dim) + 1.0
    return TableRows(spec=spec, ids=id_array, rows=values)


def _model() -> keras.Model:
    user = keras.Input(shape=(), dtype="int64", name="user")
    word = keras.Input(shape=(), dtype="string", name="word")
    out = keras.layers.Concatenate()(
        [DistributedEmbedding(USER)(user), DistributedEmbedding(WORD)(word)]
    )
    return keras.Model({"user": user, "word": word}, out)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_unseen_zeros_serves_stored_rows_and_zeros(tmp_path: Path) -> None:
    """`unseen="zeros"` (needed for the normal initializer): a served id gets its row, an
    unseen one zeros, also the hash tables' own sentinel keys (the smallest int64s; the
    bytes 0xFF and 0xFE, never UTF-8). Padding and combiners: the integration test."""
    rows = {"user": _rows(USER, [5, -9]), "word": _rows(WORD, ["a", ""])}
    info = export_saved_model(_model(), tmp_path / "m", rows=rows, unseen="zeros")
    assert info["tables"] == {"user": 2, "word": 2} and info["inputs"] == ["user", "word"]
    serve = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    users = tf.constant([-9, 6, 5, -(2**63), -(2**63) + 1], tf.int64)
    words = tf.constant([b"", b"b", b"a", b"\xff", b"\xfe"])
    (out,) = serve(user=users, word=words).values()
    want = np.zeros((5, 7), np.float32)
    want[0, :4], want[2, :4] = rows["user"].rows[1], rows["user"].rows[0]
    want[0, 4:], want[2, 4:] = rows["word"].rows[1], rows["word"].rows[0]
    assert np.array_equal(np.asarray(out), want)


def test_refusals_write_nothing(tmp_path: Path) -> None:
    model = _model()
    rows = {"user": _rows(USER, [1, 2]), "word": _rows(WORD, ["a"])}
    out = tmp_path / "out"
    with pytest.raises(ExportTooLargeError, match="needs about"):
        export_saved_model(model, out, rows=rows, unseen="zeros", memory_limit_bytes=1000)
    with pytest.raises(ConfigError, match="normal initializer"):
        export_saved_model(model, out, rows=rows)  # unseen="initializer"
    with pytest.raises(ConfigError, match="not bound to a cluster.*checkpoint_rows"):
        export_saved_model(model, out)  # no source, and no cluster to snapshot
    with pytest.raises(ConfigError, match="exactly one of them"):
        export_saved_model(model, out, rows=rows, ids={"user": [1]})
    with pytest.raises(ConfigError, match=r"tables \['word'\] are not in rows"):
        export_saved_model(model, out, rows={"user": rows["user"]}, unseen="zeros")
    with pytest.raises(ConfigError, match="dim=4 but table 'user' has dim=5"):
        wrong = TableRows(
            spec=TableSpec(name="user", dim=5, seed=1),
            ids=np.zeros(0, np.int64),
            rows=np.zeros((0, 5), np.float32),
        )
        export_saved_model(model, out, rows={**rows, "user": wrong}, unseen="zeros")
    with pytest.raises(ConfigError, match="unseen must be"):
        export_saved_model(model, out, rows=rows, unseen="random")  # type: ignore[arg-type]
    assert _leftovers(tmp_path) == []
    (out / "x").mkdir(parents=True)
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_saved_model(model, out, rows=rows, unseen="zeros")
    assert _leftovers(tmp_path) == ["out"] and _leftovers(out) == ["x"]


def test_a_layer_fed_ids_of_the_wrong_type_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    user = keras.Input(shape=(), dtype="string", name="user")
    model = keras.Model(user, DistributedEmbedding(USER)(user))
    with pytest.raises(ConfigError, match="table 'user' has int64 ids but the layer gets string"):
        export_saved_model(model, tmp_path / "a" / "b" / "1", rows={"user": _rows(USER, [1])})
    assert _leftovers(tmp_path) == []  # the parents it made are gone too


class _Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = DistributedEmbedding(USER)

    def call(self, inputs: Any) -> Any:
        return self.embedding(inputs)


def test_a_model_without_keras_inputs_is_refused(tmp_path: Path) -> None:
    """A signature needs the inputs' names and dtypes, which only keras.Input gives."""
    with pytest.raises(ConfigError, match="functional or Sequential model"):
        export_saved_model(_Subclassed(), tmp_path / "m", rows={"user": _rows(USER, [1])})
    assert _leftovers(tmp_path) == []


def test_the_writer_takes_rows_given_and_refuses_rows_that_do_not_fit(tmp_path: Path) -> None:
    """`write_saved_model`, what a checkpoint's export calls: rows in, a SavedModel out,
    no cluster; the refusals `export_saved_model` makes of `rows=` are its own."""
    rows = {"user": _rows(USER, [5]), "word": _rows(WORD, ["a"])}
    with pytest.raises(ConfigError, match=r"tables \['word'\] are not in rows"):
        write_saved_model(_model(), tmp_path / "m", {"user": rows["user"]}, unseen="zeros")
    with pytest.raises(ConfigError, match="normal initializer"):
        write_saved_model(_model(), tmp_path / "m", rows)  # unseen="initializer"
    with pytest.raises(ConfigError, match="unseen must be"):
        write_saved_model(_model(), tmp_path / "m", rows, unseen="none")  # type: ignore[arg-type]
    assert _leftovers(tmp_path) == []
    info = write_saved_model(_model(), tmp_path / "m", rows, unseen="zeros")
    assert info["tables"] == {"user": 1, "word": 1} and _leftovers(tmp_path) == ["m"]
    serve = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    (out,) = serve(user=tf.constant([5], tf.int64), word=tf.constant(["a"])).values()
    assert np.array_equal(
        np.asarray(out)[0], np.concatenate([rows["user"].rows[0], rows["word"].rows[0]])
    )
