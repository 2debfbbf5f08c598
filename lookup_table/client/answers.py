"""What the replicas answer, decoded: a push's summary and streamed answer, the rows of
`POST /v1/rows`, dense parameters, and the store errors a replica reports, raised as
the store's own."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import numpy as np
from numpy.typing import NDArray

from lookup_table.core.rows import blocks
from lookup_table.core.segments import segment_bounds
from lookup_table.core.wire import decode_array, decode_ids, decode_rows
from lookup_table.errors import (
    CorruptValueError,
    DataLossError,
    LookupTableError,
    NodeUnavailableError,
    ProtocolError,
    StorageFormatError,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
)

__all__ = [
    "STORE_ERRORS",
    "RowGroup",
    "UpdatedRows",
    "created",
    "cut_group",
    "error_of",
    "merged_answer",
    "params_of",
    "rows_answer",
    "store_error",
    "two_part_answer",
    "updated_rows",
]


# The store errors a replica answers with (JSON `type`), re-raised here without retries.
STORE_ERRORS: dict[str, type[StoreError]] = {
    cls.__name__: cls
    for cls in (
        StoreError,
        StoreFullError,
        CorruptValueError,
        StorageFormatError,
        ProtocolError,
        NodeUnavailableError,
        StoreTimeoutError,
    )
}


def created(results: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Per table, the rows the replicas created applying a push or, in sync mode, the
    round it completed (ids that had no row, which the trainer read as new through their
    owner)."""
    out: dict[str, int] = {}
    for r in results:
        for table, n in r.get("created", {}).items():
            out[str(table)] = out.get(str(table), 0) + int(n)
    return out


def merged_answer(
    answers: Mapping[int, Mapping[str, Any]], asked: Sequence[str], *, copy: bool = True
) -> dict[str, Any]:
    """The replicas' answers to one push as one: `updated` rows, `params` (`copy`: see
    `params_of`), `dense_version`, and `stamps` (replica -> (epoch, seq) of the replicas
    that stamped their answer)."""
    out: dict[str, Any] = {}
    if "rows" in asked:
        out["updated"] = updated_rows([answers[k] for k in sorted(answers)])
    out["stamps"] = {
        k: (str(a["stamp"][0]), int(a["stamp"][1])) for k, a in answers.items() if "stamp" in a
    }
    first = answers.get(0, {})
    if "dense" in asked and "params" in first:
        out["params"] = params_of(first["params"], copy=copy)
        out["dense_version"] = int(first["dense_version"])
    return out


@dataclass(frozen=True, slots=True)
class RowGroup:
    """Tables whose rows an answer brought as one block: `ids[bounds[i]:bounds[i + 1]]`
    (sorted unique) and the same rows of `rows` are those of `tables[i]`."""

    tables: tuple[str, ...]
    bounds: NDArray[np.int64]
    ids: NDArray[np.int64]
    rows: NDArray[np.float32]


class UpdatedRows(dict[str, tuple[Any, Any]]):
    """Per table, (unique ids sorted, rows); `groups`, the tables among them whose entries
    are the consecutive parts of one block (`RowGroup`), for whoever takes them all."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[RowGroup] = []


def updated_rows(results: Sequence[Mapping[str, Any]]) -> UpdatedRows:
    """Per table, (unique ids sorted, rows) from every replica's `updated` answer (and
    `updated_groups`: tables that came grouped, their rows as one array)."""
    parts: dict[str, list[tuple[Any, NDArray[np.float32]]]] = {}
    blocks: list[RowGroup] = []
    for r in results:
        for i, group in enumerate(r.get("updated_groups", [])):
            where = f"updated_groups[{i}]"
            ids = decode_ids(group["ids"], field=f"{where}.ids")
            rows = decode_rows(group, field=where)
            cut = cut_group(group["tables"], group["counts"], [ids, rows], where)
            for name, (table_ids, table_rows) in cut:
                parts.setdefault(name, []).append((table_ids, table_rows))
            if len(results) == 1 and ids.dtype == np.int64:
                bounds = segment_bounds(group["counts"])
                blocks.append(RowGroup(tuple(n for n, _ in cut), bounds, ids, rows))
        for name, doc in r.get("updated", {}).items():
            ids = decode_ids(doc["ids"], field=f"updated.{name}.ids")
            rows = decode_rows(doc, field=f"updated.{name}")
            parts.setdefault(name, []).append((ids, rows))
    out = UpdatedRows()
    for block in blocks:  # one replica's: sorted already, checked for all its tables at once
        if _each_sorted(block) and all(len(parts[name]) == 1 for name in block.tables):
            for name in block.tables:
                out[name] = parts.pop(name)[0]
            out.groups.append(block)
    for name, got in parts.items():
        if len(got) == 1:
            ids, rows = got[0]
            if ids.dtype == np.int64 and bool((ids[1:] > ids[:-1]).all()):
                out[name] = (ids, rows)  # one replica's: sorted already
                continue
        else:
            ids = np.concatenate([i for i, _ in got])
            rows = np.concatenate([r for _, r in got])
        order = np.argsort(ids, kind="stable")
        out[name] = (ids[order], rows[order])
    return out


def _each_sorted(group: RowGroup) -> bool:
    """Whether each table's ids in `group` are strictly increasing."""
    ids, inner = group.ids, group.bounds[1:-1]
    rising = ids[1:] > ids[:-1]
    rising[inner[(inner > 0) & (inner < ids.shape[0])] - 1] = True  # a table's first id
    return bool(rising.all())


