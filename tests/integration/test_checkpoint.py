"""Checkpoints against real memcached and the real service: consistent, exact, node-count free."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from lookup_table import (
    CheckpointError,
    EmbeddingStore,
    NamespaceNotEmptyError,
    PushRejectedError,
)
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig
from lookup_table.core.keyspace import META_TABLE
from lookup_table.core.optimizers import make_optimizer
from lookup_table.dense import DenseParams
from lookup_table.ops.checkpoint import (
    MANIFEST,
    namespace_keys,
    restore_checkpoint_async,
    save,
    save_checkpoint_async,
    unpack_str_ids,
)
from lookup_table.ops.checkpoint.cli import main
from lookup_table.ops.localcluster import free_port, memcached_cluster
from optimizer_service.app import make_app
from tests.conftest import make_config, written

pytestmark = pytest.mark.integration

TABLES: list[dict[str, Any]] = [
    {"name": "user", "dim": 8, "seed": 1},  # adam: slots (m, v, step) of 17 floats
    {"name": "word", "dim": 4, "seed": 2, "id_type": "string"},  # adam, string ids
    {"name": "plain", "dim": 4, "seed": 3, "optimizer": {"name": "sgd", "learning_rate": 0.1}},
]
WORDS = [
    ["a b", "x/y", "ünï", "nul\x00"],
    ["日本", "", "100%", "tab\t", "😀"],
]
DENSE = {"dense/kernel": np.ones((3, 4), np.float32), "bias": np.zeros(4, np.float32)}
ADAM_STEP = {"user": 2 * 8, "word": 2 * 4}  # the column of the row's step in its slots


def _config(nodes: list[str], **kw: Any) -> ClusterConfig:
    kw.setdefault("optimizers", ["http://127.0.0.1:1"])
    return make_config(nodes, tables=TABLES, **kw)


def _on(config: ClusterConfig, addresses: list[str]) -> ClusterConfig:
    """The same namespace and tables on other nodes, without replicas."""
    nodes = make_config(addresses, tables=TABLES).memcached
    return dataclasses.replace(config, memcached=nodes, optimizers=())


async def _serve(config: ClusterConfig, aiohttp_server: Any) -> ClusterConfig:
    """Start replica 0 on `config`'s nodes; return the config pointing at it."""
    async with EmbeddingStore(config) as store:
        if any(v is None for v in (await store.sentinels()).values()):
            await store.write_sentinels()
    server: TestServer = await aiohttp_server(
        make_app(config, replica=0, registry=CollectorRegistry())
    )
    return dataclasses.replace(config, optimizers=(str(server.make_url("")).rstrip("/"),))


def _user_ids(worker: int) -> np.ndarray:
    return np.arange(24, dtype=np.int64) * 7919 + 1_000_000 * worker - 5


async def _push(client: OptimizerClient, worker: int, rng: np.random.Generator) -> None:
    users, words = _user_ids(worker), WORDS[worker]
    await client.push(
        {
            "user": (users, rng.standard_normal((users.size, 8)).astype(np.float32)),
            "word": (words, rng.standard_normal((len(words), 4)).astype(np.float32)),
            "plain": (users[:5], rng.standard_normal((5, 4)).astype(np.float32)),
        },
        dense={n: rng.standard_normal(v.shape).astype(np.float32) for n, v in DENSE.items()},
    )


def _load(directory: Path, name: str) -> np.ndarray:
    return np.load(directory / name, allow_pickle=False)


def _ids(directory: Path, table: dict[str, Any]) -> np.ndarray:
    files = table["files"]
    if table["id_type"] == "int64":
        return _load(directory, files["ids"])
    return unpack_str_ids(
        _load(directory, files["ids_utf8"]), _load(directory, files["ids_offsets"])
    )


