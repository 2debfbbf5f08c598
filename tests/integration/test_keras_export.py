"""Export, save, load and checkpoint a model trained with Keras' `model.fit` on a real
local cluster (memcached processes and the optimizer service, rows written behind).

Every test trains the same architecture in one namespace (the service holds one set of
dense parameters): an int64 table, whose rows the replica holds and writes behind, and a
string table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lookup_table import load_config
from lookup_table.config import ClusterConfig
from lookup_table.errors import ConfigError
from tests.integration.test_trainer import _cluster_file, _running

pytestmark = [
    pytest.mark.integration,
    # Keras' model.save / load_model call np.array(variable) on TF variables, whose
    # __array__ predates numpy 2's copy keyword (Keras' code, not ours)
    pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
    ),
]

TABLES = (
    '\n[[tables]]\nname = "C1"\ndim = 8\noptimizer = { name = "adam", learning_rate = 0.05 }\n'
    '\n[[tables]]\nname = "city"\ndim = 4\nid_type = "string"\n'
    'optimizer = { name = "adam", learning_rate = 0.05 }\n'
)
VOCABULARY = 300
CITIES = [f"city-{i}" for i in range(20)]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterConfig]:
    tmp = tmp_path_factory.mktemp("keras-export")
    path = _cluster_file(tmp / "cluster.toml", mode="async", workers=1, tables=TABLES)
    with _running(path, tmp / "run"):
        loaded = load_config(path)
        assert loaded.reads_through_owner("C1")  # its rows are written behind
        yield loaded


def _model(config: ClusterConfig, *, compile: bool = True) -> Any:
    import keras

    from lookup_table.keras import DistributedEmbedding, RemoteOptimizer

    keras.utils.set_random_seed(0)
    inputs = {
        "C1": keras.Input(shape=(), dtype="int64", name="C1"),
        "city": keras.Input(shape=(), dtype="string", name="city"),
    }
    x = keras.layers.Concatenate(name="emb")(
        [
            DistributedEmbedding(config.table("C1"))(inputs["C1"]),
            DistributedEmbedding(config.table("city"))(inputs["city"]),
        ]
    )
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", name="out")(hidden))
    if compile:
        model.compile(optimizer=RemoteOptimizer(config), loss="binary_crossentropy")
    return model


def _data(n: int, *, seed: int, strings: str = "object") -> tuple[dict[str, Any], Any]:
    """Labels decided by hidden per-id weights; city ids as `strings`: "object" (an
    object array of str) or "unicode" (`np.array(list_of_str)`, dtype <U...)."""
    rng = np.random.default_rng(seed)
    hidden = np.random.default_rng(99)
    w1, w2 = hidden.normal(0, 2, VOCABULARY), hidden.normal(0, 2, len(CITIES))
    c1, city = rng.integers(0, VOCABULARY, n), rng.integers(0, len(CITIES), n)
    p = 1 / (1 + np.exp(-(w1[c1] + w2[city])))
    names = [CITIES[i] for i in city]
    column = np.array(names, dtype=object) if strings == "object" else np.array(names)
    return {"C1": c1, "city": column}, (rng.random(n) < p).astype(np.float32)


QUERY: dict[str, Any] = {
    "C1": np.array([*range(VOCABULARY), 10_000, -5], np.int64),
    "city": np.array([CITIES[i % len(CITIES)] for i in range(VOCABULARY)] + ["never", ""], object),
}


def _served(path: Path) -> Any:
    import tensorflow as tf

    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    out = serve(C1=tf.constant(QUERY["C1"]), city=tf.constant(QUERY["city"].tolist(), tf.string))
    (value,) = out.values()
    return value.numpy()


def _close(model: Any) -> None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "close"):
        optimizer.close()


@pytest.mark.timeout(300)
def test_an_export_right_after_fit_serves_what_predict_predicts(
    config: ClusterConfig, tmp_path: Path
) -> None:
    """The replica holds the rows it updated and writes them behind: an export right
    after `fit` (ids chosen, the whole snapshot, and Keras' own `model.export`) must
    still serve exactly what `model.predict` answers."""
    from lookup_table.keras import export_saved_model

    model = _model(config)
    try:
        x, y = _data(4096, seed=1)
        model.fit(x, y, batch_size=256, epochs=2, verbose=0)
        expected = model.predict(QUERY, verbose=0)
        ids = {"C1": np.arange(VOCABULARY), "city": CITIES}
        export_saved_model(model, tmp_path / "chosen", config=config, ids=ids)
        np.testing.assert_allclose(_served(tmp_path / "chosen"), expected, rtol=0, atol=1e-6)

        model.fit(x, y, batch_size=256, epochs=1, verbose=0)
        expected = model.predict(QUERY, verbose=0)
        info = export_saved_model(model, tmp_path / "snapshot")
        assert info["tables"] == {"C1": VOCABULARY, "city": len(CITIES)}
        assert info["dense"] == "checkpoint"
        np.testing.assert_allclose(_served(tmp_path / "snapshot"), expected, rtol=0, atol=1e-6)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

        model.fit(x, y, batch_size=256, epochs=1, verbose=0)
        expected = model.predict(QUERY, verbose=0)
        model.export(str(tmp_path / "keras-export"))
        np.testing.assert_allclose(_served(tmp_path / "keras-export"), expected, rtol=0, atol=1e-6)
        with pytest.raises(ConfigError, match=r"export_saved_model\(model, path\)"):
            model.export(str(tmp_path / "onnx"), format="onnx")
    finally:
        _close(model)


def test_an_unbound_model_says_how_to_export(config: ClusterConfig, tmp_path: Path) -> None:
    from lookup_table.keras import export_saved_model

    model = _model(config, compile=False)
    with pytest.raises(
        ConfigError,
        match=r"not bound to a cluster.*RemoteOptimizer.*"
        r"lookup_table\.keras\.export_saved_model\(model, path\)",
    ):
        model.export(str(tmp_path / "m"))
    with pytest.raises(ConfigError, match=r"rows=lookup_table.keras.checkpoint_rows"):
        export_saved_model(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.timeout(300)
def test_load_model_reads_a_saved_model_that_predicts_the_same(
    config: ClusterConfig, tmp_path: Path
) -> None:
    """`model.save` then `keras.models.load_model` with nothing but `import
    lookup_table.keras`: the loaded model is compiled with its RemoteOptimizer, binds to
    the cluster and predicts what the original predicts."""
    import keras

    from lookup_table.keras import RemoteOptimizer

    model = _model(config)
    loaded = None
    try:
        x, y = _data(2048, seed=2)
        model.fit(x, y, batch_size=256, epochs=1, verbose=0)
        expected = model.predict(QUERY, verbose=0)
        model.save(tmp_path / "m.keras")
        loaded = keras.models.load_model(tmp_path / "m.keras")
        assert isinstance(loaded.optimizer, RemoteOptimizer)
        assert loaded.optimizer.config.namespace == config.namespace
        np.testing.assert_allclose(loaded.predict(QUERY, verbose=0), expected, rtol=0, atol=1e-6)
        bare = keras.models.load_model(tmp_path / "m.keras", compile=False)
        bare.compile(optimizer=RemoteOptimizer(config), loss="binary_crossentropy")
        try:
            np.testing.assert_allclose(bare.predict(QUERY, verbose=0), expected, rtol=0, atol=1e-6)
        finally:
            _close(bare)
    finally:
        _close(model)
        if loaded is not None:
            _close(loaded)


@pytest.mark.timeout(300)
def test_numpy_str_ids_train_evaluate_and_predict(config: ClusterConfig) -> None:
    """`np.array(list_of_str)` (dtype <U...) ids of a string table, which Keras' array
    adapter refuses, work in fit (and its validation data), evaluate, predict and the
    *_on_batch methods, exactly as an object array of the same str."""
    model = _model(config)
    try:
        x, y = _data(2048, seed=3, strings="unicode")
        assert x["city"].dtype.kind == "U"
        xv, yv = _data(512, seed=4, strings="unicode")
        history = model.fit(x, y, batch_size=256, epochs=1, verbose=0, validation_data=(xv, yv))
        assert "val_loss" in history.history
        as_objects = {"C1": xv["C1"], "city": xv["city"].astype(object)}
        loss = model.evaluate(xv, yv, batch_size=256, verbose=0)
        assert loss == pytest.approx(model.evaluate(as_objects, yv, batch_size=256, verbose=0))
        np.testing.assert_array_equal(
            model.predict(xv, verbose=0), model.predict(as_objects, verbose=0)
        )
        batch = {"C1": x["C1"][:64], "city": x["city"][:64]}
        model.train_on_batch(batch, y[:64])
        assert np.isfinite(model.test_on_batch(batch, y[:64]))
        assert model.predict_on_batch(batch).shape == (64, 1)
    finally:
        _close(model)


@pytest.mark.timeout(300)
def test_restore_best_weights_is_refused_and_the_checkpoint_callback_replaces_it(
    config: ClusterConfig, tmp_path: Path
) -> None:
    """EarlyStopping(restore_best_weights=True) cannot restore the rows: refused before
    any step, naming the way that works; CheckpointCallback saves every N epochs (and
    the last), keeps the newest `keep_last`, and with `monitor` the best epoch, whose
    restore brings back its rows and dense weights."""
    import keras

    from lookup_table.keras import CheckpointCallback, checkpoint_rows, export_saved_model
    from lookup_table.ops.checkpoint import restore_checkpoint

    model = _model(config)
    try:
        x, y = _data(2048, seed=5)
        xv, yv = _data(512, seed=6)
        stop = keras.callbacks.EarlyStopping(monitor="val_loss", restore_best_weights=True)
        with pytest.raises(ConfigError, match=r"CheckpointCallback.*restore_checkpoint"):
            model.fit(x, y, epochs=2, validation_data=(xv, yv), callbacks=[stop], verbose=0)
        with pytest.raises(ConfigError, match="restore_best_weights=True"):
            model.fit(x, y, 256, 2, 0, [stop])  # callbacks passed by position

        every = CheckpointCallback(tmp_path / "every", every_epochs=2)
        newest = CheckpointCallback(tmp_path / "newest", keep_last=1)
        best = CheckpointCallback(tmp_path / "best", monitor="val_loss")
        model.fit(
            x,
            y,
            batch_size=256,
            epochs=3,
            validation_data=(xv, yv),
            callbacks=[every, newest, best],
            verbose=0,
        )
        assert sorted(p.name for p in (tmp_path / "every").iterdir()) == [
            "epoch-0002",
            "epoch-0003",
        ]
        assert [p.name for p in (tmp_path / "newest").iterdir()] == ["epoch-0003"]
        assert best.best_path is not None and best.best_path.is_dir()
        assert (best.best_path / "manifest.json").is_file()

        summary = restore_checkpoint(config, best.best_path, force=True, progress=False)
        assert summary["rows"] > 0
        restored = model.predict(QUERY, verbose=0)  # pulls the restored dense weights
        export_saved_model(model, tmp_path / "best-export", rows=checkpoint_rows(best.best_path))
        np.testing.assert_allclose(_served(tmp_path / "best-export"), restored, rtol=0, atol=1e-6)

        with pytest.raises(ConfigError, match="every_epochs must be a positive integer"):
            CheckpointCallback(tmp_path / "x", every_epochs=0)
        with pytest.raises(ConfigError, match="keep_last must be a positive integer"):
            CheckpointCallback(tmp_path / "x", keep_last=0)
        with pytest.raises(ConfigError, match="mode must be"):
            CheckpointCallback(tmp_path / "x", mode="up")
        missing = CheckpointCallback(tmp_path / "missing", monitor="val_auc")
        with pytest.raises(ConfigError, match="logs have no such value"):
            model.fit(x, y, batch_size=256, epochs=1, callbacks=[missing], verbose=0)
    finally:
        _close(model)


@pytest.mark.timeout(300)
def test_save_and_restore_checkpoint_work_inside_a_running_event_loop(
    config: ClusterConfig, tmp_path: Path
) -> None:
    """As in Jupyter, where a loop runs: the sync functions return their result (run on a
    private thread's loop), and the _async twins are awaited on the caller's loop."""
    from lookup_table.ops.checkpoint import (
        restore_checkpoint,
        restore_checkpoint_async,
        save_checkpoint,
        save_checkpoint_async,
    )

    model = _model(config)
    try:
        x, y = _data(1024, seed=7)
        model.fit(x, y, batch_size=256, epochs=1, verbose=0)
        expected = model.predict(QUERY, verbose=0)
    finally:
        _close(model)

    async def in_a_loop() -> tuple[Any, Any, Any, Any]:
        asyncio.get_running_loop()  # a loop runs here, as in a notebook cell
        saved = save_checkpoint(config, tmp_path / "sync", progress=False)
        restored = restore_checkpoint(config, tmp_path / "sync", force=True, progress=False)
        saved_async = await save_checkpoint_async(config, tmp_path / "async", progress=False)
        restored_async = await restore_checkpoint_async(
            config, tmp_path / "async", force=True, progress=False
        )
        return saved, restored, saved_async, restored_async

    saved, restored, saved_async, restored_async = asyncio.run(in_a_loop())
    for result in (saved, restored, saved_async, restored_async):
        assert isinstance(result, dict)
    assert {t["name"]: t["count"] for t in saved["tables"]} == {
        t["name"]: t["count"] for t in saved_async["tables"]
    }
    assert restored["rows"] == restored_async["rows"] == sum(t["count"] for t in saved["tables"])
    again = _model(config)
    try:
        np.testing.assert_allclose(again.predict(QUERY, verbose=0), expected, rtol=0, atol=1e-6)
    finally:
        _close(again)


@pytest.mark.timeout(300)
def test_a_model_a_trainer_binds_exports_its_snapshot(
    config: ClusterConfig, tmp_path: Path
) -> None:
    """Layers bound by `trainer.Trainer` (no RemoteOptimizer): `export_saved_model(model,
    path)` snapshots the Trainer's cluster right after its fit."""
    from lookup_table.keras import export_saved_model
    from trainer import Trainer

    model = _model(config, compile=False)
    x, y = _data(2048, seed=8)
    batches = [
        ({"C1": x["C1"][i : i + 256], "city": x["city"][i : i + 256]}, y[i : i + 256])
        for i in range(0, 2048, 256)
    ]
    with Trainer(config, model, progress=False) as trainer:
        trainer.fit(batches)
        expected = model.predict(QUERY, verbose=0)
        info = export_saved_model(model, tmp_path / "m")
    assert info["dense"] == "checkpoint"
    np.testing.assert_allclose(_served(tmp_path / "m"), expected, rtol=0, atol=1e-6)
