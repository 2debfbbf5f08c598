"""A memcached node lost, full or stopped while a real trainer trains.

End to end: `trainer.Trainer` (a small mlp over two `DistributedEmbedding` tables,
synthetic batches) -> memcached, and trainer -> optimizer service (a subprocess) ->
memcached. The store-level versions of these promises are in
tests/integration/test_store.py; here they must hold through the training loop (its
tf.function and I/O thread), the service's error middleware and OptimizerClient.
Everything is real: memcached processes (killed, restarted, SIGSTOPped, started with
`-M -m 2`), the service process, TensorFlow. What memcached holds is read from outside
with pymemcache (harness.item_counts, node_stats, metadump_keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from lookup_table import EmbeddingStore, initial_rows
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.keys import as_ids, decode_key, encode_keys
from lookup_table.core.keyspace import META_TABLE, Kind, journal_id
from lookup_table.core.sharding import node_of
from lookup_table.core.wire import CONTENT_TYPE, encode_array, encode_ids, pack, unpack
from lookup_table.errors import (
    DataLossError,
    LookupTableError,
    NodeUnavailableError,
    StoreFullError,
    StoreTimeoutError,
)
from lookup_table.ops.admin import init_cluster
from lookup_table.ops.checkpoint import save_checkpoint, save_checkpoint_async
from lookup_table.ops.localcluster import MemcachedProcess, free_port, start_memcached
from optimizer_service.engine.journal import JOURNAL_SLOTS
from tests.conftest import written
from tests.reliability.harness import (
    REPO,
    ServiceProcess,
    cluster_file,
    delete_keys,
    item_counts,
    memcache_client,
    metadump_keys,
    node_stats,
    wait_healthy,
)

pytestmark = pytest.mark.integration

LR = 0.1
TABLES: list[dict[str, Any]] = [
    {"name": "C1", "dim": 16, "seed": 1, "optimizer": {"name": "sgd", "learning_rate": LR}},
    {"name": "C3", "dim": 16, "seed": 3, "optimizer": {"name": "sgd", "learning_rate": LR}},
]
TABLE_NAMES = ("C1", "C3")  # C1: 583 ids (hot, reused); C3: ~10M ids (new rows every step)
TIMEOUT_S = 1.0  # store.timeout_s of these clusters
REQUEST_TIMEOUT_S = 10.0  # service.request_timeout_s: a hung push would show as >= 10 s
# Generous: the machine is shared and loaded. A bound is for "no hang, no retry loop".
MARGIN_S = 5.0


# ------------------------------------------------------------------ helpers


@contextlib.contextmanager
def _cluster(
    tmp_path: Path, nodes: Sequence[MemcachedProcess], **service: Any
) -> Iterator[tuple[Path, ClusterConfig, ServiceProcess]]:
    """Initialize a fresh namespace on `nodes` and run one optimizer replica for it
    (`service`: more keys of its [service] section)."""
    port = free_port()
    path = cluster_file(
        tmp_path,
        [n.address for n in nodes],
        port,
        tables=TABLES,
        sections={
            "store": {"timeout_s": TIMEOUT_S},
            "service": {"request_timeout_s": REQUEST_TIMEOUT_S, **service},
        },
    )
    config = load_config(path)
    asyncio.run(init_cluster(config))
    service = ServiceProcess(path, port, tmp_path)
    try:
        service.start()
        asyncio.run(wait_healthy(service))
        yield path, config, service
    finally:
        service.kill()


def _source() -> Any:
    from trainer.data import SyntheticSource

    return SyntheticSource(1_000_000, seed=7).select([*TABLE_NAMES, "I1"])


async def _written(config: ClusterConfig, version: int) -> None:
    """Wait until the replica has written every push up to model version `version` (a
    trainer's pushes are answered before their writes land), and until every journal slot
    is clear: a push's done record and then its slot's clear are written in the
    background after its rows and version, so a node killed before they land would fail
    them (and hold the push's rows for a replay) instead of finding the node idle."""
    async with OptimizerClient(config) as client:
        for _ in range(100):
            if await client.version(after=version - 1) >= version:
                break
        else:
            raise AssertionError(f"the replica never reached version {version}")
    headers = [journal_id(0, slot) for slot in range(JOURNAL_SLOTS)]
    async with EmbeddingStore(config) as store:
        deadline = time.monotonic() + 30
        while any(await store.get_blobs(META_TABLE, headers, kind=Kind.JOURNAL)):
            if time.monotonic() > deadline:
                raise AssertionError("the replica's journal slots were never all cleared")
            await asyncio.sleep(0.01)


def _trainer(config: ClusterConfig, source: Any, *, max_pushes_in_flight: int = 0) -> Any:
    import keras

    from trainer import Trainer
    from trainer.models import build_model

    # as in a fresh process: the same layer names, so the dense parameters' paths match
    # the ones stored in the namespace (a resumed trainer is a new process in real life)
    keras.backend.clear_session()
    model = build_model("mlp", source.schema, config, hidden=(8,), seed=0)
    return Trainer(config, model, progress=False, max_pushes_in_flight=max_pushes_in_flight)


def _ids_on(table: str, node: int, nodes: Sequence[str], n: int, *, start: int) -> np.ndarray:
    """`n` int ids from `start` on whose rows live on nodes[node] (never seen in training:
    the synthetic ids are 64-bit mixes, these are small)."""
    candidates = np.arange(start, start + 200 * n, dtype=np.int64)
    ids = candidates[node_of(table, candidates, nodes) == node][:n]
    assert ids.shape == (n,)
    return ids


async def _raw_push(
    config: ClusterConfig,
    url: str,
    push_id: str,
    table: str,
    ids: np.ndarray,
    grads: np.ndarray,
) -> tuple[int, dict[str, Any], float]:
    """POST /v1/gradients to replica 0 of `config` by hand: (status, decoded body, seconds)."""
    body = pack(
        {
            "push_id": push_id,
            "worker": 0,
            "version": 0,
            "tables": {table: {"ids": encode_ids(ids), "grads": encode_array(grads)}},
            **config.sender(0),
        }
    )
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S * 3)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(
            url + "/v1/gradients", data=body, headers={"Content-Type": CONTENT_TYPE}
        ) as resp,
    ):
        raw = await resp.read()
        status, json_body = resp.status, resp.content_type == "application/json"
    doc: dict[str, Any] = json.loads(raw) if json_body else unpack(raw)
    return status, doc, time.monotonic() - started