def _listdir(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


async def _assert_store_equals_checkpoint(config: ClusterConfig, directory: Path) -> None:
    """Every row, slot, dense parameter and version in memcached equals the files, bit for bit."""
    manifest = json.loads((directory / MANIFEST).read_text())
    async with EmbeddingStore(config) as store:
        assert all(v is not None for v in (await store.sentinels()).values())
        for table in manifest["tables"]:
            name, ids = table["name"], _ids(directory, table)
            rows, found = await store.get(name, ids, width=table["dim"])
            assert found.all(), name
            assert np.array_equal(_bits(rows), _bits(_load(directory, table["files"]["rows"])))
            if table["slot_width"]:
                items, _ = await store.get(name, ids, slots=True)
                slots = items[:, table["dim"] :]
                has = _load(directory, table["files"]["has_slots"])
                saved = _load(directory, table["files"]["slots"])
                assert np.array_equal(_bits(slots[has]), _bits(saved[has]))
                # a row saved without slots (storage format 1) has the initial ones
                optimizer = make_optimizer(config.table(name).optimizer)
                fresh = optimizer.initial_slots(int((~has).sum()), table["dim"])
                assert np.array_equal(_bits(slots[~has]), _bits(fresh))
        state = await DenseParams(store, make_optimizer(config.optimizer)).read(with_slots=True)
        assert state is not None and state.version == manifest["dense"]["version"]
        for p in manifest["dense"]["params"]:
            assert np.array_equal(
                _bits(state.params[p["name"]]), _bits(_load(directory, p["file"]))
            )
            saved_slots = _load(directory, p["slots_file"])
            assert np.array_equal(_bits(state.slots[p["name"]]), _bits(saved_slots))
        names = [f"version-r{k}" for k in manifest["replica_versions"]]
        values = await store.get_blobs(META_TABLE, names, kind="m")
        assert [int(v) for v in values if v] == list(manifest["replica_versions"].values())


@pytest.fixture
async def trained(memcached_nodes: list[str], aiohttp_server: Any) -> AsyncIterator[ClusterConfig]:
    """A served namespace on the shared 2 nodes, after a few pushes of both workers."""
    config = await _serve(_config(memcached_nodes), aiohttp_server)
    rng = np.random.default_rng(1)
    async with OptimizerClient(config) as client:
        await client.dense_init(DENSE)
        for _ in range(3):
            await _push(client, 0, rng)
            await _push(client, 1, rng)
    yield config


async def test_save_while_two_trainers_push_is_consistent_and_restores_into_3_nodes(
    trained: ClusterConfig, tmp_path: Path
) -> None:
    config = trained
    stop = asyncio.Event()
    pushes = [0, 0]
    pushed = asyncio.Condition()

    async def trainer(worker: int) -> None:
        rng = np.random.default_rng(10 + worker)
        async with OptimizerClient(config, worker=worker) as client:
            while not stop.is_set():
                await _push(client, worker, rng)
                async with pushed:
                    pushes[worker] += 1
                    pushed.notify_all()

    trainers = [asyncio.create_task(trainer(w)) for w in (0, 1)]
    try:
        async with pushed:
            await pushed.wait_for(lambda: min(pushes) >= 3)
        manifest = await save_checkpoint_async(config, tmp_path / "ck", progress=False)
        at_save = list(pushes)
        async with pushed:  # the replicas resumed: both trainers go on
            await pushed.wait_for(lambda: min(pushes[0] - at_save[0], pushes[1] - at_save[1]) >= 2)
    finally:
        stop.set()
        await asyncio.gather(*trainers)
    ck = tmp_path / "ck"
    assert manifest["paused"] and (ck / MANIFEST).is_file()
    assert _listdir(tmp_path) == ["ck"]  # no partial directory left behind

    # Consistent: every push is wholly in or wholly out. Each worker pushes the same
    # rows every time, so all its rows have one Adam step, and the dense step (= the
    # version) is the sum of both workers' steps.
    by_name = {t["name"]: t for t in manifest["tables"]}
    steps = []
    for worker in (0, 1):
        worker_steps = set()
        for name, ids in (("user", _user_ids(worker)), ("word", WORDS[worker])):
            table = by_name[name]
            all_ids = _ids(ck, table).tolist()
            index = [all_ids.index(i) for i in (ids.tolist() if name == "user" else ids)]
            slots = _load(ck, table["files"]["slots"])[index]
            worker_steps |= set(slots[:, ADAM_STEP[name]].tolist())
        assert len(worker_steps) == 1, worker_steps
        steps.append(int(worker_steps.pop()))
    dense = manifest["dense"]
    assert min(steps) >= 3 + 3 and dense["version"] == sum(steps)
    for p in dense["params"]:
        assert _load(ck, p["slots_file"])[0, -1] == dense["version"]
    assert manifest["replica_versions"] == {"0": dense["version"]}
    assert {p["name"] for p in dense["params"]} == set(DENSE)
    assert by_name["plain"]["slot_width"] == 0 and "slots" not in by_name["plain"]["files"]
    assert by_name["word"]["count"] == len(WORDS[0]) + len(WORDS[1])

    with memcached_cluster(3) as servers:
        three = _on(config, [s.address for s in servers])
        summary = await restore_checkpoint_async(three, ck, progress=False)
        assert summary["rows"] == sum(t["count"] for t in manifest["tables"])
        assert set(summary["sentinels"].values()) == {True}
        await _assert_store_equals_checkpoint(three, ck)


async def test_3_to_1_nodes_gives_the_same_files_and_training_goes_on(
    trained: ClusterConfig, tmp_path: Path, aiohttp_server: Any
) -> None:
    first = await save_checkpoint_async(trained, tmp_path / "from2", progress=False)
    with memcached_cluster(3) as three_servers, memcached_cluster(1) as one_server:
        three = _on(trained, [s.address for s in three_servers])
        await restore_checkpoint_async(three, tmp_path / "from2", progress=False)
        second = await save_checkpoint_async(three, tmp_path / "from3", progress=False)
        assert second["nodes_at_save"] == 3 and not second["paused"]  # no replicas to pause
        assert second["files"] == first["files"]  # the files do not depend on the nodes

        one = _on(trained, [one_server[0].address])
        await restore_checkpoint_async(one, tmp_path / "from3", progress=False)
        await _assert_store_equals_checkpoint(one, tmp_path / "from3")

        # a replica started on the restored node picks up where the checkpoint left off
        served = await _serve(
            dataclasses.replace(one, optimizers=("http://127.0.0.1:1",)), aiohttp_server
        )
        ck = tmp_path / "from3"
        user = next(t for t in first["tables"] if t["name"] == "user")
        ids = _ids(ck, user)[:6]
        index = np.arange(6)
        rows = _load(ck, user["files"]["rows"])[index]
        slots = _load(ck, user["files"]["slots"])[index]
        assert _load(ck, user["files"]["has_slots"])[index].all()
        grads = np.full((6, 8), 0.25, np.float32)
        want_rows, want_slots = make_optimizer(one.table("user").optimizer).update(
            rows, grads, slots
        )
        async with OptimizerClient(served) as client:
            version, _ = await client.dense()
            assert version == first["dense"]["version"]
            result = await client.push(
                {"user": (ids, grads)},
                dense={n: np.ones_like(v) for n, v in DENSE.items()},
            )
            assert result["applied"] and result["version"] == version + 1
        await written(served)
        async with EmbeddingStore(one) as store:
            got, _ = await store.get("user", ids, slots=True)
            got_rows, got_slots = got[:, :8], got[:, 8:]
        assert np.array_equal(_bits(got_rows), _bits(want_rows))
        assert np.array_equal(_bits(got_slots), _bits(want_slots))


async def test_restore_pauses_and_reloads_running_replicas(
    trained: ClusterConfig, tmp_path: Path
) -> None:
    """A replica that kept training past the checkpoint serves the restored version and rows
    right after the restore, with no restart; a replica that is not running is reported."""
    ck = tmp_path / "ck"
    first = await save_checkpoint_async(trained, ck, progress=False)
    saved_version = first["dense"]["version"]
    rng = np.random.default_rng(7)
    async with OptimizerClient(trained) as client:
        for _ in range(3):
            await _push(client, 0, rng)
        assert await client.version() == saved_version + 3

        # its replica not running (its URL taken by nothing): reported, the rows restored
        down = f"http://127.0.0.1:{free_port()}"
        with_down = dataclasses.replace(trained, optimizers=(down,))
        summary = await restore_checkpoint_async(with_down, ck, force=True, progress=False)
        assert summary["replicas_reloaded"] == []
        assert summary["replicas_not_running"] == [down]
        summary = await restore_checkpoint_async(trained, ck, force=True, progress=False)
        assert summary["replicas_reloaded"] == list(trained.optimizers)
        assert summary["replicas_not_running"] == []
        await _assert_store_equals_checkpoint(trained, ck)
        assert await client.version() == saved_version  # went back with the rows

        user = next(t for t in first["tables"] if t["name"] == "user")
        ids = _ids(ck, user)[:5]
        rows = _load(ck, user["files"]["rows"])[:5]
        slots = _load(ck, user["files"]["slots"])[:5]
        grads = np.full((5, 8), -0.5, np.float32)
        want_rows, want_slots = make_optimizer(trained.table("user").optimizer).update(
            rows, grads, slots
        )
        result = await client.push(
            {"user": (ids, grads)}, dense={n: np.ones_like(v) for n, v in DENSE.items()}
        )
        assert result["applied"] and result["version"] == saved_version + 1
    await written(trained)
    async with EmbeddingStore(trained) as store:
        got, _ = await store.get("user", ids, slots=True)
        got_rows, got_slots = got[:, :8], got[:, 8:]
    assert np.array_equal(_bits(got_rows), _bits(want_rows))
    assert np.array_equal(_bits(got_slots), _bits(want_slots))


@pytest.mark.parametrize("pause", [True, False], ids=["paused", "no-pause"])
async def test_a_dense_push_after_a_restore_starts_from_the_restored_parameters(
    pause: bool, trained: ClusterConfig, tmp_path: Path
) -> None:
    """Replica 0 serves the dense parameters from memory: after a restore (also one with
    `--no-pause`, which does not reload the replica) it serves and updates the restored
    ones, not those it trained past the checkpoint."""
    ck = tmp_path / "ck"
    dense = (await save_checkpoint_async(trained, ck, progress=False))["dense"]
    restored = {p["name"]: _load(ck, p["file"]) for p in dense["params"]}
    restored_slots = {p["name"]: _load(ck, p["slots_file"]) for p in dense["params"]}
    rng = np.random.default_rng(11)
    async with OptimizerClient(trained) as client:
        for _ in range(2):
            await _push(client, 0, rng)
        version, before = await client.dense()
        assert version == dense["version"] + 2
        await restore_checkpoint_async(trained, ck, force=True, pause=pause, progress=False)
        version, now = await client.dense()
        assert version == dense["version"]
        for name, value in restored.items():
            assert np.array_equal(_bits(now[name]), _bits(value)), name
        grads = {n: np.full(v.shape, 0.25, np.float32) for n, v in restored.items()}
        result = await client.push({}, dense=grads)
        if pause:  # (without the reload the replica keeps answering its own, higher version)
            assert result["version"] == dense["version"] + 1
        version, now = await client.dense()
        assert version == dense["version"] + 1
    adam = make_optimizer(trained.optimizer)
    for name, value in restored.items():
        want, _ = adam.update(
            value.reshape(1, -1), grads[name].reshape(1, -1), restored_slots[name]
        )
        assert np.array_equal(_bits(now[name]), _bits(want.reshape(value.shape))), name


async def test_resume_with_reload_needs_a_paused_replica(trained: ClusterConfig) -> None:
    async with OptimizerClient(trained, max_retries=0) as client:
        with pytest.raises(PushRejectedError, match="reload=1 needs a paused replica"):
            await client.resume(reload=True)
        await client.pause(timeout_s=30)
        await client.resume(reload=True)
        await _push(client, 0, np.random.default_rng(3))  # not left paused


def _write_toml(path: Path, config: ClusterConfig) -> Path:
    lines = [f'namespace = "{config.namespace}"']
    lines.append("memcached = [" + ", ".join(f'"{a}"' for a in config.node_addresses) + "]")
    for table in TABLES:
        lines.append("[[tables]]")
        for key, value in table.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {inner} }}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
