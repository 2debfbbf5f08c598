"""Rows written behind (`service.row_flush_pushes` > 1), real memcached and the real app.

The replica keeps the rows it updates (dirty, in its row cache) and journals each push's
new values; every `row_flush_pushes` pushes (or `row_flush_s` seconds, a pause, a clean
stop) it writes the dirty rows once and clears those journals. Checked here against the
optimizer's own math on the same gradients: the pushes train exactly as written through;
memcached gets each row once per flush, not once per push; a crash before the flush loses
nothing (the next replica replays the journals in order, every row ends at its newest
value, and a retried push is still a duplicate); a pause writes everything, so a
checkpoint reads the newest rows; pushes that also carry a table the cache does not hold
write that one through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from lookup_table import EmbeddingStore, initial_rows
from lookup_table.client import OptimizerClient, PushReads, RowReader
from lookup_table.core.keys import as_ids
from lookup_table.core.keyspace import Kind, is_journal_header
from lookup_table.core.optimizers import make_optimizer
from lookup_table.core.precision import round_to
from lookup_table.core.wire import decode_rows, encode_array, encode_ids, pack, unpack
from lookup_table.errors import (
    ClusterMismatchError,
    PushRejectedError,
    ReplicaUnavailableError,
    StorageFormatError,
)
from lookup_table.ops.checkpoint.listing import decode_bodies, namespace_keys
from optimizer_service.app import UPDATER, make_app
from optimizer_service.engine.journal import MAX_JOURNAL_SLOTS, Journal
from optimizer_service.engine.journal_format import BEHIND
from optimizer_service.engine.updater import Updater
from optimizer_service.errors import NotOwnerError
from optimizer_service.push import parse_push, parse_rows_request
from tests.conftest import make_config, node_stat
from tests.integration.test_journal_replay import renumber_journals
from tests.integration.test_row_dtypes import PRECISE, as_stored
from tests.integration.test_service import _body

pytestmark = pytest.mark.integration

TABLES = [
    {"name": "t", "dim": 8, "seed": 3},  # Adam (the default optimizer)
    {"name": "s", "dim": 4, "seed": 4, "id_type": "string"},  # not cached: written through
]
IDS = np.arange(-150, 150, dtype=np.int64) * 7919
WORDS = [f"w{i}" for i in range(20)]


def _config(nodes: list[str], *, tables: list[dict[str, Any]] = TABLES, **service: Any) -> Any:
    return make_config(
        nodes,
        tables=tables,
        optimizers=["http://127.0.0.1:1"],
        service={"row_flush_pushes": 4, "row_flush_s": 600.0, **service},
    )


async def _replica(
    nodes: list[str],
    aiohttp_server: Any,
    seed: int,
    *,
    tables: list[dict[str, Any]] = TABLES,
    **service: Any,
) -> tuple[Any, Any, Any, Reference, Any]:
    """A fresh namespace's replica 0 writing behind: (config, server, its updater, the
    reference math, the gradients' generator)."""
    config = _config(nodes, tables=tables, **service)
    server = await _start(config, aiohttp_server)
    return config, server, server.app[UPDATER], Reference(config), np.random.default_rng(seed)


async def _start(config: Any, aiohttp_server: Any, *, sentinels: bool = True) -> Any:
    if sentinels:
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
    return await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))


