"""Item layouts: what a row's item holds (the row, then its optimizer's slots), the
values of new rows and writes, the TTL a read or write gives, and admission counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.expiry import exptime
from lookup_table.core.keys import IdArray, key_prefix
from lookup_table.core.keyspace import Kind
from lookup_table.core.optimizers import Optimizer, make_optimizer
from lookup_table.core.optimizers.layout import decode_items, encode_items, value_bytes
from lookup_table.core.precision import RowDtype, decode, itemsize, round_to, storage_dtype
from lookup_table.core.rows import ROW_DTYPE, encode_rows, row_bytes
from lookup_table.store.placement import (
    Part,
    Placement,
    TableRead,
    TableWrite,
    group_key,
)

__all__ = ["Items", "TableCodec", "TableLookup"]


class TableCodec:
    """One table's items as stored (`core.optimizers.layout`): the row in the table's
    dtype, then each slot in its own; float32 items (a row, then its slots) in memory.

    A table whose row and slots are all float32 (`plain`) is stored as the float32 items
    are, bit for bit: its reads and writes take no conversion at all.
    """

    def __init__(self, dim: int, dtype: RowDtype, optimizer: Optimizer) -> None:
        self.dim = dim
        self.dtype = dtype
        self.optimizer = optimizer
        self.slot_width = optimizer.slot_width(dim)
        slots = optimizer.slot_storage(dim)
        self.plain = dtype == "float32" and all(s.dtype == "float32" for s in slots)
        self.row_bytes = dim * itemsize(dtype)
        self.item_bytes = value_bytes(optimizer, dim, dtype)
        # what tells two tables' reads apart when one part reads both (`wide_layouts`)
        self.signature = (dim, dtype, tuple((s.name, s.width, s.dtype) for s in slots))

    def encode(self, items: NDArray[np.float32]) -> NDArray[np.uint8]:
        """float32 items (n, dim + slot_width) as stored, uint8 (n, item_bytes); the rows
        rounded to nearest (the service has rounded what it steps: then exactly).

        Raises:
            RowOverflowError: a value beyond the table's dtype (nothing is encoded).
        """
        if self.plain:
            return np.ascontiguousarray(items, dtype=ROW_DTYPE).view(np.uint8)
        values = np.ascontiguousarray(items, dtype=np.float32)
        return encode_items(values, self.optimizer, self.dim, self.dtype)

    def round(self, rows: NDArray[np.float32]) -> NDArray[np.float32]:
        """`rows` (n, dim) as the table stores them (to nearest), float32."""
        return rows if self.dtype == "float32" else round_to(rows, self.dtype)

    def items_decoder(self) -> Callable[[NDArray[np.uint8]], NDArray[np.float32]] | None:
        """What turns the bytes of whole items read into float32 items (None: as they are)."""
        if self.plain:
            return None
        return lambda raw: decode_items(raw, self.optimizer, self.dim, self.dtype)

    def rows_decoder(self) -> Callable[[NDArray[np.uint8]], NDArray[np.float32]] | None:
        """What turns the leading row bytes of items read into float32 rows (None: as they are)."""
        if self.dtype == "float32":
            return None
        words = storage_dtype(self.dtype)
        return lambda raw: decode(raw.view(words), self.dtype)


@dataclass(slots=True, eq=False)
class TableLookup:
    """One table of `lookup_many`: its unique ids (placed), and the rows read for them."""

    table: str
    inverse: NDArray[np.intp]  # uniq[inverse] == the ids asked for
    rows: Part  # the read of the unique ids' rows
    values: NDArray[np.float32]  # (len(uniq), dim)
    found: NDArray[np.bool_]  # (len(uniq),)

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    def part(self, only: NDArray[np.bool_], **what: Any) -> Part:
        """A batch part of this table's rows over its ids where `only` is true."""
        placed = self.rows.placed
        return Part(placed, self.rows.prefix, placed.only(only), exptime=self.rows.exptime, **what)

    def add(self, only: NDArray[np.bool_], items: NDArray[np.uint8]) -> Part:
        """A write of `items`, the stored values of the ids where `only` is true (in id
        order): the new rows' items only, not a whole batch's."""
        rank = (np.cumsum(only) - 1).astype(np.intp)
        return self.part(only, values=items, rank=rank)

    def reread(self, only: NDArray[np.bool_]) -> Part:
        """A read of this table's rows (without slots) over its ids where `only` is true."""
        return self.part(
            only, nbytes=self.rows.nbytes, take=self.rows.take, decode=self.rows.decode
        )


