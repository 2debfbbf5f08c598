"""A table added to the cluster file after `lookup-table-admin init`: its stored layout is
recorded on every node at its first use and checked from then on, in real memcached."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lookup_table import EmbeddingStore, StorageFormatError
from lookup_table.config import AdagradConfig, ClusterConfig, SGDConfig, TableSpec
from lookup_table.core.keyspace import layout_key
from lookup_table.core.precision import round_to
from lookup_table.ops.admin import init_cluster, main, reset_namespace
from lookup_table.ops.checkpoint import restore_checkpoint_async, save_checkpoint_async
from tests.conftest import make_config, raw_client
from tests.integration.test_row_dtypes import _raw

pytestmark = pytest.mark.integration

IDS = np.array([3, -7, 11, 42, 1000], dtype=np.int64)


def _with(config: ClusterConfig, table: str, **change: Any) -> ClusterConfig:
    """`config` with table `table` changed, or added (a copy of the first table) if absent."""
    if table not in {t.name for t in config.tables}:
        added = dataclasses.replace(config.tables[0], name=table, seed=7, **change)
        return dataclasses.replace(config, tables=(*config.tables, added))
    tables = [dataclasses.replace(t, **change) if t.name == table else t for t in config.tables]
    return dataclasses.replace(config, tables=tuple(tables))


def _records(config: ClusterConfig, table: str) -> list[bytes | None]:
    """Each node's layout record of `table`, read from outside."""
    out = []
    for node in config.node_addresses:
        with raw_client(node) as client:
            out.append(client.get(layout_key(config.namespace, table)))
    return out


async def _initialized(memcached_nodes: list[str]) -> ClusterConfig:
    config = make_config(memcached_nodes, tables=[{"name": "t", "dim": 4}])
    await init_cluster(config)
    return config


async def test_a_table_added_after_init_is_refused_in_another_dtype_of_its_item_size(
    memcached_nodes: list[str],
) -> None:
    config = await _initialized(memcached_nodes)
    added = _with(config, "late", dtype="bfloat16")
    async with EmbeddingStore(added) as store:
        trained = await store.lookup("late", IDS)

    half = _with(added, "late", dtype="float16")  # 2 bytes an element too: same item size
    async with EmbeddingStore(half) as store:
        with pytest.raises(StorageFormatError, match="holds table 'late'") as info:
            await store.lookup("late", [*IDS.tolist(), 5], create=False)
        with pytest.raises(StorageFormatError, match="holds table 'late'"):
            await store.lookup("late", [5])  # and nothing is created
    message = str(info.value)
    assert "as bfloat16 rows, adam slots" in message
    assert "(recorded when the table was first used)" in message
    assert "this cluster file says float16 rows, adam slots" in message
    assert "lookup-table-checkpoint save" in message and "restore --force" in message
    assert _raw(half, "late", 5) is None
    assert all(_records(added, "late"))  # recorded on every node at its first use

    async with EmbeddingStore(added) as store:  # the layout that wrote it reads it as before
        np.testing.assert_array_equal(await store.lookup("late", IDS, create=False), trained)


async def test_a_table_added_after_init_is_refused_with_another_optimizer_of_its_item_size(
    memcached_nodes: list[str],
) -> None:
    config = await _initialized(memcached_nodes)
    # sgd with momentum and adagrad: one float32 slot an element both
    momentum = _with(config, "late", optimizer=SGDConfig(momentum=0.9))
    async with EmbeddingStore(momentum) as store:
        await store.lookup("late", IDS)
    adagrad = _with(momentum, "late", optimizer=AdagradConfig())
    async with EmbeddingStore(adagrad) as store:
        with pytest.raises(StorageFormatError, match="sgd slots .*adagrad slots.*new table name"):
            await store.get("late", IDS, slots=True)


async def test_a_table_the_sentinel_records_is_checked_there_and_gets_no_record(
    memcached_nodes: list[str],
) -> None:
    config = await _initialized(memcached_nodes)
    async with EmbeddingStore(config) as store:
        await store.lookup("t", IDS)
    assert _records(config, "t") == [None, None]
    with pytest.raises(StorageFormatError, match="holds table 't' of namespace .* as float32"):
        async with EmbeddingStore(_with(config, "t", dtype="float16")) as store:
            await store.lookup("t", IDS)
    assert _records(config, "t") == [None, None]


async def test_concurrent_first_uses_agree_and_one_of_two_layouts_wins(
    memcached_nodes: list[str],
) -> None:
    config = await _initialized(memcached_nodes)
    same = _with(config, "late", dtype="bfloat16")
    stores = [EmbeddingStore(same) for _ in range(4)]
    try:
        got = await asyncio.gather(*(s.lookup("late", IDS) for s in stores))
    finally:
        for s in stores:
            await s.close()
    for rows in got[1:]:
        np.testing.assert_array_equal(rows, got[0])
    records = _records(same, "late")
    assert all(records)

    # two layouts racing for one new table: exactly one of them is used, on every node
    other = _with(config, "race", dtype="bfloat16")
    rival = _with(config, "race", dtype="float16")
    for _ in range(5):
        fresh = [dataclasses.replace(c, namespace=c.namespace + f"x{_}") for c in (other, rival)]
        await init_cluster(dataclasses.replace(config, namespace=fresh[0].namespace))
        stores = [EmbeddingStore(c) for c in fresh]
        try:
            results = await asyncio.gather(
                *(s.lookup("race", IDS) for s in stores), return_exceptions=True
            )
        finally:
            for s in stores:
                await s.close()
        failed = [isinstance(r, StorageFormatError) for r in results]
        assert sorted(failed) == [False, True], results
        winner = fresh[failed.index(False)]
        values = set(_records(winner, "race"))
        assert len(values) == 2 and None not in values  # one record a node
        want = winner.table("race").dtype
        for record in values:
            assert f'"dtype": "{want}"'.encode() in (record or b"")


