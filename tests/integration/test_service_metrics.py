"""/metrics of a replica (real aiohttp app, real memcached): per worker series, the info
series, rows not written yet, no `_created` series."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientSession, web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from lookup_table import EmbeddingStore
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig
from lookup_table.core.wire import CONTENT_TYPE, encode_array, encode_ids, pack
from lookup_table.errors import ConfigError
from optimizer_service.app import make_app
from tests.conftest import SERVICE_TABLES, make_config, written

pytestmark = pytest.mark.integration

_IDS = np.array([11, 12, 13], dtype=np.int64)
_GRADS = np.ones((3, 8), dtype=np.float32)
_LR = np.float32(0.5)  # the "user" table's SGD


@pytest.fixture(params=[False, True], ids=["run_app", "cancelling"])
async def served(
    memcached_nodes: list[str], request: pytest.FixtureRequest
) -> AsyncIterator[tuple[ClusterConfig, web.AppRunner]]:
    """Replica 0 with rows written behind (the default), and its config. Served as
    `lookup-table-optimizer` serves it (aiohttp's `run_app`: a handler runs on when its
    client goes away), and as aiohttp's test server does (it cancels that handler)."""
    config = make_config(
        memcached_nodes, tables=SERVICE_TABLES, optimizers=["http://127.0.0.1:1"], workers=2
    )
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    runner = web.AppRunner(
        make_app(config, registry=CollectorRegistry()), handler_cancellation=request.param
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield dataclasses.replace(config, optimizers=(f"http://{host}:{port}",)), runner
    finally:
        await runner.cleanup()


def _address(runner: web.AppRunner) -> tuple[str, int]:
    host, port = runner.addresses[0][:2]
    return host, port


async def _scrape(config: ClusterConfig) -> tuple[str, dict[tuple[str, frozenset[Any]], float]]:
    """/metrics: its text, and each sample's value by (name, labels)."""
    async with ClientSession() as session, session.get(config.optimizers[0] + "/metrics") as got:
        assert got.status == 200
        text = await got.text()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def _value(samples: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def _until(what: Callable[[], Any], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _rows(config: ClusterConfig) -> np.ndarray:
    async with OptimizerClient(config) as client:
        got = await client.rows({"user": _IDS})
    return got["user"][0]


async def test_metrics_show_each_worker_the_cluster_and_the_rows_not_written_yet(
    served: tuple[ClusterConfig, web.AppRunner],
) -> None:
    config, _ = served
    start = time.time()
    async with (
        OptimizerClient(config, worker=0) as w0,
        OptimizerClient(config, worker=1) as w1,
    ):
        first = await w0.push({"user": (_IDS, _GRADS)}, examples=32, loss=np.float32(0.5))
        await w0.push({"user": (_IDS, _GRADS)}, examples=np.int64(32), loss=0.25)
        # a retry is not counted again
        again = await w0.push(
            {"user": (_IDS, _GRADS)}, push_id=first["push_id"], examples=32, loss=9.0
        )
        assert again["duplicate"]
        await w1.push({"user": (_IDS[:1], _GRADS[:1])}, examples=16)
        await w1.push({"user": (_IDS[:1], _GRADS[:1])})  # no stats: a push, no examples
    text, samples = await _scrape(config)
    assert "_created" not in text
    assert _value(samples, "lookup_table_worker_pushes_total", worker="0") == 2
    assert _value(samples, "lookup_table_worker_pushes_total", worker="1") == 2
    assert _value(samples, "lookup_table_worker_examples_total", worker="0") == 64
    assert _value(samples, "lookup_table_worker_examples_total", worker="1") == 16
    assert _value(samples, "lookup_table_worker_loss", worker="0") == 0.25
    assert ("lookup_table_worker_loss", frozenset({("worker", "1")})) not in samples
    for worker in ("0", "1"):
        last = _value(samples, "lookup_table_worker_last_push_timestamp_seconds", worker=worker)
        assert start <= last <= time.time()
    info = {
        "namespace": config.namespace,
        "replica": "0",
        "replicas": "1",
        "mode": "async",
    }
    assert _value(samples, "lookup_table_info", **info) == 1
    # written behind: the three rows wait in the replica for a flush
    assert _value(samples, "lookup_table_unwritten_rows") == 3
    assert _value(samples, "lookup_table_unflushed_pushes") == 4

    await written(config)  # a pause flushes
    _, samples = await _scrape(config)
    assert _value(samples, "lookup_table_unwritten_rows") == 0
    assert _value(samples, "lookup_table_unflushed_pushes") == 0


async def test_bad_stats_are_400_and_write_nothing(
    served: tuple[ClusterConfig, web.AppRunner],
) -> None:
    config, _ = served
    before = await _rows(config)
    cases = {
        "negative examples": ({"examples": -1}, "stats.examples: .*int >= 0, got -1"),
        "examples as a str": ({"examples": "32"}, "stats.examples: .*got '32'"),
        "examples as a bool": ({"examples": True}, "stats.examples: .*got True"),
        "examples as a float": ({"examples": 3.5}, "stats.examples: .*got 3.5"),
        "loss as a str": ({"loss": "low"}, "stats.loss: .*a number, got 'low'"),
        "unknown key": ({"accuracy": 0.9}, r"stats: expected .*got \['accuracy'\]"),
        "not a map": ([32], r"stats: expected .*got \[32\]"),
    }
    async with ClientSession() as session:
        for case, (stats, message) in cases.items():
            body = pack(
                {
                    "push_id": uuid.uuid4().hex,
                    "worker": 0,
                    "tables": {"user": {"ids": encode_ids(_IDS), "grads": encode_array(_GRADS)}},
                    "stats": stats,
                }
            )
            async with session.post(
                config.optimizers[0] + "/v1/gradients",
                data=body,
                headers={"Content-Type": CONTENT_TYPE},
            ) as resp:
                assert resp.status == 400, case
                error = (await resp.json())["error"]
            assert re.search(message, error), (case, error)
    async with OptimizerClient(config) as client:
        # the client says so before sending anything
        for kwargs, message in (
            ({"examples": -3}, "examples must be an int >= 0. Received: examples=-3"),
            ({"examples": 2.0}, "examples must be .* Received: examples=2.0"),
            ({"loss": "0.5"}, "loss must be a real number .* Received: loss of type str"),
        ):
            with pytest.raises(ConfigError, match=message):
                await client.push({"user": (_IDS, _GRADS)}, **kwargs)
        # a NaN loss (a diverged model) is reported, not refused
        await client.push({"user": (_IDS, _GRADS)}, examples=8, loss=float("nan"))
    _, samples = await _scrape(config)
    assert np.isnan(_value(samples, "lookup_table_worker_loss", worker="0"))
    assert _value(samples, "lookup_table_rejected_pushes_total", reason="stats") == len(cases)
    np.testing.assert_array_equal(await _rows(config), before - _LR * _GRADS)
