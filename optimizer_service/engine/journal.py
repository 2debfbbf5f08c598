"""The journal of one replica: a push's write plan, stored before its rows are written.

A replica has `JOURNAL_SLOTS` slots (`_meta/j/rK-jS`) when it writes its rows through,
`service.row_flush_pushes` + `JOURNAL_SLOTS` when it writes them behind; a restart reads
all `MAX_JOURNAL_SLOTS`. A slot holds one push, packed with msgpack in two parts, one body:

1. the *start* (`write_start`): each table's ids and summed gradients, written as soon as
   the push is parsed, while its rows are read; cut into chunks of at most
   `JOURNAL_CHUNK_BYTES` (under memcached's default 1 MiB item limit), or carried to the
   header when small;
2. the *end* (`write_end`), once the optimizer has computed the new values: each table's
   change witnesses (`plan.TableUpdate.witness`), the version and the dense switch, then
   the header with the body's size, CRC-32 and where the end starts (`split`), carrying
   the body's last part (`tail`) when it fits.

A header is only ever written over a complete journal: every chunk first. A cleared slot
is an empty header. Journals of older services (one body: the tables with `old_hashes`,
or the new values' hashes, or the values; inside the header as `body` when it fits) are
still read, and `write` still writes them (for the tests of their replay).

Rows written behind (`service.row_flush_pushes` > 1) are journaled in the one-body
format instead (`write` with `seq`, a per-replica sequence number, in the header). Such a
journal stays until a flush of the rows covers it, done record or not; a restart replays
every one, in `seq` order, before it serves. Per table it keeps (`_encode_behind`):

* for an optimizer that counts a row's steps (Adam: `optimizers.step_slot`), the push's
  summed gradients and each row's step before the push. A replay reads the rows from
  memcached and applies the journals in order to the rows whose step is the journaled
  one; a row with a later step was written by a flush after that push (`Recovery.restep`);
* otherwise (SGD, Adagrad, or a row past float32's exact steps) the new values: the
  newest wins.

The tables journaled by steps that have int ids and the same dim are one entry, their
arrays concatenated (`_encode_behind_all`): a push touches every table of a model.

Memcached holds a row written behind from some flush, of any push: the flush may have
been cut short, and the journals of the pushes before it are not cleared yet. The steps
tell exactly which of those pushes each row has had, where values would have to be
written again in full (three times the bytes for Adam: 16 + 33 floats a dim-16 row
instead of 16 + 1).

A plan whose write failed after it was journaled is replayed from here: in the
background while the replica lives (`Journal.finish_later`), or by the next replica
before it serves (`Updater.recover`).

A dense update is journaled as `dense_log: true`: its gradients are in the dense log of
the plan's version (`engine.dense`), written before the journal header. Journals
of older services carry the switch of `current` to a generation written before them
(`dense_switch`) or the dense values inline (`dense`): they still decode, and their
replay switches `current` or writes the values as a new generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
from lookup_table.core.keyspace import META_TABLE, Kind, journal_id
from lookup_table.core.optimizers import MAX_EXACT_STEP
from lookup_table.core.rows import blocks, value_hashes
from lookup_table.core.wire import (
    decode_array,
    decode_ids,
    encode_array,
    encode_ids,
    pack,
    pack_view,
    unpack,
)
from lookup_table.errors import DataLossError, StoreError
from lookup_table.memcached.protocol import Wire
from lookup_table.store import EmbeddingStore
from optimizer_service.engine.locks import LockSet, RowLocks
from optimizer_service.engine.plan import DenseSwitch, TableRedo, TableStep, TableUpdate, WritePlan
from optimizer_service.errors import UnavailableError

__all__ = [
    "JOURNAL_CHUNK_BYTES",
    "JOURNAL_SLOTS",
    "MAX_JOURNAL_SLOTS",
    "IncompleteJournalError",
    "Journal",
    "JournalStart",
    "decode_journal",
    "decode_parts",
    "encode_end",
    "encode_journal",
    "encode_start",
]

logger = logging.getLogger(__name__)

JOURNAL_SLOTS = 8
MAX_JOURNAL_SLOTS = 64  # config.MAX_ROW_FLUSH_PUSHES + JOURNAL_SLOTS
# memcached's default item limit (-I) is 1 MiB, key and item header included
JOURNAL_CHUNK_BYTES = 1024 * 1024 - 8 * 1024
# Above this many bytes of ids and gradients, a journal's start is encoded in a thread:
# its packing and CRC then take a few ms, which the loop spends on other work. Below, a
# thread's handoff and GIL contention cost more than they free.
_OFFLOAD_JOURNAL_BYTES = 2 << 20
# A start smaller than this is not written by itself: it goes with the end, in the header
# (one `set` for a small push), when the two fit in one item.
_START_ALONE_BYTES = 64 << 10
_HEADER_ROOM = 1024  # the header's own fields, besides the tail it carries

GradTable = tuple[str, IdArray, NDArray[np.float32]]
"""(table, unique ids (n,), summed gradients (n, dim)): what a journal's start holds."""


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
        chunks = _cut(body)
        await self._write_chunks(slot, 0, chunks)
        return JournalStart(chunks=len(chunks), crc32=crc, rest=b"", size=len(body))

    async def write_end(self, slot: int, start: JournalStart, plan: WritePlan) -> None:
        """The second part: the witnesses of `plan`'s updates (their tables in the order
        of `write_start`'s), its version and dense switch, then the header. From the
        header's write on the plan is journaled (a failure of that write may have stored
        it all the same)."""
        tail = start.rest + encode_end(plan)
        header: dict[str, Any] = {
            "push_id": plan.push_id,
            "bytes": start.written + len(tail),
            "crc32": zlib.crc32(tail, start.crc32),
            "split": start.size,
            "time": time.time(),
        }
        if len(tail) <= JOURNAL_CHUNK_BYTES - _HEADER_ROOM:
            header.update(chunks=start.chunks, tail=tail)
        else:
            more = _cut(tail)
            await self._write_chunks(slot, start.chunks, more)
            header["chunks"] = start.chunks + len(more)
        await self.write_header(slot, pack(header))

    async def _write_chunks(self, slot: int, first: int, chunks: Sequence[Wire]) -> None:
        if chunks:
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
        await self.store.set_blobs(META_TABLE, [self._id(slot)], [b""], kind=Kind.JOURNAL)

    async def clear_many(self, slots: Sequence[int]) -> None:
        """Clear several slots in one request per node."""
        if slots:
            ids = [self._id(slot) for slot in slots]
            await self.store.set_blobs(META_TABLE, ids, [b""] * len(ids), kind=Kind.JOURNAL)

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
        """
        if raw is None:
            (raw,) = await self.store.get_blobs(META_TABLE, [self._id(slot)], kind=Kind.JOURNAL)
        if not raw:
            return None
        header = unpack(raw)
        push_id = header["push_id"]
        where = f"journal slot {slot} of replica {self.replica} (push {push_id})"
        body = header.get("body")
        # a body in the header is one item with it, which memcached stores whole: it
        # needs no checksum (crc32 None; older journals carry one, still checked);
        # chunks joined always have one
        crc = header["crc32"]
        if body is None:
            ids = [self._id(slot, i) for i in range(int(header["chunks"]))]
            chunks = await self.store.get_blobs(META_TABLE, ids, kind=Kind.JOURNAL)
            if any(c is None for c in chunks):
                raise IncompleteJournalError(f"{where} is missing chunks", push_id)
            body = b"".join(c for c in chunks if c is not None) + header.get("tail", b"")
            if crc is None:
                raise IncompleteJournalError(f"{where} has chunks and no checksum", push_id)
        if len(body) != header["bytes"] or (crc is not None and zlib.crc32(body) != crc):
            raise IncompleteJournalError(f"{where} fails its checksum", push_id)
        if "split" in header:  # a start and an end
            split = int(header["split"])
            return decode_parts(body[:split], body[split:], where=where)
        plan = decode_journal(body)
        if header.get("seq") is not None:  # values written behind
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


def _encode_step(s: TableStep) -> dict[str, Any]:
    return {
        "table": s.table,
        "ids": encode_ids(s.ids),
        "grads": encode_array(s.grads),
        "old_hashes": encode_array(value_hashes(s.rows, s.slots).view(np.int64)),
    }


def _encode_values(u: TableUpdate) -> dict[str, Any]:
    """A table's new values: replayed by writing them (the newest wins)."""
    return {
        "table": u.table,
        "ids": encode_ids(u.ids),
        "rows": encode_array(u.rows),
        "slots": encode_array(u.slots),
    }


