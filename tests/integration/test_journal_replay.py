"""A journaled push whose write stopped anywhere is finished exactly once by a replay.

The journal carries a push's summed gradients and a change witness per id (one word of
its item, the row and slots, that the push changes, with its bits before the push), not
the new values (optimizer_service/engine/plan.py). A write that fails part-way can leave any
id's item written or not: every mix, plus rows never created, must end with the values
the push computed, bit for bit, and nothing applied twice. Journals of older services
(each item's hash before the push; the new values' hashes) still replay. Real memcached,
the real service app.

Rows written through (`service.row_flush_pushes = 1`), the journals of gradients; rows
written behind journal their new values (tests/integration/test_row_write_behind.py).
"""

from __future__ import annotations

import logging
import uuid
import zlib
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from lookup_table import EmbeddingStore, StorageFormatError, initial_rows
from lookup_table.core.keyspace import META_TABLE, Kind, journal_id, push_record_id
from lookup_table.core.optimizers import make_optimizer
from lookup_table.core.precision import round_to
from lookup_table.core.rows import change_witnesses, value_hashes
from lookup_table.core.wire import pack, unpack
from lookup_table.store import TableWrite
from optimizer_service.app import UPDATER, make_app
from optimizer_service.engine.journal import Journal
from optimizer_service.engine.journal_format import (
    JOURNAL_CHUNK_BYTES,
    START_END,
    decode_journal,
)
from optimizer_service.engine.plan import TableUpdate, WritePlan
from optimizer_service.push import parse_push
from tests.conftest import make_config
from tests.integration.test_row_dtypes import PRECISE, as_stored
from tests.integration.test_service import _body

THROUGH = {"row_flush_pushes": 1}  # the journal of gradients (the module's docstring)

pytestmark = pytest.mark.integration

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adam": {"name": "adam", "learning_rate": 0.01},
    "sgd": {"name": "sgd", "learning_rate": 0.5},
    "momentum": {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9},
    "nesterov": {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
    "adagrad": {"name": "adagrad", "learning_rate": 0.1},
}
# per id of the push: whether its item (the row and its slots) was written when the
# write stopped
MIX = [True, False, False, True]


async def renumber_journals(config: Any, number: int | None) -> list[int | None]:
    """Give every journal header of replica 0 the format `number` (None: no number, as
    services wrote them before formats were numbered); returns the formats they had."""
    had = []
    async with EmbeddingStore(config) as store:
        journal = Journal(store, replica=0)
        for slot, raw in enumerate(await journal.headers()):
            if raw:
                header = dict(unpack(raw))
                had.append(header.pop("format", None))
                if number is not None:
                    header["format"] = number
                await journal.write_header(slot, pack(header))
    return had


async def _read(store: EmbeddingStore, table: str, ids: Any) -> tuple[Any, Any, Any]:
    """(rows, slots, found) of `ids`: a row and its slots are one item."""
    items, found = await store.get(table, ids, unique=True, slots=True)
    dim = store.config.table(table).dim
    return items[:, :dim], items[:, dim:], found


