"""`lookup-table-checkpoint`: consistent checkpoints that do not depend on the node count.

    lookup-table-checkpoint save    --config C --dir D [--no-pause]
    lookup-table-checkpoint restore --config C --dir D [--force] [--no-pause]
    lookup-table-checkpoint export  --dir D --out model.npz

**save** pauses every optimizer replica (in-flight pushes finish, new ones wait;
they resume when the save has read everything, or by themselves after
`--pause-timeout-s`), lists the namespace's keys on every node with memcached's
`lru_crawler metadump hash`, and reads, for every table of the cluster file, the
rows (`w`) and slots (`s`) of every id found, in pipelined batches through
`EmbeddingStore.get`. The dense parameters (the current generation, with their
slots) and the replicas' version keys are read too; push records and journals
are transient and skipped. Everything is written to a temporary sibling
directory that is renamed to `D` only after `manifest.json` (written last) and
every file are on disk, so a crash never leaves a directory that looks complete.
Ids are sorted, so the files depend only on the data, not on the nodes.

Rows a trainer creates while the save runs (lookups are not paused) are either
in the checkpoint or not; both are fine, since a missing row is re-created with
the same deterministic initial value.

**restore** verifies the checkpoint first (manifest, format version, every
file's size, sha256, dtype and shape, and that its tables fit the cluster file:
same dim, id type, optimizer and slot width) and writes nothing if anything is
wrong. It refuses a namespace that holds any key but its sentinels unless
`--force` (then every key of the namespace is deleted first, so rows trained
after the checkpoint and stale journals cannot survive). It deletes the
namespace's sentinels, writes rows, slots, the dense generation, its `current`
pointer and the version keys into the cluster file's nodes (any number: the
placement is recomputed), and writes the sentinels last: a restore that fails
part-way leaves the namespace without sentinels, so trainers get
`DataLossError` instead of training on half a model. The running optimizer
replicas are paused for the whole restore (no push mixes old and restored rows)
and resumed with `?reload=1`, which makes them read the restored version; a
replica that is not running loads it when it starts (`--no-pause`: leave them
alone and restart them afterwards).

**export** writes every table's ids and rows (and the dense parameters) into one
`.npz` that `np.load(path, allow_pickle=False)` reads without memcached.

Format, version 1 (numpy `.npy` files, never pickled)::

    manifest.json                    written last: format, namespace, config tables,
                                     counts, dense shapes, versions, sha256 of every file
    tables/<table>/ids.npy           int64 (n,), ascending            (int64 tables)
    tables/<table>/ids_utf8.npy      uint8 (total,): every id's UTF-8 (string tables;
    tables/<table>/ids_offsets.npy   int64 (n + 1,)   id i = utf8[off[i]:off[i+1]],
                                                      sorted by code point)
    tables/<table>/rows.npy          float32 (n, dim)
    tables/<table>/slots.npy         float32 (n, slot_width)         (slot_width > 0)
    tables/<table>/has_slots.npy     bool (n,): False for rows never updated (no slots)
    dense/<file>.npy                 float32, the parameter's shape  (names in the manifest)
    dense_slots/<file>.npy           float32 (1, slot_width(size))
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote, unquote_to_bytes

import numpy as np
from numpy.typing import NDArray
from tqdm import tqdm

from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, NodeSpec, TableSpec, load_config
from lookup_table.core.keys import INT_ID_BYTES, IdArray, decode_key, int_key_matrix, key_prefix
from lookup_table.core.keyspace import (
    DENSE_TABLE,
    META_TABLE,
    ROW_KINDS,
    Kind,
    is_journal_header,
    sentinel_key,
    version_replica,
)
from lookup_table.core.optimizers import make_optimizer
from lookup_table.core.sharding import node_of
from lookup_table.dense import DenseParams
from lookup_table.errors import (
    CheckpointError,
    ClusterNotInitializedError,
    ConfigError,
    DataLossError,
    KeyEncodingError,
    LookupTableError,
    NamespaceNotEmptyError,
    NodeUnavailableError,
    StoreError,
)
from lookup_table.memcached import commands
from lookup_table.store import EmbeddingStore

__all__ = [
    "DEFAULT_BATCH_IDS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NodeKeys",
    "check_compatible",
    "decode_bodies",
    "decode_int_bodies",
    "dense_file_stems",
    "export_checkpoint",
    "main",
    "metadump_prefix",
    "namespace_lines",
    "pack_str_ids",
    "parse_metadump",
    "restore_checkpoint",
    "save_checkpoint",
    "unpack_str_ids",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT = "lookup-table-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_BATCH_IDS = 32_768
DEFAULT_PAUSE_TIMEOUT_S = 3600.0
_WINDOW = 4  # batches in flight at once (each is split by node and max_batch_keys)
_HASH_CHUNK = 1 << 22
_INT_BODY_BYTES = INT_ID_BYTES  # "i" + 16 hex digits
_HEX_VALUES = np.full(256, 255, dtype=np.uint8)
_HEX_VALUES[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint8)


# ================================================================ pure: ids, keys, names


def pack_str_ids(ids: Sequence[str]) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """String ids as (UTF-8 bytes concatenated, uint8 (total,); offsets, int64 (n + 1,)).

    Id i is `utf8[offsets[i]:offsets[i + 1]].tobytes().decode()`: exact for any
    string (empty, spaces, '/', NUL anywhere), unlike a fixed-width numpy `U`
    or `S` array, which drops trailing NULs.
    """
    encoded = [s.encode("utf-8") for s in ids]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
    utf8 = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    return utf8, offsets


def unpack_str_ids(utf8: NDArray[np.uint8], offsets: NDArray[np.int64]) -> NDArray[np.object_]:
    """Invert `pack_str_ids`: an object array (n,) of str.

    Raises:
        ValueError: offsets that do not describe `utf8`, or bytes that are not UTF-8.
    """
    if utf8.ndim != 1 or offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(f"expected 1-D arrays, got shapes {utf8.shape} and {offsets.shape}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != utf8.shape[0]:
        raise ValueError(
            f"offsets must run from 0 to {utf8.shape[0]} (the byte count); "
            f"got {int(offsets[0])}..{int(offsets[-1])}"
        )
    if (np.diff(offsets) < 0).any():
        raise ValueError("offsets must not decrease")
    data = utf8.tobytes()
    bounds = offsets.tolist()
    out = np.empty(len(bounds) - 1, dtype=object)
    out[:] = [data[a:b].decode("utf-8") for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return out


def _ids_from_nibbles(nibbles: NDArray[np.uint8]) -> NDArray[np.int64]:
    """int64 ids from their 16 hex digit values per row, (n, 16) -> (n,), two's complement."""
    be = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # (n, 8) big-endian bytes
    return np.ascontiguousarray(be).view(">i8").reshape(-1).astype(np.int64)