async def _client_push(
    config: ClusterConfig, table: str, ids: np.ndarray, grads: np.ndarray, push_id: str
) -> tuple[BaseException | None, float]:
    """Push through OptimizerClient: (the error it raised or None, seconds)."""
    started = time.monotonic()
    try:
        async with OptimizerClient(config) as client:
            await client.push({table: (ids, grads)}, push_id=push_id)
    except Exception as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


async def _read(
    config: ClusterConfig, table: str, ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    async with EmbeddingStore(config) as store:
        return await store.get(table, ids)


def _sgd_rows(config: ClusterConfig, table: str, ids: np.ndarray, grads: np.ndarray) -> Any:
    """What one SGD push of `grads` makes of never-seen rows: init - lr * grads."""
    spec = config.table(table)
    init = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=spec.dim)
    return init - np.float32(LR) * grads


def _row_keys(address: str, namespace: str) -> dict[str, set[int]]:
    """The ids of every row key (kind `w`) of `namespace` on a node, per table."""
    out: dict[str, set[int]] = {}
    for key in asyncio.run(metadump_keys(address)):
        if not key.startswith(namespace.encode() + b"/"):
            continue
        decoded = decode_key(key)
        if decoded.kind == "w" and decoded.table in TABLE_NAMES:
            assert isinstance(decoded.id, int)
            out.setdefault(decoded.table, set()).add(decoded.id)
    return out


# ------------------------------------------------------------------ 3. a node loses its data


