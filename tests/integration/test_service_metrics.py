"""/metrics of a replica (real aiohttp app, real memcached): per worker series, the info
series, rows not written yet, no `_created` series; a client that goes away mid-push."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
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
from optimizer_service.app import UPDATER, make_app
from tests.conftest import SERVICE_TABLES, make_config, serve_replicas, written

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
        host, port = _address(runner)
        yield dataclasses.replace(config, optimizers=(f"http://{host}:{port}",)), runner
    finally:
        await runner.cleanup()


def _address(runner: web.AppRunner) -> tuple[str, int]:
    host, port = runner.addresses[0][:2]
    return host, port


def _connections_open(runner: web.AppRunner) -> bool:
    """Whether a connection to the replica is still open (aiohttp keeps one whose handler
    runs on after it was closed, with no transport)."""
    assert runner.server is not None
    return any(c.transport is not None for c in runner.server.connections)


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
    # a push is listed for the flush once its done record is stored, which the replica
    # writes in the background after answering it: the last one may still be on its way

    async def four_listed() -> bool:
        return _value((await _scrape(config))[1], "lookup_table_unflushed_pushes") == 4

    await _until(four_listed, timeout_s=5.0)

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
                    **config.sender(0),
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


def _push_request(
    config: ClusterConfig, push_id: str, *, worker: int, answer: bool, expect: bool = False
) -> bytes:
    """A raw `POST /v1/gradients` of the "user" rows `_IDS` (headers and body)."""
    doc: dict[str, Any] = {
        **config.sender(0),
        "push_id": push_id,
        "worker": worker,
        "tables": {"user": {"ids": encode_ids(_IDS), "grads": encode_array(_GRADS)}},
    }
    if answer:
        doc["answer"] = ["rows"]
    body = pack(doc)
    head = (
        f"POST /v1/gradients HTTP/1.1\r\nHost: replica\r\nContent-Type: {CONTENT_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n" + ("Expect: 100-continue\r\n" if expect else "") + "\r\n"
    )
    return head.encode() + body


async def _assert_went_away(
    config: ClusterConfig, caplog: pytest.LogCaptureFixture, detail: str
) -> None:
    """No push counted as 500, no error logged, and one INFO line without a traceback:
    the client went away during the push (`detail`: what the line says of it)."""
    assert (await _closed_requests(config))[1] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    [line] = [r for r in caplog.records if "client went away" in r.getMessage()]
    assert line.levelno == logging.INFO and line.exc_info is None
    assert line.getMessage() == f"client went away during POST /v1/gradients ({detail})"


async def _retry(config: ClusterConfig, push_id: str) -> dict[str, Any]:
    """The trainer's retry of `push_id` (worker 1, the same gradients)."""
    async with OptimizerClient(config, worker=1) as client:
        return await client.push({"user": (_IDS, _GRADS)}, push_id=push_id)


async def _closed_requests(config: ClusterConfig) -> tuple[float, float]:
    """Pushes counted as 499 (client closed the request) and as 500."""
    _, samples = await _scrape(config)
    name = "lookup_table_http_requests_total"
    return (
        _value(samples, name, endpoint="/v1/gradients", status="499"),
        _value(samples, name, endpoint="/v1/gradients", status="500"),
    )


async def test_a_push_cut_mid_body_is_not_applied_and_no_error(
    served: tuple[ClusterConfig, web.AppRunner], caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer killed while sending a push: INFO, counted as 499, nothing applied; its
    retry applies the push."""
    config, server = served
    caplog.set_level(logging.INFO)
    before = await _rows(config)
    request = _push_request(config, "cut-1", worker=1, answer=False, expect=True)
    head, body = request.split(b"\r\n\r\n", 1)
    reader, writer = await asyncio.open_connection(*_address(server))
    writer.write(head + b"\r\n\r\n")
    # the replica says continue once the handler is about to read the body
    assert (await reader.readline()).startswith(b"HTTP/1.1 100")
    writer.write(body[: len(body) // 2])
    await writer.drain()
    writer.transport.abort()

    async def counted() -> bool:
        return (await _closed_requests(config))[0] == 1

    await _until(counted)
    await _assert_went_away(config, caplog, "before its body was read")
    np.testing.assert_array_equal(await _rows(config), before)
    retry = await _retry(config, "cut-1")
    assert retry["applied"] and not retry["duplicate"]
    np.testing.assert_array_equal(await _rows(config), before - _LR * _GRADS)


@pytest.mark.parametrize("answer", [True, False], ids=["answered", "plain"])
async def test_a_client_gone_before_the_answer_leaves_the_push_applied_once(
    served: tuple[ClusterConfig, web.AppRunner], caplog: pytest.LogCaptureFixture, answer: bool
) -> None:
    """A trainer's ctrl-C while its push waits (here: on a paused replica): INFO without
    a traceback, counted as 499 (no 500), the push applied exactly once in the background;
    the retry of its push_id is a duplicate."""
    config, server = served
    caplog.set_level(logging.INFO)
    updater = server.app[UPDATER]
    before = await _rows(config)
    await updater.pause()
    _, writer = await asyncio.open_connection(*_address(server))
    writer.write(_push_request(config, "gone-1", worker=1, answer=answer))
    await writer.drain()

    async def waiting() -> bool:  # read and parsed: held by the pause
        return "gone-1" in updater._inflight

    await _until(waiting)
    writer.transport.abort()

    async def dropped() -> bool:  # the replica saw the connection go
        return not _connections_open(server)

    await _until(dropped)
    updater.resume()

    async def counted() -> bool:
        _, samples = await _scrape(config)
        return (
            _value(samples, "lookup_table_worker_pushes_total", worker="1") == 1
            and (await _closed_requests(config))[0] == 1
        )

    await _until(counted)
    await _assert_went_away(config, caplog, "worker 1, push_id gone-1")
    np.testing.assert_array_equal(await _rows(config), before - _LR * _GRADS)
    retry = await _retry(config, "gone-1")
    assert retry["duplicate"] and not retry["applied"]
    np.testing.assert_array_equal(await _rows(config), before - _LR * _GRADS)
    await written(config)
    async with EmbeddingStore(config) as store:
        np.testing.assert_array_equal((await store.get("user", _IDS))[0], before - _LR * _GRADS)


async def test_a_push_to_two_replicas_counts_its_examples_once(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """The stats go with the part of the lowest replica a push reaches: summed over the
    replicas, each example counts once; every part counts as a push of its replica."""
    from lookup_table.core.sharding import owner_of

    config, _ = await serve_replicas(memcached_nodes, aiohttp_server)
    ids = np.arange(40, dtype=np.int64)
    owners = owner_of("user", ids, 2)
    assert set(owners.tolist()) == {0, 1}
    only_1 = ids[owners == 1]
    async with OptimizerClient(config, worker=0) as client:
        both = await client.push({"user": (ids, np.ones((40, 8), np.float32))}, examples=40)
        assert both["replicas"] == [0, 1]
        one = await client.push(
            {"user": (only_1, np.ones((only_1.size, 8), np.float32))}, examples=7, loss=0.5
        )
        assert one["replicas"] == [1]
    got = []
    for k in range(2):
        _, samples = await _scrape(dataclasses.replace(config, optimizers=(config.optimizers[k],)))
        got.append(
            [
                _value(samples, f"lookup_table_worker_{name}", worker="0")
                for name in ("pushes_total", "examples_total", "loss")
            ]
        )
    assert got == [[1, 40, 0], [2, 7, 0.5]]
