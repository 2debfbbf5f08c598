"""`lookup-table-admin reset`: a namespace starts over, on real memcached and real replicas.

The cluster (2 memcached nodes, 1 replica writing rows and dense parameters behind) is
started by `deploy/cluster.sh` (lookup_table.ops.localcluster) as separate processes. What
is left in memcached is read from outside (the nodes' own key listings).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lookup_table import EmbeddingStore
from lookup_table.client import OptimizerClient, RowReader
from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.keys import as_ids, encode_keys
from lookup_table.ops.admin import main
from lookup_table.ops.localcluster import free_port
from tests.reliability.harness import (
    cluster_file,
    localcluster,
    memcache_client,
    metadump_keys,
    process_running,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TABLES: list[dict[str, Any]] = [
    {
        "name": "user",
        "dim": 4,
        "seed": 1,
        "initializer": {"name": "uniform", "minval": -0.05, "maxval": 0.05},
    },
    {"name": "word", "dim": 4, "seed": 2, "id_type": "string"},
]
# rows and dense parameters written behind, at most 1.5 s after a push
FLUSH_S = 1.5
SECTIONS = {
    "service": {
        "request_timeout_s": 15.0,
        "row_flush_pushes": 50,
        "row_flush_s": FLUSH_S,
        "dense_flush_pushes": 1000,
        "dense_flush_s": FLUSH_S,
    }
}
USERS = np.arange(40, dtype=np.int64) * 7919 - 100
WORDS = ["a b", "x/y", "ünï", "w1", "w2"]
DENSE = {"kernel": np.ones((3, 2), np.float32), "bias": np.zeros(2, np.float32)}
NEW_DENSE = {"kernel": np.full((3, 2), 2.0, np.float32), "bias": np.ones(2, np.float32)}


def _admin(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[Path, ClusterConfig]]:
    """A cluster file and its cluster, up (2 nodes, 1 replica) and stopped afterwards."""
    nodes = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    path = cluster_file(tmp_path, nodes, free_port(), tables=TABLES, sections=SECTIONS)
    args = ["--config", str(path), "--run-dir", str(tmp_path / "run"), "--memory-mb", "16"]
    up = localcluster("up", *args, cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield path, load_config(path)
    finally:
        down = localcluster("down", *args, cwd=tmp_path)
        assert down.returncode == 0, down.stderr


async def _namespace_keys(config: ClusterConfig) -> list[tuple[str, bytes]]:
    """(node, key) of every key of the namespace, listed by the nodes themselves: every
    key of listings taken until two in a row add none (memcached's crawler misses an item
    its LRU maintainer is moving, e.g. one read a moment ago)."""
    prefix = f"{config.namespace}/".encode()
    seen: set[tuple[str, bytes]] = set()
    quiet = 0
    while quiet < 2:
        listed = {
            (address, key)
            for address in config.node_addresses
            for key in await metadump_keys(address)
            if key.startswith(prefix)
        }
        quiet = quiet + 1 if listed <= seen else 0
        seen |= listed
        await asyncio.sleep(0.2)
    return sorted(seen)


def _sentinels(config: ClusterConfig) -> list[tuple[str, bytes]]:
    key = f"{config.namespace}/_meta/m/ssentinel".encode()
    return sorted((address, key) for address in config.node_addresses)


def _stored(config: ClusterConfig, table: str, ids: Any) -> int:
    """How many rows of `ids` the nodes hold (read by key with pymemcache)."""
    keys = encode_keys(config.namespace, table, "w", as_ids(ids, table=table))
    held = 0
    for address in config.node_addresses:
        client = memcache_client(address)
        try:
            held += len(client.get_many([k.decode() for k in keys]))
        finally:
            client.close()
    return held


def _grads(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


async def _train(config: ClusterConfig) -> dict[str, np.ndarray]:
    """Initial rows, then a dense init and pushes; returns the initial rows read."""
    async with EmbeddingStore(config) as store, OptimizerClient(config) as client:
        reader = RowReader(store, client)
        initial = await reader.lookup_many({"user": USERS, "word": WORDS})
        await client.dense_init(DENSE)
        for step in range(3):
            await client.push(
                {"user": (USERS, _grads(USERS.size, step)), "word": (WORDS, _grads(5, step))},
                dense={n: np.ones_like(v) for n, v in DENSE.items()},
            )
        trained = await reader.lookup_many({"user": USERS, "word": WORDS})
        assert not np.allclose(trained["user"], initial["user"])
        assert await client.version() == 3
    return initial


async def test_reset_starts_the_namespace_over_and_the_replica_writes_nothing_back(
    running: tuple[Path, ClusterConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    path, config = running
    initial = await _train(config)
    # the replica holds the last pushes' rows and dense parameters (written behind
    # within FLUSH_S): before they are written, the namespace is reset
    code, out, err = await asyncio.to_thread(
        _admin, "reset", "--config", str(path), "--yes", capsys=capsys
    )
    assert code == 0, err
    await asyncio.sleep(FLUSH_S * 2 + 1)  # past the replica's flushes of rows and dense
    assert await _namespace_keys(config) == _sentinels(config)
    assert _stored(config, "user", USERS) == 0 and _stored(config, "word", WORDS) == 0

    assert f"namespace {config.namespace!r} reset" in out
    for table in ("user", "word", "_meta", "_dense"):
        assert f"  {table}: " in out, out
    assert "dropped what it held, serves version 0" in out

    async with EmbeddingStore(config) as store, OptimizerClient(config) as client:
        assert await client.version() == 0
        version, params = await client.dense_init(NEW_DENSE)  # accepted as the first
        assert version == 0
        assert all(np.array_equal(params[n], v) for n, v in NEW_DENSE.items())
        again = await RowReader(store, client).lookup_many({"user": USERS, "word": WORDS})
        for table in ("user", "word"):
            assert np.array_equal(again[table], initial[table]), table
        await client.push(
            {"user": (USERS[:3], _grads(3, 9))},
            dense={n: np.ones_like(v) for n, v in NEW_DENSE.items()},
        )
        assert await client.version() == 1  # trains on from version 0


async def test_reset_needs_yes_and_refuses_while_a_replica_does_not_answer(
    running: tuple[Path, ClusterConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, config = running
    await _train(config)
    async with OptimizerClient(config) as client:  # a pause writes everything behind
        await client.pause(timeout_s=30)
        await client.resume()
    before = await _namespace_keys(config)

    code, _, err = await asyncio.to_thread(_admin, "reset", "--config", str(path), capsys=capsys)
    assert code == 2 and "rerun with --yes" in err and config.namespace in err

    # the file's replica URL where nothing answers: the replica there cannot be told
    dead = tmp_path / "dead.toml"
    text = path.read_text().replace(config.optimizers[0], f"http://127.0.0.1:{free_port()}")
    dead.write_text(text)
    code, _, err = await asyncio.to_thread(
        _admin, "reset", "--config", str(dead), "--yes", capsys=capsys
    )
    assert code == 1 and "do not answer" in err and "--replicas-stopped" in err, err

    # a cluster file whose replica URL is another namespace's replica
    other = tmp_path / "other.toml"
    other.write_text(path.read_text().replace(config.namespace, config.namespace + "x"))
    code, _, err = await asyncio.to_thread(
        _admin, "reset", "--config", str(other), "--yes", "--replicas-stopped", capsys=capsys
    )
    assert code == 1 and f"serves namespace {config.namespace!r}" in err, err

    assert await _namespace_keys(config) == before  # nothing deleted
    assert _stored(config, "user", USERS) == USERS.size
    async with OptimizerClient(config) as client:
        assert await client.version() == 3  # and the replica was resumed, not reset

    # the replica really stopped: --replicas-stopped resets memcached alone, and the
    # replica started again reads the empty namespace
    port = config.optimizers[0].rsplit(":", 1)[1]
    pid = int((tmp_path / "run" / f"optimizer-127.0.0.1-{port}.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    for _ in range(200):
        if not process_running(pid):
            break
        await asyncio.sleep(0.05)
    code, out, err = await asyncio.to_thread(
        _admin, "reset", "--config", str(path), "--yes", "--replicas-stopped", capsys=capsys
    )
    assert code == 0, err
    assert "not running (it reads the empty namespace when it starts)" in out
    assert await _namespace_keys(config) == _sentinels(config)
    args = ["--config", str(path), "--run-dir", str(tmp_path / "run"), "--memory-mb", "16"]
    up = await asyncio.to_thread(localcluster, "up", *args, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    async with OptimizerClient(config) as client:
        assert await client.version() == 0
