"""Placement and parts: ids encoded and split by node once per call, and the (table,
kind) parts of a batch that share them.

`TableRead` / `TableWrite` are the public parts of `EmbeddingStore.get_many` / `set_many`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.keys import (
    INT_ID_BYTES,
    IdArray,
    IdBodies,
    as_ids,
    id_bodies,
    key_prefix,
)
from lookup_table.core.keyspace import Kind
from lookup_table.core.sharding import node_of, node_of_many
from lookup_table.errors import KeyEncodingError
from lookup_table.memcached.batch import Values

__all__ = [
    "Part",
    "Placed",
    "Placement",
    "TableRead",
    "TableWrite",
    "group_key",
    "positions_by",
    "unique_ids",
]


_MEMO_BATCH = 8  # str ids placed in batches up to this size are remembered
_MEMO_IDS = 4096  # ... up to this many (then forgotten at once: unique ones come too)
_ZERO = np.zeros(0, dtype=np.intp)


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
class Placed:
    """Ids of one table, encoded (without the kind's prefix) and placed on nodes once."""

    table: str
    ids: IdArray
    bodies: IdBodies
    by_node: list[NDArray[np.intp]]  # positions in `ids` of each node's ids, ascending
    # several tables' ids one after another (`Placement.place_wide`): table k's
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
class Part:
    """One (table, kind) of a batch: which ids of a `Placed` to send, and their values.

    Results of the part are aligned with `placed.ids`; ids not sent stay zero/false.
    """

    placed: Placed
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
    # fixed-width reads of values not stored as float32 (`store.items.TableCodec`): the
    # bytes read (n, kept) -> float32; None: the bytes are float32 as they are
    decode: Callable[[NDArray[np.uint8]], NDArray[np.float32]] | None = None

    @property
    def kept(self) -> int:
        """Bytes of each value a read keeps."""
        return self.take or self.nbytes

    def values_at(self, index: NDArray[np.intp]) -> Values:
        """The values of the ids at positions `index`: a value matrix with the rows of
        theirs in it (not gathered: `batch.ms` lays them out from there), or the blobs."""
        if self.rank is not None:
            index = self.rank[index]
        if isinstance(self.values, np.ndarray):
            return self.values, index
        if self.values is None:
            raise ValueError("a read part has no values")
        return [self.values[i] for i in index.tolist()]


def unique_ids(ids: IdArray) -> tuple[IdArray, NDArray[np.intp]]:
    """The sorted unique ids and the inverse, intp (n,): uniq[inverse] == ids."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    return cast("IdArray", uniq), inverse.reshape(-1)


def positions_by(group: NDArray[np.intp], count: int) -> list[NDArray[np.intp]]:
    """For each group number 0 .. count - 1, the positions of `group` that have it,
    ascending (one stable sort)."""
    if count <= np.iinfo(np.int16).max:  # numpy's stable sort of 16-bit keys: a radix sort
        group = group.astype(np.int16)
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(count + 1)).tolist()
    return [order[bounds[g] : bounds[g + 1]] for g in range(count)]


def group_key(table: str, ids: Any) -> tuple[str, int]:
    """Parts of one table that pass the same ids object share their encoding and placement."""
    return table, id(ids)


class Placement:
    """Encodes ids into key bodies and places them on the cluster's nodes (rendezvous
    hashing); checks ids against their table before anything is sent."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.namespace = config.namespace
        self.nodes: tuple[str, ...] = config.node_addresses
        # (table, str id) -> (key body, node) of ids placed in small batches: the
        # bookkeeping keys (journal slots, versions, dense pointers) come back every push
        self._memo: dict[tuple[str, str], tuple[bytes, int]] = {}

    def table_ids(self, table: str, ids: Any) -> IdArray:
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

    def ids_of(self, table: str, ids: Any, *, rows: bool) -> IdArray:
        """Normalized ids; those of rows (`rows`) must have the table's id type."""
        return self.table_ids(table, ids) if rows else as_ids(ids, table=table)

    def requireunique(self, table: str, ids: IdArray) -> None:
        ordered = np.sort(ids)
        if ordered.shape[0] > 1 and (ordered[1:] == ordered[:-1]).any():
            raise ValueError(f"a write to table {table!r} has duplicate ids; sum or dedupe first")

    def place(self, table: str, ids: IdArray) -> Placed:
        """Encode `ids` once and split them by node (rendezvous placement, ignores the kind)."""
        return self.place_many([(table, ids)])[0]

    def place_many(self, items: Sequence[tuple[str, IdArray]]) -> list[Placed]:
        """`place` of several (table, ids). The int64 ids of every table are encoded and
        placed in one pass of numpy operations (`node_of_many`), not one per table; str
        ids table by table. One stable sort by (table, node) splits them all."""
        if not items:
            return []
        k = len(self.nodes)
        bodies: list[IdBodies | None] = [None] * len(items)
        placement: list[NDArray[np.intp]] = [np.zeros(0, dtype=np.intp)] * len(items)
        ints = [i for i, (_, ids) in enumerate(items) if ids.dtype == np.int64]
        if ints:
            encoded, where, starts = self.encode_ints([items[i] for i in ints])
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
                bodies[i], placement[i] = self._str_placed(table, ids)
        done = cast("list[IdBodies]", bodies)
        if k == 1:
            return [
                Placed(table, ids, done[i], [np.arange(ids.shape[0], dtype=np.intp)])
                for i, (table, ids) in enumerate(items)
            ]
        if len(items) == 1:  # no sort: each node's positions, ascending
            table, ids = items[0]
            where = placement[0]
            return [Placed(table, ids, done[0], [np.flatnonzero(where == j) for j in range(k)])]
        sizes = [ids.shape[0] for _, ids in items]
        firsts = list(itertools.accumulate(sizes, initial=0))
        group = np.repeat(np.arange(len(items)) * k, sizes) + np.concatenate(placement)
        each = positions_by(group, len(items) * k)  # item i's on node j: each[i * k + j]
        return [
            Placed(table, ids, done[i], [each[i * k + j] - firsts[i] for j in range(k)])
            for i, (table, ids) in enumerate(items)
        ]

    def _str_placed(self, table: str, ids: IdArray) -> tuple[IdBodies, NDArray[np.intp]]:
        """The key bodies and nodes of str ids; those of a small batch remembered."""
        one_node = len(self.nodes) == 1
        if ids.shape[0] > _MEMO_BATCH:
            bodies = id_bodies(table, ids)
            where = _ZERO if one_node else node_of(table, ids, self.nodes)
            return bodies, where
        values = ids.tolist()
        got = [self._memo.get((table, value)) for value in values]
        if None in got:
            bodies = id_bodies(table, ids)
            where = np.zeros(len(values), np.intp) if one_node else node_of(table, ids, self.nodes)
            if len(self._memo) > _MEMO_IDS:
                self._memo.clear()
            for value, body, node in zip(values, bodies.bodies, where.tolist(), strict=True):
                self._memo[table, value] = (bytes(body), node)
            return bodies, where
        known = cast("list[tuple[bytes, int]]", got)
        encoded = [body for body, _ in known]
        where = np.array([node for _, node in known], dtype=np.intp)
        return IdBodies(
            ids=ids, table=table, bodies=encoded, longest=max(map(len, encoded), default=0)
        ), where

    def encode_ints(
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
            if len(self.nodes) > 1
            else None
        )
        return cast("NDArray[np.uint8]", encoded), where, starts

    def place_wide(self, items: Sequence[tuple[str, IdArray]]) -> Placed:
        """Several tables' int64 ids as one: one after another, encoded and placed
        together, each node's positions ascending (a wide read, `get_many`)."""
        encoded, where, starts = self.encode_ints(items)
        ids = cast("IdArray", np.concatenate([ids for _, ids in items]))
        if where is None:
            by_node = [np.arange(ids.shape[0], dtype=np.intp)]
        else:
            by_node = positions_by(where, len(self.nodes))
        return Placed(
            items[0][0],
            ids,
            IdBodies(ids=ids, table=items[0][0], bodies=encoded, longest=INT_ID_BYTES),
            by_node,
            tables=tuple(table for table, _ in items),
            starts=np.asarray(starts[:-1], dtype=np.intp),
        )

    def prefix(self, placed: Placed, kind: str) -> bytes:
        """The key prefix of `kind`, checked against the longest id of `placed`."""
        prefix = key_prefix(self.namespace, placed.table, kind)
        placed.bodies.check_prefix(prefix)
        return prefix
