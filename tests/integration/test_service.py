"""The optimizer service (real aiohttp app, real memcached) and OptimizerClient."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from lookup_table import EmbeddingStore, PushRejectedError, StorageFormatError, initial_rows
from lookup_table.client import OptimizerClient
from lookup_table.client.answers import updated_rows
from lookup_table.client.requests import wire_tables
from lookup_table.config import ClusterConfig
from lookup_table.core.keyspace import META_TABLE, Kind, push_record_id, sentinel_key
from lookup_table.core.optimizers import make_optimizer
from lookup_table.core.optimizers.adam import Adam
from lookup_table.core.optimizers.sgd import SGD
from lookup_table.core.wire import CONTENT_TYPE, encode_array, encode_ids, pack, unpack
from lookup_table.errors import StoreFullError
from lookup_table.memcached.node import Node
from optimizer_service.app import UPDATER, make_app
from optimizer_service.engine import stepping
from optimizer_service.errors import NotOwnerError
from optimizer_service.push import parse_push
from tests.conftest import SERVICE_TABLES, make_config, raw_client, written

pytestmark = pytest.mark.integration


def _config(nodes: list[str], **kw: Any) -> ClusterConfig:
    kw.setdefault("optimizers", ["http://127.0.0.1:1"])
    return make_config(nodes, tables=SERVICE_TABLES, **kw)


async def _serve(config: ClusterConfig, aiohttp_server: Any, replica: int = 0) -> TestServer:
    async with EmbeddingStore(config) as store:
        if any(v is None for v in (await store.sentinels()).values()):
            await store.write_sentinels()
    return await aiohttp_server(make_app(config, replica=replica, registry=CollectorRegistry()))


@pytest.fixture
async def served(
    memcached_nodes, aiohttp_server
) -> AsyncIterator[tuple[ClusterConfig, TestServer]]:
    yield await _served(_config(memcached_nodes), aiohttp_server)


@pytest.fixture
async def served_through(
    memcached_nodes, aiohttp_server
) -> AsyncIterator[tuple[ClusterConfig, TestServer]]:
    """`served` with rows written through (`service.row_flush_pushes = 1`): for tests of
    what a push itself writes to memcached."""
    yield await _served(_config(memcached_nodes, service={"row_flush_pushes": 1}), aiohttp_server)


async def _served(config: ClusterConfig, aiohttp_server: Any) -> tuple[ClusterConfig, TestServer]:
    """Replica 0 of `config` serving, and `config` pointing at it."""
    server = await _serve(config, aiohttp_server)
    url = str(server.make_url("")).rstrip("/")
    return dataclasses.replace(config, optimizers=(url,)), server


def _ids(ids: Any) -> Any:
    """A list of str stays a list; anything else becomes an int64 array."""
    if isinstance(ids, list) and ids and all(isinstance(x, str) for x in ids):
        return ids
    return np.asarray(ids, dtype=np.int64)


def _body(push_id: str, tables: dict[str, tuple[Any, np.ndarray]], **extra: Any) -> bytes:
    return pack(
        {
            "push_id": push_id,
            "worker": 0,
            "version": 0,
            "tables": {
                n: {"ids": encode_ids(_ids(i)), "grads": encode_array(g)}
                for n, (i, g) in tables.items()
            },
            **extra,
        }
    )


async def _rows(config: ClusterConfig, table: str, ids: Any, *, flush: bool = True) -> np.ndarray:
    """The rows memcached holds (after a flush of the rows written behind, unless the
    replica is gone: `flush=False`)."""
    if flush:
        await written(config)
    async with EmbeddingStore(config) as store:
        values, found = await store.get(table, ids)
        assert found.all()
        return values


async def test_sgd_push_updates_rows_and_sums_duplicates(served) -> None:
    config, _ = served
    ids = np.array([3, 1, 3, 2], dtype=np.int64)
    grads = np.arange(32, dtype=np.float32).reshape(4, 8) / 10
    async with EmbeddingStore(config) as store:
        before = await store.lookup("user", [1, 2, 3])
    async with OptimizerClient(config) as client:
        result = await client.push({"user": (ids, grads)})
        assert result["applied"] and result["rows"] == 3
        again = await client.push({"user": (ids, grads)}, push_id=result["push_id"])
        assert again["duplicate"] and not again["applied"]
    summed = np.stack([grads[1], grads[3], grads[0] + grads[2]])
    np.testing.assert_allclose(
        await _rows(config, "user", [1, 2, 3]), before - np.float32(0.5) * summed, rtol=1e-6
    )


async def test_push_to_rows_never_looked_up_starts_from_their_initial_value(served) -> None:
    config, _ = served
    spec = config.table("word")
    ids = ["never", "seen before"]
    grads = np.ones((2, 4), dtype=np.float32)
    async with OptimizerClient(config) as client:
        await client.push({"word": (ids, grads)})
    init = initial_rows(spec.initializer, seed=spec.seed, ids=np.array(ids, dtype=object), dim=4)
    np.testing.assert_allclose(await _rows(config, "word", ids), init - 0.25, rtol=1e-6)


async def test_concurrent_clients_never_lose_an_update(served) -> None:
    """8 clients x 50 SGD pushes on overlapping hot ids: rows == init - lr * sum(grads)."""
    config, _ = served
    rng = np.random.default_rng(7)
    hot = np.arange(40, dtype=np.int64)
    async with EmbeddingStore(config) as store:
        init = await store.lookup("user", hot)
    total = np.zeros((40, 8), dtype=np.float64)
    plans = []
    for _ in range(8):
        pushes = []
        for _ in range(50):
            ids = rng.choice(hot, size=30, replace=True)
            grads = rng.standard_normal((30, 8)).astype(np.float32)
            np.add.at(total, ids, grads.astype(np.float64))
            pushes.append((ids, grads))
        plans.append(pushes)

    async def trainer(pushes: list[tuple[np.ndarray, np.ndarray]], worker: int) -> None:
        async with OptimizerClient(config, worker=worker) as client:
            for ids, grads in pushes:
                await client.push({"user": (ids, grads)})

    await asyncio.gather(*(trainer(p, w) for w, p in enumerate(plans)))
    expected = init.astype(np.float64) - 0.5 * total
    np.testing.assert_allclose(await _rows(config, "user", hot), expected, atol=1e-4, rtol=1e-5)


@pytest.fixture
async def http(served) -> AsyncIterator[TestClient]:
    """A raw HTTP client of the served app (for bodies OptimizerClient would never send)."""
    client = TestClient(served[1])
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def test_a_push_reads_and_writes_every_table_in_one_request_per_node(
    served_through, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows and slots of all the tables of a push: one read and one write per node
    (written through: rows written behind are written by the flush, not the push)."""
    config, _ = served_through
    ids = {"user": np.arange(60), "word": [f"w{i}" for i in range(40)], "ads": np.arange(80)}
    async with EmbeddingStore(config) as store:
        await store.lookup_many({t: ids[t] for t in ("user", "ads")})  # words are new
    table_keys = [f"{config.namespace}/{t}/{k}/".encode() for t in ids for k in ("w", "s")]
    sent: list[tuple[str, bytes]] = []
    original = Node.roundtrip

    async def roundtrip(self: Node, request: Any, parse: Any) -> Any:
        joined = request if isinstance(request, bytes) else b"".join(request)
        if any(k in joined for k in table_keys):
            sent.append((self.address, joined))
        return await original(self, request, parse)

    monkeypatch.setattr(Node, "roundtrip", roundtrip)
    rng = np.random.default_rng(3)
    push = {
        t: (v, rng.standard_normal((len(v), config.table(t).dim)).astype(np.float32))
        for t, v in ids.items()
    }
    async with OptimizerClient(config) as client:
        assert (await client.push(push))["applied"]
    for node in config.node_addresses:
        requests = [r for address, r in sent if address == node]
        # after the sentinel read: the quiet reads of every table, then the writes
        assert [r.split(b"\r\n", 1)[1][:3] for r in requests] == [b"mg ", b"ms "], node
    # one mg per id: a row and its slots are one item
    assert sum(r.count(b" v q O") for _, r in sent) == 60 + 40 + 80
    monkeypatch.undo()
    async with EmbeddingStore(config) as store:
        items, found = await store.get("ads", ids["ads"], slots=True)
    assert found.all() and items.shape == (80, 16 + 33)
    assert (items[:, 16:] != 0).any(axis=1).all()  # Adam's slots of every row were updated


