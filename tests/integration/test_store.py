"""EmbeddingStore against real memcached processes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time

import numpy as np
import pytest

from lookup_table import (
    ClusterNotInitializedError,
    ConfigError,
    CorruptValueError,
    DataLossError,
    EmbeddingStore,
    KeyEncodingError,
    NodeUnavailableError,
    StorageFormatError,
    StoreFullError,
    StoreTimeoutError,
    encode_key,
    initial_rows,
)
from lookup_table.core.keyspace import sentinel_key
from lookup_table.core.sharding import node_of
from lookup_table.ops.admin import init_cluster
from lookup_table.ops.localcluster import free_port, start_memcached
from tests.conftest import make_config, node_stat, raw_client, sigstop

pytestmark = pytest.mark.integration


async def test_lookup_creates_initial_rows_in_order(store: EmbeddingStore) -> None:
    spec = store.config.table("user")
    ids = np.array([5, -3, 2**62, 5, 0, -(2**63)], dtype=np.int64)
    rows = await store.lookup("user", ids)
    assert rows.dtype == np.float32 and rows.shape == (6, 16)
    expected = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=16)
    np.testing.assert_array_equal(rows, expected)
    np.testing.assert_array_equal(rows[0], rows[3])
    # The rows are really stored, as dim little-endian float32 followed by the optimizer's
    # initial slots in the same item (Adam: m, v and the step, zeros).
    key = encode_key(store.namespace, "user", "w", -3)
    node = store.nodes[int(node_of("user", np.array([-3]), store.nodes)[0])]
    with raw_client(node) as client:
        raw = client.get(key)
    assert raw == expected[1].astype("<f4").tobytes() + bytes(4 * (2 * 16 + 1))


async def test_each_unique_id_is_fetched_once(store: EmbeddingStore) -> None:
    ids = np.array([1, 2, 3] * 100, dtype=np.int64)
    await store.lookup("user", ids)
    before = sum(node_stat(n, "cmd_get") for n in store.nodes)
    await store.lookup("user", ids)
    after = sum(node_stat(n, "cmd_get") for n in store.nodes)
    touched = len(set(node_of("user", np.array([1, 2, 3]), store.nodes).tolist()))
    assert after - before == 3 + touched  # three rows + one sentinel per node touched


async def test_lookup_reads_what_was_set(store: EmbeddingStore) -> None:
    ids = np.arange(1000, dtype=np.int64) * 7919
    await store.lookup("user", ids)
    new = np.random.default_rng(0).standard_normal((1000, 16)).astype(np.float32)
    await store.set("user", ids, new)
    order = np.random.default_rng(1).permutation(1000)
    np.testing.assert_array_equal(await store.lookup("user", ids[order]), new[order])


async def test_create_false_writes_nothing(store: EmbeddingStore) -> None:
    spec = store.config.table("item")
    ids = np.array([11, 12, 13], dtype=np.int64)
    rows = await store.lookup("item", ids, create=False)
    np.testing.assert_array_equal(
        rows, initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=64)
    )
    _, found = await store.get("item", ids)
    assert not found.any()


async def test_lost_add_race_rereads_the_winner(config, store: EmbeddingStore, in_order) -> None:
    """A trainer whose `add` loses to another writer returns the winner's row; the rows it
    did create, and the existing ones, come back in the ids' order with duplicates."""
    spec = config.table("user")
    ids = np.arange(100, 200, dtype=np.int64)
    old = ids[:20]
    stored = np.random.default_rng(5).standard_normal((20, 16)).astype(np.float32)
    await store.set("user", old, stored)
    won = ids[20::2]  # another writer creates half of the new rows between read and add
    winner = np.full((won.shape[0], 16), 7.0, dtype=np.float32)

    class RacingStore(EmbeddingStore):
        async def add(self, table, ids, values, *, kind="w", unique=False):  # type: ignore[no-untyped-def]
            await store.set(table, won, winner)  # another writer gets there first
            return await super().add(table, ids, values, kind=kind, unique=unique)

    asked = np.random.default_rng(6).permutation(np.concatenate([ids, ids[::3]]))
    async with RacingStore(config) as racer:
        rows = await racer.lookup("user", asked)
        assert racer.created == {"user": 40}
    expected = {int(i): r for i, r in zip(old, stored, strict=True)}
    expected |= {int(i): r for i, r in zip(won, winner, strict=True)}
    mine = ids[21::2]
    fresh = initial_rows(spec.initializer, seed=spec.seed, ids=mine, dim=16)
    expected |= {int(i): r for i, r in zip(mine, fresh, strict=True)}
    np.testing.assert_array_equal(rows, np.stack([expected[int(i)] for i in asked]))
    np.testing.assert_array_equal(await store.lookup("user", asked, create=False), rows)


