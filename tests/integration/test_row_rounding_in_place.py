"""16-bit tables stepped where the row cache holds them (rows written behind) against
the same pushes stepped on gathered rows (written through), real memcached and the real
app: the same rows, slots, answers, journal bytes and memcached values, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lookup_table import EmbeddingStore
from lookup_table.core.optimizers import make_optimizer, step_slot
from lookup_table.core.precision import round_to
from lookup_table.core.wire import unpack
from optimizer_service.app import UPDATER
from optimizer_service.engine.journal_format import encode_journal
from optimizer_service.engine.plan import WritePlan
from optimizer_service.errors import BadRequestError
from optimizer_service.push import parse_push
from tests.integration.test_row_dtypes import PRECISE
from tests.integration.test_row_write_behind import _config, _start
from tests.integration.test_service import _body

pytestmark = pytest.mark.integration

OTHER = {"float16": "bfloat16", "bfloat16": "float16"}


def _tables(variant: str, rounding: str) -> list[dict[str, Any]]:
    """One batch (one optimizer, one dim): two tables of the variant's dtype, one of the
    other 16-bit dtype, one of float32 rows, and a string-id table (not cached)."""
    dtype, optimizer = PRECISE[variant]
    sixteen = {"dim": 8, "optimizer": optimizer, "rounding": rounding}
    return [
        {"name": "a", "seed": 11, "dtype": dtype, **sixteen},
        {"name": "b", "seed": 12, "dtype": dtype, **sixteen},
        {"name": "c", "seed": 13, "dtype": OTHER[dtype], **sixteen},
        {"name": "d", "seed": 14, "dim": 8, "optimizer": optimizer},
        {"name": "s", "seed": 15, "id_type": "string", "dtype": dtype, **sixteen},
    ]


def _pushes(n: int) -> list[dict[str, tuple[Any, np.ndarray]]]:
    """Pushes whose ids overlap (rows updated again, new ones created)."""
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        push: dict[str, tuple[Any, np.ndarray]] = {}
        for name in "abcd":
            ids = np.sort(rng.choice(300, 120, replace=False)).astype(np.int64) * 7919 - 10**6
            push[name] = (ids, rng.standard_normal((120, 8)).astype(np.float32))
        words = [f"w{i}" for i in rng.choice(40, 10, replace=False)]
        push["s"] = (words, rng.standard_normal((10, 8)).astype(np.float32))
        out.append(push)
    return out


async def _run(
    nodes: list[str],
    aiohttp_server: Any,
    tables: list[dict[str, Any]],
    pushes: list[dict[str, tuple[Any, np.ndarray]]],
    flush_pushes: int,
    stored_step: float | None = None,
) -> tuple[list[WritePlan], dict[str, np.ndarray], int]:
    """The pushes applied by a fresh replica: their plans, every table's items in
    memcached afterwards, and how many tables' items were gathered to be stepped. With
    `stored_step`, the int tables' rows are stored first, each at a step about it."""
    config = _config(nodes, tables=tables, row_flush_pushes=flush_pushes)
    server = await _start(config, aiohttp_server)
    if stored_step is not None:
        await _store_rows(config, stored_step)
    updater = server.app[UPDATER]
    gathered = 0
    gather = updater.stepper.gather_items

    def counting(p: Any) -> None:
        nonlocal gathered
        gathered += p.place is not None
        gather(p)

    updater.stepper.gather_items = counting
    plans: list[WritePlan] = []
    for k, push in enumerate(pushes):
        body = _body(f"push-{k}", push)
        applied = await updater.apply(parse_push(unpack(body), config=config))
        assert applied.applied and applied.plan is not None
        plans.append(applied.plan)
    await updater.pause()  # rows written behind reach memcached
    stored = {}
    async with EmbeddingStore(config) as store:
        for t in tables:
            ids: Any = (
                sorted({w for p in pushes for w in p[t["name"]][0]})
                if t.get("id_type") == "string"
                else np.unique(np.concatenate([p[t["name"]][0] for p in pushes]))
            )
            items, found = await store.get(t["name"], ids, unique=True, slots=True)
            assert found.all()
            stored[t["name"]] = items
    updater.resume()
    return plans, stored, gathered


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("variant", list(PRECISE))
async def test_16_bit_rows_stepped_in_place_are_the_gathered_steps_bit_for_bit(
    memcached_nodes: list[str], aiohttp_server: Any, variant: str, rounding: str
) -> None:
    tables = _tables(variant, rounding)
    pushes = _pushes(6)
    behind, behind_stored, behind_gathered = await _run(
        memcached_nodes, aiohttp_server, tables, pushes, 4
    )
    through, through_stored, _ = await _run(memcached_nodes, aiohttp_server, tables, pushes, 1)
    assert behind_gathered == 0  # every cached table was stepped where its items are
    step_slots = {t["name"]: None for t in tables}
    for b, t in zip(behind, through, strict=True):
        for ub, ut in zip(b.updates, t.updates, strict=True):
            assert ub.table == ut.table
            assert ub.rows.view(np.uint32).tobytes() == ut.rows.view(np.uint32).tobytes()
            assert ub.slots.view(np.uint32).tobytes() == ut.slots.view(np.uint32).tobytes()
        # what a journal of rows written behind keeps (new values, or steps and gradients)
        for slots in (step_slots, {name: _step_column(tables, name) for name in step_slots}):
            assert _journal_body(b, slots) == _journal_body(t, slots)
    for name, items in behind_stored.items():
        assert items.view(np.uint32).tobytes() == through_stored[name].view(np.uint32).tobytes()


