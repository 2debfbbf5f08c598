"""The journal of one replica: a push's write plan, stored before its rows are written.

A replica has `JOURNAL_SLOTS` slots (`_meta/j/rK-jS`), `service.row_flush_pushes` more
when it writes its rows behind; a restart reads all `MAX_JOURNAL_SLOTS`. A header is only
ever written over a complete journal (every chunk first); a cleared slot is an empty
header and no chunks. What a journal holds: `journal_format`; why: docs/write-behind.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lookup_table.core.keyspace import META_TABLE, Kind, journal_id
from lookup_table.core.wire import pack, unpack
from lookup_table.errors import DataLossError, StoreError
from lookup_table.memcached.protocol import Wire
from lookup_table.store import EmbeddingStore
from optimizer_service.engine.journal_format import (
    BEHIND,
    JOURNAL_CHUNK_BYTES,
    START_END,
    GradTable,
    cut,
    decode_journal,
    decode_parts,
    encode_end,
    encode_journal,
    encode_start,
    journal_format,
)
from optimizer_service.engine.locks import LockSet, RowLocks
from optimizer_service.engine.plan import WritePlan
from optimizer_service.errors import UnavailableError

__all__ = [
    "JOURNAL_SLOTS",
    "MAX_JOURNAL_SLOTS",
    "IncompleteJournalError",
    "Journal",
    "JournalStart",
]

logger = logging.getLogger(__name__)

JOURNAL_SLOTS = 8
MAX_JOURNAL_SLOTS = 64  # config.MAX_ROW_FLUSH_PUSHES + JOURNAL_SLOTS
# Above this many bytes of ids and gradients, a journal's start is encoded in a thread:
# its packing and CRC then take a few ms, which the loop spends on other work. Below, a
# thread's handoff and GIL contention cost more than they free.
_OFFLOAD_JOURNAL_BYTES = 2 << 20
# A start smaller than this is not written by itself: it goes with the end, in the header
# (one `set` for a small push), when the two fit in one item.
_START_ALONE_BYTES = 64 << 10
_HEADER_ROOM = 1024  # the header's own fields, besides the tail it carries


@dataclass(frozen=True, slots=True)
class JournalStart:
    """What `write_start` wrote of a journal body: its first `chunks` chunks, with CRC-32
    `crc32`, and the start's bytes not written yet (`rest`: all of it when small), which
    go with the end. `size`: the start's length in the body."""

    chunks: int
    crc32: int
    rest: bytes
    size: int

    @property
    def written(self) -> int:
        return self.size - len(self.rest)