async def test_concurrent_trainers_agree(config, store: EmbeddingStore) -> None:
    ids = np.random.default_rng(2).integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)
    stores = [EmbeddingStore(config) for _ in range(4)]
    try:
        results = await asyncio.gather(*(s.lookup("user", ids) for s in stores))
    finally:
        for s in stores:
            await s.close()
    for rows in results[1:]:
        np.testing.assert_array_equal(rows, results[0])
    np.testing.assert_array_equal(await store.lookup("user", ids), results[0])


async def test_string_ids(store: EmbeddingStore) -> None:
    ids = ["banana", "a b", "x/y", "line\r\nbreak", "tab\tand\x00nul", "ü🍌", "", "7", "banana"]
    rows = await store.lookup("word", ids)
    assert rows.shape == (9, 8)
    np.testing.assert_array_equal(rows[0], rows[8])
    assert len({rows[i].tobytes() for i in range(8)}) == 8
    np.testing.assert_array_equal(await store.lookup("word", ids), rows)
    # bytes ids (what a tf.string tensor gives) are the same ids
    np.testing.assert_array_equal(await store.lookup("word", [b"banana"]), rows[:1])


async def test_bad_ids_and_tables(store: EmbeddingStore) -> None:
    with pytest.raises(KeyEncodingError, match="id_type='int64'"):
        await store.lookup("user", ["a"])
    with pytest.raises(KeyEncodingError, match="id_type='string'"):
        await store.lookup("word", [1, 2])
    with pytest.raises(KeyEncodingError, match="float64"):
        await store.lookup("user", np.array([1.5]))
    with pytest.raises(KeyEncodingError, match="too long"):
        await store.lookup("word", ["x" * 300])
    with pytest.raises(ConfigError, match="unknown table 'nope'"):
        await store.lookup("nope", [1])
    with pytest.raises(ValueError, match="dim=16"):
        await store.set("user", [1], np.zeros((1, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="duplicate"):
        await store.set("user", [1, 1], np.zeros((2, 16), dtype=np.float32))
    assert (await store.lookup("user", [])).shape == (0, 16)


async def test_slots_and_blobs(store: EmbeddingStore) -> None:
    ids = np.array([4, 5, 6], dtype=np.int64)
    rows = -np.arange(3 * 16, dtype=np.float32).reshape(3, 16)
    slots = np.arange(3 * 33, dtype=np.float32).reshape(3, 33)
    await store.set("user", ids, rows, slots=slots)
    values, found = await store.get("user", [6, 4, 99], slots=True)
    assert values.shape == (3, 16 + 33)
    assert found.tolist() == [True, True, False]
    np.testing.assert_array_equal(values[:2, :16], rows[[2, 0]])
    np.testing.assert_array_equal(values[:2, 16:], slots[[2, 0]])
    np.testing.assert_array_equal(values[2], 0)
    only_rows, _ = await store.get("user", [6, 4])
    np.testing.assert_array_equal(only_rows, rows[[2, 0]])
    # a row and its slots are one item: there is nothing to write or read of slots alone
    with pytest.raises(ValueError, match="33 slot floats"):
        await store.set("user", ids, rows, slots=slots[:, :16])
    with pytest.raises(ValueError, match="slots are stored with rows"):
        await store.set("_dense", ["a"], rows[:1], kind="d", slots=slots[:1])
    with pytest.raises(ValueError, match="width=33"):
        await store.get("user", ids, width=33)

    blobs = [b"", b"x" * 100_000, bytes(range(256))]
    await store.set_blobs("_dense", ["a", "b", "c"], blobs, kind="d")
    assert await store.get_blobs("_dense", ["c", "missing", "a", "b"], kind="d") == [
        blobs[2],
        None,
        b"",
        blobs[1],
    ]


async def test_wrong_length_value_is_corruption_not_a_miss(store: EmbeddingStore) -> None:
    await store.lookup("user", [42])
    key = encode_key(store.namespace, "user", "w", 42)
    node = store.nodes[int(node_of("user", np.array([42]), store.nodes)[0])]
    with raw_client(node) as client:
        client.set(key, b"\x00" * 10, noreply=False)  # stored before the lookup reads it
        with pytest.raises(CorruptValueError, match=rf"{key.decode()}.*{node}.*10 bytes"):
            await store.lookup("user", [1, 42, 2])
        assert client.get(key) == b"\x00" * 10  # never overwritten with a fresh row
    _, found = await store.get("user", [1, 2])
    assert not found.any()  # the failed batch created none of its rows
    # a row without its slots (as storage format 1 kept it), or a table whose optimizer
    # changed: the message says what the value should hold
    key = encode_key(store.namespace, "user", "w", 7)
    node = store.nodes[int(node_of("user", np.array([7]), store.nodes)[0])]
    with raw_client(node) as client:
        client.set(key, b"\x00" * 64, noreply=False)
    expected = r"64 bytes, expected 196 \(its dim 16 and 33 slot floats of its 'adam' optimizer"
    with pytest.raises(CorruptValueError, match=expected):
        await store.get("user", [7])


async def test_small_batches_give_the_same_rows(config, store: EmbeddingStore) -> None:
    ids = np.arange(3000, dtype=np.int64) * 31
    rows = await store.lookup("user", ids)
    small = dataclasses.replace(config, store=dataclasses.replace(config.store, max_batch_keys=7))
    async with EmbeddingStore(small) as s:
        np.testing.assert_array_equal(await s.lookup("user", ids), rows)


async def test_not_initialized(config) -> None:
    async with EmbeddingStore(config) as s:
        with pytest.raises(ClusterNotInitializedError, match="lookup-table-admin init"):
            await s.lookup("user", [1, 2, 3])
        assert all(v is None for v in (await s.sentinels()).values())


@pytest.mark.parametrize("old_format", [1, 2])
async def test_a_namespace_of_an_older_storage_format_is_refused_before_anything_is_sent(
    config, old_format: int
) -> None:
    """Format 1 (rows and slots as separate items) and format 2 (int ids in keys as 16 hex
    digits) are read by no batch of this version: its rows would be corrupt (no slots) or
    missing (re-created under other keys). The sentinel says which."""
    fields = {"namespace": config.namespace, "node": "x", "created": 1.0}
    if old_format > 1:  # format 1 wrote no "format" field
        fields["format"] = old_format
    old = json.dumps(fields).encode()
    for node in config.node_addresses:
        with raw_client(node) as client:
            client.set(sentinel_key(config.namespace), old, noreply=False)
    async with EmbeddingStore(config) as s:
        for call in (
            s.lookup("user", [1, 2, 3]),
            s.lookup("user", [1], create=False),
            s.set("user", [4], np.zeros((1, 16), np.float32)),
            s.get_blobs("_meta", ["x"], kind="m"),
        ):
            with pytest.raises(StorageFormatError, match=f"storage format {old_format}") as info:
                await call
            assert "lookup-table-checkpoint restore --force" in str(info.value)
        with pytest.raises(StorageFormatError, match=f"storage format {old_format}"):
            await init_cluster(config)
    for node in config.node_addresses:
        with raw_client(node) as client:
            for id_ in (1, 2, 3, 4):
                assert client.get(encode_key(config.namespace, "user", "w", id_)) is None
            assert client.get(sentinel_key(config.namespace)) == old  # left as it was
    for node in config.node_addresses:
        with raw_client(node) as client:
            client.set(sentinel_key(config.namespace), b"not json", noreply=False)
    async with EmbeddingStore(config) as s:
        with pytest.raises(StorageFormatError, match="cannot read"):
            await s.lookup("user", [1])


async def test_a_sentinel_written_in_the_second_of_a_flush_all_shows_once_it_is_over(
    own_nodes,
) -> None:
    """Nodes without CAS (-C) hide what is written in the second of a `flush_all` (the
    flush's time is whole seconds): a reinit right after one must not leave its nodes
    looking as if they lost their data."""
    config = make_config([s.address for s in own_nodes])
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        for node in config.node_addresses:
            with raw_client(node) as client:
                client.flush_all(noreply=False)
        assert all(v is None for v in (await s.sentinels()).values())
        assert await s.write_sentinels() == dict.fromkeys(config.node_addresses, True)
        assert all(v is not None for v in (await s.sentinels()).values())
        await s.lookup("user", [1, 2, 3])  # no DataLossError


async def test_restarted_node_raises_data_loss_and_creates_nothing(own_nodes) -> None:
    config = make_config([s.address for s in own_nodes])
    ids = np.arange(2000, dtype=np.int64)
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        before = await s.lookup("user", ids)
        lost = own_nodes[1]
        lost.restart_empty()
        with pytest.raises(DataLossError, match=lost.address) as info:
            await s.lookup("user", ids)
        assert info.value.nodes == (lost.address,)
        assert "reinit --yes" in str(info.value)
        assert node_stat(lost.address, "curr_items") == 0  # nothing re-created there
        with pytest.raises(DataLossError):
            await s.lookup("user", ids, create=False)
        # The surviving node still serves its rows only through an explicit decision:
        await s.write_sentinels([lost.address])
        after = await s.lookup("user", ids)
    on_kept = node_of("user", ids, config.node_addresses) == 0
    np.testing.assert_array_equal(after[on_kept], before[on_kept])


async def test_full_node_raises_store_full(tmp_path) -> None:
    server = start_memcached(memory_mb=2)
    try:
        config = make_config([server.address], tables=[{"name": "big", "dim": 200}])
        async with EmbeddingStore(config) as s:
            await s.write_sentinels()
            first = await s.lookup("big", np.arange(100, dtype=np.int64))
            with pytest.raises(StoreFullError, match=rf"{server.address}.*out of memory"):
                for start in range(100, 200_000, 5000):
                    await s.lookup("big", np.arange(start, start + 5000, dtype=np.int64))
            np.testing.assert_array_equal(
                await s.lookup("big", np.arange(100, dtype=np.int64), create=False), first
            )
    finally:
        server.stop()


async def test_stopped_node_times_out_naming_it(own_nodes) -> None:
    config = make_config([s.address for s in own_nodes], store={"timeout_s": 0.5})
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        rows = await s.lookup("user", np.arange(100, dtype=np.int64))
        stopped = own_nodes[0]
        sigstop(stopped.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreTimeoutError, match=rf"{stopped.address}.*0.5 s"):
                await s.lookup("user", np.arange(100, dtype=np.int64))
            assert time.monotonic() - t0 < 3
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        np.testing.assert_array_equal(await s.lookup("user", np.arange(100, dtype=np.int64)), rows)


async def test_calls_queued_behind_a_stopped_node_fail_within_two_timeouts(own_nodes) -> None:
    """6 concurrent batches on one pooled connection to a stopped node: each fails within
    2 x timeout_s (its wait for the connection, then its own round trip), not after one
    timeout per batch queued in front of it (6 x 0.5 s)."""
    config = make_config([own_nodes[0].address], store={"timeout_s": 0.5, "pool_size": 1})
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        await s.lookup("user", np.arange(10, dtype=np.int64))
        stopped = own_nodes[0]
        sigstop(stopped.pid)
        try:

            async def one(i: int) -> float:
                t0 = time.monotonic()
                with pytest.raises(StoreTimeoutError, match=stopped.address):
                    await s.lookup("user", np.arange(i, i + 10, dtype=np.int64))
                return time.monotonic() - t0

            took = await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        assert max(took) < 2.0, took  # one timeout per queued batch would be 6 x 0.5 = 3 s
        await s.lookup("user", np.arange(10, dtype=np.int64))  # the pool recovers


async def test_unreachable_node_names_it() -> None:
    address = f"127.0.0.1:{free_port()}"
    config = make_config([address])
    async with EmbeddingStore(config) as s:
        with pytest.raises(NodeUnavailableError, match=rf"{address} is unreachable"):
            await s.lookup("user", [1])


async def test_cancel_mid_read_never_corrupts_the_next_read(store: EmbeddingStore) -> None:
    """A cancelled batch must not leave a half-read reply for the next one (aiomcache#489)."""
    ids = np.arange(60_000, dtype=np.int64)
    expected = await store.lookup("user", ids)
    for delay in (0.0005, 0.002, 0.005, 0.01):
        task = asyncio.create_task(store.lookup("user", ids))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        small = await store.lookup("user", ids[:10])
        np.testing.assert_array_equal(small, expected[:10])
    np.testing.assert_array_equal(await store.lookup("user", ids), expected)
