"""`export_saved_model`: a trained model as a TF SavedModel that serves without this project.

The rows come from a snapshot of the model's cluster (a checkpoint, `ops/`), a
checkpoint given, or chosen ids read while the replicas are paused, always after the
model's own pushes; `lookup_table.serving` writes the SavedModel (docs/serving.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import keras
import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig, TableSpec
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.core.precision import itemsize
from lookup_table.errors import ConfigError
from lookup_table.layer import DistributedEmbedding, distributed_layers
from lookup_table.ops.checkpoint import export_checkpoint_saved_model, save_checkpoint
from lookup_table.ops.checkpoint.pipeline import run_blocking
from lookup_table.ops.checkpoint.save import paused_replicas
from lookup_table.remote import RemoteOptimizer
from lookup_table.serving import (
    TableRows,
    Unseen,
    check_export,
    check_export_memory,
    check_reproducible,
    check_rows,
    estimate_export_bytes,
    write_saved_model,
)
from lookup_table.session import TrainingSession
from lookup_table.store import EmbeddingStore, TableRead

__all__ = ["export_saved_model"]

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
    * `rows`: table -> `TableRows`, e.g. `lookup_table.ops.checkpoint.checkpoint_rows(dir)`;
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
            f"path), or pass rows=lookup_table.ops.checkpoint.checkpoint_rows(checkpoint_dir), "
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
