"""Apply pushes exactly once: read rows + slots, run the optimizer, journal, write back.

Exactly-once, per replica K (the replica owns its rows; nobody else writes them):

1. A push whose id has a *done record* (`_meta/p/rK:<push_id>`, TTL
   `service.push_record_ttl_s`, read together with its rows in step 3) is
   acknowledged and not applied again. Two copies of one push in flight at once share
   one application (in-process).
2. The rows of the push are locked (in-process; no two pushes read-modify-write
   one row at once; pushes on disjoint rows run concurrently): `locks.RowLocks`.
3. Rows and slots are read, the optimizer computes the new ones: a `plan.WritePlan`.
   While it computes, the push's summed gradients go to a *journal slot*
   (`_meta/j/rK-jS`, `journal.Journal.write_start`; chunks, unless small).
4. The journal is finished (`write_end`): a change witness per item (a word the push
   changes, with its old bits: `rows.change_witnesses`), then the header, written last
   with the body's checksum.
5. Rows and slots are written, then the done record; the push is answered and its
   rows unlocked, and the journal header is cleared in the background (a journal whose
   push has a done record is never replayed).

A crash before 4 completes leaves the rows untouched: the retry recomputes. A
crash after 4 leaves a journal: a restarting replica replays every journal whose
push has no done record *before it serves* (`recover`), so the retry finds the
done record. A replay reads the rows and slots and recomputes only the items whose
witness word still has its old bits (`plan`): any mix a write stopped part-way leaves
ends exactly as the push computed it. If writing fails after 4 in a live replica, the
push's rows stay locked and a background task replays the journal until it succeeds, so
no other push can read a half-written row. While that replay keeps failing (a full `-M`
node, a lost or stopped one), a push that needs those rows, or a journal slot when
every slot is held so, fails at once with the replay's last error (the same store
error, naming the node) instead of waiting for rows that may never be released.

Dense parameters (replica 0) are written behind: the dense update of a push is
computed from the in-memory state of `DenseParams` (checked against memcached's
`current` pointer, read together with the rows: a state stored behind this replica's
back, a restore, wins), its gradients are written as the *log* of its version together
with the journal's start, and the journal says only that the log is there
(`plan.dense_logged`). Once the plan is written (rows, version) the new state is the
in-memory one; every `service.dense_flush_pushes` updates or `service.dense_flush_s`
seconds, and when the replica pauses or closes, it is written as a generation in the
background (`DenseParams.flush`), which deletes the logs it covers. A restarted replica
rebuilds the state from the stored generation and the logs up to its stored version
(`recover`): the logs of every journaled push are there, the logs of pushes that were
never journaled are not counted. Updates of the dense parameters (and of the version)
are serialized by one more row lock (`locks.LockSet.dense`): a failed dense write keeps
it with its replay, so the next dense push never computes from a state the replay will
change; while the replay keeps failing, that push fails fast with its error, as pushes
on its rows do.

In sync mode the pushes of one version are first collected by `sync.SyncRounds`,
which applies their mean as one push.

Stamps: each push this replica computes is its next change (`_changes`) since its
epoch, which is new whenever it may have lost track of its rows (a start, `reload`, a
node's new sentinel: when its row cache is dropped). The answer of a live push carries
`stamp: [epoch, seq]` while the row cache is in use, so a trainer knows whether any
other push came between two of its own (`lookup_table.session`, answered rows).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.initializers import initial_rows_many
from lookup_table.core.keys import IdArray
from lookup_table.core.keyspace import META_TABLE, Kind, push_record_id, version_id
from lookup_table.core.optimizers import Optimizer, items_at, make_optimizer, step_slot
from lookup_table.core.rowcache import Located, RowCache, Spots
from lookup_table.core.rows import NOT_UPDATED, change_witnesses, still_old, value_hashes
from lookup_table.core.sharding import row_hashes_many
from lookup_table.core.wire import encode_array, encode_ids, unpack
from lookup_table.dense import DenseLogError, DenseParams
from lookup_table.errors import DataLossError
from lookup_table.store import EmbeddingStore, TableRead, TableWrite
from optimizer_service.engine.journal import JOURNAL_SLOTS, IncompleteJournalError, Journal
from optimizer_service.engine.locks import LockSet, RowLocks
from optimizer_service.engine.plan import (
    TableRedo,
    TableStep,
    TableUpdate,
    WritePlan,
    shares,
    stacked,
)
from optimizer_service.engine.sync import SyncRounds
from optimizer_service.errors import BadRequestError, NotOwnerError
from optimizer_service.push import Push, TableGrads

__all__ = ["PLAN", "Updater"]

logger = logging.getLogger(__name__)

PLAN = "_plan"  # in `apply`'s result: the write plan of the push this call applied
# above this many floats per batch (`_computed`), the math runs in a thread: compiled
# (lookup_table.core.jit), 2^18 floats of Adam take ~0.4 ms, less than the hand-off to a
# thread costs the replica below that (the demo's pushes, 104,000 floats: ~0.35 ms of
# the replica's CPU a push)
_OFFLOAD_FLOATS = 1 << 18
# Rows written behind: a flush also comes once the journals it would clear hold this
# many bytes, whatever `service.row_flush_pushes` says. They wait in memcached until the
# flush: big pushes of the same rows (a few distinct rows, so the row cache's budget does
# not call the flush) must not fill a node with journals (the demo's ~0.5 MB a push:
# ~28 MB at 56 pushes).
KEPT_JOURNAL_BYTES = 64 << 20


Stepped = tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.int64]]
"""New rows (n, dim), new slots (n, slot width), and each item's change witness (n,)."""
# (table, ids, rows, slots, known): what a step starts from, filled in where not known
Unwritten = tuple[str, IdArray, NDArray[np.float32], NDArray[np.float32], NDArray[np.bool_]]


def _step_sync(
    optimizer: Optimizer,
    rows: NDArray[np.float32],
    grads: NDArray[np.float32],
    slots: NDArray[np.float32],
) -> Stepped:
    """`optimizer.update`, and what the journal keeps of it: `change_witnesses`."""
    new_rows, new_slots = optimizer.update(rows, grads, slots)
    return new_rows, new_slots, change_witnesses((rows, slots), (new_rows, new_slots))


async def _step(
    optimizer: Optimizer,
    rows: NDArray[np.float32],
    grads: NDArray[np.float32],
    slots: NDArray[np.float32],
) -> Stepped:
    """`_step_sync`, in a thread above _OFFLOAD_FLOATS floats (not to stall the loop)."""
    if rows.size > _OFFLOAD_FLOATS:
        return await asyncio.to_thread(_step_sync, optimizer, rows, grads, slots)
    return _step_sync(optimizer, rows, grads, slots)


@dataclass(slots=True)
class _Prepared:
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
    place: _InPlace | None = None


@dataclass(slots=True)
class _InPlace:
    """Where a table's rows and slots are, as items (a row, then its slots), when it is
    stepped where they are (`Optimizer.update_at`): row i's at `at[i]` in the row cache's
    map (`spots`), or `extra[-1 - at[i]]` (read from memcached, or initial values)."""

    spots: Spots
    at: NDArray[np.intp]
    extra: NDArray[np.float32]


class _Moved(Exception):
    """The row cache's map that a push located its rows in was reused since (rotated out
    twice while the push read the rest): `_apply` reads the push's rows again."""


_NO_ROWS = np.empty((0, 0), dtype=np.float32)  # a `TableStep`'s rows stepped in place


@dataclass(frozen=True, slots=True)
class _Peek:
    """What a push reads of memcached before its rows (`Updater._peek`, one round trip
    per node): every node's sentinel, whether its done record exists, and the dense
    `current` pointer (None when the push does not read it, or before `init`)."""

    sentinels: dict[str, bytes | None]
    done: bool
    current: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class _CachedItems:
    """New items of tables stepped in place, for `RowCache.put_items`."""

    spots: Spots
    at: NDArray[np.intp]
    parts: list[tuple[str, IdArray]]
    items: NDArray[np.float32]