async def saved(trained: ClusterConfig, tmp_path: Path) -> Path:
    await save_checkpoint_async(trained, tmp_path / "ck", progress=False)
    return tmp_path / "ck"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("flip", "tables/user/rows.npy: sha256"),
        ("delete", "tables/word/ids_utf8.npy: missing (the checkpoint is partial)"),
        ("truncate", "manifest.json: not valid JSON (truncated or corrupt?)"),
    ],
)
async def test_a_corrupt_checkpoint_is_refused_and_nothing_is_written(
    saved: Path, tmp_path: Path, damage: str, message: str
) -> None:
    if damage == "flip":
        path = saved / "tables/user/rows.npy"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "delete":
        (saved / "tables/word/ids_utf8.npy").unlink()
    else:
        manifest = saved / MANIFEST
        manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    with memcached_cluster(1) as servers:
        target = make_config([servers[0].address], tables=TABLES)
        toml = _write_toml(tmp_path / "target.toml", target)
        code, err = await asyncio.to_thread(
            _cli, ["restore", "--config", str(toml), "--dir", str(saved)]
        )
        assert code == 1 and message in err, err
        async with EmbeddingStore(target, check_sentinels=False) as store:
            assert all(found.count == 0 for found in (await namespace_keys(store)).values())


def _cli(argv: list[str]) -> tuple[int, str]:
    """Run the console script's main (its own event loop: call it in a thread)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([*argv, "--no-progress"] if argv[0] != "export" else argv)
    return code, err.getvalue()


async def test_restore_into_a_namespace_with_data_needs_force(saved: Path, tmp_path: Path) -> None:
    with memcached_cluster(2) as servers:
        target = make_config([s.address for s in servers], tables=TABLES)
        async with EmbeddingStore(target) as store:
            await store.write_sentinels()
            await store.lookup("user", [424242, 7])  # rows the checkpoint does not have
            await store.set_blobs(META_TABLE, ["r0-j0"], [b"stale journal"], kind="j")
        with pytest.raises(NamespaceNotEmptyError, match=r"already holds 3 keys .*--force"):
            await restore_checkpoint_async(target, saved, progress=False)
        toml = _write_toml(tmp_path / "target.toml", target)
        code, err = await asyncio.to_thread(
            _cli, ["restore", "--config", str(toml), "--dir", str(saved)]
        )
        assert code == 1 and "--force" in err
        summary = await restore_checkpoint_async(target, saved, force=True, progress=False)
        assert summary["deleted_keys"] == 3 + 2  # the rows, the journal, two sentinels
        await _assert_store_equals_checkpoint(target, saved)
        async with EmbeddingStore(target) as store:
            _, found = await store.get("user", [424242])
            assert not found.any()  # rows trained after the checkpoint do not survive
            assert await store.get_blobs(META_TABLE, ["r0-j0"], kind="j") == [None]
        # a restore into an initialized but empty namespace needs no force
        fresh = dataclasses.replace(target, namespace=target.namespace + "b")
        async with EmbeddingStore(fresh) as store:
            await store.write_sentinels()
        await restore_checkpoint_async(fresh, saved, progress=False)
        await _assert_store_equals_checkpoint(fresh, saved)


async def test_string_ids_round_trip_exactly_through_files_nodes_and_export(
    memcached_nodes: list[str], tmp_path: Path
) -> None:
    ids = ["a b", "x/y", "ünï", "日本", "nul\x00", "\x00", "", "100%", "tab\t", "a\r\nb", "😀", "7"]
    config = _config(memcached_nodes, optimizers=[])
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        rows = await store.lookup("word", ids)
        await store.lookup("user", [7])  # int 7 and str "7" are different ids
    manifest = await save_checkpoint_async(config, tmp_path / "ck", progress=False)
    word = next(t for t in manifest["tables"] if t["name"] == "word")
    saved_ids = _ids(tmp_path / "ck", word).tolist()
    assert saved_ids == sorted(ids) and word["count"] == len(ids)
    with memcached_cluster(3) as servers:
        three = _on(config, [s.address for s in servers])
        await restore_checkpoint_async(three, tmp_path / "ck", progress=False)
        async with EmbeddingStore(three) as store:
            back, found = await store.get("word", ids)
        assert found.all() and np.array_equal(_bits(back), _bits(rows))

    out = tmp_path / "model.npz"
    code, _ = await asyncio.to_thread(
        _cli, ["export", "--dir", str(tmp_path / "ck"), "--out", str(out)]
    )
    assert code == 0
    with np.load(out, allow_pickle=False) as npz:
        exported = unpack_str_ids(npz["word/ids_utf8"], npz["word/ids_offsets"]).tolist()
        assert exported == sorted(ids)
        order = [ids.index(i) for i in exported]
        assert np.array_equal(_bits(npz["word/rows"]), _bits(rows[order]))
        assert npz["user/ids"].tolist() == [7]
        assert json.loads(npz[MANIFEST].tobytes())["namespace"] == config.namespace


async def test_a_failed_save_leaves_no_directory(
    memcached_nodes: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(memcached_nodes, optimizers=[])
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("user", np.arange(100))

    async def broken(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(save, "_save_dense", broken)
    with pytest.raises(OSError, match="disk full"):
        await save_checkpoint_async(config, tmp_path / "ck", progress=False)
    assert _listdir(tmp_path) == []
    monkeypatch.undo()
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "x").write_text("")
    with pytest.raises(CheckpointError, match="already exists"):
        await save_checkpoint_async(config, tmp_path / "ck", progress=False)
    (tmp_path / "ck" / "x").unlink()
    await save_checkpoint_async(config, tmp_path / "ck", progress=False)  # an empty dir is fine
    assert (tmp_path / "ck" / MANIFEST).is_file()