class Reference:
    """The optimizer's math on the same gradients, from the initial rows; the rows of a
    16-bit table rounded as it stores them (`as_stored`)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.opt = {n: make_optimizer(config.table(n).optimizer) for n in ("t", "s")}
        self.ids = {"t": IDS, "s": WORDS}
        self.state = {
            "t": self._initial("t", IDS),
            "s": self._initial("s", WORDS),
        }

    def _initial(self, table: str, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        spec = self.config.table(table)
        rows = initial_rows(spec.initializer, seed=spec.seed, ids=as_ids(ids), dim=spec.dim)
        if spec.dtype != "float32":
            rows = round_to(rows, spec.dtype)
        return rows, self.opt[table].initial_slots(len(ids), spec.dim)

    def step(self, table: str, grads: np.ndarray) -> None:
        rows, slots = self.state[table]
        new_rows, new_slots = self.opt[table].update(rows, grads, slots)
        spec = self.config.table(table)
        self.state[table] = (
            as_stored(spec, self.ids[table], slots, new_rows, new_slots),
            new_slots,
        )


async def _stored(config: Any, table: str, ids: Any) -> tuple[np.ndarray, np.ndarray, Any]:
    async with EmbeddingStore(config) as store:
        items, found = await store.get(table, ids, unique=True, slots=True)
    dim = config.table(table).dim
    return items[:, :dim], items[:, dim:], found


def _sets(nodes: list[str]) -> int:
    return sum(node_stat(a, "cmd_set") for a in nodes)


async def _push(updater: Any, config: Any, ref: Reference, rng: Any, push_id: str = "") -> bytes:
    g = rng.standard_normal((IDS.shape[0], 8), dtype=np.float32)
    w = rng.standard_normal((len(WORDS), 4), dtype=np.float32)
    body = _body(push_id or uuid.uuid4().hex, {"t": (IDS, g), "s": (WORDS, w)})
    await updater.apply(parse_push(unpack(body), config=config))
    ref.step("t", g)
    ref.step("s", w)
    return body


async def _until(check: Any) -> None:
    """Wait up to 5 s for background work (the flush, the done records)."""
    for _ in range(250):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{check.__name__} did not hold within 5 s")


async def test_rows_written_behind_train_exactly_and_reach_memcached_once_per_flush(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    config, _, updater, ref, rng = await _replica(memcached_nodes, aiohttp_server, 0)
    before = _sets(memcached_nodes)
    for _ in range(3):
        await _push(updater, config, ref, rng)
    _, _, found = await _stored(config, "t", IDS)
    assert not found.any()  # not flushed yet: memcached has none of the cached rows
    rows, slots, found = await _stored(config, "s", WORDS)  # the string table: through
    assert found.all()
    np.testing.assert_array_equal(rows, ref.state["s"][0])
    # the journals and done records, the string table: no item per row and push
    assert _sets(memcached_nodes) - before < IDS.shape[0]
    await _push(updater, config, ref, rng)  # the 4th: a flush starts

    async def flushed() -> bool:
        return bool((await _stored(config, "t", IDS))[2].all())

    await _until(flushed)
    rows, slots, _ = await _stored(config, "t", IDS)
    np.testing.assert_array_equal(rows, ref.state["t"][0])  # bit for bit
    np.testing.assert_array_equal(slots, ref.state["t"][1])
    assert _sets(memcached_nodes) - before < 2 * IDS.shape[0]  # each row once, not 4x
    async with EmbeddingStore(config) as store:  # the flush cleared the journals
        journal = Journal(store, replica=0)
        assert not any(await journal.headers())
    # a push reads the rows from the cache, and goes on exactly
    await _push(updater, config, ref, rng)
    await updater.pause()  # a checkpoint's pause writes everything
    rows, slots, _ = await _stored(config, "t", IDS)
    np.testing.assert_array_equal(rows, ref.state["t"][0])
    np.testing.assert_array_equal(slots, ref.state["t"][1])
    updater.resume()


@pytest.mark.parametrize("flush_pushes", [1, 3], ids=["written through", "written behind"])
async def test_a_cleared_journal_leaves_no_chunks_behind(
    memcached_nodes: list[str], aiohttp_server: Any, flush_pushes: int
) -> None:
    """A push large enough for its journal to be chunked (its ids and gradients) leaves
    only the empty headers of its slots once its rows are written and its journal is
    cleared: the chunks go with it, and the rows train as they did."""
    config, _, updater, _, rng = await _replica(
        memcached_nodes, aiohttp_server, 5, row_flush_pushes=flush_pushes
    )
    # 40,000 x (8 + 8 x 4) bytes: a push's journal is chunked, written through or behind
    ids = np.arange(40_000, dtype=np.int64) * 13
    for _ in range(3):
        grads = rng.standard_normal((ids.shape[0], 8), dtype=np.float32)
        await updater.apply(
            parse_push(unpack(_body(uuid.uuid4().hex, {"t": (ids, grads)})), config=config)
        )

    async def journal_keys() -> list[str]:
        async with EmbeddingStore(config) as store:
            found = await namespace_keys(store)
        return [
            str(id_)
            for keys in found.values()
            for id_ in decode_bodies(
                config.namespace,
                "_meta",
                Kind.JOURNAL,
                keys.bodies.get(("_meta", Kind.JOURNAL), []),
            )
        ]

    async def cleared() -> bool:
        async with EmbeddingStore(config) as store:
            return not any(await Journal(store, replica=0).headers())

    await _until(cleared)  # the rows are written and the journals cleared
    for _ in range(10):  # the chunks go right after the headers
        keys = await journal_keys()
        if all(is_journal_header(k) for k in keys):
            break
        await asyncio.sleep(0.1)
    assert keys and [k for k in keys if not is_journal_header(k)] == []
    assert (await _stored(config, "t", ids))[2].all()


async def test_a_flush_comes_early_once_the_journals_waiting_for_it_hold_their_byte_budget(
    memcached_nodes: list[str], aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journals of pushes written behind wait in memcached until a flush: however many
    pushes `row_flush_pushes` allows, once they hold `KEPT_JOURNAL_BYTES` the push that
    took them there starts the flush, which writes the rows and clears them."""
    import optimizer_service.engine.write_behind as write_behind

    config, _, updater, ref, rng = await _replica(
        memcached_nodes, aiohttp_server, 2, row_flush_pushes=50
    )
    await _push(updater, config, ref, rng)
    one = sum(updater.row_flushes.journal_bytes.values())
    assert one > IDS.shape[0] * 8 * 4  # the summed gradients at least
    await asyncio.sleep(0.1)
    assert not (await _stored(config, "t", IDS))[2].any()  # 1 of 50 pushes: no flush
    monkeypatch.setattr(write_behind, "KEPT_JOURNAL_BYTES", one + one // 2)
    await _push(updater, config, ref, rng)  # two journals: past the budget

    async def flushed() -> bool:
        return bool((await _stored(config, "t", IDS))[2].all())

    await _until(flushed)
    rows, slots, _ = await _stored(config, "t", IDS)
    np.testing.assert_array_equal(rows, ref.state["t"][0])
    np.testing.assert_array_equal(slots, ref.state["t"][1])

    async def cleared() -> bool:
        async with EmbeddingStore(config) as store:
            return not any(await Journal(store, replica=0).headers())

    await _until(cleared)


@pytest.mark.parametrize("meanwhile", ["map reused", "cache dropped"])
async def test_rows_stepped_in_the_row_cache_train_exactly_when_it_changed_meanwhile(
    memcached_nodes: list[str], aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """A push locates its cached rows, reads the rest, then steps them where the cache
    holds them. If the map they were located in was reused meanwhile (rotated out twice),
    the push reads its rows again; if the whole cache was dropped (a node's sentinel
    changed: the dirty rows are written first), it steps them in the map it located them
    in and puts the new values in the new cache by key. Either way, exactly the math."""
    config, _, updater, ref, rng = await _replica(memcached_nodes, aiohttp_server, 5)
    for _ in range(2):
        await _push(updater, config, ref, rng)
    prepared = updater.stepper.read_starts
    calls = []

    async def then_change(tables: Any, *peek: Any) -> Any:
        out = await prepared(tables, *peek)
        calls.append(len(tables))
        if len(calls) == 1 and meanwhile == "cache dropped":
            await updater.row_flushes.flush()  # what a sentinel change does before it drops
            updater.state.forget_rows()
        return out

    monkeypatch.setattr(updater.stepper, "read_starts", then_change)
    if meanwhile == "map reused":
        values_of = updater.cache.values_of
        first = []

        def reused(spots: Any) -> Any:
            first.append(spots)
            return None if len(first) == 1 else values_of(spots)

        monkeypatch.setattr(updater.cache, "values_of", reused)
    await _push(updater, config, ref, rng)
    assert len(calls) == (2 if meanwhile == "map reused" else 1)
    monkeypatch.undo()
    await _push(updater, config, ref, rng)  # and on from what the cache holds now
    await updater.pause()
    rows, slots, _ = await _stored(config, "t", IDS)
    np.testing.assert_array_equal(rows, ref.state["t"][0])
    np.testing.assert_array_equal(slots, ref.state["t"][1])
    updater.resume()


async def test_rows_read_through_the_owner_are_its_newest_and_create_nothing(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """`POST /v1/rows` (what trainers read while rows are written behind): the rows
    memcached does not hold yet come from the replica's memory, exact; ids never pushed
    get their initial values, counted as new, and no item is created for them; the first
    push of an id reports it created; bad requests are 4xx naming what is wrong."""
    config, server, updater, ref, rng = await _replica(memcached_nodes, aiohttp_server, 2)
    url = str(server.make_url("")).rstrip("/")
    config = dataclasses.replace(config, optimizers=(url,))
    g = rng.standard_normal((IDS.shape[0], 8), dtype=np.float32)
    pushed = parse_push(unpack(_body(uuid.uuid4().hex, {"t": (IDS, g)})), config=config)
    result = await updater.apply(pushed)
    assert result.created == {"t": IDS.shape[0]}  # no trainer created them: this push
    ref.step("t", g)
    await _push(updater, config, ref, rng)
    assert not (await _stored(config, "t", IDS))[2].any()  # memcached: nothing yet
    unseen = np.array([5, 10**15, -(2**62)], dtype=np.int64)

    async def recorded() -> bool:  # the pushes' done records, written in the background
        return not updater.state.recording

    await _until(recorded)
    # items stored since the nodes started, not items held: the nodes are shared, and
    # earlier tests' rows with a ttl_s expire (and are reclaimed) at any moment
    stored = sum(node_stat(a, "total_items") for a in memcached_nodes)
    async with OptimizerClient(config) as client:
        ask = np.concatenate([IDS[::-1], unseen, IDS[:3]])  # any order, duplicates
        got = await client.rows({"t": ask, "s": WORDS})
        rows, new = got["t"]
        np.testing.assert_array_equal(rows[: IDS.shape[0]], ref.state["t"][0][::-1])
        np.testing.assert_array_equal(rows[-3:], ref.state["t"][0][:3])
        spec = config.table("t")
        fresh = initial_rows(spec.initializer, seed=spec.seed, ids=unseen, dim=spec.dim)
        np.testing.assert_array_equal(rows[IDS.shape[0] : -3], fresh)
        assert new == unseen.shape[0]
        # the string table is written through: memcached's rows, read by the replica
        np.testing.assert_array_equal(got["s"][0], ref.state["s"][0])
        assert got["s"][1] == 0
        assert sum(node_stat(a, "total_items") for a in memcached_nodes) == stored
        sender = config.sender(0)
        for bad, pattern in [
            ({"tables": {"nope": {"ids": encode_ids(IDS)}}}, "unknown table 'nope'"),
            ({"tables": {"t": {"ids": ["a", "b"]}}}, "has id_type='int64' but the request"),
            ({"tables": {"t": {"ids": encode_ids(IDS), "grads": 1}}}, "exactly ids"),
            (
                {"tables": {}, "push_id": "x"},
                r"with tables \(and groups\), namespace, fingerprint, replica; got \[.fingerpr",
            ),
            ({"tables": [1]}, "expected a map of table name"),
        ]:
            with pytest.raises(PushRejectedError, match=pattern) as info:
                await client._request(0, "POST", "/v1/rows", pack({**bad, **sender}))
            assert info.value.status == 400
        with pytest.raises(PushRejectedError, match="fingerprint: missing") as info:
            await client._request(0, "POST", "/v1/rows", pack({"tables": {}, "namespace": "x"}))
        assert info.value.status == 400
        with pytest.raises(ClusterMismatchError, match="namespace 'x', this replica's"):
            await client._request(
                0, "POST", "/v1/rows", pack({"tables": {}, **sender, "namespace": "x"})
            )
        with pytest.raises(PushRejectedError, match="400"):
            await client._request(0, "POST", "/v1/rows", b"\xc1")  # not msgpack
        # a request of another client, out of order with duplicates: the unique ids' rows
        # in ascending order
        mixed = np.array([IDS[5], IDS[1], IDS[5]], dtype=np.int64)
        doc = await client._request(
            0, "POST", "/v1/rows", pack({"tables": {"t": {"ids": encode_ids(mixed)}}, **sender})
        )
        # a 16-bit table's rows come as their words, its dtype in `row_dtypes`
        alone = {"rows": doc["rows"]["t"], "row_dtype": doc.get("row_dtypes", {}).get("t")}
        answered = decode_rows({k: v for k, v in alone.items() if v is not None}, field="rows")
        np.testing.assert_array_equal(answered, ref.state["t"][0][[1, 5]])
    two = dataclasses.replace(config, optimizers=("http://a:1", "http://b:1"))
    with pytest.raises(NotOwnerError, match="rows belong to other replicas"):
        parse_rows_request({"tables": {"t": {"ids": encode_ids(IDS)}}}, config=two, replica=1)


async def test_a_push_reads_rows_along_as_post_rows_reads_them_after_it(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """A push's `read` (how a trainer reads its next batch): its answer carries what
    `POST /v1/rows` would answer once the push's new values are computed: its own rows
    new, others from the replica's memory, unseen ids initial and counted new; a retry
    answers the read again; a push of no gradients reads alone; a bad `read` is a 4xx
    naming it, and the push is not applied."""
    config, server, updater, ref, rng = await _replica(memcached_nodes, aiohttp_server, 5)
    url = str(server.make_url("")).rstrip("/")
    config = dataclasses.replace(config, optimizers=(url,))
    await _push(updater, config, ref, rng)
    unseen = np.array([5, 10**15], dtype=np.int64)
    ask = {"t": np.concatenate([IDS[::-1], unseen, IDS[:3]]), "s": WORDS}
    spec = config.table("t")
    fresh = initial_rows(spec.initializer, seed=spec.seed, ids=unseen, dim=spec.dim)
    async with OptimizerClient(config) as client:
        before = await client.rows(ask)
        g = rng.standard_normal((IDS.shape[0], 8), dtype=np.float32)
        answered: list[dict[str, Any]] = []
        push_id = uuid.uuid4().hex
        summary = await client.push(
            {"t": (IDS, g)}, push_id=push_id, reads=ask, on_read=answered.append
        )
        ref.step("t", g)
        assert summary["applied"] and len(answered) == 1
        rows, new = summary["read"]["t"]
        assert answered[0]["t"][0] is rows
        np.testing.assert_array_equal(rows[: IDS.shape[0]], ref.state["t"][0][::-1])  # after
        assert not np.array_equal(rows[: IDS.shape[0]], before["t"][0][: IDS.shape[0]])
        np.testing.assert_array_equal(rows[IDS.shape[0] : -3], fresh)
        np.testing.assert_array_equal(rows[-3:], ref.state["t"][0][:3])
        assert new == unseen.shape[0]
        np.testing.assert_array_equal(summary["read"]["s"][0], ref.state["s"][0])
        after = await client.rows(ask)
        for table in ask:
            np.testing.assert_array_equal(summary["read"][table][0], after[table][0])
        again = await client.push({"t": (IDS, g)}, push_id=push_id, reads=ask)
        assert again["duplicate"] and not again["applied"]
        np.testing.assert_array_equal(again["read"]["t"][0], rows)
        alone = await client.push({}, reads={"t": IDS[:4]})
        np.testing.assert_array_equal(alone["read"]["t"][0], ref.state["t"][0][:4])
        version = updater.version
        sender = config.sender(0)
        grads = {"t": {"ids": encode_ids(IDS), "grads": encode_array(g)}}
        for bad, pattern in [
            ({"tables": {"nope": {"ids": encode_ids(IDS)}}}, "read: tables: unknown table 'nope'"),
            ({"tables": {"t": {"ids": ["a"]}}}, "read: tables.t.ids: table 't' has id_type"),
            ({"t": {"ids": encode_ids(IDS)}}, r"read: expected a map with tables \(and groups"),
            ([1, 2], r"read: expected a map with tables \(and groups\), as POST /v1/rows takes"),
        ]:
            body = {"push_id": uuid.uuid4().hex, "tables": grads, "read": bad, **sender}
            with pytest.raises(PushRejectedError, match=pattern) as info:
                await client._request(0, "POST", "/v1/gradients", pack(body))
            assert info.value.status == 400
        assert updater.version == version  # none of them applied
        np.testing.assert_array_equal((await client.rows({"t": IDS}))["t"][0], ref.state["t"][0])
    two = dataclasses.replace(config, optimizers=("http://a:1", "http://b:1"))
    with pytest.raises(NotOwnerError, match="read: tables.t.ids: .* belong to other replicas"):
        parse_push(
            {"push_id": "p", "read": {"tables": {"t": {"ids": encode_ids(IDS)}}}},
            config=two,
            replica=1,
        )


async def test_reads_left_to_a_push_come_with_it_or_are_read_alone(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """`RowReader.lookup_many(..., along=reads)` (a trainer's next batch): the rows read
    through their owner come with the push that takes them, without a `POST /v1/rows`;
    asked after a push took them, or left when no push came (`close`), they are read by
    a request of their own; a push that fails fails them with its error."""
    config = _config(memcached_nodes)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    registry = CollectorRegistry()
    server = await aiohttp_server(make_app(config, replica=0, registry=registry))
    config = dataclasses.replace(config, optimizers=(str(server.make_url("")).rstrip("/"),))

    def alone() -> float:
        got = registry.get_sample_value(
            "lookup_table_http_requests_total", {"endpoint": "/v1/rows", "status": "200"}
        )
        return got or 0.0

    async def lookup(reads: PushReads) -> asyncio.Future[Any]:
        looking = asyncio.ensure_future(reader.lookup_many({"t": IDS[:50]}, along=reads))
        await asyncio.sleep(0)  # its first step asks
        return looking

    g = np.random.default_rng(0).standard_normal((10, 8), dtype=np.float32)
    async with EmbeddingStore(config) as store, OptimizerClient(config) as client:
        reader = RowReader(store, client)
        reads = PushReads()
        looking = await lookup(reads)
        summary = await client.push(
            {"t": (IDS[:10], g)}, reads=reads.take(), on_read=reads.answered
        )
        rows = (await looking)["t"]
        assert alone() == 0
        np.testing.assert_array_equal(rows, summary["read"]["t"][0])
        np.testing.assert_array_equal(rows, (await client.rows({"t": IDS[:50]}))["t"][0])
        assert alone() == 1
        late = PushReads()
        assert late.take() is None  # a push went without them
        assert late.ask({"t": IDS[:50]}) is None
        np.testing.assert_array_equal(
            (await reader.lookup_many({"t": IDS[:50]}, along=late))["t"], rows
        )
        assert alone() == 2
        left = PushReads()
        looking = await lookup(left)
        left.close()
        np.testing.assert_array_equal((await looking)["t"], rows)
        assert alone() == 3
        failed = PushReads()
        looking = await lookup(failed)
        assert failed.take() is not None
        failed.close()  # taken: the push answers or fails them, not `close`
        assert not looking.done()
        failed.failed(ReplicaUnavailableError("replica 0 failed after 7 attempts"))
        with pytest.raises(ReplicaUnavailableError, match="after 7 attempts"):
            await looking
        assert alone() == 3


async def test_a_new_id_is_read_from_memcached_once_then_known_until_its_push_creates_it(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """Ids memcached has no row for, read through their owner, are remembered with
    their initial values (initial entries of the row cache): reading them again and
    pushing them asks memcached nothing more; the push still reports them created and
    trains exactly from their initial values; the flush writes them."""
    config, server, updater, ref, rng = await _replica(memcached_nodes, aiohttp_server, 3)
    url = str(server.make_url("")).rstrip("/")
    config = dataclasses.replace(config, optimizers=(url,))
    spec = config.table("t")
    initial = initial_rows(spec.initializer, seed=spec.seed, ids=IDS, dim=spec.dim)

    def gets() -> int:
        return sum(node_stat(a, "cmd_get") for a in memcached_nodes)

    async with OptimizerClient(config) as client:
        before = gets()
        rows, new = (await client.rows({"t": IDS}))["t"]
        assert new == IDS.shape[0]
        np.testing.assert_array_equal(rows, initial)
        after_first = gets()
        assert after_first - before >= IDS.shape[0]  # each new id asked once
        rows, new = (await client.rows({"t": IDS[::-1]}))["t"]
        assert new == IDS.shape[0]  # still no row: new, and its initial value
        np.testing.assert_array_equal(rows, initial[::-1])
        g = rng.standard_normal((IDS.shape[0], 8), dtype=np.float32)
        pushed = parse_push(unpack(_body(uuid.uuid4().hex, {"t": (IDS, g)})), config=config)
        result = await updater.apply(pushed)
        ref.step("t", g)
        assert result.created == {"t": IDS.shape[0]}
        assert gets() - after_first < 10  # the second read and the push: no row read
        rows, new = (await client.rows({"t": IDS}))["t"]
        assert new == 0
        np.testing.assert_array_equal(rows, ref.state["t"][0])
    await updater.pause()  # the flush writes them, with the push's values
    rows, slots, found = await _stored(config, "t", IDS)
    assert found.all()
    np.testing.assert_array_equal(rows, ref.state["t"][0])
    np.testing.assert_array_equal(slots, ref.state["t"][1])
    updater.resume()


async def test_only_the_only_creator_of_a_tables_rows_remembers_ids_without_one(
    memcached_nodes: list[str],
) -> None:
    """Initial entries are for tables read through their owner, whose rows only it
    creates; written through, trainers `add` rows (after counting sightings, with
    `admit_after`), so a read that finds no row remembers nothing."""
    tables = [{"name": "t", "dim": 8}, {"name": "a", "dim": 8, "admit_after": 2}]
    unseen = np.arange(1, 40, dtype=np.int64) * 104729
    for flush, remembered in [(4, {"t"}), (1, set())]:
        config = make_config(memcached_nodes, tables=tables, service={"row_flush_pushes": flush})
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
            updater = Updater(config, store)
            updater.state.sentinels = await updater.state.cache_sentinels()
            names = [t["name"] for t in tables if updater.cache.caches(t["name"])]
            got = await updater.answers.rows_now([(n, unseen) for n in names])
            assert all(not found.any() for _, found in got)  # no row: initial values
            known = updater.cache.lookup_many([(n, unseen) for n in names])
            assert {
                n for n, (hit, _, _, initial) in zip(names, known, strict=True) if initial.all()
            } == remembered
            assert all(hit.all() == initial.all() for hit, _, _, initial in known)


@pytest.mark.parametrize(
    ("numbered", "option"),
    [(True, ""), (False, ""), *((True, name) for name in sorted(PRECISE))],
    ids=["numbered", "unnumbered", *sorted(PRECISE)],
)
async def test_a_crash_before_the_flush_is_replayed_in_order_and_loses_nothing(
    memcached_nodes: list[str], aiohttp_server: Any, numbered: bool, option: str
) -> None:
    """`numbered=False`: the journals' headers have no format number, as services wrote
    them before formats were numbered; their `seq` says they are of rows written behind.
    `option`: table t stored with one of the compact options (16-bit rows, row-wise
    optimizers), replayed to the same rounded bits."""
    tables = TABLES
    if option:
        dtype, optimizer = PRECISE[option]
        tables = [{**TABLES[0], "dtype": dtype, "optimizer": optimizer}, TABLES[1]]
    config, server, updater, ref, rng = await _replica(
        memcached_nodes, aiohttp_server, 1, tables=tables, row_flush_pushes=10
    )
    bodies = [await _push(updater, config, ref, rng) for _ in range(5)]
    await asyncio.sleep(0.2)  # the done records land
    # the process dies: no flush, no close
    updater.row_flushes.cancel_timer()
    await server.runner.shutdown()
    _, _, found = await _stored(config, "t", IDS)
    assert not found.any()
    async with EmbeddingStore(config) as store:
        headers = await Journal(store, replica=0).headers()
        assert len(headers) == MAX_JOURNAL_SLOTS and sum(bool(h) for h in headers) == 5
    if not numbered:
        assert await renumber_journals(config, None) == [BEHIND] * 5

    restarted = await _start(config, aiohttp_server, sentinels=False)
    rows, slots, found = await _stored(config, "t", IDS)
    assert found.all()
    np.testing.assert_array_equal(rows, ref.state["t"][0])  # the 5th push's values
    np.testing.assert_array_equal(slots, ref.state["t"][1])
    async with EmbeddingStore(config) as store:
        assert not any(await Journal(store, replica=0).headers())
    again = restarted.app[UPDATER]
    for body in bodies:  # every retry is a duplicate: nothing applied twice
        result = await again.apply(parse_push(unpack(body), config=config))
        assert result.duplicate
    # and the restarted replica goes on from there, writing behind again; an answer read
    # back (not the push's own plan) takes the rows memcached does not hold yet from the
    # row cache
    await _push(again, config, ref, rng)
    probe = _body("probe", {"t": (IDS[:7], np.zeros((7, 8), np.float32))}, answer=["rows"])
    got = (await again.answer(parse_push(unpack(probe), config=config), None)).to_wire()
    # a 16-bit table's rows travel as their words: half the bytes, the same values
    words = got["updated"]["t"]
    assert words.get("row_dtype") == (PRECISE[option][0] if option else None)
    assert words["rows"]["dtype"] == ("<u2" if option else "<f4")
    answered = decode_rows(words, field="updated.t")
    np.testing.assert_array_equal(answered, ref.state["t"][0][:7])
    stale, _, _ = await _stored(config, "t", IDS[:7])
    assert not np.array_equal(stale, answered)  # memcached still has the 5th push's
    await again.close()
    rows, _, _ = await _stored(config, "t", IDS)
    np.testing.assert_array_equal(rows, ref.state["t"][0])


async def test_a_restore_drops_the_rows_not_written_and_frees_their_journal_slots(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    config, _, updater, ref, rng = await _replica(memcached_nodes, aiohttp_server, 2)
    for _ in range(2):
        await _push(updater, config, ref, rng)
    await asyncio.sleep(0.2)
    free = updater.journal._free.qsize()
    await updater.pause(drop_unfinished=True)
    assert updater.journal._free.qsize() == free + 2
    assert updater.cache.dirty()[0] == []
    _, _, found = await _stored(config, "t", IDS)
    assert not found.any()  # nothing written behind a restore's back
    updater.resume()


async def test_a_flush_writes_nothing_to_a_node_that_lost_its_data(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """A node restarted empty between pushes: the flush raises DataLossError naming it and
    writes no row anywhere (a write batch's own sentinel check runs behind its writes;
    a flush carries every row written behind, so it asks first). The rows stay in the
    replica and its journals: a reinit then writes them back with their newest values."""
    from lookup_table.errors import DataLossError
    from lookup_table.ops.admin import reinit_cluster
    from tests.conftest import raw_client

    config, _, updater, ref, rng = await _replica(memcached_nodes, aiohttp_server, 7)
    for _ in range(2):
        await _push(updater, config, ref, rng)

    async def done_records_written() -> bool:
        # first: a done record that fails on the lost node is finished from its journal,
        # whose replay writes that push's own rows (the store's window, not the flush)
        return not updater.state.recording

    await _until(done_records_written)
    lost = memcached_nodes[1]
    with raw_client(lost) as raw:
        raw.flush_all()
    with pytest.raises(DataLossError, match=lost) as info:
        await updater.row_flushes.flush()
    assert info.value.nodes == (lost,)
    async with EmbeddingStore(config, check_sentinels=False) as store:
        _, found = await store.get("t", IDS)
    assert not found.any()  # not one row written, on either node
    await reinit_cluster(config)
    await updater.pause()  # the flush: every row at its newest value, on both nodes
    rows, slots, found = await _stored(config, "t", IDS)
    assert found.all()
    np.testing.assert_array_equal(rows, ref.state["t"][0])
    np.testing.assert_array_equal(slots, ref.state["t"][1])
    updater.resume()


async def _crashed_after(
    memcached_nodes: list[str], aiohttp_server: Any, pushes: int, seed: int
) -> tuple[Any, Reference, list[dict[str, tuple[np.ndarray, np.ndarray]]]]:
    """`pushes` pushes written behind, then the replica dies (no flush): the config, the
    reference, and each table's (rows, slots) after each push."""
    config, server, updater, ref, rng = await _replica(
        memcached_nodes, aiohttp_server, seed, row_flush_pushes=10
    )
    after = []
    for _ in range(pushes):
        await _push(updater, config, ref, rng)
        after.append({n: (ref.state[n][0].copy(), ref.state[n][1].copy()) for n in ("t", "s")})
    await asyncio.sleep(0.2)  # the done records land
    updater.row_flushes.cancel_timer()
    await server.runner.shutdown()
    return config, ref, after


async def _journals(config: Any) -> list[Any]:
    """The replica's journals written behind, in their order."""
    async with EmbeddingStore(config) as store:
        journal = Journal(store, replica=0)
        plans = [await journal.read(s) for s in range(MAX_JOURNAL_SLOTS)]
    return sorted((p for p in plans if p is not None), key=lambda p: p.journal_seq)


async def test_a_replay_after_a_flush_cut_short_gives_each_row_the_pushes_it_lacks(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """Adam's journal written behind keeps the gradients and each row's step before the
    push, not the new values. A flush cut short leaves rows of several ages in memcached;
    the replay applies to each exactly the journaled pushes after its step."""
    config, ref, after = await _crashed_after(memcached_nodes, aiohttp_server, 5, seed=2)
    plans = await _journals(config)
    assert len(plans) == 5
    for plan, steps in zip(plans, range(5), strict=True):
        assert [r.table for r in plan.redo] == ["t", "s"] and not plan.updates
        redo = plan.redo[0]
        assert redo.steps is not None
        np.testing.assert_array_equal(redo.steps, np.full(IDS.shape[0], steps, np.float32))
    # the cut flush: rows 0-99 reached memcached at push 3's values, rows 100-199 at push
    # 5's (the newest), rows 200-299 not at all; and the string ids of table s (written
    # through by each push) as if push 5's write had stopped after its journal
    async with EmbeddingStore(config) as store:
        for span, (rows, slots) in (
            (slice(0, 100), after[2]["t"]),
            (slice(100, 200), after[4]["t"]),
        ):
            await store.set("t", IDS[span], rows[span], slots=slots[span])
        await store.set("s", WORDS, after[3]["s"][0], slots=after[3]["s"][1])
    restarted = await _start(config, aiohttp_server, sentinels=False)
    rows, slots, found = await _stored(config, "t", IDS)
    assert found.all()
    np.testing.assert_array_equal(rows, ref.state["t"][0])  # push 5's, bit for bit
    np.testing.assert_array_equal(slots, ref.state["t"][1])
    rows, slots, _ = await _stored(config, "s", WORDS)
    np.testing.assert_array_equal(rows, ref.state["s"][0])
    np.testing.assert_array_equal(slots, ref.state["s"][1])
    assert not await _journals(config)
    await restarted.app[UPDATER].close()


async def _clear_journal(config: Any, nth: int) -> None:
    """Clear the journal of the `nth` push (0: the first) of those written behind."""
    async with EmbeddingStore(config) as store:
        journal = Journal(store, replica=0)
        headers = await journal.headers()
        order = sorted(
            (s for s, h in enumerate(headers) if h), key=lambda s: unpack(headers[s])["seq"]
        )
        await journal.clear(order[nth])


async def test_a_row_behind_its_journals_stops_the_start_and_says_why(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """A journal that expects a row at a later step than memcached holds it: an update
    of the row is in neither (lost). The replica does not start (nothing is written),
    and says which row and what to do. So does a journal of steps for a table whose
    optimizer or dim changed in the config."""
    config, _, after = await _crashed_after(memcached_nodes, aiohttp_server, 3, seed=3)
    # another optimizer: the nodes' sentinels record the table's (before any journal is read)
    sgd = [{**TABLES[0], "optimizer": {"name": "sgd"}}, TABLES[1]]
    other = make_config(["127.0.0.1:1"], tables=sgd).tables
    with pytest.raises(StorageFormatError, match="holds table 't' .* adam slots .* sgd slots"):
        await _start(dataclasses.replace(config, tables=other), aiohttp_server, sentinels=False)
    for changed, said in [
        ({"dim": 16}, "dim 16 and optimizer 'adam', which counts steps"),
        ({"ttl_s": 3600}, r"dim 8 and optimizer 'adam', and ttl_s 3600 \(journaled by values\)"),
    ]:
        tables = [{**TABLES[0], **changed}, TABLES[1]]
        other = make_config(["127.0.0.1:1"], tables=tables).tables
        with pytest.raises(RuntimeError, match=rf"table 't' for rows of dim 8, but .*{said}"):
            await _start(dataclasses.replace(config, tables=other), aiohttp_server, sentinels=False)
    # a flush wrote push 1's values, then the second push's journal goes missing
    async with EmbeddingStore(config) as store:
        await store.set("t", IDS, after[0]["t"][0], slots=after[0]["t"][1])
    await _clear_journal(config, 1)
    with pytest.raises(RuntimeError, match=r"from step 2, but .* at step 1: an update .*lost"):
        await _start(config, aiohttp_server, sentinels=False)
    rows, _, _ = await _stored(config, "t", IDS)
    np.testing.assert_array_equal(rows, after[0]["t"][0])  # nothing written


async def test_rows_a_reinitialized_node_lost_restart_from_their_initial_values(
    memcached_nodes: list[str], aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows memcached does not hold that the journals step from a later step than the
    initial one: a flush had written them, and their node lost them (a `reinit` accepted
    that). They start again from their initial values, as the lost node's rows the
    replica did not hold do, with a warning; the replica starts."""
    config, _, _ = await _crashed_after(memcached_nodes, aiohttp_server, 3, seed=4)
    await _clear_journal(config, 0)  # as if push 1's rows had been flushed, then lost
    with caplog.at_level("WARNING"):
        restarted = await _start(config, aiohttp_server, sentinels=False)
    assert "600 journaled updates of rows of table 't' that memcached lost" in caplog.text
    _, _, found = await _stored(config, "t", IDS)
    assert not found.any()  # not re-created by the replay: their next push creates them
    await restarted.app[UPDATER].close()


def test_a_journal_written_behind_keeps_values_where_steps_are_not_exact() -> None:
    """Per table: gradients and steps for Adam while every new step is exact in float32
    (at most 2**24); the new values for a row past it, and for optimizers without a step
    (the newest value wins at a replay)."""
    from optimizer_service.engine.journal_format import decode_journal, encode_journal
    from optimizer_service.engine.plan import TableUpdate, WritePlan

    ids = np.array([3, 5], dtype=np.int64)
    grads = np.ones((2, 2), np.float32)
    rows = np.zeros((2, 2), np.float32)

    def update(table: str, steps: list[float]) -> TableUpdate:
        slots = np.zeros((2, 5), np.float32)
        slots[:, 4] = steps
        return TableUpdate(table, ids, rows, slots, grads=grads)

    plan = WritePlan(
        push_id="p",
        updates=[update("a", [1, 2**24]), update("b", [2, 2**24 + 2]), update("c", [1, 1])],
    )
    chunks, header = encode_journal(plan, seq=1, step_slots={"a": 4, "b": 4, "c": None})
    back = decode_journal(unpack(header)["body"])
    (a,) = back.redo
    assert a.table == "a" and a.steps is not None
    np.testing.assert_array_equal(a.steps, [0, 2**24 - 1])
    np.testing.assert_array_equal(a.grads, grads)
    assert [u.table for u in back.updates] == ["b", "c"]  # values
    np.testing.assert_array_equal(back.updates[0].slots, plan.updates[1].slots)


def test_a_journal_written_behind_groups_the_tables_of_one_dim() -> None:
    """Tables journaled by steps with int ids and the same dim are one entry, their arrays
    concatenated; they decode to each table's own ids, gradients and steps, in the same
    bits. String ids, values and other dims stay entries of their own; a group whose
    counts do not add up is refused."""
    from optimizer_service.engine.journal_format import decode_journal, encode_journal
    from optimizer_service.engine.plan import TableUpdate, WritePlan

    rng = np.random.default_rng(5)

    def update(table: str, n: int, dim: int, ids: Any = None) -> TableUpdate:
        slots = rng.standard_normal((n, 2 * dim + 1)).astype(np.float32)
        slots[:, 2 * dim] = rng.integers(1, 1000, n)
        return TableUpdate(
            table,
            np.sort(rng.choice(10**12, n, replace=False)).astype(np.int64) if ids is None else ids,
            rng.standard_normal((n, dim)).astype(np.float32),
            slots,
            grads=rng.standard_normal((n, dim)).astype(np.float32),
        )

    updates = [
        update("a", 7, 4),
        update("wide", 3, 8),
        update("b", 1, 4),
        update("s", 2, 4, ids=np.array(["x", "y"], dtype=object)),
        update("c", 5, 4),
        update("v", 2, 4),
    ]
    step_slots = {u.table: 2 * u.rows.shape[1] for u in updates} | {"v": None}
    plan = WritePlan(push_id="p", updates=updates)
    _, header = encode_journal(plan, seq=3, step_slots=step_slots)
    body = unpack(header)["body"]
    entries = unpack(body)["tables"]
    names = [e.get("group", e.get("table")) for e in entries]
    assert names == [["a", "b", "c"], ["wide"], "s", "v"]
    back = decode_journal(body)
    assert [u.table for u in back.updates] == ["v"]
    redo = {r.table: r for r in back.redo}
    assert sorted(redo) == ["a", "b", "c", "s", "wide"]
    for u in updates[:5]:
        r = redo[u.table]
        np.testing.assert_array_equal(r.ids, u.ids)
        assert r.grads.tobytes() == u.grads.tobytes()
        assert r.steps is not None
        np.testing.assert_array_equal(r.steps, u.slots[:, 2 * u.rows.shape[1]] - 1)

    entries[0]["counts"][0] += 1  # a torn group: its counts name an id it does not have
    with pytest.raises(ValueError, match=r"a group of tables \['a', 'b', 'c'\] with counts"):
        decode_journal(pack({**unpack(body), "tables": entries}))


def test_row_flush_pushes_is_bounded_by_the_journal_slots() -> None:
    from lookup_table.errors import ConfigError

    with pytest.raises(ConfigError, match=r"service\.row_flush_pushes: expected at most 56"):
        make_config(["127.0.0.1:1"], service={"row_flush_pushes": 57})
    for key, bad in [("row_flush_pushes", 0), ("row_flush_pushes", 2.5), ("row_flush_s", 0)]:
        with pytest.raises(ConfigError, match=rf"service\.{key}: expected a positive"):
            make_config(["127.0.0.1:1"], service={key: bad})
    assert make_config(["127.0.0.1:1"]).service.row_flush_pushes == 56  # written behind


async def test_only_tables_read_through_the_owner_are_written_behind(
    memcached_nodes: list[str],
) -> None:
    """Trainers read through the owner exactly the tables the replica writes behind:
    int64 ids without `ttl_s` or `admit_after` (whose lookups count sightings in
    memcached); the others stay written through, out of the row cache."""
    tables = [
        {"name": "t", "dim": 8},
        {"name": "s", "dim": 4, "id_type": "string"},
        {"name": "e", "dim": 4, "ttl_s": 3600},
        {"name": "a", "dim": 4, "admit_after": 2},
    ]
    for flush, behind in [(4, {"t"}), (1, set())]:
        config = make_config(memcached_nodes, tables=tables, service={"row_flush_pushes": flush})
        assert {t["name"] for t in tables if config.reads_through_owner(t["name"])} == behind
        async with EmbeddingStore(config) as store:
            cached = {t["name"] for t in tables if Updater(config, store).cache.caches(t["name"])}
        assert cached == ({"t"} if flush > 1 else {"t", "a"})
