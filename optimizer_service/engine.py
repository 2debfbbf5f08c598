"""Apply pushes exactly once: read rows + slots, run the optimizer, journal, write back.

Exactly-once, per replica K (the replica owns its rows; nobody else writes them):

1. A push whose id has a *done record* (`_meta/p/rK:<push_id>`, TTL
   `service.push_record_ttl_s`) is acknowledged and not applied again. Two copies
   of one push in flight at once share one application (in-process).
2. The rows of the push are locked (in-process; no two pushes read-modify-write
   one row at once; pushes on disjoint rows run concurrently).
3. Rows and slots are read, the optimizer computes the new ones.
4. The new rows and slots are written to a *journal slot* (`_meta/j/rK-jS`,
   chunked under the item-size limit, header written last with a checksum).
5. Rows and slots are written, then the done record, then the journal header
   is cleared.

A crash before 4 completes leaves the rows untouched: the retry recomputes. A
crash after 4 leaves a journal: a restarting replica replays every journal whose
push has no done record *before it serves* (`recover`), so the retry finds the
done record. If writing fails after 4 in a live replica, the push's rows stay
locked and a background task replays the journal until it succeeds, so no other
push can read a half-written row. While that replay keeps failing (a full `-M`
node, a lost or stopped one), a push that needs those rows, or a journal slot when
every slot is held so, fails at once with the replay's last error (the same store
error, naming the node) instead of waiting for rows that may never be released.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.initializers import initial_rows
from lookup_table.core.keyspace import (
    META_TABLE,
    Kind,
    journal_id,
    push_record_id,
    version_id,
)
from lookup_table.core.optimizers import Optimizer, make_optimizer, segment_sum
from lookup_table.core.sharding import row_hashes
from lookup_table.core.wire import decode_array, decode_ids, encode_array, encode_ids, pack, unpack
from lookup_table.dense import DenseParams
from lookup_table.errors import DataLossError, StoreError
from lookup_table.store import EmbeddingStore
from optimizer_service.errors import (
    BadRequestError,
    NotOwnerError,
    StaleVersionError,
    UnavailableError,
)
from optimizer_service.push import Push, TableGrads

__all__ = ["RowLocks", "Updater"]

logger = logging.getLogger(__name__)

JOURNAL_SLOTS = 8
JOURNAL_CHUNK_BYTES = 512 * 1024
_OFFLOAD_FLOATS = 1 << 16  # above this many floats per table, run the math in a thread
_OFFLOAD_JOURNAL_BYTES = 1 << 20  # above this, encode the journal in a thread


class RowLocks:
    """Per-row mutual exclusion for read-modify-write, by row hash.

    A push waits until none of its rows is held by another push, then takes all
    of them at once (no lock ordering, so no deadlock). Waiters are woken in
    arrival order. Two different rows with the same 64-bit hash would only
    serialize needlessly. Rows held by a failed write that is being retried
    (`fail`) are not waited for: `acquire` raises that write's error instead.
    """

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._failed: dict[int, Callable[[], BaseException]] = {}
        self._changed = asyncio.Condition()

    @property
    def held(self) -> int:
        return len(self._held)

    def _blocker(self, keys: set[int]) -> Callable[[], BaseException] | None:
        if not self._failed:
            return None
        return next((self._failed[k] for k in keys if k in self._failed), None)

    async def acquire(self, keys: set[int]) -> None:
        """Take `keys`; raises the error of a failed write that holds any of them."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._held.isdisjoint(keys) or self._blocker(keys) is not None
            )
            blocker = self._blocker(keys)
            if blocker is not None:
                raise blocker()
            self._held |= keys

    async def fail(self, keys: set[int], error: Callable[[], BaseException]) -> None:
        """Mark held `keys` as held by a failed write: whoever waits for them, now or
        later, raises `error()` until they are released."""
        async with self._changed:
            self._failed.update(dict.fromkeys(keys, error))
            self._changed.notify_all()

    async def release(self, keys: set[int]) -> None:
        async with self._changed:
            self._held -= keys
            if self._failed:
                for k in keys:
                    self._failed.pop(k, None)
            self._changed.notify_all()

    @asynccontextmanager
    async def hold(self, keys: Iterable[int]) -> AsyncIterator[None]:
        wanted = set(keys)
        await self.acquire(wanted)
        try:
            yield
        finally:
            await self.release(wanted)