async def test_admin_init_records_the_tables_added_since_and_says_so(
    memcached_nodes: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = await _initialized(memcached_nodes)
    added = _with(_with(config, "late", dtype="bfloat16"), "later", dtype="float16")
    path = tmp_path / "cluster.toml"
    path.write_text(_toml(added))
    assert await asyncio.to_thread(main, ["init", "--config", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    for line in out:
        assert "already initialized; recorded the stored layout of tables added since: " in line
        assert "'late', 'later'" in line
    assert all(_records(added, "late")) and all(_records(added, "later"))
    assert await init_cluster(added) == {n: "already initialized" for n in added.node_addresses}

    refused = _with(added, "later", dtype="bfloat16")
    with pytest.raises(StorageFormatError, match="holds table 'later'"):
        await init_cluster(refused)
    path.write_text(_toml(refused))
    assert await asyncio.to_thread(main, ["init", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "lookup-table-admin init: memcached node" in err and "float16 rows" in err


def _toml(config: ClusterConfig) -> str:
    def table(t: TableSpec) -> str:
        return (
            f'[[tables]]\nname = "{t.name}"\ndim = {t.dim}\nseed = {t.seed}\ndtype = "{t.dtype}"\n'
        )

    nodes = ", ".join(f'"{n}"' for n in config.node_addresses)
    return f'namespace = "{config.namespace}"\nmemcached = [{nodes}]\n\n' + "\n".join(
        table(t) for t in config.tables
    )


async def test_reset_deletes_the_records_and_the_table_starts_over(
    memcached_nodes: list[str],
) -> None:
    config = await _initialized(memcached_nodes)
    added = _with(config, "late", dtype="bfloat16")
    async with EmbeddingStore(added) as store:
        await store.lookup("late", IDS)
    summary = await reset_namespace(config)  # the cluster file without the table
    assert summary["deleted"]["_meta"]["meta"] >= 2 + 2  # sentinels and records
    assert _records(added, "late") == [None, None]
    half = _with(added, "late", dtype="float16")
    async with EmbeddingStore(half) as store:
        rows = await store.lookup("late", IDS)
    spec = half.table("late")
    assert rows.shape == (IDS.shape[0], spec.dim)
    assert all(b'"float16"' in (r or b"") for r in _records(half, "late"))


async def test_checkpoint_round_trips_and_the_conversion_the_refusal_names(
    memcached_nodes: list[str], tmp_path: Path
) -> None:
    config = await _initialized(memcached_nodes)
    added = _with(config, "late", dtype="bfloat16")
    async with EmbeddingStore(added) as store:
        before = await store.lookup("late", IDS)
    await save_checkpoint_async(added, tmp_path / "ck", pause=False, progress=False)

    # into another namespace, initialized without the table, which a read recorded in
    # another layout: no data, so no force needed; the restore's sentinels record it
    elsewhere = dataclasses.replace(added, namespace=added.namespace + "r")
    await init_cluster(dataclasses.replace(config, namespace=elsewhere.namespace))
    async with EmbeddingStore(_with(elsewhere, "late", dtype="float16")) as store:
        await store.lookup("late", IDS, create=False)
    assert all(_records(elsewhere, "late"))
    await restore_checkpoint_async(elsewhere, tmp_path / "ck", pause=False, progress=False)
    async with EmbeddingStore(elsewhere) as store:
        np.testing.assert_array_equal(await store.lookup("late", IDS, create=False), before)
    assert _records(elsewhere, "late") == [None, None]

    # in place, converted to float16: the records of the old layout go with the old rows
    half = _with(added, "late", dtype="float16")
    await restore_checkpoint_async(half, tmp_path / "ck", force=True, pause=False, progress=False)
    assert _records(half, "late") == [None, None]
    async with EmbeddingStore(half) as store:
        got = await store.lookup("late", IDS, create=False)
    np.testing.assert_array_equal(got, round_to(before, "float16"))
    async with EmbeddingStore(added) as store:
        with pytest.raises(StorageFormatError, match="holds table 'late' .* as float16 rows"):
            await store.lookup("late", IDS)


async def test_a_namespace_started_over_is_checked_again_by_a_running_process(
    memcached_nodes: list[str],
) -> None:
    """Layouts are checked once per table and process, and again when a node's sentinel
    changed (a reset, a reinit or a restore wrote it): the first read that sees it."""
    config = await _initialized(memcached_nodes)
    half = _with(config, "late", dtype="float16")
    async with EmbeddingStore(half) as store:
        await store.lookup("late", IDS)
        await reset_namespace(config)  # the cluster file without the table
        added = _with(config, "late", dtype="bfloat16")
        async with EmbeddingStore(added) as writer:
            await writer.lookup("late", IDS)
        with pytest.raises(StorageFormatError, match="holds table 'late' .* as bfloat16 rows"):
            await store.lookup("late", IDS, create=False)
