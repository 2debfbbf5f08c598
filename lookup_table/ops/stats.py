"""`lookup-table-admin stats`: keys and bytes per table and kind, per node and in total.

The namespace's keys come from memcached's `lru_crawler metadump hash` (as a checkpoint
lists them) and their bytes from the dump's own item sizes, so they add up to `stats
bytes`; the per-node figures are the whole node's. A node that does not answer is DOWN,
a missing sentinel is flagged. docs/operations.md#inspecting-a-namespace shows the output.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig, NodeSpec
from lookup_table.core.keys import MAX_KIND_BYTES, MAX_NAME_BYTES
from lookup_table.core.keyspace import DENSE_TABLE, META_TABLE, Kind, sentinel_key
from lookup_table.core.optimizers import make_optimizer, slot_width
from lookup_table.core.optimizers.layout import value_bytes
from lookup_table.errors import ConfigError, LookupTableError, NodeUnavailableError, StoreError
from lookup_table.memcached import commands
from lookup_table.ops.metadump import (
    LABEL_BYTES,
    SEP,
    metadump_key,
    metadump_prefix,
    namespace_lines,
    void_rows,
)
from lookup_table.store import EmbeddingStore

__all__ = [
    "KIND_NAMES",
    "UNPARSED",
    "node_stats",
    "only_tables",
    "render_stats",
    "summarize_metadump",
    "table_stats",
]

logger = logging.getLogger(__name__)

KIND_NAMES = {str(kind): kind.label for kind in Kind}
"""What each key kind holds (core/keyspace.py); another kind is shown as `kind_<tag>`."""
UNPARSED = ("(unparsed)", "?")
"""The (table, kind) of namespace keys the key codec did not write."""

_SIZE_FIELD = b" size="
_SIZE_DIGITS = 12
_BLOCK_LINES = 1 << 18  # lines summarized per numpy block (bounds the window matrices)
_NODES_AT_ONCE = 4  # key listings held in memory at once (~100 bytes per key each)


# ================================================================ whole nodes


async def node_stats(config: ClusterConfig) -> dict[str, dict[str, float | int | str | bool]]:
    """Per node: items, bytes, memory limit, fill ratio, evictions, sentinel present.

    Quick (no key listing); raises when a node does not answer. `table_stats`
    has the per-table figures and reports a node that is down instead.
    """
    async with EmbeddingStore(config, check_sentinels=False) as store:
        stats = await store.stats()
        sentinels = await store.sentinels()
    out: dict[str, dict[str, float | int | str | bool]] = {}
    for node, s in stats.items():
        used, limit = int(s.get("bytes", 0)), int(s.get("limit_maxbytes", 1))
        out[node] = {
            "version": s.get("version", "?"),
            "curr_items": int(s.get("curr_items", 0)),
            "bytes": used,
            "limit_maxbytes": limit,
            "fill_ratio": used / limit if limit else 0.0,
            "evictions": int(s.get("evictions", 0)),
            "sentinel": sentinels[node] is not None,
        }
    return out


# ================================================================ pure: a metadump, summed


def _windows(arr: NDArray[np.uint8], at: NDArray[np.int64], width: int) -> NDArray[np.uint8]:
    """`arr[at[i] : at[i] + width]` for every i, (n, width); zeros past the end of `arr`."""
    out = np.zeros((at.shape[0], width), dtype=np.uint8)
    if arr.shape[0] >= width:
        fits = at <= arr.shape[0] - width
        out[fits] = np.lib.stride_tricks.sliding_window_view(arr, width)[at[fits]]
    else:
        fits = np.zeros(at.shape[0], dtype=bool)
    for i in np.flatnonzero(~fits).tolist():  # the last line or two of the reply only
        part = arr[at[i] : at[i] + width]
        out[i, : part.shape[0]] = part
    return out


def _size_field(text: bytes) -> int | None:
    """The value of ` size=N` in one metadump line, or None."""
    at = text.find(_SIZE_FIELD)
    if at < 0:
        return None
    digits = text[at + len(_SIZE_FIELD) :].split(b" ", 1)[0]
    return int(digits) if digits.isdigit() else None


def _item_sizes(
    arr: NDArray[np.uint8], starts: NDArray[np.int64], ends: NDArray[np.int64], node: str
) -> NDArray[np.int64]:
    """The `size=` field of each line (memcached's item size in bytes), int64 (n,).

    memcached 1.6 writes it last (`... cls=3 size=152\\n`): it is read right-aligned
    from the line's end with numpy. A line where it is not last (another version)
    is searched on its own.
    """
    n = starts.shape[0]
    rows = np.arange(n)
    width = len(_SIZE_FIELD) + _SIZE_DIGITS
    window = _windows(arr, np.maximum(ends - width, 0), width)
    digits = window[:, len(_SIZE_FIELD) :] - ord("0")
    is_digit = digits <= 9  # uint8: bytes below "0" wrap around to large values
    length = np.argmin(is_digit[:, ::-1], axis=1)  # trailing digits
    ok = (length >= 1) & (ends - starts > width)
    field = window[rows[:, None], _SIZE_DIGITS - length[:, None] + np.arange(len(_SIZE_FIELD))]
    ok &= (field == np.frombuffer(_SIZE_FIELD, dtype=np.uint8)).all(axis=1)
    scale = 10 ** np.arange(_SIZE_DIGITS - 1, -1, -1, dtype=np.int64)
    used = np.arange(_SIZE_DIGITS) >= _SIZE_DIGITS - length[:, None]
    sizes: NDArray[np.int64] = (np.where(used, digits, 0).astype(np.int64) * scale).sum(axis=1)
    for i in np.flatnonzero(~ok).tolist():
        text = arr[starts[i] : ends[i]].tobytes()
        size = _size_field(text)
        if size is None:
            raise StoreError(
                f"memcached node {node} listed {text[:160]!r} without a `size=` field in "
                f"`lru_crawler metadump`; is it memcached 1.5.3 or later?",
                node=node,
            )
        sizes[i] = size
    return sizes


def _labels(
    arr: NDArray[np.uint8],
    after: NDArray[np.int64],
    ends: NDArray[np.int64],
    names: Sequence[str],
) -> tuple[NDArray[np.int64], NDArray[np.int64], dict[int, str]]:
    """(table code, kind code) of each line whose key starts at `after` (past the namespace).

    A key is `{table}%2F{kind}%2F{body}` there. The kind code packs its 1-4 bytes
    into an integer; the table code is the index in `names`, or a new index for
    a table not in `names` (returned in the dict), or -1 for a key the key codec
    did not write (the kind code is then -1 too).
    """
    n = after.shape[0]
    rows = np.arange(n)
    w = _windows(arr, after, LABEL_BYTES)
    percent = w == ord("%")
    t = np.argmax(percent, axis=1)  # the end of the table name
    ok = percent.any(axis=1) & (t >= 1) & (t <= MAX_NAME_BYTES)
    t = np.where(ok, t, 0)
    for j in range(3):
        ok &= w[rows, t + j] == SEP[j]
    kind = w[rows[:, None], t[:, None] + 3 + np.arange(MAX_KIND_BYTES + 3)]
    k = np.argmax(kind == ord("%"), axis=1)  # the kind's length
    ok &= (k >= 1) & (k <= MAX_KIND_BYTES) & (kind == ord("%")).any(axis=1)
    k = np.where(ok, k, 1)
    for j in range(3):
        ok &= kind[rows, k + j] == SEP[j]
    ok &= after + t + 3 + k + 3 < ends  # all of it inside the line (the window may run past)
    letters = kind[:, :MAX_KIND_BYTES]
    inside = np.arange(MAX_KIND_BYTES) < k[:, None]
    ok &= ((letters >= ord("a")) & (letters <= ord("z")) | ~inside).all(axis=1)
    packed = np.where(inside, letters, 0).astype(np.int64)
    kind_code = (packed << (8 * np.arange(MAX_KIND_BYTES))).sum(axis=1)

    table_code = np.full(n, -1, dtype=np.int64)
    for i, name in enumerate(names):
        size = len(name)
        if size > MAX_NAME_BYTES:
            continue
        mine = ok & (t == size)
        mine[mine] = void_rows(w[mine, :size]) == np.void(name.encode("ascii"))
        table_code[mine] = i
    extra: dict[int, str] = {}
    other = np.flatnonzero(ok & (table_code < 0))
    if other.shape[0]:  # tables that are not in the cluster file: rare, np.unique is fine
        masked = np.where(np.arange(MAX_NAME_BYTES) < t[other, None], w[other, :MAX_NAME_BYTES], 0)
        found, inverse = np.unique(void_rows(masked.astype(np.uint8)), return_inverse=True)
        for j, value in enumerate(found):
            extra[len(names) + j] = bytes(value).rstrip(b"\0").decode("ascii", "replace")
        table_code[other] = len(names) + inverse.reshape(-1)
    kind_code[~ok] = -1
    return table_code, kind_code, extra


def _kind_text(code: int) -> str:
    return int(code).to_bytes(MAX_KIND_BYTES, "little").rstrip(b"\0").decode("ascii")


def summarize_metadump(
    data: bytes, namespace: str, *, tables: Iterable[str] = (), node: str = "?"
) -> dict[tuple[str, str], tuple[int, int]]:
    """Keys and bytes of `namespace` in an `lru_crawler metadump` reply, by (table, kind).

    Returns `{(table, kind tag): (keys, bytes)}`, bytes as memcached counts them
    (the dump's `size=`: item header, key and value). Keys of other namespaces
    are skipped; a key of the namespace the key codec did not write is counted
    under `UNPARSED`. Vectorized: numpy per block of lines, no Python loop per
    key. `tables` are the names expected (the cluster file's); others are found
    too, just more slowly.

    Raises:
        StoreError: a line of the namespace without a `size=` field.
    """
    names = list(dict.fromkeys([*tables, META_TABLE, DENSE_TABLE]))
    arr, starts, ends = namespace_lines(data, namespace)
    skip = len(metadump_prefix(namespace))
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for block in range(0, starts.shape[0], _BLOCK_LINES):
        s, e = starts[block : block + _BLOCK_LINES], ends[block : block + _BLOCK_LINES]
        sizes = _item_sizes(arr, s, e, node)
        table_code, kind_code, extra = _labels(arr, s + skip, e, names)
        group = (table_code << 32) | (kind_code & 0xFFFFFFFF)
        found, inverse, counts = np.unique(group, return_inverse=True, return_counts=True)
        totals = np.bincount(inverse.reshape(-1), weights=sizes, minlength=found.shape[0])
        for g, count, total in zip(found.tolist(), counts.tolist(), totals.tolist(), strict=True):
            code = g >> 32
            if code < 0:
                label = UNPARSED
            else:
                table = names[code] if code < len(names) else extra[code]
                label = (table, _kind_text(g & 0xFFFFFFFF))
            keys, size = out.get(label, (0, 0))
            out[label] = (keys + int(count), size + int(total))
    return out


_EXP_FIELD = b" exp="
_EXP_DIGITS = 12


def _expiry_times(
    arr: NDArray[np.uint8], starts: NDArray[np.int64], ends: NDArray[np.int64], node: str
) -> NDArray[np.int64]:
    """The `exp=` field of each line (the server's unix time the item expires, -1: never).

    memcached 1.6 writes it right after the key (`key=K exp=N la=...`), and a key has
    no space (the dump URL-encodes it): it is read after each line's first space.
    """
    spaces = np.flatnonzero(arr == ord(" ")).astype(np.int64)
    at = np.searchsorted(spaces, starts)
    first = np.where(at < spaces.shape[0], spaces[np.minimum(at, spaces.shape[0] - 1)], ends)
    width = len(_EXP_FIELD) + 1 + _EXP_DIGITS
    window = _windows(arr, first, width)
    ok = (window[:, : len(_EXP_FIELD)] == np.frombuffer(_EXP_FIELD, dtype=np.uint8)).all(axis=1)
    ok &= first < ends
    body = window[:, len(_EXP_FIELD) :]
    never = (body[:, 0] == ord("-")) & (body[:, 1] == ord("1")) & (body[:, 2] == ord(" "))
    digits = body - np.uint8(ord("0"))  # uint8: bytes below "0" wrap around to large values
    is_digit = digits <= 9
    length = np.argmin(np.concatenate([is_digit, np.zeros((len(body), 1), bool)], axis=1), axis=1)
    ok &= never | ((length >= 1) & (length <= _EXP_DIGITS))
    scale = 10 ** np.arange(_EXP_DIGITS + 1, dtype=np.int64)
    used = np.arange(body.shape[1]) < length[:, None]
    power = np.clip(length[:, None] - 1 - np.arange(body.shape[1]), 0, _EXP_DIGITS)
    times: NDArray[np.int64] = np.asarray(
        (np.where(used, digits, 0).astype(np.int64) * scale[power]).sum(axis=1), dtype=np.int64
    )
    times[never] = -1
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise StoreError(
            f"memcached node {node} listed {arr[starts[i] : ends[i]].tobytes()[:160]!r} "
            f"without an `exp=` field after the key in `lru_crawler metadump`",
            node=node,
        )
    return times


def count_expiring(
    data: bytes, namespace: str, before: Mapping[str, int], *, node: str = "?"
) -> dict[tuple[str, str], int]:
    """Keys of the tables in `before` that expire before `before[table]` (a unix time of
    the server), by (table, kind), from an `lru_crawler metadump` reply (vectorized).

    The dump lists only items that have not expired, each with its `exp=`.
    """
    names = list(before)
    arr, starts, ends = namespace_lines(data, namespace)
    skip = len(metadump_prefix(namespace))
    out: dict[tuple[str, str], int] = {}
    for block in range(0, starts.shape[0], _BLOCK_LINES):
        s, e = starts[block : block + _BLOCK_LINES], ends[block : block + _BLOCK_LINES]
        table_code, kind_code, _ = _labels(arr, s + skip, e, names)
        mine = (table_code >= 0) & (table_code < len(names))
        if not mine.any():
            continue
        times = _expiry_times(arr, s[mine], e[mine], node)
        limit = np.array([before[n] for n in names], dtype=np.int64)[table_code[mine]]
        soon = (times >= 0) & (times < limit)
        group = (table_code[mine][soon] << 32) | (kind_code[mine][soon] & 0xFFFFFFFF)
        found, counts = np.unique(group, return_counts=True)
        for g, count in zip(found.tolist(), counts.tolist(), strict=True):
            label = (names[g >> 32], _kind_text(g & 0xFFFFFFFF))
            out[label] = out.get(label, 0) + int(count)
    return out


# ================================================================ stats of the namespace


def _kind_name(kind: str) -> str:
    return KIND_NAMES.get(kind, f"kind_{kind}")


_Inspected = tuple[
    dict[str, Any], dict[tuple[str, str], tuple[int, int]], dict[tuple[str, str], int]
]


async def _inspect_node(
    spec: NodeSpec, config: ClusterConfig, limit: asyncio.Semaphore
) -> _Inspected:
    """One node's whole-node figures, the namespace's keys on it and, for tables with
    `ttl_s`, their keys that expire within half the TTL; an error is reported."""
    async with limit:
        return await _inspect_node_now(spec, config)


async def _inspect_node_now(spec: NodeSpec, config: ClusterConfig) -> _Inspected:
    expiring: dict[tuple[str, str], int] = {}
    try:
        stats = await commands.stats(spec, config.store)
        slabs = await commands.stats(spec, config.store, "slabs")
        dump = await commands.metadump(spec, config.store)
        groups = await asyncio.to_thread(
            summarize_metadump,
            dump,
            config.namespace,
            tables=[t.name for t in config.tables],
            node=spec.address,
        )
        now = int(stats.get("time", 0))  # the server's clock: `exp=` is on it
        before = {t.name: now + t.ttl_s // 2 for t in config.tables if t.ttl_s is not None}
        if before:
            expiring = await asyncio.to_thread(
                count_expiring, dump, config.namespace, before, node=spec.address
            )
    except LookupTableError as exc:
        logger.debug("node %s: %s", spec.address, exc)
        down = isinstance(exc, NodeUnavailableError)
        return {"ok": False, "down": down, "error": str(exc)}, {}, {}
    line = metadump_key(sentinel_key(config.namespace)) + b" "
    used, limit = int(stats.get("bytes", 0)), int(stats.get("limit_maxbytes", 0))
    malloced = int(slabs.get("total_malloced", 0))
    report: dict[str, Any] = {
        "ok": True,
        "version": stats.get("version", "?"),
        "curr_items": int(stats.get("curr_items", 0)),
        "bytes": used,
        "limit_maxbytes": limit,
        "fill_ratio": used / limit if limit else 0.0,
        "malloced_bytes": malloced,
        "malloced_ratio": malloced / limit if limit else 0.0,
        "evictions": int(stats.get("evictions", 0)),
        "store_no_memory": int(stats.get("store_no_memory", 0)),
        # whole node, every namespace: items that expired (never read since set; memory
        # reused from expired items, by a write or by the LRU crawler)
        "expired_unfetched": int(stats.get("expired_unfetched", 0)),
        "reclaimed": int(stats.get("reclaimed", 0)),
        "crawler_reclaimed": int(stats.get("crawler_reclaimed", 0)),
        "sentinel": dump.startswith(line) or b"\n" + line in dump,
        "namespace_keys": sum(keys for keys, _ in groups.values()),
        "namespace_bytes": sum(size for _, size in groups.values()),
    }
    return report, groups, expiring


async def table_stats(config: ClusterConfig) -> dict[str, Any]:
    """Keys and bytes per table and kind, per node and in total; whole-node figures.

    The result is plain JSON::

        {"namespace": ..., "complete": bool, "problems": [str, ...],
         "nodes": {address: {"ok": true, "curr_items", "bytes", "limit_maxbytes",
                             "fill_ratio", "malloced_bytes", "malloced_ratio",
                             "evictions", "store_no_memory", "sentinel", "version",
                             "namespace_keys", "namespace_bytes"}
                         | {"ok": false, "down": bool, "error": str}},
         "tables": {table: {"in_config": bool, ["dim", "id_type", "slot_width", "dtype",
                                                "optimizer", "value_bytes"],
                            "kinds": {name: {"kind": tag, "keys", "bytes",
                                             "nodes": {address: {"keys", "bytes"}}}}}}}

    Every table of the cluster file has `rows` (each with its optimizer slots:
    `slot_width` floats), zero when empty; the bookkeeping tables and tables not in the
    cluster file appear when they hold keys. Per-kind totals and `nodes` cover
    the nodes that answered; `complete` is false when one did not. `problems`
    lists what needs the operator: a node down, missing sentinels.
    """
    limit = asyncio.Semaphore(_NODES_AT_ONCE)
    results = await asyncio.gather(
        *(_inspect_node(spec, config, limit) for spec in config.memcached)
    )
    nodes = {spec.address: r for spec, (r, _, _) in zip(config.memcached, results, strict=True)}
    answered = [spec.address for spec in config.memcached if nodes[spec.address]["ok"]]

    tables: dict[str, dict[str, Any]] = {}
    for spec in config.tables:
        width = slot_width(spec)
        tables[spec.name] = {
            "in_config": True,
            "dim": spec.dim,
            "id_type": spec.id_type,
            "slot_width": width,
            "dtype": spec.dtype,
            "optimizer": spec.optimizer.name,
            # the stored value of one row (the row in its dtype, then its slots)
            "value_bytes": value_bytes(make_optimizer(spec.optimizer), spec.dim, spec.dtype),
            "kinds": {},
        }
        if spec.ttl_s is not None:
            tables[spec.name]["ttl_s"] = spec.ttl_s
        if spec.admit_after > 1:
            tables[spec.name]["admit_after"] = spec.admit_after
        tables[spec.name]["kinds"][_kind_name(Kind.ROW)] = {"kind": str(Kind.ROW)}
    for _, groups, _ in results:
        for table, kind in groups:
            entry = tables.setdefault(table, {"in_config": False, "kinds": {}})
            entry["kinds"].setdefault(_kind_name(kind), {"kind": kind})
    for entry in tables.values():
        for counts in entry["kinds"].values():
            counts.update(keys=0, bytes=0, nodes={a: {"keys": 0, "bytes": 0} for a in answered})
    for address, (_, groups, _) in zip(nodes, results, strict=True):
        for (table, kind), (keys, size) in groups.items():
            counts = tables[table]["kinds"][_kind_name(kind)]
            counts["nodes"][address] = {"keys": keys, "bytes": size}
            counts["keys"] += keys
            counts["bytes"] += size
    for spec in config.tables:
        if spec.ttl_s is None:
            continue
        for name, counts in tables[spec.name]["kinds"].items():
            if name != "counters":
                counts["expiring"] = sum(e.get((spec.name, counts["kind"]), 0) for *_, e in results)

    problems = [_node_problem(a, r) for a, r in nodes.items() if not r["ok"]]
    missing = [a for a in answered if not nodes[a]["sentinel"]]
    if missing and len(missing) == len(nodes):
        problems.append(
            f"namespace {config.namespace!r} is not initialized on any node (no sentinel): "
            f"run `lookup-table-admin init --config FILE` (or restore a checkpoint)"
        )
    elif missing:
        problems.append(
            f"{', '.join(missing)}: no sentinel for namespace {config.namespace!r}: the node "
            f"lost its data (restart, flush); restore a checkpoint or accept the loss with "
            f"`lookup-table-admin reinit --yes`"
        )
    return {
        "namespace": config.namespace,
        "complete": len(answered) == len(nodes),
        "problems": problems,
        "nodes": nodes,
        "tables": tables,
    }


# ================================================================ text output


def _node_problem(address: str, report: Mapping[str, Any]) -> str:
    return f"{address}: {'DOWN' if report['down'] else 'ERROR'}: {report['error']}"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], left: int) -> list[str]:
    """Columns padded to their widest cell; the first `left` columns left-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(header), *(line(r) for r in rows)]


def render_stats(report: Mapping[str, Any]) -> str:
    """The `stats` report as aligned text tables: keys per table, then the nodes."""
    nodes: Mapping[str, Mapping[str, Any]] = report["nodes"]
    answered = [a for a, r in nodes.items() if r["ok"]]
    lines = [
        f"namespace {report['namespace']!r}: {len(answered)} of {len(nodes)} memcached "
        f"nodes answered"
    ]
    rows: list[list[str]] = []
    ttl = any("ttl_s" in entry for entry in report["tables"].values())  # an `expiring` column
    for table, entry in report["tables"].items():
        for kind_name, counts in entry["kinds"].items():
            label = [table, f"{kind_name} ({counts['kind']})"]
            per_node = [(a, counts["nodes"][a]) for a in answered]
            total = "total" if report["complete"] else "total (nodes up)"
            for where, c in [*per_node, (total, counts)]:
                keys, size = int(c["keys"]), int(c["bytes"])
                rows.append(
                    [
                        *label,
                        where,
                        f"{keys:,}",
                        _human_bytes(size),
                        f"{size / keys:,.0f}" if keys else "-",
                        *([f"{c['expiring']:,}" if "expiring" in c else "-"] if ttl else []),
                    ]
                )
    if rows:
        header = ["table", "kind", "node", "keys", "bytes", "bytes/key"]
        lines += ["", *_aligned([*header, "expiring"] if ttl else header, rows, 3)]
        if ttl:
            lines.append(
                "expiring: keys of a table with ttl_s not read or updated for half their TTL "
                "(they expire within ttl_s/2 unless used)"
            )
    node_rows = []
    down = []
    for address, r in nodes.items():
        if not r["ok"]:
            down.append(_node_problem(address, r))
            continue
        node_rows.append(
            [
                address,
                f"{r['curr_items']:,}",
                _human_bytes(r["bytes"]),
                _human_bytes(r["malloced_bytes"]),
                _human_bytes(r["limit_maxbytes"]),
                f"{r['fill_ratio']:.1%}",
                f"{r['malloced_ratio']:.1%}",
                f"{r['evictions']:,}",
                "yes" if r["sentinel"] else "MISSING",
                f"{r['namespace_keys']:,}",
                _human_bytes(r["namespace_bytes"]),
            ]
        )
    header = [
        "node",
        "items",
        "bytes",
        "malloced",
        "limit",
        "fill",
        "malloced/limit",
        "evictions",
        "sentinel",
        "ns keys",
        "ns bytes",
    ]
    lines += ["", *(_aligned(header, node_rows, 1) if node_rows else []), *down]
    layouts = [
        [table, str(e["dim"]), e["dtype"], e["optimizer"], f"{e['value_bytes']:,}"]
        for table, e in report["tables"].items()
        if "value_bytes" in e
    ]
    if layouts:
        # a row's stored value; its key and memcached's item header come on top
        header = ["table", "dim", "dtype", "optimizer", "bytes/row value"]
        lines += ["", *_aligned(header, layouts, 1)]
    return "\n".join(lines)


def only_tables(report: dict[str, Any], wanted: Sequence[str]) -> dict[str, Any]:
    """The report with the tables in `wanted` only (ConfigError for a name it lacks)."""
    unknown = [name for name in wanted if name not in report["tables"]]
    if unknown:
        raise ConfigError(
            f"--table {unknown[0]!r}: no such table in the cluster file or on the nodes; "
            f"known: {', '.join(report['tables']) or 'none'}"
        )
    return {**report, "tables": {n: t for n, t in report["tables"].items() if n in wanted}}