class Items:
    """The item layout of every table and the parts that read, write and count items.

    `refresh_ttl`: reads of rows of a table with `ttl_s` reset their TTL.
    """

    def __init__(self, config: ClusterConfig, placement: Placement, *, refresh_ttl: bool) -> None:
        self.config = config
        self.namespace = config.namespace
        self._placement = placement
        self.refresh_ttl = refresh_ttl
        self._ttls = {t.name: t.ttl_s for t in config.tables if t.ttl_s is not None}
        self._optimizers = {t.name: make_optimizer(t.optimizer) for t in config.tables}
        self.codecs = {
            t.name: TableCodec(t.dim, t.dtype, self._optimizers[t.name]) for t in config.tables
        }
        # each table's dim and bytes of a stored row (the row, then its optimizer's slots)
        self._layouts = {name: (c.dim, c.item_bytes) for name, c in self.codecs.items()}

    def wide_layouts(
        self,
        reads: Sequence[TableRead],
        keys: Sequence[tuple[str, int]],
        todo: Mapping[tuple[str, int], tuple[str, IdArray, NDArray[np.intp] | None]],
        uses: Mapping[tuple[str, int], int],
    ) -> dict[tuple[Any, ...], list[int]]:
        """The reads `get_many` sends as wide parts, by layout (key prefix length, value
        size, bytes kept, TTL, how the values are stored): reads of rows of int64 ids,
        each its own ids, two or more of one layout."""
        layouts: dict[tuple[Any, ...], list[int]] = {}
        for r, (key, read) in enumerate(zip(keys, reads, strict=True)):
            if read.kind != Kind.ROW or uses[key] != 1 or todo[key][1].dtype != np.int64:
                continue
            nbytes, take = self.read_bytes(read)
            layout = (
                len(key_prefix(self.namespace, read.table, Kind.ROW)),
                nbytes,
                take,
                self.exptime(read.table, write=False),
                self.codec(read.table).signature,
            )
            layouts.setdefault(layout, []).append(r)
        return {layout: members for layout, members in layouts.items() if len(members) > 1}

    def wide_part(
        self,
        items: Sequence[tuple[str, IdArray, NDArray[np.intp] | None]],
        *,
        nbytes: int,
        take: int,
        exptime: int,
    ) -> Part:
        """One read of the rows of several int64 tables of one layout (`wide_layouts`):
        their ids one table after another, each key with its table's prefix."""
        decode = self.read_decoder(items[0][0], slots=take == 0)
        placed = self._placement.place_wide([(table, ids) for table, ids, _ in items])
        prefixes = np.stack(
            [
                np.frombuffer(key_prefix(self.namespace, table, Kind.ROW), dtype=np.uint8)
                for table, _, _ in items
            ]
        )
        return Part(
            placed,
            np.repeat(prefixes, [ids.shape[0] for _, ids, _ in items], axis=0),
            placed.by_node,
            nbytes=nbytes,
            take=take,
            exptime=exptime,
            decode=decode,
        )

    def write_parts(self, writes: Sequence[TableWrite], *, unique: bool) -> list[Part]:
        """Check every write and place each table's ids once; nothing is sent yet."""
        seen: set[tuple[str, str]] = set()
        rows_of = {group_key(w.table, w.ids) for w in writes if w.kind == Kind.ROW}
        todo: dict[tuple[str, int], tuple[str, IdArray]] = {}
        for w in writes:
            if (w.table, w.kind) in seen:
                raise ValueError(
                    f"two writes of table {w.table!r} kind {str(w.kind)!r} in one batch; "
                    f"concatenate their ids and values"
                )
            seen.add((w.table, w.kind))
            key = group_key(w.table, w.ids)
            if key not in todo:
                id_array = self._placement.ids_of(w.table, w.ids, rows=key in rows_of)
                if not unique:
                    self._placement.requireunique(w.table, id_array)
                todo[key] = (w.table, id_array)
        placed_of = dict(zip(todo, self._placement.place_many(list(todo.values())), strict=True))
        parts: list[Part] = []
        for w in writes:
            placed = placed_of[group_key(w.table, w.ids)]
            n = placed.ids.shape[0]
            arr = np.asarray(w.values)
            if arr.ndim != 2 or arr.shape[0] != n:
                raise ValueError(
                    f"values for table {w.table!r} must be (n, width) with n={n} "
                    f"ids; got shape {arr.shape}"
                )
            if w.kind == Kind.ROW:
                matrix = self.encode(w.table, arr, w.slots)
            elif w.slots is not None:
                raise ValueError(f"slots are stored with rows, not with kind {str(w.kind)!r}")
            else:
                matrix = encode_rows(arr, arr.shape[1])
            parts.append(
                Part(
                    placed,
                    self._placement.prefix(placed, w.kind),
                    placed.by_node,
                    values=matrix,
                    exptime=self.exptime(w.table, write=True, kind=w.kind),
                )
            )
        return parts

    def exptime(self, table: str, *, write: bool, kind: str = Kind.ROW) -> int:
        """The T flag of a read or write of (table, kind): the table's TTL for its rows
        (reads only with `refresh_ttl`), 0 (no T: no change) otherwise."""
        ttl_s = self._ttls.get(table)
        if ttl_s is None or kind != Kind.ROW or not (write or self.refresh_ttl):
            return 0
        return exptime(ttl_s, time.time())

    # ------------------------------------------------------------ internals: row items

    def codec(self, table: str) -> TableCodec:
        """How `table`'s items are stored; ConfigError if there is no such table."""
        codec = self.codecs.get(table)
        return codec if codec is not None else self.codecs[self.config.table(table).name]

    def read_decoder(
        self, table: str, *, slots: bool
    ) -> Callable[[NDArray[np.uint8]], NDArray[np.float32]] | None:
        """The `Part.decode` of a read of `table`'s rows, with their slots or without."""
        codec = self.codec(table)
        return codec.items_decoder() if slots else codec.rows_decoder()

    def layout(self, table: str) -> tuple[int, int]:
        """(dim, bytes of one stored row) of `table`; ConfigError if there is no such table."""
        layout = self._layouts.get(table)
        # config.table raises ConfigError for a table it does not have, naming those it has
        return layout if layout is not None else self._layouts[self.config.table(table).name]

    def item_bytes(self, table: str) -> int:
        """Bytes of one stored row of `table`: its dim, then its optimizer's slots."""
        return self.layout(table)[1]

    def read_bytes(self, read: TableRead) -> tuple[int, int]:
        """(value bytes, bytes kept of each) of a fixed-width read."""
        if read.kind != Kind.ROW:
            if read.slots:
                raise ValueError(f"slots are read with rows, not with kind {str(read.kind)!r}")
            if read.width is None:
                raise ValueError(f"a read of kind {str(read.kind)!r} needs its width")
            return row_bytes(read.width), 0
        dim, nbytes = self.layout(read.table)
        if read.width is not None and read.width != dim:
            raise ValueError(
                f"table {read.table!r} has dim={dim}; a read of its rows cannot have "
                f"width={read.width} (slots=True reads each row with its slots)"
            )
        return nbytes, 0 if read.slots else self.codec(read.table).row_bytes

    def encode(
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
        codec = self.codec(table)
        if slots is None:
            if not width:
                return codec.encode(rows)
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
        return codec.encode(both)

    def counter_part(self, t: TableLookup, missing: NDArray[np.bool_]) -> Part:
        """The admission counters of the ids of `t` where `missing` is true."""
        placed = t.rows.placed
        spec = self.config.table(t.table)
        return Part(
            placed,
            self._placement.prefix(placed, Kind.COUNTER),
            placed.only(missing),
            exptime=exptime(spec.counter_ttl_s, time.time()),
        )

    def describer(self, parts: Sequence[Part]) -> Callable[[int, int], tuple[str, str]]:
        """For a read's CorruptValueError: the table of an id of a part, and what its
        values should hold."""

        def describe(p: int, position: int) -> tuple[str, str]:
            table = parts[p].placed.table_at(position)
            return table, self.layout_text(parts[p], table)

        return describe

    def layout_text(self, part: Part, table: str) -> str:
        """What a value of `table` in a fixed-width read should hold, for a
        CorruptValueError."""
        wide = isinstance(part.prefix, np.ndarray)  # a wide part reads rows only
        if not wide and part.prefix != key_prefix(self.namespace, table, Kind.ROW):
            return f"{part.nbytes} ({part.nbytes // 4} float32)"
        spec = self.config.table(table)
        width = self._optimizers[table].slot_width(spec.dim)
        return (
            f"{part.nbytes} (its dim {spec.dim} and {width} slot floats of its "
            f"{spec.optimizer.name!r} optimizer, rows as {spec.dtype})"
        )