def _encode_update(u: TableUpdate) -> dict[str, Any]:
    if u.grads is None:  # absolute values (journals of an older service; tests)
        return _encode_values(u)
    return {
        "table": u.table,
        "ids": encode_ids(u.ids),
        "grads": encode_array(u.grads),
        "row_hashes": encode_array(value_hashes(u.rows).view(np.int64)),
        "slot_hashes": encode_array(value_hashes(u.slots).view(np.int64)),
    }


def _exact_steps(new_steps: NDArray[np.float32]) -> bool:
    """Whether steps after a push can be journaled as steps: each at least 1 and exact in
    float32 (at most `MAX_EXACT_STEP`)."""
    return bool((new_steps <= MAX_EXACT_STEP).all()) and bool((new_steps >= 1).all())


def _encode_behind(u: TableUpdate, step_slot: int | None) -> dict[str, Any]:
    """A table of a journal of rows written behind: its gradients and each row's step
    before the push (`steps`) when its optimizer counts steps (`step_slot`) and every new
    step is exact (at most `MAX_EXACT_STEP`); else its new values. The steps say at a
    replay which rows memcached holds from before the push (their step is the journaled
    one: the push is applied again), and which from after it (a flush wrote them since:
    skipped). A third as many bytes as the values for Adam (dim 16: 16 + 1 floats a
    row instead of 16 + 33)."""
    if step_slot is not None and u.grads is not None and u.ids.shape[0]:
        new_steps = u.slots[:, step_slot]
        if _exact_steps(new_steps):
            return {
                "table": u.table,
                "ids": encode_ids(u.ids),
                "grads": encode_array(u.grads),
                "steps": encode_array(new_steps - np.float32(1)),
            }
    return _encode_values(u)


