"""A journal's format: a push's write plan as msgpack bodies and headers, and back (pure).

Every header names its format (`format`); a header without one is of a format written
before the number existed, told by its shape (`journal_format`). The formats and why
each exists: docs/write-behind.md.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
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
from lookup_table.errors import StorageFormatError
from lookup_table.memcached.protocol import Wire
from optimizer_service.engine.plan import (
    DenseSwitch,
    TableRedo,
    TableStep,
    TableUpdate,
    WritePlan,
    stacked,
)

__all__ = [
    "BEHIND",
    "FORMATS",
    "JOURNAL_CHUNK_BYTES",
    "ONE_BODY",
    "START_END",
    "GradTable",
    "cut",
    "decode_journal",
    "decode_parts",
    "encode_end",
    "encode_journal",
    "encode_start",
    "journal_format",
]

# memcached's default item limit (-I) is 1 MiB, key and item header included
JOURNAL_CHUNK_BYTES = 1024 * 1024 - 8 * 1024

ONE_BODY = 1
"""Older services': one body whose tables carry their gradients with the hashes of the
items before the push (`old_hashes`) or of the new rows and slots (`row_hashes`, the
oldest), or their new values; the dense values inline or a switch of `current`."""
START_END = 2
"""A start (ids and gradients, `write_start`) and an end (change witnesses, version,
dense log), one body cut at `split`: rows written through."""
BEHIND = 3
"""One body of rows written behind, with `seq` in the header: each table's gradients
and steps before the push, or its new values (`encode_journal`)."""
FORMATS = {
    ONE_BODY: "one body, of older services",
    START_END: "a start and an end",
    BEHIND: "rows written behind",
}
"""Every journal format this version reads, by number."""

GradTable = tuple[str, IdArray, NDArray[np.float32]]
"""(table, unique ids (n,), summed gradients (n, dim)): what a journal's start holds."""


def journal_format(header: Mapping[str, Any], *, where: str = "a journal") -> int:
    """The format of the journal whose header is `header`: its `format`, or for a header
    without one (written before formats were numbered), the one its shape says.

    Raises:
        StorageFormatError: a format this version does not read (a newer service's).
    """
    number = header.get("format")
    if number is None:
        if "split" in header:
            return START_END
        return BEHIND if header.get("seq") is not None else ONE_BODY
    if isinstance(number, bool) or number not in FORMATS:
        known = ", ".join(f"{n} ({name})" for n, name in FORMATS.items())
        raise StorageFormatError(
            f"{where} is in journal format {number!r}, which this version does not read; "
            f"it reads formats {known}. A newer service wrote it: start that version until "
            f"it has replayed its journals, or restore a checkpoint "
            f"(lookup-table-checkpoint restore)"
        )
    return int(number)


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
    each table's own arrays would cost the replica a few small encodings and checks a
    push. A group with a row past the exact steps is journaled table by table."""
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
                "ids": encode_array(stacked([u.ids for u in members])),
                "grads": encode_array(stacked([u.grads for u in members if u.grads is not None])),
                "steps": encode_array(new_steps - np.float32(1)),
            }
        )
    return out


def cut(body: Wire) -> list[Wire]:
    """`body` in chunks of at most `JOURNAL_CHUNK_BYTES` (one memcached item each)."""
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
    """A plan in one body, as journal chunks (<= JOURNAL_CHUNK_BYTES) and its header
    (pure, thread-safe; `Journal.write`).

    A body that fits in one item travels inside the header: no chunks. With `seq`,
    format `BEHIND`: the tables are the plan's updates as `_encode_behind_all` writes
    them (`step_slots`: each table's step column, None or absent: its values; tables of
    one dim journaled by steps as one group). Without, format `ONE_BODY` as older
    services wrote it, unnumbered (for the tests of its replay): the plan's `steps` when
    it has them (with the hashes of the items before the push), else its updates: their
    new values (when they have no gradients), or their new values' hashes.
    """
    if seq is not None:
        tables = _encode_behind_all(plan.updates, step_slots or {})
    else:
        tables = [_encode_step(s) for s in plan.steps] or [_encode_update(u) for u in plan.updates]
    doc: dict[str, Any] = {"push_id": plan.push_id, "version": plan.version, "tables": tables}
    body = pack_view({**doc, **_dense_doc(plan)})
    header: dict[str, Any] = {"push_id": plan.push_id, "bytes": len(body), "time": time.time()}
    if seq is not None:
        header.update(format=BEHIND, seq=seq)
    if len(body) <= JOURNAL_CHUNK_BYTES:
        # one item, which memcached stores whole or not at all: no checksum to compute
        return [], pack_view({**header, "crc32": None, "chunks": 0, "body": body})
    chunks = cut(body)
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