@dataclass(slots=True)
class _Update:
    table: str
    ids: Any
    rows: NDArray[np.float32]
    slots: NDArray[np.float32]


@dataclass(slots=True)
class _Plan:
    """Everything one push writes: absolute values, so writing it twice is harmless."""

    push_id: str
    updates: list[_Update]
    version: int | None = None  # the replica's new version (sync mode, or dense updates)
    dense: tuple[dict[str, NDArray[np.float32]], dict[str, NDArray[np.float32]]] | None = None


def _compute(
    optimizer: Optimizer,
    rows: NDArray[np.float32],
    grads: NDArray[np.float32],
    slots: NDArray[np.float32],
) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    return optimizer.update(rows, grads, slots)


@dataclass(slots=True)
class _Round:
    """Sync mode: the pushes of one version, until every worker has pushed."""

    pushes: dict[int, Push] = field(default_factory=dict)
    done: asyncio.Future[dict[str, Any]] | None = None


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
    ) -> None:
        self.config = config
        self.store = store
        self.replica = replica
        self.push_record_ttl_s = push_record_ttl_s
        self.optimizers = {t.name: make_optimizer(t.optimizer) for t in config.tables}
        self.dense = DenseParams(store, make_optimizer(config.optimizer))
        self.locks = RowLocks()
        self.applied = 0
        self.version = 0
        self._version_changed = asyncio.Condition()
        self._inflight: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._journal_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(JOURNAL_SLOTS):
            self._journal_slots.put_nowait(slot)
        self._finishers: set[asyncio.Task[None]] = set()
        self._failing: dict[int, Callable[[], BaseException]] = {}  # journal slot -> error
        self._on_rows = on_rows
        self._rounds: dict[int, _Round] = {}
        self._recent_rounds: dict[str, dict[str, Any]] = {}
        self._open = asyncio.Event()
        self._open.set()
        self._active = 0
        self._idle = asyncio.Condition()
        self._auto_resume: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ bookkeeping keys

    def _record_id(self, push_id: str) -> str:
        return push_record_id(self.replica, push_id)

    def _journal_id(self, slot: int, chunk: int | None = None) -> str:
        return journal_id(self.replica, slot, chunk)

    def _version_id(self) -> str:
        return version_id(self.replica)

    async def is_done(self, push_id: str) -> bool:
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
        failed and their journal is replayed until it sticks): their rows are half
        written, so a checkpoint taken now would not be consistent. `drop_unfinished`
        cancels those replays first: only for a restore, which replaces every row they
        would write (and deletes their journals); otherwise they could write pre-restore
        rows over the restored ones.
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
        if self._finishers:  # a replay about to succeed (or to end its cancellation)
            await asyncio.wait(set(self._finishers), timeout=2.0)
        return len(self._finishers)

    async def reload(self) -> int:
        """Forget in-memory model state and read the version again (after a restore).

        Only while paused: nothing is in flight, so no push can mix the old state with
        the restored one. Returns the version now served.
        """
        if not self.paused:
            raise RuntimeError("reload() needs a paused replica")
        self._rounds.clear()
        self._recent_rounds.clear()
        version = await self._stored_version()
        async with self._version_changed:
            self.version = version  # may go back: the checkpoint is older
            self._version_changed.notify_all()
        logger.warning("replica %d: reloaded after a restore, version %d", self.replica, version)
        return version

    def resume(self) -> None:
        if self._auto_resume is not None:
            self._auto_resume.cancel()
            self._auto_resume = None
        self._open.set()

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

    async def apply(self, push: Push) -> dict[str, Any]:
        """Apply `push` at most once; returns `{applied, duplicate, rows, version}`."""
        if push.dense and self.replica != 0:
            raise NotOwnerError(
                f"dense gradients go to replica 0 (dense parameters live there); this is "
                f"replica {self.replica}"
            )
        running = self._inflight.get(push.push_id)
        if running is not None:
            result = await asyncio.shield(running)
            return {**result, "applied": False, "duplicate": True}
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._inflight[push.push_id] = future
        try:
            async with self._admitted():
                if self.config.mode == "sync":
                    result = await self._apply_sync(push)
                else:
                    result = await self._apply(push, version=None)
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

    async def _apply_sync(self, push: Push) -> dict[str, Any]:
        """Collect the pushes of `version` from every worker, apply their mean once."""
        recent = self._recent_rounds.get(push.push_id)
        if recent is not None:
            return {**recent, "applied": False, "duplicate": True}
        workers = self.config.workers
        if push.worker >= workers:
            raise BadRequestError(
                f"worker: {push.worker} is not a worker of this job (workers = {workers})"
            )
        if push.version != self.version:
            raise StaleVersionError(
                f"version: the push is for version {push.version} but the model is at version "
                f"{self.version}; fetch the current dense parameters and rows "
                f"(GET /v1/dense, GET /v1/version) and recompute the step"
            )
        round_ = self._rounds.setdefault(push.version, _Round())
        if round_.done is None:
            round_.done = asyncio.get_running_loop().create_future()
        done = round_.done
        if push.worker in round_.pushes:
            raise StaleVersionError(
                f"worker {push.worker} already pushed for version {push.version} (push_id "
                f"{round_.pushes[push.worker].push_id}); one push per worker and version"
            )
        round_.pushes[push.worker] = push
        if len(round_.pushes) == workers:
            del self._rounds[push.version]
            merged = _mean_push(f"sync-v{push.version}", list(round_.pushes.values()), workers)
            try:
                result = await self._apply(merged, version=push.version + 1)
            except BaseException as exc:
                done.set_exception(exc)
                done.exception()
                raise
            done.set_result(result)
            for p in round_.pushes.values():
                self._recent_rounds[p.push_id] = result
            while len(self._recent_rounds) > 64 * workers:
                self._recent_rounds.pop(next(iter(self._recent_rounds)))
        return dict(await asyncio.shield(done))

    async def _apply(self, push: Push, *, version: int | None) -> dict[str, Any]:
        if await self.is_done(push.push_id):
            return {"applied": False, "duplicate": True, "rows": 0, "version": self.version}
        keys: set[int] = set()
        for t in push.tables:
            keys.update(row_hashes(t.table, t.ids).tolist())
        await self.locks.acquire(keys)
        handed_over = False
        try:
            async with self.dense.lock if push.dense or version is not None else _nolock():
                plan = await self._plan(push, version)
                slot = await self._journal_slot()
                journaled = False
                try:
                    await self._write_journal(slot, plan)
                    journaled = True
                    await self._write_plan(plan)
                    await self._clear_journal(slot)
                except BaseException:
                    if journaled:
                        # Half-written rows must not be seen: the rows stay locked and the
                        # journal slot taken until a background replay finishes the push.
                        self._finish_later(slot, plan, keys)
                        handed_over = True
                    else:
                        self._journal_slots.put_nowait(slot)
                    raise
                self._journal_slots.put_nowait(slot)
        finally:
            if not handed_over:
                await self.locks.release(keys)
        self.applied += 1
        if self._on_rows is not None:
            for t in push.tables:
                self._on_rows(t.table, t.ids.shape[0])
        return {"applied": True, "duplicate": False, "rows": push.num_rows, "version": self.version}

    async def _plan(self, push: Push, version: int | None) -> _Plan:
        updates = list(await asyncio.gather(*(self._updated(t) for t in push.tables)))
        plan = _Plan(push_id=push.push_id, updates=updates, version=version)
        if push.dense or (version is not None and self.replica == 0):
            state = await self.dense.read(with_slots=True)
            if state is None:
                if push.dense:
                    raise BadRequestError(
                        "dense: the dense parameters are not initialized; POST /v1/dense/init "
                        "first (trainer.Trainer does)",
                        reason="dense_uninitialized",
                    )
            else:
                self.dense.check_grads(state, push.dense)
                plan.dense = self.dense.update(state, push.dense)
                if plan.version is None:
                    plan.version = state.version + 1
        return plan

    async def _updated(self, grads: TableGrads) -> _Update:
        spec = self.config.table(grads.table)
        optimizer = self.optimizers[grads.table]
        width = optimizer.slot_width(spec.dim)
        n = grads.ids.shape[0]
        if width:
            (rows, found), (slots, has_slots) = await asyncio.gather(
                self.store.get(grads.table, grads.ids, width=spec.dim, unique=True),
                self.store.get(grads.table, grads.ids, kind=Kind.SLOTS, width=width, unique=True),
            )
        else:
            rows, found = await self.store.get(grads.table, grads.ids, width=spec.dim, unique=True)
            slots, has_slots = np.zeros((n, 0), dtype=np.float32), np.ones(n, dtype=bool)
        if not found.all():
            # Never seen by `lookup` (or the trainer skipped it): its value is its initial
            # row, exactly what a lookup would have created. A lost node is caught by the
            # sentinel read above (DataLossError), never re-initialized here.
            missing = np.flatnonzero(~found)
            rows[missing] = initial_rows(
                spec.initializer, seed=spec.seed, ids=grads.ids[missing], dim=spec.dim
            )
        if not has_slots.all():
            fresh = np.flatnonzero(~has_slots)
            slots[fresh] = optimizer.initial_slots(fresh.size, spec.dim)
        if rows.size > _OFFLOAD_FLOATS:
            new_rows, new_slots = await asyncio.to_thread(
                _compute, optimizer, rows, grads.grads, slots
            )
        else:
            new_rows, new_slots = _compute(optimizer, rows, grads.grads, slots)
        return _Update(table=grads.table, ids=grads.ids, rows=new_rows, slots=new_slots)

    async def _write_updates(self, updates: Iterable[_Update]) -> None:
        jobs = []
        for u in updates:
            jobs.append(self.store.set(u.table, u.ids, u.rows))
            if u.slots.shape[1]:
                jobs.append(self.store.set(u.table, u.ids, u.slots, kind=Kind.SLOTS))
        await asyncio.gather(*jobs)

    async def _write_plan(self, plan: _Plan) -> None:
        """Write rows, slots, dense parameters and version; then the done record."""
        # the jobs return None or set_blobs' stored flags; only their completion matters
        jobs: list[Awaitable[object]] = [self._write_updates(plan.updates)]
        if plan.dense is not None and plan.version is not None:
            jobs.append(self.dense.write(plan.version, *plan.dense))
        if plan.version is not None:
            jobs.append(
                self.store.set_blobs(
                    META_TABLE, [self._version_id()], [str(plan.version).encode()], kind=Kind.META
                )
            )
        await asyncio.gather(*jobs)
        await self.store.set_blobs(
            META_TABLE,
            [self._record_id(plan.push_id)],
            [b"1"],
            kind=Kind.PUSH_RECORD,
            ttl_s=self.push_record_ttl_s,
        )
        if plan.version is not None:
            await self._set_version(plan.version)

    # ------------------------------------------------------------ the journal

    async def _write_journal(self, slot: int, plan: _Plan) -> None:
        """Chunks first, then the header (with a CRC-32 of the body): a header is only
        ever present over a complete journal."""
        size = sum(u.rows.nbytes + u.slots.nbytes for u in plan.updates)
        if size > _OFFLOAD_JOURNAL_BYTES:  # packing and the CRC would stall the loop
            chunks, header = await asyncio.to_thread(_journal_encode, plan)
        else:
            chunks, header = _journal_encode(plan)
        await self.store.set_blobs(
            META_TABLE,
            [self._journal_id(slot, i) for i in range(len(chunks))],
            chunks,
            kind=Kind.JOURNAL,
        )
        await self.store.set_blobs(
            META_TABLE, [self._journal_id(slot)], [header], kind=Kind.JOURNAL
        )

    async def _clear_journal(self, slot: int) -> None:
        await self.store.set_blobs(META_TABLE, [self._journal_id(slot)], [b""], kind=Kind.JOURNAL)

    async def _read_journal(self, slot: int) -> _Plan | None:
        (raw,) = await self.store.get_blobs(META_TABLE, [self._journal_id(slot)], kind=Kind.JOURNAL)
        if not raw:
            return None
        header = unpack(raw)
        ids = [self._journal_id(slot, i) for i in range(int(header["chunks"]))]
        chunks = await self.store.get_blobs(META_TABLE, ids, kind=Kind.JOURNAL)
        if any(c is None for c in chunks):
            raise RuntimeError(f"journal slot {slot} of replica {self.replica} is missing chunks")
        body = b"".join(c for c in chunks if c is not None)
        if len(body) != header["bytes"] or zlib.crc32(body) != header["crc32"]:
            raise RuntimeError(f"journal slot {slot} of replica {self.replica} fails its checksum")
        doc = unpack(body)
        updates = [
            _Update(
                table=t["table"],
                ids=decode_ids(t["ids"], field="journal.ids"),
                rows=decode_array(t["rows"], field="journal.rows").copy(),
                slots=decode_array(t["slots"], field="journal.slots").copy(),
            )
            for t in doc["tables"]
        ]
        dense = None
        if doc.get("dense") is not None:
            dense = (
                {
                    n: decode_array(v, field="journal.dense").copy()
                    for n, v in doc["dense"]["params"].items()
                },
                {
                    n: decode_array(v, field="journal.dense").copy()
                    for n, v in doc["dense"]["slots"].items()
                },
            )
        return _Plan(
            push_id=str(doc["push_id"]), updates=updates, version=doc.get("version"), dense=dense
        )

    async def recover(self) -> int:
        """Finish every journaled push of this replica and load its version.

        Call before serving. Returns how many pushes were finished.
        """
        finished = 0
        for slot in range(JOURNAL_SLOTS):
            plan = await self._read_journal(slot)
            if plan is None:
                continue
            if not await self.is_done(plan.push_id):
                logger.warning(
                    "replica %d: replaying journaled push %s", self.replica, plan.push_id
                )
                await self._write_plan(plan)
                finished += 1
            await self._clear_journal(slot)
        await self._set_version(await self._stored_version())
        return finished

    async def _stored_version(self) -> int:
        (raw,) = await self.store.get_blobs(META_TABLE, [self._version_id()], kind=Kind.META)
        version = int(raw) if raw else 0
        if self.replica == 0:
            state = await self.dense.read()
            if state is not None:
                version = max(version, state.version)
        return version

    async def _journal_slot(self) -> int:
        """A free journal slot. Raises the error of the failed writes when every slot is
        held by one: they wait for the store to recover, which may be never."""
        while True:
            if len(self._failing) >= JOURNAL_SLOTS:
                raise next(iter(self._failing.values()))()
            try:
                async with asyncio.timeout(0.5):  # then look again: a slot may have failed
                    return await self._journal_slots.get()
            except TimeoutError:
                continue

    def _finish_later(self, slot: int, plan: _Plan, keys: set[int]) -> None:
        """Replay a journaled push until it sticks; owns (and finally releases) its row locks.

        Once a replay has failed, pushes that need its rows (or a journal slot, when all
        are held so) fail fast with its last error rather than wait: see `RowLocks.fail`.
        """
        last: Exception | None = None

        def blocked() -> BaseException:
            return _held_by_failed_write(plan.push_id, last)

        async def finish() -> None:
            nonlocal last
            delay = 0.1
            try:
                while True:
                    try:
                        await self._write_plan(plan)
                        await self._clear_journal(slot)
                        break
                    except Exception as exc:
                        first, last = last is None, exc
                        if first:  # the store still fails: stop others waiting for it
                            self._failing[slot] = blocked
                            await self.locks.fail(keys, blocked)
                        logger.warning(
                            "replica %d: finishing push %s failed, retrying in %.1f s",
                            self.replica,
                            plan.push_id,
                            delay,
                            exc_info=True,
                        )
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 5.0)
            finally:  # done, or cancelled by a restore (pause(drop_unfinished=True))
                self._journal_slots.put_nowait(slot)
                self._failing.pop(slot, None)
                await self.locks.release(keys)

        task = asyncio.get_running_loop().create_task(finish())
        self._finishers.add(task)
        task.add_done_callback(self._finishers.discard)

    async def close(self) -> None:
        """Wait briefly for background finishers; those still running resume at restart."""
        if self._finishers:
            await asyncio.wait(self._finishers, timeout=5)


