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
push can read a half-written row.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.initializers import initial_rows
from lookup_table.sharding import row_hashes
from lookup_table.store import META_TABLE, EmbeddingStore
from lookup_table.wire import decode_array, decode_ids, encode_array, encode_ids, pack, unpack
from optimizer_service.optimizers import Optimizer, make_optimizer
from optimizer_service.push import Push, TableGrads

__all__ = ["RowLocks", "Updater"]

logger = logging.getLogger(__name__)

JOURNAL_SLOTS = 8
JOURNAL_CHUNK_BYTES = 512 * 1024
_OFFLOAD_FLOATS = 1 << 16  # above this many floats per table, run the math in a thread


class RowLocks:
    """Per-row mutual exclusion for read-modify-write, by row hash.

    A push waits until none of its rows is held by another push, then takes all
    of them at once (no lock ordering, so no deadlock). Waiters are woken in
    arrival order. Two different rows with the same 64-bit hash would only
    serialize needlessly.
    """

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._changed = asyncio.Condition()

    @property
    def held(self) -> int:
        return len(self._held)

    async def acquire(self, keys: set[int]) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._held.isdisjoint(keys))
            self._held |= keys

    async def release(self, keys: set[int]) -> None:
        async with self._changed:
            self._held -= keys
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


def _compute(
    optimizer: Optimizer,
    rows: NDArray[np.float32],
    grads: NDArray[np.float32],
    slots: NDArray[np.float32],
) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    return optimizer.update(rows, grads, slots)


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
        self.locks = RowLocks()
        self.applied = 0
        self._inflight: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._journal_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(JOURNAL_SLOTS):
            self._journal_slots.put_nowait(slot)
        self._finishers: set[asyncio.Task[None]] = set()
        self._on_rows = on_rows

    # ------------------------------------------------------------ bookkeeping keys

    def _record_id(self, push_id: str) -> str:
        return f"r{self.replica}:{push_id}"

    def _journal_id(self, slot: int, chunk: int | None = None) -> str:
        base = f"r{self.replica}-j{slot}"
        return base if chunk is None else f"{base}-c{chunk}"

    async def is_done(self, push_id: str) -> bool:
        (value,) = await self.store.get_blobs(META_TABLE, [self._record_id(push_id)], kind="p")
        return value is not None

    # ------------------------------------------------------------ the push path

    async def apply(self, push: Push) -> dict[str, Any]:
        """Apply `push` at most once; returns `{applied, duplicate, rows}`."""
        running = self._inflight.get(push.push_id)
        if running is not None:
            result = await asyncio.shield(running)
            return {**result, "applied": False, "duplicate": True}
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._inflight[push.push_id] = future
        try:
            result = await self._apply(push)
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

    async def _apply(self, push: Push) -> dict[str, Any]:
        if await self.is_done(push.push_id):
            return {"applied": False, "duplicate": True, "rows": 0}
        keys: set[int] = set()
        for t in push.tables:
            keys.update(row_hashes(t.table, t.ids).tolist())
        await self.locks.acquire(keys)
        handed_over = False
        try:
            updates = await asyncio.gather(*(self._updated(t) for t in push.tables))
            slot = await self._journal_slots.get()
            journaled = False
            try:
                await self._write_journal(slot, push.push_id, updates)
                journaled = True
                await self._write_updates(updates)
                await self._mark_done(push.push_id)
                await self._clear_journal(slot)
            except BaseException:
                if journaled:
                    # Half-written rows must not be seen: the rows stay locked and the
                    # journal slot taken until a background replay finishes the push.
                    self._finish_later(slot, push.push_id, updates, keys)
                    handed_over = True
                else:
                    self._journal_slots.put_nowait(slot)
                raise
            self._journal_slots.put_nowait(slot)
        finally:
            if not handed_over:
                await self.locks.release(keys)
        self.applied += 1
        rows = push.num_rows
        if self._on_rows is not None:
            for t in push.tables:
                self._on_rows(t.table, t.ids.shape[0])
        return {"applied": True, "duplicate": False, "rows": rows}

    async def _updated(self, grads: TableGrads) -> _Update:
        spec = self.config.table(grads.table)
        optimizer = self.optimizers[grads.table]
        width = optimizer.slot_width(spec.dim)
        n = grads.ids.shape[0]
        if width:
            (rows, found), (slots, has_slots) = await asyncio.gather(
                self.store.get(grads.table, grads.ids, width=spec.dim, unique=True),
                self.store.get(grads.table, grads.ids, kind="s", width=width, unique=True),
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
                jobs.append(self.store.set(u.table, u.ids, u.slots, kind="s"))
        await asyncio.gather(*jobs)

    async def _mark_done(self, push_id: str) -> None:
        await self.store.set_blobs(
            META_TABLE, [self._record_id(push_id)], [b"1"], kind="p", ttl_s=self.push_record_ttl_s
        )

    # ------------------------------------------------------------ the journal

    async def _write_journal(self, slot: int, push_id: str, updates: list[_Update]) -> None:
        body = pack(
            {
                "push_id": push_id,
                "tables": [
                    {
                        "table": u.table,
                        "ids": encode_ids(u.ids),
                        "rows": encode_array(u.rows),
                        "slots": encode_array(u.slots),
                    }
                    for u in updates
                ],
            }
        )
        chunks = [
            body[i : i + JOURNAL_CHUNK_BYTES] for i in range(0, len(body), JOURNAL_CHUNK_BYTES)
        ] or [b""]
        await self.store.set_blobs(
            META_TABLE, [self._journal_id(slot, i) for i in range(len(chunks))], chunks, kind="j"
        )
        header = pack(
            {
                "push_id": push_id,
                "chunks": len(chunks),
                "bytes": len(body),
                "blake2b": hashlib.blake2b(body, digest_size=16).hexdigest(),
                "time": time.time(),
            }
        )
        await self.store.set_blobs(META_TABLE, [self._journal_id(slot)], [header], kind="j")

    async def _clear_journal(self, slot: int) -> None:
        await self.store.set_blobs(META_TABLE, [self._journal_id(slot)], [b""], kind="j")

    async def _read_journal(self, slot: int) -> tuple[str, list[_Update]] | None:
        (raw,) = await self.store.get_blobs(META_TABLE, [self._journal_id(slot)], kind="j")
        if not raw:
            return None
        header = unpack(raw)
        ids = [self._journal_id(slot, i) for i in range(int(header["chunks"]))]
        chunks = await self.store.get_blobs(META_TABLE, ids, kind="j")
        if any(c is None for c in chunks):
            raise RuntimeError(f"journal slot {slot} of replica {self.replica} is missing chunks")
        body = b"".join(c for c in chunks if c is not None)
        if hashlib.blake2b(body, digest_size=16).hexdigest() != header["blake2b"]:
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
        return str(header["push_id"]), updates

    async def recover(self) -> int:
        """Finish every journaled push of this replica; call before serving. Returns the count."""
        finished = 0
        for slot in range(JOURNAL_SLOTS):
            entry = await self._read_journal(slot)
            if entry is None:
                continue
            push_id, updates = entry
            if not await self.is_done(push_id):
                logger.warning("replica %d: replaying journaled push %s", self.replica, push_id)
                await self._write_updates(updates)
                await self._mark_done(push_id)
                finished += 1
            await self._clear_journal(slot)
        return finished

    def _finish_later(
        self, slot: int, push_id: str, updates: list[_Update], keys: set[int]
    ) -> None:
        """Replay a journaled push until it sticks; owns (and finally releases) its row locks."""

        async def finish() -> None:
            delay = 0.1
            try:
                while True:
                    try:
                        await self._write_updates(updates)
                        await self._mark_done(push_id)
                        await self._clear_journal(slot)
                        break
                    except Exception:
                        logger.warning(
                            "replica %d: finishing push %s failed, retrying in %.1f s",
                            self.replica,
                            push_id,
                            delay,
                            exc_info=True,
                        )
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 5.0)
                self._journal_slots.put_nowait(slot)
            finally:
                await self.locks.release(keys)

        task = asyncio.get_running_loop().create_task(finish())
        self._finishers.add(task)
        task.add_done_callback(self._finishers.discard)

    async def close(self) -> None:
        """Wait briefly for background finishers; those still running resume at restart."""
        if self._finishers:
            await asyncio.wait(self._finishers, timeout=5)
