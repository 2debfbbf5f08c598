"""Sentinels: the key on every node whose absence means the node lost its data, and
the storage format its value records: the format, and each table's stored layout (its
row dtype and its optimizer's slots) as of the namespace's init or restore.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lookup_table.config import ClusterConfig, TableSpec
from lookup_table.core.keyspace import STORAGE_FORMAT, sentinel_format, sentinel_key
from lookup_table.core.optimizers import make_optimizer
from lookup_table.errors import DataLossError, StorageFormatError
from lookup_table.memcached.node import Node

__all__ = ["Sentinels", "recorded_layouts", "stored_layout", "stored_layouts"]


def stored_layout(spec: TableSpec) -> dict[str, Any]:
    """What decides how table `spec`'s items are laid out besides its dim: the row dtype,
    the optimizer's name and its slots (name, dtype), as a sentinel records it."""
    slots = make_optimizer(spec.optimizer).slot_storage(spec.dim)
    return {
        "dtype": spec.dtype,
        "optimizer": spec.optimizer.name,
        "slots": [[s.name, s.dtype] for s in slots if s.width],
    }


def stored_layouts(config: ClusterConfig) -> dict[str, dict[str, Any]]:
    """`stored_layout` of every table of `config`, by name."""
    return {t.name: stored_layout(t) for t in config.tables}


def recorded_layouts(sentinel: bytes) -> dict[str, Any]:
    """The stored layouts a sentinel's value records, by table (none in a sentinel that
    `sentinel_format` cannot read)."""
    try:
        recorded = json.loads(sentinel).get("tables", {})
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _describe(layout: Mapping[str, Any]) -> str:
    slots = ", ".join(f"{name} {dtype}" for name, dtype in layout.get("slots", [])) or "none"
    return f"{layout.get('dtype')} rows, {layout.get('optimizer')} slots ({slots})"


class Sentinels:
    """The data-loss sentinel of a namespace on every node, and the storage format it records.

    What a batch reads in front of its commands (`memcached.batch.Sentinel`).
    """

    def __init__(
        self, namespace: str, layouts: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        self._namespace = namespace
        self.layouts = dict(layouts or {})  # the cluster file's, by table (`stored_layouts`)
        self.key = sentinel_key(namespace)
        self._formats_ok: set[bytes] = set()  # sentinel values whose storage format is ours
        self._verified: set[str] = set()  # nodes whose sentinel was checked before a batch
        # counts the nodes seen with a new sentinel: re-initialized (or restored) since
        # `store.layouts` checked them
        self.generation = 0
        self.recorded: dict[str, frozenset[str]] = {}  # the tables each node's sentinel records

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
                f"format {found}, and this version reads format {STORAGE_FORMAT} (int ids in "
                f"keys as 11 base64url digits, a row and its optimizer slots in one item; "
                f"docs/storage.md): nothing is read from "
                f"it or written to it. Migrate: save a checkpoint with the version that wrote it "
                f"(lookup-table-checkpoint save), then restore it with this one "
                f"(lookup-table-checkpoint restore --force)",
                node=address,
            )
        recorded = recorded_layouts(sentinel)
        for table, mine in self.layouts.items():
            stored = recorded.get(table)
            if stored is not None and stored != mine:
                raise self.mismatch(address, table, stored)

    def mismatch(
        self, address: str, table: str, stored: Mapping[str, Any], *, where: str = ""
    ) -> StorageFormatError:
        """The error of node `address` holding `table` in another layout (`stored`) than
        the cluster file's; `where` says what recorded it, if not the sentinel."""
        mine = self.layouts[table]
        if stored.get("optimizer") != mine["optimizer"]:
            how = (
                "another optimizer's slots mean something else and are not converted: "
                "set the table's optimizer back, or train it under a new table name"
            )
        else:
            how = (
                "convert it: save a checkpoint with the cluster file that wrote it "
                "(lookup-table-checkpoint save), then restore it with this one "
                "(lookup-table-checkpoint restore --force), which re-encodes the rows"
            )
        return StorageFormatError(
            f"memcached node {address} holds table {table!r} of namespace "
            f"{self._namespace!r} as {_describe(stored)}{where}, and this cluster file says "
            f"{_describe(mine)}: nothing is read from it or written to it; {how}",
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
            if address in self.recorded:  # a new sentinel: the node was initialized again
                self.generation += 1
            self.recorded[address] = frozenset(recorded_layouts(value))
        self._verified.add(address)
