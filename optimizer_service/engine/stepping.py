"""The optimizer's math on a push's rows: read (or locate in the row cache) what each
table's step starts from, step tables with equal optimizers as one batch, and build
the `TableUpdate`s a write plan holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
from lookup_table.core.keyspace import META_TABLE, Kind
from lookup_table.core.optimizers import Optimizer, column_at, items_at
from lookup_table.core.rowcache import Located, Spots
from lookup_table.core.rows import NOT_UPDATED, change_witnesses
from lookup_table.dense import DenseParams
from lookup_table.errors import RowOverflowError
from optimizer_service.engine.items import Items, Unwritten
from optimizer_service.engine.plan import TableStep, TableUpdate, WritePlan, shares, stacked
from optimizer_service.engine.replica import ReplicaState
from optimizer_service.engine.rounding import RowRounder, key_counts, round_batch
from optimizer_service.engine.write_behind import RowFlushes
from optimizer_service.errors import BadRequestError
from optimizer_service.push import Push, TableGrads

logger = logging.getLogger(__name__)


# above this many floats per batch (`Stepper.step_tables`), the math runs in a thread:
# compiled (lookup_table.core.jit), the step is cheaper than the hand-off to a thread
# below that
OFFLOAD_FLOATS = 1 << 18


Stepped = tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.int64]]
"""New rows (n, dim), new slots (n, slot width), and each item's change witness (n,)."""


# the tables of one batch that round their rows: (rounder, ids) a table, in order
Roundings = Sequence[tuple[RowRounder, IdArray]]


def _step_rows_sync(
    optimizer: Optimizer,
    rows: NDArray[np.float32],
    grads: NDArray[np.float32],
    slots: NDArray[np.float32],
    roundings: Roundings = (),
) -> Stepped:
    """`optimizer.update`, its rows rounded as their tables store them (`roundings`, none
    for float32 tables), and what the journal keeps of it: `change_witnesses`.

    Raises:
        BadRequestError: a value the table's dtype cannot hold (RowOverflowError's message).
    """
    with _overflow_refused():
        new_rows, new_slots = optimizer.update(rows, grads, slots)
        if roundings:
            column = roundings[0][0].step_column  # the batch's optimizer's
            old_steps = None if column is None else slots[:, column]
            round_batch(roundings, new_rows, partial(key_counts, old_steps, new_slots))
    return new_rows, new_slots, change_witnesses((rows, slots), (new_rows, new_slots))


@contextmanager
def _overflow_refused() -> Iterator[None]:
    """A value a table's dtype cannot hold (a row, or a row-wise Adam m) refused as the
    push's 400 `row_overflow`: its message says which and what to do; nothing is written."""
    try:
        yield
    except RowOverflowError as exc:
        raise BadRequestError(str(exc), reason="row_overflow") from exc


async def step_rows(
    optimizer: Optimizer,
    rows: NDArray[np.float32],
    grads: NDArray[np.float32],
    slots: NDArray[np.float32],
    roundings: Roundings = (),
) -> Stepped:
    """`_step_rows_sync`, in a thread above OFFLOAD_FLOATS floats (not to stall the loop)."""
    if rows.size > OFFLOAD_FLOATS:
        return await asyncio.to_thread(_step_rows_sync, optimizer, rows, grads, slots, roundings)
    return _step_rows_sync(optimizer, rows, grads, slots, roundings)


@dataclass(slots=True)
class TableStart:
    """One table of a push, read: its optimizer step (`step`: the ids it updates and the
    rows and slots they start from). Admission (`admit_after`) keeps only the ids that
    have a row: `keep` are their positions among the push's, and `all_rows` every id's
    row (the initial value for a dropped one), for the push's answer."""

    grads: TableGrads
    step: TableStep
    keep: NDArray[np.intp] | None = None
    all_rows: NDArray[np.float32] | None = None
    created: int = 0  # ids without a row that the step starts from their initial values
    # rows written behind from the row cache: stepped where they are (`step` has no rows)
    place: InPlace | None = None


@dataclass(slots=True)
class InPlace:
    """Where a table's rows and slots are, as items (a row, then its slots), when it is
    stepped where they are (`Optimizer.update_at`): row i's at `at[i]` in the row cache's
    map (`spots`), or `extra[-1 - at[i]]` (read from memcached, or initial values)."""

    spots: Spots
    at: NDArray[np.intp]
    extra: NDArray[np.float32]


