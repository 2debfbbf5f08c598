"""Table layouts: each node's record of the stored layout of a table that its sentinel
does not record (one added to the cluster file after the namespace was initialized).

The first process that uses such a table `add`s its layout on every node (the first
writer wins); every process checks it before it first writes the table or uses values it
read, so that rows are never read or written in another dtype or optimizer's layout than
they were stored in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

from lookup_table.core.keyspace import layout_key
from lookup_table.errors import NodeUnavailableError, StorageFormatError
from lookup_table.memcached import batch
from lookup_table.memcached.node import Node
from lookup_table.store.gathering import gather
from lookup_table.store.placement import Part
from lookup_table.store.sentinels import Sentinels, recorded_layouts

__all__ = ["TableLayouts", "layout_value"]

logger = logging.getLogger(__name__)

_WHERE = " (recorded when the table was first used)"


def layout_value(namespace: str, table: str, layout: Any) -> bytes:
    """The value of a table's layout record: its `sentinels.stored_layout`, and whose."""
    return json.dumps(
        {"namespace": namespace, "table": table, "layout": layout, "created": time.time()}
    ).encode()


class TableLayouts:
    """The layouts of the cluster file's tables checked against what the nodes record.

    A table that a node's sentinel records is checked there (`Sentinels.check_format`);
    any other is checked against its layout record on the node, which is added where it
    is missing. Once per table and process, and again after a node's sentinel changed.
    """

    def __init__(self, namespace: str, nodes: Sequence[Node], sentinels: Sentinels) -> None:
        self._namespace = namespace
        self._nodes = nodes
        self._sentinels = sentinels
        self._checked: set[str] = set()  # tables checked as of `_generation`
        self._generation = -1  # the sentinels' generation they were checked in
        self._lock = asyncio.Lock()

    def pending(self, parts: Sequence[Part]) -> set[str]:
        """The cluster file's tables of `parts` still to check: none once they were, and
        none that the sentinel of every node (as read so far) records."""
        if self._generation != self._sentinels.generation:
            self._checked.clear()
            self._generation = self._sentinels.generation
        checked, mine = self._checked, self._sentinels.layouts
        if all(
            t in checked or t not in mine for p in parts for t in (p.placed.table, *p.placed.tables)
        ):
            return set()
        tables = {t for p in parts for t in (p.placed.table, *p.placed.tables) if t in mine}
        tables -= checked
        recorded = self._sentinels.recorded
        settled = {t for t in tables if all(t in recorded.get(n.address, ()) for n in self._nodes)}
        checked |= settled
        return tables - settled

    async def ensure(self, parts: Sequence[Part]) -> None:
        """`check` the tables of `parts` unless they were (the fast path of every batch)."""
        tables = self.pending(parts)
        if tables:
            await self.check(tables)

    async def check(self, tables: Collection[str]) -> dict[str, list[str]]:
        """Check the stored layouts of `tables` on every node that has its sentinel, and
        record them on the nodes that have no record of them. One round trip per node;
        the records added cost one more, on the first node first.

        Returns, per node, the tables whose layout this call recorded there.

        Raises:
            StorageFormatError: a node records another layout of one of `tables` (or
                another storage format) than the cluster file's; nothing was recorded
                on the nodes after it.
        """
        async with self._lock:
            if self._generation != self._sentinels.generation:
                self._checked.clear()
                self._generation = self._sentinels.generation
            todo = sorted(set(tables) - self._checked)
            if not todo:
                return {}
            generation = self._sentinels.generation
            keys = [layout_key(self._namespace, t) for t in todo]
            found = await gather(
                [
                    batch.mg_blobs(n, [self._sentinels.key, *keys], sentinel=None)
                    for n in self._nodes
                ]
            )
            missing: list[tuple[Node, list[str]]] = []
            for node, (sentinel, *records) in zip(self._nodes, found, strict=True):
                if sentinel is None:
                    continue  # lost its data: its batches say so; a new sentinel rechecks
                self._sentinels.accept(node.address, sentinel)  # the tables it records
                recorded = recorded_layouts(sentinel)
                absent = []
                for table, record in zip(todo, records, strict=True):
                    if table in recorded:
                        continue
                    if record is None:
                        absent.append(table)
                    else:
                        self._compare(node.address, table, record)
                if absent:
                    missing.append((node, absent))
            added: dict[str, list[str]] = {}
            if missing:
                # the first node first: a process records a layout on the others only
                # once it agrees with the first's, so two that disagree never both pass
                first, *rest = missing
                added.update(await self._record(*first))
                for got in await gather([self._record(node, ts) for node, ts in rest]):
                    added.update(got)
            if self._generation == generation:  # else a node's sentinel changed meanwhile
                self._checked.update(todo)
            return added

    async def _read(self, node: Node, keys: list[bytes]) -> list[bytes | None]:
        """`node`'s sentinel and the records of `keys`; all None if the node is down (the
        other nodes' records decide: a process records a layout only where it agrees)."""
        try:
            return await batch.mg_blobs(node, [self._sentinels.key, *keys], sentinel=None)
        except NodeUnavailableError as exc:
            logger.debug("layouts not checked on node %s: %s", node.address, exc)
            return [None] * (len(keys) + 1)

    async def _record(self, node: Node, tables: list[str]) -> dict[str, list[str]]:
        """`add` the layout records of `tables` on `node`; check those another process
        added first. Returns {node: tables recorded}."""
        mine = self._sentinels.layouts
        keys = [layout_key(self._namespace, t) for t in tables]
        values = [layout_value(self._namespace, t, mine[t]) for t in tables]
        (stored,), _ = await batch.ms(node, [(keys, values)], add=True, sentinel=self._sentinels)
        lost = [k for k, ok in enumerate(stored.tolist()) if not ok]
        if lost:
            again = await batch.mg_blobs(node, [keys[k] for k in lost], sentinel=None)
            for k, record in zip(lost, again, strict=True):
                if record is not None:
                    self._compare(node.address, tables[k], record)
        done = [t for t, ok in zip(tables, stored.tolist(), strict=True) if ok]
        return {node.address: done} if done else {}

    def _compare(self, address: str, table: str, record: bytes) -> None:
        try:
            stored = json.loads(record)["layout"]
            if not isinstance(stored, dict):
                raise TypeError(type(stored).__name__)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise StorageFormatError(
                f"memcached node {address} holds a layout record of table {table!r} of "
                f"namespace {self._namespace!r} that this version cannot read "
                f"({record[:80]!r}); was it written by another program? Nothing is read "
                f"from the table or written to it",
                node=address,
            ) from exc
        if stored != self._sentinels.layouts[table]:
            raise self._sentinels.mismatch(address, table, stored, where=_WHERE)
