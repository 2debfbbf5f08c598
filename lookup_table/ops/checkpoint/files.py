"""A checkpoint's files on disk: `.npy` arrays, sha256 and fsync, the atomic rename.

A save writes into a temporary sibling directory; `finalize` hashes and fsyncs
every file, writes `manifest.json` last and only then renames the directory into
place, so a crash never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
from lookup_table.errors import CheckpointError
from lookup_table.ops.checkpoint.format import MANIFEST, expected_arrays, unpack_str_ids

__all__ = [
    "check_target",
    "file_sha256",
    "finalize",
    "load_array",
    "npy_header",
    "save_array",
    "table_ids",
]

_HASH_CHUNK = 1 << 22


def npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype[Any]]:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    if fortran:
        raise ValueError("Fortran order is not used by checkpoints")
    return tuple(shape), dtype


def load_array(directory: Path, name: str) -> NDArray[Any]:
    """A checkpoint array, memory-mapped (read-only) when it has data."""
    path = directory / name
    shape, _ = npy_header(path)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return cast("NDArray[Any]", np.load(path, allow_pickle=False))
    return cast("NDArray[Any]", np.load(path, mmap_mode="r", allow_pickle=False))


def save_array(path: Path, array: NDArray[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)


def file_sha256(path: Path, *, sync: bool = False) -> tuple[str, int]:
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
        digest, size = file_sha256(path, sync=True)
        out[path.relative_to(root).as_posix()] = {"sha256": digest, "bytes": size}
    for directory in sorted({p.parent for p in root.rglob("*")} | {root}):
        _fsync_dir(directory)
    return out


def finalize(tmp: Path, target: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every file, write manifest.json last, then rename `tmp` to `target`."""
    manifest["files"] = _hash_files(tmp)
    expected_arrays(manifest)  # the manifest describes what was written
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


def check_target(target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"{target} already exists and is not an empty directory; save into a new "
            f"directory (checkpoints are never overwritten)"
        )


def table_ids(root: Path, t: Mapping[str, Any]) -> IdArray:
    files = t["files"]
    if t["id_type"] == "int64":
        return np.asarray(load_array(root, files["ids"]), dtype=np.int64)
    try:
        return unpack_str_ids(
            np.asarray(load_array(root, files["ids_utf8"])),
            np.asarray(load_array(root, files["ids_offsets"])),
        )
    except ValueError as exc:
        raise CheckpointError(f"{root / files['ids_utf8']}: {exc}") from None