async def test_tables_with_equal_optimizers_are_stepped_together_bit_for_bit(
    memcached_nodes, aiohttp_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables of one optimizer (same settings) and dim are one batch of numpy calls; each
    row and its slots come out bit for bit as a step of its table alone."""
    adam = {"name": "adam", "learning_rate": 0.01}
    tables = [
        {"name": "a", "dim": 8, "seed": 1, "optimizer": adam},
        {"name": "b", "dim": 8, "seed": 2, "optimizer": adam},  # batched with a
        {"name": "c", "dim": 8, "seed": 3, "optimizer": {**adam, "learning_rate": 0.02}},
        {"name": "d", "dim": 4, "seed": 4, "optimizer": adam},
        {"name": "e", "dim": 8, "seed": 5, "optimizer": {"name": "sgd", "learning_rate": 0.1}},
        {"name": "f", "dim": 8, "seed": 6, "optimizer": adam},  # batched with a and b
    ]
    config = make_config(memcached_nodes, tables=tables, optimizers=["http://127.0.0.1:1"])
    server = await _serve(config, aiohttp_server)
    updater = server.app[UPDATER]
    rng = np.random.default_rng(11)
    ids = {
        t["name"]: rng.choice(10_000, size=50 + 10 * i, replace=False) for i, t in enumerate(tables)
    }
    async with EmbeddingStore(config) as store:  # rows with some history: steps differ
        await store.lookup_many({n: v[::2] for n, v in ids.items()})
    first = {
        n: (v[::2], rng.standard_normal((v[::2].size, config.table(n).dim))) for n, v in ids.items()
    }
    await updater.apply(
        parse_push(
            unpack(_body("warm", {n: (i, g.astype(np.float32)) for n, (i, g) in first.items()})),
            config=config,
        )
    )
    await updater.pause()  # rows written behind: the pause writes them
    updater.resume()
    async with EmbeddingStore(config) as store:
        before = {n: await store.get(n, v, slots=True) for n, v in ids.items()}
    grads = {
        n: rng.standard_normal((v.size, config.table(n).dim)).astype(np.float32)
        for n, v in ids.items()
    }
    calls = []
    compute = stepping.step_rows

    async def counted(optimizer: Any, rows: Any, g: Any, slots: Any) -> Any:
        calls.append(("arrays", rows.shape))
        return await compute(optimizer, rows, g, slots)

    monkeypatch.setattr(stepping, "step_rows", counted)

    def counting(kind: Any) -> Any:
        original = kind.update_at

        def located(self: Any, values: Any, at: Any, extra: Any, g: Any) -> Any:
            calls.append(("in place", g.shape))
            return original(self, values, at, extra, g)

        return located

    for kind in (Adam, SGD):  # rows written behind are stepped where the row cache has them
        monkeypatch.setattr(kind, "update_at", counting(kind))
    await updater.apply(
        parse_push(unpack(_body("p", {n: (ids[n], grads[n]) for n in ids})), config=config)
    )
    batches = [(50 + 60 + 100, 8), (70, 8), (80, 4), (90, 8)]
    assert sorted(calls) == sorted(("in place", shape) for shape in batches)
    await updater.pause()
    updater.resume()
    async with EmbeddingStore(config) as store:
        for n, v in ids.items():
            spec = config.table(n)
            items, found = before[n]
            rows, slots = items[:, : spec.dim].copy(), items[:, spec.dim :].copy()
            optimizer = make_optimizer(spec.optimizer)
            if not found.all():
                missing = np.flatnonzero(~found)
                rows[missing] = initial_rows(
                    spec.initializer, seed=spec.seed, ids=v[missing], dim=spec.dim
                )
                slots[missing] = optimizer.initial_slots(missing.size, spec.dim)
            want_rows, want_slots = optimizer.update(rows, grads[n], slots)
            got, found = await store.get(n, v, slots=True)
            assert found.all()
            assert got[:, : spec.dim].tobytes() == want_rows.tobytes(), n
            assert got[:, spec.dim :].tobytes() == want_slots.tobytes(), n


async def test_bad_pushes_are_4xx_and_write_nothing(served, http) -> None:
    config, _ = served
    client = http
    async with EmbeddingStore(config) as store:
        before = await store.lookup("user", [1, 2])
        ok_grads = np.ones((2, 8), dtype=np.float32)
        nan = ok_grads.copy()
        nan[1, 3] = np.nan
        sent = config.sender(0)  # whose pushes this replica takes
        cases = {
            "not msgpack": (b"\xc1\x00garbage", 400, "msgpack"),
            "not a map": (pack([1, 2]), 400, "map"),
            "bad push_id": (pack({"push_id": "a b", "tables": {}, **sent}), 400, "push_id"),
            "no namespace": (
                _body("p10", {}, **{k: v for k, v in sent.items() if k != "namespace"}),
                400,
                r"namespace: missing; .*GET /v1/tables",
            ),
            "replica not an int": (
                _body("p11", {}, **{**sent, "replica": "0"}),
                400,
                "replica: got '0'",
            ),
            "another namespace": (
                _body("p12", {"user": ([1, 2], ok_grads)}, **{**sent, "namespace": "other"}),
                409,
                "namespace 'other', this replica's",
            ),
            "another fingerprint": (
                _body("p13", {"user": ([1, 2], ok_grads)}, **{**sent, "fingerprint": "0" * 64}),
                409,
                "fingerprint '0000.*use the same file for trainers and replicas",
            ),
            "another replica": (
                _body("p14", {"user": ([1, 2], ok_grads)}, **{**sent, "replica": 1}),
                409,
                "replica 1, this replica's 0",
            ),
            "unknown table": (
                _body("p1", {"nope": ([1], ok_grads[:1])}, **sent),
                400,
                "unknown table",
            ),
            "wrong dim": (
                _body("p2", {"user": ([1, 2], np.ones((2, 4), np.float32))}, **sent),
                400,
                r"expected shape \(2, 8\)",
            ),
            "nan": (_body("p3", {"user": ([1, 2], nan)}, **sent), 400, "finite"),
            "string ids for int table": (
                _body("p4", {"user": (["a", "b"], ok_grads)}, **sent),
                400,
                "id_type",
            ),
            "int ids for string table": (
                _body("p5", {"word": ([1, 2], ok_grads[:, :4])}, **sent),
                400,
                "id_type",
            ),
            "wrong dtype": (
                pack(
                    {
                        "push_id": "p6",
                        **sent,
                        "tables": {
                            "user": {
                                "ids": encode_ids(np.array([1, 2])),
                                "grads": {"dtype": "<f8", "shape": [2, 8], "data": b"\0" * 128},
                            }
                        },
                    }
                ),
                400,
                "dtype",
            ),
            "length mismatch": (
                pack(
                    {
                        "push_id": "p7",
                        **sent,
                        "tables": {
                            "user": {
                                "ids": encode_ids(np.array([1, 2])),
                                "grads": {"dtype": "<f4", "shape": [2, 8], "data": b"\0" * 10},
                            }
                        },
                    }
                ),
                400,
                "needs 64 bytes",
            ),
            "too long string id": (
                _body("p8", {"word": (["x" * 300], ok_grads[:1, :4])}, **sent),
                400,
                "too long",
            ),
            # a half-valid push: the first table is fine, the second is not -> nothing written
            "half valid": (
                _body(
                    "p9",
                    {"user": ([1, 2], ok_grads), "word": (["a"], np.ones((1, 3), np.float32))},
                    **sent,
                ),
                400,
                "expected shape",
            ),
        }
        for name, (body, status, pattern) in cases.items():
            resp = await client.post(
                "/v1/gradients", data=body, headers={"Content-Type": CONTENT_TYPE}
            )
            text = await resp.text()
            assert resp.status == status, (name, text)
            doc = await resp.json()
            assert "error" in doc
            assert re.search(pattern, doc["error"]), (name, doc["error"])
        np.testing.assert_array_equal(await store.lookup("user", [1, 2]), before)


async def test_oversized_body_is_413(memcached_nodes, aiohttp_client) -> None:
    config = _config(memcached_nodes, service={"max_body_bytes": 4096})
    app = make_app(config, registry=CollectorRegistry())
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    client = await aiohttp_client(app)
    resp = await client.post("/v1/gradients", data=b"\0" * 10_000)
    assert resp.status == 413
    assert "error" in await resp.json()


async def test_token_required(memcached_nodes, aiohttp_client) -> None:
    """Every route of the app but /healthz and /metrics answers 401 without the right token
    (routes are enumerated from the router, so a new endpoint is covered by construction)."""
    config = _config(memcached_nodes, token="s3cret")
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    app = make_app(config, registry=CollectorRegistry())
    client = await aiohttp_client(app)
    routes = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    public = {("GET", "/healthz"), ("GET", "/metrics")}
    assert public <= routes and len(routes - public) >= 7, routes
    wrong_tokens = [None, "Bearer nope", "Bearer s3cre", "Bearer s3cretx", "bearer s3cret"]
    for method, path in sorted(routes - public):
        for token in wrong_tokens:
            headers = {} if token is None else {"Authorization": token}
            resp = await client.request(method, path, headers=headers, data=_body("x", {}))
            assert resp.status == 401, (method, path, token, resp.status)
            assert "bearer token" in (await resp.json())["error"]
    ok = await client.get("/v1/tables", headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200
    assert [t["name"] for t in unpack(await ok.read())["tables"]] == ["user", "word", "ads"]
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/metrics")).status == 200


async def test_metrics_and_healthz(served, http) -> None:
    config, _ = served
    async with OptimizerClient(config) as client:
        await client.push({"user": (np.array([1, 2]), np.ones((2, 8), np.float32))})
        await client.push({"ads": (np.array([5]), np.ones((1, 16), np.float32))})
        await client.rows({"user": np.array([1, 2, 3])})  # 2 rows exist, 3 has none
        await client.rows({"user": np.array([4])})
        with pytest.raises(PushRejectedError, match="unknown table"):
            await client.push({"nope": (np.array([1]), np.ones((1, 8), np.float32))})
    tc = http
    text = await (await tc.get("/metrics")).text()
    for needle in (
        'lookup_table_pushes_total{status="applied"} 2.0',
        'lookup_table_rows_updated_total{table="user"} 2.0',
        'lookup_table_rows_read_total{row="existing",table="user"} 2.0',
        'lookup_table_rows_read_total{row="new",table="user"} 2.0',
        'lookup_table_rejected_pushes_total{reason="unknown_table"} 1.0',
        "lookup_table_push_latency_seconds_count 2.0",
        "lookup_table_node_fill_ratio{node=",
        "lookup_table_node_evictions{node=",
    ):
        assert needle in text, needle
    health = await tc.get("/healthz")
    assert health.status == 200 and (await health.json())["status"] == "ok"


async def _restart_and_retry(
    config: ClusterConfig,
    aiohttp_server: Any,
    push_id: str,
    ids: np.ndarray,
    grads: np.ndarray,
    *,
    want: np.ndarray,
) -> None:
    """Start a replica again (its recovery runs before it serves): the "user" rows of
    `ids` are `want`; the client's retry of `push_id` is a duplicate and changes nothing."""
    restarted = await _serve(config, aiohttp_server)
    cfg = dataclasses.replace(config, optimizers=(str(restarted.make_url("")).rstrip("/"),))
    np.testing.assert_allclose(await _rows(cfg, "user", ids), want, rtol=1e-6)
    async with OptimizerClient(cfg) as client:
        retry = await client.push({"user": (ids, grads)}, push_id=push_id)
    assert retry["duplicate"]
    np.testing.assert_allclose(await _rows(cfg, "user", ids), want, rtol=1e-6)


async def test_journaled_push_is_finished_by_the_next_replica_exactly_once(
    served, aiohttp_server
) -> None:
    """A replica that dies after journaling a push but before writing its rows: the
    restarted replica finishes it before serving, and the client's retry is a duplicate."""
    config, server = served
    updater = server.app[UPDATER]
    ids = np.array([10, 11], dtype=np.int64)
    async with EmbeddingStore(config) as store:
        before = await store.lookup("user", ids)
    grads = np.ones((2, 8), dtype=np.float32)
    push_id = uuid.uuid4().hex
    push = parse_push(unpack(_body(push_id, {"user": (ids, grads)})), config=config)

    async def crash(*_: Any) -> None:
        raise ConnectionResetError("simulated crash between journal and rows")

    updater.items.write = crash  # type: ignore[method-assign]  # the process "dies" here
    with pytest.raises(ConnectionResetError):
        await updater.apply(push)
    for task in list(updater.state.finishers):
        task.cancel()  # the dead process's background replay never runs
    await server.close()
    np.testing.assert_array_equal(await _rows(config, "user", ids, flush=False), before)

    await _restart_and_retry(config, aiohttp_server, push_id, ids, grads, want=before - 0.5)


async def test_a_push_answered_before_its_done_record_is_still_applied_once(
    served_through, aiohttp_server
) -> None:
    """The done record is written after the push is answered. Until it is stored, a
    retry is a duplicate and the rows stay locked (a push on them waits for it); a
    replica that dies before it is stored leaves the journal, whose replay finds every
    item written, recomputes none and writes the record: the retry is a duplicate.
    (Written through; rows written behind: tests/integration/test_row_write_behind.py.)"""
    config, server = served_through
    updater = server.app[UPDATER]
    ids = np.array([20, 21], dtype=np.int64)
    async with EmbeddingStore(config) as store:
        before = await store.lookup("user", ids)
    grads = np.ones((2, 8), dtype=np.float32)
    hold = asyncio.Event()
    real = updater.writes.write_record

    async def slow_record(push_id: str) -> None:
        await hold.wait()
        await real(push_id)

    updater.writes.write_record = slow_record  # type: ignore[method-assign]
    first = uuid.uuid4().hex
    push = parse_push(unpack(_body(first, {"user": (ids, grads)})), config=config)
    assert (await updater.apply(push)).applied  # answered, its record not stored
    np.testing.assert_allclose(await _rows(config, "user", ids), before - 0.5, rtol=1e-6)
    assert await updater.is_done(first)
    assert (await updater.apply(push)).duplicate
    other = parse_push(unpack(_body(uuid.uuid4().hex, {"user": (ids, grads)})), config=config)
    waiting = asyncio.ensure_future(updater.apply(other))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # the rows are locked until the record is stored
    hold.set()
    assert (await waiting).applied
    np.testing.assert_allclose(await _rows(config, "user", ids), before - 1.0, rtol=1e-6)
    async with EmbeddingStore(config) as store:
        (record,) = await store.get_blobs(
            META_TABLE, [push_record_id(0, first)], kind=Kind.PUSH_RECORD
        )
    assert record == b"1"

    # the replica "dies" with the record of its last push never written
    hold.clear()
    last = uuid.uuid4().hex
    push = parse_push(unpack(_body(last, {"user": (ids, grads)})), config=config)
    assert (await updater.apply(push)).applied
    for task in list(updater.state.cleanups):
        task.cancel()
    await server.close()
    np.testing.assert_allclose(await _rows(config, "user", ids), before - 1.5, rtol=1e-6)
    await _restart_and_retry(config, aiohttp_server, last, ids, grads, want=before - 1.5)


async def test_a_done_record_whose_write_fails_is_finished_from_the_journal(served) -> None:
    """A failed write of the done record (the push is answered, its rows written): the
    push is finished from its journal in the background, rows held meanwhile; the rows
    end as the push computed them, once, and a retry is a duplicate."""
    config, server = served
    updater = server.app[UPDATER]
    ids = np.array([30, 31], dtype=np.int64)
    async with EmbeddingStore(config) as store:
        before = await store.lookup("user", ids)
    grads = np.ones((2, 8), dtype=np.float32)
    real = updater.writes.write_record
    failures = 0

    async def failing_once(push_id: str) -> None:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise StoreFullError(
                "memcached node n1 is full (SERVER_ERROR out of memory)", node="n1"
            )
        await real(push_id)

    updater.writes.write_record = failing_once  # type: ignore[method-assign]
    push_id = uuid.uuid4().hex
    async with OptimizerClient(config) as client:
        result = await client.push({"user": (ids, grads)}, push_id=push_id)
        assert result["applied"]
        for _ in range(200):
            if failures and not updater.state.cleanups and not updater.state.finishers:
                break
            await asyncio.sleep(0.05)
        assert failures == 1 and not updater.state.finishers
        assert (await client.push({"user": (ids, grads)}, push_id=push_id))["duplicate"]
    np.testing.assert_allclose(await _rows(config, "user", ids), before - 0.5, rtol=1e-6)


async def test_dense_first_writer_wins_and_updates_with_the_optimizer(served) -> None:
    from lookup_table.core.optimizers import make_optimizer

    config, _ = served
    mine = {"w": np.full((3, 2), 0.5, np.float32), "b": np.zeros(2, np.float32)}
    theirs = {"w": np.full((3, 2), 9.0, np.float32), "b": np.ones(2, np.float32)}
    async with OptimizerClient(config, worker=0) as a, OptimizerClient(config, worker=1) as b:
        (va, pa), (vb, pb) = await asyncio.gather(a.dense_init(mine), b.dense_init(theirs))
        assert va == vb == 0
        for name in ("w", "b"):
            np.testing.assert_array_equal(pa[name], pb[name])  # both start from one winner
        grad = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.ones(2, np.float32)}
        result = await a.push({}, dense=grad)
        assert result["version"] == 1
        version, now = await b.dense()
        assert version == 1
        adam = make_optimizer(config.optimizer)
        for name in ("w", "b"):
            row = pa[name].reshape(1, -1)
            want, _ = adam.update(
                row, grad[name].reshape(1, -1), adam.initial_slots(1, row.shape[1])
            )
            np.testing.assert_array_equal(now[name], want.reshape(pa[name].shape))
        with pytest.raises(PushRejectedError, match=r"dense.w: expected shape \(3, 2\)"):
            await a.push({}, dense={"w": np.ones((2, 3), np.float32)})
        with pytest.raises(PushRejectedError, match="unknown dense parameter"):
            await a.push({}, dense={"nope": np.ones(1, np.float32)})
        assert (await b.dense())[0] == 1  # refused pushes changed nothing