@pytest.mark.parametrize(
    ("name", "numbered"),
    [(name, True) for name in sorted(OPTIMIZERS)]
    + [("adam", False)]
    + [(name, True) for name in sorted(PRECISE)],
    ids=[*sorted(OPTIMIZERS), "adam-unnumbered", *sorted(PRECISE)],
)
async def test_a_replay_finishes_a_push_whose_items_were_written_in_part_exactly_once(
    memcached_nodes: list[str],
    aiohttp_server: Any,
    caplog: pytest.LogCaptureFixture,
    name: str,
    numbered: bool,
) -> None:
    """`numbered=False`: the journal's header has no format number, as services wrote
    it before formats were numbered; its shape says it is a start and an end. The
    compact options (`PRECISE`: 16-bit rows, row-wise optimizers) replay to the same
    rounded bits."""
    dtype, optimizer = PRECISE.get(name, ("float32", OPTIMIZERS.get(name, {})))
    tables = [
        {"name": "t", "dim": 8, "seed": 5, "optimizer": optimizer, "dtype": dtype},
        {"name": "s", "dim": 4, "seed": 6, "id_type": "string", "optimizer": optimizer},
    ]
    config = make_config(
        memcached_nodes, tables=tables, optimizers=["http://127.0.0.1:1"], service=THROUGH
    )
    opt = make_optimizer(config.table("t").optimizer)
    # ids 0..7 exist (0..3 updated by an earlier push), 8..11 were never looked up
    ids = np.arange(12, dtype=np.int64)
    words = [f"w{i}" for i in range(8)]
    rng = np.random.default_rng(7)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("t", ids[:8])
        await store.lookup("s", words[:4])
    server = await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    updater = server.app[UPDATER]
    first = {"t": (ids[:4], rng.standard_normal((4, 8), dtype=np.float32))}
    await updater.apply(parse_push(unpack(_body("first", first)), config=config))

    grads = rng.standard_normal((12, 8), dtype=np.float32)
    wgrads = rng.standard_normal((8, 4), dtype=np.float32)
    async with EmbeddingStore(config) as store:
        rows, slots, found = await _read(store, "t", ids)
    rows[~found] = np.stack([r for r in (await _initial(config, ids[~found]))])
    slots[~found] = opt.initial_slots(int((~found).sum()), 8)
    want_rows, want_slots = opt.update(rows, grads, slots)
    want_rows = as_stored(config.table("t"), ids, slots, want_rows, want_slots)

    async def stop_part_way(updates: list[TableUpdate]) -> None:
        writes = []
        for u in updates:
            done = np.array([MIX[i % 4] for i in range(u.ids.shape[0])])
            writes.append(TableWrite(u.table, u.ids[done], u.rows[done], slots=u.slots[done]))
        await updater.store.set_many(writes)
        raise ConnectionResetError("simulated crash in the middle of the rows")

    updater.items.write = stop_part_way  # type: ignore[method-assign]
    push_id = uuid.uuid4().hex
    body = _body(push_id, {"t": (ids, grads), "s": (words, wgrads)})
    with pytest.raises(ConnectionResetError):
        await updater.apply(parse_push(unpack(body), config=config))
    for task in list(updater.state.finishers):
        task.cancel()  # the dead process's background replay never runs
    await server.close()

    async with EmbeddingStore(config) as store:
        journal = Journal(store, replica=0)
        plans = [p for p in [await journal.read(s) for s in range(journal.slots)] if p]
        assert [p.push_id for p in plans] == [push_id]
        plan = plans[0]
        assert not plan.updates and [r.table for r in plan.redo] == ["t", "s"]
        np.testing.assert_array_equal(plan.redo[0].grads, grads)  # journaled: the gradients
        # and one word per item that the push changes, with its bits as the push read it
        # (initial values where none)
        assert plan.redo[0].old_hashes is None and plan.redo[0].witness is not None
        np.testing.assert_array_equal(
            plan.redo[0].witness, change_witnesses((rows, slots), (want_rows, want_slots))
        )
        mid_rows, _, _ = await _read(store, "t", ids)
    # the crash left some items new, others old
    assert (mid_rows == want_rows).all(axis=1).tolist() != [True] * 12
    if not numbered:
        assert await renumber_journals(config, None) == [START_END]

    caplog.set_level(logging.WARNING, logger="optimizer_service.engine.recovery")
    restarted = await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    assert "replaying journaled push" in caplog.text
    assert "differ from the journaled" not in caplog.text  # every recomputation matched
    async with EmbeddingStore(config) as store:
        got_rows, got_slots, found = await _read(store, "t", ids)
        assert found.all()
        journal = Journal(store, replica=0)
        np.testing.assert_array_equal(got_rows, want_rows)
        np.testing.assert_array_equal(got_slots, want_slots)
        assert [await journal.read(s) for s in range(journal.slots)] == [None] * journal.slots
    retry = await restarted.app[UPDATER].apply(parse_push(unpack(body), config=config))
    assert retry.duplicate


async def _initial(config: Any, ids: Any) -> Any:
    from lookup_table import initial_rows

    spec = config.table("t")
    rows = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=spec.dim)
    return rows if spec.dtype == "float32" else round_to(rows, spec.dtype)


