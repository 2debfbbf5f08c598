"""Dense parameters in the service: served from replica 0's memory, written behind.

Each update writes its gradients' log; a generation is written every
`service.dense_flush_pushes` updates (or `dense_flush_s` seconds, or at a pause); a
restarted replica rebuilds what was not flushed from the logs of the journaled pushes.

Real memcached and the real aiohttp app. Failures are simulated by replacing one step
of the updater (as `test_service.py` does for `items.write`), never memcached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from numpy.typing import NDArray
from prometheus_client import CollectorRegistry

from lookup_table import EmbeddingStore
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig
from lookup_table.core.keyspace import (
    DENSE_TABLE,
    META_TABLE,
    Kind,
    dense_chunk_id,
    dense_log_id,
    version_id,
)
from lookup_table.core.optimizers import make_optimizer
from lookup_table.dense import DenseParams, DenseState
from lookup_table.errors import ReplicaUnavailableError, StoreFullError
from lookup_table.ops.admin import reinit_cluster
from lookup_table.ops.localcluster import MemcachedProcess
from optimizer_service.app import STORE, UPDATER, make_app
from optimizer_service.engine.dense import DenseReplica
from optimizer_service.engine.journal import Journal
from optimizer_service.engine.plan import WritePlan
from optimizer_service.engine.updater import Updater
from tests.conftest import SERVICE_TABLES, make_config
from tests.reliability.harness import memcache_client

pytestmark = pytest.mark.integration

Params = dict[str, NDArray[np.float32]]

# big enough for several 512 KiB chunks with the slots (Adam: 2 floats + 1 per parameter)
INIT: Params = {
    "kernel": np.linspace(-1, 1, 300 * 400, dtype=np.float32).reshape(300, 400),
    "bias": np.full(400, 0.1, np.float32),
}


def _grads(seed: int) -> Params:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in INIT.items()}


def _config(
    nodes: list[str], *, flush_pushes: int = 20, flush_s: float = 60.0, **service: Any
) -> ClusterConfig:
    return make_config(
        nodes,
        tables=SERVICE_TABLES,
        optimizers=["http://127.0.0.1:1"],
        service={"dense_flush_pushes": flush_pushes, "dense_flush_s": flush_s, **service},
    )


async def _serve(config: ClusterConfig, aiohttp_server: Any) -> tuple[ClusterConfig, TestServer]:
    """Replica 0 on `config`'s nodes (recovery runs before it serves)."""
    async with EmbeddingStore(config) as store:
        if any(v is None for v in (await store.sentinels()).values()):
            await store.write_sentinels()
    server: TestServer = await aiohttp_server(
        make_app(config, replica=0, registry=CollectorRegistry())
    )
    url = str(server.make_url("")).rstrip("/")
    return dataclasses.replace(config, optimizers=(url,)), server


def _adam_steps(
    config: ClusterConfig, params: Mapping[str, NDArray[np.float32]], *grads: Params
) -> tuple[Params, Params]:
    """The optimizer's math applied to `params` (fresh slots), one step per gradient."""
    adam = make_optimizer(config.optimizer)
    values = {n: np.asarray(v, np.float32) for n, v in params.items()}
    slots = {n: adam.initial_slots(1, v.size) for n, v in values.items()}
    return _adam_from(config, values, slots, *grads)


def _adam_from(
    config: ClusterConfig,
    params: Mapping[str, NDArray[np.float32]],
    slots: Mapping[str, NDArray[np.float32]],
    *grads: Params,
) -> tuple[Params, Params]:
    adam = make_optimizer(config.optimizer)
    values, state = dict(params), dict(slots)
    for grad in grads:
        for n, g in grad.items():
            row, state[n] = adam.update(values[n].reshape(1, -1), g.reshape(1, -1), state[n])
            values[n] = row.reshape(values[n].shape)
    return values, state


def _assert_params(got: Mapping[str, NDArray[np.float32]], want: Params) -> None:
    assert set(got) == set(want)
    for n, v in want.items():
        np.testing.assert_array_equal(got[n], v, err_msg=n)


