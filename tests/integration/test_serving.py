"""A model trained on a real cluster, exported as a SavedModel, served without the project.

One module fixture does the slow part once: memcached (the session's nodes), the
optimizer service as a real process, a few training steps through it, a
checkpoint, `model.predict` with the layers bound to the cluster (what serving
must reproduce), and the export of two models from the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from lookup_table import EmbeddingStore, ExportTooLargeError, load_config
from lookup_table.config import ClusterConfig
from lookup_table.keras import DistributedEmbedding, checkpoint_rows, export_saved_model
from lookup_table.ops.checkpoint import save_checkpoint, unpack_str_ids
from lookup_table.ops.checkpoint.cli import main
from lookup_table.ops.localcluster import free_port
from tests.reliability.harness import ServiceProcess, cluster_file, wait_healthy

pytestmark = [
    pytest.mark.integration,
    # Keras' model.save / load_model call np.array(variable) on TF variables, whose
    # __array__ predates numpy 2's copy keyword (Keras' code, not ours)
    pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    ),
]

SGD = {"name": "sgd", "learning_rate": 0.5}  # big steps: trained rows are far from initial
TABLES: list[dict[str, Any]] = [
    # uniform(-0.05, 0.05); stored as bfloat16: exported as such, cast at lookup
    {"name": "user", "dim": 8, "seed": 1, "optimizer": SGD, "dtype": "bfloat16"},
    {
        "name": "item",
        "dim": 4,
        "seed": 2,
        "id_type": "string",
        "initializer": {"name": "uniform", "minval": -0.5, "maxval": 0.5},
        "optimizer": SGD,
    },
]
WORDS = ["a b", "x/y", "ünï", "", "日本", "tab\t", "😀", "nul\x00", "long" * 40]
NEVER_SEEN_USERS = [123_456_789, -(2**63), 2**63 - 1, -42]
NEVER_SEEN_ITEMS = ["never", "ünseen-" + "z" * 130, "\x00"]  # 2 BLAKE2b blocks


def _build(config: ClusterConfig) -> tuple[keras.Model, keras.Model, keras.Model]:
    """The trained model (int64 and string tables, dense, ragged and padded multi-hot
    inputs, every combiner, a table shared by layers), the same layers with the
    embeddings as a second output (so every row shows in what is compared), and a model
    over the same tables with sparse weighted inputs (which the trainer does not feed)."""
    user, item = config.table("user"), config.table("item")
    inputs = {
        "user": keras.Input(shape=(), dtype="int64", name="user"),
        "item": keras.Input(shape=(), dtype="string", name="item"),
        "tags": keras.Input(shape=(None,), dtype="string", name="tags", ragged=True),
        "hist": keras.Input(shape=(3,), dtype="int64", name="hist"),
        "clicks": keras.Input(shape=(1,), dtype="float32", name="clicks"),
    }
    emb = keras.layers.Concatenate(name="emb")(
        [
            DistributedEmbedding(user, feature="user")(inputs["user"]),
            DistributedEmbedding(item, feature="item")(inputs["item"]),
            DistributedEmbedding(item, combiner="mean", feature="tags", name="tags_mean")(
                inputs["tags"]
            ),
            DistributedEmbedding(
                user, combiner="sqrtn", padding_id=0, feature="hist", name="hist_sqrtn"
            )(inputs["hist"]),
        ]
    )
    hidden = keras.layers.Dense(8, activation="relu")(
        keras.layers.Concatenate()([emb, inputs["clicks"]])
    )
    score = keras.layers.Dense(1, activation="sigmoid", name="score")(hidden)
    trained = keras.Model(inputs, score, name="ctr")
    view = keras.Model(inputs, {"score": score, "emb": emb}, name="ctr_view")

    genres = keras.Input(shape=(4,), dtype="int64", name="genres", sparse=True)
    weights = keras.Input(shape=(4,), dtype="float32", name="genre_weights", sparse=True)
    words = keras.Input(shape=(2,), dtype="string", name="words")
    out = keras.layers.Concatenate()(
        [
            DistributedEmbedding(user, combiner="mean", name="genres_mean")(
                genres, sparse_weights=weights
            ),
            DistributedEmbedding(user, combiner="sum", name="genres_sum")(genres),
            DistributedEmbedding(item, combiner="sum", padding_id="", name="words_sum")(words),
        ]
    )
    sparse = keras.Model(
        {"genres": genres, "genre_weights": weights, "words": words},
        {"sparse_emb": out, "sparse_score": keras.layers.Dense(2, name="sparse_dense")(out)},
    )
    return trained, view, sparse


def _ragged(rows: list[list[Any]], dtype: Any) -> tf.RaggedTensor:
    return tf.ragged.constant(rows, dtype=dtype, inner_shape=())


def _batches(rng: np.random.Generator, count: int, size: int) -> list[tuple[dict[str, Any], Any]]:
    from trainer.data.batch import Ragged

    out = []
    for _ in range(count):
        tags = [list(rng.choice(WORDS, int(rng.integers(0, 4)))) for _ in range(size)]
        splits = np.concatenate([[0], np.cumsum([len(t) for t in tags])]).astype(np.int64)
        hist = rng.integers(0, 30, (size, 3)).astype(np.int64)
        hist[rng.random((size, 3)) < 0.3] = 0
        features = {
            "user": rng.integers(1, 30, size).astype(np.int64),
            "item": np.array(list(rng.choice(WORDS, size)), dtype=object),
            "tags": Ragged(values=np.array(sum(tags, []), dtype=object), row_splits=splits),
            "hist": hist,
            "clicks": rng.random((size, 1)).astype(np.float32),
        }
        out.append((features, (rng.random(size) < 0.5).astype(np.float32)))
    return out


# Queries: trained ids, ids never seen (their initial rows), padding, empty and
# all-padding rows, ids of the other table's type, ids beyond 128 bytes.
QUERY: dict[str, Any] = {
    "user": np.array([1, 2, *NEVER_SEEN_USERS, 29, 0], np.int64),
    "item": np.array(["a b", "ünï", *NEVER_SEEN_ITEMS, "", "long" * 40, "x/y"], dtype=object),
    "tags": [
        ["a b", "x/y"],
        [],
        ["never", "ünï", "a b"],
        ["long" * 40],
        ["", ""],
        ["7"],
        [],
        ["😀"],
    ],
    "hist": np.array(
        [
            [1, 0, 0],
            [0, 0, 0],
            [5, 999, 2**40],
            [7, 7, 0],
            [3, 0, 3],
            [-42, 1, 2],
            [0, 0, 9],
            [1, 2, 3],
        ],
        np.int64,
    ),
    "clicks": np.linspace(0, 1, 8, dtype=np.float32).reshape(8, 1),
}
SPARSE_INDICES = [[0, 0], [0, 2], [1, 1], [2, 0], [2, 3], [3, 1], [3, 2]]
SPARSE_QUERY: dict[str, Any] = {
    "genres": (SPARSE_INDICES, [1, 2, 777, 5, 5, 3, -(2**63)], [5, 4]),
    "genre_weights": (SPARSE_INDICES, [1.0, -2.0, 0.5, 0.25, 3.0, 0.0, 2.0], [5, 4]),
    "words": np.array(
        [["a b", ""], ["", ""], ["never", "x/y"], ["ünï", "ünï"], ["", "😀"]], dtype=object
    ),
}


def _keras_inputs(query: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in query.items():
        if name == "tags":
            out[name] = _ragged(value, tf.string)
        elif isinstance(value, tuple):
            dtype = tf.float32 if name == "genre_weights" else tf.int64
            out[name] = tf.SparseTensor(
                tf.constant(value[0], tf.int64), tf.constant(value[1], dtype), value[2]
            )
        elif value.dtype == object:
            out[name] = tf.constant(value.tolist(), tf.string)
        else:
            out[name] = tf.constant(value)
    return out


def _signature_inputs(query: dict[str, Any]) -> dict[str, Any]:
    """The query as the signature's named tensors, as JSON-able lists."""
    out: dict[str, Any] = {}
    for name, value in query.items():
        if name == "tags":
            out["tags_values"] = ["string", sum(value, [])]
            out["tags_row_lengths"] = ["int64", [len(v) for v in value]]
        elif isinstance(value, tuple):
            out[f"{name}_indices"] = ["int64", value[0]]
            out[f"{name}_values"] = ["float32" if name == "genre_weights" else "int64", value[1]]
            out[f"{name}_dense_shape"] = ["int64", value[2]]
        elif value.dtype == object:
            out[name] = ["string", value.tolist()]
        else:
            out[name] = [value.dtype.name, value.tolist()]
    return out