def test_a_small_journal_is_one_item_and_a_big_one_is_chunked() -> None:
    """The body travels inside the header when it fits in one item (one `set`)."""
    from optimizer_service.engine.journal_format import encode_journal
    from optimizer_service.engine.plan import WritePlan

    def plan(n: int) -> WritePlan:
        rows = np.ones((n, 16), np.float32)
        slots = np.zeros((n, 33), np.float32)
        update = TableUpdate("t", np.arange(n, dtype=np.int64), rows, slots, grads=rows * 2)
        return WritePlan(push_id="p", updates=[update])

    chunks, header = encode_journal(plan(1000))
    assert chunks == [] and unpack(header)["chunks"] == 0
    assert unpack(header)["crc32"] is None  # one item: memcached stores it whole
    back = decode_journal(unpack(header)["body"])
    assert back.redo[0].grads.tolist() == (np.ones((1000, 16)) * 2).tolist()
    big = JOURNAL_CHUNK_BYTES // (8 + 64 + 16) + 1000  # ids, grads, two hashes per id
    chunks, header = encode_journal(plan(big))
    assert len(chunks) == 2 and "body" not in unpack(header)
    assert unpack(header)["crc32"] == zlib.crc32(b"".join(chunks))  # chunks: checked
    assert decode_journal(b"".join(chunks)).redo[0].ids.shape == (big,)


def test_an_older_format_journal_holds_each_tables_own_old_hashes() -> None:
    """The older format of old hashes, with tables of several row and slot widths: each
    table's journaled hashes are `value_hashes` of its own rows and slots."""
    from optimizer_service.engine.journal_format import encode_journal
    from optimizer_service.engine.plan import TableStep

    rng = np.random.default_rng(4)
    shapes = {
        "a": (30, 8, 17),
        "b": (50, 8, 17),
        "c": (20, 8, 8),
        "d": (40, 4, 9),
        "e": (10, 8, 17),
    }
    steps = [
        TableStep(
            name,
            rng.choice(1000, size=n, replace=False).astype(np.int64),
            rng.standard_normal((n, dim)).astype(np.float32),
            rng.standard_normal((n, dim)).astype(np.float32),
            rng.standard_normal((n, width)).astype(np.float32),
        )
        for name, (n, dim, width) in shapes.items()
    ]
    chunks, header = encode_journal(WritePlan(push_id="p", updates=[], steps=steps))
    body = b"".join(chunks) if chunks else unpack(header)["body"]
    redo = decode_journal(body).redo
    assert [r.table for r in redo] == list(shapes)
    for step, r in zip(steps, redo, strict=True):
        assert r.ids.tolist() == step.ids.tolist()
        assert r.grads.tobytes() == step.grads.tobytes()
        assert r.old_hashes is not None
        assert r.old_hashes.tolist() == value_hashes(step.rows, step.slots).tolist(), r.table


