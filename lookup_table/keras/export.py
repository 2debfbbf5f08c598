"""Export a trained model as a TF SavedModel that serves without this project.

`export_saved_model`: the rows come from a snapshot of the model's cluster (a
checkpoint, `ops/`), a checkpoint given (`checkpoint_rows`), or chosen ids read while the
replicas are paused, always after the model's own pushes.
`export_checkpoint_saved_model`: a checkpoint's rows and dense weights
(`lookup-table-checkpoint export --format savedmodel`). `lookup_table.keras.serving`
writes the SavedModel (docs/serving.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import keras
import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig, TableSpec
from lookup_table.core.initializers import InitializerSpec
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.core.precision import itemsize
from lookup_table.errors import CheckpointError, ConfigError
from lookup_table.keras.fit import RemoteOptimizer
from lookup_table.keras.layer import DistributedEmbedding, distributed_layers
from lookup_table.keras.serving import (
    TableRows,
    Unseen,
    check_export,
    check_export_memory,
    check_reproducible,
    check_rows,
    estimate_export_bytes,
    write_saved_model,
)
from lookup_table.keras.session import TrainingSession
from lookup_table.ops.checkpoint import save_checkpoint
from lookup_table.ops.checkpoint.files import load_array, npy_header, table_ids
from lookup_table.ops.checkpoint.format import rows_from_file, table_dtype
from lookup_table.ops.checkpoint.pipeline import run_blocking
from lookup_table.ops.checkpoint.save import paused_replicas
from lookup_table.ops.checkpoint.verify import verify_checkpoint
from lookup_table.store import EmbeddingStore, TableRead

__all__ = ["checkpoint_rows", "export_checkpoint_saved_model", "export_saved_model"]

logger = logging.getLogger(__name__)


def export_saved_model(
    model: keras.Model,
    path: str | os.PathLike[str],
    *,
    rows: Mapping[str, TableRows] | None = None,
    config: ClusterConfig | None = None,
    ids: Mapping[str, Any] | None = None,
    unseen: Unseen = "initializer",
    memory_limit_bytes: int | None = None,
) -> dict[str, Any]:
    """Write `model` as a TF SavedModel that serves without this project (docs/serving.md).

    The rows of its `DistributedEmbedding` tables come from exactly one source:

    * nothing given: the model must be bound to its cluster (compiled with
      `RemoteOptimizer`, or its layers bound by `trainer.Trainer`). Its pushes are
      waited for, the replicas paused (they write what they hold behind), every row of
      the namespace and the dense parameters saved as a checkpoint into a temporary
      sibling of `path`, the replicas resumed, and the export made from that snapshot:
      rows and dense weights of one instant (the model's trainable weights are set to
      the snapshot's; a cluster without dense parameters yet keeps the model's). Needs
      disk for the checkpoint (rows and optimizer slots) while it runs.
    * `rows`: table -> `TableRows`, e.g. `lookup_table.keras.checkpoint_rows(dir)`;
    * `config` and `ids`: table -> the ids to include, read from the live cluster with
      the store (`get`: nothing is written; ids without a row are left out, so they
      are served as unseen) while the replicas are paused (after the bound model's
      pushes, if it is bound to this cluster).

    With `rows` or `ids`, the dense weights are the model's, as they are now.

    Args:
        model: a functional or Sequential Keras model (built from `keras.Input`).
        path: the SavedModel directory to create (e.g. `models/ctr/1` for TF Serving);
            it must not exist, or be empty. Written to a temporary sibling and renamed.
        unseen: "initializer" (an unseen id gets its table's initial row, as the
            cluster answers with `create=False`) or "zeros".
        memory_limit_bytes: refuse an export needing more; None: the memory available.

    Returns:
        {"path", "bytes", "tables": {table: rows}, "inputs": [...], "outputs": [...]}.

    Raises:
        ExportTooLargeError: it would not fit in memory (nothing read or written).
        ConfigError: a bad argument, a table missing from the source, a layer whose
            dim or id type does not fit its table, a target that exists, no source
            given for a model that is not bound to a cluster.
        CheckpointError: the snapshot failed (a replica could not write what it holds).
        DataLossError, NodeUnavailableError, ...: reading from the cluster failed.
    """
    target = check_export(model, path, unseen=unseen)
    layers = distributed_layers(model)
    wanted = sorted({layer.table for layer in layers})
    bound = _bound(model, layers)
    if rows is None and config is None and ids is None:
        return _export_snapshot(
            model, target, bound, wanted, unseen=unseen, memory_limit_bytes=memory_limit_bytes
        )
    session = None if bound is None else bound[1]
    if session is not None and config is not None and session.config.namespace == config.namespace:
        session.settle_pushes()  # the read must see what this model pushed
    sources = _sources(
        wanted, rows=rows, config=config, ids=ids, unseen=unseen, limit=memory_limit_bytes
    )
    return write_saved_model(model, target, sources, unseen=unseen)


def _bound(
    model: keras.Model, layers: Sequence[DistributedEmbedding]
) -> tuple[ClusterConfig, TrainingSession | None] | None:
    """The cluster `model` is bound to and the open session that trains it, if any: its
    `RemoteOptimizer`'s (None before its first fit, evaluate or predict), or the
    `trainer.Trainer` its layers are bound to."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, RemoteOptimizer):
        session = optimizer.session
        return optimizer.config, None if session is None or session.closed else session
    sessions = [
        layer.source
        for layer in layers
        if isinstance(layer.source, TrainingSession) and not layer.source.closed
    ]
    namespaces = sorted({s.config.namespace for s in sessions})
    if len(namespaces) > 1:
        raise ConfigError(
            f"model {model.name!r}: its layers are bound to sessions of namespaces "
            f"{namespaces}; an export reads one cluster: pass rows=checkpoint_rows(dir)"
        )
    return (sessions[0].config, sessions[0]) if sessions else None