def decode_int_bodies(bodies: Sequence[bytes]) -> NDArray[np.int64]:
    """The int64 ids of key bodies `i` + 16 lowercase hex digits, vectorized.

    The inverse of `keys.int_key_matrix` on the id part (two's complement, so
    `iffffffffffffffff` is -1); `keys.decode_key` gives the same ids one by one.

    Raises:
        KeyEncodingError: a body that is not an int id.
    """
    n = len(bodies)
    joined = b"".join(bodies)
    if len(joined) != n * _INT_BODY_BYTES:
        raise KeyEncodingError(f"not all {n} key bodies are int ids ({_INT_BODY_BYTES} bytes)")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    mat = np.frombuffer(joined, dtype=np.uint8).reshape(n, _INT_BODY_BYTES)
    nibbles = _HEX_VALUES[mat[:, 1:]]
    bad = (mat[:, 0] != ord("i")) | (nibbles > 15).any(axis=1)
    if bad.any():
        raise KeyEncodingError(f"not an int id key body: {bodies[int(np.flatnonzero(bad)[0])]!r}")
    return _ids_from_nibbles(nibbles)


def _key_body(body: bytes) -> bytes:
    """A metadump key body (memcached URL-encodes keys) as the key codec wrote it."""
    return unquote_to_bytes(body) if b"%" in body else body


def decode_bodies(
    namespace: str, table: str, kind: str, bodies: Sequence[bytes]
) -> list[int | str]:
    """Ids of metadump key bodies one by one, through `keys.decode_key` (validating)."""
    prefix = key_prefix(namespace, table, kind)
    return [decode_key(prefix + _key_body(b)).id for b in bodies]


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
            out += [prefix + _key_body(b) for b in bodies]
        return out


def _metadump_pattern(namespace: str) -> re.Pattern[bytes]:
    # memcached URL-encodes every byte but A-Za-z0-9 -._~ ("/" is %2F), so a line's key
    # is `{namespace}%2F{table}%2F{kind}%2F{body}`
    ns = re.escape(quote(namespace + "/", safe="").encode("ascii"))
    return re.compile(rb"key=" + ns + rb"([A-Za-z0-9_.\-]+)%2F([a-z]{1,4})%2F([^ \n]+)")


_MAX_INT_TAIL = 64 + 3 + 4 + 3 + _INT_BODY_BYTES + 1  # table, %2F, kind, %2F, body, space
_PARSE_BLOCK_LINES = 1 << 18  # lines decoded per numpy block (bounds the window matrix)


def _void_rows(matrix: NDArray[np.uint8]) -> NDArray[np.void]:
    """Rows of a uint8 matrix as one opaque value each (compared with memcmp)."""
    width = matrix.shape[1]
    return np.ascontiguousarray(matrix).view(np.dtype((np.void, width)))[:, 0]


