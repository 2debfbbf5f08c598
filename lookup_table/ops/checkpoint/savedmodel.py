"""Export a checkpoint as a TF SavedModel (`lookup-table-checkpoint export --format savedmodel`).

The model's architecture comes from a Keras model (the command line loads the
file `model.save("model.keras")` wrote), its embedding rows from the checkpoint,
and its dense weights from the checkpoint (`dense="checkpoint"`: the trained
weights the save read from the cluster, matched by variable path as the trainer
pushed them) or from the model as it is (`dense="model"`).
`lookup_table.serving.write_saved_model` writes the SavedModel (docs/serving.md says
what it holds and how it serves).

TensorFlow is imported only when an export runs: `save` and `restore` never load it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lookup_table.config import TableSpec
from lookup_table.core.initializers import InitializerSpec
from lookup_table.core.precision import itemsize
from lookup_table.errors import CheckpointError, ConfigError
from lookup_table.ops.checkpoint.files import load_array, npy_header, table_ids
from lookup_table.ops.checkpoint.format import rows_from_file, table_dtype
from lookup_table.ops.checkpoint.verify import verify_checkpoint

if TYPE_CHECKING:
    import keras

    from lookup_table.serving import TableRows, Unseen

__all__ = ["checkpoint_rows", "export_checkpoint_saved_model"]

DENSE_SOURCES = ("checkpoint", "model")


def checkpoint_rows(
    directory: str | os.PathLike[str],
    *,
    tables: Iterable[str] | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> dict[str, TableRows]:
    """The ids and rows of a checkpoint's tables, for `export_saved_model(rows=...)`
    and `write_saved_model`.

    Rows are memory-mapped (read when the export copies them); string ids are
    unpacked into str. The specs (dim, id type, seed, initializer) are the saved
    cluster file's, which unseen ids need.

    Args:
        tables: only these tables (default: every table of the checkpoint).
        manifest: the checkpoint's manifest, already verified (default: verify now).

    Raises:
        CheckpointError: the checkpoint is partial or corrupt, or lacks a table.
    """
    from lookup_table.serving import TableRows

    root = Path(directory)
    if manifest is None:
        manifest = verify_checkpoint(root)
    saved = {t["name"]: t for t in manifest["tables"]}
    wanted = list(saved) if tables is None else list(tables)
    out: dict[str, TableRows] = {}
    for name in wanted:
        if name not in saved:
            raise CheckpointError(
                f"{root}: table {name!r} is not in the checkpoint (it has {sorted(saved)})"
            )
        t = saved[name]
        out[name] = TableRows(
            spec=_spec(root, manifest, t),
            ids=table_ids(root, t),
            rows=rows_from_file(load_array(root, t["files"]["rows"]), table_dtype(t)),
        )
    return out


def _spec(root: Path, manifest: Mapping[str, Any], t: Mapping[str, Any]) -> TableSpec:
    """The table's spec as the saved cluster file had it."""
    configured = {c["name"]: c for c in manifest.get("config", {}).get("tables", [])}
    c = configured.get(t["name"])
    if c is None:
        raise CheckpointError(
            f"{root}: the manifest has no config for table {t['name']!r} (its seed and initializer)"
        )
    try:
        initializer = InitializerSpec.from_dict(c["initializer"], where=f"{t['name']}.initializer")
        return TableSpec(
            name=t["name"],
            dim=int(t["dim"]),
            seed=int(c["seed"]),
            id_type=t["id_type"],
            initializer=initializer,
            dtype=table_dtype(t),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{root}: table {t['name']!r}: bad config in the manifest: {exc}"
        ) from None


def _estimate(root: Path, t: Mapping[str, Any]) -> int:
    from lookup_table.serving import estimate_export_bytes

    id_bytes = 0
    if t["id_type"] == "string":
        id_bytes = int(np.prod(npy_header(root / t["files"]["ids_utf8"])[0]))
    return estimate_export_bytes(
        count=int(t["count"]),
        dim=int(t["dim"]),
        id_type=t["id_type"],
        id_bytes=id_bytes,
        itemsize=itemsize(table_dtype(t)),
    )


def _assign_dense(root: Path, manifest: Mapping[str, Any], model: keras.Model) -> int:
    """Set the model's trainable weights to the checkpoint's dense parameters."""
    dense = manifest.get("dense")
    if dense is None:
        raise CheckpointError(
            f"{root}: the checkpoint holds no dense parameters; export with --dense model "
            f"(dense='model') to keep the model's own weights"
        )
    params = {p["name"]: p for p in dense["params"]}
    variables = {v.path: v for v in model.trainable_variables}
    if set(params) != set(variables):
        raise CheckpointError(
            f"{root}: the checkpoint's dense parameters do not fit the model: not in the "
            f"checkpoint {sorted(set(variables) - set(params))[:5]}, not in the model "
            f"{sorted(set(params) - set(variables))[:5]}; export the model this checkpoint "
            f"trained, or with --dense model (dense='model')"
        )
    values = {}
    for name, var in variables.items():
        value = np.asarray(load_array(root, params[name]["file"]), np.float32)
        if tuple(value.shape) != tuple(var.shape):
            raise CheckpointError(
                f"{root}: dense parameter {name!r} has shape {value.shape} in the checkpoint "
                f"but {tuple(var.shape)} in the model"
            )
        values[name] = value
    for name, var in variables.items():
        var.assign(values[name])
    return len(values)


def export_checkpoint_saved_model(
    directory: str | os.PathLike[str],
    model: keras.Model,
    out: str | os.PathLike[str],
    *,
    dense: str = "checkpoint",
    unseen: Unseen = "initializer",
    memory_limit_bytes: int | None = None,
) -> dict[str, Any]:
    """Write `model` with the checkpoint's rows (and dense weights) as a TF SavedModel.

    Checks the checkpoint and the memory the export needs before it loads a row or
    writes anything. With `dense="checkpoint"` the model's trainable weights are
    set to the checkpoint's dense parameters (matched by variable path).

    Returns:
        What `write_saved_model` returns, plus "dense": the source of the weights.

    Raises:
        CheckpointError: a partial or corrupt checkpoint, a table or dense parameter
            of the model it lacks.
        ExportTooLargeError: the export would not fit in memory.
        ConfigError: see `write_saved_model`.
    """
    from lookup_table.layer import distributed_layers
    from lookup_table.serving import check_export_memory, write_saved_model

    if dense not in DENSE_SOURCES:
        raise ConfigError(f"dense must be 'checkpoint' or 'model', got {dense!r}")
    root = Path(directory)
    manifest = verify_checkpoint(root)
    saved = {t["name"]: t for t in manifest["tables"]}
    wanted = sorted({layer.table for layer in distributed_layers(model)})
    missing = [name for name in wanted if name not in saved]
    if missing:
        raise CheckpointError(
            f"{root}: the model's tables {missing} are not in the checkpoint "
            f"(it has {sorted(saved)})"
        )
    needed = sum(_estimate(root, saved[name]) for name in wanted)
    check_export_memory(needed, limit_bytes=memory_limit_bytes, what=f"exporting {root}")
    if dense == "checkpoint":
        _assign_dense(root, manifest, model)
    rows = checkpoint_rows(root, tables=wanted, manifest=manifest)
    result = write_saved_model(model, out, rows, unseen=unseen)
    result["dense"] = dense
    return result