async def _stored(config: ClusterConfig) -> DenseState | None:
    """The dense parameters as memcached holds them (a fresh reader, no memory)."""
    async with EmbeddingStore(config) as store:
        return await DenseParams(store, make_optimizer(config.optimizer)).read(with_slots=True)


async def _chunks_present(config: ClusterConfig, meta: Mapping[str, Any]) -> int:
    """How many of the chunks of generation `meta` exist in memcached."""
    gen = meta["generation"]
    ids = [dense_chunk_id(gen, n, i) for n, p in meta["params"].items() for i in range(p["chunks"])]
    sids = [dense_chunk_id(gen, n, i) for n, k in meta["slots"].items() for i in range(k)]
    async with EmbeddingStore(config) as store:
        values = await store.get_blobs(DENSE_TABLE, ids, kind=Kind.DENSE)
        slots = await store.get_blobs(DENSE_TABLE, sids, kind=Kind.DENSE_SLOTS)
    return sum(v is not None for v in values + slots)


async def _logs_present(config: ClusterConfig, versions: range) -> list[int]:
    """The versions among `versions` whose dense log (its index) is in memcached."""
    async with EmbeddingStore(config) as store:
        got = await store.get_blobs(
            DENSE_TABLE, [dense_log_id(v) for v in versions], kind=Kind.DENSE_LOG
        )
    return [v for v, raw in zip(versions, got, strict=True) if raw is not None]


async def _flushed(server: TestServer) -> None:
    """Wait for the replica's background flush of the dense parameters, if one runs."""
    task = server.app[UPDATER].dense_flushes.flushing
    if task is not None:
        async with asyncio.timeout(10):
            await task


async def _die(server: TestServer) -> None:
    """Stop replica 0 as a crash would: nothing more is flushed."""

    async def no_flush() -> bool:
        return False

    updater = server.app[UPDATER]
    await _flushed(server)
    updater.dense.flush = no_flush  # type: ignore[method-assign]
    for task in list(updater.state.finishers):
        task.cancel()  # the dead process's background replay never runs
    await server.close()


class _Recorder:
    """Counts the store calls of a running replica by kind (the calls still run)."""

    def __init__(self, store: EmbeddingStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int]] = []
        self.written: dict[str, int] = {}
        get_blobs, set_blobs, peek = store.get_blobs, store.set_blobs, store.peek

        async def counted_get(table: str, ids: Any, *, kind: str) -> list[bytes | None]:
            self.reads.append((kind, len(ids)))
            return await get_blobs(table, ids, kind=kind)

        async def counted_peek(reads: Any) -> Any:  # a push's bookkeeping reads
            self.reads += [(kind, len(ids)) for _, ids, kind in reads]
            return await peek(reads)

        async def counted_set(table: str, ids: Any, values: Any, **kw: Any) -> Any:
            kind = kw["kind"]
            self.written[kind] = self.written.get(kind, 0) + sum(len(v) for v in values)
            return await set_blobs(table, ids, values, **kw)

        monkeypatch.setattr(store, "get_blobs", counted_get)
        monkeypatch.setattr(store, "set_blobs", counted_set)
        monkeypatch.setattr(store, "peek", counted_peek)

    def clear(self) -> None:
        self.reads.clear()
        self.written.clear()

    def dense_reads(self) -> list[tuple[str, int]]:
        return [r for r in self.reads if r[0] in (Kind.DENSE, Kind.DENSE_SLOTS)]


