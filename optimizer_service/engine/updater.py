"""The replica's engine room by room: `Updater` admits a push (pause, resume, in-flight
copies, sync rounds), locks its rows, has it planned (`stepping`), journaled and written
(`writes`), answered (`answers`), and written behind (`write_behind`); a start replays
its journals first (`recovery`). docs/service.md and docs/write-behind.md say why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.keys import IdArray
from lookup_table.core.sharding import row_hashes_many
from lookup_table.store import EmbeddingStore
from optimizer_service.engine.answers import Answer, Answers
from optimizer_service.engine.items import Items
from optimizer_service.engine.locks import LockSet
from optimizer_service.engine.plan import Applied, WritePlan
from optimizer_service.engine.recovery import Recovery
from optimizer_service.engine.replica import ReplicaState
from optimizer_service.engine.stepping import CachedItems, CacheMoved, Stepper
from optimizer_service.engine.sync import SyncRounds
from optimizer_service.engine.write_behind import DenseFlushes, RowFlushes
from optimizer_service.engine.writes import Writes
from optimizer_service.errors import NotOwnerError
from optimizer_service.push import Push

logger = logging.getLogger(__name__)


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
        self.state = state = ReplicaState(
            config, store, replica=replica, push_record_ttl_s=push_record_ttl_s
        )
        self.config = config
        self.store = store
        self.replica = replica
        self.push_record_ttl_s = push_record_ttl_s
        self.optimizers = state.optimizers
        self.dense = state.dense
        self.locks = state.locks
        self.journal = state.journal
        self.cache = state.cache
        self.items = Items(state)
        self.dense_flushes = DenseFlushes(state)
        self.row_flushes = RowFlushes(state, self.items)
        self.stepper = Stepper(state, self.items, self.row_flushes)
        self.answers = Answers(state, self.items)
        self.writes = Writes(state, self.items, self.dense_flushes, self.row_flushes)
        self.recovery = Recovery(state, self.items, self.writes, self.row_flushes)
        self.applied = 0
        self._inflight: dict[str, asyncio.Future[Applied]] = {}
        self._on_rows = on_rows
        self._on_dropped = on_dropped  # (table, gradients of ids without a row dropped)
        self._rounds = SyncRounds(config.workers)
        self._active = 0
        self._idle = asyncio.Condition()
        self._auto_resume: asyncio.TimerHandle | None = None

    @property
    def version(self) -> int:
        return self.state.version

    async def is_done(self, push_id: str) -> bool:
        return await self.state.is_done(push_id)

    async def recover(self) -> int:
        """Finish every journaled push of this replica and load its version
        (`Recovery.recover`). Call before serving. Returns how many pushes were finished."""
        return await self.recovery.recover()

    async def answer(self, push: Push, plan: WritePlan | None) -> Answer:
        """What `push.answer` asks back (`Answers.answer`): `plan` is the push's own write
        plan when this replica applied it (`Applied.plan`), else None."""
        return await self.answers.answer(push, plan)

    @property
    def unwritten_rows(self) -> int:
        """Rows (with their slots) this replica holds that memcached does not yet: written
        behind since the last flush, or being written by one."""
        return self.cache.unwritten()

    @property
    def unflushed_pushes(self) -> int:
        """Pushes done since the last flush of the rows written behind began."""
        return len(self.row_flushes.unflushed)

    @property
    def paused(self) -> bool:
        return self.state.paused

    async def pause(self, *, timeout_s: float = 600.0, drop_unfinished: bool = False) -> int:
        """Hold new pushes and wait for those in flight; resumes by itself after `timeout_s`.

        Returns how many pushes are still being finished in the background (their write
        failed and their journal is replayed until it sticks), plus the pushes whose rows
        and the dense updates that could not be written behind now (`RowFlushes.flush`,
        `DenseReplica.flush`): memcached does not hold all they wrote, so a checkpoint
        taken now would not be consistent.
        `drop_unfinished` cancels those replays and a dense flush under way first, and
        writes nothing behind: only for a restore or a reset, which replaces every row
        they would write (and deletes their journals); otherwise they could write the
        old rows over the new ones.
        """
        self.state.admitting.clear()
        if self._auto_resume is not None:
            self._auto_resume.cancel()
        self._auto_resume = asyncio.get_running_loop().call_later(timeout_s, self.resume)
        async with self._idle:
            await self._idle.wait_for(lambda: self._active == 0)
        if self.state.finishers and drop_unfinished:
            logger.warning(
                "replica %d: dropping %d unfinished pushes (a restore replaces their rows)",
                self.replica,
                len(self.state.finishers),
            )
            for task in self.state.finishers:
                task.cancel()
        if drop_unfinished:
            self.row_flushes.drop()
            self.dense_flushes.drop()
        if self.state.finishers or self.state.cleanups:  # a replay about to succeed, journal clears
            await asyncio.wait(self.state.finishers | self.state.cleanups, timeout=2.0)
        unflushed = 0
        if not drop_unfinished and self.state.flush_every > 1:
            try:  # a checkpoint reads memcached: the rows written behind go there
                await self.row_flushes.flush()
            except Exception:
                unflushed += len(self.row_flushes.unflushed)
                logger.warning(
                    "replica %d: writing the rows behind at the pause failed: %d pushes are "
                    "only in their journals",
                    self.replica,
                    unflushed,
                    exc_info=True,
                )
        if not drop_unfinished:  # a checkpoint reads memcached: the dense state goes there
            self.dense_flushes.cancel_timer()
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
        return len(self.state.finishers) + unflushed

    async def reload(self) -> int:
        """Forget in-memory model state and read the version again (after a restore).

        Only while paused: nothing is in flight, so no push can mix the old state with
        the restored one. Returns the version now served.
        """
        if not self.state.paused:
            raise RuntimeError("reload() needs a paused replica")
        self._rounds.clear()
        self.dense_flushes.cancel_timer()
        self.dense.forget()
        self.state.forget_rows()
        self.state.sentinels = await self.state.cache_sentinels()
        version = await self.recovery.stored_version()
        async with self.state.version_changed:
            self.state.version = version  # may go back: the checkpoint is older
            self.state.version_changed.notify_all()
        logger.warning("replica %d: reloaded after a restore, version %d", self.replica, version)
        return version

    def resume(self) -> None:
        if self._auto_resume is not None:
            self._auto_resume.cancel()
            self._auto_resume = None
        self.state.admitting.set()
        self.dense_flushes.when_due()  # what a failed flush at the pause left, or came since

    @asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        await self.state.admitting.wait()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                async with self._idle:
                    self._idle.notify_all()

    async def wait_version(self, after: int, *, timeout_s: float) -> int:
        """Long-poll: the version once it is > `after`, or the current one at the timeout."""
        async with self.state.version_changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.state.version_changed.wait_for(lambda: self.state.version > after)
            except TimeoutError:
                pass
            return self.state.version

    async def apply(
        self, push: Push, *, on_plan: Callable[[WritePlan], None] | None = None
    ) -> Applied:
        """Apply `push` at most once; returns whether this call applied it (`Applied`).

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
            # its created rows are counted once, by the call that applied it
            return replace(result, applied=False, duplicate=True, created={})
        if push.push_id in self.state.recording:  # written, its done record on its way
            return Applied(applied=False, duplicate=True, rows=0, version=self.state.version)
        future: asyncio.Future[Applied] = asyncio.get_running_loop().create_future()
        self._inflight[push.push_id] = future
        try:
            async with self._admitted():
                if self.config.mode == "sync":
                    result = await self._rounds.join(
                        push, version=self.state.version, apply=self._apply_round
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

    async def _apply_round(self, merged: Push, version: int) -> Applied:
        return await self._apply(merged, version=version)

    async def _apply(
        self,
        push: Push,
        *,
        version: int | None,
        on_plan: Callable[[WritePlan], None] | None = None,
    ) -> Applied:
        if self.state.flush_every > 1:
            await self.row_flushes.make_room(push)
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
            peek = asyncio.ensure_future(self.stepper.peek(push, version))
            reading = asyncio.gather(
                peek, self.stepper.plan_push(push, version, peek), return_exceptions=True
            )
            writes: list[asyncio.Future[Any]] = []
            plan: WritePlan | None = None
            cached: list[CachedItems] = []
            journaled = False
            log: Coroutine[Any, Any, None] | None = None  # the dense log, until started
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
                if peeked.done or push.push_id in self.state.recording:
                    self.journal.give_back(slot)
                    return Applied(
                        applied=False, duplicate=True, rows=0, version=self.state.version
                    )
                if isinstance(planned, BaseException):
                    raise planned
                # rows written behind while the row cache is in use (it holds them)
                behind = self.state.flush_every > 1 and self.state.sentinels is not None
                started = None
                if not behind:
                    # The journal's start (the gradients) is written while the optimizer
                    # computes, not while the rows are read: memcached and this loop then
                    # serve the reads alone (a big journal sent beside the reads slows them)
                    started = asyncio.ensure_future(
                        self.journal.write_start(
                            slot, [(t.table, t.ids, t.grads) for t in push.tables]
                        )
                    )
                    writes.append(started)
                plan, prepared = planned
                if plan.dense_logged and plan.version is not None:
                    log = self.dense.write_log(plan.version, push.dense)
                    if not behind:  # written while the rows are stepped (which awaits)
                        writes.append(asyncio.ensure_future(log))
                        log = None
                while True:
                    try:
                        plan.updates, cached = await self.stepper.step_tables(
                            prepared, behind=behind
                        )
                        break
                    except CacheMoved:  # rare: rotated out twice while the rest was read
                        prepared = await self.stepper.read_starts(push.tables)
                self.state.changes += 1
                plan.seq = self.state.changes
                if on_plan is not None:
                    on_plan(plan)
                if log is not None:
                    # rows stepped in place never yield: a log started before them would
                    # encode its gradients ahead of the answer, on the trainer's wait
                    writes.append(asyncio.ensure_future(log))
                    log = None
                results = await asyncio.gather(*writes, return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                if started is None:  # the new values, kept until a flush writes them
                    self.row_flushes.journal_seq += 1
                    self.row_flushes.journal_bytes[slot] = await self.journal.write(
                        slot,
                        plan,
                        seq=self.row_flushes.journal_seq,
                        step_slots=self.state.step_slots,
                    )
                else:
                    await self.journal.write_end(slot, started.result(), plan)
                journaled = True
                await self.writes.write_plan(plan, record=False, behind=behind)
            except BaseException:
                if log is not None:  # never started
                    log.close()
                await settled()
                if plan is not None and (journaled or not behind):
                    # half written? (rows written behind: a row the cache holds dirty is
                    # only forgotten when the replay below writes a newer value)
                    self.cache.forget((u.table, u.ids) for u in plan.updates)
                if journaled and plan is not None:
                    # Half-written rows must not be seen: the rows stay locked and the
                    # journal slot taken until a background replay finishes the push.
                    self.writes.finish_later(slot, plan, keys, behind=behind)
                    handed_over = True
                else:
                    # a dense log written for nothing is overwritten by the next update
                    # to its version (no journal names it: it never counts)
                    self.journal.give_back(slot)
                raise
            self.writes.record_later(slot, plan, keys, behind=behind)
            handed_over = True
            if self.state.sentinels is not None:
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
        return Applied(
            applied=True,
            duplicate=False,
            rows=push.num_rows,
            version=self.state.version,
            plan=plan,
            # rows this push (or sync round: SyncRounds tells the worker that applied it)
            # created
            created={u.table: u.created for u in plan.updates if u.created},
        )

    async def read_rows(
        self, reads: Sequence[tuple[str, IdArray]], *, after: WritePlan | None = None
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """`POST /v1/rows`: the rows of each (table, unique ids of this replica's) as this
        replica knows them, and which exist; an id without a row gets its initial value
        and nothing is created (its first push writes it). `after`: a push's plan, whose
        rows read as it changes them (a push's `read`). Waits while paused, as a push
        does: a restore's rows are what a read after it sees."""
        async with self._admitted():
            return await self.answers.rows_after(reads, after)

    async def close(self) -> None:
        """Write the rows and the dense state behind; wait briefly for background
        finishers (those still running resume at restart, as the journals and dense logs
        do)."""
        self.dense_flushes.cancel_timer()
        if self.state.finishers or self.state.cleanups:  # done records: their journals are listed
            await asyncio.wait(self.state.finishers | self.state.cleanups, timeout=5)
        if self.state.flush_every > 1:
            try:
                await self.row_flushes.flush()
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
        if self.state.finishers or self.state.cleanups:
            await asyncio.wait(self.state.finishers | self.state.cleanups, timeout=5)
