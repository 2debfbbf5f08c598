"""`EmbeddingStore`: the async shell over the memcached fleet.

A batch costs one pipelined round trip per node (per `store.max_batch_keys` keys),
all nodes in parallel::

    store = EmbeddingStore(load_config("cluster.toml"))
    async with store:
        rows = await store.lookup("user", ids)          # float32 (len(ids), dim)
        by_table = await store.lookup_many({"user": ids, "item": item_ids})

`lookup` deduplicates ids, reads every row of the batch, and creates the
missing ones with `add` (set-if-absent) from the table's deterministic
initializer, so concurrent trainers never overwrite each other: a trainer that
loses the `add` race re-reads the winner's row. `lookup(..., create=False)`
never writes: missing rows come back as their would-be initial value.

Many tables, many kinds, one round trip: `lookup_many` looks up the ids of many
tables, `get_many` reads and `set_many` / `add_many` write values of many (table,
kind) pairs (`TableRead`, `TableWrite`), each as ONE pipelined request per node
(split only where a node's keys exceed `store.max_batch_keys`), with the node's
sentinel read first, exactly as the single-table calls do. A training step of 26
tables is then one request per node instead of 26, and the optimizer service
reads the rows and slots of a whole push in one request per node and writes them
back in another. The ids of a table are encoded and placed on nodes once per
call: parts of one table that pass the same ids object share the work, and only
the key prefix differs per kind (placement ignores the kind).

A row and its optimizer slots are one item (storage format 2,
`core.keyspace.STORAGE_FORMAT`): `dim` float32, then the optimizer's `slot_width`
(Adam: m, v and the row's step). memcached's cost is per operation, so the service
pays one `mg` and one `ms` per id; a lookup keeps only each value's row bytes, and
a new row is added with the optimizer's initial slots. `TableRead(slots=True)` and
`TableWrite(slots=...)` read and write both. Every node's sentinel records the
format; a node of another format raises `StorageFormatError` before anything of
this version is written to it (`check_format`).

Data loss: every batch also reads the node's sentinel (written by
`lookup-table-admin init`) in the same round trip. A node whose sentinel is
gone has lost its rows (restart, flush), so the batch raises `DataLossError`
naming it before anything is created. (A node that dies between a batch's read
and its `add`, a window of one round trip, is caught by the sentinel read
pipelined in front of the adds: that batch raises, and the sentinel stays
missing until an operator restores or re-initializes. Its adds, which memcached
ran all the same, may be on the node; nothing reads them, and `restore --force`
deletes them. The same holds for any write batch sent to a lost node.) A `-M`
node that is out of memory raises `StoreFullError`; a value of the wrong length
`CorruptValueError` naming the table and key (and what it should hold);
timeouts and refused connections `NodeUnavailableError` (`StoreTimeoutError`);
a node of another storage format `StorageFormatError`. Ids that cannot be keys
(`KeyEncodingError`) and unknown tables (`ConfigError`) are raised before
anything is sent, for every table of a multi-table call.

Connections: `lookup_table.memcached` is the one transport. Each node has a small
pool of `store.pool_size` connections (`memcached.node.Node`); a connection that
saw a timeout, a cancellation or any error mid-reply is closed, never reused, so a
stale reply can never be read as someone else's miss (the hazard of
aiomcache#489). `stats` runs on a connection of its own (`memcached.commands`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.expiry import exptime
from lookup_table.core.initializers import initial_rows
from lookup_table.core.keys import (
    INT_ID_BYTES,
    IdArray,
    IdBodies,
    as_ids,
    id_bodies,
    key_prefix,
    prefixed_keys,
)
from lookup_table.core.keyspace import STORAGE_FORMAT, Kind, sentinel_format, sentinel_key
from lookup_table.core.optimizers import make_optimizer
from lookup_table.core.rows import ROW_DTYPE, encode_rows, row_bytes
from lookup_table.core.sharding import node_of, node_of_many
from lookup_table.errors import (
    ClusterNotInitializedError,
    DataLossError,
    KeyEncodingError,
    LookupTableError,
    StorageFormatError,
    StoreError,
)
from lookup_table.memcached import batch, commands
from lookup_table.memcached.batch import Segment, Values
from lookup_table.memcached.node import Node
from lookup_table.memcached.protocol import Keys, Wire

__all__ = ["EmbeddingStore", "TableRead", "TableWrite"]

logger = logging.getLogger(__name__)


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TableRead:
    """One part of `EmbeddingStore.get_many`: fixed-width float32 values of one (table, kind).

    Attributes:
        table: the table (its keys' `{table}` part).
        ids: int64 or str ids, anything `lookup_table.core.keys.as_ids` takes.
        kind: "w" rows (the default), or a bookkeeping kind with its `width`.
        width: floats per value of a non-row kind. Rows: None or the table's dim.
        slots: rows only: each value is the row followed by its optimizer slots,
            (n, dim + slot_width), as stored; false: the row alone, (n, dim).

    A stored row of another length than the table's dim plus its optimizer's slot width
    (docs/storage.md) raises CorruptValueError.
    """

    table: str
    ids: Any
    kind: str = Kind.ROW
    width: int | None = None
    slots: bool = False


@dataclass(frozen=True, slots=True)
class TableWrite:
    """One part of `EmbeddingStore.set_many` / `add_many`: values of one (table, kind).

    Attributes:
        table: the table.
        ids: unique int64 or str ids, (n,).
        values: float32 (n, width); rows ("w") must have the table's dim.
        kind: "w" rows (the default), or a bookkeeping kind.
        slots: rows only: their optimizer slots, float32 (n, slot_width), stored with
            them in one item; None: the optimizer's initial slots (a new row's).
    """

    table: str
    ids: Any
    values: NDArray[np.float32]
    kind: str = Kind.ROW
    slots: NDArray[np.float32] | None = None


@dataclass(slots=True, eq=False)
class _Placed:
    """Ids of one table, encoded (without the kind's prefix) and placed on nodes once."""

    table: str
    ids: IdArray
    bodies: IdBodies
    by_node: list[NDArray[np.intp]]  # positions in `ids` of each node's ids, ascending
    # several tables' ids one after another (`EmbeddingStore._place_wide`): table k's
    # start at starts[k]; `table` is the first
    tables: tuple[str, ...] = ()
    starts: NDArray[np.intp] | None = None

    def only(self, mask: NDArray[np.bool_]) -> list[NDArray[np.intp]]:
        """`by_node` restricted to the positions where `mask` is true."""
        return [positions[mask[positions]] for positions in self.by_node]

    def table_at(self, position: int) -> str:
        """The table of the id at `position`."""
        if self.starts is None:
            return self.table
        return self.tables[int(np.searchsorted(self.starts, position, side="right")) - 1]


@dataclass(slots=True, eq=False)
class _Part:
    """One (table, kind) of a batch: which ids of a `_Placed` to send, and their values.

    Results of the part are aligned with `placed.ids`; ids not sent stay zero/false.
    """

    placed: _Placed
    # `{namespace}/{table}/{kind}/`; of several tables' ids (a wide read): each id's
    # prefix, a uint8 matrix (n, prefix length)
    prefix: bytes | NDArray[np.uint8]
    by_node: list[NDArray[np.intp]]
    nbytes: int = 0  # fixed-width reads: the value size
    take: int = 0  # fixed-width reads: the leading bytes of each value kept (0: all)
    values: NDArray[np.uint8] | Sequence[bytes] | None = None  # writes, aligned with ids
    exptime: int = 0  # > 0: memcached's T flag, the TTL its reads and writes give (expiry.py)
    # writes of some of the ids only: `values` holds just theirs, row rank[i] for position i
    rank: NDArray[np.intp] | None = None

    @property
    def kept(self) -> int:
        """Bytes of each value a read keeps."""
        return self.take or self.nbytes

    def values_at(self, index: NDArray[np.intp]) -> Values:
        """The values of the ids at positions `index`: a value matrix with the rows of
        theirs in it (not gathered: `_ms` lays them out from there), or the blobs."""
        if self.rank is not None:
            index = self.rank[index]
        if isinstance(self.values, np.ndarray):
            return self.values, index
        if self.values is None:
            raise ValueError("a read part has no values")
        return [self.values[i] for i in index.tolist()]


def _raise_first(errors: Sequence[BaseException]) -> None:
    """Raise the most useful single error of a fan-out (data loss first)."""
    lost = [e for e in errors if isinstance(e, DataLossError)]
    if lost:
        nodes = tuple(sorted({n for e in lost for n in e.nodes}))
        if len(lost) == 1:
            raise lost[0]
        raise DataLossError(
            f"memcached nodes {', '.join(nodes)} have lost their data: their sentinels are "
            f"gone (restart or flush). Nothing is read from them until you restore a checkpoint "
            f"(lookup-table-checkpoint restore) or accept the loss (lookup-table-admin reinit "
            f"--yes)",
            nodes=nodes,
        ) from lost[0]
    for exc in errors:
        if isinstance(exc, LookupTableError):
            raise exc
    raise errors[0]


async def _gather(jobs: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run jobs concurrently; on failure cancel the rest and raise one clear error."""
    if len(jobs) == 1:
        return [await jobs[0]]
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]
    except BaseExceptionGroup as group_error:
        _raise_first(group_error.exceptions)
    return [t.result() for t in tasks]


def _unique(ids: IdArray) -> tuple[IdArray, NDArray[np.intp]]:
    """The sorted unique ids and the inverse, intp (n,): uniq[inverse] == ids."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    return cast("IdArray", uniq), inverse.reshape(-1)


_OVERLAP_FLOATS = 1 << 18
"""From this many floats, a lookup that creates rows puts them in the caller's order in a
thread while its adds are in flight (`_in_order_during`). `benchmarks/store.py`, 65,536 ids
with 10 % new (1M floats at dim 16): the gather took 1-4 ms after the adds' round trip,
on the critical path; beside it, the mixed lookup took 2.5-5 ms less. The bound is the
service's for its optimizer steps (`optimizer_service.updater._OFFLOAD_FLOATS`); smaller
gathers stay inline (a thread's hand-off would cost more than it frees)."""


def _in_order(
    parts: Sequence[tuple[NDArray[np.float32], NDArray[np.intp]]],
) -> list[NDArray[np.float32]]:
    """values[inverse] of every (values, inverse): new arrays, in the ids' order."""
    return [np.take(values, inverse, axis=0) for values, inverse in parts]


async def _in_order_during(
    job: Coroutine[Any, Any, T],
    parts: Sequence[tuple[NDArray[np.float32], NDArray[np.intp]]],
) -> tuple[T, list[NDArray[np.float32]]]:
    """`job`'s result and `_in_order(parts)`; big gathers run in a worker thread while
    `job` awaits its round trips (numpy's take releases the GIL).

    `job` must not write the `values` it is given; the gathers read them meanwhile. A
    cancelled or failed job leaves the thread to finish on its own: it only makes new
    arrays, which nobody then reads.
    """
    if sum(inverse.shape[0] * values.shape[1] for values, inverse in parts) < _OVERLAP_FLOATS:
        rows = _in_order(parts)
        return await job, rows
    result, rows = await asyncio.gather(job, asyncio.to_thread(_in_order, parts))
    return result, rows


def _positions_by(group: NDArray[np.intp], count: int) -> list[NDArray[np.intp]]:
    """For each group number 0 .. count - 1, the positions of `group` that have it,
    ascending (one stable sort)."""
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(count + 1)).tolist()
    return [order[bounds[g] : bounds[g + 1]] for g in range(count)]


def _group_key(table: str, ids: Any) -> tuple[str, int]:
    """Parts of one table that pass the same ids object share their encoding and placement."""
    return table, id(ids)


@dataclass(slots=True, eq=False)
class _TableLookup:
    """One table of `lookup_many`: its unique ids (placed), and the rows read for them."""

    table: str
    inverse: NDArray[np.intp]  # uniq[inverse] == the ids asked for
    rows: _Part  # the read of the unique ids' rows
    values: NDArray[np.float32]  # (len(uniq), dim)
    found: NDArray[np.bool_]  # (len(uniq),)

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    def part(self, only: NDArray[np.bool_], **what: Any) -> _Part:
        """A batch part of this table's rows over its ids where `only` is true."""
        placed = self.rows.placed
        return _Part(placed, self.rows.prefix, placed.only(only), exptime=self.rows.exptime, **what)

    def add(self, only: NDArray[np.bool_], items: NDArray[np.uint8]) -> _Part:
        """A write of `items`, the stored values of the ids where `only` is true (in id
        order): the new rows' items only, not a whole batch's."""
        rank = (np.cumsum(only) - 1).astype(np.intp)
        return self.part(only, values=items, rank=rank)

    def reread(self, only: NDArray[np.bool_]) -> _Part:
        """A read of this table's rows (without slots) over its ids where `only` is true."""
        return self.part(only, nbytes=self.rows.nbytes, take=self.rows.take)


class _Sentinels:
    """The data-loss sentinel of a namespace on every node, and the storage format it records.

    What a batch reads in front of its commands (`memcached.batch.Sentinel`).
    """

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace
        self.key = sentinel_key(namespace)
        self._formats_ok: set[bytes] = set()  # sentinel values whose storage format is ours
        self._verified: set[str] = set()  # nodes whose sentinel was checked before a batch

    def verified(self, address: str) -> bool:
        return address in self._verified

    def check_format(self, address: str, sentinel: bytes) -> None:
        """Raise StorageFormatError unless `sentinel` (node `address`'s) records this
        version's storage format (`core.keyspace.STORAGE_FORMAT`)."""
        try:
            found = sentinel_format(sentinel)
        except ValueError as exc:
            raise StorageFormatError(
                f"memcached node {address} holds a sentinel for namespace {self._namespace!r} "
                f"that this version cannot read ({exc}); was it written by another program?",
                node=address,
            ) from exc
        if found != STORAGE_FORMAT:
            raise StorageFormatError(
                f"memcached node {address} holds namespace {self._namespace!r} in storage "
                f"format {found}, and this version reads format {STORAGE_FORMAT} (a row and "
                f"its optimizer slots in one item; docs/storage.md): nothing is read from "
                f"it or written to it. Migrate: save a checkpoint with the version that wrote it "
                f"(lookup-table-checkpoint save), then restore it with this one "
                f"(lookup-table-checkpoint restore --force)",
                node=address,
            )

    def lost(self, node: Node, *, writes: bool) -> DataLossError:
        """What a batch raises that found `node`'s sentinel gone."""
        done = (
            "This batch's writes may have reached it, but nothing is read from it until you restore"
            if writes
            else "Nothing was created on it. Restore"
        )
        return DataLossError(
            f"memcached node {node.address} has lost its data: its sentinel "
            f"{self.key.decode()!r} is gone (the server restarted or was "
            f"flushed). {done} a checkpoint (lookup-table-checkpoint restore) or accept "
            f"the loss (lookup-table-admin reinit --yes)",
            nodes=(node.address,),
        )

    def accept(self, address: str, value: bytes) -> None:
        """`check_format` of a node's sentinel (once per sentinel value); the node is then
        verified for the writes that follow (a write batch checks a node it has not)."""
        if value not in self._formats_ok:
            self.check_format(address, value)
            self._formats_ok.add(value)
        self._verified.add(address)


class EmbeddingStore:
    """Batched, async access to the rows and slots of every table in memcached.

    Args:
        config: the cluster file (`load_config`); nodes, namespace, tables, timeouts.
        check_sentinels: read each node's sentinel with every batch (default).
            Only `lookup-table-admin` turns this off, to inspect a broken cluster.
        refresh_ttl: reads of rows and slots of a table with `ttl_s` reset their
            TTL (default: a read is a use). A checkpoint save turns this off, so
            that saving does not keep every row alive; writes always set the TTL.

    Use as `async with EmbeddingStore(cfg) as store:` or call `close()`.
    Methods are safe to call concurrently from many tasks of one event loop.
    """

    def __init__(
        self, config: ClusterConfig, *, check_sentinels: bool = True, refresh_ttl: bool = True
    ) -> None:
        self.config = config
        self.namespace = config.namespace
        self.nodes: tuple[str, ...] = config.node_addresses
        self._nodes = [Node(spec, config.store) for spec in config.memcached]
        self._check_sentinels = check_sentinels
        self._sentinels = _Sentinels(config.namespace)
        self._sentinel_key = self._sentinels.key
        # what every batch reads in front of its commands (None: nothing)
        self._guard = self._sentinels if check_sentinels else None
        self.created: dict[str, int] = {}  # rows this store created, per table
        self.refresh_ttl = refresh_ttl
        self._ttls = {t.name: t.ttl_s for t in config.tables if t.ttl_s is not None}
        self._optimizers = {t.name: make_optimizer(t.optimizer) for t in config.tables}
        # each table's dim and bytes of a stored row (the row, then its optimizer's slots)
        self._layouts = {
            t.name: (t.dim, row_bytes(t.dim + self._optimizers[t.name].slot_width(t.dim)))
            for t in config.tables
        }

    async def __aenter__(self) -> EmbeddingStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection. The store cannot be used afterwards."""
        for node in self._nodes:
            await node.close()

    # ------------------------------------------------------------ lookups

    async def lookup(self, table: str, ids: Any, *, create: bool = True) -> NDArray[np.float32]:
        """The rows of `ids` in order, float32 (len(ids), dim).

        Duplicates are allowed (each unique id is fetched once). Missing rows are
        created with `add` from the table's initializer when `create` is true; a
        row another writer created first is re-read. With `create=False` nothing
        is written and missing rows come back as their would-be initial value.
        A table with `ttl_s` or `admit_after` is looked up by `lookup_many` (its
        reads refresh TTLs; its misses are counted, see there).

        Raises:
            ConfigError: unknown table.
            KeyEncodingError: an id that cannot be a key, or of the wrong type.
            DataLossError: a node of the batch lost its data; nothing was created.
            StoreFullError, CorruptValueError, NodeUnavailableError: see errors.py.
        """
        spec = self.config.table(table)
        if spec.ttl_s is not None or spec.admit_after > 1:
            # the TTLs and the admission counters are lookup_many's
            return (await self.lookup_many({table: ids}, create=create))[table]
        id_array = self._table_ids(table, ids)
        if id_array.shape[0] == 0:
            return np.zeros((0, spec.dim), dtype=np.float32)
        uniq, inverse = _unique(id_array)
        values, found = await self.get(table, uniq, width=spec.dim, unique=True)
        missing = np.flatnonzero(~found)
        if not missing.size:
            return values[inverse]
        fresh = initial_rows(spec.initializer, seed=spec.seed, ids=uniq[missing], dim=spec.dim)
        values[missing] = fresh  # what an add stores, and what create=False returns
        if not create:
            return values[inverse]
        stored, (out,) = await _in_order_during(
            self.add(table, uniq[missing], fresh, unique=True), [(values, inverse)]
        )
        self.created[table] = self.created.get(table, 0) + int(stored.sum())
        raced = missing[~stored]  # ascending, as `missing` is
        if raced.size:  # another writer created these rows first: theirs count
            again, ok = await self.get(table, uniq[raced], width=spec.dim, unique=True)
            if not ok.all():
                raise self._vanished(table, uniq[raced][~ok][0])
            lost = np.zeros(uniq.shape[0], dtype=bool)
            lost[raced] = True
            at = np.flatnonzero(lost[inverse])
            out[at] = again[np.searchsorted(raced, inverse[at])]
        return out

    async def lookup_many(
        self, ids: Mapping[str, Any], *, create: bool = True
    ) -> dict[str, NDArray[np.float32]]:
        """`lookup` of many tables at once: {table: ids} -> {table: rows}.

        Each table's rows are float32 (len(ids), dim), exactly what `lookup(table,
        ids, create=create)` returns: duplicates fetched once, missing rows created
        with `add` from the table's initializer, a row whose `add` lost a race
        re-read, `created` counted per table, and nothing written with
        `create=False`. The reads of every table are one request per node; the adds
        of every table's new rows one more (only if there are new rows); the
        re-reads of lost races one more (only if an `add` lost one). Every table
        and id is checked before anything is sent.

        A new row is stored with its optimizer's initial slots (one item: docs/storage.md);
        the reads take only the rows from the items.

        Lifecycle (docs/storage.md): the reads of a table with `ttl_s` reset the TTL
        of its rows (and so of their slots, in the same item); its adds give the new rows
        that TTL. For a table with `admit_after`
        K >= 2, `create=True` counts a sighting of every id without a row (`ma` on its
        counter, in the adds' request) and adds only the rows of the ids whose count
        reached K (one more request per node, only if one did); the others come back
        as their initial values and nothing is stored for them but the counter.

        Raises:
            ConfigError: an unknown table.
            KeyEncodingError: an id that cannot be a key, or of the wrong type for
                its table.
            DataLossError: a node lost its data; nothing was created, on any table.
            StoreFullError, CorruptValueError, NodeUnavailableError: see errors.py.
        """
        prepared: list[tuple[str, NDArray[np.intp], _Part]] = []
        uniques = [
            (table, _unique(self._table_ids(table, table_ids))) for table, table_ids in ids.items()
        ]
        placements = self._place_many([(table, uniq) for table, (uniq, _) in uniques])
        for (table, (_, inverse)), placed in zip(uniques, placements, strict=True):
            rows = _Part(
                placed,
                self._prefix(placed, Kind.ROW),
                placed.by_node,
                self._item_bytes(table),
                take=row_bytes(self.config.table(table).dim),
                exptime=self._exptime(table, write=False),
            )
            prepared.append((table, inverse, rows))
        read = await self._read([rows for _, _, rows in prepared])
        lookups = [
            _TableLookup(table, inverse, rows, values, found)
            for (table, inverse, rows), (values, found) in zip(prepared, read, strict=True)
        ]

        new = [(t, ~t.found) for t in lookups if not t.found.all()]
        for t, missing in new:
            spec = self.config.table(t.table)
            t.values[missing] = initial_rows(
                spec.initializer, seed=spec.seed, ids=t.rows.placed.ids[missing], dim=spec.dim
            )
        if not (create and new):
            return {t.table: t.values[t.inverse] for t in lookups}
        raced, outs = await _in_order_during(
            self._create(new), [(t.values, t.inverse) for t in lookups]
        )
        out = {t.table: rows for t, rows in zip(lookups, outs, strict=True)}
        for t, lost, values in raced:  # rows another writer created first: theirs count
            at = np.flatnonzero(lost[t.inverse])
            out[t.table][at] = values[t.inverse[at]]
        return out

    async def _create(
        self, new: Sequence[tuple[_TableLookup, NDArray[np.bool_]]]
    ) -> list[tuple[_TableLookup, NDArray[np.bool_], NDArray[np.float32]]]:
        """`lookup_many`'s writes: add the rows of each table's `missing` ids (their
        initial values are in its `values` already), or count the sightings of a table
        with `admit_after` and add the rows of the ids that reached it; re-read the rows
        whose add another writer won.

        Returns, per table with lost races, (lookup, lost mask over its unique ids, the
        rows read, aligned with its unique ids: valid where lost). It never writes a
        lookup's `values` (`_in_order_during` gathers them meanwhile).
        """
        for t, _ in new:  # adds give the TTL: a new row is a use
            t.rows.exptime = self._exptime(t.table, write=True)
        now = [(t, m) for t, m in new if self.config.table(t.table).admit_after == 1]
        counted = [(t, m) for t, m in new if self.config.table(t.table).admit_after > 1]
        add_parts = [t.add(m, self._items(t.table, t.values[m], None)) for t, m in now]
        if counted:
            stored_all, counts = await self._add_and_count(
                add_parts, [self._counter_part(t, m) for t, m in counted]
            )
        else:
            stored_all, counts = await self._write(add_parts, add=True), []
        adds = list(zip(now, stored_all, strict=True))
        admitted: list[tuple[_TableLookup, NDArray[np.bool_]]] = []
        for (t, missing), count in zip(counted, counts, strict=True):
            ready = missing & (count >= self.config.table(t.table).admit_after)
            if ready.any():
                admitted.append((t, ready))
        if admitted:  # the ids whose sighting just reached admit_after get their row
            stored_late = await self._write(
                [t.add(m, self._items(t.table, t.values[m], None)) for t, m in admitted],
                add=True,
            )
            adds += zip(admitted, stored_late, strict=True)
        raced: list[tuple[_TableLookup, NDArray[np.bool_]]] = []
        for (t, missing), stored in adds:
            self.created[t.table] = self.created.get(t.table, 0) + int(stored.sum())
            if not stored[missing].all():
                raced.append((t, missing & ~stored))
        if not raced:
            return []
        again = await self._read([t.reread(lost) for t, lost in raced])
        for (t, lost), (_, found) in zip(raced, again, strict=True):
            if not found[lost].all():
                raise self._vanished(t.table, t.rows.placed.ids[lost & ~found][0])
        return [(t, lost, values) for (t, lost), (values, _) in zip(raced, again, strict=True)]

    # ------------------------------------------------------------ fixed-width values

    async def get(
        self,
        table: str,
        ids: Any,
        *,
        kind: str = Kind.ROW,
        width: int | None = None,
        unique: bool = False,
        slots: bool = False,
    ) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
        """Read fixed-width float32 values (rows, bookkeeping) of `ids`.

        Args:
            kind: "w" rows (the default), or a bookkeeping kind.
            width: floats per value of a non-row kind; a stored value of another length
                raises CorruptValueError. Rows: None or the table's dim.
            unique: the caller guarantees ids are unique (skips a dedupe).
            slots: rows only: each row followed by its optimizer slots, as stored
                (n, dim + slot_width).

        Returns:
            (values float32 (n, width), found bool (n,)); missing values are zeros.
        """
        (result,) = await self.get_many(
            [TableRead(table, ids, kind, width, slots=slots)], unique=unique
        )
        return result

    async def get_many(
        self, reads: Sequence[TableRead], *, unique: bool = False
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """`get` of many (table, kind) parts in one request per node; results in order.

        Each result is what `get(read.table, read.ids, kind=read.kind,
        width=read.width, slots=read.slots)` returns: (values float32 (n, width), found
        bool (n,)), missing values zeros. Reads of one table that pass the same `ids`
        object are deduplicated, encoded and placed once. `unique=True`: the caller
        guarantees every read's ids are unique.

        Raises:
            ConfigError: a read of rows of an unknown table.
            ValueError: a row read with a width other than the table's dim, or `slots`
                on a non-row kind (before anything is sent).
            KeyEncodingError: ids that cannot be keys, or row ids of the wrong type
                for their table (before anything is sent).
            CorruptValueError: a value of another length, naming its table and key.
            DataLossError, StoreFullError, NodeUnavailableError: see errors.py.
        """
        keys = [_group_key(r.table, r.ids) for r in reads]
        rows_of = {key for key, r in zip(keys, reads, strict=True) if r.kind == Kind.ROW}
        todo: dict[tuple[str, int], tuple[str, IdArray, NDArray[np.intp] | None]] = {}
        uses = Counter(keys)
        for key, read in zip(keys, reads, strict=True):
            if key in todo:
                continue
            id_array = self._ids_of(read.table, read.ids, rows=key in rows_of)
            inverse = None
            if not unique:
                uniq, inv = _unique(id_array)
                if uniq.shape[0] != id_array.shape[0]:
                    id_array, inverse = uniq, inv
            todo[key] = (read.table, id_array, inverse)
        parts: list[_Part] = []
        spans: list[tuple[int, int, int] | None] = [None] * len(reads)  # part, ids' span
        layouts = self._wide_layouts(reads, keys, todo, uses)
        for (_, nbytes, take, ttl), members in layouts.items():
            part = self._wide_part(
                [todo[keys[m]] for m in members],
                nbytes=nbytes,
                take=take,
                exptime=ttl,
            )
            starts = cast("NDArray[np.intp]", part.placed.starts).tolist()
            bounds = [*starts, part.placed.ids.shape[0]]
            for k, m in enumerate(members):
                spans[m] = (len(parts), bounds[k], bounds[k + 1])
            parts.append(part)
        narrow = {keys[r]: todo[keys[r]][:2] for r in range(len(reads)) if spans[r] is None}
        placed_of = dict(zip(narrow, self._place_many(list(narrow.values())), strict=True))
        for r, read in enumerate(reads):
            if spans[r] is not None:
                continue
            placed = placed_of[keys[r]]
            nbytes, take = self._read_bytes(read)
            spans[r] = (len(parts), 0, placed.ids.shape[0])
            parts.append(
                _Part(
                    placed,
                    self._prefix(placed, read.kind),
                    placed.by_node,
                    nbytes=nbytes,
                    take=take,
                    exptime=self._exptime(read.table, write=False, kind=read.kind),
                )
            )
        results = await self._read(parts)
        out: list[tuple[NDArray[np.float32], NDArray[np.bool_]]] = []
        for key, span in zip(keys, spans, strict=True):
            p, start, stop = cast("tuple[int, int, int]", span)
            values, found = results[p][0][start:stop], results[p][1][start:stop]
            _, _, inverse = todo[key]
            out.append((values, found) if inverse is None else (values[inverse], found[inverse]))
        return out

    def _wide_layouts(
        self,
        reads: Sequence[TableRead],
        keys: Sequence[tuple[str, int]],
        todo: Mapping[tuple[str, int], tuple[str, IdArray, NDArray[np.intp] | None]],
        uses: Mapping[tuple[str, int], int],
    ) -> dict[tuple[int, int, int, int], list[int]]:
        """The reads `get_many` sends as wide parts, by layout (key prefix length, value
        size, bytes kept, TTL): reads of rows of int64 ids, each its own ids, two or
        more of one layout."""
        layouts: dict[tuple[int, int, int, int], list[int]] = {}
        for r, (key, read) in enumerate(zip(keys, reads, strict=True)):
            if read.kind != Kind.ROW or uses[key] != 1 or todo[key][1].dtype != np.int64:
                continue
            nbytes, take = self._read_bytes(read)
            layout = (
                len(key_prefix(self.namespace, read.table, Kind.ROW)),
                nbytes,
                take,
                self._exptime(read.table, write=False),
            )
            layouts.setdefault(layout, []).append(r)
        return {layout: members for layout, members in layouts.items() if len(members) > 1}

    def _wide_part(
        self,
        items: Sequence[tuple[str, IdArray, NDArray[np.intp] | None]],
        *,
        nbytes: int,
        take: int,
        exptime: int,
    ) -> _Part:
        """One read of the rows of several int64 tables of one layout (`_wide_layouts`):
        their ids one table after another, each key with its table's prefix."""
        placed = self._place_wide([(table, ids) for table, ids, _ in items])
        prefixes = np.stack(
            [
                np.frombuffer(key_prefix(self.namespace, table, Kind.ROW), dtype=np.uint8)
                for table, _, _ in items
            ]
        )
        return _Part(
            placed,
            np.repeat(prefixes, [ids.shape[0] for _, ids, _ in items], axis=0),
            placed.by_node,
            nbytes=nbytes,
            take=take,
            exptime=exptime,
        )

    async def set(
        self,
        table: str,
        ids: Any,
        values: NDArray[np.float32],
        *,
        kind: str = Kind.ROW,
        slots: NDArray[np.float32] | None = None,
    ) -> None:
        """Write fixed-width float32 values (n, width) of unique `ids` (overwrite).

        Rows are stored with their optimizer `slots` (n, slot_width) in one item; None
        gives them the optimizer's initial slots.

        Raises:
            ValueError: duplicate ids or a shape mismatch.
            StoreFullError: a node is out of memory (some values may be written).
        """
        await self.set_many([TableWrite(table, ids, values, kind, slots)])

    async def set_many(self, writes: Sequence[TableWrite], *, unique: bool = False) -> None:
        """`set` of many (table, kind) parts in one request per node (overwrite).

        Writes of one table that pass the same `ids` object are checked, encoded and
        placed once. Each (table, kind) may appear once. A row and its slots
        (`TableWrite.slots`) are one item: one `ms`. `unique=True`: the caller
        guarantees every write's ids are unique (skips the check, a sort of each).

        Raises:
            ValueError: duplicate ids, a shape mismatch, or one (table, kind) twice
                (before anything is sent).
            KeyEncodingError: ids that cannot be keys, or row ids of the wrong type.
            StoreFullError: a node is out of memory (some values may be written).
            DataLossError, NodeUnavailableError: see errors.py.
        """
        await self._write(self._write_parts(writes, unique=unique), add=False)

    async def add(
        self,
        table: str,
        ids: Any,
        values: NDArray[np.float32],
        *,
        kind: str = Kind.ROW,
        unique: bool = False,
        slots: NDArray[np.float32] | None = None,
    ) -> NDArray[np.bool_]:
        """Set-if-absent for unique `ids`; returns which values were stored, bool (n,).

        `unique=True`: the caller guarantees the ids are unique (skips the check). Rows
        get `slots` as `set` gives them.
        """
        (stored,) = await self.add_many(
            [TableWrite(table, ids, values, kind, slots)], unique=unique
        )
        return stored

    async def add_many(
        self, writes: Sequence[TableWrite], *, unique: bool = False
    ) -> list[NDArray[np.bool_]]:
        """`add` (set-if-absent) of many (table, kind) parts in one request per node.

        Returns, per write in order, which of its values were stored, bool (n,).
        `unique=True`: the caller guarantees every write's ids are unique. Raises
        what `set_many` raises.
        """
        return await self._write(self._write_parts(writes, unique=unique), add=True)

    # ------------------------------------------------------------ blobs

    async def get_blobs(self, table: str, ids: Any, *, kind: str) -> list[bytes | None]:
        """Read variable-length values (dense chunks, bookkeeping) of unique `ids`."""
        id_array = as_ids(ids, table=table)
        out: list[bytes | None] = [None] * id_array.shape[0]

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            values = await batch.mg_blobs(node, keys, sentinel=self._guard)
            for i, value in zip(index.tolist(), values, strict=True):
                out[i] = value

        await self._fan_out(table, kind, id_array, one)
        return out

    async def set_blobs(
        self,
        table: str,
        ids: Any,
        values: Sequence[Wire],
        *,
        kind: str,
        add: bool = False,
        ttl_s: int = 0,
    ) -> NDArray[np.bool_]:
        """Write variable-length values of unique `ids`; returns which were stored.

        `add` stores only absent keys; `ttl_s` > 0 lets the values expire (up to
        `core.expiry.MAX_TTL_S`; above 30 days sent as the absolute time it ends).
        """
        id_array = as_ids(ids, table=table)
        if len(values) != id_array.shape[0]:
            raise ValueError(f"{id_array.shape[0]} ids but {len(values)} values")
        self._require_unique(table, id_array)
        stored = np.zeros(id_array.shape[0], dtype=bool)

        expiry = [exptime(ttl_s, time.time()) if ttl_s > 0 else 0]

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            (stored[index],), _ = await batch.ms(
                node,
                [(keys, [values[i] for i in index.tolist()])],
                add=add,
                exptimes=expiry,
                sentinel=self._guard,
            )

        await self._fan_out(table, kind, id_array, one)  # an overwrite that failed raised
        return stored

    async def delete_blobs(self, table: str, ids: Any, *, kind: str) -> NDArray[np.bool_]:
        """Delete the values of unique `ids`; returns which existed."""
        id_array = as_ids(ids, table=table)
        existed = np.zeros(id_array.shape[0], dtype=bool)

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            existed[index] = await batch.md(node, keys, sentinel=self._guard)

        await self._fan_out(table, kind, id_array, one)
        return existed

    # ------------------------------------------------------------ sentinels

    async def sentinels(self) -> dict[str, bytes | None]:
        """Each node's sentinel value (None where it is missing), one round trip per node
        (`peek` of nothing else)."""
        sentinels, _ = await self.peek([])
        return sentinels

    async def peek(
        self, reads: Sequence[tuple[str, Any, str]]
    ) -> tuple[dict[str, bytes | None], list[list[bytes | None]]]:
        """Every node's sentinel (`sentinels`) and the blobs of each (table, unique ids,
        kind) of `reads` (`get_blobs`), in one round trip per node: its sentinel read,
        then its keys. A push's bookkeeping reads (its done record, the dense pointer)
        ride on the sentinel reads it makes anyway.

        Raises:
            DataLossError: a node that lost its sentinel holds some of the keys (a
                batch's sentinel in front refuses its reads the same way).
        """
        placed = self._place_many([(table, as_ids(ids, table=table)) for table, ids, _ in reads])
        parts = [
            _Part(p, self._prefix(p, kind), p.by_node)
            for p, (_, _, kind) in zip(placed, reads, strict=True)
        ]
        out: list[list[bytes | None]] = [[None] * p.ids.shape[0] for p in placed]
        segments: dict[Node, list[Segment]] = {node: [] for node in self._nodes}
        for node, chunk in self._chunks(parts):  # a node's keys: one request, however many
            segments[node] += chunk

        async def read(node: Node) -> bytes | None:
            keys = [self._sentinel_key]
            for s in segments[node]:
                keys += [bytes(k) for k in s.keys] if isinstance(s.keys, np.ndarray) else s.keys
            sentinel, *values = await batch.mg_blobs(node, keys, sentinel=None)
            if segments[node] and self._check_sentinels:
                if sentinel is None:
                    raise self._lost(node, writes=False)
                self._accept_sentinel(node.address, sentinel)
            got = iter(values)
            for s in segments[node]:
                for i in s.index.tolist():
                    out[s.part][i] = next(got)
            return sentinel

        sentinels = await _gather([read(node) for node in self._nodes])
        return dict(zip(self.nodes, sentinels, strict=True)), out

    async def write_sentinels(self, nodes: Sequence[str] | None = None) -> dict[str, bool]:
        """`add` the sentinel on `nodes` (default: all); returns which nodes got a new one.

        The value records the namespace, node, time and a cluster id shared by
        every sentinel written in this call.
        """
        wanted = list(self.nodes if nodes is None else nodes)
        unknown = sorted(set(wanted) - set(self.nodes))
        if unknown:
            raise ValueError(f"not nodes of this cluster: {', '.join(unknown)}")
        cluster_id = uuid.uuid4().hex

        async def write(node: Node) -> bool:
            value = json.dumps(
                {
                    "format": STORAGE_FORMAT,
                    "namespace": self.namespace,
                    "node": node.address,
                    "cluster_id": cluster_id,
                    "created": time.time(),
                }
            ).encode()
            (stored,), _ = await batch.ms(
                node, [([self._sentinel_key], [value])], add=True, sentinel=None
            )
            return bool(stored[0])

        targets = [n for n in self._nodes if n.address in wanted]
        results = await _gather([write(node) for node in targets])
        return {n.address: ok for n, ok in zip(targets, results, strict=True)}

    def check_format(self, address: str, sentinel: bytes) -> None:
        """Raise StorageFormatError unless `sentinel` (node `address`'s) records this
        version's storage format (`core.keyspace.STORAGE_FORMAT`)."""
        self._sentinels.check_format(address, sentinel)

    async def stats(self) -> dict[str, dict[str, str]]:
        """memcached `stats` of every node (values as text), each on its own connection."""
        values = await _gather(
            [commands.stats(spec, self.config.store) for spec in self.config.memcached]
        )
        return dict(zip(self.nodes, values, strict=True))

    # ------------------------------------------------------------ internals: preparing

    def _table_ids(self, table: str, ids: Any) -> IdArray:
        spec = self.config.table(table)
        id_array = as_ids(ids, table=table)
        is_int = id_array.dtype == np.int64
        if id_array.shape[0] and is_int != (spec.id_type == "int64"):
            got = "int64" if is_int else "str"
            raise KeyEncodingError(
                f"table {table!r} has id_type={spec.id_type!r} but got {got} ids "
                f"(e.g. {id_array[0]!r}); pass {spec.id_type} ids or set id_type in [[tables]]"
            )
        return id_array

    def _ids_of(self, table: str, ids: Any, *, rows: bool) -> IdArray:
        """Normalized ids; those of rows (`rows`) must have the table's id type."""
        return self._table_ids(table, ids) if rows else as_ids(ids, table=table)

    def _require_unique(self, table: str, ids: IdArray) -> None:
        ordered = np.sort(ids)
        if ordered.shape[0] > 1 and (ordered[1:] == ordered[:-1]).any():
            raise ValueError(f"a write to table {table!r} has duplicate ids; sum or dedupe first")

    def _place(self, table: str, ids: IdArray) -> _Placed:
        """Encode `ids` once and split them by node (rendezvous placement, ignores the kind)."""
        return self._place_many([(table, ids)])[0]

    def _place_many(self, items: Sequence[tuple[str, IdArray]]) -> list[_Placed]:
        """`_place` of several (table, ids). The int64 ids of every table are encoded and
        placed in one pass of numpy operations (`node_of_many`), not one per table; str
        ids table by table. One stable sort by (table, node) splits them all."""
        if not items:
            return []
        k = len(self._nodes)
        bodies: list[IdBodies | None] = [None] * len(items)
        placement: list[NDArray[np.intp]] = [np.zeros(0, dtype=np.intp)] * len(items)
        ints = [i for i, (_, ids) in enumerate(items) if ids.dtype == np.int64]
        if ints:
            encoded, where, starts = self._encode_ints([items[i] for i in ints])
            for n, i in enumerate(ints):
                a, b = starts[n], starts[n + 1]
                table, ids = items[i]
                bodies[i] = IdBodies(
                    ids=ids, table=table, bodies=encoded[a:b], longest=INT_ID_BYTES
                )
                if where is not None:
                    placement[i] = where[a:b]
        for i, (table, ids) in enumerate(items):
            if bodies[i] is None:
                bodies[i] = id_bodies(table, ids)
                if k > 1:
                    placement[i] = node_of(table, ids, self.nodes)
        done = cast("list[IdBodies]", bodies)
        if k == 1:
            return [
                _Placed(table, ids, done[i], [np.arange(ids.shape[0], dtype=np.intp)])
                for i, (table, ids) in enumerate(items)
            ]
        sizes = [ids.shape[0] for _, ids in items]
        firsts = list(itertools.accumulate(sizes, initial=0))
        group = np.repeat(np.arange(len(items)) * k, sizes) + np.concatenate(placement)
        each = _positions_by(group, len(items) * k)  # item i's on node j: each[i * k + j]
        return [
            _Placed(table, ids, done[i], [each[i * k + j] - firsts[i] for j in range(k)])
            for i, (table, ids) in enumerate(items)
        ]

    def _encode_ints(
        self, items: Sequence[tuple[str, IdArray]]
    ) -> tuple[NDArray[np.uint8], NDArray[np.intp] | None, list[int]]:
        """The key bodies and nodes (None: one node) of several tables' int64 ids,
        concatenated, in one pass of numpy operations (`node_of_many`), and where each
        table's start."""
        arrays = [cast("NDArray[np.int64]", ids) for _, ids in items]
        starts = list(itertools.accumulate((a.shape[0] for a in arrays), initial=0))
        encoded = id_bodies(items[0][0], np.concatenate(arrays)).bodies
        where = (
            node_of_many([table for table, _ in items], arrays, self.nodes)
            if len(self._nodes) > 1
            else None
        )
        return cast("NDArray[np.uint8]", encoded), where, starts

    def _place_wide(self, items: Sequence[tuple[str, IdArray]]) -> _Placed:
        """Several tables' int64 ids as one: one after another, encoded and placed
        together, each node's positions ascending (a wide read, `get_many`)."""
        encoded, where, starts = self._encode_ints(items)
        ids = cast("IdArray", np.concatenate([ids for _, ids in items]))
        if where is None:
            by_node = [np.arange(ids.shape[0], dtype=np.intp)]
        else:
            by_node = _positions_by(where, len(self._nodes))
        return _Placed(
            items[0][0],
            ids,
            IdBodies(ids=ids, table=items[0][0], bodies=encoded, longest=INT_ID_BYTES),
            by_node,
            tables=tuple(table for table, _ in items),
            starts=np.asarray(starts[:-1], dtype=np.intp),
        )

    def _prefix(self, placed: _Placed, kind: str) -> bytes:
        """The key prefix of `kind`, checked against the longest id of `placed`."""
        prefix = key_prefix(self.namespace, placed.table, kind)
        placed.bodies.check_prefix(prefix)
        return prefix

    def _write_parts(self, writes: Sequence[TableWrite], *, unique: bool) -> list[_Part]:
        """Check every write and place each table's ids once; nothing is sent yet."""
        seen: set[tuple[str, str]] = set()
        rows_of = {_group_key(w.table, w.ids) for w in writes if w.kind == Kind.ROW}
        todo: dict[tuple[str, int], tuple[str, IdArray]] = {}
        for w in writes:
            if (w.table, w.kind) in seen:
                raise ValueError(
                    f"two writes of table {w.table!r} kind {str(w.kind)!r} in one batch; "
                    f"concatenate their ids and values"
                )
            seen.add((w.table, w.kind))
            key = _group_key(w.table, w.ids)
            if key not in todo:
                id_array = self._ids_of(w.table, w.ids, rows=key in rows_of)
                if not unique:
                    self._require_unique(w.table, id_array)
                todo[key] = (w.table, id_array)
        placed_of = dict(zip(todo, self._place_many(list(todo.values())), strict=True))
        parts: list[_Part] = []
        for w in writes:
            placed = placed_of[_group_key(w.table, w.ids)]
            n = placed.ids.shape[0]
            arr = np.asarray(w.values)
            if arr.ndim != 2 or arr.shape[0] != n:
                raise ValueError(
                    f"values for table {w.table!r} must be (n, width) with n={n} "
                    f"ids; got shape {arr.shape}"
                )
            if w.kind == Kind.ROW:
                matrix = self._items(w.table, arr, w.slots)
            elif w.slots is not None:
                raise ValueError(f"slots are stored with rows, not with kind {str(w.kind)!r}")
            else:
                matrix = encode_rows(arr, arr.shape[1])
            parts.append(
                _Part(
                    placed,
                    self._prefix(placed, w.kind),
                    placed.by_node,
                    values=matrix,
                    exptime=self._exptime(w.table, write=True, kind=w.kind),
                )
            )
        return parts

    def _exptime(self, table: str, *, write: bool, kind: str = Kind.ROW) -> int:
        """The T flag of a read or write of (table, kind): the table's TTL for its rows
        (reads only with `refresh_ttl`), 0 (no T: no change) otherwise."""
        ttl_s = self._ttls.get(table)
        if ttl_s is None or kind != Kind.ROW or not (write or self.refresh_ttl):
            return 0
        return exptime(ttl_s, time.time())

    # ------------------------------------------------------------ internals: row items

    def _layout(self, table: str) -> tuple[int, int]:
        """(dim, bytes of one stored row) of `table`; ConfigError if there is no such table."""
        layout = self._layouts.get(table)
        # config.table raises ConfigError for a table it does not have, naming those it has
        return layout if layout is not None else self._layouts[self.config.table(table).name]

    def _item_bytes(self, table: str) -> int:
        """Bytes of one stored row of `table`: its dim, then its optimizer's slots."""
        return self._layout(table)[1]

    def _read_bytes(self, read: TableRead) -> tuple[int, int]:
        """(value bytes, bytes kept of each) of a fixed-width read."""
        if read.kind != Kind.ROW:
            if read.slots:
                raise ValueError(f"slots are read with rows, not with kind {str(read.kind)!r}")
            if read.width is None:
                raise ValueError(f"a read of kind {str(read.kind)!r} needs its width")
            return row_bytes(read.width), 0
        dim, nbytes = self._layout(read.table)
        if read.width is not None and read.width != dim:
            raise ValueError(
                f"table {read.table!r} has dim={dim}; a read of its rows cannot have "
                f"width={read.width} (slots=True reads each row with its slots)"
            )
        return nbytes, 0 if read.slots else row_bytes(dim)

    def _items(
        self, table: str, rows: NDArray[np.float32], slots: NDArray[np.float32] | None
    ) -> NDArray[np.uint8]:
        """The stored values of `rows` and their `slots` (None: the optimizer's initial
        ones), uint8 (n, item bytes); ValueError on a shape that does not fit the table."""
        spec = self.config.table(table)
        optimizer = self._optimizers[table]
        width = optimizer.slot_width(spec.dim)
        n = rows.shape[0]
        if rows.shape[1] != spec.dim:
            raise ValueError(
                f"table {table!r} has dim={spec.dim} but the rows have {rows.shape[1]} floats"
            )
        if slots is None:
            if not width:
                return encode_rows(rows, spec.dim)
            slots = optimizer.initial_slots(1, spec.dim)  # every row's: broadcast below
        else:
            slots = np.asarray(slots)
            if slots.shape != (n, width):
                raise ValueError(
                    f"table {table!r} keeps {width} slot floats per row (optimizer "
                    f"{spec.optimizer.name!r}, dim {spec.dim}); got slots of shape "
                    f"{slots.shape} for {n} rows"
                )
        both = np.empty((n, spec.dim + width), dtype=ROW_DTYPE)
        both[:, : spec.dim] = rows
        both[:, spec.dim :] = slots
        return both.view(np.uint8)

    def _counter_part(self, t: _TableLookup, missing: NDArray[np.bool_]) -> _Part:
        """The admission counters of the ids of `t` where `missing` is true."""
        placed = t.rows.placed
        spec = self.config.table(t.table)
        return _Part(
            placed,
            self._prefix(placed, Kind.COUNTER),
            placed.only(missing),
            exptime=exptime(spec.counter_ttl_s, time.time()),
        )

    @staticmethod
    def _vanished(table: str, id_: object) -> StoreError:
        return StoreError(
            f"row {id_!r} of table {table!r} was created by another writer but "
            f"is gone again (deleted or flushed between two round trips)"
        )

    # ------------------------------------------------------------ internals: fan-out

    def _chunks(self, parts: Sequence[_Part]) -> list[tuple[Node, list[Segment]]]:
        """Each node's ids of every part, as round trips of at most `max_batch_keys` keys.

        Every key is built here, before anything is sent.
        """
        step = self.config.store.max_batch_keys
        out: list[tuple[Node, list[Segment]]] = []
        for j, node in enumerate(self._nodes):
            segments: list[Segment] = []
            size = 0
            for p, part in enumerate(parts):
                positions = part.by_node[j]
                start = 0
                while start < positions.shape[0]:
                    index = positions[start : start + step - size]
                    keys = prefixed_keys(part.prefix, part.placed.bodies.bodies, index)
                    segments.append(Segment(p, index, keys, part.exptime))
                    size += index.shape[0]
                    start += index.shape[0]
                    if size == step:
                        out.append((node, segments))
                        segments, size = [], 0
            if segments:
                out.append((node, segments))
        return out

    async def _run(self, jobs: Sequence[Coroutine[Any, Any, None]]) -> None:
        """Run the round trips of a batch; a batch on an uninitialized cluster says so."""
        if not jobs:
            return
        try:
            await _gather(jobs)
        except DataLossError as exc:
            if not any(v is not None for v in (await self.sentinels()).values()):
                raise ClusterNotInitializedError(
                    f"namespace {self.namespace!r} is not initialized on any memcached node "
                    f"({', '.join(self.nodes)}): run `lookup-table-admin init --config FILE` "
                    f"(deploy/cluster.sh up does it)"
                ) from exc
            raise

    async def _read(
        self, parts: Sequence[_Part]
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """Fixed-width reads of every part: one request per node (per max_batch_keys)."""
        results = [
            (
                np.zeros((p.placed.ids.shape[0], p.kept // ROW_DTYPE.itemsize), dtype=np.float32),
                np.zeros(p.placed.ids.shape[0], dtype=bool),
            )
            for p in parts
        ]
        chunks = self._chunks(parts)
        describe = self._describer(parts)
        await self._run(
            [
                batch.mg_rows(node, parts, segs, results, sentinel=self._guard, describe=describe)
                for node, segs in chunks
            ]
        )
        return results

    async def _write(self, parts: Sequence[_Part], *, add: bool) -> list[NDArray[np.bool_]]:
        """`ms` (or `add`) of every part: one request per node (per max_batch_keys)."""
        stored, _ = await self._add_and_count(parts, [], add=add)
        return stored

    async def _add_and_count(
        self, writes: Sequence[_Part], counts: Sequence[_Part], *, add: bool = True
    ) -> tuple[list[NDArray[np.bool_]], list[NDArray[np.uint64]]]:
        """`ms` (`add`: set-if-absent) of every write part and `ma` (one sighting) of every
        counter part, together: one request per node (per max_batch_keys).

        Returns, per write part, which values were stored, and per counter part, the
        counts after this sighting (uint64, aligned with the part's ids; 0 where not sent).
        """
        if not writes and not counts:
            return [], []
        parts = [*writes, *counts]
        stored = [np.zeros(p.placed.ids.shape[0], dtype=bool) for p in writes]
        counted = [np.zeros(p.placed.ids.shape[0], dtype=np.uint64) for p in counts]

        async def one(node: Node, segments: list[Segment]) -> None:
            sets = [s for s in segments if s.part < len(writes)]
            mas = [s for s in segments if s.part >= len(writes)]
            flags, values = await batch.ms(
                node,
                [(s.keys, parts[s.part].values_at(s.index)) for s in sets],
                add=add,
                exptimes=[s.exptime for s in sets],
                counts=[(s.keys, s.exptime) for s in mas],
                sentinel=self._guard,
            )
            for s, ok in zip(sets, flags, strict=True):
                stored[s.part][s.index] = ok
            for s, got in zip(mas, values, strict=True):
                counted[s.part - len(writes)][s.index] = got

        await self._run([one(node, segments) for node, segments in self._chunks(parts)])
        return stored, counted

    async def _fan_out(
        self,
        table: str,
        kind: str,
        ids: IdArray,
        job: Callable[[Node, NDArray[np.intp], Keys], Coroutine[Any, Any, None]],
    ) -> None:
        """Split the ids of one (table, kind) by node (and max_batch_keys); run `job` on each."""
        if ids.shape[0] == 0:
            return
        placed = self._place(table, ids)
        part = _Part(placed, self._prefix(placed, kind), placed.by_node)
        chunks = self._chunks([part])
        await self._run([job(node, s.index, s.keys) for node, (s,) in chunks])

    # ------------------------------------------------------------ internals: round trips

    def _lost(self, node: Node, *, writes: bool) -> DataLossError:
        return self._sentinels.lost(node, writes=writes)

    def _accept_sentinel(self, address: str, value: bytes) -> None:
        self._sentinels.accept(address, value)

    def _describer(self, parts: Sequence[_Part]) -> Callable[[int, int], tuple[str, str]]:
        """For a read's CorruptValueError: the table of an id of a part, and what its
        values should hold."""

        def describe(p: int, position: int) -> tuple[str, str]:
            table = parts[p].placed.table_at(position)
            return table, self._layout_text(parts[p], table)

        return describe

    def _layout_text(self, part: _Part, table: str) -> str:
        """What a value of `table` in a fixed-width read should hold, for a
        CorruptValueError."""
        wide = isinstance(part.prefix, np.ndarray)  # a wide part reads rows only
        if not wide and part.prefix != key_prefix(self.namespace, table, Kind.ROW):
            return f"{part.nbytes} ({part.nbytes // 4} float32)"
        spec = self.config.table(table)
        width = self._optimizers[table].slot_width(spec.dim)
        return (
            f"{part.nbytes} (its dim {spec.dim} and {width} slot floats of its "
            f"{spec.optimizer.name!r} optimizer, float32)"
        )