async def test_a_push_answers_with_its_updated_rows_and_the_dense_weights(served) -> None:
    """Read your writes: `answer` returns exactly what the push wrote (rows of its unique
    ids, sorted; the dense weights and their version), and a retried push (a duplicate)
    answers the same, read back from the store."""
    config, _ = served
    ids = np.array([9, 4, 9, 7], dtype=np.int64)
    grads = np.arange(32, dtype=np.float32).reshape(4, 8) / 10
    words = ["b", "a", "b"]
    wgrads = np.ones((3, 4), np.float32)
    dense0 = {"w": np.full((3, 2), 0.5, np.float32)}
    async with OptimizerClient(config) as client:
        await client.dense_init(dense0)
        early: list[dict[str, Any]] = []
        result = await client.push(
            {"user": (ids, grads), "word": (words, wgrads)},
            dense={"w": np.ones((3, 2), np.float32)},
            answer=("rows", "dense"),
            on_answer=early.append,
        )
        # the answer as it came (before the writes) is the summary's; the summary's
        # dense weights are the caller's own to change
        (first,) = early
        assert first["updated"].keys() == result["updated"].keys()
        np.testing.assert_array_equal(first["params"]["w"], result["params"]["w"])
        assert result["params"]["w"].flags.writeable
        version, dense = await client.dense()
        got_ids, got_rows = result["updated"]["user"]
        np.testing.assert_array_equal(got_ids, [4, 7, 9])
        np.testing.assert_array_equal(got_rows, await _rows(config, "user", [4, 7, 9]))
        got_words, word_rows = result["updated"]["word"]
        assert got_words.tolist() == ["a", "b"]
        np.testing.assert_array_equal(word_rows, await _rows(config, "word", ["a", "b"]))
        assert result["dense_version"] == version == 1
        np.testing.assert_array_equal(result["params"]["w"], dense["w"])
        again = await client.push(
            {"user": (ids, grads), "word": (words, wgrads)},
            dense={"w": np.ones((3, 2), np.float32)},
            answer=("rows", "dense"),
            push_id=result["push_id"],
        )
        assert again["duplicate"] and not again["applied"]
        for table in ("user", "word"):
            assert again["updated"][table][0].tolist() == result["updated"][table][0].tolist()
            np.testing.assert_array_equal(again["updated"][table][1], result["updated"][table][1])
        assert again["dense_version"] == 1
        np.testing.assert_array_equal(again["params"]["w"], dense["w"])
        plain = await client.push({"user": (ids, grads)})
        assert "updated" not in plain and "params" not in plain