def _encode_behind_all(
    updates: Sequence[TableUpdate], step_slots: Mapping[str, int | None]
) -> list[dict[str, Any]]:
    """The tables of a journal of rows written behind, as `_encode_behind` keeps them,
    with the tables journaled by steps that have int ids grouped by (dim, step column):
    one entry `{group: [table], counts: [ids of each], ids, grads, steps}`, each array
    the tables' concatenated in that order. A push touches every table of a model, and
    each table's own arrays cost the replica ~4 small encodings and checks a push (26
    tables: ~0.7 ms of its CPU a step, against ~0.1 ms for the same rows as one table).
    A group with a row past the exact steps is journaled table by table."""
    # a group (its step column, its tables) at its first table's place
    entries: list[TableUpdate | tuple[int, list[TableUpdate]]] = []
    groups: dict[tuple[int, int], list[TableUpdate]] = {}
    for u in updates:
        column = step_slots.get(u.table)
        if (
            column is None
            or u.grads is None
            or not u.ids.shape[0]
            or not isinstance(u.ids, np.ndarray)
            or u.ids.dtype.kind not in "iu"
        ):
            entries.append(u)
        elif (u.grads.shape[1], column) in groups:
            groups[u.grads.shape[1], column].append(u)
        else:
            entries.append((column, groups.setdefault((u.grads.shape[1], column), [u])))
    out: list[dict[str, Any]] = []
    for entry in entries:
        if isinstance(entry, TableUpdate):
            out.append(_encode_behind(entry, step_slots.get(entry.table)))
            continue
        column, members = entry
        new_steps = np.concatenate([u.slots[:, column] for u in members])
        if not _exact_steps(new_steps):
            out.extend(_encode_behind(u, column) for u in members)
            continue
        out.append(
            {
                "group": [u.table for u in members],
                "counts": [int(u.ids.shape[0]) for u in members],
                "ids": encode_array(np.concatenate([u.ids for u in members])),
                "grads": encode_array(np.concatenate([u.grads for u in members])),
                "steps": encode_array(new_steps - np.float32(1)),
            }
        )
    return out


def _cut(body: Wire) -> list[Wire]:
    return [body[i : i + JOURNAL_CHUNK_BYTES] for i in range(0, len(body), JOURNAL_CHUNK_BYTES)]


def encode_start(tables: Sequence[GradTable]) -> bytes:
    """A journal's start (pure, thread-safe): msgpack `{tables: [{table, ids, grads}]}`."""
    return pack(
        {
            "tables": [
                {"table": name, "ids": encode_ids(ids), "grads": encode_array(grads)}
                for name, ids, grads in tables
            ]
        }
    )