@pytest.mark.timeout(180)
def test_node_lost_during_training_raises_data_loss_then_restore_resumes(tmp_path: Path) -> None:
    """kill -9 + empty restart of a node between two batches: the very next step raises
    DataLossError naming it; the service answers 503 DataLossError for a push touching it
    and OptimizerClient raises DataLossError; nothing is created on the node; `restore
    --force` puts back exactly the checkpoint, and a new trainer resumes from it."""
    nodes = [start_memcached(memory_mb=64), start_memcached(memory_mb=64)]
    try:
        with _cluster(tmp_path, nodes) as (path, config, service):
            addresses = list(config.node_addresses)
            lost = nodes[1]
            source = _source()
            batches = source.batches(64, epochs=None)
            trainer = _trainer(config, source)
            try:
                trainer.fit(batches, steps=4)
                ckpt = tmp_path / "ckpt"
                save_checkpoint(config, ckpt, progress=False)
                saved = {
                    t: (
                        np.load(ckpt / "tables" / t / "ids.npy"),
                        np.load(ckpt / "tables" / t / "rows.npy"),
                    )
                    for t in TABLE_NAMES
                }
                assert all(ids.shape[0] > 0 for ids, _ in saved.values())
                manifest = json.loads((ckpt / "manifest.json").read_text())
                trainer.fit(batches, steps=3)  # the rows move on after the checkpoint

                pulled: list[int] = []
                restarted_at: list[float] = []

                def restart_between_batches() -> Iterator[Any]:
                    # fit() asks for batch i+1 just before it runs the step on batch i, after
                    # the step on batch i-1 was answered; that push's writes may still be
                    # landing, so the restart waits for them (the replica's version): it
                    # then lands between the steps on batches 1 and 2.
                    for i, batch in enumerate(batches):
                        if i == 3:
                            asyncio.run(_written(config, trainer.version))
                            lost.restart_empty()
                            restarted_at.append(time.monotonic())
                        pulled.append(i)
                        yield batch

                with pytest.raises(DataLossError) as info:
                    trainer.fit(restart_between_batches(), steps=50)
                failed_after_s = time.monotonic() - restarted_at[0]
                # The very first step after the restart (the one on batch 2) raised: had it
                # raised one step later, batch 4 would have been asked for.
                assert pulled == [0, 1, 2, 3]
                assert failed_after_s < TIMEOUT_S + MARGIN_S, failed_after_s
                assert info.value.nodes == (lost.address,)
                assert f"memcached node {lost.address} has lost its data" in str(info.value)
                assert "lookup-table-checkpoint restore" in str(info.value)
                # nothing was written on the restarted node, not even one add
                assert item_counts([lost.address])[lost.address] == (0, 0)
            finally:
                trainer.close()

            # The service, for a push touching the lost node (rows of the checkpoint).
            c1_ids, _ = saved["C1"]
            on_lost = c1_ids[node_of("C1", c1_ids, addresses) == 1][:4]
            assert on_lost.shape == (4,)
            grads = np.full((4, 16), 0.5, dtype=np.float32)
            status, doc, _ = asyncio.run(
                _raw_push(config, service.url, "lost-1", "C1", on_lost, grads)
            )
            assert status == 503, doc
            assert doc["type"] == "DataLossError" and doc["nodes"] == [lost.address], doc
            assert f"memcached node {lost.address} has lost its data" in doc["error"]
            error, _ = asyncio.run(_client_push(config, "C1", on_lost, grads, "lost-2"))
            assert isinstance(error, DataLossError), repr(error)
            assert error.nodes == (lost.address,) and lost.address in str(error)
            assert item_counts([lost.address])[lost.address] == (0, 0)

            # restore the checkpoint (the operator's command), then restart the replica
            restore = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "lookup_table.ops.checkpoint",
                    "restore",
                    "--config",
                    str(path),
                    "--dir",
                    str(ckpt),
                    "--force",
                    "--no-progress",
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert restore.returncode == 0, restore.stdout + restore.stderr
            service.terminate()
            service.start()
            asyncio.run(wait_healthy(service))

            # Immediately after the restore every row is the checkpoint's (on both nodes:
            # the survivor's newer rows were replaced), and the restarted node holds the
            # checkpoint's rows placed on it, and no other row.
            for table, (ids, rows) in saved.items():
                values, found = asyncio.run(_read(config, table, ids))
                assert found.all(), table
                np.testing.assert_array_equal(values, rows)
            on_node = _row_keys(lost.address, config.namespace)
            for table, (ids, _) in saved.items():
                want = ids[node_of(table, ids, addresses) == 1]
                assert on_node.get(table, set()) == set(want.tolist()), table

            # a new trainer resumes from the checkpoint's model
            trainer = _trainer(config, source)
            try:
                resumed = trainer.fit(source.batches(64, epochs=None), steps=4)
            finally:
                trainer.close()
            assert resumed.steps == 4
            assert all(math.isfinite(loss) for _, loss in resumed.losses)
            # it started from the checkpoint's dense version (not the 5 steps trained after
            # it), and each step's push moved the model on by one
            version = manifest["dense"]["version"]
            assert resumed.versions == [version, version + 1, version + 2, version + 3]
    finally:
        for node in nodes:  # side by side: each takes up to a second to exit
            node.terminate()
        for node in nodes:
            node.stop()


