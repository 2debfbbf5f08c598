"""Save a namespace into a new checkpoint directory (`lookup-table-checkpoint save`).

It pauses the replicas while it lists the namespace's keys (`lru_crawler metadump`) and
reads every row with its slots, the dense parameters and the version keys; the files go
to a temporary directory renamed into place after `manifest.json`, ids sorted so the
files depend only on the data. The steps and why: docs/checkpoints.md#save.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, TableSpec
from lookup_table.core.keys import IdArray, id_text
from lookup_table.core.keyspace import (
    DENSE_TABLE,
    META_TABLE,
    ROW_KINDS,
    Kind,
    is_journal_header,
    version_replica,
)
from lookup_table.core.optimizers import make_optimizer, slot_width
from lookup_table.core.sharding import node_of
from lookup_table.dense import DenseParams
from lookup_table.errors import (
    CheckpointError,
    ClusterNotInitializedError,
    DataLossError,
    KeyEncodingError,
    LookupTableError,
)
from lookup_table.ops.checkpoint.files import check_target, finalize, save_array
from lookup_table.ops.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    dense_file_stems,
    pack_str_ids,
    rows_for_file,
    slot_layout,
    table_files,
)
from lookup_table.ops.checkpoint.listing import decode_bodies, decode_int_bodies, namespace_keys
from lookup_table.ops.checkpoint.pipeline import (
    DEFAULT_BATCH_IDS,
    DEFAULT_PAUSE_TIMEOUT_S,
    WINDOW,
    blocking_twin,
    progress_bar,
    run_bounded,
)
from lookup_table.store import EmbeddingStore

__all__ = ["paused_replicas", "save_checkpoint", "save_checkpoint_async"]

logger = logging.getLogger(__name__)


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
            f"a {type(bad).__name__} id {id_text(bad)}; fix id_type in the cluster file"
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
            f"{id_text(ids[i])}) are on memcached node {nodes[node_index]} but the cluster "
            f"file places them on {nodes[int(placed[i])]}: its `memcached` list is not the list "
            f"the data was written with; save with the original node list"
        )


async def save_checkpoint_async(
    config: ClusterConfig,
    directory: str | os.PathLike[str],
    *,
    pause: bool = True,
    pause_timeout_s: float = DEFAULT_PAUSE_TIMEOUT_S,
    batch_ids: int = DEFAULT_BATCH_IDS,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Save the namespace of `config` into the new directory `directory`; return the manifest
    (`save_checkpoint`, awaited on the caller's loop).

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
        StoreError, ReplicaUnavailableError, PushRejectedError: memcached or a replica failed.
    """
    target = Path(directory)
    check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    started = time.monotonic()
    created = datetime.datetime.now(datetime.UTC)
    try:
        async with EmbeddingStore(config, refresh_ttl=False) as store:
            await _require_intact(store)
            async with paused_replicas(config, enabled=pause, timeout_s=pause_timeout_s) as held:
                body = await _read_namespace(store, tmp, batch_ids=batch_ids, progress=progress)
                held.check("the save")
        read_s = time.monotonic() - started
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "namespace": config.namespace,
            "created": created.isoformat(timespec="seconds"),
            "created_unix": created.timestamp(),
            "nodes_at_save": len(config.memcached),
            "node_addresses_at_save": list(config.node_addresses),
            "paused": held.paused,
            "optimizer_replicas": len(config.optimizers),
            **body,
        }
        await asyncio.to_thread(finalize, tmp, target, manifest)
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


save_checkpoint = blocking_twin(
    save_checkpoint_async,
    name="save_checkpoint",
    doc="""Save the namespace of `config` into the new directory `directory`; return the manifest.

    Returns when the checkpoint is written, also where an event loop runs (Jupyter: the
    save runs on a private thread's loop meanwhile). Async code awaits
    `save_checkpoint_async` instead, which takes the same arguments (module docstring).
    """,
)


class _Held:
    """What `paused_replicas` yields: whether replicas are paused, and since when."""

    def __init__(self, paused: bool, timeout_s: float) -> None:
        self.paused = paused
        self.timeout_s = timeout_s
        self.since = time.monotonic()

    def check(self, what: str) -> None:
        """Raise CheckpointError if the replicas may have resumed by themselves."""
        if self.paused and time.monotonic() - self.since >= self.timeout_s:
            raise CheckpointError(
                f"{what} took longer than the pause ({self.timeout_s:g} s): the replicas "
                f"resumed during it, so it is not consistent; raise --pause-timeout-s"
            )