def _encoded_start(tables: Sequence[GradTable]) -> tuple[bytes, int]:
    body = encode_start(tables)
    return body, zlib.crc32(body)


def encode_end(plan: WritePlan) -> bytes:
    """A journal's end (pure): msgpack `{push_id, version, tables: [{table, witness}],
    dense_log}`, the tables those of the start, in its order.

    Raises:
        ValueError: an update without its witness (a bug: the updater computes them).
    """
    tables = []
    for u in plan.updates:
        if u.witness is None:
            raise ValueError(f"the update of table {u.table!r} has no change witness")
        tables.append({"table": u.table, "witness": encode_array(u.witness)})
    return pack(
        {"push_id": plan.push_id, "version": plan.version, "tables": tables, **_dense_doc(plan)}
    )


def _dense_doc(plan: WritePlan) -> dict[str, Any]:
    if plan.dense_logged:  # the gradients are in the dense log of `version`
        return {"dense_log": True}
    if plan.dense_switch is not None:
        return {
            "dense_switch": {
                "current": plan.dense_switch.current,
                "previous": plan.dense_switch.previous,
            }
        }
    if plan.dense is not None:  # no generation written for it: carry the values
        params, slots = plan.dense
        return {
            "dense": {
                "params": {n: encode_array(v) for n, v in params.items()},
                "slots": {n: encode_array(v) for n, v in slots.items()},
            }
        }
    return {}


def encode_journal(
    plan: WritePlan,
    *,
    seq: int | None = None,
    step_slots: Mapping[str, int | None] | None = None,
) -> tuple[list[Wire], Wire]:
    """A plan in the one-body format, as journal chunks (<= JOURNAL_CHUNK_BYTES) and its
    header (pure, thread-safe; `Journal.write`).

    A body that fits in one item travels inside the header: no chunks. With `seq` (rows
    written behind, `seq` in the header) the tables are the plan's updates as
    `_encode_behind_all` writes them (`step_slots`: each table's step column, None or
    absent: its values; tables of one dim journaled by steps as one group). Without,
    the formats of older services: the plan's `steps` when it has them (with the hashes
    of the items before the push), else its updates: their new values (when they have
    no gradients), or their new values' hashes (the oldest format).
    """
    if seq is not None:
        tables = _encode_behind_all(plan.updates, step_slots or {})
    else:
        tables = [_encode_step(s) for s in plan.steps] or [_encode_update(u) for u in plan.updates]
    doc: dict[str, Any] = {"push_id": plan.push_id, "version": plan.version, "tables": tables}
    body = pack_view({**doc, **_dense_doc(plan)})
    header: dict[str, Any] = {"push_id": plan.push_id, "bytes": len(body), "time": time.time()}
    if seq is not None:
        header["seq"] = seq
    if len(body) <= JOURNAL_CHUNK_BYTES:
        # one item, which memcached stores whole or not at all: no checksum to compute
        # (~0.15 ms a push of the demo's ~0.5 MB)
        return [], pack_view({**header, "crc32": None, "chunks": 0, "body": body})
    chunks = _cut(body)
    return chunks, pack({**header, "crc32": zlib.crc32(body), "chunks": len(chunks)})


def _decode_table(t: dict[str, Any]) -> TableUpdate | TableRedo:
    ids = decode_ids(t["ids"], field="journal.ids")
    if "grads" not in t:
        return TableUpdate(
            table=t["table"],
            ids=ids,
            rows=decode_array(t["rows"], field="journal.rows").copy(),
            slots=decode_array(t["slots"], field="journal.slots").copy(),
        )
    grads = decode_array(t["grads"], field="journal.grads").copy()
    if "steps" in t:  # rows written behind: each row's step before the push
        steps = decode_array(t["steps"], field="journal.steps", dtype="<f4").copy()
        if steps.shape != ids.shape[:1] or grads.shape[:1] != ids.shape[:1]:
            raise ValueError(
                f"journal: table {t['table']!r} has {ids.shape[0]} ids, {grads.shape[0]} "
                f"gradient rows and {steps.shape[0]} steps"
            )
        return TableRedo(table=t["table"], ids=ids, grads=grads, steps=steps)
    if "old_hashes" in t:
        old = decode_array(t["old_hashes"], field="journal.old_hashes").view(np.uint64)
        return TableRedo(table=t["table"], ids=ids, grads=grads, old_hashes=old)
    return TableRedo(  # a journal of an older service: the new values' hashes
        table=t["table"],
        ids=ids,
        grads=grads,
        row_hashes=decode_array(t["row_hashes"], field="journal.row_hashes").view(np.uint64),
        slot_hashes=decode_array(t["slot_hashes"], field="journal.slot_hashes").view(np.uint64),
    )