def _export_snapshot(
    model: keras.Model,
    target: Path,
    bound: tuple[ClusterConfig, TrainingSession | None] | None,
    wanted: Sequence[str],
    *,
    unseen: Unseen,
    memory_limit_bytes: int | None,
) -> dict[str, Any]:
    """`export_saved_model` of a bound model: a checkpoint of its cluster into a temporary
    sibling of `target`, exported with its rows and dense weights, then removed."""
    if bound is None:
        raise ConfigError(
            f"model {model.name!r} is not bound to a cluster, so there are no rows to export: "
            f"compile it with optimizer=lookup_table.keras.RemoteOptimizer(config) (or train "
            f"it with trainer.Trainer) and call lookup_table.keras.export_saved_model(model, "
            f"path), or pass rows=lookup_table.keras.checkpoint_rows(checkpoint_dir), "
            f"or config= and ids={{table: ids}}"
        )
    config, session = bound
    for name in wanted:
        spec = config.table(name)
        if unseen == "initializer":
            check_reproducible(spec)
    if session is not None:
        session.settle_pushes()
    snapshot = target.with_name(f".{target.name}.snapshot-{uuid.uuid4().hex[:8]}")
    try:
        manifest = save_checkpoint(config, snapshot, progress=False)
        dense = "checkpoint" if manifest.get("dense") is not None else "model"
        result = export_checkpoint_saved_model(
            snapshot,
            model,
            target,
            dense=dense,
            unseen=unseen,
            memory_limit_bytes=memory_limit_bytes,
        )
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)
    logger.info(
        "exported %s from a snapshot of namespace %r (dense weights from the %s)",
        target,
        config.namespace,
        "snapshot" if dense == "checkpoint" else "model",
    )
    return result


def _sources(
    wanted: Sequence[str],
    *,
    rows: Mapping[str, TableRows] | None,
    config: ClusterConfig | None,
    ids: Mapping[str, Any] | None,
    unseen: Unseen,
    limit: int | None,
) -> dict[str, TableRows]:
    """The rows of every table in `wanted`, from `rows` or read from the cluster, after
    checking that unseen ids can be served and that the export fits in memory."""
    if rows is None and (config is None or ids is None) or rows is not None and ids is not None:
        raise ConfigError(
            "pass the rows to export as rows=checkpoint_rows(dir), or as config= and "
            "ids={table: ids} to read from the cluster (exactly one of them), or neither "
            "for a model bound to its cluster (export_saved_model(model, path))"
        )
    if rows is not None:
        check_rows(wanted, rows, unseen=unseen)
        needed = sum(_estimate(rows[t].spec, rows[t].ids) for t in wanted)
        check_export_memory(needed, limit_bytes=limit)
        return {t: rows[t] for t in wanted}
    if config is None or ids is None:  # checked above (for mypy)
        raise ConfigError("config and ids are both needed")
    missing = [t for t in wanted if t not in ids]
    if missing:
        raise ConfigError(
            f"ids has no entry for the model's tables {missing}; pass the ids to export of "
            f"every table (an empty list serves all its ids as unseen)"
        )
    specs = {t: config.table(t) for t in wanted}
    if unseen == "initializer":
        for spec in specs.values():
            check_reproducible(spec)
    chosen: dict[str, IdArray] = {}
    for t in wanted:
        given = as_ids(ids[t], table=t)
        # np.unique keeps the dtype: int64 or object
        chosen[t] = given if given.shape[0] == 0 else cast(IdArray, np.unique(given))
    needed = sum(_estimate(specs[t], chosen[t]) for t in wanted)
    check_export_memory(needed, limit_bytes=limit)
    read = _read_rows(config, chosen)
    out: dict[str, TableRows] = {}
    for t in wanted:
        values, found = read.pop(t)  # not two copies of the rows at once
        kept = values if found.all() else values[found]
        out[t] = TableRows(spec=specs[t], ids=chosen[t][found], rows=kept)
    return out


def _estimate(spec: TableSpec, ids: IdArray) -> int:
    id_bytes = sum(len(s.encode("utf-8")) for s in ids.tolist()) if spec.id_type == "string" else 0
    return estimate_export_bytes(
        count=int(ids.shape[0]),
        dim=spec.dim,
        id_type=spec.id_type,
        id_bytes=id_bytes,
        itemsize=itemsize(spec.dtype),
    )


def _read_rows(
    config: ClusterConfig, ids: Mapping[str, IdArray]
) -> dict[str, tuple[NDArray[np.float32], NDArray[np.bool_]]]:
    """Rows of unique `ids` per table with the store (one request per node; nothing
    written) while the optimizer replicas are paused (they write the rows they hold
    behind first), on a loop of its own (the caller may be inside one)."""
    names = list(ids)

    async def read() -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        async with EmbeddingStore(config) as store, paused_replicas(config) as held:
            got = await store.get_many([TableRead(t, ids[t]) for t in names], unique=True)
            held.check("the export's read")
            return got

    return dict(zip(names, run_blocking(read()), strict=True))


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


def _checkpoint_estimate(root: Path, t: Mapping[str, Any]) -> int:
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
    needed = sum(_checkpoint_estimate(root, saved[name]) for name in wanted)
    check_export_memory(needed, limit_bytes=memory_limit_bytes, what=f"exporting {root}")
    if dense == "checkpoint":
        _assign_dense(root, manifest, model)
    rows = checkpoint_rows(root, tables=wanted, manifest=manifest)
    result = write_saved_model(model, out, rows, unseen=unseen)
    result["dense"] = dense
    return result