async def test_a_replay_of_an_expired_rows_push_starts_from_fresh_slots_as_the_push_did(
    memcached_nodes: list[str], aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A TTL table's row that expired (its item, the row and its slots) starts again from
    its initial value and fresh slots; the journal's replay must start from the same values
    as the push it finishes."""
    tables = [{"name": "t", "dim": 8, "seed": 5, "ttl_s": 3600}]  # Adam
    config = make_config(
        memcached_nodes, tables=tables, optimizers=["http://127.0.0.1:1"], service=THROUGH
    )
    spec = config.table("t")
    adam = make_optimizer(spec.optimizer)
    ids = np.arange(4, dtype=np.int64)
    rng = np.random.default_rng(3)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("t", ids)
    server = await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    updater = server.app[UPDATER]
    first = {"t": (ids, rng.standard_normal((4, 8), dtype=np.float32))}
    await updater.apply(parse_push(unpack(_body("first", first)), config=config))
    async with EmbeddingStore(config) as store:  # rows 0 and 1 expire, with their slots
        assert (await store.delete_blobs("t", ids[:2], kind=Kind.ROW)).all()

    async def crash(*_: Any) -> None:
        raise ConnectionResetError("simulated crash between the journal and the rows")

    updater.items.write = crash  # type: ignore[method-assign]
    grads = rng.standard_normal((4, 8), dtype=np.float32)
    with pytest.raises(ConnectionResetError):
        await updater.apply(
            parse_push(unpack(_body(uuid.uuid4().hex, {"t": (ids, grads)})), config=config)
        )
    for task in list(updater.state.finishers):
        task.cancel()
    await server.close()

    caplog.set_level(logging.WARNING, logger="optimizer_service.engine.recovery")
    await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    assert "replaying journaled push" in caplog.text
    assert "differ from the journaled" not in caplog.text
    fresh = initial_rows(spec.initializer, seed=spec.seed, ids=ids[:2], dim=8)
    want_rows, want_slots = adam.update(fresh, grads[:2], adam.initial_slots(2, 8))
    async with EmbeddingStore(config) as store:
        rows, slots, found = await _read(store, "t", ids[:2])
    assert found.all()
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(slots, want_slots)


@pytest.mark.parametrize(
    ("older", "holds", "lacks"),
    [
        ("new-values-hashes", b"row_hashes", b"old_hashes"),
        ("old-items-hashes", b"old_hashes", b"split"),
    ],
)
async def test_a_journal_of_an_older_service_still_replays(
    memcached_nodes: list[str], aiohttp_server: Any, older: str, holds: bytes, lacks: bytes
) -> None:
    """Journals of older services, one body each: the oldest format has the hashes of the
    new rows and slots (recompute the items that do not have them), the next one the hash
    of each item before the push (recompute the items that still have it). A replica of
    this version finishes either push, and steps no item twice."""
    from optimizer_service.engine.plan import TableStep

    tables = [{"name": "t", "dim": 8, "seed": 5}]  # Adam
    config = make_config(
        memcached_nodes, tables=tables, optimizers=["http://127.0.0.1:1"], service=THROUGH
    )
    adam = make_optimizer(config.table("t").optimizer)
    ids = np.arange(8, dtype=np.int64)
    grads = np.random.default_rng(11).standard_normal((8, 8), dtype=np.float32)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("t", ids)
        rows, slots, _ = await _read(store, "t", ids)
        want_rows, want_slots = adam.update(rows, grads, slots)
        done = np.array([MIX[i % 4] for i in range(8)])
        await store.set_many([TableWrite("t", ids[done], want_rows[done], slots=want_slots[done])])
        if older == "new-values-hashes":
            update = TableUpdate("t", ids, want_rows, want_slots, grads=grads)
            plan = WritePlan(push_id=older, updates=[update])
        else:
            plan = WritePlan(
                push_id=older, updates=[], steps=[TableStep("t", ids, grads, rows, slots)]
            )
        await Journal(store, replica=0).write(2, plan)
        (raw,) = await store.get_blobs(META_TABLE, [journal_id(0, 2)], kind=Kind.JOURNAL)
    assert raw is not None and holds in raw and lacks not in raw
    assert "format" not in unpack(raw)  # format 1, as older services wrote it: no number

    await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    async with EmbeddingStore(config) as store:
        got_rows, got_slots, found = await _read(store, "t", ids)
    assert found.all()
    np.testing.assert_array_equal(got_rows, want_rows)  # the written ones not stepped twice
    np.testing.assert_array_equal(got_slots, want_slots)


async def test_a_replay_never_steps_an_id_whose_gradient_admission_dropped(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """`admit_after`: a push drops the gradient of an id without a row. When a trainer
    creates that row before the push's journal is replayed, the replay still leaves it
    alone (its witness is NOT_UPDATED) and finishes the other ids once."""
    tables = [{"name": "t", "dim": 4, "seed": 5, "admit_after": 2}]  # Adam
    config = make_config(
        memcached_nodes, tables=tables, optimizers=["http://127.0.0.1:1"], service=THROUGH
    )
    spec = config.table("t")
    adam = make_optimizer(spec.optimizer)
    ids = np.arange(8, dtype=np.int64)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        for _ in range(2):  # ids 0..3 are admitted: they have rows
            await store.lookup("t", ids[:4])
        rows, slots, found = await _read(store, "t", ids[:4])
    assert found.all()
    grads = np.random.default_rng(13).standard_normal((8, 4), dtype=np.float32)
    want_rows, want_slots = adam.update(rows, grads[:4], slots)
    server = await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    updater = server.app[UPDATER]

    async def stop_part_way(updates: list[TableUpdate]) -> None:
        (u,) = updates
        done = np.array([MIX[i % 4] for i in range(u.ids.shape[0])])
        await updater.store.set_many(
            [TableWrite(u.table, u.ids[done], u.rows[done], slots=u.slots[done])]
        )
        raise ConnectionResetError("simulated crash in the middle of the rows")

    updater.items.write = stop_part_way  # type: ignore[method-assign]
    with pytest.raises(ConnectionResetError):
        await updater.apply(parse_push(unpack(_body("p", {"t": (ids, grads)})), config=config))
    for task in list(updater.state.finishers):
        task.cancel()
    await server.close()
    async with EmbeddingStore(config) as store:
        for _ in range(2):  # meanwhile a trainer sees ids 4..7 twice: they get rows
            await store.lookup("t", ids[4:])

    await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    async with EmbeddingStore(config) as store:
        got_rows, got_slots, found = await _read(store, "t", ids)
    assert found.all()
    np.testing.assert_array_equal(got_rows[:4], want_rows)
    np.testing.assert_array_equal(got_slots[:4], want_slots)
    fresh = initial_rows(spec.initializer, seed=spec.seed, ids=ids[4:], dim=4)
    np.testing.assert_array_equal(got_rows[4:], fresh)  # never stepped
    np.testing.assert_array_equal(got_slots[4:], adam.initial_slots(4, 4))


@pytest.mark.parametrize(
    ("n", "dim", "start_chunks", "end_chunks"),
    [(100, 4, 0, 0), (20_000, 16, 2, 0), (140_000, 1, 2, 2)],
    ids=["all-in-the-header", "start-in-chunks", "end-in-chunks-too"],
)
async def test_a_journal_is_read_back_whatever_parts_went_to_chunks(
    memcached_nodes: list[str], n: int, dim: int, start_chunks: int, end_chunks: int
) -> None:
    """A small push's journal is one `set` (the header carries it all); a bigger one's
    gradients go to chunks first; a push of more ids than 1 MiB of witnesses holds
    (~130k) has its end in chunks too. Each reads back to the same plan."""
    config = make_config(memcached_nodes, tables=[{"name": "t", "dim": dim}], service=THROUGH)
    rng = np.random.default_rng(n)
    ids = np.sort(rng.choice(10 * n, size=n, replace=False)).astype(np.int64)
    grads = rng.standard_normal((n, dim), dtype=np.float32)
    witness = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
    update = TableUpdate("t", ids, grads, grads, witness=witness)
    plan = WritePlan(push_id="big", updates=[update], version=7)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        journal = Journal(store, replica=0)
        start = await journal.write_start(3, [("t", ids, grads)])
        assert start.chunks == start_chunks
        await journal.write_end(3, start, plan)
        (raw,) = await store.get_blobs(META_TABLE, [journal_id(0, 3)], kind=Kind.JOURNAL)
        assert raw is not None
        header = unpack(raw)
        assert header["chunks"] == start_chunks + end_chunks
        assert ("tail" in header) == (end_chunks == 0)
        back = await journal.read(3)
    assert back is not None and back.push_id == "big" and back.version == 7
    (redo,) = back.redo
    assert redo.table == "t" and redo.old_hashes is None and redo.witness is not None
    np.testing.assert_array_equal(redo.ids, ids)
    np.testing.assert_array_equal(redo.grads, grads)
    np.testing.assert_array_equal(redo.witness, witness)


async def _torn_journal(memcached_nodes: list[str], push_id: str, *, done: bool) -> Any:
    """A cluster with a chunked journal of `push_id` in slot 1 whose first chunk a later
    push's chunk overwrote (its header's clear had failed); `done`: the push has its
    done record. Returns the cluster's config."""
    config = make_config(
        memcached_nodes,
        tables=[{"name": "t", "dim": 16, "seed": 5}],
        optimizers=["http://127.0.0.1:1"],
        service=THROUGH,
    )
    n = JOURNAL_CHUNK_BYTES // (8 + 64 + 16) + 1000  # two chunks
    rows = np.ones((n, 16), np.float32)
    update = TableUpdate("t", np.arange(n, dtype=np.int64), rows, rows, grads=rows)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await Journal(store, replica=0).write(1, WritePlan(push_id=push_id, updates=[update]))
        await store.set_blobs(
            META_TABLE, [journal_id(0, 1, 0)], [b"a later push"], kind=Kind.JOURNAL
        )
        if done:
            await store.set_blobs(
                META_TABLE, [push_record_id(0, push_id)], [b"1"], kind=Kind.PUSH_RECORD
            )
    return config