async def test_an_answered_push_whose_write_fails_raises_the_store_error_after_answering(
    served,
) -> None:
    """The answer comes before the writes: when writing then fails (here a full node),
    the answer was already handed over and `push` raises the store's own error, naming
    the node; the journaled push is finished in the background once the store recovers."""
    from lookup_table.errors import StoreFullError

    config, server = served
    updater = server.app[UPDATER]
    real = updater.writes.write_plan
    failures = 0
    store_full = True

    async def write_plan(plan: Any, **kwargs: Any) -> None:  # the background replay too
        nonlocal failures
        if not store_full:
            return await real(plan, **kwargs)
        failures += 1
        raise StoreFullError("memcached node n1 is full (SERVER_ERROR out of memory)", node="n1")

    updater.writes.write_plan = write_plan
    answers: list[dict[str, Any]] = []
    ids = np.array([5, 6], dtype=np.int64)
    async with EmbeddingStore(config) as store:
        before = await store.lookup("user", ids)
    async with OptimizerClient(config) as client:
        with pytest.raises(StoreFullError, match="is full") as caught:
            await client.push(
                {"user": (ids, np.ones((2, 8), np.float32))},
                answer=("rows",),
                on_answer=answers.append,
            )
        assert caught.value.node == "n1"
        assert len(answers) == 1
        got_ids, rows = answers[0]["updated"]["user"]
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_allclose(rows, before - 0.5, rtol=1e-6)  # SGD lr 0.5
        store_full = False  # the store "recovers": the background replay writes the push
        for _ in range(200):
            if not updater.state.finishers:
                break
            await asyncio.sleep(0.05)
        assert failures >= 1 and not updater.state.finishers
    np.testing.assert_array_equal(await _rows(config, "user", ids), rows)


