"""Flushes of what a replica writes behind: the dense state (a generation every
`service.dense_flush_pushes` updates or `dense_flush_s` seconds) and the rows the row
cache holds dirty (their journals cleared after). docs/write-behind.md says why."""

from __future__ import annotations

import asyncio
import logging

from lookup_table.errors import DataLossError
from optimizer_service.engine.items import Items
from optimizer_service.engine.journal import JOURNAL_SLOTS
from optimizer_service.engine.plan import TableUpdate
from optimizer_service.engine.replica import ReplicaState
from optimizer_service.push import Push

logger = logging.getLogger(__name__)


# Rows written behind: a flush also comes once the journals it would clear hold this
# many bytes, whatever `service.row_flush_pushes` says. They wait in memcached until the
# flush: big pushes of the same rows (a few distinct rows, so the row cache's budget does
# not call the flush) must not fill a node with journals.
KEPT_JOURNAL_BYTES = 64 << 20


class DenseFlushes:
    """When the dense state is written behind (replica 0)."""

    def __init__(self, state: ReplicaState) -> None:
        self.state = state
        self.timer: asyncio.TimerHandle | None = None
        self.flushing: asyncio.Task[object] | None = None

    def when_due(self) -> None:
        """Write the dense state behind now if `service.dense_flush_pushes` updates are
        not stored yet; else within `service.dense_flush_s` seconds. Not while paused:
        the pause flushed, and a restore must not get a flush of the state before it."""
        if self.state.paused:
            return
        if self.state.dense.unflushed >= self.state.config.service.dense_flush_pushes:
            self.later()
        else:
            self.arm_timer()

    def arm_timer(self) -> None:
        """Flush within `service.dense_flush_s` seconds, if anything is left to write
        and no flush is planned (not while paused)."""
        if self.state.dense.unflushed and self.timer is None and not self.state.paused:
            self.timer = asyncio.get_running_loop().call_later(
                self.state.config.service.dense_flush_s, self.later
            )

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def later(self) -> None:
        """Start a flush in the background unless one runs (it writes the newest state
        there is when it starts; the next update due starts the next)."""
        self.cancel_timer()
        if self.state.paused or (self.flushing is not None and not self.flushing.done()):
            return

        async def flush() -> None:
            try:
                await self.state.dense.flush()
            except Exception:
                logger.warning(
                    "replica %d: writing the dense parameters behind failed (their logs "
                    "keep the updates; the next flush retries)",
                    self.state.replica,
                    exc_info=True,
                )
            self.arm_timer()  # updates came meanwhile, or this flush failed

        self.flushing = self.state.in_background(flush())

    def drop(self) -> None:
        """A restore or reset replaces the dense state: a flush of the old one under way
        must not land after it (the dense state itself is dropped at the reload)."""
        self.cancel_timer()
        if self.flushing is not None:
            self.flushing.cancel()


