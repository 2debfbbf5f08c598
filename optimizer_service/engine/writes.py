"""Writing a push's plan: rows, slots, dense switch and version, then its done record
(in the background), a failed write replayed from its journal until it sticks, and the
journal cleared (docs/service.md, exactly-once)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Sequence

import numpy as np

from lookup_table.core.keyspace import META_TABLE, Kind, version_id
from lookup_table.core.rows import still_old, value_hashes
from optimizer_service.engine.items import Items
from optimizer_service.engine.locks import LockSet
from optimizer_service.engine.plan import TableRedo, TableUpdate, WritePlan
from optimizer_service.engine.replica import ReplicaState
from optimizer_service.engine.write_behind import DenseFlushes, RowFlushes

logger = logging.getLogger(__name__)


class Writes:
    """Writes of write plans, done records and journal clears."""

    def __init__(
        self,
        state: ReplicaState,
        items: Items,
        dense_flushes: DenseFlushes,
        row_flushes: RowFlushes,
    ) -> None:
        self.state = state
        self.items = items
        self.dense_flushes = dense_flushes
        self.row_flushes = row_flushes

    async def write_plan(
        self, plan: WritePlan, *, replay: bool = False, record: bool = True, behind: bool = False
    ) -> None:
        """Write rows, slots, the dense switch and version; then the done record.

        `replay`: the plan comes back from the journal (a failed write or a crash); its
        dense switch happens only if `current` still names the state it replaces.
        `record=False` leaves the done record to the caller (`record_later`).
        `behind`: the rows of cached tables are not written (a flush writes them).
        """
        updates = [u for u in plan.updates if not (behind and self.state.cache.caches(u.table))]
        if plan.redo:  # a journal's: read what is written, recompute the rest
            updates += await self.recompute_unwritten(plan.redo)
        # the jobs return None or set_blobs' stored flags; only their completion matters
        jobs: list[Awaitable[object]] = [self.items.write(updates)]
        if plan.dense_switch is not None:  # a journal of an older format
            jobs.append(
                self.state.dense.switch(
                    plan.dense_switch.current,
                    plan.dense_switch.previous,
                    values=plan.dense,
                    check=replay,
                )
            )
        elif plan.dense is not None and plan.version is not None and not plan.dense_logged:
            # a journal of an older service: it carries the values, not a generation
            jobs.append(self.state.dense.write(plan.version, *plan.dense))
        if plan.version is not None:
            jobs.append(
                self.state.store.set_blobs(
                    META_TABLE,
                    [version_id(self.state.replica)],
                    [str(plan.version).encode()],
                    kind=Kind.META,
                )
            )
        await asyncio.gather(*jobs)
        if plan.dense_logged and plan.dense is not None and plan.version is not None:
            # a live plan's (a recovered journal has no values: `recover` replays the logs)
            self.state.dense.advance(plan.version, *plan.dense)
            self.dense_flushes.when_due()
        if record:
            await self.write_record(plan.push_id)
        if plan.version is not None:
            await self.state.set_version(plan.version)

    async def recompute_unwritten(self, redo: Sequence[TableRedo]) -> list[TableUpdate]:
        """What a journal's tables still need written: the items the push did not write,
        recomputed (see `plan`); one read per node.

        An item's witness word keeps its old bits until the push writes the item
        (`rows.still_old`). Journals of older services have the hash of each item before
        the push (`old_hashes`: recompute the items that still have it) or the new
        values' hashes (recompute the items that do not have them yet).
        """
        got = await self.items.read_filled([(r.table, r.ids) for r in redo])
        out: list[TableUpdate] = []
        for r, (rows, slots, _) in zip(redo, got, strict=True):
            optimizer = self.state.optimizers[r.table]
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
                # rounded as the push rounded it (its keys: the same ids and steps)
                new_rows = self.state.rounders[r.table].round(
                    r.ids[todo], slots[todo], new_rows, new_slots
                )
                out.append(TableUpdate(r.table, r.ids[todo], new_rows, new_slots))
        return out

    async def write_record(self, push_id: str) -> None:
        await self.state.store.set_blobs(
            META_TABLE,
            [self.state.record_id(push_id)],
            [b"1"],
            kind=Kind.PUSH_RECORD,
            ttl_s=self.state.push_record_ttl_s,
        )

    def record_later(
        self, slot: int, plan: WritePlan, keys: LockSet, *, behind: bool = False
    ) -> None:
        """Write a written push's done record in the background (the push is answered
        meanwhile), then unlock its rows and clear its journal slot.

        Until the record is stored, the push counts as done here (`is_done`) and its rows
        stay locked. So a crash meanwhile leaves its journal to a replay that no other
        push has raced: the replay finds every item written and writes the record. A
        failed write of the record hands the push to `finish_later`, which holds the rows
        until a replay of the journal (which writes the same values again) and the record
        stick. `behind`: the journal stays until a flush of the rows clears it.
        """
        self.state.recording.add(plan.push_id)

        async def record() -> None:
            try:
                await self.write_record(plan.push_id)
            except Exception:
                logger.warning(
                    "replica %d: writing the done record of push %s failed; it is "
                    "finished from its journal",
                    self.state.replica,
                    plan.push_id,
                    exc_info=True,
                )
                self.finish_later(slot, plan, keys, behind=behind)
                return
            finally:
                self.state.recording.discard(plan.push_id)
            if behind:  # listed before the rows are unlocked: see `RowFlushes.flush`
                self.row_flushes.keep_journal(slot)
                await self.state.locks.release(keys)
                return
            await self.state.locks.release(keys)
            self.clear_later(slot)

        self.state.in_background(record())

    def finish_later(
        self, slot: int, plan: WritePlan, keys: LockSet, *, behind: bool = False
    ) -> None:
        """Replay a journaled push in the background until it sticks (`Journal.finish_later`);
        the replay owns (and finally releases) its journal slot and row locks. `behind`:
        the replay writes the push's rows through, and its journal stays until a flush
        (an earlier journal of the same rows may still be replayed after a crash: this
        one must follow it)."""
        task = self.state.journal.finish_later(
            slot,
            plan,
            write=functools.partial(self.write_plan, replay=True),
            locks=self.state.locks,
            keys=keys,
            keep=self.row_flushes.keep_journal if behind else None,
        )
        self.state.finishers.add(task)
        task.add_done_callback(self.state.finishers.discard)

    def clear_later(self, slot: int) -> None:
        """Clear a finished push's journal slot in the background, then free it.

        The push is answered and its rows unlocked first: its done record is written, so
        a recovery that finds the journal before the clear lands skips it, and a failed
        clear only leaves the slot to be overwritten by its next push.
        """

        async def clear() -> None:
            try:
                await self.state.journal.clear(slot)
            except Exception:
                logger.warning(
                    "replica %d: clearing journal slot %d failed (its push is done)",
                    self.state.replica,
                    slot,
                    exc_info=True,
                )
            finally:
                self.state.journal.give_back(slot)

        self.state.in_background(clear())
