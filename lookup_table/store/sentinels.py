"""Sentinels: the key on every node whose absence means the node lost its data, and
the storage format its value records.
"""

from __future__ import annotations

from lookup_table.core.keyspace import STORAGE_FORMAT, sentinel_format, sentinel_key
from lookup_table.errors import DataLossError, StorageFormatError
from lookup_table.memcached.node import Node

__all__ = ["Sentinels"]


class Sentinels:
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
                f"format {found}, and this version reads format {STORAGE_FORMAT} (int ids in "
                f"keys as 11 base64url digits, a row and its optimizer slots in one item; "
                f"docs/storage.md): nothing is read from "
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