async def test_a_bad_answer_request_is_400_and_writes_nothing(served, http) -> None:
    config, _ = served
    async with EmbeddingStore(config) as store:
        before = await store.lookup("user", [1, 2])
        push = {"user": ([1, 2], np.ones((2, 8), np.float32))}
        for answer, pattern in [
            ("rows", "answer: expected a list"),
            (["rows", 3], "answer: expected a list"),
            (["rows", "slots"], r"answer: unknown \['slots'\]"),
        ]:
            resp = await http.post(
                "/v1/gradients",
                data=_body(uuid.uuid4().hex, push, answer=answer, **config.sender(0)),
                headers={"Content-Type": CONTENT_TYPE},
            )
            doc = await resp.json()
            assert resp.status == 400 and re.search(pattern, doc["error"]), (answer, doc)
        np.testing.assert_array_equal(await store.lookup("user", [1, 2]), before)
    two = dataclasses.replace(config, optimizers=("http://a:1", "http://b:1"))
    with pytest.raises(NotOwnerError, match="answer: dense parameters live on replica 0"):
        parse_push({"push_id": "p", "answer": ["dense"]}, config=two, replica=1)


async def test_sync_mode_two_replicas_apply_the_mean_once(memcached_nodes, aiohttp_server) -> None:
    from lookup_table.ops.localcluster import free_port

    ports = [free_port(), free_port()]
    config = _config(
        memcached_nodes, mode="sync", workers=2, optimizers=[f"http://127.0.0.1:{p}" for p in ports]
    )
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        ids = np.arange(50, dtype=np.int64)
        init = await store.lookup("user", ids)
    for k, port in enumerate(ports):
        await aiohttp_server(make_app(config, replica=k, registry=CollectorRegistry()), port=port)
    g0 = np.ones((50, 8), np.float32)
    g1 = np.full((50, 8), 3.0, np.float32)
    async with OptimizerClient(config, worker=0) as w0, OptimizerClient(config, worker=1) as w1:
        first = asyncio.create_task(w0.push({"user": (ids, g0)}, version=0))
        await asyncio.sleep(0.2)
        assert not first.done()  # waits for the other worker of version 0
        r1 = await w1.push({"user": (ids, g1)}, version=0)
        r0 = await first
        assert r0["version"] == r1["version"] == 1 and r0["replicas"] == [0, 1]
        assert await w0.version(after=0) == 1
        np.testing.assert_allclose(await _rows(config, "user", ids), init - 0.5 * 2.0, rtol=1e-6)
        with pytest.raises(PushRejectedError, match="model is at version 1"):
            await w0.push({"user": (ids, g0)}, version=0)