async def _sentinels_of(peek: asyncio.Future[_Peek]) -> dict[str, bytes | None]:
    return (await peek).sentinels


def _joined(places: Sequence[_InPlace]) -> tuple[NDArray[np.intp], NDArray[np.float32]]:
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


class Updater:
    """The read-update-write engine of one replica (the service's I/O shell)."""

    def __init__(
        self,
        config: ClusterConfig,
        store: EmbeddingStore,
        *,
        replica: int = 0,
        push_record_ttl_s: int = 86_400,
        on_rows: Any = None,
        on_dropped: Callable[[str, int], None] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.replica = replica
        self.push_record_ttl_s = push_record_ttl_s
        self.optimizers = {t.name: make_optimizer(t.optimizer) for t in config.tables}
        # each table's step column (Adam): its journal written behind keeps the gradients
        # and steps (module journal). Not with `ttl_s`: a row that expired before a replay
        # would look like a lost update; its values are journaled
        self._step_slots = {
            t.name: step_slot(self.optimizers[t.name], t.dim) if t.ttl_s is None else None
            for t in config.tables
        }
        self.dense = DenseParams(store, make_optimizer(config.optimizer))
        self.locks = RowLocks()
        # rows written behind (docs/write-behind.md): every row_flush_pushes pushes
        self._flush_every = config.service.row_flush_pushes
        self.journal = Journal(
            store, replica=replica, behind=self._flush_every if self._flush_every > 1 else 0
        )
        self.cache = RowCache(
            {
                t.name: (t.dim, self.optimizers[t.name].slot_width(t.dim))
                for t in config.tables
                if t.id_type == "int64"
                and t.ttl_s is None  # see lookup_table.core.rowcache
                # rows written behind: only those trainers read through this replica
                and (self._flush_every == 1 or config.reads_through_owner(t.name))
            },
            config.service.cache_mb * 2**20,
        )
        self._sentinels: dict[str, bytes | None] | None = None  # None: cache not in use
        # an answer's `stamp`: this replica's rows as it knows them (a new epoch when it
        # may not any more) and how many pushes changed them
        self._epoch = uuid.uuid4().hex[:16]
        self._changes = 0
        self.applied = 0
        self.version = 0
        self._version_changed = asyncio.Condition()
        self._inflight: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._finishers: set[asyncio.Task[None]] = set()
        self._cleanups: set[asyncio.Task[object]] = set()
        self._recording: set[str] = set()  # written pushes whose done record is on its way
        self._on_rows = on_rows
        self._on_dropped = on_dropped  # (table, gradients of ids without a row dropped)
        self._rounds = SyncRounds(config.workers)
        self._open = asyncio.Event()
        self._open.set()
        self._active = 0
        self._idle = asyncio.Condition()
        self._auto_resume: asyncio.TimerHandle | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[object] | None = None
        # rows written behind: the journal slots of done pushes whose values a flush has
        # not written yet (in the order they were done), slots to clear, the journals'
        # sequence
        self._unflushed: list[int] = []
        self._journal_bytes: dict[int, int] = {}  # slot -> bytes of its journal
        self._to_clear: list[int] = []
        self._journal_seq = 0
        self._row_flush_lock = asyncio.Lock()
        self._row_flushing: asyncio.Task[object] | None = None
        self._row_timer: asyncio.TimerHandle | None = None

    @property
    def unwritten_rows(self) -> int:
        """Rows (with their slots) this replica holds that memcached does not yet: written
        behind since the last flush, or being written by one."""
        return self.cache.unwritten()

    @property
    def unflushed_pushes(self) -> int:
        """Pushes done since the last flush of the rows written behind began."""
        return len(self._unflushed)

    # ------------------------------------------------------------ push records

    def _record_id(self, push_id: str) -> str:
        return push_record_id(self.replica, push_id)

    async def is_done(self, push_id: str) -> bool:
        if push_id in self._recording:
            return True
        (value,) = await self.store.get_blobs(
            META_TABLE, [self._record_id(push_id)], kind=Kind.PUSH_RECORD
        )
        return value is not None

    # ------------------------------------------------------------ pause / resume

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def pause(self, *, timeout_s: float = 600.0, drop_unfinished: bool = False) -> int:
        """Hold new pushes and wait for those in flight; resumes by itself after `timeout_s`.

        Returns how many pushes are still being finished in the background (their write
        failed and their journal is replayed until it sticks), plus the pushes whose rows
        and the dense updates that could not be written behind now (`_flush_rows`,
        `DenseParams.flush`): memcached does not hold all they wrote, so a checkpoint
        taken now would not be consistent.
        `drop_unfinished` cancels those replays and a dense flush under way first, and
        writes nothing behind: only for a restore or a reset, which replaces every row
        they would write (and deletes their journals); otherwise they could write the
        old rows over the new ones.
        """
        self._open.clear()
        if self._auto_resume is not None:
            self._auto_resume.cancel()
        self._auto_resume = asyncio.get_running_loop().call_later(timeout_s, self.resume)
        async with self._idle:
            await self._idle.wait_for(lambda: self._active == 0)
        if self._finishers and drop_unfinished:
            logger.warning(
                "replica %d: dropping %d unfinished pushes (a restore replaces their rows)",
                self.replica,
                len(self._finishers),
            )
            for task in self._finishers:
                task.cancel()
        if drop_unfinished:
            self._drop_unflushed()
            self._drop_dense_flush()
        if self._finishers or self._cleanups:  # a replay about to succeed, journal clears
            await asyncio.wait(self._finishers | self._cleanups, timeout=2.0)
        unflushed = 0
        if not drop_unfinished and self._flush_every > 1:
            try:  # a checkpoint reads memcached: the rows written behind go there
                await self._flush_rows()
            except Exception:
                unflushed += len(self._unflushed)
                logger.warning(
                    "replica %d: writing the rows behind at the pause failed: %d pushes are "
                    "only in their journals",
                    self.replica,
                    unflushed,
                    exc_info=True,
                )
        if not drop_unfinished:  # a checkpoint reads memcached: the dense state goes there
            self._cancel_flush_timer()
            try:
                await self.dense.flush()
            except Exception:
                # their logs keep them; a save refuses to read a state they are missing from
                unflushed += self.dense.unflushed
                logger.warning(
                    "replica %d: writing the dense parameters behind at the pause failed: "
                    "%d updates are only in their logs",
                    self.replica,
                    self.dense.unflushed,
                    exc_info=True,
                )
        return len(self._finishers) + unflushed

    async def reload(self) -> int:
        """Forget in-memory model state and read the version again (after a restore).

        Only while paused: nothing is in flight, so no push can mix the old state with
        the restored one. Returns the version now served.
        """
        if not self.paused:
            raise RuntimeError("reload() needs a paused replica")
        self._rounds.clear()
        self._cancel_flush_timer()
        self.dense.forget()
        self._forget_rows()
        self._sentinels = await self._cache_sentinels()
        version = await self._stored_version()
        async with self._version_changed:
            self.version = version  # may go back: the checkpoint is older
            self._version_changed.notify_all()
        logger.warning("replica %d: reloaded after a restore, version %d", self.replica, version)
        return version

    def _forget_rows(self) -> None:
        """Drop the row cache: what this replica knew of its rows may not hold any more
        (a restore, a node's new sentinel). A new epoch tells trainers the same."""
        self.cache.forget()
        self._epoch = uuid.uuid4().hex[:16]

    def resume(self) -> None:
        if self._auto_resume is not None:
            self._auto_resume.cancel()
            self._auto_resume = None
        self._open.set()
        self._flush_when_due()  # what a failed flush at the pause left, or came since

    @asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        await self._open.wait()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                async with self._idle:
                    self._idle.notify_all()

    # ------------------------------------------------------------ versions

    async def wait_version(self, after: int, *, timeout_s: float) -> int:
        """Long-poll: the version once it is > `after`, or the current one at the timeout."""
        async with self._version_changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._version_changed.wait_for(lambda: self.version > after)
            except TimeoutError:
                pass
            return self.version

    async def _set_version(self, version: int) -> None:
        async with self._version_changed:
            self.version = max(self.version, version)
            self._version_changed.notify_all()

    # ------------------------------------------------------------ the push path

    async def apply(
        self, push: Push, *, on_plan: Callable[[WritePlan], None] | None = None
    ) -> dict[str, Any]:
        """Apply `push` at most once; returns `{applied, duplicate, rows, version}`.

        `on_plan(plan)` is called once the new values are computed, before anything is
        written (async mode, when this call applies the push): an early answer.
        """
        if push.dense and self.replica != 0:
            raise NotOwnerError(
                f"dense gradients go to replica 0 (dense parameters live there); this is "
                f"replica {self.replica}"
            )
        running = self._inflight.get(push.push_id)
        if running is not None:
            result = await asyncio.shield(running)
            return {
                **{k: v for k, v in result.items() if k != "created"},  # counted once
                "applied": False,
                "duplicate": True,
            }
        if push.push_id in self._recording:  # written, its done record on its way
            return {"applied": False, "duplicate": True, "rows": 0, "version": self.version}
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._inflight[push.push_id] = future
        try:
            async with self._admitted():
                if self.config.mode == "sync":
                    result = await self._rounds.join(
                        push, version=self.version, apply=self._apply_round
                    )
                else:
                    result = await self._apply(push, version=None, on_plan=on_plan)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # mark retrieved: nobody else may be waiting
            raise
        else:
            future.set_result(result)
            return result
        finally:
            del self._inflight[push.push_id]

    async def _apply_round(self, merged: Push, version: int) -> dict[str, Any]:
        return await self._apply(merged, version=version)

    async def _apply(
        self,
        push: Push,
        *,
        version: int | None,
        on_plan: Callable[[WritePlan], None] | None = None,
    ) -> dict[str, Any]:
        if self._flush_every > 1:
            await self._room_for(push)
        keys = LockSet(
            row_hashes_many([t.table for t in push.tables], [t.ids for t in push.tables]),
            dense=bool(push.dense) or version is not None,  # one dense (and version) update
        )
        await self.locks.acquire(keys)
        handed_over = False
        try:
            slot = await self.journal.take()
            # the done record, the nodes' sentinels and the dense pointer: one round trip
            # per node, while the push's rows are located
            peek = asyncio.ensure_future(self._peek(push, version))
            reading = asyncio.gather(peek, self._plan(push, version, peek), return_exceptions=True)
            writes: list[asyncio.Future[Any]] = []
            plan: WritePlan | None = None
            cached: list[_CachedItems] = []
            journaled = False
            behind = False

            async def settled() -> None:  # no write of the slot in flight any more
                if writes:
                    await asyncio.wait(writes)
                for w in writes:
                    if not w.cancelled():
                        w.exception()  # retrieved: the error that stopped the push is raised

            try:
                peeked, planned = await reading
                if isinstance(peeked, BaseException):
                    raise peeked
                if peeked.done or push.push_id in self._recording:
                    self.journal.give_back(slot)
                    return {"applied": False, "duplicate": True, "rows": 0, "version": self.version}
                if isinstance(planned, BaseException):
                    raise planned
                # rows written behind while the row cache is in use (it holds them)
                behind = self._flush_every > 1 and self._sentinels is not None
                started = None
                if not behind:
                    # The journal's start (the gradients) is written while the optimizer
                    # computes, not while the rows are read: memcached and this loop then
                    # serve the reads alone (at 16,384 rows of dim 64, 4 MB of journal sent
                    # beside the reads made them 5 ms slower: benchmarks/optimizer.py)
                    started = asyncio.ensure_future(
                        self.journal.write_start(
                            slot, [(t.table, t.ids, t.grads) for t in push.tables]
                        )
                    )
                    writes.append(started)
                plan, prepared = planned
                if plan.dense_logged and plan.version is not None:  # while it computes
                    log = self.dense.write_log(plan.version, push.dense)
                    writes.append(asyncio.ensure_future(log))
                while True:
                    try:
                        plan.updates, cached = await self._computed(prepared, behind=behind)
                        break
                    except _Moved:  # rare: rotated out twice while the rest was read
                        prepared = await self._prepared(push.tables)
                self._changes += 1
                plan.seq = self._changes
                if on_plan is not None:
                    on_plan(plan)
                results = await asyncio.gather(*writes, return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                if started is None:  # the new values, kept until a flush writes them
                    self._journal_seq += 1
                    self._journal_bytes[slot] = await self.journal.write(
                        slot, plan, seq=self._journal_seq, step_slots=self._step_slots
                    )
                else:
                    await self.journal.write_end(slot, started.result(), plan)
                journaled = True
                await self._write_plan(plan, record=False, behind=behind)
            except BaseException:
                await settled()
                if plan is not None and (journaled or not behind):
                    # half written? (rows written behind: a row the cache holds dirty is
                    # only forgotten when the replay below writes a newer value)
                    self.cache.forget((u.table, u.ids) for u in plan.updates)
                if journaled and plan is not None:
                    # Half-written rows must not be seen: the rows stay locked and the
                    # journal slot taken until a background replay finishes the push.
                    self._finish_later(slot, plan, keys, behind=behind)
                    handed_over = True
                else:
                    # a dense log written for nothing is overwritten by the next update
                    # to its version (no journal names it: it never counts)
                    self.journal.give_back(slot)
                raise
            self._record_later(slot, plan, keys, behind=behind)
            handed_over = True
            if self._sentinels is not None:
                placed = {table for c in cached for table, _ in c.parts}
                self.cache.put_many(
                    [
                        (u.table, u.ids, u.rows, u.slots)
                        for u in plan.updates
                        if u.table not in placed
                    ],
                    dirty=behind,
                )
                for c in cached:
                    self.cache.put_items(c.spots, c.at, c.parts, c.items, dirty=behind)
        finally:
            if not handed_over:
                await self.locks.release(keys)
        self.applied += 1
        for u in plan.updates:
            if self._on_rows is not None:
                self._on_rows(u.table, u.ids.shape[0])
            if u.dropped and self._on_dropped is not None:
                self._on_dropped(u.table, u.dropped)
        out = {
            "applied": True,
            "duplicate": False,
            "rows": push.num_rows,
            "version": self.version,
            PLAN: plan,
        }
        # rows this push (or sync round: SyncRounds tells the worker that applied it) created
        created = {u.table: u.created for u in plan.updates if u.created}
        if created:
            out["created"] = created
        return out

    async def answer(self, push: Push, result: Mapping[str, Any]) -> dict[str, Any]:
        """What `push.answer` asks back once `apply` returned `result` (read your writes).

        `updated`: per table of the push, its unique ids and their rows after the push;
        `params` and `dense_version`: the dense parameters (replica 0). Taken from the
        push's own write plan when this call applied it; otherwise (a duplicate, a sync
        round's merged push) read back from the store, then at least as new as the push.
        """
        plan: WritePlan | None = result.get(PLAN)
        out: dict[str, Any] = {}
        if plan is not None and plan.seq is not None and self._sentinels is not None:
            # while the row cache is in use, this replica knows every change of its rows:
            # its `plan.seq`-th change since `epoch` is this push's
            out["stamp"] = [self._epoch, plan.seq]
        if "rows" in push.answer:
            done = {u.table: u for u in plan.updates} if plan is not None else {}
            updated: dict[str, Any] = {}
            reads = []
            for t in push.tables:
                u = done.get(t.table)
                if u is not None:
                    ids, rows = (u.ids, u.rows) if u.answer is None else u.answer
                    if ids is t.ids or (ids.shape == t.ids.shape and np.array_equal(ids, t.ids)):
                        updated[t.table] = (t.ids, rows)
                        continue
                reads.append(t)
            if reads:
                got = await self._rows_now([(t.table, t.ids) for t in reads])
                for t, (rows, _) in zip(reads, got, strict=True):
                    updated[t.table] = (t.ids, rows)
            grouped = []
            for group in push.groups:  # as the push came: one array each, in its order
                if all(name in updated for name in group):
                    parts = [updated.pop(name) for name in group]
                    grouped.append(
                        {
                            "tables": list(group),
                            "counts": [int(ids.shape[0]) for ids, _ in parts],
                            "ids": encode_array(np.concatenate([ids for ids, _ in parts])),
                            "rows": encode_array(np.concatenate([rows for _, rows in parts])),
                        }
                    )
            if grouped:
                out["updated_groups"] = grouped
            out["updated"] = {
                name: {"ids": encode_ids(ids), "rows": encode_array(rows)}
                for name, (ids, rows) in updated.items()
            }
        if "dense" in push.answer:
            params: Mapping[str, NDArray[np.float32]]
            if plan is not None and plan.dense is not None and plan.version is not None:
                version, params = plan.version, plan.dense[0]
            else:
                state = await self.dense.read()
                if state is None:
                    return out
                version, params = state.version, state.params
            out["dense_version"] = version
            out["params"] = {n: encode_array(v) for n, v in params.items()}
        return out

    async def read_rows(
        self, reads: Sequence[tuple[str, IdArray]]
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """`POST /v1/rows`: the rows of each (table, unique ids of this replica's) as this
        replica knows them, and which exist; an id without a row gets its initial value
        and nothing is created (its first push writes it). Waits while paused, as a push
        does: a restore's rows are what a read after it sees."""
        async with self._admitted():
            return await self._rows_now(reads)

    async def _rows_now(
        self, reads: Sequence[tuple[str, IdArray]]
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """(rows, found) of each (table, unique ids): the row cache's (written behind,
        memcached may not hold them yet), memcached's for the rest (one request per node),
        initial values where neither has a row (not created, not admitted, or expired).

        The cache is asked first: a row it lacks is one memcached holds at its newest
        (this replica is its only writer, and never drops a row it has not written), so a
        read that follows returns that value or a newer one. Ids of tables read through
        their owner (`ClusterConfig.reads_through_owner`: this replica is the only one to
        create their rows) that memcached has no row for are remembered as initial
        entries (`lookup_table.core.rowcache`): the push that creates them, and the reads
        before it, do not ask memcached again. Elsewhere trainers create rows with `add`
        (and count sightings first with `admit_after`), so "no row" would not stay true."""
        use = [self._sentinels is not None and self.cache.caches(t) for t, _ in reads]
        cached = iter(self.cache.lookup_many([r for r, u in zip(reads, use, strict=True) if u]))
        out: list[tuple[NDArray[np.float32], NDArray[np.bool_]]] = []
        misses: list[tuple[int, NDArray[np.bool_]]] = []
        for k, ((table, ids), cache_it) in enumerate(zip(reads, use, strict=True)):
            n = ids.shape[0]
            if cache_it:
                hit, rows, _, initial = next(cached)
                found = hit & ~initial  # an initial entry holds its initial value already
            else:
                rows = np.empty((n, self.config.table(table).dim), dtype=np.float32)
                hit = found = np.zeros(n, dtype=bool)
            out.append((rows, found))
            if not hit.all():
                misses.append((k, ~hit))
        if not misses:
            return out
        got = await self.store.get_many(
            [TableRead(reads[k][0], reads[k][1][miss]) for k, miss in misses], unique=True
        )
        fresh: list[tuple[int, NDArray[np.intp]]] = []  # no row anywhere: initial values
        for (k, miss), (rows_m, found_m) in zip(misses, got, strict=True):
            rows, found = out[k]
            at = np.flatnonzero(miss)
            rows[at], found[at] = rows_m, found_m
            if not found_m.all():
                fresh.append((k, at[~found_m]))
        starting = self._initial_rows([(reads[k][0], reads[k][1][new]) for k, new in fresh])
        remember: list[tuple[str, IdArray, NDArray[np.float32], NDArray[np.float32]]] = []
        for (k, new), values in zip(fresh, starting, strict=True):
            table, ids = reads[k]
            out[k][0][new] = values
            if use[k] and self.config.reads_through_owner(table):
                slots = self.optimizers[table].initial_slots(new.size, values.shape[1])
                remember.append((table, ids[new], values, slots))
        if remember:  # only where the cache holds nothing newer since the read
            self.cache.put_many(remember, initial=True)
        return out

    def _reads_dense(self, push: Push, version: int | None) -> bool:
        return bool(push.dense) or (version is not None and self.replica == 0)

    async def _peek(self, push: Push, version: int | None) -> _Peek:
        """The nodes' sentinels, the push's done record and (a dense update) the dense
        `current` pointer, in one round trip per node (`EmbeddingStore.peek`)."""
        reads: list[tuple[str, Any, str]] = [
            (META_TABLE, [self._record_id(push.push_id)], Kind.PUSH_RECORD)
        ]
        if self._reads_dense(push, version):
            reads.append(DenseParams.CURRENT_READ)
        sentinels, values = await self.store.peek(reads)
        current = DenseParams.pointer(values[1][0]) if len(values) > 1 else None
        return _Peek(sentinels, done=values[0][0] is not None, current=current)

    async def _plan(
        self, push: Push, version: int | None, peek: asyncio.Future[_Peek]
    ) -> tuple[WritePlan, list[_Prepared]]:
        """Read what the push updates; compute the dense update. The plan's `steps` (what
        is journaled) are set, its `updates` are `_computed` from the tables returned."""
        prepared = await self._prepared(push.tables, peek)
        dense = self._reads_dense(push, version)
        # the dense `current` pointer is read with the sentinels: the in-memory copy is
        # used when it still names it (no read of the whole generation)
        current = (await peek).current
        plan = WritePlan(push_id=push.push_id, updates=[], version=version)
        if not dense:
            return plan, prepared
        state = None if current is None else await self.dense.read(current=current)
        if state is None:
            if push.dense:
                raise BadRequestError(
                    "dense: the dense parameters are not initialized; POST /v1/dense/init "
                    "first (trainer.Trainer does)",
                    reason="dense_uninitialized",
                )
            return plan, prepared
        self.dense.check_grads(state, push.dense)
        if plan.version is None:
            plan.version = state.version + 1
        if push.dense:
            plan.dense = self.dense.update(state, push.dense)
        else:  # only the version moves (a sync round without dense gradients)
            plan.dense = (dict(state.params), dict(state.slots))
        plan.dense_logged = True
        return plan, prepared

    async def _prepared(
        self, tables: Sequence[TableGrads], peek: asyncio.Future[_Peek] | None = None
    ) -> list[_Prepared]:
        """Read the rows and slots of every table of a push (one request per node; a row
        and its slots are one item), those not in the cache: what each table's optimizer
        step starts from. The tables written behind are only located in the cache
        (`_in_place`): their step reads the cached items where they are."""
        use = [self._sentinels is not None and self.cache.caches(g.table) for g in tables]
        here = [u and self._in_place(g.table) for g, u in zip(tables, use, strict=True)]
        located = iter(
            self.cache.locate_many(
                [(g.table, g.ids) for g, h in zip(tables, here, strict=True) if h]
            )
        )
        wanted = [
            (g.table, g.ids) for g, u, h in zip(tables, use, here, strict=True) if u and not h
        ]
        from_cache = iter(self.cache.lookup_many(wanted))
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
        read = self._read([(g.table, g.ids) for g in tables], [~hit for hit, _, _ in cached])
        if any(hit.any() for hit, _, _ in cached):
            # cached rows are what this replica wrote, unless a node lost its data since
            # (its sentinel is gone, or new after a reinit): read together with the rest,
            # or with the push's done record (`peek`)
            sentinels, values = await asyncio.gather(
                self.store.sentinels() if peek is None else _sentinels_of(peek), read
            )
            if sentinels != self._sentinels:
                logger.warning(
                    "replica %d: a node's sentinel changed (lost data, reinit): the row "
                    "cache is dropped",
                    self.replica,
                )
                if self._flush_every > 1:
                    # the newest values of the rows written behind are only here (and in
                    # their journals): written first (a lost node fails it: DataLossError)
                    await self._flush_rows()
                self._forget_rows()
                self._sentinels = sentinels if all(sentinels.values()) else None
                return await self._prepared(tables)
        else:
            values = await read
        starts: list[tuple[TableGrads, NDArray[np.float32], NDArray[np.bool_], Any]] = []
        unknown: list[Unwritten] = []
        out: list[_Prepared | None] = []
        for grads, (hit, rows_c, slots_c), read, initial, place in zip(
            tables, cached, values, initials, places, strict=True
        ):
            spec = self.config.table(grads.table)
            # cached with a row (an initial entry has none: this push creates it, from
            # the initial values the cache holds)
            stored = hit if initial is None else hit & ~initial
            if place is not None:
                out.append(self._located(grads, place, stored, read, unknown))
                continue
            width = self.optimizers[grads.table].slot_width(spec.dim)
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
        self._fill_unwritten(unknown)
        regular = iter([self._prepare(*start) for start in starts])
        return [p if p is not None else next(regular) for p in out]

    def _in_place(self, table: str) -> bool:
        """Whether a table's step reads its rows where the row cache holds them (its rows
        are written behind, and read through this replica: `reads_through_owner`)."""
        return self._flush_every > 1 and self.config.reads_through_owner(table)

    def _located(
        self,
        grads: TableGrads,
        place: Located,
        stored: NDArray[np.bool_],
        read: tuple[NDArray[np.float32], NDArray[np.bool_]] | None,
        unknown: list[Unwritten],
    ) -> _Prepared:
        """A table stepped in place: the items of the ids the cache lacks are `read`
        (memcached's; their initial values where it has no row either: `unknown` gets
        them for `_fill_unwritten`) and go to the step's `extra`."""
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
        return _Prepared(grads, step, created=created, place=_InPlace(place.spots, at, extra))

    async def _read(
        self, tables: Sequence[tuple[str, IdArray]], wanted: Sequence[NDArray[np.bool_]]
    ) -> list[Any]:
        """Per (table, ids), (items, found) of the ids `wanted`: (n, dim + slot width), a
        row then its slots (one request per node for all tables: a row and its slots are
        one item); None for a table with none wanted."""
        reads = [
            TableRead(table, ids if want.all() else ids[want], slots=True)
            for (table, ids), want in zip(tables, wanted, strict=True)
            if want.any()
        ]
        values = iter(await self.store.get_many(reads, unique=True) if reads else ())
        return [next(values) if want.any() else None for want in wanted]

    async def _read_filled(
        self, tables: Sequence[tuple[str, IdArray]]
    ) -> list[tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.bool_]]]:
        """Per (table, ids), (rows, slots, found) of every id, the ids without a row at
        their initial values (`_fill_unwritten`): what a replay starts from."""
        read = await self._read(tables, [np.ones(ids.shape[0], dtype=bool) for _, ids in tables])
        got = []
        for (table, _), (items, found) in zip(tables, read, strict=True):
            dim = self.config.table(table).dim
            got.append((items[:, :dim], items[:, dim:], found))
        self._fill_unwritten(
            [
                (table, ids, rows, slots, found)
                for (table, ids), (rows, slots, found) in zip(tables, got, strict=True)
            ]
        )
        return got

    async def _cache_sentinels(self) -> dict[str, bytes | None] | None:
        """The nodes' sentinels, which the cache's rows belong to; None (no cache) while
        a node lacks one, or when the cache is off."""
        if self.config.service.cache_mb <= 0:
            return None
        sentinels = await self.store.sentinels()
        return sentinels if all(sentinels.values()) else None

    def _prepare(
        self,
        grads: TableGrads,
        rows: NDArray[np.float32],
        found: NDArray[np.bool_],
        slots: NDArray[np.float32],
    ) -> _Prepared:
        """One table's step: the rows and slots it starts from (slots (n, 0) for an
        optimizer without)."""
        spec = self.config.table(grads.table)
        if spec.admit_after > 1 and not found.all():
            # not admitted yet (no row: lookups saw the id fewer than admit_after times):
            # its gradients are dropped, its row stays the initial value, nothing is written
            keep = np.flatnonzero(found)
            step = TableStep(
                grads.table, grads.ids[keep], grads.grads[keep], rows[keep], slots[keep]
            )
            return _Prepared(grads, step, keep=keep, all_rows=rows)
        created = int(found.shape[0] - np.count_nonzero(found))
        step = TableStep(grads.table, grads.ids, grads.grads, rows, slots)
        return _Prepared(grads, step, created=created)

    async def _computed(
        self, prepared: Sequence[_Prepared], *, behind: bool = True
    ) -> tuple[list[TableUpdate], list[_CachedItems]]:
        """Each table's new rows and slots (its optimizer's step from its `_Prepared`),
        and the new items of the tables stepped in place, for `RowCache.put_items`.

        Tables with equal optimizers (same settings) and dims are stepped as one batch:
        the math is row by row, elementwise, so a row's result does not depend on the
        rows beside it (bit for bit what a step of its table alone gives, which is how
        a replay recomputes it), and a push of 26 small tables costs one pass of numpy
        calls instead of 26. Tables located in the row cache are stepped where their
        items are (`Optimizer.update_at`), unless the rows are not written behind after
        all (`behind` False: the journal needs change witnesses, of the old values) or
        the batch is large enough for a thread: then their items are gathered first.

        Raises:
            _Moved: the cache reused the map the rows were located in (`_apply` reads
                them again).
        """
        groups: dict[tuple[Optimizer, int], list[_Prepared]] = {}
        here: dict[tuple[Optimizer, int, Spots], list[_Prepared]] = {}
        for p in prepared:
            optimizer, dim = self.optimizers[p.grads.table], p.grads.grads.shape[1]
            if p.place is None:
                groups.setdefault((optimizer, dim), []).append(p)
            else:
                here.setdefault((optimizer, dim, p.place.spots), []).append(p)
        for (optimizer, dim, spots), members in list(here.items()):
            if not behind or sum(p.grads.grads.size for p in members) > _OFFLOAD_FLOATS:
                del here[optimizer, dim, spots]
                for p in members:
                    self._gather(p)
                groups.setdefault((optimizer, dim), []).extend(members)
        stepped: dict[int, Stepped] = {}

        async def batch(optimizer: Optimizer, members: list[_Prepared]) -> None:
            steps = [p.step for p in members]
            new_rows, new_slots, witness = await _step(
                optimizer,
                stacked([s.rows for s in steps]),
                stacked([s.grads for s in steps]),
                stacked([s.slots for s in steps]),
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
            id(p): self._update(p, *stepped[id(p.step)]) for p in prepared if id(p.step) in stepped
        }
        puts: list[_CachedItems] = []
        for (optimizer, dim, spots), members in here.items():
            values = self.cache.values_of(spots)
            if values is None:
                raise _Moved(f"the row cache reused the map of {len(members)} tables' rows")
            at, extra = _joined([p.place for p in members if p.place is not None])
            grads = stacked([p.grads.grads for p in members])
            rows, items = optimizer.update_at(values, at, extra, grads)
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
                _CachedItems(spots, at, [(p.step.table, p.step.ids) for p in members], items)
            )
        return [updates[id(p)] for p in prepared], puts

    def _gather(self, p: _Prepared) -> None:
        """A table located in the row cache gets its rows and slots as arrays (the step
        then runs as for any table).

        Raises:
            _Moved: the map it was located in was reused since.
        """
        place = p.place
        if place is None:
            return
        values = self.cache.values_of(place.spots)
        if values is None:
            raise _Moved(f"the row cache reused the map of table {p.step.table!r}'s rows")
        items = items_at(values, place.at, place.extra)
        dim = p.grads.grads.shape[1]
        p.step = TableStep(p.step.table, p.step.ids, p.step.grads, items[:, :dim], items[:, dim:])
        p.place = None

    @staticmethod
    def _update(
        p: _Prepared,
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

    def _fill_unwritten(self, parts: Sequence[Unwritten]) -> None:
        """In place, for each (table, ids, rows, slots, known): a row not known (never
        created, or expired: TTL) takes its initial value and the optimizer's initial
        slots, exactly what a lookup would have created (a lost node is caught by the
        sentinel read: DataLossError, never re-initialized here). The push and the replay
        of its journal start from the same values so. The row cache's initial entries
        are known: they hold these values already. One batch of initial values for all
        the tables (`initial_rows_many`)."""
        todo = [
            (table, ids, rows, slots, np.flatnonzero(~known))
            for table, ids, rows, slots, known in parts
            if not known.all()
        ]
        initial = self._initial_rows([(t[0], t[1][t[4]]) for t in todo])
        for (table, _, rows, slots, at), values in zip(todo, initial, strict=True):
            rows[at] = values
            slots[at] = self.optimizers[table].initial_slots(at.size, values.shape[1])

    def _initial_rows(self, parts: Sequence[tuple[str, IdArray]]) -> list[NDArray[np.float32]]:
        """The initial rows of each (table, ids): one batch per initializer and dim."""
        specs = [self.config.table(table) for table, _ in parts]
        return initial_rows_many(
            [(s.initializer, s.seed, ids, s.dim) for s, (_, ids) in zip(specs, parts, strict=True)]
        )

    async def _redone(self, redo: Sequence[TableRedo]) -> list[TableUpdate]:
        """What a journal's tables still need written: the items the push did not write,
        recomputed (see `plan`); one read per node.

        An item's witness word keeps its old bits until the push writes the item
        (`rows.still_old`). Journals of older services have the hash of each item before
        the push (`old_hashes`: recompute the items that still have it) or the new
        values' hashes (recompute the items that do not have them yet).
        """
        got = await self._read_filled([(r.table, r.ids) for r in redo])
        out: list[TableUpdate] = []
        for r, (rows, slots, _) in zip(redo, got, strict=True):
            optimizer = self.optimizers[r.table]
            # a row and its slots are one item: both written, or neither
            if r.witness is not None:
                todo = np.flatnonzero(still_old(r.witness, rows, slots))
            elif r.old_hashes is not None:
                todo = np.flatnonzero(value_hashes(rows, slots) == r.old_hashes)
            elif r.row_hashes is not None and r.slot_hashes is not None:
                new = (value_hashes(rows) == r.row_hashes) & (value_hashes(slots) == r.slot_hashes)
                todo = np.flatnonzero(~new)
            else:
                raise RuntimeError(f"a journaled update of table {r.table!r} has no hashes")
            if todo.size:
                new_rows, new_slots = optimizer.update(rows[todo], r.grads[todo], slots[todo])
                out.append(TableUpdate(r.table, r.ids[todo], new_rows, new_slots))
        return out

    async def _write_updates(self, updates: Iterable[TableUpdate]) -> None:
        """Write the rows and slots of every table in one request per node (a row and
        its slots are one item: one `ms`). Each update's ids are unique: a push's are
        summed per id when it is parsed, a journal's as they were, the row cache holds
        a key once."""
        writes = [TableWrite(u.table, u.ids, u.rows, slots=u.slots) for u in updates]
        if writes:
            await self.store.set_many(writes, unique=True)

    async def _write_plan(
        self, plan: WritePlan, *, replay: bool = False, record: bool = True, behind: bool = False
    ) -> None:
        """Write rows, slots, the dense switch and version; then the done record.

        `replay`: the plan comes back from the journal (a failed write or a crash); its
        dense switch happens only if `current` still names the state it replaces.
        `record=False` leaves the done record to the caller (`_record_later`).
        `behind`: the rows of cached tables are not written (a flush writes them).
        """
        updates = [u for u in plan.updates if not (behind and self.cache.caches(u.table))]
        if plan.redo:  # a journal's: read what is written, recompute the rest
            updates += await self._redone(plan.redo)
        # the jobs return None or set_blobs' stored flags; only their completion matters
        jobs: list[Awaitable[object]] = [self._write_updates(updates)]
        if plan.dense_switch is not None:  # a journal of an older format
            jobs.append(
                self.dense.switch(
                    plan.dense_switch.current,
                    plan.dense_switch.previous,
                    values=plan.dense,
                    check=replay,
                )
            )
        elif plan.dense is not None and plan.version is not None and not plan.dense_logged:
            # a journal of an older service: it carries the values, not a generation
            jobs.append(self.dense.write(plan.version, *plan.dense))
        if plan.version is not None:
            jobs.append(
                self.store.set_blobs(
                    META_TABLE,
                    [version_id(self.replica)],
                    [str(plan.version).encode()],
                    kind=Kind.META,
                )
            )
        await asyncio.gather(*jobs)
        if plan.dense_logged and plan.dense is not None and plan.version is not None:
            # a live plan's (a recovered journal has no values: `recover` replays the logs)
            self.dense.advance(plan.version, *plan.dense)
            self._flush_when_due()
        if record:
            await self._write_record(plan.push_id)
        if plan.version is not None:
            await self._set_version(plan.version)

    async def _write_record(self, push_id: str) -> None:
        await self.store.set_blobs(
            META_TABLE,
            [self._record_id(push_id)],
            [b"1"],
            kind=Kind.PUSH_RECORD,
            ttl_s=self.push_record_ttl_s,
        )

    def _record_later(
        self, slot: int, plan: WritePlan, keys: LockSet, *, behind: bool = False
    ) -> None:
        """Write a written push's done record in the background (the push is answered
        meanwhile), then unlock its rows and clear its journal slot.

        Until the record is stored, the push counts as done here (`is_done`) and its rows
        stay locked. So a crash meanwhile leaves its journal to a replay that no other
        push has raced: the replay finds every item written and writes the record. A
        failed write of the record hands the push to `_finish_later`, which holds the rows
        until a replay of the journal (which writes the same values again) and the record
        stick. `behind`: the journal stays until a flush of the rows clears it.
        """
        self._recording.add(plan.push_id)

        async def record() -> None:
            try:
                await self._write_record(plan.push_id)
            except Exception:
                logger.warning(
                    "replica %d: writing the done record of push %s failed; it is "
                    "finished from its journal",
                    self.replica,
                    plan.push_id,
                    exc_info=True,
                )
                self._finish_later(slot, plan, keys, behind=behind)
                return
            finally:
                self._recording.discard(plan.push_id)
            if behind:  # listed before the rows are unlocked: see `_flush_rows`
                self._keep_journal(slot)
                await self.locks.release(keys)
                return
            await self.locks.release(keys)
            self._clear_later(slot)

        self._in_background(record())

    def _finish_later(
        self, slot: int, plan: WritePlan, keys: LockSet, *, behind: bool = False
    ) -> None:
        """Replay a journaled push in the background until it sticks (`Journal.finish_later`);
        the replay owns (and finally releases) its journal slot and row locks. `behind`:
        the replay writes the push's rows through, and its journal stays until a flush
        (an earlier journal of the same rows may still be replayed after a crash: this
        one must follow it)."""
        task = self.journal.finish_later(
            slot,
            plan,
            write=functools.partial(self._write_plan, replay=True),
            locks=self.locks,
            keys=keys,
            keep=self._keep_journal if behind else None,
        )
        self._finishers.add(task)
        task.add_done_callback(self._finishers.discard)

    def _clear_later(self, slot: int) -> None:
        """Clear a finished push's journal slot in the background, then free it.

        The push is answered and its rows unlocked first: its done record is written, so
        a recovery that finds the journal before the clear lands skips it, and a failed
        clear only leaves the slot to be overwritten by its next push.
        """

        async def clear() -> None:
            try:
                await self.journal.clear(slot)
            except Exception:
                logger.warning(
                    "replica %d: clearing journal slot %d failed (its push is done)",
                    self.replica,
                    slot,
                    exc_info=True,
                )
            finally:
                self.journal.give_back(slot)

        self._in_background(clear())

    # ------------------------------------------------------------ dense write-behind

    def _flush_when_due(self) -> None:
        """Write the dense state behind now if `service.dense_flush_pushes` updates are
        not stored yet; else within `service.dense_flush_s` seconds. Not while paused:
        the pause flushed, and a restore must not get a flush of the state before it."""
        if self.paused:
            return
        if self.dense.unflushed >= self.config.service.dense_flush_pushes:
            self._flush_dense_later()
        else:
            self._arm_flush_timer()

    def _arm_flush_timer(self) -> None:
        """Flush within `service.dense_flush_s` seconds, if anything is left to write
        and no flush is planned (not while paused)."""
        if self.dense.unflushed and self._flush_timer is None and not self.paused:
            self._flush_timer = asyncio.get_running_loop().call_later(
                self.config.service.dense_flush_s, self._flush_dense_later
            )

    def _cancel_flush_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _flush_dense_later(self) -> None:
        """Start a flush in the background unless one runs (it writes the newest state
        there is when it starts; the next update due starts the next)."""
        self._cancel_flush_timer()
        if self.paused or (self._flushing is not None and not self._flushing.done()):
            return

        async def flush() -> None:
            try:
                await self.dense.flush()
            except Exception:
                logger.warning(
                    "replica %d: writing the dense parameters behind failed (their logs "
                    "keep the updates; the next flush retries)",
                    self.replica,
                    exc_info=True,
                )
            self._arm_flush_timer()  # updates came meanwhile, or this flush failed

        self._flushing = self._in_background(flush())

    # ------------------------------------------------------------ row write-behind

    def _keep_journal(self, slot: int) -> None:
        """A done push whose rows are written behind: its journal stays until a flush."""
        self._unflushed.append(slot)
        self._flush_rows_when_due()

    async def _room_for(self, push: Push) -> None:
        """Before a push whose rows may be written behind: flush now (and fail with the
        flush's error) when its rows would take the dirty rows past the row cache's
        budget (`RowCache.room_for`), or when flushes lag so far behind that the journal
        slots run out."""
        if (
            not self.cache.room_for([(t.table, t.ids.shape[0]) for t in push.tables])
            or len(self._unflushed) + len(self._to_clear) >= self._flush_every + JOURNAL_SLOTS // 2
        ):
            await self._flush_rows()

    def _flush_rows_when_due(self) -> None:
        """Flush the rows written behind now if `service.row_flush_pushes` pushes are not
        written yet, or their journals hold `KEPT_JOURNAL_BYTES`; else within
        `service.row_flush_s` seconds. Not while paused (the pause flushed; a restore
        must not get a flush of the rows before it)."""
        if self.paused or not self._unflushed:
            return
        if (
            len(self._unflushed) >= self._flush_every
            or sum(self._journal_bytes.get(slot, 0) for slot in self._unflushed)
            >= KEPT_JOURNAL_BYTES
        ):
            self._flush_rows_later()
        elif self._row_timer is None:
            self._row_timer = asyncio.get_running_loop().call_later(
                self.config.service.row_flush_s, self._flush_rows_later
            )

    def _cancel_row_timer(self) -> None:
        if self._row_timer is not None:
            self._row_timer.cancel()
            self._row_timer = None

    def _flush_rows_later(self) -> None:
        """Start a flush of the rows in the background unless one runs; a failed one is
        tried again a second later (the journals keep the rows meanwhile)."""
        self._cancel_row_timer()
        if self.paused or (self._row_flushing is not None and not self._row_flushing.done()):
            return

        async def flush() -> None:
            try:
                await self._flush_rows()
            except Exception:
                logger.warning(
                    "replica %d: writing the rows behind failed (their journals keep them; "
                    "retrying in 1 s)",
                    self.replica,
                    exc_info=True,
                )
                if self._row_timer is None and not self.paused:
                    self._row_timer = asyncio.get_running_loop().call_later(
                        1.0, self._flush_rows_later
                    )
                return
            self._flush_rows_when_due()  # pushes came meanwhile

        self._row_flushing = self._in_background(flush())

    async def _flush_rows(self) -> None:
        """Write every dirty row of the row cache, then clear the journals of the pushes
        done before it was copied.

        Why that order keeps a restart exact: a push is listed (`_unflushed`) when its
        done record is written, before its rows are unlocked, and its values are in the
        cache before that. So a listed push's rows are in the copy (its values, or newer
        ones), and a push not listed yet (still recording) has no later push on its rows
        among the listed ones: the journals a crash leaves, replayed in their order,
        end every row at its newest value. One flush at a time.
        """
        async with self._row_flush_lock:
            self._cancel_row_timer()
            await self._check_nodes_kept_data()
            listed, self._unflushed = self._unflushed, []
            parts, stamp = self.cache.dirty()
            try:
                await self._write_updates(
                    TableUpdate(table, ids, rows, slots) for table, ids, rows, slots in parts
                )
            except BaseException:
                self._unflushed[:0] = listed
                self.cache.undo_dirty()
                raise
            self.cache.clean(stamp)
            clear, self._to_clear = self._to_clear + listed, []
            try:
                await self.journal.clear_many(clear)
            except Exception:
                # the rows are written: a replay of these journals writes the same values
                # (or older ones of rows a later push changed: it would be replayed after)
                self._to_clear = clear
                logger.warning(
                    "replica %d: clearing %d journals of rows written behind failed; the "
                    "next flush clears them",
                    self.replica,
                    len(clear),
                    exc_info=True,
                )
                return
            for slot in clear:
                self.journal.give_back(slot)

    async def _check_nodes_kept_data(self) -> None:
        """Before a flush writes: DataLossError if a node lost its sentinel (restarted or
        flushed) and nothing is written. A write batch checks the sentinel in the same
        pipeline as its writes, which memcached runs whatever it finds; a push's writes
        are its own rows, but a flush's are every row written behind since the last one,
        so it asks first (one round trip a flush). A node re-initialized since (a new
        sentinel) is written: its rows this replica holds come back with their newest
        values (docs/write-behind.md)."""
        sentinels = await self.store.sentinels()
        lost = tuple(node for node, value in sentinels.items() if value is None)
        if lost:
            which = f"node {lost[0]} has" if len(lost) == 1 else f"nodes {', '.join(lost)} have"
            raise DataLossError(
                f"memcached {which} lost its data: its sentinel is gone (the server restarted "
                f"or was flushed). The rows written behind were not written there: they stay "
                f"in replica {self.replica}'s memory and journals. Restore a checkpoint "
                f"(lookup-table-checkpoint restore) or accept the loss (lookup-table-admin "
                f"reinit --yes)",
                nodes=lost,
            )

    def _drop_unflushed(self) -> None:
        """A restore replaces every row (and deletes the journals): forget the rows not
        written yet, and free their journal slots."""
        self._cancel_row_timer()
        if self._row_flushing is not None:
            self._row_flushing.cancel()
        for slot in self._unflushed + self._to_clear:
            self.journal.give_back(slot)
        self._unflushed, self._to_clear = [], []
        self._forget_rows()

    def _drop_dense_flush(self) -> None:
        """A restore or reset replaces the dense state: a flush of the old one under way
        must not land after it (the dense state itself is dropped at the reload)."""
        self._cancel_flush_timer()
        if self._flushing is not None:
            self._flushing.cancel()

    def _in_background(self, job: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        """Run `job` as a task that `pause` and `close` wait for (`_cleanups`)."""
        task = asyncio.get_running_loop().create_task(job)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    # ------------------------------------------------------------ recovery

    async def recover(self) -> int:
        """Finish every journaled push of this replica and load its version.

        Call before serving. Returns how many pushes were finished.
        """
        finished = 0
        found: list[tuple[int, WritePlan]] = []
        for slot, raw in enumerate(await self.journal.headers()):
            if not raw:
                continue
            try:
                plan = await self.journal.read(slot, raw)
            except IncompleteJournalError as exc:
                behind = unpack(raw).get("seq") is not None
                if behind or not await self.is_done(exc.push_id):
                    why = (
                        "and it holds rows written behind"
                        if behind
                        else "and its push has no done record"
                    )
                    raise RuntimeError(
                        f"replica {self.replica}: {exc}, {why}: they may be written in "
                        f"part; restore a checkpoint (lookup-table-checkpoint restore)"
                    ) from exc
                # a finished push's header, whose clear failed, over a later push's chunks
                logger.warning("replica %d: %s; its push is done: cleared", self.replica, exc)
                await self.journal.clear(slot)
                continue
            if plan is not None:
                found.append((slot, plan))
        # rows written behind: every journal, done or not, in their order (values: the
        # newest wins; gradients and steps: `_restep` gives each row the pushes it lacks);
        # each replay writes its done record
        found.sort(key=lambda sp: sp[1].journal_seq)
        await self._restep([plan for _, plan in found if plan.journal_seq])
        for _, plan in found:
            if plan.journal_seq or not await self.is_done(plan.push_id):
                logger.warning(
                    "replica %d: replaying journaled push %s", self.replica, plan.push_id
                )
                await self._write_plan(plan, replay=True)
                finished += 1
        await self.journal.clear_many([slot for slot, _ in found])
        self._journal_seq = max((p.journal_seq for _, p in found), default=0)
        version = await self._stored_version()
        if self.replica == 0:
            await self._recover_dense(version)
        await self._set_version(version)
        self._sentinels = await self._cache_sentinels()
        return finished

    async def _restep(self, plans: Sequence[WritePlan]) -> None:
        """In place, the journals of rows written behind (in their order) that keep
        gradients and steps (`TableRedo.steps`) get their updates' values back: the rows
        journaled are read from memcached once, then each journal is applied in order to
        the rows whose step is its journaled one, i.e. that memcached (or an earlier
        journal) holds from just before the push. A row with a later step has it already:
        a flush wrote it after the push. Journals of values set what they hold. The
        steps go up by exactly one an update, so this is exact, whatever a crash left
        half-flushed, and bit for bit what the replica computed (a row's update depends
        on its own values only, not on the rows stepped beside it).

        A row memcached does not hold that a journal steps from a later step than its
        initial one was written by a flush and then lost with its node: a `reinit` (its
        node's new sentinel lets the reads through) accepted that. It starts again from
        its initial value, as the rows of that node the replica did not hold do (a
        warning counts them); the journals' later pushes skip it.

        Raises:
            RuntimeError: a row memcached holds (or an earlier journal made) is at a step
                below a journal's: an update of the row is in neither (lost).
        """
        stepped = [r for plan in plans for r in plan.redo if r.steps is not None]
        if not stepped:
            return
        union: dict[str, IdArray] = {}
        for r in stepped:
            union[r.table] = np.union1d(union.get(r.table, r.ids[:0]), r.ids)
        # no row yet: the initial value the push started from
        got = await self._read_filled(list(union.items()))
        state: dict[str, tuple[IdArray, NDArray[np.float32], NDArray[np.float32]]] = {}
        known: dict[str, NDArray[np.bool_]] = {}  # in memcached, or made by a journal
        for (table, ids), (rows, slots, found) in zip(union.items(), got, strict=True):
            state[table] = (ids, rows, slots)
            known[table] = found
        gone: dict[str, int] = {}
        for plan in plans:
            for u in plan.updates:  # values (an optimizer without steps): newest so far
                if u.table in state:
                    ids, rows, slots = state[u.table]
                    at = np.searchsorted(ids, u.ids)
                    held = at < ids.shape[0]
                    held[held] = ids[at[held]] == u.ids[held]
                    rows[at[held]], slots[at[held]] = u.rows[held], u.slots[held]
            redo = []
            for r in plan.redo:
                if r.steps is None:
                    redo.append(r)
                    continue
                ids, rows, slots = state[r.table]
                column = self._step_slots.get(r.table)
                if column is None or r.grads.shape[1:] != rows.shape[1:]:
                    spec = self.config.table(r.table)
                    if step_slot(self.optimizers[r.table], spec.dim) is None:
                        counts = "which counts no steps"
                    elif column is None:  # `ttl_s`: journaled by values
                        counts = f"and ttl_s {spec.ttl_s} (journaled by values)"
                    else:
                        counts = "which counts steps"
                    raise RuntimeError(
                        f"replica {self.replica}: journaled push {plan.push_id} keeps steps "
                        f"of table {r.table!r} for rows of dim {r.grads.shape[1]}, but the "
                        f"config gives it dim {spec.dim} and optimizer "
                        f"{spec.optimizer.name!r}, {counts} (the config changed since): "
                        f"start it with the config it was written with"
                    )
                at = np.searchsorted(ids, r.ids)
                now = slots[at, column]
                behind = now < r.steps
                lost = np.flatnonzero(behind & known[r.table][at])
                if behind.any():
                    gone[r.table] = gone.get(r.table, 0) + int(np.count_nonzero(behind))
                if lost.size:
                    i = int(lost[0])
                    raise RuntimeError(
                        f"replica {self.replica}: journaled push {plan.push_id} updates row "
                        f"{r.ids[i]!r} of table {r.table!r} from step {int(r.steps[i])}, but "
                        f"memcached and the earlier journals hold it at step {int(now[i])}: "
                        f"an update of it is lost; restore a checkpoint "
                        f"(lookup-table-checkpoint restore)"
                    )
                due = now == r.steps  # the others are newer: a flush wrote them since
                todo = at[due]
                new_rows, new_slots = self.optimizers[r.table].update(
                    rows[todo], r.grads[due], slots[todo]
                )
                rows[todo], slots[todo] = new_rows, new_slots
                known[r.table][todo] = True
                plan.updates.append(TableUpdate(r.table, ids[todo], new_rows, new_slots))
            plan.redo = redo
        for table, count in gone.items():
            logger.warning(
                "replica %d: %d journaled updates of rows of table %r that memcached lost "
                "(a re-initialized node) are skipped: those rows start again from their "
                "initial values",
                self.replica,
                count,
                table,
            )

    async def _recover_dense(self, version: int) -> None:
        """Rebuild the dense state from the stored generation and the logs of the updates
        after it, up to `version`, this replica's stored version (every journaled dense
        push wrote it, or its journal's replay just did; when the generation is newer,
        nothing is replayed); store it as a generation."""
        try:
            replayed = await self.dense.replay_logs(version)
        except DenseLogError as exc:
            raise RuntimeError(
                f"replica {self.replica}: {exc}, but its push was applied: the dense "
                f"parameters after it cannot be rebuilt; restore a checkpoint "
                f"(lookup-table-checkpoint restore)"
            ) from exc
        if replayed:
            logger.warning(
                "replica %d: dense parameters rebuilt from %d logged updates",
                self.replica,
                replayed,
            )

    async def _stored_version(self) -> int:
        (raw,) = await self.store.get_blobs(META_TABLE, [version_id(self.replica)], kind=Kind.META)
        version = int(raw) if raw else 0
        if self.replica == 0:
            current = await self.dense.meta()
            if current is not None:
                version = max(version, int(current["version"]))
        return version

    async def close(self) -> None:
        """Write the rows and the dense state behind; wait briefly for background
        finishers (those still running resume at restart, as the journals and dense logs
        do)."""
        self._cancel_flush_timer()
        if self._finishers or self._cleanups:  # done records: their journals are listed
            await asyncio.wait(self._finishers | self._cleanups, timeout=5)
        if self._flush_every > 1:
            try:
                await self._flush_rows()
            except Exception:
                logger.warning(
                    "replica %d: writing the rows behind at close failed; the next start "
                    "replays their journals",
                    self.replica,
                    exc_info=True,
                )
        if self.replica == 0:
            try:
                await self.dense.flush()
            except Exception:
                logger.warning(
                    "replica %d: writing the dense parameters behind at close failed; "
                    "the next start rebuilds them from their logs",
                    self.replica,
                    exc_info=True,
                )
        if self._finishers or self._cleanups:
            await asyncio.wait(self._finishers | self._cleanups, timeout=5)
