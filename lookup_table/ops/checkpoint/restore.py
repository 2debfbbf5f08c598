"""Restore a checkpoint into any number of nodes (`lookup-table-checkpoint restore`).

It verifies the whole checkpoint and writes nothing if anything is wrong, refuses a
namespace holding data unless `--force`, pauses the running replicas, and writes the
sentinels last, so a restore that fails part-way leaves trainers a `DataLossError`
rather than half a model. The steps and why: docs/checkpoints.md#restore.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig
from lookup_table.core.keyspace import META_TABLE, SENTINEL_ID, Kind, layout_table
from lookup_table.core.optimizers import make_optimizer
from lookup_table.dense import DenseParams
from lookup_table.errors import LookupTableError, NamespaceNotEmptyError, ReplicaUnavailableError
from lookup_table.memcached import commands
from lookup_table.ops.checkpoint.files import load_array, table_ids
from lookup_table.ops.checkpoint.format import (
    check_compatible,
    check_fits,
    rows_from_file,
    table_dtype,
)
from lookup_table.ops.checkpoint.listing import NodeKeys, decode_bodies, namespace_keys
from lookup_table.ops.checkpoint.pipeline import (
    DEFAULT_BATCH_IDS,
    DEFAULT_PAUSE_TIMEOUT_S,
    WINDOW,
    blocking_twin,
    progress_bar,
    run_bounded,
)
from lookup_table.ops.checkpoint.verify import verify_checkpoint
from lookup_table.store import EmbeddingStore

__all__ = ["restore_checkpoint", "restore_checkpoint_async"]

logger = logging.getLogger(__name__)


async def restore_checkpoint_async(
    config: ClusterConfig,
    directory: str | os.PathLike[str],
    *,
    force: bool = False,
    pause: bool = True,
    batch_ids: int = DEFAULT_BATCH_IDS,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint into the namespace and nodes of `config`; return a summary
    (`restore_checkpoint`, awaited on the caller's loop).

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
    for t in manifest["tables"]:  # before anything is deleted or written
        rows = load_array(root, t["files"]["rows"])
        target = config.table(t["name"]).dtype
        await asyncio.to_thread(check_fits, t["name"], rows, table_dtype(t), target)
    ns = config.namespace
    async with (
        EmbeddingStore(config, check_sentinels=False) as store,
        _PausedReplicas(config, enabled=pause) as replicas,
    ):
        dumps = await namespace_keys(store)
        data = {node: _data_keys(ns, found) for node, found in dumps.items()}
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


restore_checkpoint = blocking_twin(
    restore_checkpoint_async,
    name="restore_checkpoint",
    doc="""Restore a checkpoint into the namespace and nodes of `config`; return a summary.

    Returns when the restore is done, also where an event loop runs (Jupyter: the
    restore runs on a private thread's loop meanwhile). Async code awaits
    `restore_checkpoint_async` instead, which takes the same arguments.
    """,
)


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
                except ReplicaUnavailableError as exc:
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


def _data_keys(namespace: str, found: NodeKeys) -> int:
    """The keys of a node that hold data: not its sentinel, nor a table's layout record
    (the restore deletes them and writes the sentinels, which record every table, anew)."""
    meta = decode_bodies(
        namespace, META_TABLE, Kind.META, found.bodies.get((META_TABLE, Kind.META), [])
    )
    book = [m for m in meta if m == SENTINEL_ID or (isinstance(m, str) and layout_table(m))]
    return found.count - len(book)


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
    with progress_bar(rows_total, "restore", progress) as bar:
        for t in manifest["tables"]:
            slots_total += await _restore_table(store, root, t, batch_ids, bar)
    dense = manifest.get("dense")
    if dense is not None:
        params = {
            p["name"]: np.array(load_array(root, p["file"]), dtype=np.float32)
            for p in dense["params"]
        }
        slots = {
            p["name"]: np.array(load_array(root, p["slots_file"]), dtype=np.float32)
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
    ids = table_ids(root, t)
    rows = load_array(root, t["files"]["rows"])
    slots = load_array(root, t["files"]["slots"]) if width else None
    has_slots = np.asarray(load_array(root, t["files"]["has_slots"])) if width else None

    spec = store.config.table(name)
    optimizer = make_optimizer(spec.optimizer)
    saved = table_dtype(t)  # the store re-encodes the rows in the table's dtype (nearest)

    def batch(start: int) -> Callable[[], Awaitable[None]]:
        async def write() -> None:
            stop = min(start + batch_ids, n)
            these = None
            if slots is not None and has_slots is not None:
                # a row and its slots are one item; a row saved without slots (by the
                # format-1 store, before its first update) gets the initial ones, which
                # the service gave it then
                these = np.array(slots[start:stop], dtype=np.float32)
                fresh = np.flatnonzero(~np.asarray(has_slots[start:stop]))
                if fresh.size:
                    these[fresh] = optimizer.initial_slots(fresh.size, spec.dim)
            values = rows_from_file(rows[start:stop], saved)
            await store.set(name, ids[start:stop], values, slots=these)
            bar.update(stop - start)

        return write

    await run_bounded((batch(s) for s in range(0, n, batch_ids)), WINDOW)
    return n if slots is not None else 0
