"""What a push asks back (read your writes) and `POST /v1/rows`: rows as this replica
knows them, from the row cache, memcached, or their initial values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import IdArray
from lookup_table.core.precision import RowDtype
from lookup_table.core.wire import encode_array, encode_ids, encode_rows
from lookup_table.store import TableRead
from optimizer_service.engine.items import Items
from optimizer_service.engine.plan import WritePlan
from optimizer_service.engine.replica import ReplicaState
from optimizer_service.push import Push

__all__ = ["Answer", "Answers", "group_dtype"]


def group_dtype(dtypes: Mapping[str, RowDtype], tables: Sequence[str]) -> RowDtype:
    """The dtype rows of `tables` travel in as one array: theirs when they share one, else
    float32 (which holds every dtype's values exactly)."""
    kinds = {dtypes.get(t, "float32") for t in tables}
    return kinds.pop() if len(kinds) == 1 else "float32"


@dataclass(frozen=True, slots=True)
class Answer:
    """What a push asks back (`Answers.answer`): `stamp` (epoch, the push's place in this
    replica's changes of its rows) while the row cache is in use; `updated`, when the
    push asked for rows, each table's unique ids and their rows after the push, sent
    grouped as the push came (`groups`); `dense`, when it asked for them and they exist,
    the dense parameters' version and values. `dtypes` (table -> its row dtype) is how
    each table's rows travel (`encode_rows`: a 16-bit table's in half the bytes)."""

    stamp: tuple[str, int] | None = None
    updated: Mapping[str, tuple[IdArray, NDArray[np.float32]]] | None = None
    groups: Sequence[Sequence[str]] = ()
    dense: tuple[int, Mapping[str, NDArray[np.float32]]] | None = None
    dtypes: Mapping[str, RowDtype] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The answer as the service sends it: `stamp`, `updated_groups` (one array per
        group of the push, in its order), `updated`, `dense_version` and `params`."""
        out: dict[str, Any] = {}
        if self.stamp is not None:
            out["stamp"] = list(self.stamp)
        if self.updated is not None:
            updated = dict(self.updated)
            grouped = []
            for group in self.groups:  # as the push came: one array each, in its order
                if all(name in updated for name in group):
                    parts = [updated.pop(name) for name in group]
                    block = np.concatenate([rows for _, rows in parts])
                    grouped.append(
                        {
                            "tables": list(group),
                            "counts": [int(ids.shape[0]) for ids, _ in parts],
                            "ids": encode_array(np.concatenate([ids for ids, _ in parts])),
                            **encode_rows(block, group_dtype(self.dtypes, group)),
                        }
                    )
            if grouped:
                out["updated_groups"] = grouped
            out["updated"] = {
                name: {
                    "ids": encode_ids(ids),
                    **encode_rows(rows, self.dtypes.get(name, "float32")),
                }
                for name, (ids, rows) in updated.items()
            }
        if self.dense is not None:
            version, params = self.dense
            out["dense_version"] = version
            out["params"] = {n: encode_array(v) for n, v in params.items()}
        return out


def _new_rows(plan: WritePlan | None) -> dict[str, tuple[IdArray, NDArray[np.float32]]]:
    """Per table `plan` updates, its unique ids and their new rows as a push's answer
    sends them (a 16-bit table's as rounded for storage)."""
    if plan is None:
        return {}
    return {u.table: (u.ids, u.rows) if u.answer is None else u.answer for u in plan.updates}


class Answers:
    """A push's answer and the rows read through this replica."""

    def __init__(self, state: ReplicaState, items: Items) -> None:
        self.state = state
        self.items = items

    async def answer(self, push: Push, plan: WritePlan | None) -> Answer:
        """What `push.answer` asks back once `apply` returned (read your writes).

        `updated`: per table of the push, its unique ids and their rows after the push;
        `params` and `dense_version`: the dense parameters (replica 0). Taken from `plan`,
        the push's own write plan, when this call applied it (`Applied.plan`); otherwise
        (a duplicate, a sync round's merged push) read back from the store, then at least
        as new as the push.
        """
        stamp = None
        if plan is not None and plan.seq is not None and self.state.sentinels is not None:
            # while the row cache is in use, this replica knows every change of its rows:
            # its `plan.seq`-th change since `epoch` is this push's
            stamp = (self.state.epoch, plan.seq)
        updated: dict[str, tuple[IdArray, NDArray[np.float32]]] | None = None
        if "rows" in push.answer:
            done = _new_rows(plan)
            updated = {}
            reads = []
            for t in push.tables:
                if t.table in done:
                    ids, rows = done[t.table]
                    if ids is t.ids or (ids.shape == t.ids.shape and np.array_equal(ids, t.ids)):
                        updated[t.table] = (t.ids, rows)
                        continue
                reads.append(t)
            if reads:
                got = await self.rows_now([(t.table, t.ids) for t in reads])
                for t, (rows, _) in zip(reads, got, strict=True):
                    updated[t.table] = (t.ids, rows)
        dense = None
        if "dense" in push.answer:
            params: Mapping[str, NDArray[np.float32]]
            if plan is not None and plan.dense is not None and plan.version is not None:
                version, params = plan.version, plan.dense[0]
            else:
                state = await self.state.dense.read()
                if state is None:
                    return Answer(stamp, updated, push.groups, dtypes=self._dtypes(updated))
                version, params = state.version, state.params
            dense = (version, params)
        return Answer(stamp, updated, push.groups, dense, self._dtypes(updated))

    def _dtypes(
        self, updated: Mapping[str, tuple[IdArray, NDArray[np.float32]]] | None
    ) -> dict[str, RowDtype]:
        """The row dtype of each table `updated` answers with."""
        config = self.state.config
        return {t: config.table(t).dtype for t in updated or ()}

    async def rows_after(
        self, reads: Sequence[tuple[str, IdArray]], plan: WritePlan | None
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """`rows_now`, but the rows `plan` changes (a push's, computed, perhaps not written
        yet) as it changes them: what a push's `read` answers (its own rows new)."""
        done = _new_rows(plan)
        if not done:
            return await self.rows_now(reads)
        theirs: list[tuple[NDArray[np.bool_], NDArray[np.intp]] | None] = []
        rest: list[tuple[str, IdArray]] = []
        for table, ids in reads:
            changed = done.get(table)
            if changed is None or not changed[0].shape[0] or not ids.shape[0]:
                theirs.append(None)
                rest.append((table, ids))
                continue
            at = np.minimum(np.searchsorted(changed[0], ids), changed[0].shape[0] - 1)
            hit = changed[0][at] == ids
            some = bool(hit.any())
            theirs.append((hit, at) if some else None)
            rest.append((table, ids[~hit]) if some else (table, ids))
        got = await self.rows_now(rest)
        out: list[tuple[NDArray[np.float32], NDArray[np.bool_]]] = []
        for (table, ids), mine, (rows, found) in zip(reads, theirs, got, strict=True):
            if mine is None:
                out.append((rows, found))
                continue
            hit, at = mine
            every = np.empty((ids.shape[0], rows.shape[1]), dtype=np.float32)
            every[~hit] = rows
            every[hit] = done[table][1][at[hit]]
            exists = np.ones(ids.shape[0], dtype=bool)  # the push writes them
            exists[~hit] = found
            out.append((every, exists))
        return out

    async def rows_now(
        self, reads: Sequence[tuple[str, IdArray]]
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """(rows, found) of each (table, unique ids): the row cache's (written behind,
        memcached may not hold them yet), memcached's for the rest (one request per node),
        initial values where neither has a row (not created, not admitted, or expired).

        The cache is asked first: a row it lacks is one memcached holds at its newest
        (this replica is its only writer, and never drops a row it has not written), so a
        read that follows returns that value or a newer one. Ids of tables read through
        their owner (`ClusterConfig.reads_through_owner`: this replica is the only one to
        create their rows) that memcached has no row for are remembered as initial
        entries (`lookup_table.core.rowcache`): the push that creates them, and the reads
        before it, do not ask memcached again. Elsewhere trainers create rows with `add`
        (and count sightings first with `admit_after`), so "no row" would not stay true."""
        use = [self.state.sentinels is not None and self.state.cache.caches(t) for t, _ in reads]
        cached = iter(
            self.state.cache.lookup_many(
                [r for r, u in zip(reads, use, strict=True) if u], rows_only=True
            )
        )
        out: list[tuple[NDArray[np.float32], NDArray[np.bool_]]] = []
        misses: list[tuple[int, NDArray[np.bool_]]] = []
        for k, ((table, ids), cache_it) in enumerate(zip(reads, use, strict=True)):
            n = ids.shape[0]
            if cache_it:
                hit, rows, _, initial = next(cached)
                found = hit & ~initial  # an initial entry holds its initial value already
            else:
                rows = np.empty((n, self.state.config.table(table).dim), dtype=np.float32)
                hit = found = np.zeros(n, dtype=bool)
            out.append((rows, found))
            if not hit.all():
                misses.append((k, ~hit))
        if not misses:
            return out
        got = await self.state.store.get_many(
            [TableRead(reads[k][0], reads[k][1][miss]) for k, miss in misses], unique=True
        )
        fresh: list[tuple[int, NDArray[np.intp]]] = []  # no row anywhere: initial values
        for (k, miss), (rows_m, found_m) in zip(misses, got, strict=True):
            rows, found = out[k]
            at = np.flatnonzero(miss)
            rows[at], found[at] = rows_m, found_m
            if not found_m.all():
                fresh.append((k, at[~found_m]))
        starting = self.items.initial_rows([(reads[k][0], reads[k][1][new]) for k, new in fresh])
        remember: list[tuple[str, IdArray, NDArray[np.float32], NDArray[np.float32]]] = []
        for (k, new), values in zip(fresh, starting, strict=True):
            table, ids = reads[k]
            out[k][0][new] = values
            if use[k] and self.state.config.reads_through_owner(table):
                slots = self.state.optimizers[table].initial_slots(new.size, values.shape[1])
                remember.append((table, ids[new], values, slots))
        if remember:  # only where the cache holds nothing newer since the read
            self.state.cache.put_many(remember, initial=True)
        return out