def _decode_group(t: dict[str, Any]) -> list[TableRedo]:
    """The tables of a group of a journal written behind (`_encode_behind_all`)."""
    names, counts = list(t["group"]), [int(n) for n in t["counts"]]
    ids = decode_array(t["ids"], field="journal.ids", dtype="<i8", ndim=1)
    grads = decode_array(t["grads"], field="journal.grads", dtype="<f4", ndim=2).copy()
    steps = decode_array(t["steps"], field="journal.steps", dtype="<f4", ndim=1).copy()
    n = sum(counts)
    if len(names) != len(counts) or not ids.shape[0] == grads.shape[0] == steps.shape[0] == n:
        raise ValueError(
            f"journal: a group of tables {names} with counts {counts} has {ids.shape[0]} ids, "
            f"{grads.shape[0]} gradient rows and {steps.shape[0]} steps"
        )
    return [
        TableRedo(table=name, ids=i.copy(), grads=g, steps=s)
        for name, i, g, s in zip(
            names, blocks(ids, counts), blocks(grads, counts), blocks(steps, counts), strict=True
        )
    ]


def decode_journal(body: bytes) -> WritePlan:
    """The plan of a one-body journal (older services) whose size and checksum were
    checked (pure)."""
    doc = unpack(body)
    tables: list[TableUpdate | TableRedo] = []
    for t in doc["tables"]:
        if "group" in t:
            tables.extend(_decode_group(t))
        else:
            tables.append(_decode_table(t))
    return _plan_of(
        doc,
        updates=[t for t in tables if isinstance(t, TableUpdate)],
        redo=[t for t in tables if isinstance(t, TableRedo)],
    )


def decode_parts(start: bytes, end: bytes, *, where: str = "a journal") -> WritePlan:
    """The plan of a journal's start and end whose size and checksum were checked (pure).

    Raises:
        ValueError: the end's tables are not the start's, or a witness count is not the
            table's id count (a bug, not a torn journal: the checksum held).
    """
    first, last = unpack(start), unpack(end)
    redo = []
    names = [t["table"] for t in first["tables"]]
    if [t["table"] for t in last["tables"]] != names:
        raise ValueError(
            f"{where}: its end has tables {[t['table'] for t in last['tables']]}, its start {names}"
        )
    for t, w in zip(first["tables"], last["tables"], strict=True):
        ids = decode_ids(t["ids"], field="journal.ids")
        witness = decode_array(w["witness"], field="journal.witness", dtype="<i8")
        if witness.shape != ids.shape[:1]:
            raise ValueError(
                f"{where}: table {t['table']!r} has {ids.shape[0]} ids and {witness.shape[0]} "
                f"witnesses"
            )
        redo.append(
            TableRedo(
                table=t["table"],
                ids=ids,
                grads=decode_array(t["grads"], field="journal.grads").copy(),
                witness=witness.copy(),
            )
        )
    return _plan_of(last, updates=[], redo=redo)


def _plan_of(
    doc: dict[str, Any], *, updates: list[TableUpdate], redo: list[TableRedo]
) -> WritePlan:
    switch = None
    if doc.get("dense_switch") is not None:
        switch = DenseSwitch(
            current=dict(doc["dense_switch"]["current"]),
            previous=None
            if doc["dense_switch"]["previous"] is None
            else dict(doc["dense_switch"]["previous"]),
        )
    dense = None
    if doc.get("dense") is not None:  # a journal of an older service: the values inline
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
    return WritePlan(
        push_id=str(doc["push_id"]),
        updates=updates,
        redo=redo,
        version=doc.get("version"),
        dense=dense,
        dense_switch=switch,
        dense_logged=bool(doc.get("dense_log", False)),
    )