@pytest.mark.parametrize("row_flush_pushes", [1, 4], ids=["rows-through", "rows-behind"])
async def test_a_sync_round_tells_the_rows_it_created_to_one_worker(
    memcached_nodes, aiohttp_server, row_flush_pushes: int
) -> None:
    """Rows no lookup created: the round that first pushes them creates them, and its
    `created` goes to the worker whose push applied the round, so they count once."""
    config, _ = await _served(
        _config(
            memcached_nodes, mode="sync", workers=2, service={"row_flush_pushes": row_flush_pushes}
        ),
        aiohttp_server,
    )
    ids = np.arange(1_000, 1_030, dtype=np.int64)
    g = np.ones((30, 8), np.float32)
    async with OptimizerClient(config, worker=0) as w0, OptimizerClient(config, worker=1) as w1:
        for version in range(2):  # the second round creates nothing
            r0, r1 = await asyncio.gather(
                w0.push({"user": (ids, g)}, version=version),
                w1.push({"user": (ids, g)}, version=version),
            )
            assert r0["version"] == r1["version"] == version + 1
            created = [r0["created"], r1["created"]]
            assert sorted(created, key=len) == [{}, {"user": 30} if version == 0 else {}], created
        again = await w0.push({"user": (ids, g)}, version=0, push_id=r0["push_id"])
        assert again["duplicate"] and again["created"] == {}


