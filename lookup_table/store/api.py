"""`EmbeddingStore`: the async shell over the memcached fleet (docs/storage.md).

A batch costs one pipelined round trip per node (per `store.max_batch_keys` keys),
all nodes in parallel::

    store = EmbeddingStore(load_config("cluster.toml"))
    async with store:
        rows = await store.lookup("user", ids)          # float32 (len(ids), dim)
        by_table = await store.lookup_many({"user": ids, "item": item_ids})
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.expiry import exptime
from lookup_table.core.initializers import initial_rows
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.core.keyspace import STORAGE_FORMAT, Kind
from lookup_table.errors import StoreError
from lookup_table.memcached import batch, commands
from lookup_table.memcached.node import Node
from lookup_table.memcached.protocol import Keys, Wire
from lookup_table.store.fanout import FanOut
from lookup_table.store.gathering import gather
from lookup_table.store.items import Items, TableLookup
from lookup_table.store.placement import (
    Part,
    Placement,
    TableRead,
    TableWrite,
    group_key,
    unique_ids,
)
from lookup_table.store.sentinels import Sentinels, stored_layouts

__all__ = ["EmbeddingStore"]

_HIDDEN_SENTINEL_TRIES = 3

T = TypeVar("T")


_OVERLAP_FLOATS = 1 << 18
"""From this many floats, a lookup that creates rows puts them in the caller's order in a
thread while its adds are in flight (`_in_order_during`): a big gather after the adds'
round trip is on the critical path. The bound is the service's for its optimizer steps
(`optimizer_service.engine.stepping.OFFLOAD_FLOATS`); smaller gathers stay inline (a thread's
hand-off would cost more than it frees)."""


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
        self.created: dict[str, int] = {}  # rows this store created, per table
        self._sentinels = Sentinels(config.namespace, stored_layouts(config))
        self._sentinel_key = self._sentinels.key
        self._placement = Placement(config)
        self._items = Items(config, self._placement, refresh_ttl=refresh_ttl)
        self._fan = FanOut(
            config, self._placement, self._items, self._sentinels, check_sentinels=check_sentinels
        )

    async def __aenter__(self) -> EmbeddingStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection. The store cannot be used afterwards."""
        await self._fan.close()

    @property
    def refresh_ttl(self) -> bool:
        """Reads of rows of a table with `ttl_s` reset their TTL."""
        return self._items.refresh_ttl

    @refresh_ttl.setter
    def refresh_ttl(self, value: bool) -> None:
        self._items.refresh_ttl = value

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
        id_array = self._placement.table_ids(table, ids)
        if id_array.shape[0] == 0:
            return np.zeros((0, spec.dim), dtype=np.float32)
        uniq, inverse = unique_ids(id_array)
        values, found = await self.get(table, uniq, width=spec.dim, unique=True)
        missing = np.flatnonzero(~found)
        if not missing.size:
            return values[inverse]
        fresh = self._items.codec(table).round(
            initial_rows(spec.initializer, seed=spec.seed, ids=uniq[missing], dim=spec.dim)
        )
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
        prepared: list[tuple[str, NDArray[np.intp], Part]] = []
        uniques = [
            (table, unique_ids(self._placement.table_ids(table, table_ids)))
            for table, table_ids in ids.items()
        ]
        placements = self._placement.place_many([(table, uniq) for table, (uniq, _) in uniques])
        for (table, (_, inverse)), placed in zip(uniques, placements, strict=True):
            rows = Part(
                placed,
                self._placement.prefix(placed, Kind.ROW),
                placed.by_node,
                self._items.item_bytes(table),
                take=self._items.codec(table).row_bytes,
                exptime=self._items.exptime(table, write=False),
                decode=self._items.read_decoder(table, slots=False),
            )
            prepared.append((table, inverse, rows))
        read = await self._fan.read([rows for _, _, rows in prepared])
        lookups = [
            TableLookup(table, inverse, rows, values, found)
            for (table, inverse, rows), (values, found) in zip(prepared, read, strict=True)
        ]

        new = [(t, ~t.found) for t in lookups if not t.found.all()]
        for t, missing in new:
            spec = self.config.table(t.table)
            # as stored: a new row reads back as it is returned here
            t.values[missing] = self._items.codec(t.table).round(
                initial_rows(
                    spec.initializer, seed=spec.seed, ids=t.rows.placed.ids[missing], dim=spec.dim
                )
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
        self, new: Sequence[tuple[TableLookup, NDArray[np.bool_]]]
    ) -> list[tuple[TableLookup, NDArray[np.bool_], NDArray[np.float32]]]:
        """`lookup_many`'s writes: add the rows of each table's `missing` ids (their
        initial values are in its `values` already), or count the sightings of a table
        with `admit_after` and add the rows of the ids that reached it; re-read the rows
        whose add another writer won.

        Returns, per table with lost races, (lookup, lost mask over its unique ids, the
        rows read, aligned with its unique ids: valid where lost). It never writes a
        lookup's `values` (`_in_order_during` gathers them meanwhile).
        """
        for t, _ in new:  # adds give the TTL: a new row is a use
            t.rows.exptime = self._items.exptime(t.table, write=True)
        now = [(t, m) for t, m in new if self.config.table(t.table).admit_after == 1]
        counted = [(t, m) for t, m in new if self.config.table(t.table).admit_after > 1]
        add_parts = [t.add(m, self._items.encode(t.table, t.values[m], None)) for t, m in now]
        if counted:
            stored_all, counts = await self._fan.add_and_count(
                add_parts, [self._items.counter_part(t, m) for t, m in counted]
            )
        else:
            stored_all, counts = await self._write(add_parts, add=True), []
        adds = list(zip(now, stored_all, strict=True))
        admitted: list[tuple[TableLookup, NDArray[np.bool_]]] = []
        for (t, missing), count in zip(counted, counts, strict=True):
            ready = missing & (count >= self.config.table(t.table).admit_after)
            if ready.any():
                admitted.append((t, ready))
        if admitted:  # the ids whose sighting just reached admit_after get their row
            stored_late = await self._write(
                [t.add(m, self._items.encode(t.table, t.values[m], None)) for t, m in admitted],
                add=True,
            )
            adds += zip(admitted, stored_late, strict=True)
        raced: list[tuple[TableLookup, NDArray[np.bool_]]] = []
        for (t, missing), stored in adds:
            self.created[t.table] = self.created.get(t.table, 0) + int(stored.sum())
            if not stored[missing].all():
                raced.append((t, missing & ~stored))
        if not raced:
            return []
        again = await self._fan.read([t.reread(lost) for t, lost in raced])
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
        keys = [group_key(r.table, r.ids) for r in reads]
        rows_of = {key for key, r in zip(keys, reads, strict=True) if r.kind == Kind.ROW}
        todo: dict[tuple[str, int], tuple[str, IdArray, NDArray[np.intp] | None]] = {}
        uses = Counter(keys)
        for key, read in zip(keys, reads, strict=True):
            if key in todo:
                continue
            id_array = self._placement.ids_of(read.table, read.ids, rows=key in rows_of)
            inverse = None
            if not unique:
                uniq, inv = unique_ids(id_array)
                if uniq.shape[0] != id_array.shape[0]:
                    id_array, inverse = uniq, inv
            todo[key] = (read.table, id_array, inverse)
        parts: list[Part] = []
        spans: list[tuple[int, int, int] | None] = [None] * len(reads)  # part, ids' span
        layouts = self._items.wide_layouts(reads, keys, todo, uses)
        for (_, nbytes, take, ttl, _), members in layouts.items():
            part = self._items.wide_part(
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
        placed_of = dict(
            zip(narrow, self._placement.place_many(list(narrow.values())), strict=True)
        )
        for r, read in enumerate(reads):
            if spans[r] is not None:
                continue
            placed = placed_of[keys[r]]
            nbytes, take = self._items.read_bytes(read)
            spans[r] = (len(parts), 0, placed.ids.shape[0])
            parts.append(
                Part(
                    placed,
                    self._placement.prefix(placed, read.kind),
                    placed.by_node,
                    nbytes=nbytes,
                    take=take,
                    exptime=self._items.exptime(read.table, write=False, kind=read.kind),
                    decode=(
                        self._items.read_decoder(read.table, slots=read.slots)
                        if read.kind == Kind.ROW
                        else None
                    ),
                )
            )
        results = await self._fan.read(parts)
        out: list[tuple[NDArray[np.float32], NDArray[np.bool_]]] = []
        for key, span in zip(keys, spans, strict=True):
            p, start, stop = cast("tuple[int, int, int]", span)
            values, found = results[p][0][start:stop], results[p][1][start:stop]
            _, _, inverse = todo[key]
            out.append((values, found) if inverse is None else (values[inverse], found[inverse]))
        return out

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
        await self._write(self._items.write_parts(writes, unique=unique), add=False)

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
        return await self._write(self._items.write_parts(writes, unique=unique), add=True)

    # ------------------------------------------------------------ blobs

    async def get_blobs(self, table: str, ids: Any, *, kind: str) -> list[bytes | None]:
        """Read variable-length values (dense chunks, bookkeeping) of unique `ids`."""
        id_array = as_ids(ids, table=table)
        out: list[bytes | None] = [None] * id_array.shape[0]

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            values = await batch.mg_blobs(node, keys, sentinel=self._fan.guard)
            for i, value in zip(index.tolist(), values, strict=True):
                out[i] = value

        await self._fan.fan_out(table, kind, id_array, one)
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
        self._placement.requireunique(table, id_array)
        stored = np.zeros(id_array.shape[0], dtype=bool)

        expiry = [exptime(ttl_s, time.time()) if ttl_s > 0 else 0]

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            (stored[index],), _ = await batch.ms(
                node,
                [(keys, [values[i] for i in index.tolist()])],
                add=add,
                exptimes=expiry,
                sentinel=self._fan.guard,
            )

        await self._fan.fan_out(table, kind, id_array, one)  # an overwrite that failed raised
        return stored

    async def delete_blobs(self, table: str, ids: Any, *, kind: str) -> NDArray[np.bool_]:
        """Delete the values of unique `ids`; returns which existed."""
        id_array = as_ids(ids, table=table)
        existed = np.zeros(id_array.shape[0], dtype=bool)

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            existed[index] = await batch.md(node, keys, sentinel=self._fan.guard)

        await self._fan.fan_out(table, kind, id_array, one)
        return existed

    # ------------------------------------------------------------ sentinels

    async def sentinels(self) -> dict[str, bytes | None]:
        """Each node's sentinel value (None where it is missing), one round trip per node
        (`peek` of nothing else)."""
        return await self._fan.sentinels()

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
        return await self._fan.peek(reads)

    async def write_sentinels(self, nodes: Sequence[str] | None = None) -> dict[str, bool]:
        """`add` the sentinel on `nodes` (default: all); returns which nodes got a new one
        (not one restarted or flushed meanwhile). A sentinel that memcached hides because
        it came in the second of a `flush_all` (nodes run with -C) is added again after it.

        The value records the namespace, node, time, a cluster id shared by every
        sentinel written in this call, and each table's stored layout (`stored_layouts`).
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
                    "tables": self._sentinels.layouts,
                }
            ).encode()
            before = await restarts_and_flushes(node)
            for _ in range(_HIDDEN_SENTINEL_TRIES):
                (stored,), _ = await batch.ms(
                    node, [([self._sentinel_key], [value])], add=True, sentinel=None
                )
                if not stored[0]:
                    return False
                (seen,) = await batch.mg_blobs(node, [self._sentinel_key], sentinel=None)
                if seen is not None:
                    if self._fan.guard is not None:  # its tables need no layout record
                        self._sentinels.accept(node.address, seen)
                    return True
                # memcached without CAS (-C) hides every item written in the second of a
                # flush_all: add it again once that second is over, unless the node was
                # restarted or flushed since this call began (a loss to report, not hide)
                if await restarts_and_flushes(node) != before:
                    return False
                await asyncio.sleep(1.0)
            raise StoreError(
                f"memcached node {node.address} does not show the sentinel written to it "
                f"{_HIDDEN_SENTINEL_TRIES} times in a row; is something flushing it?",
                node=node.address,
            )

        specs = dict(zip(self.nodes, self.config.memcached, strict=True))

        async def restarts_and_flushes(node: Node) -> tuple[str | None, str | None]:
            stats = await commands.stats(specs[node.address], self.config.store)
            return stats.get("pid"), stats.get("cmd_flush")

        targets = [n for n in self._fan.connections if n.address in wanted]
        results = await gather([write(node) for node in targets])
        return {n.address: ok for n, ok in zip(targets, results, strict=True)}

    async def record_layouts(self, tables: Sequence[str] | None = None) -> dict[str, list[str]]:
        """Check the stored layout of `tables` (default: every table of the cluster file)
        on every node, and record it where neither the sentinel nor a record holds it
        (`store.layouts`; a batch of a table does the same before its first round trip).
        Returns, per node, the tables recorded by this call.

        Raises:
            StorageFormatError: a node holds one of the tables in another layout.
        """
        names = [t.name for t in self.config.tables] if tables is None else list(tables)
        for name in names:
            self.config.table(name)  # ConfigError: not a table of the cluster file
        return await self._fan.layouts.check(names)

    def check_format(self, address: str, sentinel: bytes) -> None:
        """Raise StorageFormatError unless `sentinel` (node `address`'s) records this
        version's storage format (`core.keyspace.STORAGE_FORMAT`)."""
        self._sentinels.check_format(address, sentinel)

    async def stats(self) -> dict[str, dict[str, str]]:
        """memcached `stats` of every node (values as text), each on its own connection."""
        values = await gather(
            [commands.stats(spec, self.config.store) for spec in self.config.memcached]
        )
        return dict(zip(self.nodes, values, strict=True))

    async def _write(self, parts: Sequence[Part], *, add: bool) -> list[NDArray[np.bool_]]:
        """`ms` (or `add`) of every part: one request per node (per max_batch_keys)."""
        return await self._fan.write(parts, add=add)

    @staticmethod
    def _vanished(table: str, id_: object) -> StoreError:
        return StoreError(
            f"row {id_!r} of table {table!r} was created by another writer but "
            f"is gone again (deleted or flushed between two round trips)"
        )