@contextlib.asynccontextmanager
async def paused_replicas(
    config: ClusterConfig, *, enabled: bool = True, timeout_s: float = DEFAULT_PAUSE_TIMEOUT_S
) -> AsyncIterator[_Held]:
    """Pause every optimizer replica of `config` for the body, then resume them.

    When paused, no push is in flight and each replica has written what it holds
    behind (rows and dense parameters) to memcached, so memcached holds one consistent
    model. They resume by themselves after `timeout_s`; `check` on what this yields
    tells whether that happened.

    Raises:
        CheckpointError: a replica still finishes pushes whose memcached write failed.
        ReplicaUnavailableError, PushRejectedError: a replica could not be paused.
    """
    client = OptimizerClient(config, max_retries=2) if enabled and config.optimizers else None
    if enabled and client is None:
        logger.warning("no optimizer replicas in the cluster file: nothing to pause")
    try:
        if client is not None:
            unfinished = await client.pause(timeout_s=timeout_s)
            if any(unfinished.values()):
                raise CheckpointError(
                    "optimizer replicas are still finishing pushes whose memcached "
                    "write failed ("
                    + ", ".join(f"replica {k}: {n}" for k, n in unfinished.items() if n)
                    + "; see their logs): their rows are half written, so a snapshot "
                    "would not be consistent. Fix the node they name "
                    "(lookup-table-admin stats) and try again"
                )
        yield _Held(client is not None, timeout_s)
    finally:
        if client is not None:
            try:
                await client.resume()
            except LookupTableError as exc:
                logger.warning(
                    "could not resume the optimizer replicas (they resume by "
                    "themselves after %g s): %s",
                    timeout_s,
                    exc,
                )
            await client.close()


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
    dumps = await namespace_keys(store)
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
        w_ids = keys.ids(Kind.ROW, spec.id_type)
        if spec.id_type == "int64":
            merged = np.sort(w_ids)  # each node's ids are disjoint: sorted, they are unique
            table_ids: IdArray = cast("NDArray[np.int64]", merged)
        else:
            strs = sorted(w_ids.tolist())
            str_ids = np.empty(len(strs), dtype=object)
            str_ids[:] = strs
            table_ids = str_ids
        plans.append((spec, table_ids, slot_width(spec)))
        total += table_ids.shape[0]

    tables: list[dict[str, Any]] = []
    with progress_bar(total, "save", progress) as bar:
        for spec, ids, width in plans:
            tables.append(await _save_table(store, tmp, spec, ids, width, batch_ids, bar))
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
                    "slot_width": slot_width(s),
                    "dtype": s.dtype,
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
    batch_ids: int,
    bar: Any,
) -> dict[str, Any]:
    n = ids.shape[0]
    files = table_files(spec.name, spec.id_type, width)
    if spec.id_type == "int64":
        save_array(tmp / files["ids"], np.asarray(ids, dtype="<i8"))
    else:
        utf8, offsets = pack_str_ids(ids.tolist())
        save_array(tmp / files["ids_utf8"], utf8)
        save_array(tmp / files["ids_offsets"], offsets.astype("<i8"))
    # in memory, then written at once: filling a memory-mapped file page by page is
    # slower, and a table whose rows do not fit in memory does not fit metadump either
    rows = np.empty((n, spec.dim), dtype="<f4")
    slots = np.zeros((n, width), dtype="<f4") if width else None

    def batch(start: int) -> Callable[[], Awaitable[None]]:
        async def read() -> None:
            stop = min(start + batch_ids, n)
            part = ids[start:stop]
            # a row and its slots are one item (docs/storage.md): one read of both
            values, found = await store.get(spec.name, part, unique=True, slots=True)
            if not found.all():
                lost = np.flatnonzero(~found)
                _vanished(spec, "row", part[int(lost[0])], lost.size)
            rows[start:stop] = values[:, : spec.dim]
            if slots is not None:
                slots[start:stop] = values[:, spec.dim :]
            bar.update(stop - start)

        return read

    await run_bounded((batch(s) for s in range(0, n, batch_ids)), WINDOW)
    # as stored: the store's float32 rows are exactly the dtype's values
    await asyncio.to_thread(save_array, tmp / files["rows"], rows_for_file(rows, spec.dtype))
    if slots is not None:
        await asyncio.to_thread(save_array, tmp / files["slots"], slots)
        save_array(tmp / files["has_slots"], np.ones(n, dtype=bool))
    return {
        "name": spec.name,
        "dim": spec.dim,
        "id_type": spec.id_type,
        "optimizer": spec.optimizer.name,
        "slot_width": width,
        "dtype": spec.dtype,
        "slots": slot_layout(spec),
        "count": n,
        "with_slots": n if width else 0,
        "files": files,
    }


def _vanished(spec: TableSpec, what: str, example: object, count: int) -> None:
    raise CheckpointError(
        f"{count} {what} value(s) of table {spec.name!r} (e.g. id {id_text(example)}) were "
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
        save_array(tmp / file, value)
        save_array(tmp / slots_file, slot)
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