class Journal:
    """The journal slots of replica `replica`: take a free one, write, read, clear.

    A slot whose plan failed to write stays taken until a background replay finishes
    it. While that replay keeps failing and every slot is held so, `take` raises the
    replay's last error instead of waiting for a slot that may never be freed.
    """

    def __init__(self, store: EmbeddingStore, *, replica: int, behind: int = 0) -> None:
        """`behind`: how many journals of rows written behind may stay until a flush
        (`service.row_flush_pushes`; 0 when the rows are written through): the slots are
        `JOURNAL_SLOTS` more."""
        slots = JOURNAL_SLOTS + behind
        if not 0 < slots <= MAX_JOURNAL_SLOTS:
            raise ValueError(f"a replica has 1 to {MAX_JOURNAL_SLOTS} journal slots, not {slots}")
        self.store = store
        self.replica = replica
        self.slots = slots
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(self.slots):
            self._free.put_nowait(slot)
        self._failing: dict[int, Callable[[], BaseException]] = {}  # slot -> error
        # slot -> chunks written in it since it was last cleared (which deletes them)
        self._chunks: dict[int, int] = {}

    def _id(self, slot: int, chunk: int | None = None) -> str:
        return journal_id(self.replica, slot, chunk)

    async def take(self) -> int:
        """A free journal slot. Raises the error of the failed writes when every slot is
        held by one: they wait for the store to recover, which may be never."""
        while True:
            if len(self._failing) >= self.slots:
                raise next(iter(self._failing.values()))()
            try:
                async with asyncio.timeout(0.5):  # then look again: a slot may have failed
                    return await self._free.get()
            except TimeoutError:
                continue

    def give_back(self, slot: int) -> None:
        self._free.put_nowait(slot)

    async def write_start(self, slot: int, tables: Sequence[GradTable]) -> JournalStart:
        """The first part of a push's journal: its tables' ids and summed gradients
        (chunks, unless small). Call as soon as the push is parsed; `write_end` finishes
        the journal. Until then no header names the chunks: a crash leaves nothing to
        replay. Every chunk write of a slot must be over before the slot is given back
        (a late one would tear the next journal in the slot)."""
        size = sum(ids.nbytes + grads.nbytes for _, ids, grads in tables)
        if size > _OFFLOAD_JOURNAL_BYTES:  # packing and the CRC would stall the loop
            body, crc = await asyncio.to_thread(_encoded_start, tables)
        else:
            body, crc = _encoded_start(tables)
        if len(body) <= _START_ALONE_BYTES:
            return JournalStart(chunks=0, crc32=0, rest=body, size=len(body))
        chunks = cut(body)
        await self._write_chunks(slot, 0, chunks)
        return JournalStart(chunks=len(chunks), crc32=crc, rest=b"", size=len(body))

    async def write_end(self, slot: int, start: JournalStart, plan: WritePlan) -> None:
        """The second part: the witnesses of `plan`'s updates (their tables in the order
        of `write_start`'s), its version and dense switch, then the header. From the
        header's write on the plan is journaled (a failure of that write may have stored
        it all the same)."""
        tail = start.rest + encode_end(plan)
        header: dict[str, Any] = {
            "format": START_END,
            "push_id": plan.push_id,
            "bytes": start.written + len(tail),
            "crc32": zlib.crc32(tail, start.crc32),
            "split": start.size,
            "time": time.time(),
        }
        if len(tail) <= JOURNAL_CHUNK_BYTES - _HEADER_ROOM:
            header.update(chunks=start.chunks, tail=tail)
        else:
            more = cut(tail)
            await self._write_chunks(slot, start.chunks, more)
            header["chunks"] = start.chunks + len(more)
        await self.write_header(slot, pack(header))

    async def _write_chunks(self, slot: int, first: int, chunks: Sequence[Wire]) -> None:
        if chunks:
            self._chunks[slot] = max(self._chunks.get(slot, 0), first + len(chunks))
            ids = [self._id(slot, first + i) for i in range(len(chunks))]
            await self.store.set_blobs(META_TABLE, ids, chunks, kind=Kind.JOURNAL)

    async def write(
        self,
        slot: int,
        plan: WritePlan,
        *,
        seq: int | None = None,
        step_slots: Mapping[str, int | None] | None = None,
    ) -> int:
        """A plan in the one-body format: chunks first, then the header (with a CRC-32 of
        the body). With `seq`, rows written behind (see the module's doc: gradients and
        steps where `step_slots` names a table's step column, else new values); without,
        the format of older services (for the tests of its replay). Returns the bytes
        written (the chunks' and the header's)."""
        chunks, header = encode_journal(plan, seq=seq, step_slots=step_slots)
        await self._write_chunks(slot, 0, chunks)
        await self.write_header(slot, header)
        return len(header) + sum(len(c) for c in chunks)

    async def write_header(self, slot: int, header: Wire) -> None:
        """The last write of a journal: from here on the plan is journaled (a failure of
        this write may have stored it all the same)."""
        await self.store.set_blobs(META_TABLE, [self._id(slot)], [header], kind=Kind.JOURNAL)

    async def clear(self, slot: int) -> None:
        await self.clear_many([slot])

    async def clear_many(self, slots: Sequence[int]) -> None:
        """Clear several slots: their headers in one request per node, then delete their
        chunks (a journal's chunks are as large as its push: left, they would hold its
        ids and gradients until the slot's next journal overwrote them). The header goes
        first, so no header ever names a deleted chunk."""
        if not slots:
            return
        ids = [self._id(slot) for slot in slots]
        await self.store.set_blobs(META_TABLE, ids, [b""] * len(ids), kind=Kind.JOURNAL)
        chunks = [
            self._id(slot, chunk) for slot in slots for chunk in range(self._chunks.get(slot, 0))
        ]
        if chunks:
            await self.store.delete_blobs(META_TABLE, chunks, kind=Kind.JOURNAL)
        for slot in slots:
            self._chunks.pop(slot, None)

    async def headers(self) -> list[bytes | None]:
        """The header of each of the `MAX_JOURNAL_SLOTS` slots (b"" or None: clear), in one
        request per node: what a restart reads, whatever the slots it had."""
        ids = [self._id(slot) for slot in range(MAX_JOURNAL_SLOTS)]
        return await self.store.get_blobs(META_TABLE, ids, kind=Kind.JOURNAL)

    async def read(self, slot: int, raw: bytes | None = None) -> WritePlan | None:
        """The plan journaled in `slot` (its header `raw` when read already), or None
        when the slot is clear.

        Raises:
            IncompleteJournalError: the header's body is not all there (a chunk is
                missing, or the checksum fails): its chunks were overwritten since.
            StorageFormatError: a journal format this version does not read.
        """
        if raw is None:
            (raw,) = await self.store.get_blobs(META_TABLE, [self._id(slot)], kind=Kind.JOURNAL)
        if not raw:
            return None
        header = unpack(raw)
        where = f"journal slot {slot} of replica {self.replica} (push {header.get('push_id')})"
        form = journal_format(header, where=where)
        push_id = header["push_id"]
        body = header.get("body")
        # a body in the header is one item with it, which memcached stores whole: it
        # needs no checksum (crc32 None; older journals carry one, still checked);
        # chunks joined always have one
        crc = header["crc32"]
        if body is None:
            count = int(header["chunks"])
            self._chunks[slot] = max(self._chunks.get(slot, 0), count)  # a clear deletes them
            ids = [self._id(slot, i) for i in range(count)]
            chunks = await self.store.get_blobs(META_TABLE, ids, kind=Kind.JOURNAL)
            if any(c is None for c in chunks):
                raise IncompleteJournalError(f"{where} is missing chunks", push_id)
            body = b"".join(c for c in chunks if c is not None) + header.get("tail", b"")
            if crc is None:
                raise IncompleteJournalError(f"{where} has chunks and no checksum", push_id)
        if len(body) != header["bytes"] or (crc is not None and zlib.crc32(body) != crc):
            raise IncompleteJournalError(f"{where} fails its checksum", push_id)
        if form == START_END:
            split = int(header["split"])
            return decode_parts(body[:split], body[split:], where=where)
        plan = decode_journal(body)
        if form == BEHIND:
            plan.journal_seq = int(header["seq"])
        return plan

    def finish_later(
        self,
        slot: int,
        plan: WritePlan,
        *,
        write: Callable[[WritePlan], Awaitable[None]],
        locks: RowLocks,
        keys: LockSet,
        keep: Callable[[int], None] | None = None,
    ) -> asyncio.Task[None]:
        """Replay a journaled push with `write` until it sticks; owns (and finally
        releases) `slot` and its row locks `keys`. `keep(slot)`: the journal stays (rows
        written behind: a flush clears it); called instead of clearing it, before the
        rows are unlocked.

        Once a replay has failed, pushes that need its rows (or a journal slot, when all
        are held so) fail fast with its last error rather than wait: see `RowLocks.fail`.
        """
        last: Exception | None = None

        def blocked() -> BaseException:
            return _held_by_failed_write(plan.push_id, last)

        async def finish() -> None:
            nonlocal last
            delay = 0.1
            kept = False
            try:
                while True:
                    try:
                        await write(plan)
                        if keep is not None:
                            keep(slot)
                            kept = True
                        else:
                            await self.clear(slot)
                        break
                    except Exception as exc:
                        first, last = last is None, exc
                        if first:  # the store still fails: stop others waiting for it
                            self._failing[slot] = blocked
                            await locks.fail(keys, blocked)
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
                if not kept:
                    self.give_back(slot)
                self._failing.pop(slot, None)
                await locks.release(keys)

        return asyncio.get_running_loop().create_task(finish())


class IncompleteJournalError(RuntimeError):
    """A journal header whose body is not all there any more.

    A header is written only over complete chunks, and a slot is reused only once its
    push is finished. So its push is done, and a later push in the same slot overwrote
    chunks after this header's clear had failed (then it has a done record), or the
    chunks were lost (they have no TTL; a flushed or restarted node is reported as data
    loss before this).
    """

    def __init__(self, message: str, push_id: str) -> None:
        super().__init__(message)
        self.push_id = push_id


def _held_by_failed_write(push_id: str, error: Exception | None) -> BaseException:
    """The error for a push that needs rows a failed, journaled push still holds: the
    same kind of error (so the service answers the same status and `type`), naming it."""
    message = (
        f"rows (or the dense parameters) of this push are held by push {push_id!r}, whose "
        f"write failed and is retried in the background until it succeeds: {error}"
    )
    if isinstance(error, DataLossError):
        return DataLossError(message, nodes=error.nodes)
    if isinstance(error, StoreError):
        return type(error)(message, node=error.node)
    return UnavailableError(message)


def _encoded_start(tables: Sequence[GradTable]) -> tuple[bytes, int]:
    body = encode_start(tables)
    return body, zlib.crc32(body)