@pytest.mark.timeout(120)
def test_node_lost_with_a_push_in_flight_raises_at_most_one_step_later(tmp_path: Path) -> None:
    """Pipelined (max_pushes_in_flight=1): the step after the restart still uses rows
    prefetched before it, and its push is refused by the service. The error, from the
    background I/O thread, is raised by the next step at the latest (never swallowed, and
    not replaced by another one when the `with` block closes the trainer). A push or
    prefetch in flight while the node was down (between the kill and the restart) fails as
    NodeUnavailableError naming it. Writes that read before the restart and wrote after it
    (the store's documented window) may land on the node, but nothing reads them: the node
    stays flagged, and only rows of those in-flight batches can be there."""
    nodes = [start_memcached(memory_mb=64), start_memcached(memory_mb=64)]
    try:
        with _cluster(tmp_path, nodes) as (_, config, _service):
            lost = nodes[1]
            source = _source()
            batches = source.batches(64, epochs=None)
            pulled: list[int] = []
            ids_of: list[dict[str, np.ndarray]] = []
            raised_by_fit: list[BaseException] = []

            def restart_between_batches() -> Iterator[Any]:
                for i, batch in enumerate(batches):
                    if i == 3:  # between the steps on batches 1 and 2, as above
                        lost.restart_empty()
                    pulled.append(i)
                    ids_of.append({t: batch.features[t] for t in TABLE_NAMES})
                    yield batch

            with (
                pytest.raises((DataLossError, NodeUnavailableError)) as info,
                _trainer(config, source, max_pushes_in_flight=1) as trainer,
            ):
                trainer.fit(batches, steps=3)
                try:
                    trainer.fit(restart_between_batches(), steps=50)
                except LookupTableError as exc:
                    raised_by_fit.append(exc)
                    raise
            assert raised_by_fit == [info.value]
            # raised by the step on batch 2 (a refused push of batch 1) or on batch 3
            assert pulled in ([0, 1, 2, 3], [0, 1, 2, 3, 4]), pulled
            error = info.value
            named = error.nodes if isinstance(error, DataLossError) else (error.node,)
            assert named == (lost.address,) and lost.address in str(error)
            # in flight at the restart: the push of batch 1, the prefetch of batch 2
            for table, ids in _row_keys(lost.address, config.namespace).items():
                in_flight = set(np.concatenate([ids_of[1][table], ids_of[2][table]]).tolist())
                assert ids <= in_flight, (table, len(ids - in_flight))
            with pytest.raises(DataLossError, match=lost.address):
                asyncio.run(_read(config, "C1", ids_of[0]["C1"]))
    finally:
        for node in nodes:  # side by side: each takes up to a second to exit
            node.terminate()
        for node in nodes:
            node.stop()


# ------------------------------------------------------------------ 7. a node stops answering


