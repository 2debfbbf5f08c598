"""The checkpoint format: its names, the manifest's promises, string-id packing, fit.

Format version 1 is a directory of numpy `.npy` files (never pickled) and
`manifest.json`, written last; docs/checkpoints.md#format lists every file. Pure: no I/O
(`files` reads and writes them, `verify` checks a directory).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig, TableSpec
from lookup_table.core.optimizers import make_optimizer, slot_width
from lookup_table.core.precision import MAX_FINITE, ROW_DTYPES, RowDtype, decode, encode
from lookup_table.errors import CheckpointError, ConfigError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "check_compatible",
    "check_fits",
    "slot_layout",
    "dense_file_stems",
    "expected_arrays",
    "pack_str_ids",
    "rows_for_file",
    "rows_from_file",
    "table_dtype",
    "table_files",
    "unpack_str_ids",
]

FORMAT = "lookup-table-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# a table's rows file holds its rows as stored: float32, float16, or bfloat16's bits
# (numpy has no bfloat16); the manifest's `dtype` says which (none: float32)
ROWS_FILE_DTYPES: dict[str, str] = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def table_dtype(t: Mapping[str, Any]) -> RowDtype:
    """The row dtype a manifest's table records (float32 when it records none)."""
    dtype: object = t.get("dtype", "float32")
    for known in ROW_DTYPES:
        if dtype == known:
            return known
    raise CheckpointError(
        f"{MANIFEST}: table {t.get('name')!r} has dtype {dtype!r}, expected one of "
        f"{', '.join(ROW_DTYPES)} (a checkpoint of a newer version?)"
    )


def rows_for_file(rows: NDArray[np.float32], dtype: RowDtype) -> NDArray[Any]:
    """float32 rows (as the store gives them: exactly `dtype`'s values) as the rows file
    holds them (`ROWS_FILE_DTYPES`)."""
    words = encode(rows, dtype)
    return words.view("<f2") if dtype == "float16" else words


def rows_from_file(rows: NDArray[Any], dtype: RowDtype) -> NDArray[np.float32]:
    """The float32 rows of (a slice of) a rows file of `dtype`, exactly."""
    if dtype == "float32":
        return np.asarray(rows, dtype=np.float32)
    return decode(np.ascontiguousarray(rows).view("<u2"), dtype)


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


def table_files(name: str, id_type: str, width: int) -> dict[str, str]:
    base = f"tables/{name}/"
    files = (
        {"ids": base + "ids.npy"}
        if id_type == "int64"
        else {"ids_utf8": base + "ids_utf8.npy", "ids_offsets": base + "ids_offsets.npy"}
    )
    files["rows"] = base + "rows.npy"
    if width:
        files["slots"] = base + "slots.npy"
        files["has_slots"] = base + "has_slots.npy"
    return files


def expected_arrays(manifest: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """Every data file the manifest promises: path -> (dtype, shape; None = any 1-D)."""
    out: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for t in manifest["tables"]:
        n, dim, width = int(t["count"]), int(t["dim"]), int(t["slot_width"])
        files = t["files"]
        if files != table_files(t["name"], t["id_type"], width):
            raise CheckpointError(
                f"{MANIFEST}: table {t['name']!r} lists files {sorted(files.values())}, "
                f"expected {sorted(table_files(t['name'], t['id_type'], width).values())}"
            )
        if t["id_type"] == "int64":
            out[files["ids"]] = ("<i8", (n,))
        else:
            out[files["ids_utf8"]] = ("|u1", None)
            out[files["ids_offsets"]] = ("<i8", (n + 1,))
        out[files["rows"]] = (ROWS_FILE_DTYPES[table_dtype(t)], (n, dim))
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
        width = slot_width(spec)
        if width != int(t["slot_width"]) or (width and spec.optimizer.name != t["optimizer"]):
            raise CheckpointError(
                f"table {name!r}: the checkpoint's slots are {t['optimizer']} slots of "
                f"{t['slot_width']} floats per row, but the cluster file's optimizer "
                f"{spec.optimizer.name!r} keeps {width}; restore with optimizer "
                f"{t['optimizer']!r} for this table"
            )
        saved_slots = t.get("slots")
        if saved_slots is not None and saved_slots != slot_layout(spec):
            raise CheckpointError(
                f"table {name!r}: the checkpoint's slots are stored as {saved_slots}, the "
                f"cluster file's optimizer keeps {slot_layout(spec)} (another momentum_dtype?); "
                f"restore with the optimizer settings it was saved with"
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


def slot_layout(spec: TableSpec) -> list[list[Any]]:
    """How a table's slots are stored (name, width, dtype), as a manifest records them."""
    return [
        [slot.name, slot.width, slot.dtype]
        for slot in make_optimizer(spec.optimizer).slot_storage(spec.dim)
        if slot.width
    ]


def check_fits(table: str, rows: NDArray[Any], saved: RowDtype, target: RowDtype) -> None:
    """Refuse restoring rows of dtype `saved` into a table of dtype `target` whose range
    does not hold them (bfloat16 or float32 values beyond float16's 65504).

    Raises:
        CheckpointError: naming the table, the largest value and what to do.
    """
    if MAX_FINITE[target] >= MAX_FINITE[saved] or not rows.size:
        return
    biggest = float(np.max(np.abs(rows_from_file(rows, saved))))
    if biggest > MAX_FINITE[target]:
        raise CheckpointError(
            f"table {table!r}: the checkpoint holds a row value of magnitude {biggest:g}, "
            f"beyond {target}'s largest ({MAX_FINITE[target]:g}); nothing was written. "
            f'Restore it into dtype = "bfloat16" or "float32" (the table\'s dtype in '
            f"the cluster file)"
        )
