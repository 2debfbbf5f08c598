"""Trainers and optimizer replicas must run agreeing cluster files: a client of another
file is refused before its first push, naming each field that differs with both values,
and the replicas' rows stay as they were; a push of another file is refused (409)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lookup_table import EmbeddingStore
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, SGDConfig, StoreConfig, load_config
from lookup_table.core.sharding import owner_of
from lookup_table.core.wire import encode_array, encode_ids, pack
from lookup_table.errors import ClusterMismatchError, ConfigError
from lookup_table.store.sentinels import stored_layouts
from tests.conftest import serve_replica, serve_replicas, written
from tests.integration.test_keras_fit import (
    _cluster,
    _data,
    _item_count,
    _readme_model,
    _service_state,
)
from tests.integration.test_trainer import _cluster_file, _running, _train

pytestmark = pytest.mark.integration

IDS = np.arange(40, dtype=np.int64)


@pytest.fixture
async def running(
    memcached_nodes: list[str], aiohttp_server: Any
) -> tuple[ClusterConfig, list[Any]]:
    """Two replicas of one cluster file, serving: (the file, their servers)."""
    return await serve_replicas(memcached_nodes, aiohttp_server)


def _table(config: ClusterConfig, name: str, **changes: Any) -> ClusterConfig:
    tables = tuple(
        dataclasses.replace(t, **changes) if t.name == name else t for t in config.tables
    )
    return dataclasses.replace(config, tables=tables)


# (the trainer's file made from the replicas', what the message must say)
MISMATCHES: dict[str, tuple[Callable[[ClusterConfig], ClusterConfig], list[str]]] = {
    "learning_rate": (
        lambda c: _table(c, "user", optimizer=SGDConfig(learning_rate=0.05)),
        [
            r"tables\[user\]\.optimizer\.learning_rate: 0\.05 in this trainer's cluster file, "
            r"0\.5 in replica 0's"
        ],
    ),
    "optimizer name": (
        lambda c: _table(c, "ads", optimizer=SGDConfig()),
        [
            r"tables\[ads\]\.optimizer: \{name = \"sgd\", learning_rate = 0\.01, .*\} in this "
            r"trainer's cluster file, \{name = \"adam\", learning_rate = 0\.001, .*\} in replica "
            r"0's"
        ],
    ),
    "namespace": (
        lambda c: dataclasses.replace(c, namespace=c.namespace + "b"),
        [r"namespace: \"(t\w+)b\" in this trainer's cluster file, \"\1\" in replica 0's"],
    ),
    "dim": (
        lambda c: _table(c, "user", dim=16),
        [r"tables\[user\]\.dim: 16 in this trainer's cluster file, 8 in replica 0's"],
    ),
    "memcached": (
        lambda c: dataclasses.replace(c, memcached=c.memcached[:1]),
        [
            r"memcached: \[\"127\.0\.0\.1:\d+\"\] in this trainer's cluster file, "
            r"\[\"127\.0\.0\.1:\d+\", \"127\.0\.0\.1:\d+\"\] in replica 0's"
        ],
    ),
    "replica count": (
        lambda c: dataclasses.replace(c, optimizers=c.optimizers[:1]),
        [r"replicas: 1 in this trainer's cluster file, 2 in replica 0's"],
    ),
    "replica order": (
        lambda c: dataclasses.replace(c, optimizers=c.optimizers[::-1]),
        [
            r"replica 0 \(http://127\.0\.0\.1:\d+\) of this cluster file is replica 1 of the "
            r"file it runs",
            r"in the order of their --replica",
        ],
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
async def test_a_trainer_of_another_cluster_file_is_refused_before_its_first_push(
    running: tuple[ClusterConfig, list[Any]], case: str
) -> None:
    config, _ = running
    make, patterns = MISMATCHES[case]
    theirs = make(config)
    assert theirs.fingerprint != config.fingerprint or case == "replica order"
    if theirs.namespace != config.namespace:  # the user ran lookup-table-admin init
        async with EmbeddingStore(theirs) as store:
            await store.write_sentinels()
    grads = {t: np.full((len(IDS), theirs.table(t).dim), 0.5, np.float32) for t in ("user", "ads")}
    async with OptimizerClient(theirs, max_retries=1, backoff_s=0.01) as client:
        with pytest.raises(ClusterMismatchError) as info:
            await client.push({t: (IDS, g) for t, g in grads.items()}, dense={})
        message = str(info.value)
        for pattern in patterns:
            assert re.search(pattern, message), message
        assert "use the same file for trainers and replicas, or restart the replicas" in message
        assert info.value.replica == 0
        # every request that reads or changes the model is refused alike
        for refused in (client.rows({"user": IDS}), client.dense(), client.version()):
            with pytest.raises(ClusterMismatchError):
                await refused
    # nothing was written: no row in the replicas' memory nor in memcached, either file's
    async with OptimizerClient(config) as client:
        read = await client.rows({"user": IDS, "ads": IDS})
    assert {t: new for t, (_, new) in read.items()} == {"user": len(IDS), "ads": len(IDS)}
    await written(config)
    # a file with another stored layout for the namespace's tables reads nothing of it
    # (the sentinels record the layouts): `config`'s reads cover the namespace then
    same = theirs.namespace != config.namespace or stored_layouts(theirs) == stored_layouts(config)
    for cfg in (config, theirs) if same else (config,):
        async with EmbeddingStore(cfg) as store:
            for table in ("user", "ads"):
                _, found = await store.get(table, IDS)
                assert not found.any(), (cfg.namespace, table)


async def test_a_file_that_agrees_trains_and_the_check_is_made_once_per_replica(
    running: tuple[ClusterConfig, list[Any]],
) -> None:
    """Tuning, token-free URLs by another host name: not part of the agreement. Two pushes
    started at once wait for one check of each replica; later requests make none."""
    config, _ = running
    mine = dataclasses.replace(
        config,
        optimizers=tuple(u.replace("127.0.0.1", "localhost") for u in config.optimizers),
        store=StoreConfig(timeout_s=2.0, pool_size=2),
    )
    assert mine.fingerprint == config.fingerprint
    grads = np.full((len(IDS), 8), 0.5, np.float32)
    async with OptimizerClient(mine) as client:
        first, second = await asyncio.gather(
            client.push({"user": (IDS, grads)}), client.push({"user": (IDS[:5], grads[:5])})
        )
        assert first["applied"] and second["applied"]
        await client.push({"user": (IDS, grads)})
        await client.version()
    for k, url in enumerate(mine.optimizers):
        async with OptimizerClient(config) as raw:
            text = await _metrics(raw, k)
        got = re.findall(
            r'lookup_table_http_requests_total\{endpoint="/v1/tables",status="(\d+)"\} (\S+)', text
        )
        assert got == [("200", "1.0")], (url, got)


async def _metrics(client: OptimizerClient, k: int) -> str:
    session = client._get_session()
    async with session.get(client.config.optimizers[k] + "/metrics") as resp:
        return await resp.text()


async def test_a_replica_restarted_with_another_file_refuses_the_next_push(
    running: tuple[ClusterConfig, list[Any]], aiohttp_server: Any
) -> None:
    """The client checked the replicas once; replica 0 then restarts with another
    learning rate: its fingerprint differs, so the next push part for it is refused (409)
    and nothing of that part is written."""
    config, servers = running
    mine = owner_of("user", IDS, 2) == 0
    ids = IDS[mine]  # rows of replica 0 alone
    grads = np.full((len(ids), 8), 0.5, np.float32)
    async with OptimizerClient(config) as client:
        await client.push({"user": (ids[:2], grads[:2])})
        await servers[0].close()
        other = _table(config, "user", optimizer=SGDConfig(learning_rate=0.05))
        await serve_replica(other, aiohttp_server, 0)
        with pytest.raises(ClusterMismatchError) as info:
            await client.push({"user": (ids[2:], grads[2:])})
    message = str(info.value)
    assert "replica 0" in message and "refused the request (409)" in message
    assert f"fingerprint '{config.fingerprint[:20]}" in message
    assert f"this replica's '{other.fingerprint}'" in message
    async with OptimizerClient(other) as flush:  # rows written behind: to memcached
        await flush.pause(replicas=[0])
        await flush.resume(replicas=[0])
    async with EmbeddingStore(config) as store:
        _, found = await store.get("user", ids)
    assert found.tolist() == [True, True] + [False] * (len(ids) - 2)


async def test_a_raw_push_of_another_file_is_409_and_writes_nothing(
    running: tuple[ClusterConfig, list[Any]],
) -> None:
    config, _ = running
    ids = IDS[owner_of("user", IDS, 2) == 0]
    grads = np.full((len(ids), 8), 0.5, np.float32)
    good = {
        "push_id": "raw-1",
        "tables": {"user": {"ids": encode_ids(ids), "grads": encode_array(grads)}},
        **config.sender(0),
    }
    async with OptimizerClient(config) as client:
        session = client._get_session()
        url = config.optimizers[0] + "/v1/gradients"
        for wrong, status, pattern in [
            ({"fingerprint": "f" * 64}, 409, "fingerprint 'ffff"),
            ({"namespace": "elsewhere"}, 409, "namespace 'elsewhere', this replica's"),
            ({"replica": 1}, 409, "replica 1, this replica's 0"),
            ({"fingerprint": None}, 400, r"fingerprint: missing; .*GET /v1/tables"),
        ]:
            body = {k: v for k, v in {**good, **wrong}.items() if v is not None}
            async with session.post(url, data=pack(body)) as resp:
                doc = await resp.json()
                assert resp.status == status and re.search(pattern, doc["error"]), doc
                if status == 409:
                    assert doc["type"] == "ClusterMismatchError"
                    assert "use the same file for trainers and replicas" in doc["error"]
        read = await client.rows({"user": ids})
    assert read["user"][1] == len(ids)  # no row made
    await written(config)
    async with EmbeddingStore(config) as store:
        _, found = await store.get("user", ids)
    assert not found.any()


# ------------------------------------------------------------------ real trainers


@contextlib.contextmanager
def _compiled(model: Any, config: ClusterConfig) -> Iterator[None]:
    """`model` compiled with a RemoteOptimizer of `config`, which is closed afterwards."""
    from lookup_table.keras import RemoteOptimizer

    optimizer = RemoteOptimizer(config)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    try:
        yield
    finally:
        optimizer.close()


@pytest.mark.timeout(300)
def test_the_trainer_cli_refuses_a_copy_of_the_file_with_another_learning_rate(
    tmp_path: Path,
) -> None:
    """The issue's reproduction: a copy of the cluster file with another learning rate
    trained with rc 0 at the service's. Now it exits 1 before its first push, naming the
    field and both values, and memcached holds what it held."""
    path = _cluster_file(tmp_path / "cluster.toml", mode="async", workers=1)
    with _running(path, tmp_path / "run"):
        config = load_config(path)
        copy = tmp_path / "copy.toml"
        text = path.read_text()
        assert text.count("learning_rate = 0.02") == 26
        copy.write_text(text.replace("learning_rate = 0.02", "learning_rate = 0.5", 1))
        items = _item_count(config)
        proc = _train(copy, tmp_path / "out.json", worker=0, workers=1, steps=4)
        out = proc.communicate(timeout=240)[0]
        assert proc.returncode == 1, out[-3000:]
        assert (
            "tables[C1].optimizer.learning_rate: 0.5 in this trainer's cluster file, 0.02 in "
            "replica 0's" in out
        ), out[-3000:]
        assert "restart the replicas with this one (deploy/cluster.sh down/up" in out
        assert _item_count(config) == items
        assert not (tmp_path / "out.json").exists()


@pytest.mark.timeout(400)
# Keras 3.15 saves a variable with np.array(variable), which numpy 2 deprecates
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept:DeprecationWarning")
def test_model_fit_refuses_another_namespace_continues_its_own_and_names_dense_causes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """model.fit (RemoteOptimizer): with only the namespace changed (and initialized), it is
    refused before its first push and the replica's namespace keeps its rows and dense
    parameters; with the replicas' file, a second model continues the trained namespace
    (logged); a model of other layer names gets the real causes."""
    import keras

    path = _cluster(tmp_path, "keras")
    with _running(path, tmp_path / "run"):
        config = load_config(path)
        x, y = _data(512, seed=1)
        model = _readme_model(config)
        with _compiled(model, config):
            model.fit(x, y, batch_size=128, epochs=1, verbose=0)
        ids = {"C1": np.unique(x["C1"]), "C2": np.unique(x["C2"])}
        rows, dense = _service_state(config, ids)

        moved = dataclasses.replace(config, namespace=config.namespace + "b")

        async def init() -> None:  # lookup-table-admin init of the new namespace
            async with EmbeddingStore(moved) as store:
                await store.write_sentinels()

        asyncio.run(init())
        items = _item_count(config)
        model = _readme_model(moved)
        with _compiled(model, moved), pytest.raises(ClusterMismatchError) as info:
            model.fit(x, y, batch_size=128, epochs=1, verbose=0)
        assert (
            f'namespace: "{moved.namespace}" in this trainer\'s cluster file, '
            f'"{config.namespace}" in replica 0\'s' in str(info.value)
        )
        assert _item_count(config) == items  # neither namespace got a row
        after_rows, after_dense = _service_state(config, ids)
        for table in ids:
            np.testing.assert_array_equal(after_rows[table], rows[table])
        for name in dense:
            np.testing.assert_array_equal(after_dense[name], dense[name])

        caplog.set_level(logging.INFO, logger="lookup_table.keras.session")
        model = _readme_model(config, seed=1)
        with _compiled(model, config):
            model.fit(x, y, batch_size=128, epochs=1, verbose=0)
        continuing = [r for r in caplog.records if "continuing namespace" in r.getMessage()]
        assert len(continuing) == 1 and continuing[0].levelno == logging.WARNING
        assert re.fullmatch(
            rf"continuing namespace {config.namespace} at version [1-9]\d* \(its model was "
            r"trained before; `lookup-table-admin reset --config FILE --yes` starts it over\)",
            continuing[0].getMessage(),
        )

        keras.backend.clear_session()
        c1 = keras.Input(shape=(), dtype="int64", name="C1")
        c2 = keras.Input(shape=(), dtype="int64", name="C2")
        from lookup_table.keras import DistributedEmbedding

        x1 = DistributedEmbedding(config.table("C1"))(c1)
        x2 = DistributedEmbedding(config.table("C2"))(c2)
        hidden = keras.layers.Dense(16)(keras.layers.Concatenate()([x1, x2]))  # unnamed
        other = keras.Model({"C1": c1, "C2": c2}, keras.layers.Dense(1, name="out")(hidden))
        with _compiled(other, config), pytest.raises(ConfigError) as refused:
            other.fit(x, y, batch_size=128, epochs=1, verbose=0)
        message = str(refused.value)
        assert "initialized by a model with other layer names" in message, message
        assert "['dense/bias', 'dense/kernel'] (2 in all) are not among them" in message
        assert "['hidden/bias', 'hidden/kernel'] (2) are not this model's" in message
        assert "keras.backend.clear_session()" in message
        assert "`lookup-table-admin reset --config FILE --yes`" in message