@pytest.mark.parametrize("variant", ["float16-rowwise_adam", "bfloat16-adam"])
async def test_rows_past_float32s_exact_steps_are_keyed_by_their_old_step_in_place_too(
    memcached_nodes: list[str], aiohttp_server: Any, variant: str
) -> None:
    """Past 2**24 a float32 step no longer moves (step + 1 == step): a row's key is its
    stored step, the same in place as gathered."""
    tables = _tables(variant, "stochastic")
    pushes = _pushes(2)
    behind, behind_stored, gathered = await _run(
        memcached_nodes, aiohttp_server, tables, pushes, 4, stored_step=2.0**24
    )
    through, through_stored, _ = await _run(
        memcached_nodes, aiohttp_server, tables, pushes, 1, stored_step=2.0**24
    )
    assert gathered == 0
    for b, t in zip(behind, through, strict=True):
        for ub, ut in zip(b.updates, t.updates, strict=True):
            assert ub.rows.view(np.uint32).tobytes() == ut.rows.view(np.uint32).tobytes()
            assert ub.slots.view(np.uint32).tobytes() == ut.slots.view(np.uint32).tobytes()
    for name, items in behind_stored.items():
        assert items.view(np.uint32).tobytes() == through_stored[name].view(np.uint32).tobytes()


async def _store_rows(config: Any, step: float) -> None:
    """Rows of tables a..d for every id the pushes use, their values what each dtype
    stores, their slots small, and their step column (where there is one) around `step`."""
    rng = np.random.default_rng(8)
    ids = np.arange(300, dtype=np.int64) * 7919 - 10**6
    async with EmbeddingStore(config) as store:
        for name in "abcd":
            spec = config.table(name)
            rows = rng.uniform(-0.1, 0.1, (300, spec.dim)).astype(np.float32)
            if spec.dtype != "float32":
                rows = round_to(rows, spec.dtype)
            optimizer = make_optimizer(spec.optimizer)
            slots = rng.uniform(0, 1e-3, (300, optimizer.slot_width(spec.dim)))
            slots = slots.astype(np.float32)
            column = step_slot(optimizer, spec.dim)
            if column is not None:
                slots[:, column] = step + rng.integers(-2, 3, 300)
            await store.set(name, ids, rows, slots=slots)


def _journal_body(plan: WritePlan, step_slots: dict[str, int | None]) -> bytes:
    chunks, header = encode_journal(plan, seq=1, step_slots=step_slots)
    body = unpack(header)["body"] if not chunks else b"".join(bytes(c) for c in chunks)
    return bytes(body)