async def test_a_done_pushs_header_over_a_later_pushs_chunks_is_cleared_at_start(
    memcached_nodes: list[str], aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = await _torn_journal(memcached_nodes, "finished", done=True)
    caplog.set_level(logging.WARNING, logger="optimizer_service.engine.recovery")
    await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    assert "fails its checksum; its push is done: cleared" in caplog.text
    async with EmbeddingStore(config) as store:
        assert await Journal(store, replica=0).read(1) is None


async def test_a_torn_journal_of_a_push_not_done_stops_the_start_and_says_why(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    config = await _torn_journal(memcached_nodes, "unfinished", done=False)
    with pytest.raises(RuntimeError, match="push unfinished.*no done record.*restore"):
        await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))


async def test_a_push_whose_optimizer_step_fails_writes_no_journal_header_and_no_row(
    memcached_nodes: list[str], aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal's chunks go out while the optimizer computes; when the computation
    fails, they are waited for, the slot is given back, and nothing names them."""
    config = make_config(
        memcached_nodes,
        tables=[{"name": "t", "dim": 8, "seed": 5}],
        optimizers=["http://127.0.0.1:1"],
        service=THROUGH,
    )
    ids = np.arange(30_000, dtype=np.int64)  # 1.4 MB of journal: chunks
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("t", ids)
        before, _, _ = await _read(store, "t", ids)
    server = await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    updater = server.app[UPDATER]

    async def fails(*_: Any, **__: Any) -> None:
        raise FloatingPointError("simulated: the optimizer's step failed")

    updater.stepper.step_tables = fails  # type: ignore[method-assign]
    grads = np.ones((30_000, 8), dtype=np.float32)
    caplog.set_level(logging.WARNING)
    with pytest.raises(FloatingPointError):
        await updater.apply(parse_push(unpack(_body("p", {"t": (ids, grads)})), config=config))
    assert updater.journal._free.qsize() == updater.journal.slots  # every slot given back
    async with EmbeddingStore(config) as store:
        journal = Journal(store, replica=0)
        assert [await journal.read(s) for s in range(journal.slots)] == [None] * journal.slots
        chunk = await store.get_blobs(META_TABLE, [journal_id(0, 0, 0)], kind=Kind.JOURNAL)
        assert chunk[0] is not None  # the chunks were written: only no header names them
        after, _, _ = await _read(store, "t", ids)
    np.testing.assert_array_equal(after, before)
    await server.close()
    assert "never retrieved" not in caplog.text


async def test_a_journal_of_an_unknown_format_stops_the_start_and_says_which(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    """A journal a newer service wrote (a format number this version does not know) is
    neither replayed nor cleared: the replica refuses to start, naming the number and the
    formats it reads, and memcached keeps the journal for the version that wrote it."""
    tables = [{"name": "t", "dim": 4, "seed": 5}]
    config = make_config(
        memcached_nodes, tables=tables, optimizers=["http://127.0.0.1:1"], service=THROUGH
    )
    ids = np.arange(4, dtype=np.int64)
    grads = np.ones((4, 4), np.float32)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("t", ids)
        rows, _, _ = await _read(store, "t", ids)
        journal = Journal(store, replica=0)
        start = await journal.write_start(2, [("t", ids, grads)])
        witness = np.zeros(4, np.int64)
        plan = WritePlan(
            push_id="newer", updates=[TableUpdate("t", ids, rows, rows, witness=witness)]
        )
        await journal.write_end(2, start, plan)
    assert await renumber_journals(config, 9) == [START_END]
    with pytest.raises(
        StorageFormatError,
        match=r"journal slot 2 of replica 0 \(push newer\) is in journal format 9, which this "
        r"version does not read; it reads formats 1 \(.*\), 2 \(.*\), 3 \(.*\)\. A newer "
        r"service wrote it",
    ):
        await aiohttp_server(make_app(config, replica=0, registry=CollectorRegistry()))
    async with EmbeddingStore(config) as store:
        after, _, _ = await _read(store, "t", ids)
        (raw,) = await store.get_blobs(META_TABLE, [journal_id(0, 2)], kind=Kind.JOURNAL)
    np.testing.assert_array_equal(after, rows)  # nothing replayed
    assert raw and unpack(raw)["format"] == 9  # nor cleared
