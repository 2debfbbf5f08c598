"""The keys of a namespace on every node, from `lru_crawler metadump`, by (table, kind).

A checkpoint saves exactly the ids it finds here and a restore deletes exactly
these keys. The rows and slots of int64 tables are decoded with numpy (millions of
keys per node); every other key is kept as its body and decoded one by one
through the key codec, which validates it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import NodeSpec
from lookup_table.core.keys import (
    INT_ID_BYTES,
    INT_ID_DIGITS,
    MAX_KIND_BYTES,
    decode_int_digits,
    decode_key,
    int_key_matrix,
    key_prefix,
)
from lookup_table.core.keyspace import ROW_KINDS
from lookup_table.errors import KeyEncodingError, StoreError
from lookup_table.memcached import commands
from lookup_table.ops.metadump import (
    LABEL_BYTES,
    key_body,
    metadump_prefix,
    namespace_lines,
    void_rows,
)
from lookup_table.store import EmbeddingStore

__all__ = [
    "NodeKeys",
    "decode_bodies",
    "decode_int_bodies",
    "namespace_keys",
    "parse_metadump",
]


def decode_int_bodies(bodies: Sequence[bytes]) -> NDArray[np.int64]:
    """The int64 ids of key bodies `i` + 11 base64url digits, vectorized.

    The inverse of `keys.int_key_matrix` on the id part; `keys.decode_key` gives the
    same ids one by one.

    Raises:
        KeyEncodingError: a body that is not an int id.
    """
    n = len(bodies)
    joined = b"".join(bodies)
    if len(joined) != n * INT_ID_BYTES:
        raise KeyEncodingError(f"not all {n} key bodies are int ids ({INT_ID_BYTES} bytes)")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    mat = np.frombuffer(joined, dtype=np.uint8).reshape(n, INT_ID_BYTES)
    ids, ok = decode_int_digits(mat[:, 1:])
    bad = (mat[:, 0] != ord("i")) | ~ok
    if bad.any():
        raise KeyEncodingError(f"not an int id key body: {bodies[int(np.flatnonzero(bad)[0])]!r}")
    return ids


def decode_bodies(
    namespace: str, table: str, kind: str, bodies: Sequence[bytes]
) -> list[int | str]:
    """Ids of metadump key bodies one by one, through `keys.decode_key` (validating)."""
    prefix = key_prefix(namespace, table, kind)
    return [decode_key(prefix + key_body(b)).id for b in bodies]


@dataclass(slots=True)
class NodeKeys:
    """The keys of one namespace on one node (from `lru_crawler metadump`).

    `int_ids`: (table, kind) -> int64 ids, decoded without a Python loop (the rows
    and slots of the int64 tables that `parse_metadump` was told about).
    `bodies`: (table, kind) -> every other key's body, still URL-encoded by
    memcached (decode with `decode_bodies`).
    """

    int_ids: dict[tuple[str, str], NDArray[np.int64]] = field(default_factory=dict)
    bodies: dict[tuple[str, str], list[bytes]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        ints = sum(int(a.shape[0]) for a in self.int_ids.values())
        return ints + sum(len(b) for b in self.bodies.values())

    def keys(self, namespace: str) -> list[bytes]:
        """Every key, as stored in memcached (for deleting them)."""
        out: list[bytes] = []
        for (table, kind), ids in self.int_ids.items():
            matrix = int_key_matrix(key_prefix(namespace, table, kind), ids)
            flat, width = matrix.tobytes(), matrix.shape[1]
            out += [flat[i : i + width] for i in range(0, len(flat), width)]
        for (table, kind), bodies in self.bodies.items():
            prefix = f"{namespace}/{table}/{kind}/".encode("ascii")
            out += [prefix + key_body(b) for b in bodies]
        return out


def _metadump_pattern(namespace: str) -> re.Pattern[bytes]:
    # memcached URL-encodes every byte but A-Za-z0-9 -._~ ("/" is %2F), so a line's key
    # is `{namespace}%2F{table}%2F{kind}%2F{body}`
    kind = rb"([a-z]{1,%d})" % MAX_KIND_BYTES
    label = rb"([A-Za-z0-9_.\-]+)%2F" + kind + rb"%2F([^ \n]+)"
    return re.compile(re.escape(metadump_prefix(namespace)) + label)


_MAX_INT_TAIL = LABEL_BYTES + INT_ID_BYTES + 1  # table %2F kind %2F, body, space
_PARSE_BLOCK_LINES = 1 << 18  # lines decoded per numpy block (bounds the window matrix)


def _int_rows(
    arr: NDArray[np.uint8],
    starts: NDArray[np.int64],
    namespace_bytes: int,
    int_tables: Sequence[str],
    out: dict[tuple[str, str], list[NDArray[np.int64]]],
) -> NDArray[np.bool_]:
    """Decode the row and slot keys of int64 tables with numpy; return which lines were.

    Such a line starts `key={ns}%2F{table}%2Fw%2Fi{11 base64url digits} `: after the
    namespace, the first '%' ends the table name, and everything else is at a fixed
    offset from it. Lines that do not fit are left to the general parser.
    """
    handled = np.zeros(starts.shape[0], dtype=bool)
    by_length: dict[int, list[bytes]] = {}
    for table in int_tables:
        by_length.setdefault(len(table), []).append(table.encode("ascii"))
    span = namespace_bytes + _MAX_INT_TAIL
    if not by_length or arr.shape[0] < span:
        return handled
    windows = np.lib.stride_tricks.sliding_window_view(arr, span)
    room = np.flatnonzero(starts <= arr.shape[0] - span)  # the last lines: general parser
    kinds = {k: np.frombuffer(b"%2F" + k.encode() + b"%2Fi", "<u8")[0] for k in ROW_KINDS}
    for block in range(0, room.shape[0], _PARSE_BLOCK_LINES):
        lines = room[block : block + _PARSE_BLOCK_LINES]
        tail = windows[starts[lines]][:, namespace_bytes:]
        name_bytes = np.argmax(tail == ord("%"), axis=1)
        for length, names in by_length.items():
            rows = np.flatnonzero(name_bytes == length)
            end = length + 8 + INT_ID_DIGITS  # name %2F kind %2Fi, the digits, a space
            seg = tail[rows, : end + 1]
            fixed = np.ascontiguousarray(seg[:, length : length + 8]).view("<u8")[:, 0]
            ids, ok = decode_int_digits(seg[:, length + 8 : end])
            fits = (seg[:, end] == ord(" ")) & ok
            label = void_rows(seg[:, :length])
            for name in names:
                mine = fits & (label == np.void(name))
                for kind, code in kinds.items():
                    pick = np.flatnonzero(mine & (fixed == code))
                    if pick.shape[0]:
                        group = out.setdefault((name.decode("ascii"), kind), [])
                        group.append(ids[pick])
                        handled[lines[rows[pick]]] = True
    return handled


def parse_metadump(
    data: bytes, namespace: str, *, int_tables: Iterable[str] = (), node: str = "?"
) -> NodeKeys:
    """The keys of `namespace` in an `lru_crawler metadump` reply, grouped by (table, kind).

    Rows and slots of the tables in `int_tables` (int64 ids) are decoded with
    numpy, without a Python loop per key; every other key of the namespace is
    kept as its body (string ids, bookkeeping, tables not in the list).

    Raises:
        StoreError: a key of the namespace that the key codec did not write.
    """
    out = NodeKeys()
    prefix = metadump_prefix(namespace)
    arr, starts, _ = namespace_lines(data, namespace)
    if starts.shape[0] == 0:
        return out
    int_parts: dict[tuple[str, str], list[NDArray[np.int64]]] = {}
    handled = _int_rows(arr, starts, len(prefix), list(int_tables), int_parts)
    out.int_ids = {group: np.concatenate(parts) for group, parts in int_parts.items()}
    rest = starts[~handled].tolist()
    if not rest:
        return out
    pattern = _metadump_pattern(namespace)
    grouped: dict[tuple[bytes, bytes], list[bytes]] = {}
    for start in rest:
        line = data[start : data.index(b"\n", start)]
        match = pattern.match(line)
        if match is None:
            key = unquote_to_bytes(line[4:].split(b" ", 1)[0])
            raise StoreError(
                f"memcached node {node} holds key {key[:120]!r} under namespace "
                f"{namespace!r} that is not a lookup-table key; remove it or use another "
                f"namespace",
                node=node,
            )
        table, kind, body = match.groups()
        grouped.setdefault((table, kind), []).append(body)
    out.bodies = {(t.decode("ascii"), k.decode("ascii")): v for (t, k), v in grouped.items()}
    return out


async def namespace_keys(store: EmbeddingStore) -> dict[str, NodeKeys]:
    """Per node address: the namespace's keys grouped by (table, kind)."""
    cfg = store.config
    int_tables = [t.name for t in cfg.tables if t.id_type == "int64"]

    async def one(spec: NodeSpec) -> NodeKeys:
        data = await commands.metadump(spec, cfg.store)
        return parse_metadump(data, cfg.namespace, int_tables=int_tables, node=spec.address)

    results = await asyncio.gather(*(one(spec) for spec in cfg.memcached))
    return dict(zip(store.nodes, results, strict=True))
