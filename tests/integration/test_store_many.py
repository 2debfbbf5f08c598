"""Multi-table batches (`lookup_many`, `get_many`, `set_many`, `add_many`) against real
memcached: the same results as the per-table calls, one request per node, the same errors."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lookup_table.store.placement as placement_module
from lookup_table import (
    ConfigError,
    CorruptValueError,
    DataLossError,
    EmbeddingStore,
    KeyEncodingError,
    StoreFullError,
    StoreTimeoutError,
    TableRead,
    TableWrite,
    encode_key,
    initial_rows,
)
from lookup_table.config import ClusterConfig
from lookup_table.core.keys import id_bodies
from lookup_table.core.sharding import node_of
from lookup_table.memcached.node import Node
from lookup_table.ops.localcluster import start_memcached
from tests.conftest import make_config, node_stat, raw_client, sigstop

pytestmark = pytest.mark.integration

MANY_TABLES: list[dict[str, Any]] = [{"name": f"C{i}", "dim": 16, "seed": i} for i in range(26)]
ADAM_SLOTS = 2 * 16 + 1  # m, v and the row's step


class RoundTrips:
    """Every pipelined request sent to a node, by node address."""

    def __init__(self) -> None:
        self.requests: dict[str, list[bytes]] = collections.defaultdict(list)

    def per_node(self) -> dict[str, int]:
        return {node: len(sent) for node, sent in self.requests.items()}

    def total(self) -> int:
        return sum(self.per_node().values())

    def clear(self) -> None:
        self.requests.clear()


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> RoundTrips:
    """Count the round trips of every store (an instrumented `Node.roundtrip`)."""
    seen = RoundTrips()
    original = Node.roundtrip

    async def roundtrip(self: Node, request: Any, parse: Callable[[bytes], Any]) -> Any:
        sent = request if isinstance(request, bytes) else b"".join(request)
        seen.requests[self.address].append(sent)
        return await original(self, request, parse)

    monkeypatch.setattr(Node, "roundtrip", roundtrip)
    return seen


def _ids_on_every_node(table: str, nodes: tuple[str, ...], n: int, start: int = 0) -> np.ndarray:
    """The first n consecutive int ids from `start` on of which every node holds some (the
    nodes' addresses are random ports: a run of a dozen ids may all land on one node)."""
    for first in range(start, start + 1000 * n, n):
        ids = np.arange(first, first + n, dtype=np.int64)
        if len(set(node_of(table, ids, nodes).tolist())) == len(nodes):
            return ids
    raise AssertionError(f"no {n} consecutive ids from {start} on cover every node")


# ------------------------------------------------------------------ the same results


async def _populate(store: EmbeddingStore, seed: int) -> None:
    """Some rows and slots exist, some not: ids 0..59 of every table, a random half of each."""
    rng = np.random.default_rng(seed)
    user = np.flatnonzero(rng.random(60) < 0.5).astype(np.int64)
    item = np.flatnonzero(rng.random(60) < 0.5).astype(np.int64)
    words = [f"w{i}" for i in np.flatnonzero(rng.random(60) < 0.5).tolist()]
    rows = await store.lookup("user", user)
    await store.lookup("item", item)
    await store.lookup("word", words)
    slots = rng.standard_normal((user.shape[0], ADAM_SLOTS)).astype(np.float32)
    await store.set("user", user, rows, slots=slots)


table_ids = {
    "user": st.lists(st.integers(0, 80), max_size=40),
    "item": st.lists(st.integers(0, 80), max_size=40),
    "word": st.lists(st.integers(0, 80).map(lambda i: f"w{i}"), max_size=40),
}
lookups_st = st.fixed_dictionaries({}, optional=table_ids)


@given(lookups=lookups_st, create=st.booleans(), seed=st.integers(0, 3))
def test_lookup_many_equals_lookup_per_table(
    memcached_nodes: list[str], lookups: dict[str, list[Any]], create: bool, seed: int
) -> None:
    """Two namespaces populated alike: one answers lookup_many, the other a lookup per table.
    Rows, `created` counts and what is stored afterwards are the same."""

    async def scenario() -> None:
        stores = [EmbeddingStore(make_config(memcached_nodes)) for _ in range(2)]
        try:
            for s in stores:
                await s.write_sentinels()
                await _populate(s, seed)
                s.created.clear()
            many = await stores[0].lookup_many(lookups, create=create)
            single = {
                t: await stores[1].lookup(t, ids, create=create) for t, ids in lookups.items()
            }
            assert many.keys() == single.keys()
            for table in lookups:
                assert many[table].dtype == np.float32
                np.testing.assert_array_equal(many[table], single[table])
            assert {t: n for t, n in stores[0].created.items() if n} == {
                t: n for t, n in stores[1].created.items() if n
            }
            everything: dict[str, Any] = {"user": np.arange(81), "item": np.arange(81)}
            everything["word"] = [f"w{i}" for i in range(81)]
            for table, ids in everything.items():
                a, b = [await s.get(table, ids) for s in stores]
                np.testing.assert_array_equal(a[0], b[0])
                np.testing.assert_array_equal(a[1], b[1])
        finally:
            for s in stores:
                await s.close()

    asyncio.run(scenario())


reads_st = st.lists(
    st.tuples(
        st.sampled_from(["user", "item", "word"]),
        st.booleans(),  # each row with its slots
        st.lists(st.integers(0, 80), max_size=30),
        st.booleans(),  # share the ids object with the read before it (same table only)
    ),
    max_size=8,
)


@given(reads=reads_st, unique=st.booleans(), seed=st.integers(0, 3))
def test_get_many_equals_get_per_read(
    memcached_nodes: list[str],
    reads: list[tuple[str, bool, list[int], bool]],
    unique: bool,
    seed: int,
) -> None:
    async def scenario() -> None:
        async with EmbeddingStore(make_config(memcached_nodes)) as store:
            await store.write_sentinels()
            await _populate(store, seed)
            requests: list[TableRead] = []
            for table, with_slots, raw, share in reads:
                ids: Any = [f"w{i}" for i in raw] if table == "word" else np.array(raw, np.int64)
                if unique:
                    ids = list(dict.fromkeys(ids)) if table == "word" else np.unique(ids)
                if share and requests and requests[-1].table == table:
                    ids = requests[-1].ids  # the same ids object
                requests.append(TableRead(table, ids, slots=with_slots))
            await _get_many_is_get_per_read(store, requests, unique=unique)

    asyncio.run(scenario())


async def _get_many_is_get_per_read(
    store: EmbeddingStore, requests: list[TableRead], *, unique: bool
) -> None:
    """get_many of `requests` returns, for each, what a get of it alone returns."""
    results = await store.get_many(requests, unique=unique)
    assert len(results) == len(requests)
    for r, (values, found) in zip(requests, results, strict=True):
        want_values, want_found = await store.get(r.table, r.ids, unique=unique, slots=r.slots)
        assert values.dtype == np.float32 and values.shape == want_values.shape
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(found, want_found)


WIDE_TABLES: list[dict[str, Any]] = [
    {"name": f"C{i}", "dim": 16 if i % 3 else 8, "seed": i} for i in range(1, 13)
]
wide_reads_st = st.lists(
    st.tuples(
        st.integers(1, 12),  # the table: C1..C12, two key prefix lengths, dims 16 and 8
        st.booleans(),  # each row with its slots
        st.lists(st.integers(0, 150), max_size=30),
    ),
    max_size=14,
)


@given(reads=wide_reads_st, unique=st.booleans(), seed=st.integers(0, 3))
def test_get_many_of_many_tables_equals_get_per_read(
    memcached_nodes: list[str], reads: list[tuple[int, bool, list[int]]], unique: bool, seed: int
) -> None:
    """Reads of rows of int tables of one layout (key prefix length, dim, slots or not)
    go as one wide part, their keys built, placed and scattered together: the values are
    a get's per read, whatever the mix of layouts, repeated tables and missing rows."""

    async def scenario() -> None:
        config = make_config(memcached_nodes, tables=WIDE_TABLES)
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
            rng = np.random.default_rng(seed)
            made = {
                f"C{i}": np.flatnonzero(rng.random(150) < 0.5).astype(np.int64)
                for i in range(1, 13)
            }
            await store.lookup_many(made)
            for table in ("C2", "C11"):
                ids = made[table]
                rows = rng.standard_normal((ids.shape[0], 16)).astype(np.float32)
                slots = rng.standard_normal((ids.shape[0], ADAM_SLOTS)).astype(np.float32)
                await store.set(table, ids, rows, slots=slots)
            requests = []
            for number, with_slots, raw in reads:
                ids = np.array(raw, np.int64)
                requests.append(
                    TableRead(f"C{number}", np.unique(ids) if unique else ids, slots=with_slots)
                )
            await _get_many_is_get_per_read(store, requests, unique=unique)

    asyncio.run(scenario())


async def test_set_many_writes_what_set_writes(store: EmbeddingStore) -> None:
    rng = np.random.default_rng(5)
    user = np.arange(100, 400, dtype=np.int64)
    words = [f"x{i}" for i in range(50)]
    rows = rng.standard_normal((300, 16)).astype(np.float32)
    slots = rng.standard_normal((300, ADAM_SLOTS)).astype(np.float32)
    word_rows = rng.standard_normal((50, 8)).astype(np.float32)
    await store.set_many(
        [TableWrite("user", user, rows, slots=slots), TableWrite("word", words, word_rows)]
    )
    got = await store.get_many(
        [
            TableRead("user", user[::-1]),
            TableRead("user", user, slots=True),
            TableRead("word", words, slots=True),
        ]
    )
    np.testing.assert_array_equal(got[0][0], rows[::-1])
    np.testing.assert_array_equal(got[1][0], np.hstack([rows, slots]))
    np.testing.assert_array_equal(got[2][0][:, :8], word_rows)
    np.testing.assert_array_equal(got[2][0][:, 8:], 0)  # Adam's initial slots
    assert all(found.all() for _, found in got)
    assert await store.set_many([]) is None
    assert await store.get_many([]) == []
    assert await store.lookup_many({}) == {}


async def test_add_many_stores_only_absent_values(store: EmbeddingStore) -> None:
    await store.set("user", [1, 2], np.ones((2, 16), dtype=np.float32))
    stored = await store.add_many(
        [
            TableWrite("user", [1, 2, 3], np.full((3, 16), 2.0, dtype=np.float32)),
            TableWrite("word", ["a", "b"], np.full((2, 8), 3.0, dtype=np.float32)),
        ]
    )
    assert [s.tolist() for s in stored] == [[False, False, True], [True, True]]
    values, _ = await store.get("user", [1, 2, 3])
    assert values[:, 0].tolist() == [1.0, 1.0, 2.0]


# ------------------------------------------------------------------ one request per node


async def test_rows_and_slots_of_26_tables_are_one_request_per_node(
    config: ClusterConfig, round_trips: RoundTrips, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(list(config.node_addresses), tables=MANY_TABLES)
    rng = np.random.default_rng(7)
    ids = {f"C{i}": rng.integers(0, 10**9, size=400).astype(np.int64) for i in range(26)}
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup_many(ids)  # create
        round_trips.clear()

        # The ids of a table are placed once (all int tables in one node_of_many call), and
        # a row and its slots are one item: one mg.
        placements: list[str] = []
        original_node_of = placement_module.node_of
        original_node_of_many = placement_module.node_of_many

        def counting_node_of(table: str, *args: Any) -> Any:
            placements.append(table)
            return original_node_of(table, *args)

        def counting_node_of_many(tables: list[str], *args: Any) -> Any:
            placements.extend(tables)
            return original_node_of_many(tables, *args)

        monkeypatch.setattr(placement_module, "node_of", counting_node_of)
        monkeypatch.setattr(placement_module, "node_of_many", counting_node_of_many)
        reads = [TableRead(t, table_ids, slots=True) for t, table_ids in ids.items()]
        gets_before = sum(node_stat(n, "cmd_get") for n in store.nodes)
        results = await store.get_many(reads)
        gets_after = sum(node_stat(n, "cmd_get") for n in store.nodes)
        assert sorted(placements) == sorted(ids)
        assert round_trips.per_node() == dict.fromkeys(store.nodes, 1)
        keys = sum(np.unique(v).shape[0] for v in ids.values())
        assert gets_after - gets_before == keys + len(store.nodes)  # + one sentinel per node
        for sent in round_trips.requests.values():
            assert sent[0].count(store._sentinel_key) == 1
            assert sent[0].startswith(b"mg " + store._sentinel_key + b" v\r\n")
        assert all(found.all() for _, found in results)  # every row exists
        assert not any(values[:, 16:].any() for values, _ in results)  # initial slots: zeros

        round_trips.clear()
        uniq = {t: np.unique(v) for t, v in ids.items()}  # writes need unique ids
        slots = {t: np.full((len(v), ADAM_SLOTS), 0.5, np.float32) for t, v in uniq.items()}
        rows_of = {t: np.zeros((len(v), 16), np.float32) for t, v in uniq.items()}
        await store.set_many([TableWrite(t, uniq[t], rows_of[t], slots=slots[t]) for t in ids])
        assert round_trips.per_node() == dict.fromkeys(store.nodes, 1)

        round_trips.clear()
        rows = await store.lookup_many(ids)  # all exist: the read only
        assert round_trips.per_node() == dict.fromkeys(store.nodes, 1)
        for t, table_ids in ids.items():
            np.testing.assert_array_equal(rows[t], await store.lookup(t, table_ids))

        round_trips.clear()
        fresh = {t: v + 10**9 for t, v in ids.items()}
        await store.lookup_many(fresh)  # all new: the read, then the adds
        assert round_trips.per_node() == dict.fromkeys(store.nodes, 2)
        assert sum(store.created.values()) == 2 * sum(np.unique(v).shape[0] for v in ids.values())


async def test_batches_over_max_batch_keys_are_split_each_with_its_sentinel(
    config: ClusterConfig, round_trips: RoundTrips
) -> None:
    small = make_config(
        list(config.node_addresses), tables=MANY_TABLES[:5], store={"max_batch_keys": 7}
    )
    ids = {f"C{i}": np.arange(i, i + 20, dtype=np.int64) for i in range(5)}
    async with EmbeddingStore(small) as store:
        await store.write_sentinels()
        created = await store.lookup_many(ids)
        round_trips.clear()
        again = await store.lookup_many(ids)
        placement = [node_of(t, v, store.nodes) for t, v in ids.items()]
        for j, node in enumerate(store.nodes):
            on_node = sum(int((p == j).sum()) for p in placement)
            sent = round_trips.requests[node]
            assert len(sent) == -(-on_node // 7)  # ceil: full round trips of 7 keys
            assert all(r.startswith(b"mg " + store._sentinel_key) for r in sent)
            assert sum(r.count(b" v q O") for r in sent) == on_node
        for t, v in ids.items():
            np.testing.assert_array_equal(again[t], created[t])
            spec = small.table(t)
            np.testing.assert_array_equal(
                created[t], initial_rows(spec.initializer, seed=spec.seed, ids=v, dim=spec.dim)
            )


# ------------------------------------------------------------------ creation semantics


async def test_lookup_many_creates_like_lookup_and_rereads_lost_races(
    config: ClusterConfig, store: EmbeddingStore, in_order: str
) -> None:
    """A trainer whose adds lose to another writer returns the winner's rows, per table,
    and counts only the rows it created: with the rows put in order after the adds, or in a
    thread while they are in flight (`in_order`)."""
    user, words = np.arange(100, 200, dtype=np.int64), [f"r{i}" for i in range(40)]
    winner_user = np.full((50, 16), 7.0, dtype=np.float32)  # the other writer got half
    winner_word = np.full((40, 8), 9.0, dtype=np.float32)  # and every word

    class RacingStore(EmbeddingStore):
        async def _write(self, parts: Any, *, add: bool) -> Any:
            if add:  # another writer creates some rows between our read and our add
                await store.set_many(
                    [
                        TableWrite("user", user[::2], winner_user),
                        TableWrite("word", words, winner_word),
                    ]
                )
            return await super()._write(parts, add=add)

    async with RacingStore(config) as racer:
        rows = await racer.lookup_many({"user": np.concatenate([user, user[:10]]), "word": words})
        assert racer.created == {"user": 50, "word": 0}  # as lookup counts them
    np.testing.assert_array_equal(rows["user"][0:100:2], winner_user)
    spec = config.table("user")
    fresh = initial_rows(spec.initializer, seed=spec.seed, ids=user[1::2], dim=16)
    np.testing.assert_array_equal(rows["user"][1:100:2], fresh)
    np.testing.assert_array_equal(rows["user"][100:], rows["user"][:10])
    np.testing.assert_array_equal(rows["word"], winner_word)


async def test_lookup_many_create_false_writes_nothing(
    store: EmbeddingStore, round_trips: RoundTrips
) -> None:
    rows = await store.lookup_many({"user": [1, 2], "item": [3], "word": ["a"]}, create=False)
    assert round_trips.total() <= len(store.nodes)  # the read only
    assert all(
        not r.startswith(b"ms") and b"\r\nms " not in r
        for s in round_trips.requests.values()
        for r in s
    )
    for table, ids in (("user", [1, 2]), ("item", [3]), ("word", ["a"])):
        spec = store.config.table(table)
        expected = initial_rows(spec.initializer, seed=spec.seed, ids=np.array(ids), dim=spec.dim)
        np.testing.assert_array_equal(rows[table], expected)
        _, found = await store.get(table, ids)
        assert not found.any()
    assert store.created == {}


async def test_concurrent_lookup_many_agree_and_create_each_row_once(config: ClusterConfig) -> None:
    rng = np.random.default_rng(11)
    ids = {
        "user": rng.integers(0, 3000, size=2000),
        "word": [f"c{i}" for i in rng.integers(0, 900, size=800)],
    }
    stores = [EmbeddingStore(config) for _ in range(4)]
    try:
        await stores[0].write_sentinels()
        results = await asyncio.gather(*(s.lookup_many(ids) for s in stores))
    finally:
        for s in stores:
            await s.close()
    for other in results[1:]:
        for table in ids:
            np.testing.assert_array_equal(other[table], results[0][table])
    for table, table_ids in ids.items():
        assert sum(s.created.get(table, 0) for s in stores) == len(
            set(np.asarray(table_ids).tolist())
        )


# ------------------------------------------------------------------ errors


async def test_bad_ids_and_tables_are_refused_before_anything_is_sent(
    store: EmbeddingStore, round_trips: RoundTrips
) -> None:
    zeros = np.zeros
    cases: list[tuple[type[Exception], str, Callable[[], Awaitable[object]]]] = [
        (KeyEncodingError, "table 'word' has id_type='string'",
         lambda: store.lookup_many({"user": [1, 2], "word": [3]})),
        (KeyEncodingError, "too long",
         lambda: store.lookup_many({"user": [1], "word": ["x" * 300]})),
        (KeyEncodingError, "float64",
         lambda: store.lookup_many({"user": [1], "item": np.array([1.5])})),
        (ConfigError, "unknown table 'nope'",
         lambda: store.lookup_many({"user": [1], "nope": [1]})),
        (KeyEncodingError, "table 'user' has id_type='int64'",
         lambda: store.get_many([TableRead("item", [1]), TableRead("user", ["a"])])),
        (KeyEncodingError, "too long",
         lambda: store.get_many(
             [TableRead("item", [1]), TableRead("word", ["y" * 240], slots=True)]
         )),
        (ValueError, "slots are read with rows",
         lambda: store.get_many(
             [TableRead("item", [1]), TableRead("_meta", ["a"], kind="m", width=2, slots=True)]
         )),
        (ValueError, "33 slot floats",
         lambda: store.set_many([TableWrite("item", [1], zeros((1, 64), np.float32)),
                                 TableWrite("user", [1], zeros((1, 16), np.float32),
                                            slots=zeros((1, 32), np.float32))])),
        (ValueError, "dim=16",
         lambda: store.set_many([TableWrite("item", [1], zeros((1, 64), np.float32)),
                                 TableWrite("user", [1], zeros((1, 8), np.float32))])),
        (ValueError, "duplicate",
         lambda: store.set_many([TableWrite("item", [1], zeros((1, 64), np.float32)),
                                 TableWrite("user", [1, 1], zeros((2, 16), np.float32))])),
        (ValueError, "two writes of table 'user' kind 'w'",
         lambda: store.add_many([TableWrite("user", [1], zeros((1, 16), np.float32)),
                                 TableWrite("user", [2], zeros((1, 16), np.float32))])),
        (ValueError, r"must be \(n, width\) with n=2",
         lambda: store.set_many([TableWrite("user", [1, 2], zeros((3, 16), np.float32))])),
    ]  # fmt: skip
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            await call()
        assert round_trips.total() == 0, match
    _, found = await store.get("item", [1])
    assert not found.any()  # nothing of a refused batch was written


async def test_wrong_length_value_is_corruption_naming_table_and_key(store: EmbeddingStore) -> None:
    await store.lookup_many({"user": [42], "item": [42]})
    key = encode_key(store.namespace, "item", "w", 42)
    node = store.nodes[int(node_of("item", np.array([42]), store.nodes)[0])]
    with raw_client(node) as client:
        client.set(key, b"\x00" * 10)
        with pytest.raises(
            CorruptValueError,
            match=rf"{key.decode()}.* of table 'item' on memcached node {node} has 10 bytes",
        ) as info:
            await store.lookup_many({"user": [1, 42, 2], "item": [7, 42], "word": ["new"]})
        assert info.value.node == node
        assert client.get(key) == b"\x00" * 10  # never overwritten with a fresh row
    found = [
        f
        for _, f in await store.get_many(
            [TableRead("user", [1, 2]), TableRead("item", [7]), TableRead("word", ["new"])]
        )
    ]
    assert not any(f.any() for f in found)  # the failed batch created nothing, on any table
    key = encode_key(store.namespace, "user", "w", 5)
    node = store.nodes[int(node_of("user", np.array([5]), store.nodes)[0])]
    with raw_client(node) as client:
        client.set(key, b"\x00" * 132)  # its 33 Adam slots alone: not a row
    with pytest.raises(CorruptValueError, match="of table 'user'.*132 bytes, expected 196"):
        await store.get_many([TableRead("item", [42 + 1]), TableRead("user", [5], slots=True)])


async def test_corruption_in_a_later_table_of_one_value_size_names_that_table(
    config: ClusterConfig,
) -> None:
    """Tables of one dim are one group of reads: the error still names the right key."""
    config = make_config(list(config.node_addresses), tables=MANY_TABLES[:6])
    ids = {f"C{i}": np.arange(50, dtype=np.int64) for i in range(6)}
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup_many(ids)
        key = encode_key(store.namespace, "C4", "w", 33)
        node = store.nodes[int(node_of("C4", np.array([33]), store.nodes)[0])]
        with raw_client(node) as client:
            client.set(key, b"\x00" * 8)
        with pytest.raises(CorruptValueError, match=rf"{key.decode()}' of table 'C4'.*8 bytes"):
            await store.lookup_many(ids)
        with pytest.raises(CorruptValueError, match=rf"{key.decode()}' of table 'C4'"):
            await store.get_many([TableRead(t, v) for t, v in ids.items()])


async def test_lost_node_raises_data_loss_and_nothing_is_created_anywhere(own_nodes: Any) -> None:
    config = make_config([s.address for s in own_nodes])
    user = _ids_on_every_node("user", config.node_addresses, 200)
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        before = await s.lookup_many({"user": user, "word": ["a", "b", "c"]})
        lost, kept = own_nodes[1], own_nodes[0]
        lost.restart_empty()
        items_kept = node_stat(kept.address, "curr_items")
        with pytest.raises(DataLossError, match=lost.address) as info:
            await s.lookup_many({"user": np.concatenate([user, user + 10_000]), "word": ["d", "e"]})
        assert info.value.nodes == (lost.address,)
        assert "reinit --yes" in str(info.value)
        assert node_stat(lost.address, "curr_items") == 0  # nothing re-created there
        assert node_stat(kept.address, "curr_items") == items_kept  # nor on the kept node
        for call in (
            lambda: s.lookup_many({"user": user}, create=False),
            lambda: s.get_many([TableRead("user", user), TableRead("user", user, slots=True)]),
            lambda: s.set_many([TableWrite("user", user, before["user"])]),
        ):
            with pytest.raises(DataLossError, match=lost.address):
                await call()


async def test_peek_reads_every_sentinel_and_the_blobs_in_one_round_trip_per_node(
    own_nodes: Any, round_trips: RoundTrips
) -> None:
    """A push's bookkeeping reads ride on the sentinel reads: each node's sentinel, then
    the keys it holds. A node that lost its data fails the peek only if it holds keys."""
    config = make_config([s.address for s in own_nodes])
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        ids = _ids_on_every_node("_meta", s.nodes, 12)
        await s.set_blobs("_meta", ids[:8], [b"v%d" % i for i in range(8)], kind="p")
        await s.set_blobs("_dense", ["current"], [b"pointer"], kind="m")
        sentinels = await s.sentinels()
        round_trips.clear()
        got, blobs = await s.peek([("_meta", ids, "p"), ("_dense", ["current"], "m")])
        assert round_trips.per_node() == dict.fromkeys(s.nodes, 1)
        assert all(r.startswith(b"mg " + s._sentinel_key) for r in round_trips.requests[s.nodes[0]])
        assert got == sentinels and all(got.values())
        assert blobs == [[b"v%d" % i for i in range(8)] + [None] * 4, [b"pointer"]]
        assert await s.peek([]) == (sentinels, [])

        lost = own_nodes[1]
        lost.restart_empty()
        placed = node_of("_meta", ids, s.nodes)
        kept_only = ids[placed == 0]
        got, (blobs,) = await s.peek([("_meta", kept_only, "p")])  # reported, not raised
        assert got[lost.address] is None and got[own_nodes[0].address] == sentinels[s.nodes[0]]
        assert blobs == [b"v%d" % i if i < 8 else None for i in np.flatnonzero(placed == 0)]
        with pytest.raises(DataLossError, match=lost.address) as info:
            await s.peek([("_meta", ids, "p")])
        assert info.value.nodes == (lost.address,)


async def test_full_node_raises_store_full_naming_it() -> None:
    server = start_memcached(memory_mb=2)
    try:
        tables = [{"name": "big", "dim": 200}, {"name": "small", "dim": 4}]
        config = make_config([server.address], tables=tables)
        async with EmbeddingStore(config) as s:
            await s.write_sentinels()
            first = await s.lookup_many({"big": np.arange(100), "small": np.arange(100)})
            with pytest.raises(StoreFullError, match=rf"{server.address} is out of memory") as info:
                for start in range(100, 200_000, 5000):
                    block = np.arange(start, start + 5000, dtype=np.int64)
                    await s.lookup_many({"small": block, "big": block})
            assert info.value.node == server.address
            again = await s.lookup_many(
                {"big": np.arange(100), "small": np.arange(100)}, create=False
            )
            for table in first:
                np.testing.assert_array_equal(again[table], first[table])
    finally:
        server.stop()


async def test_full_node_refuses_an_overwrite_batch_naming_it() -> None:
    """Overwrites are sent quiet (only failures answer): a full node's refusal still
    fails the batch with StoreFullError naming the node, and the values it had stay."""
    server = start_memcached(memory_mb=2)
    try:
        config = make_config([server.address], tables=[{"name": "big", "dim": 200}])
        async with EmbeddingStore(config) as s:
            await s.write_sentinels()
            ids = np.arange(100, dtype=np.int64)
            first = await s.lookup_many({"big": ids})
            rows = np.ones((5000, 200), dtype=np.float32)
            with pytest.raises(StoreFullError, match=rf"{server.address} is out of memory") as info:
                for start in range(1000, 200_000, 5000):
                    block = np.arange(start, start + 5000, dtype=np.int64)
                    await s.set_many([TableWrite("big", block, rows)])
            assert info.value.node == server.address
            assert "one of 5000 keys" in str(info.value)
            again = await s.lookup_many({"big": ids}, create=False)
            np.testing.assert_array_equal(again["big"], first["big"])
    finally:
        server.stop()


async def test_stopped_node_times_out_naming_it(own_nodes: Any) -> None:
    config = make_config([s.address for s in own_nodes], store={"timeout_s": 0.5})
    user = _ids_on_every_node("user", config.node_addresses, 100)
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        rows = await s.lookup_many({"user": user, "item": user})
        stopped = own_nodes[0]
        sigstop(stopped.pid)
        try:
            for call in (
                lambda: s.lookup_many({"user": user, "item": user}),
                lambda: s.get_many([TableRead("user", user), TableRead("item", user)]),
                lambda: s.set_many([TableWrite("user", user, rows["user"])]),
            ):
                t0 = time.monotonic()
                with pytest.raises(StoreTimeoutError, match=rf"{stopped.address}.*0.5 s"):
                    await call()
                assert time.monotonic() - t0 < 3
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        again = await s.lookup_many({"user": user, "item": user})
        for table in rows:
            np.testing.assert_array_equal(again[table], rows[table])


@given(
    st.lists(st.sampled_from(["user", "item", "word"]), min_size=1, max_size=5),
    st.integers(min_value=1, max_value=4),
    st.data(),
)
def test_placing_many_tables_at_once_equals_one_at_a_time(
    tables: list[str], n_nodes: int, data: st.DataObject
) -> None:
    """`_place_many` (one numpy pass for every int table) encodes and places each table's
    ids as `node_of` and `id_bodies` do table by table: each node's positions ascending."""
    config = make_config([f"127.0.0.1:{20000 + i}" for i in range(n_nodes)])
    store = EmbeddingStore(config)  # nothing is sent: placement only
    items = []
    for table in tables:
        if config.table(table).id_type == "string":
            ids: Any = np.array(data.draw(st.lists(st.text(max_size=5), max_size=8)), dtype=object)
        else:
            ids = np.array(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30)))
            ids = ids.astype(np.int64)
        items.append((table, ids))
    for (table, ids), many in zip(items, store._placement.place_many(items), strict=True):
        where = node_of(table, ids, store.nodes)
        expected = [np.flatnonzero(where == j) for j in range(n_nodes)]
        assert many.table == table and many.ids is ids
        assert len(many.by_node) == n_nodes
        for a, b in zip(many.by_node, expected, strict=True):
            np.testing.assert_array_equal(a, b)
        one = id_bodies(table, ids).bodies
        if isinstance(one, np.ndarray):
            np.testing.assert_array_equal(many.bodies.bodies, one)
        else:
            assert many.bodies.bodies == one
