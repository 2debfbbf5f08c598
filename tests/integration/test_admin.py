"""`lookup-table-admin stats` against real memcached and the real service: exact counts.

Rows are created with `store.lookup`, slots by pushing gradients through the real
optimizer service (in-process, `make_app`), so the keys are what production writes.
The expected counts per node come from the sharding function, and the node totals
are read from outside (pymemcache `stats`), never from the code under test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from lookup_table import EmbeddingStore
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.keys import encode_keys
from lookup_table.core.sharding import node_of
from lookup_table.ops.admin import main
from lookup_table.ops.localcluster import MemcachedProcess
from lookup_table.ops.stats import table_stats
from optimizer_service.app import make_app
from tests.reliability.harness import cluster_file, item_counts, memcache_client

pytestmark = pytest.mark.integration

TABLES: list[dict[str, Any]] = [
    {"name": "user", "dim": 8, "seed": 1},  # adam: slots of 17 floats
    {"name": "word", "dim": 4, "seed": 2, "id_type": "string"},  # adam, string ids
    {"name": "plain", "dim": 4, "seed": 3, "optimizer": {"name": "sgd", "learning_rate": 0.1}},
]
USERS = np.arange(300, dtype=np.int64) * 7919 - 1000  # negative ids too
WORDS = ["a b", "x/y", "ünï", "100%", "", "日本", "tab\t", *(f"w{i}" for i in range(33))]
PLAIN = np.arange(120, dtype=np.int64) + 2**40
PUSHED = {"user": USERS[:100], "word": WORDS[:7], "plain": PLAIN[:30]}
DIMS = {"user": 8, "word": 4, "plain": 4}
SLOT_WIDTHS = {"user": 17, "word": 9, "plain": 0}
OTHER_USERS = np.arange(77, dtype=np.int64)  # another namespace, same table name, same ids


def _ids(table: str, ids: Any) -> Any:
    return np.array(ids, dtype=object) if table == "word" else np.asarray(ids, dtype=np.int64)


def _per_node(config: ClusterConfig, table: str, ids: Any) -> dict[str, int]:
    """How many of `ids` each node holds (the sharding function, not the code under test)."""
    placement = node_of(table, _ids(table, ids), config.node_addresses)
    return {a: int((placement == j).sum()) for j, a in enumerate(config.node_addresses)}


def _key_bytes(config: ClusterConfig, table: str, kind: str, ids: Any) -> dict[str, int]:
    """Sum of the key lengths per node."""
    keys = encode_keys(config.namespace, table, kind, _ids(table, ids))
    lengths = np.array([len(k) for k in keys])
    placement = node_of(table, _ids(table, ids), config.node_addresses)
    return {a: int(lengths[placement == j].sum()) for j, a in enumerate(config.node_addresses)}


async def _cli(argv: list[str]) -> int:
    """`lookup-table-admin ARGV` (it runs its own event loop: in a thread)."""
    return await asyncio.to_thread(main, argv)


def _node_stats(address: str) -> dict[bytes, bytes]:
    client = memcache_client(address)
    try:
        return dict(client.stats())
    finally:
        client.close()


async def _fill(config: ClusterConfig, aiohttp_server: Any) -> None:
    """Rows of every table through the store; slots and bookkeeping through the service."""
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("user", USERS)
        await store.lookup("word", WORDS)
        await store.lookup("plain", PLAIN)
    server: TestServer = await aiohttp_server(
        make_app(config, replica=0, registry=CollectorRegistry())
    )
    served = dataclasses.replace(config, optimizers=(str(server.make_url("")).rstrip("/"),))
    rng = np.random.default_rng(5)
    async with OptimizerClient(served) as client:
        await client.dense_init({"bias": np.zeros(4, np.float32)})
        for _ in range(2):
            await client.push(
                {
                    name: (ids, rng.standard_normal((len(ids), DIMS[name])).astype(np.float32))
                    for name, ids in PUSHED.items()
                },
                dense={"bias": np.ones(4, np.float32)},
            )


@pytest.fixture
async def filled(
    own_nodes: list[MemcachedProcess], tmp_path: Path, aiohttp_server: Any
) -> tuple[Path, ClusterConfig, ClusterConfig]:
    """(cluster file, its config, another namespace's config) on 2 fresh nodes, filled."""
    addresses = [s.address for s in own_nodes]
    path = cluster_file(tmp_path, addresses, [], tables=TABLES)
    config = load_config(path)
    other = dataclasses.replace(config, namespace="other" + uuid.uuid4().hex[:8])
    async with EmbeddingStore(other) as store:
        await store.write_sentinels()
        await store.lookup("user", OTHER_USERS)
    await _fill(config, aiohttp_server)
    return path, config, other


@pytest.mark.timeout(120)
async def test_stats_counts_every_row_with_its_slots_exactly_per_node_and_in_total(
    filled: tuple[Path, ClusterConfig, ClusterConfig],
) -> None:
    _, config, other = filled
    report = await table_stats(config)
    assert report["namespace"] == config.namespace
    assert report["complete"] and report["problems"] == []
    tables = report["tables"]
    assert list(tables)[:3] == ["user", "word", "plain"]  # the cluster file's order first

    expected = {"user": USERS, "word": WORDS, "plain": PLAIN}
    for table, ids in expected.items():
        entry = tables[table]
        assert entry["in_config"] and entry["dim"] == DIMS[table]
        assert entry["slot_width"] == SLOT_WIDTHS[table]
        assert set(entry["kinds"]) == {"rows"}  # a row and its slots are one item
        counts = entry["kinds"]["rows"]
        assert counts["kind"] == "w"
        assert counts["keys"] == len(ids), table
        per_node = _per_node(config, table, ids)
        assert {a: c["keys"] for a, c in counts["nodes"].items()} == per_node
        assert counts["bytes"] == sum(c["bytes"] for c in counts["nodes"].values())
        # plausible: memcached's item = its header (~50-60 bytes) + key + the row and slots
        value = 4 * (DIMS[table] + SLOT_WIDTHS[table])
        key_bytes = _key_bytes(config, table, "w", ids)
        for address, c in counts["nodes"].items():
            if per_node[address] == 0:  # 7 words: one node may hold none (the namespace is random)
                assert c["bytes"] == 0, (table, address)
                continue
            payload = key_bytes[address] + per_node[address] * value
            assert payload < c["bytes"] <= payload + 100 * per_node[address], (table, address)
    assert tables["user"]["kinds"]["rows"]["keys"] == 300  # not 377: the other namespace's
    assert tables["_dense"]["in_config"] is False
    assert tables["_dense"]["kinds"]["dense"]["keys"] >= 1
    assert tables["_dense"]["kinds"]["dense_slots"]["keys"] >= 1
    meta = tables["_meta"]["kinds"]
    assert meta["meta"]["keys"] >= 3  # a sentinel per node and the replica's version
    assert meta["push_records"]["keys"] >= 2

    # The other namespace on the same nodes: counted there, never here; together they
    # are every item of each node, to the byte (read with pymemcache, not our code).
    theirs = await table_stats(other)
    assert theirs["tables"]["user"]["kinds"]["rows"]["keys"] == len(OTHER_USERS)
    assert theirs["tables"]["user"]["kinds"]["rows"]["nodes"] == {
        a: {"keys": n, "bytes": theirs["tables"]["user"]["kinds"]["rows"]["nodes"][a]["bytes"]}
        for a, n in _per_node(other, "user", OTHER_USERS).items()
    }
    counts = item_counts(list(config.node_addresses))
    for address in config.node_addresses:
        node, their = report["nodes"][address], theirs["nodes"][address]
        outside = _node_stats(address)
        assert node["ok"] and node["sentinel"] and node["evictions"] == 0
        assert node["curr_items"] == counts[address][0] == int(outside[b"curr_items"])
        assert node["namespace_keys"] + their["namespace_keys"] == node["curr_items"]
        assert node["bytes"] == int(outside[b"bytes"])
        assert node["namespace_bytes"] + their["namespace_bytes"] == node["bytes"]
        assert node["limit_maxbytes"] == 64 * 2**20 == int(outside[b"limit_maxbytes"])
        assert node["fill_ratio"] == pytest.approx(node["bytes"] / node["limit_maxbytes"])
        # memcached takes memory from -m in 1 MiB slab pages
        assert node["malloced_bytes"] >= node["bytes"] and node["malloced_bytes"] % 2**20 == 0
        assert node["version"] == outside[b"version"].decode()
        per_table = sum(
            k["nodes"][address]["keys"]
            for t in report["tables"].values()
            for k in t["kinds"].values()
        )
        assert per_table == node["namespace_keys"]


@pytest.mark.timeout(120)
async def test_stats_cli_prints_an_aligned_table_and_json(
    filled: tuple[Path, ClusterConfig, ClusterConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    path, config, _ = filled
    a, b = config.node_addresses
    users = _per_node(config, "user", USERS)

    assert await _cli(["stats", "--config", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    report = json.loads(out.out)
    assert report["tables"]["user"]["kinds"]["rows"]["keys"] == 300
    assert report["tables"]["word"]["kinds"]["rows"]["keys"] == len(WORDS)
    assert {n: report["tables"]["user"]["kinds"]["rows"]["nodes"][n]["keys"] for n in (a, b)} == (
        users
    )
    assert report["nodes"][a]["sentinel"] is True and report["complete"] is True

    assert await _cli(["stats", "--config", str(path)]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    text = out.out.splitlines()
    assert text[0] == f"namespace {config.namespace!r}: 2 of 2 memcached nodes answered"
    blocks = "\n".join(text[2:]).split("\n\n")
    keys_block, nodes_block = blocks[0].splitlines(), blocks[1].splitlines()
    assert keys_block[0].split() == ["table", "kind", "node", "keys", "bytes", "bytes/key"]
    # aligned: every line of a block is padded to the same width (last column right-aligned)
    assert len({len(line) for line in keys_block}) == 1
    assert len({len(line) for line in nodes_block}) == 1
    rows = [line.split() for line in keys_block[1:]]
    user_rows = {r[3]: r[4] for r in rows if r[:3] == ["user", "rows", "(w)"]}
    assert user_rows == {a: str(users[a]), b: str(users[b]), "total": "300"}
    word_rows = {r[3]: r[4] for r in rows if r[:3] == ["word", "rows", "(w)"]}
    assert word_rows["total"] == str(len(WORDS))
    assert any(r[:2] == ["_meta", "meta"] for r in rows)
    assert any(r[:2] == ["_dense", "dense"] for r in rows)
    assert nodes_block[0].split()[:3] == ["node", "items", "bytes"]
    assert [line.split()[0] for line in nodes_block[1:]] == [a, b]
    assert all(" yes " in line for line in nodes_block[1:])  # the sentinel column

    assert await _cli(["stats", "--config", str(path), "--table", "word"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.split("\n\n")[1].splitlines()[1:]]
    assert {r[0] for r in rows} == {"word"} and len(rows) == 3  # rows x (2 nodes + total)

    assert await _cli(["stats", "--config", str(path), "--json", "--table", "_meta"]) == 0
    assert list(json.loads(capsys.readouterr().out)["tables"]) == ["_meta"]

    assert await _cli(["stats", "--config", str(path), "--table", "nope"]) == 1
    out = capsys.readouterr()
    assert "'nope'" in out.err and "user" in out.err and "Traceback" not in out.err


@pytest.mark.timeout(120)
async def test_stats_of_a_cluster_never_initialized_says_so(
    memcached_nodes: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_file(tmp_path, memcached_nodes, [], tables=TABLES)
    assert await _cli(["stats", "--config", str(path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert "not initialized on any node" in out.err
    assert "lookup-table-admin init" in out.err
    assert out.out.count("MISSING") == len(memcached_nodes)

    assert await _cli(["stats", "--config", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert all(not n["sentinel"] and n["namespace_keys"] == 0 for n in report["nodes"].values())
    assert report["tables"]["user"]["kinds"]["rows"]["keys"] == 0


@pytest.mark.timeout(120)
async def test_stats_marks_a_node_that_is_down_and_a_node_that_lost_its_data(
    own_nodes: list[MemcachedProcess], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    addresses = [s.address for s in own_nodes]
    path = cluster_file(tmp_path, addresses, [], tables=TABLES)
    config = load_config(path)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("user", USERS)
    users = _per_node(config, "user", USERS)

    # one node flushed: it answers, without its sentinel
    client = memcache_client(addresses[1])
    try:
        client.flush_all()
    finally:
        client.close()
    assert await _cli(["stats", "--config", str(path)]) == 1
    out = capsys.readouterr()
    assert f"{addresses[1]}: no sentinel" in out.err and "reinit --yes" in out.err
    assert "MISSING" in out.out and "Traceback" not in out.err

    own_nodes[1].stop()
    assert await _cli(["stats", "--config", str(path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert re.search(rf"{re.escape(addresses[1])}: DOWN: .*unreachable", out.out)
    assert re.search(rf"{re.escape(addresses[1])}: DOWN: .*unreachable", out.err)
    assert "1 of 2 memcached nodes answered" in out.out
    rows = [line.split() for line in out.out.split("\n\n")[1].splitlines()[1:]]
    user_rows = {r[3]: r[-4] for r in rows if r[:3] == ["user", "rows", "(w)"]}
    assert user_rows == {
        addresses[0]: str(users[addresses[0]]),
        "total": str(users[addresses[0]]),  # the "total (nodes up)" line
    }

    assert await _cli(["stats", "--config", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    down = report["nodes"][addresses[1]]
    assert down["ok"] is False and down["down"] is True and "unreachable" in down["error"]
    assert report["complete"] is False
    assert report["nodes"][addresses[0]]["sentinel"] is True
    rows_entry = report["tables"]["user"]["kinds"]["rows"]
    assert rows_entry["nodes"] == {
        addresses[0]: {"keys": users[addresses[0]], "bytes": rows_entry["bytes"]}
    }
