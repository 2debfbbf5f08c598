"""Check a checkpoint directory completely before anything trusts it.

`verify_checkpoint` reads the manifest (present, valid JSON, format and version,
every field), then every data file it promises (present, size, sha256, dtype,
shape) and the content that the shapes cannot show (ids ascending, string-id
offsets, slot counts). A restore and an export run it first and write nothing
when it fails.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lookup_table.errors import CheckpointError
from lookup_table.ops.checkpoint.files import file_sha256, load_array, npy_header
from lookup_table.ops.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    expected_arrays,
)

__all__ = ["verify_checkpoint"]


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
        expected = expected_arrays(manifest)
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
            digest, _ = file_sha256(path)
            if digest != info["sha256"]:
                raise CheckpointError(
                    f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                    f"{str(info['sha256'])[:16]}...: the file is corrupt"
                )
    for name, (dtype, shape) in expected.items():
        path = root / name
        try:
            got_shape, got_dtype = npy_header(path)
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
        ids = load_array(root, files["ids"])
        if ids.shape[0] > 1 and not (np.diff(ids) > 0).all():
            raise CheckpointError(f"{root / files['ids']}: ids are not strictly ascending")
    else:
        offsets = load_array(root, files["ids_offsets"])
        utf8 = load_array(root, files["ids_utf8"])
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
        with_slots = int(np.count_nonzero(load_array(root, files["has_slots"])))
        if with_slots != int(t.get("with_slots", with_slots)):
            raise CheckpointError(
                f"{root / files['has_slots']}: {with_slots} rows with slots, the manifest says "
                f"{t['with_slots']}"
            )