async def test_pause_holds_new_pushes_until_resume(served) -> None:
    config, _ = served
    async with OptimizerClient(config) as client:
        await client.pause(timeout_s=30)
        push = asyncio.create_task(
            client.push({"user": (np.array([1]), np.ones((1, 8), np.float32))})
        )
        await asyncio.sleep(0.3)
        assert not push.done()
        await client.resume()
        assert (await push)["applied"]


async def test_a_replica_refuses_to_start_on_a_namespace_of_storage_format_1(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """It would read format 1's rows as corrupt or missing: it says so and serves nothing."""
    config = make_config(memcached_nodes, tables=SERVICE_TABLES)
    old = b'{"namespace": "%s", "node": "x", "created": 1.0}' % config.namespace.encode()
    for node in config.node_addresses:
        with raw_client(node) as client:
            client.set(sentinel_key(config.namespace), old, noreply=False)
    with pytest.raises(StorageFormatError, match="storage format 1.*restore --force"):
        await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))


# Three Adam tables of one dim (sent as a group), one of another dim and one of string ids
# (sent alone): the shapes of a model's features.
GROUPED_TABLES: list[dict[str, Any]] = [
    {"name": "c1", "dim": 4, "seed": 1},
    {"name": "c2", "dim": 4, "seed": 2},
    {"name": "c3", "dim": 4, "seed": 3},
    {"name": "wide", "dim": 8, "seed": 4},
    {"name": "word", "dim": 4, "seed": 5, "id_type": "string"},
]