def cut_group(
    names: Any, counts: Any, arrays: Sequence[NDArray[Any]], where: str
) -> list[tuple[str, list[NDArray[Any]]]]:
    """Each table of a group in an answer with its block of each of the group's `arrays`
    (`rows.blocks`); LookupTableError where the tables and counts do not fit them."""
    total = arrays[0].shape[0]
    if (
        not isinstance(names, list)
        or not isinstance(counts, list)
        or len(names) != len(counts)
        or not all(isinstance(c, int) and c >= 0 for c in counts)
        or sum(counts) != total
        or any(a.shape[0] != total for a in arrays)
    ):
        raise LookupTableError(
            f"{where}: tables {names!r} with counts {counts!r} do not fit its {total} rows"
        )
    cut = [blocks(a, counts) for a in arrays]
    return [(str(n), [c[k] for c in cut]) for k, n in enumerate(names)]


def rows_answer(
    doc: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], replica: int
) -> dict[str, tuple[NDArray[np.float32], int]]:
    """Per table, (rows, how many had no row) from one replica's `POST /v1/rows` answer,
    the tables of the request's `groups` taken from its `groups` (one array each)."""
    out: dict[str, tuple[NDArray[np.float32], int]] = {}
    answered = doc.get("groups", [])
    if len(answered) != len(groups):
        raise LookupTableError(
            f"replica {replica} answered {len(answered)} groups of rows for {len(groups)}"
        )
    for i, (sent, got) in enumerate(zip(groups, answered, strict=True)):
        where = f"groups[{i}]"
        rows = decode_rows(got, field=where)
        new = got["new"]
        if not isinstance(new, list) or len(new) != len(sent["tables"]):
            raise LookupTableError(
                f"replica {replica} answered {where}.new {new!r} for tables {sent['tables']!r}"
            )
        for (name, (table_rows,)), fresh in zip(
            cut_group(sent["tables"], sent["counts"], [rows], where), new, strict=True
        ):
            out[name] = (table_rows, int(fresh))
    row_dtypes = doc.get("row_dtypes", {})
    for name, value in doc["rows"].items():
        alone = {"rows": value}
        if name in row_dtypes:  # a 16-bit table's words
            alone["row_dtype"] = row_dtypes[name]
        got = decode_rows(alone, field=f"rows.{name}")
        out[name] = (got, int(doc["new"][name]))
    return out


async def two_part_answer(
    resp: aiohttp.ClientResponse,
    first: Callable[[dict[str, Any]], None],
    then: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Read a streamed answer: hand its first map to `first` on arrival (and, with `then`,
    the second to `then`: a push's `read`), return the last: the outcome. A middle map
    that is an error (`{error, status, ...}`) is returned as the outcome. A reply cut
    before its last map raises ClientPayloadError (the push is retried)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True)
    parts = 2 if then is None else 3
    docs: list[Any] = []
    async for chunk in resp.content.iter_any():
        unpacker.feed(chunk)
        for doc in unpacker:
            if not isinstance(doc, dict):
                raise aiohttp.ClientPayloadError(f"expected msgpack maps, got {type(doc).__name__}")
            docs.append(doc)
            if len(docs) == 1:
                first(doc)
            elif len(docs) == 2 and then is not None:
                if "error" in doc:
                    return dict(doc)
                then(doc)
    if len(docs) != parts:
        raise aiohttp.ClientPayloadError(f"the answer was cut after {len(docs)} of {parts} maps")
    outcome: dict[str, Any] = docs[-1]
    return outcome


def params_of(doc: Mapping[str, Any], *, copy: bool = True) -> dict[str, NDArray[np.float32]]:
    """Dense parameters by name: writable copies, or (`copy=False`) read-only views of
    the answer's bytes, for a reader that copies them anyway (an assign to variables)."""
    return {
        n: _copied(decode_array(v, field=f"params.{n}", dtype="<f4"), copy) for n, v in doc.items()
    }


def _copied(array: NDArray[Any], copy: bool) -> NDArray[Any]:
    return array.copy() if copy else array


def error_of(raw: bytes, status: int) -> tuple[str, dict[str, Any]]:
    """The message and the whole document of a JSON error body (or its first bytes)."""
    try:
        doc = json.loads(raw)
        return str(doc.get("error", doc)), doc
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace") or f"HTTP {status}", {}


def store_error(doc: Mapping[str, Any], message: str) -> LookupTableError | None:
    """The store error a replica answered with (its `type`, `node`, `nodes`), if any."""
    kind = doc.get("type")
    if kind == "DataLossError":
        nodes = doc.get("nodes")
        return DataLossError(
            message, nodes=tuple(str(n) for n in nodes) if isinstance(nodes, list) else ()
        )
    cls = STORE_ERRORS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return None
    node = doc.get("node")
    return cls(message, node=node if isinstance(node, str) else None)
