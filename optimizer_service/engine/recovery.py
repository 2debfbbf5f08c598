"""A replica's start: replay every journal its pushes left (in their order, rows written
behind stepped back to their newest values), rebuild the dense state from its logs,
and load the version, before it serves."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
from lookup_table.core.keyspace import META_TABLE, Kind, version_id
from lookup_table.core.optimizers import step_slot
from lookup_table.core.wire import unpack
from optimizer_service.engine.dense import DenseLogError
from optimizer_service.engine.items import Items
from optimizer_service.engine.journal import IncompleteJournalError
from optimizer_service.engine.plan import TableUpdate, WritePlan
from optimizer_service.engine.replica import ReplicaState
from optimizer_service.engine.write_behind import RowFlushes
from optimizer_service.engine.writes import Writes

logger = logging.getLogger(__name__)


class Recovery:
    """Journal replay and the stored version."""

    def __init__(
        self, state: ReplicaState, items: Items, writes: Writes, row_flushes: RowFlushes
    ) -> None:
        self.state = state
        self.items = items
        self.writes = writes
        self.row_flushes = row_flushes

    async def recover(self) -> int:
        """Finish every journaled push of this replica and load its version.

        Call before serving. Returns how many pushes were finished.
        """
        finished = 0
        found: list[tuple[int, WritePlan]] = []
        for slot, raw in enumerate(await self.state.journal.headers()):
            if not raw:
                continue
            try:
                plan = await self.state.journal.read(slot, raw)
            except IncompleteJournalError as exc:
                behind = unpack(raw).get("seq") is not None
                if behind or not await self.state.is_done(exc.push_id):
                    why = (
                        "and it holds rows written behind"
                        if behind
                        else "and its push has no done record"
                    )
                    raise RuntimeError(
                        f"replica {self.state.replica}: {exc}, {why}: they may be written in "
                        f"part; restore a checkpoint (lookup-table-checkpoint restore)"
                    ) from exc
                # a finished push's header, whose clear failed, over a later push's chunks
                logger.warning("replica %d: %s; its push is done: cleared", self.state.replica, exc)
                await self.state.journal.clear(slot)
                continue
            if plan is not None:
                found.append((slot, plan))
        # rows written behind: every journal, done or not, in their order (values: the
        # newest wins; gradients and steps: `restep` gives each row the pushes it lacks);
        # each replay writes its done record
        found.sort(key=lambda sp: sp[1].journal_seq)
        await self.restep([plan for _, plan in found if plan.journal_seq])
        for _, plan in found:
            if plan.journal_seq or not await self.state.is_done(plan.push_id):
                logger.warning(
                    "replica %d: replaying journaled push %s", self.state.replica, plan.push_id
                )
                await self.writes.write_plan(plan, replay=True)
                finished += 1
        await self.state.journal.clear_many([slot for slot, _ in found])
        self.row_flushes.journal_seq = max((p.journal_seq for _, p in found), default=0)
        version = await self.stored_version()
        if self.state.replica == 0:
            await self.recover_dense(version)
        await self.state.set_version(version)
        self.state.sentinels = await self.state.cache_sentinels()
        return finished

    async def restep(self, plans: Sequence[WritePlan]) -> None:
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
        got = await self.items.read_filled(list(union.items()))
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
                column = self.state.step_slots.get(r.table)
                if column is None or r.grads.shape[1:] != rows.shape[1:]:
                    spec = self.state.config.table(r.table)
                    if step_slot(self.state.optimizers[r.table], spec.dim) is None:
                        counts = "which counts no steps"
                    elif column is None:  # `ttl_s`: journaled by values
                        counts = f"and ttl_s {spec.ttl_s} (journaled by values)"
                    else:
                        counts = "which counts steps"
                    raise RuntimeError(
                        f"replica {self.state.replica}: journaled push {plan.push_id} keeps steps "
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
                        f"replica {self.state.replica}: journaled push {plan.push_id} updates row "
                        f"{r.ids[i]!r} of table {r.table!r} from step {int(r.steps[i])}, but "
                        f"memcached and the earlier journals hold it at step {int(now[i])}: "
                        f"an update of it is lost; restore a checkpoint "
                        f"(lookup-table-checkpoint restore)"
                    )
                due = now == r.steps  # the others are newer: a flush wrote them since
                todo = at[due]
                new_rows, new_slots = self.state.optimizers[r.table].update(
                    rows[todo], r.grads[due], slots[todo]
                )
                # rounded as the push rounded it (its keys: the same ids and steps)
                new_rows = self.state.rounders[r.table].round(
                    ids[todo], slots[todo], new_rows, new_slots
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
                self.state.replica,
                count,
                table,
            )

    async def recover_dense(self, version: int) -> None:
        """Rebuild the dense state from the stored generation and the logs of the updates
        after it, up to `version`, this replica's stored version (every journaled dense
        push wrote it, or its journal's replay just did; when the generation is newer,
        nothing is replayed); store it as a generation."""
        try:
            replayed = await self.state.dense.replay_logs(version)
        except DenseLogError as exc:
            raise RuntimeError(
                f"replica {self.state.replica}: {exc}, but its push was applied: the dense "
                f"parameters after it cannot be rebuilt; restore a checkpoint "
                f"(lookup-table-checkpoint restore)"
            ) from exc
        if replayed:
            logger.warning(
                "replica %d: dense parameters rebuilt from %d logged updates",
                self.state.replica,
                replayed,
            )

    async def stored_version(self) -> int:
        (raw,) = await self.state.store.get_blobs(
            META_TABLE, [version_id(self.state.replica)], kind=Kind.META
        )
        version = int(raw) if raw else 0
        if self.state.replica == 0:
            current = await self.state.dense.meta()
            if current is not None:
                version = max(version, int(current["version"]))
        return version