def _step_column(tables: list[dict[str, Any]], name: str) -> int | None:
    from tests.conftest import make_config

    spec = make_config(["127.0.0.1:1"], tables=tables).table(name)
    return step_slot(make_optimizer(spec.optimizer), spec.dim)


async def _overflowing_push(nodes: list[str], aiohttp_server: Any, flush_pushes: int) -> str:
    """A push whose step takes one float16 row beyond 65504, by a replica writing rows
    behind or through: its error's message, once nothing of it was written."""
    sgd = {"name": "sgd", "learning_rate": 1.0}
    tables = [
        {"name": "wide", "dim": 4, "seed": 1, "dtype": "bfloat16", "optimizer": sgd},
        {"name": "small", "dim": 4, "seed": 2, "dtype": "float16", "optimizer": sgd},
    ]
    config = _config(nodes, tables=tables, row_flush_pushes=flush_pushes)
    updater = (await _start(config, aiohttp_server)).app[UPDATER]
    ids = np.arange(5, dtype=np.int64) * 31
    grads = np.zeros((5, 4), dtype=np.float32)
    wide = grads.copy()
    wide[1, 2] = -1e6  # fits bfloat16
    small = grads.copy()
    small[3, 1] = -1e5  # id 93: beyond float16's largest
    body = _body("too-far", {"wide": (ids, wide), "small": (ids, small)})
    with pytest.raises(BadRequestError) as err:
        await updater.apply(parse_push(unpack(body), config=config))
    assert err.value.reason == "row_overflow"
    await updater.pause()
    async with EmbeddingStore(config) as store:
        for name in ("wide", "small"):
            assert not (await store.get(name, ids, unique=True))[1].any()
    updater.resume()
    cached = updater.cache.lookup_many([("wide", ids), ("small", ids)])
    assert not any(hit.any() for hit, *_ in cached)
    return str(err.value)


async def test_a_row_beyond_its_dtype_stepped_in_place_is_refused_as_when_gathered(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    behind = await _overflowing_push(memcached_nodes, aiohttp_server, 4)
    assert behind == await _overflowing_push(memcached_nodes, aiohttp_server, 1)
    assert "table 'small'" in behind and "(id 93)" in behind and "nothing was stored" in behind


async def _momentum_overflow(nodes: list[str], aiohttp_server: Any, flush_pushes: int) -> str:
    """A push whose row-wise Adam m (stored as bfloat16) goes beyond bfloat16's range (a
    gradient near float32's limit, beta_1 0: m is the gradient), by a replica writing rows
    behind or through: its error's message, once nothing of it was written."""
    adam = {"name": "rowwise_adam", "learning_rate": 0.01, "beta_1": 0.0}
    tables = [{"name": "t", "dim": 4, "seed": 1, "dtype": "bfloat16", "optimizer": adam}]
    config = _config(nodes, tables=tables, row_flush_pushes=flush_pushes)
    updater = (await _start(config, aiohttp_server)).app[UPDATER]
    ids = np.arange(5, dtype=np.int64) * 31
    grads = np.zeros((5, 4), dtype=np.float32)
    grads[2, 1] = 3.4e38  # finite float32, beyond bfloat16's 3.3895e38
    with pytest.raises(BadRequestError) as err:
        await updater.apply(parse_push(unpack(_body("m-far", {"t": (ids, grads)})), config=config))
    assert err.value.reason == "row_overflow"
    await updater.pause()
    async with EmbeddingStore(config) as store:
        assert not (await store.get("t", ids, unique=True))[1].any()
    updater.resume()
    assert not updater.cache.lookup_many([("t", ids)])[0][0].any()
    return str(err.value)


async def test_a_momentum_beyond_bfloat16_is_refused_as_a_bad_request_on_both_paths(
    memcached_nodes: list[str], aiohttp_server: Any
) -> None:
    behind = await _momentum_overflow(memcached_nodes, aiohttp_server, 4)
    assert behind == await _momentum_overflow(memcached_nodes, aiohttp_server, 1)
    assert "first moment m" in behind and "does not fit bfloat16" in behind
    assert "nothing was stored" in behind and "clip them" in behind