def _int_rows(
    arr: NDArray[np.uint8],
    starts: NDArray[np.int64],
    namespace_bytes: int,
    int_tables: Sequence[str],
    out: dict[tuple[str, str], list[NDArray[np.int64]]],
) -> NDArray[np.bool_]:
    """Decode the row and slot keys of int64 tables with numpy; return which lines were.

    Such a line starts `key={ns}%2F{table}%2F{w|s}%2Fi{16 hex digits} `: after the
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
            seg = tail[rows, : length + 25]  # name %2F kind %2Fi hex{16} space
            fixed = np.ascontiguousarray(seg[:, length : length + 8]).view("<u8")[:, 0]
            nibbles = _HEX_VALUES[seg[:, length + 8 : length + 24]]
            fits = (seg[:, length + 24] == ord(" ")) & (nibbles.max(axis=1) <= 15)
            label = _void_rows(seg[:, :length])
            for name in names:
                mine = fits & (label == np.void(name))
                for kind, code in kinds.items():
                    pick = np.flatnonzero(mine & (fixed == code))
                    if pick.shape[0]:
                        group = out.setdefault((name.decode("ascii"), kind), [])
                        group.append(_ids_from_nibbles(nibbles[pick]))
                        handled[lines[rows[pick]]] = True
    return handled


def metadump_prefix(namespace: str) -> bytes:
    """How every metadump line of a key of `namespace` starts (memcached URL-encodes keys)."""
    return b"key=" + quote(namespace + "/", safe="").encode("ascii")


def namespace_lines(
    data: bytes, namespace: str
) -> tuple[NDArray[np.uint8], NDArray[np.int64], NDArray[np.int64]]:
    """The lines of an `lru_crawler metadump` reply that list a key of `namespace`.

    Returns `(arr, starts, ends)`: the reply as uint8 (a view, no copy), and each
    such line's first byte and its terminating `\\n`, int64 (n,), in reply order.
    Found with numpy, without a Python loop per line.
    """
    prefix = metadump_prefix(namespace)
    arr = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(arr == ord("\n")).astype(np.int64, copy=False)
    starts = np.zeros_like(ends)
    starts[1:] = ends[:-1] + 1
    long_enough = ends - starts > len(prefix)
    starts, ends = starts[long_enough], ends[long_enough]
    if starts.shape[0] == 0:
        return arr, starts, ends
    windows = np.lib.stride_tricks.sliding_window_view(arr, len(prefix))
    mine = _void_rows(windows[starts]) == np.void(prefix)
    return arr, starts[mine], ends[mine]


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


def dense_file_stems(names: Iterable[str]) -> dict[str, str]:
    """A safe, unique file stem for every dense parameter name ('/' becomes '__').

    Unique also on case-insensitive file systems; the manifest keeps the real names.
    """
    out: dict[str, str] = {}
    used: set[str] = set()
    for name in sorted(names):
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name.replace("/", "__")) or "_"
        if stem.startswith("."):
            stem = "_" + stem
        base, k = stem, 1
        while stem.lower() in used:
            stem = f"{base}-{k}"
            k += 1
        used.add(stem.lower())
        out[name] = stem
    return out


def _slot_width(spec: TableSpec) -> int:
    return make_optimizer(spec.optimizer).slot_width(spec.dim)


def _table_files(name: str, id_type: str, slot_width: int) -> dict[str, str]:
    base = f"tables/{name}/"
    files = (
        {"ids": base + "ids.npy"}
        if id_type == "int64"
        else {"ids_utf8": base + "ids_utf8.npy", "ids_offsets": base + "ids_offsets.npy"}
    )
    files["rows"] = base + "rows.npy"
    if slot_width:
        files["slots"] = base + "slots.npy"
        files["has_slots"] = base + "has_slots.npy"
    return files


def _expected_arrays(manifest: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Every data file the manifest promises: path -> (dtype, shape; None = any 1-D)."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for t in manifest["tables"]:
        n, dim, width = int(t["count"]), int(t["dim"]), int(t["slot_width"])
        files = t["files"]
        if files != _table_files(t["name"], t["id_type"], width):
            raise CheckpointError(
                f"{MANIFEST}: table {t['name']!r} lists files {sorted(files.values())}, "
                f"expected {sorted(_table_files(t['name'], t['id_type'], width).values())}"
            )
        if t["id_type"] == "int64":
            out[files["ids"]] = ("<i8", (n,))
        else:
            out[files["ids_utf8"]] = ("|u1", None)
            out[files["ids_offsets"]] = ("<i8", (n + 1,))
        out[files["rows"]] = ("<f4", (n, dim))
        if width:
            out[files["slots"]] = ("<f4", (n, width))
            out[files["has_slots"]] = ("|b1", (n,))
    dense = manifest.get("dense")
    if dense is not None:
        for p in dense["params"]:
            out[p["file"]] = ("<f4", tuple(int(x) for x in p["shape"]))
            out[p["slots_file"]] = ("<f4", tuple(int(x) for x in p["slots_shape"]))
    return out


def check_compatible(manifest: Mapping[str, Any], config: ClusterConfig) -> list[str]:
    """Refuse a checkpoint whose tables do not fit `config`; return warnings.

    Every table of the checkpoint must be in the cluster file with the same dim,
    id type and slot layout (optimizer and slot width); the dense parameters'
    slots must fit `[optimizer]`.

    Raises:
        CheckpointError: naming the table and what differs.
    """
    warnings: list[str] = []
    saved = {t["name"] for t in manifest["tables"]}
    for t in manifest["tables"]:
        name = t["name"]
        try:
            spec = config.table(name)
        except ConfigError:
            raise CheckpointError(
                f"table {name!r} of the checkpoint is not in the cluster file; add it "
                f"([[tables]] name = {name!r}, dim = {t['dim']}, id_type = {t['id_type']!r})"
            ) from None
        if spec.dim != int(t["dim"]):
            raise CheckpointError(
                f"table {name!r}: the checkpoint has dim={t['dim']} but the cluster file says "
                f"dim={spec.dim}; restore with dim={t['dim']} or use a new table name"
            )
        if spec.id_type != t["id_type"]:
            raise CheckpointError(
                f"table {name!r}: the checkpoint has id_type={t['id_type']!r} but the cluster "
                f"file says id_type={spec.id_type!r}"
            )
        width = _slot_width(spec)
        if width != int(t["slot_width"]) or (width and spec.optimizer.name != t["optimizer"]):
            raise CheckpointError(
                f"table {name!r}: the checkpoint's slots are {t['optimizer']} slots of "
                f"{t['slot_width']} floats per row, but the cluster file's optimizer "
                f"{spec.optimizer.name!r} keeps {width}; restore with optimizer "
                f"{t['optimizer']!r} for this table"
            )
    warnings += [
        f"table {spec.name!r} is not in the checkpoint: it starts empty"
        for spec in config.tables
        if spec.name not in saved
    ]
    dense = manifest.get("dense")
    if dense is not None:
        optimizer = make_optimizer(config.optimizer)
        for p in dense["params"]:
            size = int(np.prod(p["shape"], dtype=np.int64))
            want = [1, optimizer.slot_width(size)]
            if [int(x) for x in p["slots_shape"]] != want or (
                want[1] and config.optimizer.name != dense["optimizer"]
            ):
                raise CheckpointError(
                    f"dense parameter {p['name']!r}: the checkpoint's slots are "
                    f"{dense['optimizer']} slots of shape {p['slots_shape']}, but the cluster "
                    f"file's [optimizer] {config.optimizer.name!r} keeps {want}; restore with "
                    f"[optimizer] name = {dense['optimizer']!r}"
                )
    return warnings


# ================================================================ files


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype[Any]]:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    if fortran:
        raise ValueError("Fortran order is not used by checkpoints")
    return tuple(shape), dtype


def _load(directory: Path, name: str) -> NDArray[Any]:
    """A checkpoint array, memory-mapped (read-only) when it has data."""
    path = directory / name
    shape, _ = _npy_header(path)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return cast("NDArray[Any]", np.load(path, allow_pickle=False))
    return cast("NDArray[Any]", np.load(path, mmap_mode="r", allow_pickle=False))


def _save(path: Path, array: NDArray[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)


def _sha256(path: Path, *, sync: bool = False) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(fh.fileno())
    return digest.hexdigest(), size


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_files(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under `root` (relative POSIX paths), fsynced."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest, size = _sha256(path, sync=True)
        out[path.relative_to(root).as_posix()] = {"sha256": digest, "bytes": size}
    for directory in sorted({p.parent for p in root.rglob("*")} | {root}):
        _fsync_dir(directory)
    return out


def _finalize(tmp: Path, target: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every file, write manifest.json last, then rename `tmp` to `target`."""
    manifest["files"] = _hash_files(tmp)
    _expected_arrays(manifest)  # the manifest describes what was written
    with open(tmp / MANIFEST, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if target.exists():
        target.rmdir()  # checked empty before the save started
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    return manifest


def _check_target(target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"{target} already exists and is not an empty directory; save into a new "
            f"directory (checkpoints are never overwritten)"
        )


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing: {directory} is not a checkpoint, or a save that did not finish "
            f"(a save writes {MANIFEST} last)"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path}: not valid JSON (truncated or corrupt?): {exc}; the checkpoint cannot be "
            f"trusted"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f'{path}: not a {FORMAT} manifest (no "format": {FORMAT!r})')
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {doc.get('format_version')!r}; this lookup-table reads "
            f"version {FORMAT_VERSION}"
        )
    return doc