@asynccontextmanager
async def _nolock() -> AsyncIterator[None]:
    yield


def _held_by_failed_write(push_id: str, error: Exception | None) -> BaseException:
    """The error for a push that needs rows a failed, journaled push still holds: the
    same kind of error (so the service answers the same status and `type`), naming it."""
    message = (
        f"rows of this push are held by push {push_id!r}, whose write failed and is retried "
        f"in the background until it succeeds: {error}"
    )
    if isinstance(error, DataLossError):
        return DataLossError(message, nodes=error.nodes)
    if isinstance(error, StoreError):
        return type(error)(message, node=error.node)
    return UnavailableError(message)


def _mean_push(push_id: str, pushes: list[Push], workers: int) -> Push:
    """One push whose gradients are the mean over `workers` pushes (sum / workers)."""
    by_table: dict[str, list[TableGrads]] = {}
    for p in pushes:
        for t in p.tables:
            by_table.setdefault(t.table, []).append(t)
    tables = []
    scale = np.float32(1.0 / workers)
    for name, parts in by_table.items():
        ids = np.concatenate([t.ids for t in parts])
        grads = np.concatenate([t.grads for t in parts])
        uniq, summed = segment_sum(ids, grads)
        tables.append(TableGrads(table=name, ids=uniq, grads=summed * scale))
    dense: dict[str, NDArray[np.float32]] = {}
    for p in pushes:
        for name, g in p.dense.items():
            dense[name] = dense[name] + g if name in dense else np.array(g, dtype=np.float32)
    return Push(
        push_id=push_id,
        worker=0,
        version=pushes[0].version,
        tables=tuple(tables),
        dense={n: (g * scale).astype(np.float32) for n, g in dense.items()},
    )


def _journal_encode(plan: _Plan) -> tuple[list[bytes], bytes]:
    """A plan as journal chunks (<= JOURNAL_CHUNK_BYTES) and its header (pure, thread-safe)."""
    doc: dict[str, Any] = {
        "push_id": plan.push_id,
        "version": plan.version,
        "tables": [
            {
                "table": u.table,
                "ids": encode_ids(u.ids),
                "rows": encode_array(u.rows),
                "slots": encode_array(u.slots),
            }
            for u in plan.updates
        ],
    }
    if plan.dense is not None:
        params, slots = plan.dense
        doc["dense"] = {
            "params": {n: encode_array(v) for n, v in params.items()},
            "slots": {n: encode_array(v) for n, v in slots.items()},
        }
    body = pack(doc)
    chunks = [
        body[i : i + JOURNAL_CHUNK_BYTES] for i in range(0, len(body), JOURNAL_CHUNK_BYTES)
    ] or [b""]
    header = pack(
        {
            "push_id": plan.push_id,
            "chunks": len(chunks),
            "bytes": len(body),
            "crc32": zlib.crc32(body),
            "time": time.time(),
        }
    )
    return chunks, header
