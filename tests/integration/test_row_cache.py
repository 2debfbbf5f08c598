"""The replica's row cache with real memcached and the real service app.

A push on rows the replica wrote last reads none of them from memcached, and trains
exactly as without the cache; a node that lost its data is noticed although its rows
are cached (DataLossError), and after `reinit` its rows start again from their initial
values instead of coming back from the cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from lookup_table import DataLossError, EmbeddingStore, initial_rows
from lookup_table.client import OptimizerClient
from lookup_table.core.optimizers import make_optimizer
from lookup_table.core.sharding import node_of
from lookup_table.ops.admin import reinit_cluster
from optimizer_service.app import UPDATER, make_app
from tests.conftest import make_config, node_stat, raw_client, written

pytestmark = pytest.mark.integration

TABLES = [{"name": "t", "dim": 8, "seed": 3}]  # Adam


async def _serve(config: Any, aiohttp_server: Any) -> Any:
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    server = await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    url = str(server.make_url("")).rstrip("/")
    return dataclasses.replace(config, optimizers=(url,)), server


async def _state(config: Any, ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """Rows and slots in memcached (rows written behind: after a flush)."""
    await written(config)
    async with EmbeddingStore(config) as store:
        items, found = await store.get("t", ids, unique=True, slots=True)
    assert found.all()
    return items[:, :8], items[:, 8:]


def _gets(nodes: list[str]) -> int:
    return sum(node_stat(a, "cmd_get") for a in nodes)


@pytest.mark.parametrize("cache_mb", [64, 0], ids=["cache", "no-cache"])
async def test_cached_pushes_read_no_rows_and_train_exactly_as_uncached(
    memcached_nodes: list[str], aiohttp_server: Any, cache_mb: int
) -> None:
    config = make_config(memcached_nodes, tables=TABLES, service={"cache_mb": cache_mb})
    config, server = await _serve(config, aiohttp_server)
    adam = make_optimizer(config.table("t").optimizer)
    ids = np.arange(-300, 300, dtype=np.int64) * 7919
    rng = np.random.default_rng(0)
    async with OptimizerClient(config) as client:
        await client.push({"t": (ids, rng.standard_normal((600, 8), dtype=np.float32))})
        for _ in range(3):
            rows, slots = await _state(config, ids)
            g = rng.standard_normal((600, 8), dtype=np.float32)
            before = _gets(memcached_nodes)
            await client.push({"t": (ids, g)})
            gets = _gets(memcached_nodes) - before
            want_rows, want_slots = adam.update(rows, g, slots)
            got_rows, got_slots = await _state(config, ids)
            np.testing.assert_array_equal(got_rows, want_rows)
            np.testing.assert_array_equal(got_slots, want_slots)
            if cache_mb:  # sentinels (one per batch and node) and the done record only,
                assert gets <= 20, gets  # not 600 rows with their slots
            else:
                assert gets >= 600, gets  # one item per row: the row and its slots
    assert (server.app[UPDATER].cache.nbytes() > 0) == bool(cache_mb)


@pytest.mark.parametrize("row_flush_pushes", [1, 20], ids=["rows-through", "rows-behind"])
async def test_a_lost_node_is_noticed_through_the_cache_and_reinit_restarts_its_rows(
    memcached_nodes: list[str], aiohttp_server: Any, row_flush_pushes: int
) -> None:
    """Written through, the lost node's rows start again from their initial values after
    a reinit. Written behind, the rows the replica held unwritten (here all of them) are
    written back with their newest values by its next flush: the loss is only of rows it
    did not hold (docs/write-behind.md)."""
    config = make_config(
        memcached_nodes, tables=TABLES, service={"row_flush_pushes": row_flush_pushes}
    )
    config, _ = await _serve(config, aiohttp_server)
    spec = config.table("t")
    adam = make_optimizer(spec.optimizer)
    ids = np.arange(400, dtype=np.int64)
    nodes = node_of("t", ids, config.node_addresses)
    g = np.ones((400, 8), np.float32)
    async with OptimizerClient(config, max_retries=0) as client:
        await client.push({"t": (ids, g)})
        await client.push({"t": (ids, g)})  # cached now
        lost = memcached_nodes[0]
        with raw_client(lost) as raw:
            raw.flush_all()
        with pytest.raises(DataLossError, match=lost):
            await client.push({"t": (ids, g)})
        await reinit_cluster(config)
        if row_flush_pushes > 1:  # every row held, written back: all go on from there
            rows, slots = await _state(config, ids)
            r = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=8)
            s = adam.initial_slots(ids.size, 8)
            for _ in range(2):  # the two pushes before the loss, the third was refused
                r, s = adam.update(r, g, s)
            np.testing.assert_array_equal(rows, r)
            np.testing.assert_array_equal(slots, s)
            await client.push({"t": (ids, g)})
            want, want_slots = adam.update(rows, g, slots)
            got, got_slots = await _state(config, ids)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got_slots, want_slots)
            return
        kept_rows, kept_slots = await _state(config, ids[nodes != 0])
        await client.push({"t": (ids, g)})
    on_lost = ids[nodes == 0]
    assert on_lost.size and on_lost.size < ids.size
    fresh = initial_rows(spec.initializer, seed=spec.seed, ids=on_lost, dim=8)
    want, want_slots = adam.update(fresh, g[: on_lost.size], adam.initial_slots(on_lost.size, 8))
    got, got_slots = await _state(config, on_lost)
    np.testing.assert_array_equal(got, want)  # from the initial rows, not the cached ones
    np.testing.assert_array_equal(got_slots, want_slots)
    want, want_slots = adam.update(kept_rows, g[: kept_rows.shape[0]], kept_slots)
    got, got_slots = await _state(config, ids[nodes != 0])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_slots, want_slots)
