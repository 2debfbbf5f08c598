"""Keras' own `model.fit` / `evaluate` / `predict` against a real local cluster
(memcached processes and the optimizer service), compiled with `RemoteOptimizer`."""

from __future__ import annotations

import asyncio
import csv
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lookup_table import EmbeddingStore, load_config
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig
from lookup_table.errors import ConfigError, PushRejectedError, ReplicaUnavailableError
from tests.conftest import worker_metrics, written
from tests.integration.test_trainer import _cluster_file, _running

pytestmark = pytest.mark.integration

TABLES = (
    '\n[[tables]]\nname = "C1"\ndim = 8\noptimizer = { name = "adam", learning_rate = 0.02 }\n'
    '\n[[tables]]\nname = "C2"\ndim = 8\noptimizer = { name = "adam", learning_rate = 0.02 }\n'
    '\n[[tables]]\nname = "city"\ndim = 4\nid_type = "string"\n'
    'optimizer = { name = "adam", learning_rate = 0.05 }\n'
    '\n[[tables]]\nname = "tags"\ndim = 4\nid_type = "string"\n'
    'optimizer = { name = "sgd", learning_rate = 0.5 }\n'
)


def _cluster(tmp_path: Path, tag: str, *, mode: str = "async", workers: int = 1) -> Path:
    return _cluster_file(tmp_path / f"{tag}.toml", mode=mode, workers=workers, tables=TABLES)


def _readme_model(config: ClusterConfig, *, seed: int = 0, feature: bool = False) -> Any:
    """README's model: two DistributedEmbedding layers, Dense 16 relu, Dense 1 sigmoid.
    The dense layers are named, so every process and thread names the service's dense
    parameters alike. `feature` names the layers' columns (Trainer feeds only those;
    model.fit finds them in the model's graph either way)."""
    import keras

    from lookup_table.keras import DistributedEmbedding

    keras.utils.set_random_seed(seed)
    c1 = keras.Input(shape=(), dtype="int64", name="C1")
    c2 = keras.Input(shape=(), dtype="int64", name="C2")
    x = keras.layers.Concatenate()(
        [
            DistributedEmbedding(config.table(name), feature=name if feature else None)(column)
            for name, column in (("C1", c1), ("C2", c2))
        ]
    )
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="out")(hidden)
    return keras.Model({"C1": c1, "C2": c2}, out)


def _data(n: int, *, seed: int, vocabulary: int = 60) -> tuple[dict[str, Any], Any]:
    """Ids whose hidden per-id weights decide the label (learnable from the rows alone)."""
    rng = np.random.default_rng(seed)
    hidden = np.random.default_rng(99)
    w1, w2 = hidden.normal(0, 1.5, vocabulary), hidden.normal(0, 1.5, vocabulary)
    c1, c2 = rng.integers(0, vocabulary, n), rng.integers(0, vocabulary, n)
    p = 1 / (1 + np.exp(-(w1[c1] + w2[c2])))
    return {"C1": c1, "C2": c2}, (rng.random(n) < p).astype(np.float32)