def verify_checkpoint(directory: str | os.PathLike[str], *, hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint directory completely; return its manifest.

    Checks: the manifest (present, valid JSON, format and version, fields), every
    data file it promises (present, listed, size, sha256 unless `hashes=False`,
    dtype, shape), int ids strictly ascending, string-id offsets consistent, and
    the slot and table counts.

    Raises:
        CheckpointError: naming the file and what is wrong.
    """
    root = Path(directory)
    manifest = _read_manifest(root)
    try:
        _check_fields(manifest)
        expected = _expected_arrays(manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{root / MANIFEST}: missing or malformed field {exc}") from None
    files: dict[str, Any] = manifest["files"]
    unlisted = sorted(set(expected) - set(files))
    if unlisted:
        raise CheckpointError(f'{root / MANIFEST}: {unlisted[0]} is not listed under "files"')
    for name, info in sorted(files.items()):
        path = root / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{root / MANIFEST}: bad file name {name!r}")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the checkpoint is partial)")
        size = path.stat().st_size
        if size != int(info["bytes"]):
            raise CheckpointError(
                f"{path}: {size} bytes, the manifest says {info['bytes']} (truncated or corrupt)"
            )
        if hashes:
            digest, _ = _sha256(path)
            if digest != info["sha256"]:
                raise CheckpointError(
                    f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                    f"{str(info['sha256'])[:16]}...: the file is corrupt"
                )
    for name, (dtype, shape) in expected.items():
        path = root / name
        try:
            got_shape, got_dtype = _npy_header(path)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{path}: not a readable .npy file: {exc}") from None
        if (
            got_dtype.str != dtype
            or (shape is not None and got_shape != shape)
            or (shape is None and len(got_shape) != 1)
        ):
            raise CheckpointError(
                f"{path}: {got_dtype.str} {got_shape}, the manifest promises {dtype} "
                f"{shape if shape is not None else '(any,)'}"
            )
    for t in manifest["tables"]:
        _verify_table_content(root, t)
    return manifest


_TABLE_FIELDS: dict[str, type[Any]] = {
    "name": str,
    "dim": int,
    "id_type": str,
    "optimizer": str,
    "slot_width": int,
    "count": int,
    "with_slots": int,
    "files": dict,
}


def _check_fields(manifest: Mapping[str, Any]) -> None:
    """KeyError/TypeError naming the first missing or mistyped manifest field."""

    def need(doc: Mapping[str, Any], key: str, kind: type[Any], where: str) -> None:
        if key not in doc:
            raise KeyError(f"{where}{key}")
        if not isinstance(doc[key], kind) or isinstance(doc[key], bool) and kind is int:
            raise TypeError(f"{where}{key} must be {kind.__name__}, got {doc[key]!r}")

    top: tuple[tuple[str, type[Any]], ...] = (("namespace", str), ("tables", list), ("files", dict))
    for key, kind in top:
        need(manifest, key, kind, "")
    for i, t in enumerate(manifest["tables"]):
        if not isinstance(t, dict):
            raise TypeError(f"tables[{i}] must be an object")
        for key, kind in _TABLE_FIELDS.items():
            need(t, key, kind, f"tables[{i}].")
        if t["id_type"] not in ("int64", "string"):
            raise ValueError(f"tables[{i}].id_type must be int64 or string, got {t['id_type']!r}")
    for name, info in manifest["files"].items():
        if not isinstance(info, dict):
            raise TypeError(f"files[{name!r}] must be an object")
        need(info, "sha256", str, f"files[{name!r}].")
        need(info, "bytes", int, f"files[{name!r}].")
    dense = manifest.get("dense")
    if dense is not None:
        if not isinstance(dense, dict):
            raise TypeError("dense must be an object or null")
        need(dense, "version", int, "dense.")
        need(dense, "optimizer", str, "dense.")
        need(dense, "params", list, "dense.")
        param_fields: tuple[tuple[str, type[Any]], ...] = (
            ("name", str),
            ("file", str),
            ("slots_file", str),
            ("shape", list),
            ("slots_shape", list),
        )
        for i, p in enumerate(dense["params"]):
            for key, kind in param_fields:
                need(p, key, kind, f"dense.params[{i}].")
    versions = manifest.get("replica_versions", {})
    if not isinstance(versions, dict) or not all(
        isinstance(v, int) and str(k).isdigit() for k, v in versions.items()
    ):
        raise TypeError(f"replica_versions must map replica numbers to ints, got {versions!r}")


def _verify_table_content(root: Path, t: Mapping[str, Any]) -> None:
    files = t["files"]
    if t["id_type"] == "int64":
        ids = _load(root, files["ids"])
        if ids.shape[0] > 1 and not (np.diff(ids) > 0).all():
            raise CheckpointError(f"{root / files['ids']}: ids are not strictly ascending")
    else:
        offsets = _load(root, files["ids_offsets"])
        utf8 = _load(root, files["ids_utf8"])
        if (
            int(offsets[0]) != 0
            or int(offsets[-1]) != utf8.shape[0]
            or (np.diff(offsets) < 0).any()
        ):
            raise CheckpointError(
                f"{root / files['ids_offsets']}: offsets do not describe "
                f"{files['ids_utf8']} ({utf8.shape[0]} bytes)"
            )
    if int(t["slot_width"]):
        with_slots = int(np.count_nonzero(_load(root, files["has_slots"])))
        if with_slots != int(t.get("with_slots", with_slots)):
            raise CheckpointError(
                f"{root / files['has_slots']}: {with_slots} rows with slots, the manifest says "
                f"{t['with_slots']}"
            )


def _table_ids(root: Path, t: Mapping[str, Any]) -> IdArray:
    files = t["files"]
    if t["id_type"] == "int64":
        return np.asarray(_load(root, files["ids"]), dtype=np.int64)
    try:
        return unpack_str_ids(
            np.asarray(_load(root, files["ids_utf8"])),
            np.asarray(_load(root, files["ids_offsets"])),
        )
    except ValueError as exc:
        raise CheckpointError(f"{root / files['ids_utf8']}: {exc}") from None


async def _namespace_keys(store: EmbeddingStore) -> dict[str, NodeKeys]:
    """Per node address: the namespace's keys grouped by (table, kind)."""
    cfg = store.config
    int_tables = [t.name for t in cfg.tables if t.id_type == "int64"]

    async def one(spec: NodeSpec) -> NodeKeys:
        data = await commands.metadump(spec, cfg.store)
        return parse_metadump(data, cfg.namespace, int_tables=int_tables, node=spec.address)

    results = await asyncio.gather(*(one(spec) for spec in cfg.memcached))
    return dict(zip(store.nodes, results, strict=True))


# ================================================================ helpers


def _progress(total: int, desc: str, enabled: bool | None) -> Any:
    return tqdm(
        total=total,
        desc=desc,
        unit="rows",
        unit_scale=True,
        file=sys.stderr,
        leave=False,
        disable=None if enabled is None else not enabled,
        dynamic_ncols=True,
    )


async def _bounded(jobs: Iterable[Callable[[], Awaitable[None]]], window: int) -> None:
    """Run jobs with at most `window` in flight; the first failure cancels the rest."""
    gate = asyncio.Semaphore(window)

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    try:
        async with asyncio.TaskGroup() as group:
            for job in jobs:
                group.create_task(run(job))
    except BaseExceptionGroup as failed:
        errors = failed.exceptions
        first = next((e for e in errors if isinstance(e, LookupTableError)), errors[0])
        raise first from None


def _id_text(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(slots=True)
class _TableKeys:
    """The ids of one table found by metadump, per kind (each a list of per-node parts)."""

    parts: dict[str, list[IdArray]] = field(default_factory=lambda: {k: [] for k in ROW_KINDS})

    def ids(self, kind: str, id_type: str) -> IdArray:
        parts = self.parts[kind]
        if id_type == "int64":
            return (
                np.concatenate(cast("list[NDArray[np.int64]]", parts))
                if parts
                else np.empty(0, dtype=np.int64)
            )
        out = np.empty(sum(p.shape[0] for p in parts), dtype=object)
        if parts:
            out[:] = [x for p in parts for x in p.tolist()]
        return out


def _decode_ids(
    namespace: str, spec: TableSpec, kind: str, bodies: list[bytes], node: str
) -> IdArray:
    if spec.id_type == "int64":
        try:
            return decode_int_bodies(bodies)
        except KeyEncodingError:
            pass  # not all int ids: decode one by one for a precise error below
    ids = decode_bodies(namespace, spec.name, kind, bodies)
    want = int if spec.id_type == "int64" else str
    bad = next((x for x in ids if not isinstance(x, want)), None)
    if bad is not None:
        raise CheckpointError(
            f"table {spec.name!r} has id_type={spec.id_type!r} but memcached node {node} holds "
            f"a {type(bad).__name__} id {_id_text(bad)}; fix id_type in the cluster file"
        )
    if spec.id_type == "int64":
        return np.array(ids, dtype=np.int64)
    out = np.empty(len(ids), dtype=object)
    out[:] = ids
    return out


def _check_placement(
    spec: TableSpec, kind: str, ids: IdArray, node_index: int, nodes: Sequence[str]
) -> None:
    if ids.shape[0] == 0:
        return
    placed = node_of(spec.name, ids, nodes)
    wrong = np.flatnonzero(placed != node_index)
    if wrong.size:
        i = int(wrong[0])
        raise CheckpointError(
            f"{wrong.size} keys of table {spec.name!r} (kind {kind!r}, e.g. id "
            f"{_id_text(ids[i])}) are on memcached node {nodes[node_index]} but the cluster "
            f"file places them on {nodes[int(placed[i])]}: its `memcached` list is not the list "
            f"the data was written with; save with the original node list"
        )


# ================================================================ save


async def save_checkpoint(
    config: ClusterConfig,
    directory: str | os.PathLike[str],
    *,
    pause: bool = True,
    pause_timeout_s: float = DEFAULT_PAUSE_TIMEOUT_S,
    batch_ids: int = DEFAULT_BATCH_IDS,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Save the namespace of `config` into the new directory `directory`; return the manifest.

    Args:
        pause: pause every optimizer replica of `config` while reading (consistent).
        pause_timeout_s: the replicas resume by themselves after this long (a save
            that takes longer fails: its snapshot would not be consistent).
        batch_ids: ids per pipelined read (each is split by node).
        progress: a tqdm bar on stderr; None = only on a terminal.

    Raises:
        CheckpointError: the target exists, the data does not fit the config, or the
            replicas resumed before the save finished.
        DataLossError, ClusterNotInitializedError: a node lost its data / nothing to save.
        StoreError, NodeUnavailableError, PushRejectedError: memcached or a replica failed.
    """
    target = Path(directory)
    _check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    started = time.monotonic()
    created = datetime.datetime.now(datetime.UTC)
    try:
        async with EmbeddingStore(config) as store:
            await _require_intact(store)
            client = OptimizerClient(config, max_retries=2) if pause and config.optimizers else None
            if pause and client is None:
                logger.warning("no optimizer replicas in the cluster file: nothing to pause")
            try:
                if client is not None:
                    unfinished = await client.pause(timeout_s=pause_timeout_s)
                    if any(unfinished.values()):
                        raise CheckpointError(
                            "optimizer replicas are still finishing pushes whose memcached "
                            "write failed ("
                            + ", ".join(f"replica {k}: {n}" for k, n in unfinished.items() if n)
                            + "; see their logs): their rows are half written, so the "
                            "checkpoint would not be consistent. Fix the node they name "
                            "(lookup-table-admin stats) and save again"
                        )
                paused_at = time.monotonic()
                body = await _read_namespace(store, tmp, batch_ids=batch_ids, progress=progress)
                if client is not None and time.monotonic() - paused_at >= pause_timeout_s:
                    raise CheckpointError(
                        f"the save took longer than the pause ({pause_timeout_s:g} s): the "
                        f"replicas resumed during it, so it is not consistent; raise "
                        f"--pause-timeout-s"
                    )
            finally:
                if client is not None:
                    try:
                        await client.resume()
                    except LookupTableError as exc:
                        logger.warning(
                            "could not resume the optimizer replicas (they resume by "
                            "themselves after %g s): %s",
                            pause_timeout_s,
                            exc,
                        )
                    await client.close()
        read_s = time.monotonic() - started
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "namespace": config.namespace,
            "created": created.isoformat(timespec="seconds"),
            "created_unix": created.timestamp(),
            "nodes_at_save": len(config.memcached),
            "node_addresses_at_save": list(config.node_addresses),
            "paused": client is not None,
            "optimizer_replicas": len(config.optimizers),
            **body,
        }
        await asyncio.to_thread(_finalize, tmp, target, manifest)
        rows = sum(int(t["count"]) for t in manifest["tables"])
        seconds = time.monotonic() - started
        manifest["timing"] = {
            "seconds": seconds,
            "read_seconds": read_s,
            "rows_per_s": rows / seconds if seconds > 0 else 0.0,
        }
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


async def _require_intact(store: EmbeddingStore) -> None:
    sentinels = await store.sentinels()
    missing = [node for node, value in sentinels.items() if value is None]
    if len(missing) == len(sentinels):
        raise ClusterNotInitializedError(
            f"namespace {store.namespace!r} is not initialized on any node "
            f"({', '.join(store.nodes)}): nothing to save"
        )
    if missing:
        raise DataLossError(
            f"memcached nodes {', '.join(missing)} have lost their data (no sentinel): a "
            f"checkpoint now would be partial; restore an earlier checkpoint instead",
            nodes=tuple(missing),
        )


async def _read_namespace(
    store: EmbeddingStore, tmp: Path, *, batch_ids: int, progress: bool | None
) -> dict[str, Any]:
    """Enumerate and read everything into `tmp`; return the manifest's body."""
    config = store.config
    ns = config.namespace
    dumps = await _namespace_keys(store)
    by_table: dict[str, _TableKeys] = {t.name: _TableKeys() for t in config.tables}
    meta: dict[str, list[str]] = {}
    skipped: dict[str, int] = {}
    transient = 0
    for j, (node, found) in enumerate(dumps.items()):
        for (table, kind), int_ids in found.int_ids.items():
            _check_placement(config.table(table), kind, int_ids, j, store.nodes)
            by_table[table].parts[kind].append(int_ids)
        for (table, kind), bodies in found.bodies.items():
            if table in by_table and kind in ROW_KINDS:
                spec = config.table(table)
                ids = _decode_ids(ns, spec, kind, bodies, node)
                _check_placement(spec, kind, ids, j, store.nodes)
                by_table[table].parts[kind].append(ids)
            elif table == META_TABLE and kind in (Kind.META, Kind.JOURNAL):
                meta.setdefault(kind, []).extend(
                    str(x) for x in decode_bodies(ns, table, kind, bodies)
                )
            elif (table == META_TABLE and kind == Kind.PUSH_RECORD) or table == DENSE_TABLE:
                transient += len(bodies)  # push records; dense chunks are read via `current`
            else:
                skipped[f"{table}/{kind}"] = skipped.get(f"{table}/{kind}", 0) + len(bodies)
    for what, count in sorted(skipped.items()):
        logger.warning(
            "skipping %d keys of %s/%s: not a table of the cluster file", count, ns, what
        )

    plans = []
    total = 0
    for spec in config.tables:
        keys = by_table[spec.name]
        w_ids, s_ids = keys.ids(Kind.ROW, spec.id_type), keys.ids(Kind.SLOTS, spec.id_type)
        width = _slot_width(spec)
        if not width and s_ids.shape[0]:
            logger.warning(
                "table %r: %d slot values are not saved: its optimizer %r keeps no slots",
                spec.name,
                s_ids.shape[0],
                spec.optimizer.name,
            )
        if spec.id_type == "int64":
            merged = np.sort(np.concatenate([w_ids, s_ids]) if width else w_ids)
            if merged.shape[0] > 1:  # np.unique hashes: 50x slower than this here
                merged = merged[np.concatenate([[True], merged[1:] != merged[:-1]])]
            table_ids: IdArray = cast("NDArray[np.int64]", merged)
            enumerated_s = np.isin(table_ids, s_ids, assume_unique=True)
        else:
            strs = sorted(set(w_ids.tolist()) | set(s_ids.tolist()) if width else w_ids.tolist())
            str_ids = np.empty(len(strs), dtype=object)
            str_ids[:] = strs
            table_ids = str_ids
            s_set = set(s_ids.tolist())
            enumerated_s = np.fromiter((x in s_set for x in strs), dtype=bool, count=len(strs))
        plans.append((spec, table_ids, width, enumerated_s))
        total += table_ids.shape[0]

    tables: list[dict[str, Any]] = []
    with _progress(total, "save", progress) as bar:
        for spec, ids, width, enumerated_s in plans:
            tables.append(
                await _save_table(store, tmp, spec, ids, width, enumerated_s, batch_ids, bar)
            )
    dense = await _save_dense(store, tmp)
    versions = await _read_versions(store, meta.get("m", []))
    unfinished = await _unfinished_journals(store, meta.get("j", []))
    return {
        "config": {
            "tables": [
                {
                    "name": s.name,
                    "dim": s.dim,
                    "id_type": s.id_type,
                    "seed": s.seed,
                    "initializer": s.initializer.to_dict(),
                    "optimizer": s.optimizer.name,
                    "slot_width": _slot_width(s),
                }
                for s in config.tables
            ],
            "optimizer": config.optimizer.name,
            "mode": config.mode,
            "workers": config.workers,
        },
        "tables": tables,
        "dense": dense,
        "replica_versions": versions,
        "keys": {
            "skipped": skipped,
            "transient_skipped": transient,
            "unfinished_journals": unfinished,
        },
    }


async def _save_table(
    store: EmbeddingStore,
    tmp: Path,
    spec: TableSpec,
    ids: IdArray,
    width: int,
    enumerated_s: NDArray[np.bool_],
    batch_ids: int,
    bar: Any,
) -> dict[str, Any]:
    n = ids.shape[0]
    files = _table_files(spec.name, spec.id_type, width)
    if spec.id_type == "int64":
        _save(tmp / files["ids"], np.asarray(ids, dtype="<i8"))
    else:
        utf8, offsets = pack_str_ids(ids.tolist())
        _save(tmp / files["ids_utf8"], utf8)
        _save(tmp / files["ids_offsets"], offsets.astype("<i8"))
    # in memory, then written at once: filling a memory-mapped file page by page was 3x
    # slower here, and a table whose rows do not fit in memory does not fit metadump either
    rows = np.empty((n, spec.dim), dtype="<f4")
    slots = np.zeros((n, width), dtype="<f4") if width else None
    has_slots = np.zeros(n, dtype=bool)

    def batch(start: int) -> Callable[[], Awaitable[None]]:
        async def read() -> None:
            stop = min(start + batch_ids, n)
            part = ids[start:stop]
            if slots is not None:
                (values, found), (slot_values, hit) = await asyncio.gather(
                    store.get(spec.name, part, width=spec.dim, unique=True),
                    store.get(spec.name, part, kind=Kind.SLOTS, width=width, unique=True),
                )
                lost = np.flatnonzero(enumerated_s[start:stop] & ~hit)
                if lost.size:
                    _vanished(spec, "slots", part[int(lost[0])], lost.size)
                slots[start:stop] = slot_values
                has_slots[start:stop] = hit
            else:
                values, found = await store.get(spec.name, part, width=spec.dim, unique=True)
            if not found.all():
                lost = np.flatnonzero(~found)
                _vanished(spec, "row", part[int(lost[0])], lost.size)
            rows[start:stop] = values
            bar.update(stop - start)

        return read

    await _bounded((batch(s) for s in range(0, n, batch_ids)), _WINDOW)
    await asyncio.to_thread(_save, tmp / files["rows"], rows)
    if slots is not None:
        await asyncio.to_thread(_save, tmp / files["slots"], slots)
        _save(tmp / files["has_slots"], has_slots)
    return {
        "name": spec.name,
        "dim": spec.dim,
        "id_type": spec.id_type,
        "optimizer": spec.optimizer.name,
        "slot_width": width,
        "count": n,
        "with_slots": int(np.count_nonzero(has_slots)) if width else 0,
        "files": files,
    }


def _vanished(spec: TableSpec, what: str, example: object, count: int) -> None:
    raise CheckpointError(
        f"{count} {what} value(s) of table {spec.name!r} (e.g. id {_id_text(example)}) were "
        f"listed by metadump but are gone when read: something deleted them during the save "
        f"(a flushed node is reported as DataLossError); save again"
    )


async def _save_dense(store: EmbeddingStore, tmp: Path) -> dict[str, Any] | None:
    optimizer = make_optimizer(store.config.optimizer)
    state = await DenseParams(store, optimizer).read(with_slots=True)
    if state is None:
        return None
    stems = dense_file_stems(state.params)
    params = []
    for name in sorted(state.params):
        value = np.asarray(state.params[name], dtype="<f4")
        slot = np.asarray(state.slots[name], dtype="<f4")
        file, slots_file = f"dense/{stems[name]}.npy", f"dense_slots/{stems[name]}.npy"
        _save(tmp / file, value)
        _save(tmp / slots_file, slot)
        params.append(
            {
                "name": name,
                "shape": list(value.shape),
                "file": file,
                "slots_shape": list(slot.shape),
                "slots_file": slots_file,
            }
        )
    return {
        "version": state.version,
        "optimizer": store.config.optimizer.name,
        "params": params,
    }


async def _read_versions(store: EmbeddingStore, meta_ids: list[str]) -> dict[str, int]:
    wanted = sorted(i for i in meta_ids if version_replica(i) is not None)
    if not wanted:
        return {}
    values = await store.get_blobs(META_TABLE, wanted, kind=Kind.META)
    out: dict[str, int] = {}
    for name, raw in zip(wanted, values, strict=True):
        replica = version_replica(name)
        if raw is None or replica is None:
            continue
        try:
            out[str(replica)] = int(raw)
        except ValueError:
            raise CheckpointError(
                f"version key {name!r} holds {raw[:40]!r}, not an integer"
            ) from None
    return out


async def _unfinished_journals(store: EmbeddingStore, journal_ids: list[str]) -> int:
    headers = sorted(i for i in journal_ids if is_journal_header(i))
    if not headers:
        return 0
    values = await store.get_blobs(META_TABLE, headers, kind=Kind.JOURNAL)
    busy = [h for h, v in zip(headers, values, strict=True) if v]
    if busy:
        logger.warning(
            "%d journaled pushes were not finished (%s): the checkpoint may miss them; "
            "restart the replicas that own them before saving if that matters",
            len(busy),
            ", ".join(busy),
        )
    return len(busy)


# ================================================================ restore


async def restore_checkpoint(
    config: ClusterConfig,
    directory: str | os.PathLike[str],
    *,
    force: bool = False,
    pause: bool = True,
    batch_ids: int = DEFAULT_BATCH_IDS,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint into the namespace and nodes of `config`; return a summary.

    Running optimizer replicas are paused for the restore (no push mixes old and restored
    rows) and then resumed with a reload, so they serve the restored version without a
    restart; replicas that are not running load it when they start.

    Args:
        force: replace a namespace that already holds data (its keys are deleted first).
        pause: pause and reload the running replicas (false: leave them alone; restart
            them afterwards).
        batch_ids: ids per pipelined write (each is split by node).
        progress: a tqdm bar on stderr; None = only on a terminal.

    Raises:
        CheckpointError: the checkpoint is partial, corrupt or does not fit `config`
            (nothing was written).
        NamespaceNotEmptyError: the namespace holds data and `force` is false.
        StoreError, NodeUnavailableError: memcached failed part-way; the namespace
            then has no sentinels (trainers get DataLossError): restore again with force.
    """
    root = Path(directory)
    started = time.monotonic()
    manifest = await asyncio.to_thread(verify_checkpoint, root)
    for warning in check_compatible(manifest, config):
        logger.warning("%s", warning)
    ns = config.namespace
    async with (
        EmbeddingStore(config, check_sentinels=False) as store,
        _PausedReplicas(config, enabled=pause) as replicas,
    ):
        dumps = await _namespace_keys(store)
        sentinel_body = sentinel_key(ns).rsplit(b"/", 1)[1]
        data = {
            node: found.count - found.bodies.get((META_TABLE, Kind.META), []).count(sentinel_body)
            for node, found in dumps.items()
        }
        if any(data.values()) and not force:
            where = ", ".join(f"{node}: {n}" for node, n in data.items() if n)
            raise NamespaceNotEmptyError(
                f"namespace {ns!r} already holds {sum(data.values())} keys ({where}); restore "
                f"into a new namespace, or pass --force to delete them and restore over them"
            )
        await replicas.drop_unfinished()
        deleted = 0
        for spec in config.memcached:
            keys = dumps[spec.address].keys(ns)
            if keys:
                deleted += await commands.delete_keys(spec, config.store, keys)
        try:
            summary = await _write_checkpoint(
                store, root, manifest, batch_ids=batch_ids, progress=progress
            )
            written = await store.write_sentinels()
        except BaseException:
            logger.error(
                "restore of %s into namespace %r failed part-way: the namespace has no "
                "sentinels (trainers get DataLossError); run the restore again with --force",
                root,
                ns,
            )
            raise
    seconds = time.monotonic() - started
    rows = summary["rows"]
    return {
        **summary,
        "namespace": ns,
        "checkpoint_namespace": manifest["namespace"],
        "nodes": list(config.node_addresses),
        "deleted_keys": deleted,
        "sentinels": written,
        "replicas_reloaded": replicas.paused,
        "replicas_not_running": replicas.unreachable,
        "seconds": seconds,
        "rows_per_s": rows / seconds if seconds > 0 else 0.0,
    }


class _PausedReplicas:
    """Pause the optimizer replicas that answer; on exit, resume them with a reload.

    A replica that does not answer is not running (or not reachable): it reads the
    restored version when it starts. A replica that answers but refuses (e.g. a wrong
    token) stops the restore before anything is written.
    """

    def __init__(self, config: ClusterConfig, *, enabled: bool) -> None:
        self.config = config
        self.enabled = enabled and bool(config.optimizers)
        self.paused: list[str] = []
        self.unreachable: list[str] = []
        self._client: OptimizerClient | None = None
        self._indexes: list[int] = []

    async def __aenter__(self) -> _PausedReplicas:
        if not self.enabled:
            return self
        self._client = OptimizerClient(self.config, max_retries=1, backoff_s=0.2)
        try:
            for k, url in enumerate(self.config.optimizers):
                try:
                    await self._client.pause(timeout_s=DEFAULT_PAUSE_TIMEOUT_S, replicas=[k])
                except NodeUnavailableError as exc:
                    logger.warning("replica %d (%s) not paused: %s", k, url, exc)
                    self.unreachable.append(url)
                else:
                    self.paused.append(url)
                    self._indexes.append(k)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def drop_unfinished(self) -> None:
        """Cancel the paused replicas' background replays of failed writes: the restore
        replaces their rows, and they must not write pre-restore rows over it."""
        if self._client is not None and self._indexes:
            await self._client.pause(
                timeout_s=DEFAULT_PAUSE_TIMEOUT_S, replicas=self._indexes, drop_unfinished=True
            )

    async def __aexit__(self, *exc: object) -> None:
        if self._client is None:
            return
        try:
            if self._indexes:
                await self._client.resume(reload=True, replicas=self._indexes)
        except LookupTableError as exc:
            logger.warning(
                "could not resume the optimizer replicas %s (they resume by themselves after "
                "%g s; restart them to load the restored version): %s",
                self.paused,
                DEFAULT_PAUSE_TIMEOUT_S,
                exc,
            )
        finally:
            await self._client.close()
            self._client = None


async def _write_checkpoint(
    store: EmbeddingStore,
    root: Path,
    manifest: Mapping[str, Any],
    *,
    batch_ids: int,
    progress: bool | None,
) -> dict[str, Any]:
    rows_total = sum(int(t["count"]) for t in manifest["tables"])
    slots_total = 0
    with _progress(rows_total, "restore", progress) as bar:
        for t in manifest["tables"]:
            slots_total += await _restore_table(store, root, t, batch_ids, bar)
    dense = manifest.get("dense")
    if dense is not None:
        params = {
            p["name"]: np.array(_load(root, p["file"]), dtype=np.float32) for p in dense["params"]
        }
        slots = {
            p["name"]: np.array(_load(root, p["slots_file"]), dtype=np.float32)
            for p in dense["params"]
        }
        await DenseParams(store, make_optimizer(store.config.optimizer)).write(
            int(dense["version"]), params, slots
        )
    versions: Mapping[str, int] = manifest.get("replica_versions", {})
    if versions:
        await store.set_blobs(
            META_TABLE,
            [f"version-r{k}" for k in versions],
            [str(int(v)).encode() for v in versions.values()],
            kind=Kind.META,
        )
    return {
        "rows": rows_total,
        "slots": slots_total,
        "tables": len(manifest["tables"]),
        "dense_params": len(dense["params"]) if dense is not None else 0,
        "dense_version": int(dense["version"]) if dense is not None else None,
        "replica_versions": dict(versions),
    }


async def _restore_table(
    store: EmbeddingStore, root: Path, t: Mapping[str, Any], batch_ids: int, bar: Any
) -> int:
    name, n, width = t["name"], int(t["count"]), int(t["slot_width"])
    if n == 0:
        return 0
    ids = _table_ids(root, t)
    rows = _load(root, t["files"]["rows"])
    slots = _load(root, t["files"]["slots"]) if width else None
    has_slots = np.asarray(_load(root, t["files"]["has_slots"])) if width else None

    def batch(start: int) -> Callable[[], Awaitable[None]]:
        async def write() -> None:
            stop = min(start + batch_ids, n)
            jobs = [store.set(name, ids[start:stop], np.asarray(rows[start:stop]))]
            if slots is not None and has_slots is not None:
                pick = np.flatnonzero(has_slots[start:stop]) + start
                if pick.size:
                    jobs.append(
                        store.set(name, ids[pick], np.asarray(slots[pick]), kind=Kind.SLOTS)
                    )
            await asyncio.gather(*jobs)
            bar.update(stop - start)

        return write

    await _bounded((batch(s) for s in range(0, n, batch_ids)), _WINDOW)
    return int(np.count_nonzero(has_slots)) if has_slots is not None else 0


# ================================================================ export


def export_checkpoint(
    directory: str | os.PathLike[str], out: str | os.PathLike[str]
) -> dict[str, Any]:
    """Write every table's ids and rows (and the dense parameters) into one `.npz`.

    Arrays: `<table>/ids` (int64) or `<table>/ids_utf8` + `<table>/ids_offsets`
    (string ids, as in the checkpoint), `<table>/rows` float32 (n, dim),
    `_dense/<param name>` and `manifest.json` (the manifest as UTF-8 bytes).
    Readable with `np.load(out, allow_pickle=False)`; written to a temporary file
    and renamed.

    Raises:
        CheckpointError: the checkpoint is partial or corrupt.
    """
    root = Path(directory)
    manifest = verify_checkpoint(root)
    arrays: dict[str, NDArray[Any]] = {}
    for t in manifest["tables"]:
        for key, file in t["files"].items():
            if key in ("ids", "ids_utf8", "ids_offsets", "rows"):
                arrays[f"{t['name']}/{key}"] = _load(root, file)
    dense = manifest.get("dense")
    if dense is not None:
        for p in dense["params"]:
            arrays[f"{DENSE_TABLE}/{p['name']}"] = _load(root, p["file"])
    arrays[MANIFEST] = np.frombuffer(json.dumps(manifest).encode("utf-8"), dtype=np.uint8)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            savez: Callable[..., None] = np.savez  # its stub types **kwds as allow_pickle
            savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "out": str(target),
        "bytes": target.stat().st_size,
        "tables": {t["name"]: int(t["count"]) for t in manifest["tables"]},
        "dense_params": len(dense["params"]) if dense is not None else 0,
    }


# ================================================================ CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lookup-table-checkpoint", description=(__doc__ or "").split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="save the namespace into a new directory")
    restore = sub.add_parser("restore", help="restore a checkpoint into the cluster file's nodes")
    export = sub.add_parser("export", help="write ids and rows of every table into one .npz")
    for cmd in (save, restore):
        cmd.add_argument("--config", required=True, help="the cluster file (TOML)")
        cmd.add_argument("--dir", required=True, help="the checkpoint directory")
        cmd.add_argument(
            "--batch-ids",
            type=int,
            default=DEFAULT_BATCH_IDS,
            help=f"ids per pipelined batch (default {DEFAULT_BATCH_IDS})",
        )
        cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    save.add_argument(
        "--no-pause",
        action="store_true",
        help="do not pause the optimizer replicas (the checkpoint may mix versions)",
    )
    save.add_argument(
        "--pause-timeout-s",
        type=float,
        default=DEFAULT_PAUSE_TIMEOUT_S,
        help="replicas resume by themselves after this (default 3600)",
    )
    restore.add_argument(
        "--no-pause",
        action="store_true",
        help="do not pause and reload the running optimizer replicas (restart them after)",
    )
    restore.add_argument(
        "--force",
        action="store_true",
        help="delete the namespace's keys first if it already holds data",
    )
    export.add_argument("--dir", required=True, help="the checkpoint directory")
    export.add_argument("--out", required=True, help="the .npz to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    progress = False if getattr(args, "no_progress", False) else None
    try:
        if args.command == "save":
            if args.batch_ids < 1:
                raise ConfigError(f"--batch-ids must be >= 1, got {args.batch_ids}")
            config = load_config(args.config)
            manifest = asyncio.run(
                save_checkpoint(
                    config,
                    args.dir,
                    pause=not args.no_pause,
                    pause_timeout_s=args.pause_timeout_s,
                    batch_ids=args.batch_ids,
                    progress=progress,
                )
            )
            rows = sum(int(t["count"]) for t in manifest["tables"])
            slots = sum(int(t["with_slots"]) for t in manifest["tables"])
            timing = manifest["timing"]
            dense = manifest["dense"]
            print(
                f"saved namespace {config.namespace!r} to {args.dir}: {rows:,} rows, "
                f"{slots:,} slots in {len(manifest['tables'])} tables, "
                f"{len(dense['params']) if dense else 0} dense params "
                f"(version {dense['version'] if dense else '-'}), "
                f"{'paused' if manifest['paused'] else 'NOT paused'}; "
                f"{timing['seconds']:.2f} s, {timing['rows_per_s']:,.0f} rows/s"
            )
        elif args.command == "restore":
            if args.batch_ids < 1:
                raise ConfigError(f"--batch-ids must be >= 1, got {args.batch_ids}")
            config = load_config(args.config)
            summary = asyncio.run(
                restore_checkpoint(
                    config,
                    args.dir,
                    force=args.force,
                    pause=not args.no_pause,
                    batch_ids=args.batch_ids,
                    progress=progress,
                )
            )
            print(
                f"restored {args.dir} into namespace {config.namespace!r} on "
                f"{len(summary['nodes'])} node(s): {summary['rows']:,} rows, "
                f"{summary['slots']:,} slots, {summary['dense_params']} dense params; "
                f"{summary['seconds']:.2f} s, {summary['rows_per_s']:,.0f} rows/s"
                + (f" (deleted {summary['deleted_keys']:,} old keys)" if args.force else "")
            )
            if summary["replicas_reloaded"]:
                print(
                    "optimizer replicas paused, reloaded and resumed: "
                    + ", ".join(summary["replicas_reloaded"])
                )
            if summary["replicas_not_running"]:
                print(
                    "optimizer replicas not reached (they load the restored version when they "
                    "start): " + ", ".join(summary["replicas_not_running"])
                )
            elif config.optimizers and args.no_pause:
                print("restart the optimizer replicas: they load their version at startup")
        else:
            result = export_checkpoint(args.dir, args.out)
            print(
                f"exported {args.dir} to {result['out']} ({result['bytes']:,} bytes): "
                + ", ".join(f"{name} {n:,} rows" for name, n in result["tables"].items())
            )
    except (LookupTableError, OSError) as exc:
        print(f"lookup-table-checkpoint {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