async def test_tables_sent_as_a_group_train_bit_for_bit_as_one_by_one(
    memcached_nodes, aiohttp_server
) -> None:
    """Two services of the same tables: one gets OptimizerClient's pushes and reads (the
    int64 tables of one dim as a group), the other the same pushes one table at a time.
    Every answer's rows, every read and the rows in memcached are the same bits; a bad
    table among them is refused naming it."""
    configs = []
    for _ in range(2):
        config = make_config(memcached_nodes, tables=GROUPED_TABLES, optimizers=["http://x:1"])
        configs.append((await _served(config, aiohttp_server))[0])
    rng = np.random.default_rng(7)
    async with OptimizerClient(configs[0]) as grouped, OptimizerClient(configs[1]) as alone:
        for step in range(4):
            tables: dict[str, Any] = {}
            for spec in GROUPED_TABLES:
                ids: Any = np.unique(rng.integers(0, 60, size=25))
                if spec["name"] == "word":
                    ids = [f"w{int(i)}" for i in ids]
                dim = spec["dim"]
                tables[spec["name"]] = (ids, rng.standard_normal((len(ids), dim), np.float32))
            singles, groups = wire_tables(
                grouped.config, {n: (_ids(i), g) for n, (i, g) in tables.items()}, grads=True
            )
            assert [g["tables"] for g in groups] == [["c1", "c2", "c3"]]
            assert set(singles) == {"wide", "word"}
            raw: list[dict[str, Any]] = []
            for client, body in (
                (grouped, {"tables": singles, "groups": groups}),
                (alone, {"tables": {**singles, **_one_by_one(tables, ("c1", "c2", "c3"))}}),
            ):
                body.update(push_id=f"s{step}", answer=["rows"], **client.config.sender(0))
                await client._request(0, "POST", "/v1/gradients", pack(body), first=raw.append)
            assert [g["tables"] for g in raw[0]["updated_groups"]] == [["c1", "c2", "c3"]]
            assert "updated_groups" not in raw[1]
            a, b = updated_rows([raw[0]]), updated_rows([raw[1]])
            assert set(a) == set(b) == set(tables)
            for name, (ids, rows) in a.items():
                np.testing.assert_array_equal(ids, b[name][0])
                np.testing.assert_array_equal(rows, b[name][1])
            for reads in (
                {n: _ids(i) for n, (i, _) in tables.items()},
                {"c1": np.arange(70), "c3": np.arange(5), "wide": np.arange(3)},
            ):
                got = await grouped.rows(reads)  # c1..c3 (or c1, c3) as a group
                body = {
                    "tables": {n: {"ids": encode_ids(np.unique(i))} for n, i in reads.items()},
                    **alone.config.sender(0),
                }
                want = await alone._request(0, "POST", "/v1/rows", pack(body))
                assert "groups" not in want
                for name, ids in reads.items():
                    order = np.argsort(np.argsort(np.asarray(ids)))  # unique ids' order
                    rows = np.frombuffer(want["rows"][name]["data"], np.float32)
                    np.testing.assert_array_equal(got[name][0], rows.reshape(len(ids), -1)[order])
                    assert got[name][1] == want["new"][name]
        bad = {
            "c1": (np.array([1, 2]), np.ones((2, 4), np.float32)),
            "c2": (np.array([1, 2]), np.ones((2, 5), np.float32)),  # not dim 4: sent alone
            "c3": (np.array([3]), np.ones((1, 4), np.float32)),
        }
        with pytest.raises(PushRejectedError, match=r"tables.c2.grads: expected shape \(2, 4\)"):
            await grouped.push(bad)
        nan = dict(
            bad, c2=(np.array([1, 2]), np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]], np.float32))
        )
        with pytest.raises(PushRejectedError, match="tables.c2: gradient is not finite"):
            await grouped.push(nan)


def _one_by_one(tables: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {
        n: {"ids": encode_ids(_ids(tables[n][0])), "grads": encode_array(tables[n][1])}
        for n in names
    }