def _service_state(
    config: ClusterConfig, ids: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stored rows of `ids` (create=False; rows written behind: after a flush) and the
    service's dense parameters."""

    async def read() -> tuple[dict[str, Any], dict[str, Any]]:
        await written(config)
        async with EmbeddingStore(config) as store, OptimizerClient(config) as client:
            rows = {t: await store.lookup(t, i, create=False) for t, i in ids.items()}
            return rows, (await client.dense())[1]

    return asyncio.run(read())


def _item_count(config: ClusterConfig) -> int:
    async def count() -> int:
        async with EmbeddingStore(config) as store:
            stats = await store.stats()
        return sum(int(s["curr_items"]) for s in stats.values())

    return asyncio.run(count())


@pytest.mark.timeout(300)
# Keras 3.15 saves a variable with np.array(variable), which numpy 2 deprecates (the
# variable's __array__ lacks `copy`): Keras' warning, not ours
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept:DeprecationWarning")
def test_the_readme_snippet_trains_with_model_fit(tmp_path: Path) -> None:
    """The issue's snippet, unchanged apart from the optimizer: compile with
    RemoteOptimizer and AUC, fit numpy dicts with validation data and callbacks, then
    evaluate and predict; predict before any training is a clear error, and evaluate and
    predict agree with the rows and dense weights the service holds."""
    import keras

    from lookup_table.keras import RemoteOptimizer

    path = _cluster(tmp_path, "readme")
    x, y = _data(8192, seed=1)
    xv, yv = _data(2048, seed=2)
    with _running(path, tmp_path / "run"):
        config = load_config(path)
        model = _readme_model(config)
        optimizer = RemoteOptimizer(config)
        model.compile(
            optimizer=optimizer,
            loss="binary_crossentropy",
            metrics=[keras.metrics.AUC(name="auc")],
        )
        try:
            with pytest.raises(PushRejectedError, match="model.predict before any training"):
                model.predict(xv, verbose=0)
            log, best = tmp_path / "log.csv", tmp_path / "best.keras"
            history = model.fit(
                x,
                y,
                batch_size=1024,
                epochs=3,
                validation_data=(xv, yv),
                verbose=0,
                callbacks=[
                    keras.callbacks.EarlyStopping(monitor="val_auc", mode="max", patience=2),
                    keras.callbacks.CSVLogger(str(log)),
                    keras.callbacks.ModelCheckpoint(
                        str(best), monitor="val_auc", mode="max", save_best_only=True
                    ),
                ],
            )
            h = history.history
            assert set(h) == {"loss", "auc", "val_loss", "val_auc"}
            assert len(h["loss"]) == 3
            assert h["loss"][-1] < h["loss"][0] - 0.05, h
            assert h["val_auc"][-1] > max(0.75, h["val_auc"][0]), h
            with log.open() as fh:
                rows = list(csv.DictReader(fh))
            assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
            assert float(rows[-1]["val_auc"]) == pytest.approx(h["val_auc"][-1], rel=1e-5)
            assert best.stat().st_size > 0
            # every layer got its rows as step arguments, none through a py_function
            assert optimizer.session is not None
            assert [layer.table for layer in optimizer.session.fed_layers] == ["C1", "C2"]
            # each step reported its batch to the service's /metrics (the loss stays a
            # tensor: reading it would wait for the device)
            examples = worker_metrics(config, "lookup_table_worker_examples_total")
            assert examples == {"0": 3 * 8192}
            assert worker_metrics(config, "lookup_table_worker_loss") == {}

            asyncio.run(written(config))  # no flush of the training's rows in between
            items = _item_count(config)
            unseen = {"C1": np.arange(10_000, 10_512), "C2": np.arange(20_000, 20_512)}
            ev = model.evaluate(xv, yv, batch_size=512, return_dict=True, verbose=0)
            preds = model.predict(xv, batch_size=512, verbose=0)
            model.predict(unseen, verbose=0)  # ids never trained: read, not created
            assert _item_count(config) == items
            assert ev["auc"] == pytest.approx(h["val_auc"][-1], abs=1e-6)
            # predict = the model computed from the rows and weights the service holds
            stored, dense = _service_state(config, xv)
            assert [v.path for v in model.trainable_variables] == list(dense)
            e = np.concatenate([stored["C1"], stored["C2"]], axis=1)
            hid = np.maximum(e @ dense["hidden/kernel"] + dense["hidden/bias"], 0)
            want = 1 / (1 + np.exp(-(hid @ dense["out/kernel"] + dense["out/bias"])))
            np.testing.assert_allclose(preds, want, atol=2e-6)
            p = np.clip(preds.reshape(-1), 1e-7, 1 - 1e-7)
            bce = -np.mean(yv * np.log(p) + (1 - yv) * np.log(1 - p))
            assert ev["loss"] == pytest.approx(bce, abs=1e-5)
        finally:
            optimizer.close()


@pytest.mark.timeout(300)
def test_tf_data_with_a_string_table_and_a_ragged_combiner(tmp_path: Path) -> None:
    """tf.data input; an int64 table, a string table and a ragged multi-hot string
    column combined with "mean": every layer is fed its rows, the string and ragged rows
    are trained in the store, and the loss falls."""
    import keras
    import tensorflow as tf

    from lookup_table.keras import DistributedEmbedding, RemoteOptimizer

    path = _cluster(tmp_path, "strings")
    rng = np.random.default_rng(3)
    n = 3072
    c1 = rng.integers(0, 40, n)
    city = np.array([f"city{i}" for i in rng.integers(0, 12, n)])
    lengths = rng.integers(0, 4, n)
    tag_ids = rng.integers(0, 9, int(lengths.sum()))
    tags = tf.RaggedTensor.from_row_lengths([f"t{i}" for i in tag_ids], lengths)
    w_c1, w_city, w_tag = rng.normal(0, 1.5, 40), rng.normal(0, 1.5, 12), rng.normal(0, 2, 9)
    tag_sum = np.bincount(np.repeat(np.arange(n), lengths), w_tag[tag_ids], minlength=n)
    city_index = np.array([int(c[4:]) for c in city])
    logit = w_c1[c1] + w_city[city_index] + tag_sum / np.maximum(lengths, 1)
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    features = {"C1": c1, "city": city, "tags": tags}
    dataset = tf.data.Dataset.from_tensor_slices((features, y)).shuffle(n, seed=1).batch(256)
    with _running(path, tmp_path / "run"):
        config = load_config(path)
        keras.utils.set_random_seed(0)
        inputs = {
            "C1": keras.Input(shape=(), dtype="int64", name="C1"),
            "city": keras.Input(shape=(), dtype="string", name="city"),
            "tags": keras.Input(shape=(None,), dtype="string", name="tags", ragged=True),
        }
        x = keras.layers.Concatenate()(
            [
                DistributedEmbedding(config.table("C1"))(inputs["C1"]),
                DistributedEmbedding(config.table("city"))(inputs["city"]),
                DistributedEmbedding(config.table("tags"), combiner="mean")(inputs["tags"]),
            ]
        )
        out = keras.layers.Dense(1, activation="sigmoid", name="out")(x)
        model = keras.Model(inputs, out)
        optimizer = RemoteOptimizer(config)
        model.compile(optimizer=optimizer, loss="binary_crossentropy")
        try:
            initial = asyncio.run(_initial_rows(config))
            history = model.fit(dataset, epochs=3, shuffle=False, verbose=0)
            losses = history.history["loss"]
            assert losses[-1] < losses[0] - 0.05, losses
            assert optimizer.session is not None
            assert sorted(layer.table for layer in optimizer.session.fed_layers) == [
                "C1",
                "city",
                "tags",
            ]
            created = optimizer.session.rows_created
            assert created == {"C1": 40, "city": 12, "tags": 9}, created
            trained = asyncio.run(_initial_rows(config, create=False))
            for table in ("city", "tags"):  # trained: far from their initial values
                assert np.abs(trained[table] - initial[table]).max() > 0.05, table
            preds = model.predict(dataset.map(lambda f, label: f), verbose=0)
            assert preds.shape == (n, 1)
        finally:
            optimizer.close()


async def _initial_rows(config: ClusterConfig, *, create: bool = False) -> dict[str, Any]:
    async with EmbeddingStore(config) as store:
        return {
            "city": await store.lookup("city", [f"city{i}" for i in range(12)], create=create),
            "tags": await store.lookup("tags", [f"t{i}" for i in range(9)], create=create),
        }


@pytest.mark.timeout(300)
def test_model_fit_trains_exactly_as_trainer_fit(tmp_path: Path) -> None:
    """One worker, async, the same batches from the same weights on fresh clusters:
    model.fit (a tf.data input, one step per epoch, so each epoch's loss is one step's)
    gives Trainer.fit's losses, dense weights and rows. A stale row or weight would
    differ by a whole Adam step."""
    import keras
    import tensorflow as tf

    from lookup_table.keras import RemoteOptimizer
    from trainer import Trainer

    x, y = _data(14 * 256, seed=5, vocabulary=300)  # consecutive batches share ids
    batches = [
        ({k: v[i : i + 256] for k, v in x.items()}, y[i : i + 256]) for i in range(0, 14 * 256, 256)
    ]
    results = []
    for tag in ("trainer", "fit"):
        path = _cluster(tmp_path, tag)
        with _running(path, tmp_path / f"run-{tag}"):
            config = load_config(path)
            model = _readme_model(config, seed=3, feature=True)
            if tag == "trainer":
                with Trainer(config, model, progress=False) as trainer:
                    losses = [loss for _, loss in trainer.fit(batches).losses]
                    fed = len(trainer.fed_layers)
            else:
                optimizer = RemoteOptimizer(config)
                model.compile(optimizer=optimizer, loss="binary_crossentropy")
                dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(256)
                try:
                    history = model.fit(
                        dataset, epochs=14, steps_per_epoch=1, shuffle=False, verbose=0
                    )
                    assert optimizer.session is not None
                    fed = len(optimizer.session.fed_layers)
                finally:
                    optimizer.close()
                losses = history.history["loss"]
                assert int(optimizer.iterations.numpy()) == 14
            rows, dense = _service_state(config, {t: np.unique(x[t]) for t in ("C1", "C2")})
            results.append((np.array(losses), rows, dense, fed))
            keras.backend.clear_session()
    (loss_a, rows_a, dense_a, fed_a), (loss_b, rows_b, dense_b, fed_b) = results
    assert fed_a == fed_b == 2
    assert loss_a.shape == (14,) and loss_a[-1] < loss_a[0]
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5)
    assert dense_a.keys() == dense_b.keys()
    for name in dense_a:
        np.testing.assert_allclose(dense_b[name], dense_a[name], atol=1e-6)
    for table in rows_a:
        np.testing.assert_allclose(rows_b[table], rows_a[table], atol=1e-6)