class RowFlushes:
    """When and how the rows written behind reach memcached."""

    def __init__(self, state: ReplicaState, items: Items) -> None:
        self.state = state
        self.items = items
        # the journal slots of done pushes whose values a flush has not written yet (in
        # the order they were done), slots to clear, the journals' sequence
        self.unflushed: list[int] = []
        self.journal_bytes: dict[int, int] = {}  # slot -> bytes of its journal
        self.to_clear: list[int] = []
        self.journal_seq = 0
        self.lock = asyncio.Lock()
        self.flushing: asyncio.Task[object] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def keep_journal(self, slot: int) -> None:
        """A done push whose rows are written behind: its journal stays until a flush."""
        self.unflushed.append(slot)
        self.when_due()

    async def make_room(self, push: Push) -> None:
        """Before a push whose rows may be written behind: flush now (and fail with the
        flush's error) when its rows would take the dirty rows past the row cache's
        budget (`RowCache.room_for`), or when flushes lag so far behind that the journal
        slots run out."""
        if (
            not self.state.cache.room_for([(t.table, t.ids.shape[0]) for t in push.tables])
            or len(self.unflushed) + len(self.to_clear)
            >= self.state.flush_every + JOURNAL_SLOTS // 2
        ):
            await self.flush()

    def when_due(self) -> None:
        """Flush the rows written behind now if `service.row_flush_pushes` pushes are not
        written yet, or their journals hold `KEPT_JOURNAL_BYTES`; else within
        `service.row_flush_s` seconds. Not while paused (the pause flushed; a restore
        must not get a flush of the rows before it)."""
        if self.state.paused or not self.unflushed:
            return
        if (
            len(self.unflushed) >= self.state.flush_every
            or sum(self.journal_bytes.get(slot, 0) for slot in self.unflushed) >= KEPT_JOURNAL_BYTES
        ):
            self.later()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(
                self.state.config.service.row_flush_s, self.later
            )

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def later(self) -> None:
        """Start a flush of the rows in the background unless one runs; a failed one is
        tried again a second later (the journals keep the rows meanwhile)."""
        self.cancel_timer()
        if self.state.paused or (self.flushing is not None and not self.flushing.done()):
            return

        async def flush() -> None:
            try:
                await self.flush()
            except Exception:
                logger.warning(
                    "replica %d: writing the rows behind failed (their journals keep them; "
                    "retrying in 1 s)",
                    self.state.replica,
                    exc_info=True,
                )
                if self.timer is None and not self.state.paused:
                    self.timer = asyncio.get_running_loop().call_later(1.0, self.later)
                return
            self.when_due()  # pushes came meanwhile

        self.flushing = self.state.in_background(flush())

    async def flush(self) -> None:
        """Write every dirty row of the row cache, then clear the journals of the pushes
        done before it was copied.

        Why that order keeps a restart exact: a push is listed (`unflushed`) when its
        done record is written, before its rows are unlocked, and its values are in the
        cache before that. So a listed push's rows are in the copy (its values, or newer
        ones), and a push not listed yet (still recording) has no later push on its rows
        among the listed ones: the journals a crash leaves, replayed in their order,
        end every row at its newest value. One flush at a time.
        """
        async with self.lock:
            self.cancel_timer()
            await self.check_nodes_kept_data()
            listed, self.unflushed = self.unflushed, []
            parts, stamp = self.state.cache.dirty()
            try:
                await self.items.write(
                    TableUpdate(table, ids, rows, slots) for table, ids, rows, slots in parts
                )
            except BaseException:
                self.unflushed[:0] = listed
                self.state.cache.undo_dirty()
                raise
            self.state.cache.clean(stamp)
            clear, self.to_clear = self.to_clear + listed, []
            try:
                await self.state.journal.clear_many(clear)
            except Exception:
                # the rows are written: a replay of these journals writes the same values
                # (or older ones of rows a later push changed: it would be replayed after)
                self.to_clear = clear
                logger.warning(
                    "replica %d: clearing %d journals of rows written behind failed; the "
                    "next flush clears them",
                    self.state.replica,
                    len(clear),
                    exc_info=True,
                )
                return
            for slot in clear:
                self.state.journal.give_back(slot)

    async def check_nodes_kept_data(self) -> None:
        """Before a flush writes: DataLossError if a node lost its sentinel (restarted or
        flushed) and nothing is written. A write batch checks the sentinel in the same
        pipeline as its writes, which memcached runs whatever it finds; a push's writes
        are its own rows, but a flush's are every row written behind since the last one,
        so it asks first (one round trip a flush). A node re-initialized since (a new
        sentinel) is written: its rows this replica holds come back with their newest
        values (docs/write-behind.md)."""
        sentinels = await self.state.store.sentinels()
        lost = tuple(node for node, value in sentinels.items() if value is None)
        if lost:
            which = f"node {lost[0]} has" if len(lost) == 1 else f"nodes {', '.join(lost)} have"
            raise DataLossError(
                f"memcached {which} lost its data: its sentinel is gone (the server restarted "
                f"or was flushed). The rows written behind were not written there: they stay "
                f"in replica {self.state.replica}'s memory and journals. Restore a checkpoint "
                f"(lookup-table-checkpoint restore) or accept the loss (lookup-table-admin "
                f"reinit --yes)",
                nodes=lost,
            )

    def drop(self) -> None:
        """A restore replaces every row (and deletes the journals): forget the rows not
        written yet, and free their journal slots."""
        self.cancel_timer()
        if self.flushing is not None:
            self.flushing.cancel()
        for slot in self.unflushed + self.to_clear:
            self.state.journal.give_back(slot)
        self.unflushed, self.to_clear = [], []
        self.state.forget_rows()