@pytest.mark.timeout(150)
def test_stopped_node_fails_training_and_pushes_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP a node: a training step raises StoreTimeoutError naming it within
    store.timeout_s (+ margin); the service answers a push 503 StoreTimeoutError naming it,
    as fast; OptimizerClient raises StoreTimeoutError without retrying. After SIGCONT the
    same push applies exactly once and training goes on."""
    nodes = [start_memcached(memory_mb=64), start_memcached(memory_mb=64)]
    try:
        with _cluster(tmp_path, nodes) as (_, config, service):
            addresses = list(config.node_addresses)
            stopped = nodes[1]
            assert stopped.pid is not None
            source = _source()
            batches = source.batches(64, epochs=None)
            ids = _ids_on("C1", 1, addresses, 4, start=1_000)
            grads = np.full((4, 16), 0.25, dtype=np.float32)
            trainer = _trainer(config, source)
            try:
                trainer.fit(batches, steps=3)
                os.kill(stopped.pid, signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    with pytest.raises(StoreTimeoutError) as info:
                        trainer.fit(batches, steps=3)
                    step_s = time.monotonic() - started
                    assert info.value.node == stopped.address
                    assert f"memcached node {stopped.address} did not answer within 1 s" in str(
                        info.value
                    )

                    status, doc, push_s = asyncio.run(
                        _raw_push(config, service.url, "stop-1", "C1", ids, grads)
                    )
                    assert status == 503, doc
                    assert doc["type"] == "StoreTimeoutError", doc
                    assert doc["node"] == stopped.address, doc
                    assert f"memcached node {stopped.address} did not answer" in doc["error"]

                    error, client_s = asyncio.run(_client_push(config, "C1", ids, grads, "stop-1"))
                    assert isinstance(error, StoreTimeoutError), repr(error)
                    assert error.node == stopped.address and stopped.address in str(error)
                finally:
                    os.kill(stopped.pid, signal.SIGCONT)
                for what, seconds in (("step", step_s), ("push", push_s), ("client", client_s)):
                    assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + MARGIN_S, (what, seconds)

                # the failed push left nothing: retried after SIGCONT it applies exactly once
                asyncio.run(wait_healthy(service, timeout_s=15))
                error, _ = asyncio.run(_client_push(config, "C1", ids, grads, "stop-1"))
                assert error is None, repr(error)
                asyncio.run(written(config))  # rows written behind: written now
                values, found = asyncio.run(_read(config, "C1", ids))
                assert found.all()
                np.testing.assert_allclose(
                    values, _sgd_rows(config, "C1", ids, grads), rtol=0, atol=1e-6
                )
                again = trainer.fit(batches, steps=3)
                assert again.steps == 3 and all(math.isfinite(v) for _, v in again.losses)
            finally:
                trainer.close()
    finally:
        for node in nodes:  # side by side: each takes up to a second to exit
            node.terminate()
        for node in nodes:
            node.stop()


# ------------------------------------------------------------------ 4. a node is full


def _meta_on(node: int, ids: Sequence[str], nodes: Sequence[str]) -> bool:
    """Whether every bookkeeping value (`_meta` table) of `ids` lives on nodes[node]."""
    return bool((node_of(META_TABLE, as_ids(list(ids)), nodes) == node).all())


def _push_id_on(node: int, nodes: Sequence[str], stem: str, replica: int = 0) -> str:
    """A push id whose done record (`_meta/p/r<K>:<push_id>`) lives on nodes[node]."""
    return next(
        f"{stem}-{i}" for i in range(1000) if _meta_on(node, [f"r{replica}:{stem}-{i}"], nodes)
    )


def _fill_slab_classes(address: str, keys: Sequence[bytes], value_bytes: int) -> int:
    """Write filler items the size of `keys` with `value_bytes` values (give or take 16
    bytes, so flags or CAS do not matter) to the node until each of their slab classes
    is exhausted: a write of that size fails with memcached's out-of-memory error.
    Training stops at the first refused write, which may leave free chunks in the
    class a later push needs; after this, no item of that size fits. Returns the
    number of filler items written."""
    from pymemcache.exceptions import MemcacheServerError

    client = memcache_client(address)
    written = 0
    try:
        for key_len in sorted({len(k) for k in keys}):
            for size in range(value_bytes - 16, value_bytes + 17, 4):
                value = b"f" * size
                while True:
                    key = f"fill/{key_len}/{size}/{written}".encode().ljust(key_len, b"_")
                    assert len(key) == key_len, key
                    try:
                        client.set(key, value, noreply=False)
                    except MemcacheServerError as exc:
                        assert "out of memory" in str(exc), exc
                        break
                    written += 1
    finally:
        client.close()
    return written


@pytest.mark.timeout(180)
def test_full_node_stops_training_with_store_full_and_keeps_rows(tmp_path: Path) -> None:
    """Train until a `-M -m 2` node is full: fit raises StoreFullError naming it (not another
    error, not a hang, no eviction); every row written before is still there, unchanged. A
    push through the service that needs the node answers 507 StoreFullError naming it and
    OptimizerClient raises StoreFullError at once; no row of it is anything but absent or
    its one correct new value."""
    # slab_automove=0: memcached must not move a page into the class of the push's rows
    # between the filling below and the push (with -M it would never evict, but a moved
    # free page would let the push fit).
    big = start_memcached(memory_mb=64)
    small = start_memcached(memory_mb=2, extra_args=("-o", "slab_automove=0"))
    loop = asyncio.new_event_loop()
    try:
        # written through: each push writes its rows (rows written behind reach a full node
        # at a flush: test_full_node_stops_training_written_behind_and_loses_nothing)
        with _cluster(tmp_path, [big, small], row_flush_pushes=1) as (_, config, service):
            addresses = list(config.node_addresses)
            source = _source()
            reader = EmbeddingStore(config)
            seen: list[dict[str, np.ndarray]] = []
            snapshot: dict[str, tuple[np.ndarray, np.ndarray]] = {}

            def snapshotting() -> Iterator[Any]:
                # When fit() asks for batch j, the steps on batches 0..j-3 are done (their
                # pushes written), the step on batch j-2 was answered (its writes may still
                # be landing) and the step on batch j-1 comes next: if either fails, the
                # rows of batches 0..j-3 that neither touches must stay exactly as read here.
                for j, batch in enumerate(source.batches(512, epochs=None)):
                    if j >= 3:
                        for table in TABLE_NAMES:
                            ids = np.unique(np.concatenate([s[table] for s in seen[: j - 2]]))
                            ids = ids[~np.isin(ids, seen[j - 2][table])]
                            ids = ids[~np.isin(ids, seen[j - 1][table])]
                            values, found = loop.run_until_complete(reader.get(table, ids))
                            assert found.all(), f"rows of {table} vanished before the node filled"
                            snapshot[table] = (ids, values)
                    seen.append({t: np.unique(batch.features[t]) for t in TABLE_NAMES})
                    yield batch

            trainer = _trainer(config, source)
            try:
                with pytest.raises(StoreFullError) as info:
                    trainer.fit(snapshotting(), steps=2000)
            finally:
                trainer.close()
            assert len(seen) > 4  # it trained before the node filled up
            assert info.value.node == small.address, str(info.value)
            assert f"memcached node {small.address} is out of memory" in str(info.value)
            stats = {n.address: node_stats(n.address) for n in (big, small)}
            assert stats[big.address]["evictions"] == stats[small.address]["evictions"] == 0
            assert stats[small.address]["store_no_memory"] > 0  # -M said no; nothing dropped
            for table, (ids, before) in snapshot.items():
                values, found = loop.run_until_complete(reader.get(table, ids))
                assert found.all(), table
                np.testing.assert_array_equal(values, before)

            # A push of new rows, half of them on the full node: 507 naming it, at once.
            on_small = _ids_on("C1", 1, addresses, 4, start=10**12)
            on_big = _ids_on("C1", 0, addresses, 4, start=10**12)
            ids = np.concatenate([on_small, on_big])
            grads = np.linspace(-1, 1, 8 * 16, dtype=np.float32).reshape(8, 16)
            # Deterministic: no row of the push's size fits on the small node any more.
            small_keys = encode_keys(config.namespace, "C1", "w", on_small)
            _fill_slab_classes(small.address, small_keys, 16 * 4)
            push_id = _push_id_on(0, addresses, "full")
            status, doc, push_s = asyncio.run(
                _raw_push(config, service.url, push_id, "C1", ids, grads)
            )
            assert status == 507, doc
            assert doc["type"] == "StoreFullError" and doc["node"] == small.address, doc
            assert f"memcached node {small.address} is out of memory" in doc["error"]
            assert push_s < MARGIN_S
            values, found = loop.run_until_complete(reader.get("C1", ids))
            # What is written is the push's own result or nothing, row by row, and all of it
            # only if the push was journaled before the full node refused rows (memcached may
            # still take a few: -M refuses once no chunk is free). A journaled push is
            # finished by a background replay once the node has room (exactly once: see the
            # next test); its rows stay locked for other pushes meanwhile.
            journaled = bool(found[4:].all())
            assert journaled or not found.any(), found
            assert not found[:4].all()
            want = _sgd_rows(config, "C1", ids, grads)
            np.testing.assert_allclose(values[found], want[found], rtol=0, atol=1e-6)
            # The same push again through the client: StoreFullError at once (journaled: its
            # rows are held by the failed write; else: the node refuses it again).
            error, client_s = asyncio.run(_client_push(config, "C1", ids, grads, push_id))
            assert isinstance(error, StoreFullError), repr(error)
            assert error.node == small.address and small.address in str(error)
            if journaled:
                assert f"held by push {push_id!r}" in str(error)
            assert client_s < MARGIN_S
            assert node_stats(small.address)["evictions"] == 0
            loop.run_until_complete(reader.close())
    finally:
        loop.close()
        big.terminate()
        small.terminate()
        big.stop()
        small.stop()


@pytest.mark.timeout(90)
async def test_failed_journaled_write_fails_other_pushes_fast_then_finishes_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push journaled on a healthy node whose rows a full node refuses: the replica
    answers StoreFullError, replays the push in the background, and meanwhile fails fast
    (not waits, possibly forever) for a push that needs its rows, or a journal slot when
    every slot is held so. Once the node has room, the push lands exactly once."""
    from optimizer_service.engine import journal
    from optimizer_service.engine.updater import Updater
    from optimizer_service.push import Push, TableGrads
    from tests.conftest import make_config

    monkeypatch.setattr(journal, "JOURNAL_SLOTS", 1)  # one stuck push holds every slot
    big = start_memcached(memory_mb=64)
    small: MemcachedProcess | None = None
    try:
        # Deterministic: the node addresses are chosen so that the journal of slot 0
        # lives on the healthy node, which journals the push; the full node then refuses
        # its rows. (With other addresses the journal may fail first: nothing written.)
        for _ in range(200):
            port = free_port()
            if _meta_on(0, ["r0-j0", "r0-j0-c0"], [big.address, f"127.0.0.1:{port}"]):
                break
        small = start_memcached(port=port, memory_mb=2)
        nodes = [big.address, small.address]
        # written through: a push writes its rows (the replay of a journaled push whose
        # write failed); rows written behind are written by a flush (test_row_write_behind)
        config = make_config(
            nodes, tables=TABLES, store={"timeout_s": 2.0}, service={"row_flush_pushes": 1}
        )
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
            with pytest.raises(StoreFullError):
                for start in range(0, 10**7, 20_000):
                    await store.lookup("C3", np.arange(start, start + 20_000, dtype=np.int64))
            updater = Updater(config, store)
            await updater.recover()
            try:
                ids = _ids_on("C1", 1, nodes, 4, start=10**12)
                grads = np.full((4, 16), 2.0, dtype=np.float32)
                stuck = Push(
                    push_id=_push_id_on(0, nodes, "stuck"),
                    worker=0,
                    version=0,
                    tables=(TableGrads("C1", ids, grads),),
                )
                with pytest.raises(StoreFullError, match=f"{small.address} is out of memory"):
                    await updater.apply(stuck)
                assert len(updater.state.finishers) == 1  # journaled, replayed in the background
                other_ids = _ids_on("C1", 0, nodes, 4, start=10**13)
                other = Push(
                    push_id=_push_id_on(0, nodes, "other"),
                    worker=0,
                    version=0,
                    tables=(TableGrads("C1", other_ids, grads),),
                )
                async with asyncio.timeout(MARGIN_S):  # no waiting for the replay
                    for push in (stuck, other):  # its rows; the only journal slot
                        with pytest.raises(StoreFullError) as info:
                            await updater.apply(push)
                        assert f"held by push {stuck.push_id!r}" in str(info.value)
                        assert info.value.node == small.address
                values, found = await store.get("C1", ids)
                assert not found.any()

                # room on the full node: the replay lands, exactly once
                keys = [
                    k
                    for k in await metadump_keys(small.address)
                    if k.startswith(f"{config.namespace}/C3/w/".encode())
                ]
                delete_keys(small.address, keys)
                done, _ = await asyncio.wait(updater.state.finishers, timeout=30)
                assert len(done) == 1 and not updater.state.finishers
                assert (await updater.apply(stuck)).duplicate
                assert (await updater.apply(other)).applied
                for pushed in (ids, other_ids):
                    values, found = await store.get("C1", pushed)
                    assert found.all()
                    np.testing.assert_allclose(
                        values, _sgd_rows(config, "C1", pushed, grads), rtol=0, atol=1e-6
                    )
            finally:
                for task in list(updater.state.finishers):
                    task.cancel()
                await updater.close()
    finally:
        big.terminate()
        if small is not None:
            small.terminate()
            small.stop()
        big.stop()