@pytest.mark.timeout(300)
def test_two_workers_train_one_model_in_sync_mode(tmp_path: Path) -> None:
    """Sync mode, 2 workers (threads, each its own model and RemoteOptimizer, its own
    half of the data): the service applies both workers' pushes once per version, so
    both step through the same versions and end with the service's dense weights."""
    import keras

    from lookup_table.keras import RemoteOptimizer

    path = _cluster(tmp_path, "sync", mode="sync", workers=2)
    x, y = _data(4096, seed=7)
    with _running(path, tmp_path / "run"):
        config = load_config(path)
        with pytest.raises(ConfigError, match="workers = 2 in sync mode"):
            RemoteOptimizer(config, worker_index=0, num_workers=3)
        models = [_readme_model(config, seed=0) for _ in range(2)]
        optimizers = [RemoteOptimizer(config, worker_index=i, num_workers=2) for i in range(2)]
        histories: list[Any] = [None, None]
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                models[i].compile(
                    optimizer=optimizers[i],
                    loss="binary_crossentropy",
                    metrics=[keras.metrics.AUC(name="auc")],
                )
                shard = {k: v[i::2] for k, v in x.items()}
                histories[i] = models[i].fit(shard, y[i::2], batch_size=256, epochs=2, verbose=0)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=240)
            assert not errors, errors
            steps = 2 * 2048 // 256
            sessions = [opt.session for opt in optimizers]
            assert all(s is not None for s in sessions)
            # fit ends with the service's weights: the version after both workers' steps
            assert [s.version for s in sessions if s is not None] == [steps, steps]
            _, dense = _service_state(config, {})
            for model in models:
                for v in model.trainable_variables:
                    np.testing.assert_allclose(v.numpy(), dense[v.path], atol=1e-6)
            for h in histories:
                assert h.history["loss"][-1] < h.history["loss"][0]
        finally:
            for opt in optimizers:
                opt.close()