class CacheMoved(Exception):
    """The row cache's map that a push located its rows in was reused since (rotated out
    twice while the push read the rest): the `Updater` reads the push's rows again."""


_NO_ROWS = np.empty((0, 0), dtype=np.float32)  # a `TableStep`'s rows stepped in place


@dataclass(frozen=True, slots=True)
class Peek:
    """What a push reads of memcached before its rows (`Stepper.peek`, one round trip
    per node): every node's sentinel, whether its done record exists, and the dense
    `current` pointer (None when the push does not read it, or before `init`)."""

    sentinels: dict[str, bytes | None]
    done: bool
    current: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class CachedItems:
    """New items of tables stepped in place, for `RowCache.put_items`."""

    spots: Spots
    at: NDArray[np.intp]
    parts: list[tuple[str, IdArray]]
    items: NDArray[np.float32]


async def _sentinels_of(peek: asyncio.Future[Peek]) -> dict[str, bytes | None]:
    return (await peek).sentinels


def _joined(places: Sequence[InPlace]) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
    """The places of tables stepped as one batch as one: their `at` one after another,
    each table's `extra` indices shifted past the tables' before it."""
    if len(places) == 1:
        return places[0].at, places[0].extra
    ats = []
    shift = 0
    for place in places:
        at = place.at
        if place.extra.shape[0]:
            at = np.where(at < 0, at - shift, at)
            shift += place.extra.shape[0]
        ats.append(at)
    return np.concatenate(ats), np.concatenate([p.extra for p in places])


