"""Dense parameters in the service: served from replica 0's memory, journaled as a switch.

Real memcached and the real aiohttp app. Failures are simulated by replacing one step
of the updater (as `test_service.py` does for `_write_updates`), never memcached.
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
from lookup_table.core.keyspace import DENSE_TABLE, Kind, dense_chunk_id
from lookup_table.core.optimizers import make_optimizer
from lookup_table.dense import DenseParams, DenseState
from lookup_table.errors import ReplicaUnavailableError, StoreFullError
from lookup_table.ops.admin import reinit_cluster
from lookup_table.ops.localcluster import MemcachedProcess
from optimizer_service.app import STORE, UPDATER, make_app
from optimizer_service.journal import Journal
from optimizer_service.plan import WritePlan
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


def _config(nodes: list[str]) -> ClusterConfig:
    return make_config(nodes, tables=SERVICE_TABLES, optimizers=["http://127.0.0.1:1"])


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


class _Recorder:
    """Counts the store calls of a running replica by kind (the calls still run)."""

    def __init__(self, store: EmbeddingStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int]] = []
        self.written: dict[str, int] = {}
        get_blobs, set_blobs = store.get_blobs, store.set_blobs

        async def counted_get(table: str, ids: Any, *, kind: str) -> list[bytes | None]:
            self.reads.append((kind, len(ids)))
            return await get_blobs(table, ids, kind=kind)

        async def counted_set(table: str, ids: Any, values: Any, **kw: Any) -> Any:
            kind = kw["kind"]
            self.written[kind] = self.written.get(kind, 0) + sum(len(v) for v in values)
            return await set_blobs(table, ids, values, **kw)

        monkeypatch.setattr(store, "get_blobs", counted_get)
        monkeypatch.setattr(store, "set_blobs", counted_set)

    def clear(self) -> None:
        self.reads.clear()
        self.written.clear()

    def dense_reads(self) -> list[tuple[str, int]]:
        return [r for r in self.reads if r[0] in (Kind.DENSE, Kind.DENSE_SLOTS)]


async def test_pushes_and_gets_read_only_the_pointer_and_the_journal_carries_no_values(
    memcached_nodes: list[str], aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, server = await _serve(_config(memcached_nodes), aiohttp_server)
    recorder = _Recorder(server.app[STORE], monkeypatch)
    grads = [_grads(1), _grads(2)]
    async with OptimizerClient(config) as client:
        await client.dense_init(INIT)
        for i, grad in enumerate(grads, start=1):
            recorder.clear()
            result = await client.push({}, dense=grad)
            assert result["version"] == i
            # the push read the `current` pointer (one small get), not the generation
            assert recorder.dense_reads() == []
            assert recorder.reads.count((Kind.META, 1)) >= 1
            # the journal names the new generation; its chunks were written beside it
            assert 0 < recorder.written[Kind.JOURNAL] < 4096
            assert recorder.written[Kind.DENSE] == sum(v.nbytes for v in INIT.values())

            recorder.clear()
            version, params = await client.dense()
            assert version == i
            _assert_params(params, _adam_steps(config, INIT, *grads[:i])[0])
            assert recorder.reads == [(Kind.META, 1)]  # the pointer only
    stored = await _stored(config)
    assert stored is not None and stored.version == 2
    _assert_params(stored.params, _adam_steps(config, INIT, *grads)[0])


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
async def test_a_push_journaled_before_its_switch_is_finished_by_the_next_replica(
    restored_since: bool, memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """The replica dies after the journal header, before `current` is switched: the
    next one switches it from the journal alone (the generation was written before the
    header) and deletes the old generation; the client's retry is a duplicate. If the
    parameters were replaced in between (a restore), the replay leaves them alone."""
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
        raise ConnectionResetError("simulated crash between the journal and the switch")

    updater._write_plan = crash  # type: ignore[method-assign]  # the process "dies" here
    push_id = uuid.uuid4().hex
    async with OptimizerClient(config, max_retries=0) as client:
        with pytest.raises(ReplicaUnavailableError, match="ConnectionResetError"):
            await client.push(
                {"user": (ids, np.ones((2, 8), np.float32))}, dense=grad, push_id=push_id
            )
    for task in list(updater._finishers):
        task.cancel()  # the dead process's background replay never runs
    await server.close()

    now = await _stored(config)
    assert now is not None and now.generation == before.generation and now.version == 0
    async with EmbeddingStore(config) as store:
        plan = await Journal(store, replica=0).read(0)
    assert plan is not None and plan.dense_switch is not None and plan.dense is None
    switch = plan.dense_switch
    assert switch.previous is not None and switch.previous["generation"] == before.generation
    assert switch.current["version"] == 1
    total = sum(p["chunks"] for p in switch.current["params"].values())
    total += sum(switch.current["slots"].values())
    assert await _chunks_present(config, switch.current) == total  # written before the header

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
        assert after.version == 1 and after.generation == switch.current["generation"]
        _assert_params(after.params, want)
        _assert_params(after.slots, want_slots)
        assert await _chunks_present(config, before.meta) == 0  # the old generation is gone
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
        dense = DenseParams(store, adam)
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


class _FailingSwitch:
    """`DenseParams.switch` that fails as a full node would: its first `fail_calls` calls
    (all while `fail_calls` is None, until `heal`); the first call that succeeds takes
    `slow_s` more (a replay still running)."""

    def __init__(
        self,
        dense: DenseParams,
        monkeypatch: pytest.MonkeyPatch,
        *,
        fail_calls: int | None = None,
        slow_s: float = 0.0,
    ) -> None:
        self.fail_calls = fail_calls
        self.calls = 0
        self.replay_failed = asyncio.Event()  # a replay failed too, not only the push
        original = dense.switch

        async def switch(*args: Any, **kw: Any) -> bool:
            nonlocal slow_s
            self.calls += 1
            if self.fail_calls is None or self.calls <= self.fail_calls:
                if self.calls >= 2:
                    self.replay_failed.set()
                raise StoreFullError(
                    "memcached node 127.0.0.1:9 is out of memory (simulated)", node="127.0.0.1:9"
                )
            slow, slow_s = slow_s, 0.0
            await asyncio.sleep(slow)
            return await original(*args, **kw)

        monkeypatch.setattr(dense, "switch", switch)

    def heal(self) -> None:
        self.fail_calls = self.calls


async def test_a_dense_push_waits_for_the_replay_of_a_failed_dense_write(
    memcached_nodes: list[str], aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Push A's switch fails after its journal; while A's replay runs, push B must not
    compute from the state before A (the replay would then overwrite B: a lost update).
    B waits for the replay and applies on top of A."""
    config, server = await _serve(_config(memcached_nodes), aiohttp_server)
    updater = server.app[UPDATER]
    a, b = _grads(1), _grads(2)
    async with OptimizerClient(config, max_retries=0) as client:
        await client.dense_init(INIT)
        # only the push's own switch fails; its replay is still switching when B arrives
        _FailingSwitch(updater.dense, monkeypatch, fail_calls=1, slow_s=0.5)
        with pytest.raises(StoreFullError, match="simulated"):
            await client.push({}, dense=a)
        assert len(updater._finishers) == 1
        result = await client.push({}, dense=b)
        assert result["applied"] and result["version"] == 2
        assert not updater._finishers
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
        failing = _FailingSwitch(updater.dense, monkeypatch)
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
            await asyncio.wait(set(updater._finishers))
        assert updater.locks.held == 0
        result = await client.push({}, dense=c)
        assert result["applied"] and result["version"] == 2
        version, params = await client.dense()
    assert version == 2
    _assert_params(params, _adam_steps(config, INIT, a, c)[0])
    stored = await _stored(config)
    assert stored is not None and stored.version == 2
    _assert_params(stored.params, _adam_steps(config, INIT, a, c)[0])