async def test_pushes_write_logs_and_every_kth_update_a_generation(
    memcached_nodes: list[str], aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each dense push writes its gradients' log (not the parameters) and reads only the
    `current` pointer; GET /v1/dense answers from memory. The third update (K = 3) is
    flushed: a generation at version 3, the logs it covers and the old generation gone.
    A pause flushes the rest, so a checkpoint sees the parameters the trainers see."""
    config, server = await _serve(_config(memcached_nodes, flush_pushes=3), aiohttp_server)
    recorder = _Recorder(server.app[STORE], monkeypatch)
    grads = [_grads(i) for i in range(1, 6)]
    grad_bytes = sum(v.nbytes for v in INIT.values())
    async with OptimizerClient(config) as client:
        await client.dense_init(INIT)
        first = await _stored(config)
        assert first is not None
        for i, grad in enumerate(grads[:2], start=1):
            recorder.clear()
            result = await client.push({}, dense=grad)
            assert result["version"] == i
            # the push read the `current` pointer (one small get), not the generation
            assert recorder.dense_reads() == []
            assert recorder.reads.count((Kind.META, 1)) >= 1
            assert 0 < recorder.written[Kind.JOURNAL] < 4096  # no values in the journal
            assert Kind.DENSE not in recorder.written and Kind.DENSE_SLOTS not in recorder.written
            assert grad_bytes < recorder.written[Kind.DENSE_LOG] < grad_bytes + 4096

            recorder.clear()
            version, params = await client.dense()
            assert version == i
            _assert_params(params, _adam_steps(config, INIT, *grads[:i])[0])
            assert recorder.reads == [(Kind.META, 1)]  # the pointer only
        stored = await _stored(config)
        assert stored is not None and stored.version == 0  # behind: not flushed yet
        assert await _logs_present(config, range(1, 6)) == [1, 2]

        await client.push({}, dense=grads[2])
        await _flushed(server)
        stored = await _stored(config)
        assert stored is not None and stored.version == 3
        want, want_slots = _adam_steps(config, INIT, *grads[:3])
        _assert_params(stored.params, want)
        _assert_params(stored.slots, want_slots)
        assert await _logs_present(config, range(1, 6)) == []
        assert await _chunks_present(config, first.meta) == 0

        await client.push({}, dense=grads[3])
        await client.push({}, dense=grads[4])
        assert await _logs_present(config, range(1, 6)) == [4, 5]
        await client.pause(timeout_s=30)
        stored = await _stored(config)
        assert stored is not None and stored.version == 5
        want, want_slots = _adam_steps(config, INIT, *grads)
        _assert_params(stored.params, want)
        _assert_params(stored.slots, want_slots)
        assert await _logs_present(config, range(1, 6)) == []
        await client.resume()
        version, params = await client.dense()
    assert version == 5
    _assert_params(params, want)


async def test_a_replica_killed_before_a_flush_rebuilds_the_updates_from_their_logs(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """Five updates, none flushed, then the replica dies: the next one rebuilds the
    parameters and slots exactly (Adam's step count included) from the generation and
    the five logs, stores them, and trains on from there."""
    config, server = await _serve(_config(memcached_nodes), aiohttp_server)
    grads = [_grads(i) for i in range(1, 7)]
    async with OptimizerClient(config) as client:
        await client.dense_init(INIT)
        for grad in grads[:5]:
            await client.push({}, dense=grad)
    await _die(server)
    stored = await _stored(config)
    assert stored is not None and stored.version == 0
    assert await _logs_present(config, range(1, 7)) == [1, 2, 3, 4, 5]

    config, server = await _serve(config, aiohttp_server)  # recovery runs before serving
    want, want_slots = _adam_steps(config, INIT, *grads[:5])
    stored = await _stored(config)
    assert stored is not None and stored.version == 5
    _assert_params(stored.params, want)
    _assert_params(stored.slots, want_slots)
    assert await _logs_present(config, range(1, 7)) == []
    assert server.app[UPDATER].version == 5
    async with OptimizerClient(config) as client:
        result = await client.push({}, dense=grads[5])
        assert result["version"] == 6
        version, params = await client.dense()
    assert version == 6
    _assert_params(params, _adam_steps(config, INIT, *grads)[0])


@pytest.mark.parametrize("row_flush_pushes", [1, 20], ids=["rows-through", "rows-behind"])
async def test_a_log_without_a_journaled_push_does_not_count(
    memcached_nodes: list[str],
    aiohttp_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    row_flush_pushes: int,
) -> None:
    """Push A writes its log, then its journal header fails: A is not applied. B takes
    the same version and writes its own log over A's. After a crash the next replica
    rebuilds B's update, never A's. (Rows written through end a push's journal with
    `write_end`; written behind, the journal of values is one `write`.)"""
    config = _config(memcached_nodes, row_flush_pushes=row_flush_pushes)
    config, server = await _serve(config, aiohttp_server)
    updater = server.app[UPDATER]
    a, b = _grads(1), _grads(2)
    method = "write_end" if row_flush_pushes == 1 else "write"
    real = getattr(updater.journal, method)

    async def failing_end(*args: Any, **kw: Any) -> None:
        monkeypatch.setattr(updater.journal, method, real)  # fails once
        raise StoreFullError("memcached node 127.0.0.1:9 is out of memory (simulated)")

    async with OptimizerClient(config, max_retries=0) as client:
        await client.dense_init(INIT)
        monkeypatch.setattr(updater.journal, method, failing_end)
        with pytest.raises(StoreFullError, match="simulated"):
            await client.push({}, dense=a)
        assert await _logs_present(config, range(1, 3)) == [1]  # A's log, not counted
        version, params = await client.dense()
        assert version == 0
        _assert_params(params, INIT)
        result = await client.push({}, dense=b)
        assert result["applied"] and result["version"] == 1
    await _die(server)

    config, server = await _serve(config, aiohttp_server)
    stored = await _stored(config)
    assert stored is not None and stored.version == 1
    _assert_params(stored.params, _adam_steps(config, INIT, b)[0])


async def test_a_missing_log_of_a_journaled_update_stops_the_replica_with_a_clear_error(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """The log of an update that was applied is gone (deleted by hand here; a node that
    lost its data is caught by its sentinel first): replica 0 refuses to start, naming
    the version and what to do, and writes nothing."""
    config, server = await _serve(_config(memcached_nodes), aiohttp_server)
    async with OptimizerClient(config) as client:
        await client.dense_init(INIT)
        for i in range(1, 4):
            await client.push({}, dense=_grads(i))
    await _die(server)
    async with EmbeddingStore(config) as store:
        await store.delete_blobs(DENSE_TABLE, [dense_log_id(2)], kind=Kind.DENSE_LOG)
        updater = Updater(config, store, replica=0)
        with pytest.raises(RuntimeError, match=r"dense update to version 2 is missing.*restore"):
            await updater.recover()
        (raw,) = await store.get_blobs(META_TABLE, [version_id(0)], kind=Kind.META)
        assert raw == b"3"
    stored = await _stored(config)
    assert stored is not None and stored.version == 0
    assert await _logs_present(config, range(1, 4)) == [1, 3]


async def test_a_log_that_fits_one_item_goes_in_its_index_and_a_bigger_one_is_checked(
    memcached_nodes: list[str],
) -> None:
    """A dense log of at most `INLINE_LOG_BYTES` is one item (its index carries the body:
    stored whole, no checksum); a bigger one is cut into chunks with a CRC-32, and a
    chunk of another write (a torn log), or chunks without a checksum, stop its read."""
    from lookup_table.core.wire import pack, unpack
    from lookup_table.dense import CHUNK_BYTES
    from optimizer_service.engine.dense import INLINE_LOG_BYTES, DenseLogError

    config = _config(memcached_nodes)
    rng = np.random.default_rng(3)
    small = {"w": rng.standard_normal(1000, dtype=np.float32)}
    big = {"w": rng.standard_normal(INLINE_LOG_BYTES // 4 + 10, dtype=np.float32)}
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        dense = DenseReplica(store, make_optimizer(config.optimizer))
        await dense.write_log(1, small)
        await dense.write_log(2, big)
        raw1, raw2 = await store.get_blobs(
            DENSE_TABLE, [dense_log_id(1), dense_log_id(2)], kind=Kind.DENSE_LOG
        )
        assert raw1 is not None and raw2 is not None
        one, two = unpack(raw1), unpack(raw2)
        assert one["chunks"] == 0 and one["crc32"] is None and "body" in one
        assert two["chunks"] == 2 and isinstance(two["crc32"], int) and "body" not in two
        got = await DenseReplica(store, make_optimizer(config.optimizer)).read_logs([1, 2])
        np.testing.assert_array_equal(got[0]["w"], small["w"])
        np.testing.assert_array_equal(got[1]["w"], big["w"])
        # a torn log: its first chunk from another write (of the same size: the CRC-32
        # tells them apart)
        other = bytes(CHUNK_BYTES)
        await store.set_blobs(DENSE_TABLE, [dense_log_id(2, 0)], [other], kind=Kind.DENSE_LOG)
        with pytest.raises(DenseLogError, match="version 2 does not check out"):
            await dense.read_logs([2])
        # chunks, and an index without their checksum
        await store.set_blobs(
            DENSE_TABLE,
            [dense_log_id(2)],
            [pack({**two, "crc32": None})],
            kind=Kind.DENSE_LOG,
        )
        with pytest.raises(DenseLogError, match="version 2 does not check out"):
            await dense.read_logs([2])


async def test_values_handed_out_never_change_under_their_holder(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    config, server = await _serve(_config(memcached_nodes), aiohttp_server)
    dense = server.app[UPDATER].dense
    async with OptimizerClient(config) as client:
        await client.dense_init(INIT)
        held = await dense.read()
        assert held is not None
        copies = {n: np.array(v) for n, v in held.params.items()}
        slot_copies = {n: np.array(v) for n, v in held.slots.items()}
        await client.push({}, dense=_grads(1))
        await client.push({}, dense=_grads(2))
    _assert_params(held.params, copies)
    _assert_params(held.slots, slot_copies)
    assert not any(v.flags.writeable for v in [*held.params.values(), *held.slots.values()])
    now = await dense.read()
    assert now is not None and now.version == 2 and now is not held


@pytest.mark.parametrize("change", ["rewritten", "reinit"])
async def test_a_push_after_the_parameters_changed_behind_the_replica_uses_the_new_ones(
    change: str, own_nodes: list[MemcachedProcess], aiohttp_server: Any
) -> None:
    """`rewritten`: another writer (as a checkpoint restore does) puts a new generation;
    `reinit`: every node lost its data and `lookup-table-admin reinit` accepted it, the
    trainers offered their dense weights again. The replica's memory must not win."""
    config, _ = await _serve(_config([s.address for s in own_nodes]), aiohttp_server)
    new = {n: v + np.float32(3) for n, v in INIT.items()}
    async with OptimizerClient(config) as client:
        await client.dense_init(INIT)
        await client.push({}, dense=_grads(1))
        assert (await client.dense())[0] == 1
        if change == "rewritten":
            adam = make_optimizer(config.optimizer)
            slots = {
                n: np.full((1, adam.slot_width(v.size)), 0.5, np.float32) for n, v in new.items()
            }
            async with EmbeddingStore(config) as store:
                await DenseParams(store, adam).write(7, new, slots)
            want_version, (want, _) = 8, _adam_from(config, new, slots, _grads(2))
        else:
            for node in own_nodes:
                mc = memcache_client(node.address)
                try:
                    mc.flush_all()
                finally:
                    mc.close()
            await reinit_cluster(config)
            version, params = await client.dense_init(new)
            assert version == 0  # created again: nothing of the old state survives
            _assert_params(params, new)
            want_version, (want, _) = 1, _adam_steps(config, new, _grads(2))
        version, params = await client.dense()
        _assert_params(params, new)
        result = await client.push({}, dense=_grads(2))
        assert result["version"] == want_version
        version, params = await client.dense()
        assert version == want_version
        _assert_params(params, want)


@pytest.mark.parametrize("restored_since", [False, True], ids=["plain", "restored-since"])
async def test_a_push_journaled_before_its_writes_is_finished_by_the_next_replica(
    restored_since: bool, memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """The replica dies after the journal header, before the push's rows and version are
    written: the next one replays the journal (its rows, the version) and rebuilds the
    dense update from its log; the client's retry is a duplicate. If the parameters were
    replaced in between (a restore), the rebuild leaves them alone."""
    config = _config(memcached_nodes)
    config, server = await _serve(config, aiohttp_server)
    updater = server.app[UPDATER]
    grad = _grads(1)
    ids = np.array([10, 11], dtype=np.int64)
    async with OptimizerClient(config) as client:
        await client.dense_init(INIT)
    before = await _stored(config)
    assert before is not None

    async def crash(*_: Any, **__: Any) -> None:
        raise ConnectionResetError("simulated crash between the journal and the writes")

    updater.writes.write_plan = crash  # type: ignore[method-assign]  # the process "dies" here
    push_id = uuid.uuid4().hex
    async with OptimizerClient(config, max_retries=0) as client:
        with pytest.raises(ReplicaUnavailableError, match="ConnectionResetError"):
            await client.push(
                {"user": (ids, np.ones((2, 8), np.float32))}, dense=grad, push_id=push_id
            )
    await _die(server)

    now = await _stored(config)
    assert now is not None and now.generation == before.generation and now.version == 0
    async with EmbeddingStore(config) as store:
        plan = await Journal(store, replica=0).read(0)
    assert plan is not None and plan.dense_logged and plan.version == 1
    assert plan.dense is None and plan.dense_switch is None  # no values in the journal
    assert await _logs_present(config, range(1, 3)) == [1]  # written before the header

    if restored_since:
        restored = {n: v - np.float32(1) for n, v in INIT.items()}
        async with EmbeddingStore(config) as store:
            adam = make_optimizer(config.optimizer)
            await DenseParams(store, adam).write(
                5, restored, DenseParams(store, adam).initial_slots(restored)
            )

    config, _ = await _serve(config, aiohttp_server)  # recovery runs before serving
    after = await _stored(config)
    assert after is not None
    if restored_since:
        assert after.version == 5
        _assert_params(after.params, {n: v - np.float32(1) for n, v in INIT.items()})
    else:
        want, want_slots = _adam_steps(config, INIT, grad)
        assert after.version == 1
        _assert_params(after.params, want)
        _assert_params(after.slots, want_slots)
        assert await _chunks_present(config, before.meta) == 0  # the old generation is gone
        assert await _logs_present(config, range(1, 3)) == []
    async with OptimizerClient(config) as client:
        retry = await client.push(
            {"user": (ids, np.ones((2, 8), np.float32))}, dense=grad, push_id=push_id
        )
        assert retry["duplicate"]
        version, params = await client.dense()
        assert version == after.version
        _assert_params(params, dict(after.params))


async def test_a_journal_of_the_previous_service_with_inline_dense_values_is_replayed(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """Before this version a journal carried the new dense values: after an upgrade the
    new replica still finishes such a push (as a new generation)."""
    config = _config(memcached_nodes)
    adam = make_optimizer(config.optimizer)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        dense = DenseReplica(store, adam)
        await dense.init(INIT)
        old = await _stored(config)
        assert old is not None
        new, new_slots = _adam_steps(config, INIT, _grads(1))
        plan = WritePlan(push_id="old-service-push", updates=[], version=1, dense=(new, new_slots))
        await Journal(store, replica=0).write(3, plan)  # the inline format of before
    config, server = await _serve(config, aiohttp_server)
    after = await _stored(config)
    assert after is not None and after.version == 1 and after.generation != old.generation
    _assert_params(after.params, new)
    _assert_params(after.slots, new_slots)
    assert await _chunks_present(config, old.meta) == 0
    assert server.app[UPDATER].version == 1


class _FailingVersionWrite:
    """Replica 0's writes of its version key (every dense push's, after its journal) fail
    as a full node would: the first `fail_calls` (all while `fail_calls` is None, until
    `heal`); the first that succeeds takes `slow_s` more (a replay still running)."""

    def __init__(
        self,
        store: EmbeddingStore,
        monkeypatch: pytest.MonkeyPatch,
        *,
        fail_calls: int | None = None,
        slow_s: float = 0.0,
    ) -> None:
        self.fail_calls = fail_calls
        self.calls = 0
        self.replay_failed = asyncio.Event()  # a replay failed too, not only the push
        original = store.set_blobs

        async def set_blobs(table: str, ids: Any, values: Any, **kw: Any) -> Any:
            nonlocal slow_s
            if table != META_TABLE or list(ids) != [version_id(0)]:
                return await original(table, ids, values, **kw)
            self.calls += 1
            if self.fail_calls is None or self.calls <= self.fail_calls:
                if self.calls >= 2:
                    self.replay_failed.set()
                raise StoreFullError(
                    "memcached node 127.0.0.1:9 is out of memory (simulated)", node="127.0.0.1:9"
                )
            slow, slow_s = slow_s, 0.0
            await asyncio.sleep(slow)
            return await original(table, ids, values, **kw)

        monkeypatch.setattr(store, "set_blobs", set_blobs)

    def heal(self) -> None:
        self.fail_calls = self.calls


async def test_a_dense_push_waits_for_the_replay_of_a_failed_dense_write(
    memcached_nodes: list[str], aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Push A's writes fail after its journal; while A's replay runs, push B must not
    compute from the state before A (A's update would then be lost). B waits for the
    replay and applies on top of A."""
    config, server = await _serve(_config(memcached_nodes), aiohttp_server)
    updater = server.app[UPDATER]
    a, b = _grads(1), _grads(2)
    async with OptimizerClient(config, max_retries=0) as client:
        await client.dense_init(INIT)
        # only the push's own write fails; its replay is still writing when B arrives
        _FailingVersionWrite(updater.store, monkeypatch, fail_calls=1, slow_s=0.5)
        with pytest.raises(StoreFullError, match="simulated"):
            await client.push({}, dense=a)
        assert len(updater.state.finishers) == 1
        result = await client.push({}, dense=b)
        assert result["applied"] and result["version"] == 2
        assert not updater.state.finishers
        await client.pause(timeout_s=30)  # flushes: memcached then holds what is served
        await client.resume()
        version, params = await client.dense()
    assert version == 2
    _assert_params(params, _adam_steps(config, INIT, a, b)[0])
    stored = await _stored(config)
    assert stored is not None and stored.version == 2
    _assert_params(stored.params, _adam_steps(config, INIT, a, b)[0])


async def test_a_dense_push_fails_fast_while_a_failed_dense_write_keeps_failing(
    memcached_nodes: list[str], aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While push A's replay keeps failing, push B fails at once with A's error (the
    same status and type, naming A), nothing of B is applied; GET /v1/dense serves the
    state before A. Once the store heals A lands once, and C applies on top of it."""
    config, server = await _serve(_config(memcached_nodes), aiohttp_server)
    updater = server.app[UPDATER]
    a, b, c = _grads(1), _grads(2), _grads(3)
    async with OptimizerClient(config, max_retries=0) as client:
        await client.dense_init(INIT)
        failing = _FailingVersionWrite(updater.store, monkeypatch)
        push_a = uuid.uuid4().hex
        with pytest.raises(StoreFullError, match="simulated"):
            await client.push({}, dense=a, push_id=push_a)
        async with asyncio.timeout(10):
            await failing.replay_failed.wait()
        async with asyncio.timeout(2):  # fails fast: no waiting for the replay
            with pytest.raises(StoreFullError, match=f"held by push '{push_a}'") as info:
                await client.push({}, dense=b)
        assert info.value.node == "127.0.0.1:9"
        version, params = await client.dense()
        assert version == 0
        _assert_params(params, INIT)

        failing.heal()
        async with asyncio.timeout(15):
            await asyncio.wait(set(updater.state.finishers))
        assert updater.locks.held == 0
        result = await client.push({}, dense=c)
        assert result["applied"] and result["version"] == 2
        await client.pause(timeout_s=30)  # flushes: memcached then holds what is served
        await client.resume()
        version, params = await client.dense()
    assert version == 2
    _assert_params(params, _adam_steps(config, INIT, a, c)[0])
    stored = await _stored(config)
    assert stored is not None and stored.version == 2
    _assert_params(stored.params, _adam_steps(config, INIT, a, c)[0])