class Stepper:
    """Reads what a push's tables start from and runs their optimizers' steps."""

    def __init__(self, state: ReplicaState, items: Items, row_flushes: RowFlushes) -> None:
        self.state = state
        self.items = items
        self.row_flushes = row_flushes  # a node's new sentinel: rows written behind first

    def reads_dense(self, push: Push, version: int | None) -> bool:
        return bool(push.dense) or (version is not None and self.state.replica == 0)

    async def peek(self, push: Push, version: int | None) -> Peek:
        """The nodes' sentinels, the push's done record and (a dense update) the dense
        `current` pointer, in one round trip per node (`EmbeddingStore.peek`)."""
        reads: list[tuple[str, Any, str]] = [
            (META_TABLE, [self.state.record_id(push.push_id)], Kind.PUSH_RECORD)
        ]
        if self.reads_dense(push, version):
            reads.append(DenseParams.CURRENT_READ)
        sentinels, values = await self.state.store.peek(reads)
        current = DenseParams.pointer(values[1][0]) if len(values) > 1 else None
        return Peek(sentinels, done=values[0][0] is not None, current=current)

    async def plan_push(
        self, push: Push, version: int | None, peek: asyncio.Future[Peek]
    ) -> tuple[WritePlan, list[TableStart]]:
        """Read what the push updates; compute the dense update. The plan's `steps` (what
        is journaled) are set, its `updates` are `step_tables` from the tables returned."""
        prepared = await self.read_starts(push.tables, peek)
        dense = self.reads_dense(push, version)
        # the dense `current` pointer is read with the sentinels: the in-memory copy is
        # used when it still names it (no read of the whole generation)
        current = (await peek).current
        plan = WritePlan(push_id=push.push_id, updates=[], version=version)
        if not dense:
            return plan, prepared
        state = None if current is None else await self.state.dense.read(current=current)
        if state is None:
            if push.dense:
                raise BadRequestError(
                    "dense: the dense parameters are not initialized; POST /v1/dense/init "
                    "first (trainer.Trainer does)",
                    reason="dense_uninitialized",
                )
            return plan, prepared
        self.state.dense.check_grads(state, push.dense)
        if plan.version is None:
            plan.version = state.version + 1
        if push.dense:
            plan.dense = self.state.dense.update(state, push.dense)
        else:  # only the version moves (a sync round without dense gradients)
            plan.dense = (dict(state.params), dict(state.slots))
        plan.dense_logged = True
        return plan, prepared

    async def read_starts(
        self, tables: Sequence[TableGrads], peek: asyncio.Future[Peek] | None = None
    ) -> list[TableStart]:
        """Read the rows and slots of every table of a push (one request per node; a row
        and its slots are one item), those not in the cache: what each table's optimizer
        step starts from. The tables written behind are only located in the cache
        (`steps_in_place`): their step reads the cached items where they are."""
        use = [
            self.state.sentinels is not None and self.state.cache.caches(g.table) for g in tables
        ]
        here = [u and self.steps_in_place(g.table) for g, u in zip(tables, use, strict=True)]
        located = iter(
            self.state.cache.locate_many(
                [(g.table, g.ids) for g, h in zip(tables, here, strict=True) if h]
            )
        )
        wanted = [
            (g.table, g.ids) for g, u, h in zip(tables, use, here, strict=True) if u and not h
        ]
        from_cache = iter(self.state.cache.lookup_many(wanted))
        cached: list[tuple[NDArray[np.bool_], NDArray[np.float32], NDArray[np.float32]]] = []
        initials: list[NDArray[np.bool_] | None] = []  # hits without a row in memcached
        places: list[Any] = []  # the `Located` of a table stepped in place
        for grads, cache_it, in_place in zip(tables, use, here, strict=True):
            if in_place:
                place = next(located)
                cached.append((place.hit, _NO_ROWS, _NO_ROWS))
                initials.append(place.initial if place.initial.any() else None)
                places.append(place)
            elif cache_it:
                hit, rows_c, slots_c, unwritten = next(from_cache)
                cached.append((hit, rows_c, slots_c))
                initials.append(unwritten if unwritten.any() else None)
                places.append(None)
            else:
                n = grads.ids.shape[0]
                nothing = np.empty((n, 0), dtype=np.float32)
                cached.append((np.zeros(n, dtype=bool), nothing, nothing))
                initials.append(None)
                places.append(None)
        read = self.items.read([(g.table, g.ids) for g in tables], [~hit for hit, _, _ in cached])
        if any(hit.any() for hit, _, _ in cached):
            # cached rows are what this replica wrote, unless a node lost its data since
            # (its sentinel is gone, or new after a reinit): read together with the rest,
            # or with the push's done record (`peek`)
            sentinels, values = await asyncio.gather(
                self.state.store.sentinels() if peek is None else _sentinels_of(peek), read
            )
            if sentinels != self.state.sentinels:
                logger.warning(
                    "replica %d: a node's sentinel changed (lost data, reinit): the row "
                    "cache is dropped",
                    self.state.replica,
                )
                if self.state.flush_every > 1:
                    # the newest values of the rows written behind are only here (and in
                    # their journals): written first (a lost node fails it: DataLossError)
                    await self.row_flushes.flush()
                self.state.forget_rows()
                self.state.sentinels = sentinels if all(sentinels.values()) else None
                return await self.read_starts(tables)
        else:
            values = await read
        starts: list[tuple[TableGrads, NDArray[np.float32], NDArray[np.bool_], Any]] = []
        unknown: list[Unwritten] = []
        out: list[TableStart | None] = []
        for grads, (hit, rows_c, slots_c), read, initial, place in zip(
            tables, cached, values, initials, places, strict=True
        ):
            spec = self.state.config.table(grads.table)
            # cached with a row (an initial entry has none: this push creates it, from
            # the initial values the cache holds)
            stored = hit if initial is None else hit & ~initial
            if place is not None:
                out.append(self.start_in_place(grads, place, stored, read, unknown))
                continue
            width = self.state.optimizers[grads.table].slot_width(spec.dim)
            n = grads.ids.shape[0]
            if hit.all():
                rows, found, slots = rows_c, stored, slots_c
            elif not hit.any():  # all read: the read's own arrays, no copy
                items, found = read
                rows, slots = items[:, : spec.dim], items[:, spec.dim :]
            else:
                miss = np.flatnonzero(~hit)
                rows = np.empty((n, spec.dim), dtype=np.float32)
                slots = np.empty((n, width), dtype=np.float32)
                found = stored.copy()
                rows[hit], slots[hit] = rows_c[hit], slots_c[hit]
                items, found[miss] = read
                rows[miss], slots[miss] = items[:, : spec.dim], items[:, spec.dim :]
            starts.append((grads, rows, found, slots))
            unknown.append((grads.table, grads.ids, rows, slots, found | hit))
            out.append(None)
        self.items.fill_unwritten(unknown)
        regular = iter([self.start_table(*start) for start in starts])
        return [p if p is not None else next(regular) for p in out]

    def steps_in_place(self, table: str) -> bool:
        """Whether a table's step reads its rows where the row cache holds them (its rows
        are written behind, and read through this replica: `reads_through_owner`)."""
        return self.state.flush_every > 1 and self.state.config.reads_through_owner(table)

    def start_in_place(
        self,
        grads: TableGrads,
        place: Located,
        stored: NDArray[np.bool_],
        read: tuple[NDArray[np.float32], NDArray[np.bool_]] | None,
        unknown: list[Unwritten],
    ) -> TableStart:
        """A table stepped in place: the items of the ids the cache lacks are `read`
        (memcached's; their initial values where it has no row either: `unknown` gets
        them for `Items.fill_unwritten`) and go to the step's `extra`."""
        at = place.at
        found = stored
        if read is None:
            extra = np.empty((0, place.spots.cache.width), dtype=np.float32)
        else:
            extra, found_m = read
            miss = np.flatnonzero(at < 0)
            at = at.copy()
            at[miss] = -1 - np.arange(miss.shape[0])
            found = stored.copy()
            found[miss] = found_m
            dim = grads.grads.shape[1]
            unknown.append((grads.table, grads.ids[miss], extra[:, :dim], extra[:, dim:], found_m))
        step = TableStep(grads.table, grads.ids, grads.grads, _NO_ROWS, _NO_ROWS)
        created = int(found.shape[0] - np.count_nonzero(found))
        return TableStart(grads, step, created=created, place=InPlace(place.spots, at, extra))

    def start_table(
        self,
        grads: TableGrads,
        rows: NDArray[np.float32],
        found: NDArray[np.bool_],
        slots: NDArray[np.float32],
    ) -> TableStart:
        """One table's step: the rows and slots it starts from (slots (n, 0) for an
        optimizer without)."""
        spec = self.state.config.table(grads.table)
        if spec.admit_after > 1 and not found.all():
            # not admitted yet (no row: lookups saw the id fewer than admit_after times):
            # its gradients are dropped, its row stays the initial value, nothing is written
            keep = np.flatnonzero(found)
            step = TableStep(
                grads.table, grads.ids[keep], grads.grads[keep], rows[keep], slots[keep]
            )
            return TableStart(grads, step, keep=keep, all_rows=rows)
        created = int(found.shape[0] - np.count_nonzero(found))
        step = TableStep(grads.table, grads.ids, grads.grads, rows, slots)
        return TableStart(grads, step, created=created)

    async def step_tables(
        self, prepared: Sequence[TableStart], *, behind: bool = True
    ) -> tuple[list[TableUpdate], list[CachedItems]]:
        """Each table's new rows and slots (its optimizer's step from its `TableStart`),
        and the new items of the tables stepped in place, for `RowCache.put_items`.

        Tables with equal optimizers (same settings) and dims are stepped as one batch:
        the math is row by row, elementwise, so a row's result does not depend on the
        rows beside it (bit for bit what a step of its table alone gives, which is how
        a replay recomputes it), and a push of 26 small tables costs one pass of numpy
        calls instead of 26. Tables located in the row cache are stepped where their
        items are (`Optimizer.update_at`), unless the rows are not written behind after
        all (`behind` False: the journal needs change witnesses, of the old values) or
        the batch is large enough for a thread: then their items are gathered first.
        Rows of 16-bit tables are rounded to what their table stores right after the
        step, whichever way it ran (`round_batch`: the same bits both ways).

        Raises:
            CacheMoved: the cache reused the map the rows were located in (`Updater` reads
                them again).
        """
        rounders = self.state.rounders
        groups: dict[tuple[Optimizer, int], list[TableStart]] = {}
        here: dict[tuple[Optimizer, int, Spots], list[TableStart]] = {}
        for p in prepared:
            optimizer, dim = self.state.optimizers[p.grads.table], p.grads.grads.shape[1]
            if p.place is None:
                groups.setdefault((optimizer, dim), []).append(p)
            else:
                here.setdefault((optimizer, dim, p.place.spots), []).append(p)
        for (optimizer, dim, spots), members in list(here.items()):
            if not behind or sum(p.grads.grads.size for p in members) > OFFLOAD_FLOATS:
                del here[optimizer, dim, spots]
                for p in members:
                    self.gather_items(p)
                groups.setdefault((optimizer, dim), []).extend(members)
        stepped: dict[int, Stepped] = {}

        async def batch(optimizer: Optimizer, members: list[TableStart]) -> None:
            steps = [p.step for p in members]
            roundings = [(rounders[s.table], s.ids) for s in steps]
            new_rows, new_slots, witness = await step_rows(
                optimizer,
                stacked([s.rows for s in steps]),
                stacked([s.grads for s in steps]),
                stacked([s.slots for s in steps]),
                roundings if any(r.rounds for r, _ in roundings) else (),
            )
            for s, rows, slots, w in zip(
                steps,
                shares(new_rows, steps),
                shares(new_slots, steps),
                shares(witness, steps),
                strict=True,
            ):
                stepped[id(s)] = (rows, slots, w)

        await asyncio.gather(*(batch(key[0], members) for key, members in groups.items()))
        updates = {
            id(p): self.table_update(p, *stepped[id(p.step)])
            for p in prepared
            if id(p.step) in stepped
        }
        puts: list[CachedItems] = []
        for (optimizer, dim, spots), members in here.items():
            values = self.state.cache.values_of(spots)
            if values is None:
                raise CacheMoved(f"the row cache reused the map of {len(members)} tables' rows")
            at, extra = _joined([p.place for p in members if p.place is not None])
            grads = stacked([p.grads.grads for p in members])
            roundings = [(rounders[p.step.table], p.step.ids) for p in members]
            rounds = any(r.rounds for r, _ in roundings)
            column = roundings[0][0].step_column
            # a row's key counts its steps before this one: read from the old items (the
            # new step is no count past 2**24, where float32's step + 1 == step)
            old_steps = (
                column_at(values, at, extra, dim + column)
                if rounds and column is not None and any(r.stochastic for r, _ in roundings)
                else None
            )
            with _overflow_refused():
                rows, items = optimizer.update_at(values, at, extra, grads)
                if rounds:
                    # the new arrays are rounded before anything holds them (the cache
                    # gets the items after the journal): every holder keeps stored values
                    counts = partial(key_counts, old_steps, items[:, dim:])
                    round_batch(roundings, rows, counts)
                    items[:, :dim] = rows
            steps = [p.step for p in members]
            for p, new_rows, new_items in zip(
                members, shares(rows, steps), shares(items, steps), strict=True
            ):
                updates[id(p)] = TableUpdate(
                    p.step.table,
                    p.step.ids,
                    new_rows,
                    new_items[:, dim:],
                    grads=p.step.grads,
                    created=p.created,
                )
            puts.append(
                CachedItems(spots, at, [(p.step.table, p.step.ids) for p in members], items)
            )
        return [updates[id(p)] for p in prepared], puts

    def gather_items(self, p: TableStart) -> None:
        """A table located in the row cache gets its rows and slots as arrays (the step
        then runs as for any table).

        Raises:
            CacheMoved: the map it was located in was reused since.
        """
        place = p.place
        if place is None:
            return
        values = self.state.cache.values_of(place.spots)
        if values is None:
            raise CacheMoved(f"the row cache reused the map of table {p.step.table!r}'s rows")
        items = items_at(values, place.at, place.extra)
        dim = p.grads.grads.shape[1]
        p.step = TableStep(p.step.table, p.step.ids, p.step.grads, items[:, :dim], items[:, dim:])
        p.place = None

    @staticmethod
    def table_update(
        p: TableStart,
        new_rows: NDArray[np.float32],
        new_slots: NDArray[np.float32],
        witness: NDArray[np.int64],
    ) -> TableUpdate:
        step = p.step
        if p.keep is None or p.all_rows is None:
            return TableUpdate(
                step.table,
                step.ids,
                new_rows,
                new_slots,
                grads=step.grads,
                witness=witness,
                created=p.created,
            )
        # the push's answer gives the dropped ids their initial rows (`all_rows` holds them)
        answer = p.all_rows.copy()
        answer[p.keep] = new_rows
        every = np.full(p.grads.ids.shape[0], NOT_UPDATED, dtype=np.int64)
        every[p.keep] = witness  # the journal's ids are the push's: a replay skips the rest
        return TableUpdate(
            table=step.table,
            ids=step.ids,
            rows=new_rows,
            slots=new_slots,
            grads=step.grads,
            answer=(p.grads.ids, answer),
            dropped=int(p.grads.ids.shape[0] - p.keep.size),
            witness=every,
        )