@pytest.mark.timeout(120)
async def test_full_node_stops_training_written_behind_and_loses_nothing() -> None:
    """Rows written behind, a `-M` node with no room for them: pushes are applied, their
    values kept in the replica and its journals, while the flush fails and retries. Once
    the flushes lag by the journal slots' margin, every push is refused (StoreFullError
    naming the node, not applied; a push whose journal would land on the full node is
    refused so at once): training stops, it does not run on unwritten. Nothing is
    evicted. With room again, each refused push, retried, applies exactly once, and the
    next flush writes every row at its newest value."""
    from lookup_table.core.optimizers import make_optimizer
    from optimizer_service.engine.updater import Updater
    from optimizer_service.push import Push, TableGrads
    from tests.conftest import make_config

    big = start_memcached(memory_mb=64)
    small = start_memcached(memory_mb=2, extra_args=("-o", "slab_automove=0"))
    try:
        nodes = [big.address, small.address]
        config = make_config(
            nodes,
            tables=TABLES,
            store={"timeout_s": 2.0},
            service={"row_flush_pushes": 2, "row_flush_s": 600.0},
        )
        spec = config.table("C1")
        ids = np.concatenate(
            [_ids_on("C1", 0, nodes, 8, start=10**12), _ids_on("C1", 1, nodes, 8, start=10**12)]
        )
        sgd = make_optimizer(spec.optimizer)
        want = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=spec.dim)
        rng = np.random.default_rng(5)
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
            with pytest.raises(StoreFullError):  # every page of the small node taken
                for start in range(0, 10**7, 20_000):
                    await store.lookup("C3", np.arange(start, start + 20_000, dtype=np.int64))
            updater = Updater(config, store)
            await updater.recover()
            try:
                refused: list[tuple[Push, np.ndarray]] = []
                applied = 0
                for i in range(80):
                    grads = rng.standard_normal((ids.size, spec.dim)).astype(np.float32)
                    push = Push(
                        push_id=f"full-{i}",
                        worker=0,
                        version=0,
                        tables=(TableGrads("C1", ids, grads),),
                    )
                    try:
                        await updater.apply(push)
                    except StoreFullError as exc:
                        assert exc.node == small.address, exc
                        assert f"memcached node {small.address} is out of memory" in str(exc)
                        refused.append((push, grads))
                        if len(refused) >= 3 and refused[-3][0].push_id == f"full-{i - 2}":
                            break  # three in a row: the flushes lag, every push refused
                    else:
                        applied += 1
                        want = sgd.update(want, grads, np.empty((ids.size, 0), np.float32))[0]
                else:
                    raise AssertionError("pushes never stopped while the node was full")
                assert applied > 2  # journals on the healthy node kept the rows meanwhile
                assert node_stats(small.address)["evictions"] == 0

                # room on the full node: the flush lands, every refused push applies once
                keys = [
                    k
                    for k in await metadump_keys(small.address)
                    if k.startswith(f"{config.namespace}/C3/w/".encode())
                ]
                delete_keys(small.address, keys)
                for push, grads in refused:
                    assert (await updater.apply(push)).applied
                    assert (await updater.apply(push)).duplicate
                    want = sgd.update(want, grads, np.empty((ids.size, 0), np.float32))[0]
                await updater.pause()  # the flush: memcached holds the newest rows
                values, found = await store.get("C1", ids)
                assert found.all()
                np.testing.assert_allclose(values, want, rtol=0, atol=1e-5)
                updater.resume()
            finally:
                await updater.close()
    finally:
        big.terminate()
        small.terminate()
        big.stop()
        small.stop()


