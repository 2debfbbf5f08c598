"""Rows stored as float16 or bfloat16, and the row-wise optimizers' items, in real memcached:
the bytes of an item as the layout says, float32 rows back, and a namespace that refuses a
cluster file with another row dtype or optimizer for a table it holds."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from prometheus_client import CollectorRegistry

from lookup_table import (
    CheckpointError,
    EmbeddingStore,
    StorageFormatError,
    encode_key,
    initial_rows,
)
from lookup_table.config import ClusterConfig, RowwiseAdagradConfig, TableSpec
from lookup_table.core.hashing import id_hashes
from lookup_table.core.keys import as_ids
from lookup_table.core.optimizers import make_optimizer, step_slot
from lookup_table.core.optimizers.layout import decode_items, encode_items, value_bytes
from lookup_table.core.precision import round_to, rounding_keys
from lookup_table.core.rows import value_hashes
from lookup_table.core.sharding import node_of
from lookup_table.core.wire import CONTENT_TYPE
from lookup_table.ops.admin import init_cluster
from lookup_table.ops.checkpoint import restore_checkpoint_async, save_checkpoint_async
from lookup_table.ops.stats import render_stats, table_stats
from optimizer_service.app import make_app
from optimizer_service.engine.journal import Journal
from tests.conftest import make_config, raw_client
from tests.integration.test_service import _body

pytestmark = pytest.mark.integration

# the compact options of the crash tests (test_journal_replay, test_row_write_behind)
PRECISE: dict[str, tuple[str, dict[str, Any]]] = {
    "float16-rowwise_adam": ("float16", {"name": "rowwise_adam", "learning_rate": 0.01}),
    "float16-rowwise_adagrad": ("float16", {"name": "rowwise_adagrad", "learning_rate": 0.1}),
    "bfloat16-adam": ("bfloat16", {"name": "adam", "learning_rate": 0.01}),
}


def as_stored(
    spec: TableSpec,
    ids: Any,
    old_slots: NDArray[np.float32],
    new_rows: NDArray[np.float32],
    new_slots: NDArray[np.float32],
) -> NDArray[np.float32]:
    """A step's new rows as a table of `spec` stores them: rounded stochastically, keyed
    by the row's step before the update (optimizers that count them) or the hash of its
    new slots (the others)."""
    if spec.dtype == "float32":
        return new_rows
    column = step_slot(make_optimizer(spec.optimizer), spec.dim)
    steps = old_slots[:, column].astype(np.int64) if column is not None else value_hashes(new_slots)
    keys = rounding_keys(spec.seed, id_hashes(as_ids(ids)), steps)
    return round_to(new_rows, spec.dtype, rounding="stochastic", keys=keys)


OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adam": {"name": "adam"},
    "sgd": {"name": "sgd"},
    "rowwise_adagrad": {"name": "rowwise_adagrad"},
    "rowwise_adam": {"name": "rowwise_adam"},
}


def _raw(config: ClusterConfig, table: str, id_: int) -> bytes | None:
    node = config.node_addresses[int(node_of(table, np.array([id_]), config.node_addresses)[0])]
    with raw_client(node) as client:
        value: bytes | None = client.get(encode_key(config.namespace, table, "w", id_))
        return value


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
async def test_items_are_stored_as_their_layout_says_and_read_back_as_float32(
    memcached_nodes: list[str], dtype: str, optimizer: str
) -> None:
    dim = 3  # odd: a 16-bit row is not a whole number of float32
    table = {"name": "t", "dim": dim, "dtype": dtype, "optimizer": OPTIMIZERS[optimizer]}
    config = make_config(memcached_nodes, tables=[table])
    spec = config.table("t")
    opt = make_optimizer(spec.optimizer)
    ids = np.array([7, -2, 7, 40], dtype=np.int64)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        rows = await store.lookup("t", ids)
        assert rows.dtype == np.float32 and rows.shape == (4, dim)
        initial = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=dim)
        expected = initial if dtype == "float32" else round_to(initial, dtype)  # type: ignore[arg-type]
        np.testing.assert_array_equal(rows, expected)
        np.testing.assert_array_equal(await store.lookup("t", ids), rows)  # read back: same
        items = np.concatenate([expected[:1], opt.initial_slots(1, dim)], axis=1)
        stored = encode_items(items, opt, dim, spec.dtype).tobytes()
        assert _raw(config, "t", 7) == stored
        assert len(stored) == value_bytes(opt, dim, spec.dtype)

        # rows and slots written are read back with their slots, as stored
        new_rows = np.array([[0.1, -2.5, 3e-3], [1.0, 2.0, -0.333]], dtype=np.float32)
        slots = np.abs(np.random.default_rng(1).normal(size=(2, opt.slot_width(dim))))
        slots = slots.astype(np.float32)
        both = np.concatenate([new_rows, slots], axis=1)
        as_stored = decode_items(encode_items(both, opt, dim, spec.dtype), opt, dim, spec.dtype)
        await store.set("t", [7, 40], new_rows, slots=slots)
        got, found = await store.get("t", [40, 7, 99], slots=True)
        assert found.tolist() == [True, True, False]
        np.testing.assert_array_equal(got[:2], as_stored[::-1])
        assert not got[2].any()
        plain, _ = await store.get("t", [7, 40])
        np.testing.assert_array_equal(plain, as_stored[:, :dim])


async def test_one_read_of_tables_of_equal_value_sizes_decodes_each_as_its_own(
    memcached_nodes: list[str],
) -> None:
    # 32 bytes a row both: float32 dim 8, float16 dim 16 (sgd: no slots)
    tables = [
        {"name": "a", "dim": 8, "optimizer": {"name": "sgd"}},
        {"name": "b", "dim": 16, "dtype": "float16", "optimizer": {"name": "sgd"}},
        {"name": "c", "dim": 16, "dtype": "bfloat16", "optimizer": {"name": "sgd"}},
    ]
    config = make_config(memcached_nodes, tables=tables)
    ids = np.arange(50, dtype=np.int64)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        first = await store.lookup_many({"a": ids, "b": ids, "c": ids})
        again = await store.lookup_many({"a": ids, "b": ids, "c": ids}, create=False)
    for name in ("a", "b", "c"):
        spec = config.table(name)
        initial = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=spec.dim)
        expected = initial if spec.dtype == "float32" else round_to(initial, spec.dtype)
        np.testing.assert_array_equal(first[name], expected)
        np.testing.assert_array_equal(again[name], expected)


async def test_ttl_and_admission_with_half_precision_rows(memcached_nodes: list[str]) -> None:
    tables = [
        {"name": "t", "dim": 4, "dtype": "float16", "ttl_s": 600, "admit_after": 2},
    ]
    config = make_config(memcached_nodes, tables=tables)
    spec = config.table("t")
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        first = await store.lookup("t", [5])
        assert _raw(config, "t", 5) is None  # one sighting: counted, not stored
        second = await store.lookup("t", [5])
        np.testing.assert_array_equal(first, second)
    initial = initial_rows(spec.initializer, seed=spec.seed, ids=np.array([5]), dim=4)
    np.testing.assert_array_equal(second, round_to(initial, "float16"))
    stored = _raw(config, "t", 5) or b""
    assert stored[:8] == round_to(initial, "float16").astype("<f2").tobytes()  # then adam's slots
    assert len(stored) == 8 + 4 * (2 * 4 + 1)


async def test_a_cluster_file_with_another_dtype_or_optimizer_is_refused_saying_how(
    memcached_nodes: list[str],
) -> None:
    config = make_config(
        memcached_nodes,
        tables=[{"name": "t", "dim": 4}, {"name": "u", "dim": 2, "dtype": "bfloat16"}],
    )
    await init_cluster(config)
    async with EmbeddingStore(config) as store:
        await store.lookup("t", [1, 2])

    def changed(name: str, **change: Any) -> ClusterConfig:
        tables = [dataclasses.replace(t, **change) if t.name == name else t for t in config.tables]
        return dataclasses.replace(config, tables=tuple(tables))

    halved = changed("t", dtype="float16")
    async with EmbeddingStore(halved) as store:
        with pytest.raises(StorageFormatError, match="holds table 't'") as info:
            await store.lookup("t", [1, 2])
    message = str(info.value)
    assert "float32 rows, adam slots (momentum float32, velocity float32, step float32)" in message
    assert "this cluster file says float16 rows, adam slots" in message
    assert "lookup-table-checkpoint save" in message and "restore --force" in message

    other = changed("u", optimizer=RowwiseAdagradConfig())
    async with EmbeddingStore(other) as store:
        with pytest.raises(StorageFormatError, match="holds table 'u'.*new table name"):
            await store.lookup("t", [1])  # any batch: the sentinel read in front says so
    with pytest.raises(StorageFormatError, match="holds table 't'"):
        await init_cluster(halved)

    # what does not change the stored layout is no conversion: a learning rate, a table
    # added after the namespace was made
    tuned = changed("t", optimizer=dataclasses.replace(config.table("t").optimizer, beta_1=0.5))
    added = dataclasses.replace(
        config, tables=(*config.tables, dataclasses.replace(config.table("u"), name="v"))
    )
    for ok in (tuned, added):
        async with EmbeddingStore(ok) as store:
            assert (await store.lookup("t", [1, 2])).shape == (2, 4)
    for id_ in (1, 2):  # float32 rows of dim 4 and adam's slots, as before
        assert len(_raw(config, "t", id_) or b"") == 4 * (4 + 2 * 4 + 1)


@pytest.mark.parametrize("row_flush_pushes", [1, 4], ids=["written through", "written behind"])
async def test_a_step_beyond_the_dtype_is_a_400_naming_the_row_and_nothing_is_written(
    memcached_nodes: list[str], aiohttp_client: Any, row_flush_pushes: int
) -> None:
    tables = [
        {"name": "a", "dim": 4, "seed": 1},  # float32 adam: stepped first, never written
        {
            "name": "h",
            "dim": 4,
            "dtype": "float16",
            "optimizer": {"name": "sgd", "learning_rate": 1e5},
        },
    ]
    config = make_config(
        memcached_nodes,
        tables=tables,
        optimizers=["http://127.0.0.1:1"],
        service={"row_flush_pushes": row_flush_pushes},
    )
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        before = {t: await store.lookup(t, [1, 2]) for t in ("a", "h")}
    client = await aiohttp_client(make_app(config, replica=0, registry=CollectorRegistry()))
    grads = np.zeros((2, 4), dtype=np.float32)
    grads[1, 2] = 1.0  # id 2's third value: -1e5 and more, beyond float16's 65504
    body = _body(
        "over",
        {"a": ([1, 2], np.ones((2, 4), np.float32)), "h": ([1, 2], grads)},
        **config.sender(0),
    )
    resp = await client.post("/v1/gradients", data=body, headers={"Content-Type": CONTENT_TYPE})
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert "table 'h'" in error and "id 2" in error, error
    assert "bfloat16" in error and "learning rate" in error, error  # what to do
    await client.close()
    async with EmbeddingStore(config) as store:
        for t in ("a", "h"):
            np.testing.assert_array_equal(await store.lookup(t, [1, 2], create=False), before[t])
            items, _ = await store.get(t, [1, 2], slots=True)
            assert not items[:, config.table(t).dim :].any()  # no slot moved either
        assert not any(await Journal(store, replica=0).headers())


def _with_dtype(
    config: ClusterConfig, dtype: str, *, namespace: str | None = None
) -> ClusterConfig:
    tables = tuple(dataclasses.replace(t, dtype=dtype) for t in config.tables)  # type: ignore[arg-type]
    return dataclasses.replace(config, tables=tables, namespace=namespace or config.namespace)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
async def test_a_checkpoint_holds_rows_as_stored_and_restores_into_any_dtype(
    memcached_nodes: list[str], tmp_path: Any, dtype: str
) -> None:
    tables = [
        {"name": "t", "dim": 5, "seed": 2, "dtype": dtype, "optimizer": {"name": "rowwise_adam"}},
        {"name": "w", "dim": 3, "id_type": "string", "dtype": dtype},
    ]
    config = make_config(memcached_nodes, tables=tables)
    ids = np.arange(-20, 20, dtype=np.int64) * 977
    words = [f"w{i}" for i in range(9)]
    rng = np.random.default_rng(4)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("w", words)
        big = rng.normal(scale=300.0, size=(ids.shape[0], 5)).astype(np.float32)
        slots = np.abs(rng.normal(size=(ids.shape[0], 7))).astype(np.float32)
        await store.set("t", ids, big, slots=slots)
        saved_t, _ = await store.get("t", ids, slots=True)
        saved_w = await store.lookup("w", words, create=False)
    manifest = await save_checkpoint_async(config, tmp_path / "ck", pause=False, progress=False)
    by_name = {t["name"]: t for t in manifest["tables"]}
    assert by_name["t"]["dtype"] == dtype and by_name["t"]["optimizer"] == "rowwise_adam"
    assert by_name["t"]["slots"] == [
        ["momentum", 5, "bfloat16"],
        ["velocity", 1, "float32"],
        ["step", 1, "float32"],
    ]
    rows_file = np.load(tmp_path / "ck" / by_name["t"]["files"]["rows"])
    assert rows_file.dtype.str == {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}[dtype]
    assert rows_file.nbytes == ids.shape[0] * 5 * (4 if dtype == "float32" else 2)  # as stored

    # the same dtype: every bit back
    again = _with_dtype(config, dtype, namespace=config.namespace + "a")
    await restore_checkpoint_async(again, tmp_path / "ck", pause=False, progress=False)
    async with EmbeddingStore(again) as store:
        got, found = await store.get("t", ids, slots=True)
        assert found.all()
        np.testing.assert_array_equal(got, saved_t)
        np.testing.assert_array_equal(await store.lookup("w", words, create=False), saved_w)

    # another dtype: converted, to nearest (float32 holds every 16-bit value exactly)
    for other in ("float32", "bfloat16", "float16"):
        if other == dtype:
            continue
        into = _with_dtype(config, other, namespace=config.namespace + other)
        await restore_checkpoint_async(into, tmp_path / "ck", pause=False, progress=False)
        async with EmbeddingStore(into) as store:
            got, _ = await store.get("t", ids, slots=True)
        want = saved_t[:, :5] if other == "float32" else round_to(saved_t[:, :5], other)  # type: ignore[arg-type]
        np.testing.assert_array_equal(got[:, :5], want)
        np.testing.assert_array_equal(got[:, 5:], saved_t[:, 5:])  # slots as they were


async def test_a_restore_into_float16_of_values_beyond_it_is_refused_before_anything_is_written(
    memcached_nodes: list[str], tmp_path: Any
) -> None:
    config = make_config(
        memcached_nodes, tables=[{"name": "t", "dim": 2, "optimizer": {"name": "sgd"}}]
    )
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.set("t", [1, 2], np.array([[1.0, 2.0], [-7e4, 3.0]], np.float32))
    await save_checkpoint_async(config, tmp_path / "ck", pause=False, progress=False)
    half = _with_dtype(config, "float16", namespace=config.namespace + "h")
    with pytest.raises(CheckpointError, match=r"table 't'.*70000.*beyond float16.*bfloat16"):
        await restore_checkpoint_async(half, tmp_path / "ck", pause=False, progress=False)
    async with EmbeddingStore(half) as store:
        assert all(v is None for v in (await store.sentinels()).values())  # nothing written
    other = dataclasses.replace(
        config,
        namespace=config.namespace + "o",
        tables=(dataclasses.replace(config.table("t"), optimizer=RowwiseAdagradConfig()),),
    )
    with pytest.raises(CheckpointError, match=r"table 't'.*restore with optimizer 'sgd'"):
        await restore_checkpoint_async(other, tmp_path / "ck", pause=False, progress=False)


async def test_admin_stats_shows_each_tables_dtype_and_bytes_a_row(
    memcached_nodes: list[str],
) -> None:
    tables = [
        {"name": "h", "dim": 16, "dtype": "float16", "optimizer": {"name": "rowwise_adam"}},
        {"name": "f", "dim": 16},
    ]
    config = make_config(memcached_nodes, tables=tables)
    await init_cluster(config)
    async with EmbeddingStore(config) as store:
        await store.lookup("h", np.arange(10))
    report = await table_stats(config)
    h, f = report["tables"]["h"], report["tables"]["f"]
    assert (h["dtype"], h["optimizer"], h["value_bytes"]) == ("float16", "rowwise_adam", 72)
    assert (f["dtype"], f["optimizer"], f["value_bytes"]) == ("float32", "adam", 196)
    assert h["kinds"]["rows"]["keys"] == 10
    text = render_stats(report).splitlines()
    assert text[-3].split() == ["table", "dim", "dtype", "optimizer", "bytes/row", "value"]
    assert text[-2].split() == ["h", "16", "float16", "rowwise_adam", "72"]
    assert text[-1].split() == ["f", "16", "float32", "adam", "196"]


async def test_the_conversion_the_refusal_names_works_in_place(
    memcached_nodes: list[str], tmp_path: Any
) -> None:
    """Save with the file that wrote the namespace, restore --force with the new dtype:
    the namespace then holds (and its sentinels record) the new layout."""
    config = make_config(memcached_nodes, tables=[{"name": "t", "dim": 4}])
    await init_cluster(config)
    async with EmbeddingStore(config) as store:
        before = await store.lookup("t", [1, 2, 3])
    await save_checkpoint_async(config, tmp_path / "ck", pause=False, progress=False)
    half = _with_dtype(config, "float16", namespace=config.namespace)
    await restore_checkpoint_async(half, tmp_path / "ck", force=True, pause=False, progress=False)
    async with EmbeddingStore(half) as store:
        got = await store.lookup("t", [1, 2, 3], create=False)
    np.testing.assert_array_equal(got, round_to(before, "float16"))
    assert len(_raw(config, "t", 1) or b"") == 2 * 4 + 4 * (2 * 4 + 1)
    async with EmbeddingStore(config) as store:  # the old file is refused now
        with pytest.raises(StorageFormatError, match="as float16 rows"):
            await store.lookup("t", [1])
