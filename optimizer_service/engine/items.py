"""Items read and written in one request per node (a row and its slots are one item),
and the initial values of rows that have none yet."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.initializers import initial_rows_many
from lookup_table.core.keys import IdArray
from lookup_table.core.precision import round_to
from lookup_table.store import TableRead, TableWrite
from optimizer_service.engine.plan import TableUpdate
from optimizer_service.engine.replica import ReplicaState

# (table, ids, rows, slots, known): what a step starts from, filled in where not known
Unwritten = tuple[str, IdArray, NDArray[np.float32], NDArray[np.float32], NDArray[np.bool_]]


class Items:
    """Reads and writes of one replica's items."""

    def __init__(self, state: ReplicaState) -> None:
        self.state = state

    async def read(
        self, tables: Sequence[tuple[str, IdArray]], wanted: Sequence[NDArray[np.bool_]]
    ) -> list[Any]:
        """Per (table, ids), (items, found) of the ids `wanted`: (n, dim + slot width), a
        row then its slots (one request per node for all tables: a row and its slots are
        one item); None for a table with none wanted."""
        reads = [
            TableRead(table, ids if want.all() else ids[want], slots=True)
            for (table, ids), want in zip(tables, wanted, strict=True)
            if want.any()
        ]
        values = iter(await self.state.store.get_many(reads, unique=True) if reads else ())
        return [next(values) if want.any() else None for want in wanted]

    async def read_filled(
        self, tables: Sequence[tuple[str, IdArray]]
    ) -> list[tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.bool_]]]:
        """Per (table, ids), (rows, slots, found) of every id, the ids without a row at
        their initial values (`fill_unwritten`): what a replay starts from."""
        read = await self.read(tables, [np.ones(ids.shape[0], dtype=bool) for _, ids in tables])
        got = []
        for (table, _), (items, found) in zip(tables, read, strict=True):
            dim = self.state.config.table(table).dim
            got.append((items[:, :dim], items[:, dim:], found))
        self.fill_unwritten(
            [
                (table, ids, rows, slots, found)
                for (table, ids), (rows, slots, found) in zip(tables, got, strict=True)
            ]
        )
        return got

    def fill_unwritten(self, parts: Sequence[Unwritten]) -> None:
        """In place, for each (table, ids, rows, slots, known): a row not known (never
        created, or expired: TTL) takes its initial value and the optimizer's initial
        slots, exactly what a lookup would have created (a lost node is caught by the
        sentinel read: DataLossError, never re-initialized here). The push and the replay
        of its journal start from the same values so. The row cache's initial entries
        are known: they hold these values already. One batch of initial values for all
        the tables (`initial_rows_many`)."""
        todo = [
            (table, ids, rows, slots, np.flatnonzero(~known))
            for table, ids, rows, slots, known in parts
            if not known.all()
        ]
        initial = self.initial_rows([(t[0], t[1][t[4]]) for t in todo])
        for (table, _, rows, slots, at), values in zip(todo, initial, strict=True):
            rows[at] = values
            slots[at] = self.state.optimizers[table].initial_slots(at.size, values.shape[1])

    def initial_rows(self, parts: Sequence[tuple[str, IdArray]]) -> list[NDArray[np.float32]]:
        """The initial rows of each (table, ids): one batch per initializer and dim; as
        the table stores them (rounded to nearest: what a lookup creates)."""
        specs = [self.state.config.table(table) for table, _ in parts]
        rows = initial_rows_many(
            [(s.initializer, s.seed, ids, s.dim) for s, (_, ids) in zip(specs, parts, strict=True)]
        )
        return [
            r if s.dtype == "float32" else round_to(r, s.dtype)
            for s, r in zip(specs, rows, strict=True)
        ]

    async def write(self, updates: Iterable[TableUpdate]) -> None:
        """Write the rows and slots of every table in one request per node (a row and
        its slots are one item: one `ms`). Each update's ids are unique: a push's are
        summed per id when it is parsed, a journal's as they were, the row cache holds
        a key once."""
        writes = [TableWrite(u.table, u.ids, u.rows, slots=u.slots) for u in updates]
        if writes:
            await self.state.store.set_many(writes, unique=True)