@pytest.mark.timeout(120)
def test_misuse_gives_clear_errors(tmp_path: Path) -> None:
    """Another optimizer, an uncompiled predict, a table the cluster file lacks, a dim
    that differs from the cluster's, and no cluster up: each a clear error naming the
    fix (the first four before any network call)."""
    import keras

    from lookup_table.keras import DistributedEmbedding, RemoteOptimizer

    path = _cluster(tmp_path, "down")  # never started: nothing listens on its ports
    config = load_config(path)
    x, y = _data(256, seed=1)

    model = _readme_model(config)
    model.compile("adam", "binary_crossentropy")
    with pytest.raises(ConfigError, match=r"compiled with optimizer Adam.*RemoteOptimizer\(config"):
        model.fit(x, y, verbose=0)
    with pytest.raises(ConfigError, match="model.predict: .* was not compiled.*RemoteOptimizer"):
        _readme_model(config).predict(x, verbose=0)

    def one_layer(layer: Any) -> Any:
        c1 = keras.Input(shape=(), dtype="int64", name="C1")
        out = keras.layers.Dense(1, activation="sigmoid")(layer(c1))
        m = keras.Model({"C1": c1}, out)
        m.compile(optimizer=RemoteOptimizer(config), loss="binary_crossentropy")
        return m

    with pytest.raises(ConfigError, match="table 'users', which the cluster file"):
        one_layer(DistributedEmbedding("users", dim=8)).fit({"C1": x["C1"]}, y, verbose=0)
    with pytest.raises(ConfigError, match="expects dim=16 but table 'C1' has dim=8"):
        one_layer(DistributedEmbedding("C1", dim=16)).fit({"C1": x["C1"]}, y, verbose=0)

    model = _readme_model(config)
    optimizer = RemoteOptimizer(config)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    try:
        with pytest.raises(ReplicaUnavailableError, match="model.fit could not reach"):
            model.fit(x, y, verbose=0)
    finally:
        optimizer.close()
