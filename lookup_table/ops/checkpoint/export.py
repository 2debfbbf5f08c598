"""Export a checkpoint into one `.npz` (`lookup-table-checkpoint export`).

The `.npz` holds every table's ids and rows and the dense parameters, and
`np.load(path, allow_pickle=False)` reads it without memcached.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keyspace import DENSE_TABLE
from lookup_table.ops.checkpoint.files import load_array
from lookup_table.ops.checkpoint.format import MANIFEST, rows_from_file, table_dtype
from lookup_table.ops.checkpoint.verify import verify_checkpoint

__all__ = ["export_checkpoint"]


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
            if key in ("ids", "ids_utf8", "ids_offsets"):
                arrays[f"{t['name']}/{key}"] = load_array(root, file)
        # float32, whatever the table's dtype: the 16-bit values are float32's exactly
        arrays[f"{t['name']}/rows"] = rows_from_file(
            load_array(root, t["files"]["rows"]), table_dtype(t)
        )
    dense = manifest.get("dense")
    if dense is not None:
        for p in dense["params"]:
            arrays[f"{DENSE_TABLE}/{p['name']}"] = load_array(root, p["file"])
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