async def test_unfinished_push_blocks_a_save_and_a_restore_drops_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, aiohttp_server: Any
) -> None:
    """A push whose write a full node refused is replayed in the background: a save then
    refuses (its rows are half written) instead of hanging in the pause, and a restore
    cancels the replay before it writes, so no pre-restore row lands over the restored
    ones, even once the node has room again."""
    import dataclasses

    from prometheus_client import CollectorRegistry

    from lookup_table.errors import CheckpointError
    from lookup_table.ops.checkpoint import restore_checkpoint_async
    from optimizer_service.app import UPDATER, make_app
    from optimizer_service.engine import journal
    from tests.conftest import make_config

    monkeypatch.setattr(journal, "JOURNAL_SLOTS", 1)
    big = start_memcached(memory_mb=64)
    small: MemcachedProcess | None = None
    try:
        for _ in range(200):  # slot 0's journal on the healthy node (see the test above)
            port = free_port()
            if _meta_on(0, ["r0-j0", "r0-j0-c0"], [big.address, f"127.0.0.1:{port}"]):
                break
        small = start_memcached(port=port, memory_mb=2)
        nodes = [big.address, small.address]
        config = make_config(
            nodes,
            tables=TABLES,
            store={"timeout_s": 2.0},
            optimizers=["http://127.0.0.1:1"],
            service={"row_flush_pushes": 1},  # written through (see the test above)
        )
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
            with pytest.raises(StoreFullError):
                for start in range(0, 10**7, 20_000):
                    await store.lookup("C3", np.arange(start, start + 20_000, dtype=np.int64))
        app = make_app(config, registry=CollectorRegistry())
        server = await aiohttp_server(app)
        config = dataclasses.replace(config, optimizers=(str(server.make_url("")).rstrip("/"),))
        ck = tmp_path / "ck"
        await save_checkpoint_async(config, ck, progress=False)

        ids = _ids_on("C1", 1, nodes, 4, start=10**12)
        grads = np.full((4, 16), 2.0, dtype=np.float32)
        async with OptimizerClient(config, max_retries=0) as client:
            with pytest.raises(StoreFullError, match=small.address):
                await client.push({"C1": (ids, grads)}, push_id=_push_id_on(0, nodes, "stuck"))
        updater = app[UPDATER]
        assert len(updater.state.finishers) == 1  # journaled, replayed in the background

        async with asyncio.timeout(MARGIN_S + 5):  # refused, not hung in the pause
            with pytest.raises(CheckpointError, match="replica 0: 1; see their logs"):
                await save_checkpoint_async(config, tmp_path / "ck2", progress=False)
        assert not (tmp_path / "ck2").exists() and not updater.paused

        summary = await restore_checkpoint_async(config, ck, force=True, progress=False)
        assert summary["replicas_reloaded"] == list(config.optimizers)
        assert not updater.state.finishers and updater.locks.held == 0 and not updater.paused
        # the checkpoint filled the node again: make room, so a replay still alive would
        # now write its rows
        keys = [
            k
            for k in await metadump_keys(small.address)
            if k.startswith(f"{config.namespace}/C3/w/".encode())
        ]
        delete_keys(small.address, keys)
        await asyncio.sleep(1.0)
        async with EmbeddingStore(config) as store:
            _, found = await store.get("C1", ids)
            assert not found.any(), "the dropped replay wrote pre-restore rows"
        async with OptimizerClient(config, max_retries=0) as client:  # not blocked any more
            result = await client.push({"C1": (ids, grads)})
            assert result["applied"]
        async with EmbeddingStore(config) as store:
            values, found = await store.get("C1", ids)
        assert found.all()
        np.testing.assert_allclose(values, _sgd_rows(config, "C1", ids, grads), atol=1e-6)
    finally:
        big.terminate()
        if small is not None:
            small.terminate()
            small.stop()
        big.stop()