@dataclass
class Served:
    config: ClusterConfig
    checkpoint: Path
    model_file: Path  # the view's architecture, saved before training
    initial_dense: dict[str, np.ndarray]  # its weights then
    cli: tuple[int, str, str]  # the export of the view: exit code, stdout, stderr
    exports: dict[str, Path]  # "view" (from the command line), "sparse" (chosen ids)
    expected: dict[str, dict[str, np.ndarray]]  # model.predict, bound to the cluster
    sparse_info: dict[str, Any]  # what export_saved_model returned
    sparse_ids: dict[str, list[Any]]  # the ids it was asked to export


@pytest.fixture(scope="module")
def served(
    memcached_nodes: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """Train, save a checkpoint, predict with the layers bound to the cluster, then export
    the view with the command line (rows and dense weights from the checkpoint) and the
    sparse model with the Python API (rows of chosen ids read from the live cluster)."""
    from trainer import Trainer

    tmp = tmp_path_factory.mktemp("serving")
    port = free_port()
    config = load_config(cluster_file(tmp, memcached_nodes, port, tables=TABLES))

    async def init() -> None:
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()

    asyncio.run(init())
    service = ServiceProcess(tmp / "cluster.toml", port, tmp)
    service.start()
    try:
        asyncio.run(wait_healthy(service))
        keras.utils.set_random_seed(7)
        trained, view, sparse = _build(config)
        model_file = tmp / "ctr.keras"
        view.save(model_file)  # untrained weights: the command line takes the checkpoint's
        initial = {v.path: np.array(v.numpy()) for v in view.trainable_variables}
        with Trainer(config, trained, progress=False) as trainer:
            trainer.fit(_batches(np.random.default_rng(3), 4, 32))
        checkpoint = tmp / "ckpt"
        save_checkpoint(config, checkpoint, progress=False)
        expected: dict[str, dict[str, np.ndarray]] = {}
        for name, model, query in (("view", view, QUERY), ("sparse", sparse, SPARSE_QUERY)):
            with Trainer(config, model, progress=False):  # binds the layers to the cluster
                expected[name] = dict(model.predict(_keras_inputs(query), verbose=0))
        exports = {"view": tmp / "view" / "1", "sparse": tmp / "sparse" / "1"}
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(
                ["export", "--format", "savedmodel", "--dir", str(checkpoint)]
                + ["--model", str(model_file), "--out", str(exports["view"])]
            )
        seen = {name: sorted(t.ids.tolist()) for name, t in checkpoint_rows(checkpoint).items()}
        ids = {"user": seen["user"] + [555, 556], "item": seen["item"] + ["not created"]}
        info = export_saved_model(sparse, exports["sparse"], config=config, ids=ids)
        yield Served(
            config,
            checkpoint,
            model_file,
            initial,
            (code, out.getvalue(), err.getvalue()),
            exports,
            expected,
            info,
            ids,
        )
    finally:
        service.terminate()


def _checkpoint_ids(served: Served) -> dict[str, set[Any]]:
    rows = checkpoint_rows(served.checkpoint)
    return {name: set(t.ids.tolist()) for name, t in rows.items()}


SERVE = textwrap.dedent(
    """
    import importlib, json, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("lookup_table", "trainer", "optimizer_service", "tests"):
                raise ImportError(f"{name} is blocked in this process")
            return None

    sys.meta_path.insert(0, Blocked())
    for name in ("lookup_table", "trainer", "optimizer_service"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{name} could be imported")

    import numpy as np
    import tensorflow as tf

    jobs = json.loads(open(sys.argv[1], encoding="utf-8").read())
    for job in jobs:
        serve = tf.saved_model.load(job["path"]).signatures["serving_default"]
        args = {k: tf.constant(v, getattr(tf, t)) for k, (t, v) in job["inputs"].items()}
        out = {k: v.numpy() for k, v in serve(**args).items()}
        np.savez(job["out"], **out)
        # as TF Serving's C++ loader does: a graph, the restore op, the init op, and
        # the signature's tensors by name
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], job["path"])
            signature = meta.signature_def["serving_default"]
            feed = {signature.inputs[k].name: v.numpy() for k, v in args.items()}
            fetch = {k: v.name for k, v in signature.outputs.items()}
            np.savez(job["out"].replace(".npz", "-graph.npz"), **sess.run(fetch, feed))
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lookup_table", "trainer"))
    print(json.dumps({"project_modules": loaded}))
    """
)


@pytest.mark.timeout(240)
def test_served_without_the_project_equals_predict(served: Served, tmp_path: Path) -> None:
    """`tf.saved_model.load` in a process where lookup_table, trainer and
    optimizer_service cannot be imported serves both exports, and so does the TF1 graph
    loader (restore op, init op, tensors by name: how TF Serving loads a SavedModel);
    every output equals `model.predict` with the layers bound to the cluster: trained
    and never seen ids (their initial rows, int64 and string, BLAKE2b across blocks),
    padding, ragged, dense and sparse multi-hot inputs, every combiner, sparse weights."""
    assert served.cli[0] == 0, served.cli
    seen = _checkpoint_ids(served)
    assert not set(NEVER_SEEN_USERS) & seen["user"] and not set(NEVER_SEEN_ITEMS) & seen["item"]
    assert {1, 2, 29} <= seen["user"] and {"a b", "ünï", ""} <= seen["item"]
    jobs = [
        {
            "path": str(served.exports["view"]),
            "inputs": _signature_inputs(QUERY),
            "out": str(tmp_path / "view.npz"),
        },
        {
            "path": str(served.exports["sparse"]),
            "inputs": _signature_inputs(SPARSE_QUERY),
            "out": str(tmp_path / "sparse.npz"),
        },
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs), encoding="utf-8")
    (tmp_path / "serve.py").write_text(SERVE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    proc = subprocess.run(
        [sys.executable, "serve.py", "jobs.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"project_modules": []}
    for name in ("view", "sparse", "view-graph", "sparse-graph"):
        expected = served.expected[name.removesuffix("-graph")]
        with np.load(tmp_path / f"{name}.npz", allow_pickle=False) as got:
            assert sorted(got.files) == sorted(expected)
            for key, want in expected.items():
                assert got[key].shape == want.shape, (name, key)
                np.testing.assert_allclose(
                    got[key], want, rtol=0, atol=1e-5, err_msg=f"{name}/{key}"
                )
    # a 16-bit table's rows are exported as stored: half float32's bytes
    for path in served.exports.values():
        reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
        dtypes, shapes = reader.get_variable_to_dtype_map(), reader.get_variable_to_shape_map()
        half = [shapes[k][1] for k, dtype in dtypes.items() if dtype == tf.bfloat16]
        assert half == [8], dtypes  # the user table's rows, and nothing else
    # the never seen ids' initial rows matter to the output (zeros would not pass)
    emb = served.expected["view"]["emb"]
    assert np.abs(emb[2:6, :8]).min() > 0 and np.abs(emb[2:5, 8:12]).min() > 0


def test_the_export_holds_only_core_tf_ops(served: Served) -> None:
    """No py_function (the layers' lookups in training) and no op TF does not register:
    what TF Serving needs to load it unchanged."""
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.python.framework import op_def_registry

    for path in served.exports.values():
        doc = saved_model_pb2.SavedModel()
        doc.ParseFromString((path / "saved_model.pb").read_bytes())
        graph = doc.meta_graphs[0].graph_def
        ops = {n.op for n in graph.node} | {
            n.op for f in graph.library.function for n in f.node_def
        }
        functions = {f.signature.name for f in graph.library.function}
        assert "LookupTableFindV2" in ops and "MutableDenseHashTableV2" in ops
        assert not ops & {"PyFunc", "PyFuncStateless", "EagerPyFunc"}
        unknown = sorted(op for op in ops - functions if op_def_registry.get(op) is None)
        assert unknown == []
        signatures = [k for k in doc.meta_graphs[0].signature_def if not k.startswith("__")]
        assert signatures == ["serving_default"]  # and __saved_model_init_op (the tables)


def test_an_export_of_chosen_ids_reads_them_from_the_cluster(served: Served) -> None:
    """`config=` and `ids=`: the rows are read with the store; ids without a row are left
    out (served as unseen, as the cluster answers them). The served outputs are checked
    against predict in the first test."""
    seen = _checkpoint_ids(served)
    assert served.sparse_ids["user"][-2:] == [555, 556] and 555 not in seen["user"]
    info = served.sparse_info
    assert info["tables"] == {"item": len(seen["item"]), "user": len(seen["user"])}
    assert info["outputs"] == ["sparse_emb", "sparse_score"]
    assert info["inputs"] == [
        "genre_weights_indices",
        "genre_weights_values",
        "genre_weights_dense_shape",
        "genres_indices",
        "genres_values",
        "genres_dense_shape",
        "words",
    ]
    assert info["bytes"] == sum(
        p.stat().st_size for p in served.exports["sparse"].rglob("*") if p.is_file()
    )


def test_an_export_too_big_for_memory_is_refused_before_anything(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The estimate is checked against the limit before the cluster or the checkpoint is
    read and before anything is written, from Python and from the command line."""
    out = tmp_path / "big" / "1"
    ids = {"user": list(range(1, 30)), "item": WORDS}
    model = _build(served.config)[1]
    with pytest.raises(ExportTooLargeError) as info:
        export_saved_model(model, out, config=served.config, ids=ids, memory_limit_bytes=1000)
    assert f"needs about {info.value.needed_bytes:,} bytes" in str(info.value)
    assert "limit given is 1,000 bytes" in str(info.value) and info.value.needed_bytes > 1000
    args = ["export", "--format", "savedmodel", "--dir", str(served.checkpoint)]
    args += ["--model", str(served.model_file), "--out", str(out), "--memory-limit-bytes", "1000"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "needs about" in err and "1,000 bytes" in err and "nothing was written" in err
    assert not (tmp_path / "big").exists()


def test_the_command_line_exports_a_checkpoint_with_its_dense_weights(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lookup-table-checkpoint export --format savedmodel` (the view served in the first
    test): the architecture from the model file, saved before training, the rows and the
    trained dense weights from the checkpoint; `--format npz` stays the default."""
    code, printed, _ = served.cli
    assert code == 0
    assert f"SavedModel to {served.exports['view']}" in printed
    assert "dense weights from the checkpoint" in printed and "returns emb, score" in printed
    manifest = json.loads((served.checkpoint / "manifest.json").read_text())
    for p in manifest["dense"]["params"]:  # training moved every weight the file holds
        trained = np.load(served.checkpoint / p["file"], allow_pickle=False)
        assert np.abs(trained - served.initial_dense[p["name"]]).max() > 1e-4, p["name"]
    args = ["export", "--format", "savedmodel", "--dir", str(served.checkpoint)]
    assert main([*args, "--out", str(tmp_path / "m")]) == 1
    assert "needs --model" in capsys.readouterr().err
    npz = tmp_path / "rows.npz"
    assert main(["export", "--dir", str(served.checkpoint), "--out", str(npz)]) == 0
    with np.load(npz, allow_pickle=False) as doc:
        words = unpack_str_ids(doc["item/ids_utf8"], doc["item/ids_offsets"])
    assert set(words.tolist()) == _checkpoint_ids(served)["item"]
    assert not (tmp_path / "m").exists()
