"""`EmbeddingStore`: the async shell over the memcached fleet.

A batch costs one pipelined round trip per node (per `store.max_batch_keys` ids),
all nodes in parallel::

    store = EmbeddingStore(load_config("cluster.toml"))
    async with store:
        rows = await store.lookup("user", ids)          # float32 (len(ids), dim)

`lookup` deduplicates ids, reads every row of the batch, and creates the
missing ones with `add` (set-if-absent) from the table's deterministic
initializer, so concurrent trainers never overwrite each other: a trainer that
loses the `add` race re-reads the winner's row. `lookup(..., create=False)`
never writes: missing rows come back as their would-be initial value.

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
`CorruptValueError`; timeouts and refused connections `NodeUnavailableError`.

Connections: `lookup_table.memcached` is the one transport. Each node has a small
pool of `store.pool_size` connections (`memcached.node.Node`); a connection that
saw a timeout, a cancellation or any error mid-reply is closed, never reused, so a
stale reply can never be read as someone else's miss (the hazard of
aiomcache#489). `stats` runs on a connection of its own (`memcached.commands`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.initializers import initial_rows
from lookup_table.core.keys import IdArray, as_ids, encode_keys, int_key_matrix, key_prefix
from lookup_table.core.keyspace import Kind, sentinel_key
from lookup_table.core.rows import ROW_DTYPE, encode_rows, row_bytes
from lookup_table.core.sharding import node_of
from lookup_table.errors import (
    ClusterNotInitializedError,
    CorruptValueError,
    DataLossError,
    KeyEncodingError,
    LookupTableError,
    ProtocolError,
    StoreError,
    StoreFullError,
)
from lookup_table.memcached import commands, protocol
from lookup_table.memcached.node import Node
from lookup_table.memcached.protocol import Keys

__all__ = ["EmbeddingStore"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _keys_for(namespace: str, table: str, kind: str, ids: IdArray) -> Keys:
    """Fixed-width int keys as one uint8 matrix; str keys as a list of bytes."""
    if ids.dtype == np.int64:
        return int_key_matrix(key_prefix(namespace, table, kind), cast("NDArray[np.int64]", ids))
    return encode_keys(namespace, table, kind, ids)


def _num_keys(keys: Keys) -> int:
    return keys.shape[0] if isinstance(keys, np.ndarray) else len(keys)


def _key_text(keys: Keys, i: int) -> str:
    key = keys[i].tobytes() if isinstance(keys, np.ndarray) else keys[i]
    return key.decode("ascii", "replace")


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


class EmbeddingStore:
    """Batched, async access to the rows and slots of every table in memcached.

    Args:
        config: the cluster file (`load_config`); nodes, namespace, tables, timeouts.
        check_sentinels: read each node's sentinel with every batch (default).
            Only `lookup-table-admin` turns this off, to inspect a broken cluster.

    Use as `async with EmbeddingStore(cfg) as store:` or call `close()`.
    Methods are safe to call concurrently from many tasks of one event loop.
    """

    def __init__(self, config: ClusterConfig, *, check_sentinels: bool = True) -> None:
        self.config = config
        self.namespace = config.namespace
        self.nodes: tuple[str, ...] = config.node_addresses
        self._nodes = [Node(spec, config.store) for spec in config.memcached]
        self._check_sentinels = check_sentinels
        self._sentinel_key = sentinel_key(config.namespace)
        self.created: dict[str, int] = {}  # rows this store created, per table

    async def __aenter__(self) -> EmbeddingStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection. The store cannot be used afterwards."""
        for node in self._nodes:
            await node.close()

    # ------------------------------------------------------------ public API

    async def lookup(self, table: str, ids: Any, *, create: bool = True) -> NDArray[np.float32]:
        """The rows of `ids` in order, float32 (len(ids), dim).

        Duplicates are allowed (each unique id is fetched once). Missing rows are
        created with `add` from the table's initializer when `create` is true; a
        row another writer created first is re-read. With `create=False` nothing
        is written and missing rows come back as their would-be initial value.

        Raises:
            ConfigError: unknown table.
            KeyEncodingError: an id that cannot be a key, or of the wrong type.
            DataLossError: a node of the batch lost its data; nothing was created.
            StoreFullError, CorruptValueError, NodeUnavailableError: see errors.py.
        """
        spec = self.config.table(table)
        id_array = self._table_ids(table, ids)
        if id_array.shape[0] == 0:
            return np.zeros((0, spec.dim), dtype=np.float32)
        uniq_any, inverse = np.unique(id_array, return_inverse=True)
        uniq = cast(IdArray, uniq_any)
        values, found = await self.get(table, uniq, width=spec.dim, unique=True)
        missing = np.flatnonzero(~found)
        if missing.size:
            fresh = initial_rows(spec.initializer, seed=spec.seed, ids=uniq[missing], dim=spec.dim)
            if create:
                stored = await self.add(table, uniq[missing], fresh, unique=True)
                self.created[table] = self.created.get(table, 0) + int(stored.sum())
                values[missing[stored]] = fresh[stored]
                raced = missing[~stored]
                if raced.size:
                    again, ok = await self.get(table, uniq[raced], width=spec.dim, unique=True)
                    if not ok.all():
                        bad = uniq[raced][~ok][0]
                        raise StoreError(
                            f"row {bad!r} of table {table!r} was created by another writer but "
                            f"is gone again (deleted or flushed between two round trips)"
                        )
                    values[raced] = again
            else:
                values[missing] = fresh
        return values[inverse.reshape(-1)]

    async def get(
        self,
        table: str,
        ids: Any,
        *,
        kind: str = Kind.ROW,
        width: int | None = None,
        unique: bool = False,
    ) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
        """Read fixed-width float32 values (rows, slots) of `ids`.

        Args:
            kind: "w" rows (width defaults to the table's dim), "s" slots, ...
            width: floats per value; a stored value of another length raises
                CorruptValueError.
            unique: the caller guarantees ids are unique (skips a dedupe).

        Returns:
            (values float32 (n, width), found bool (n,)); missing values are zeros.
        """
        if width is None:
            width = self.config.table(table).dim
        id_array = self._table_ids(table, ids) if kind == Kind.ROW else as_ids(ids, table=table)
        if not unique:
            uniq, inverse = np.unique(id_array, return_inverse=True)
            if uniq.shape[0] != id_array.shape[0]:
                values, found = await self.get(table, uniq, kind=kind, width=width, unique=True)
                return values[inverse.reshape(-1)], found[inverse.reshape(-1)]
        nbytes = row_bytes(width)
        out = np.zeros((id_array.shape[0], width), dtype=np.float32)
        found = np.zeros(id_array.shape[0], dtype=bool)

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            raw, hit = await self._mg_fixed(node, keys, nbytes)
            out[index] = raw.view(ROW_DTYPE)
            found[index] = hit

        await self._fan_out(table, kind, id_array, one, check_sentinel=True)
        return out, found

    async def set(
        self, table: str, ids: Any, values: NDArray[np.float32], *, kind: str = Kind.ROW
    ) -> None:
        """Write fixed-width float32 values (n, width) of unique `ids` (overwrite).

        Raises:
            ValueError: duplicate ids or a shape mismatch.
            StoreFullError: a node is out of memory (some values may be written).
        """
        id_array, matrix = self._prepare_write(table, ids, values, kind)

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            await self._ms(node, keys, matrix[index], add=False)

        await self._fan_out(table, kind, id_array, one, check_sentinel=True)

    async def add(
        self,
        table: str,
        ids: Any,
        values: NDArray[np.float32],
        *,
        kind: str = Kind.ROW,
        unique: bool = False,
    ) -> NDArray[np.bool_]:
        """Set-if-absent for unique `ids`; returns which values were stored, bool (n,).

        `unique=True`: the caller guarantees the ids are unique (skips the check).
        """
        id_array, matrix = self._prepare_write(table, ids, values, kind, unique=unique)
        stored = np.zeros(id_array.shape[0], dtype=bool)

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            stored[index] = await self._ms(node, keys, matrix[index], add=True)

        await self._fan_out(table, kind, id_array, one, check_sentinel=True)
        return stored

    async def get_blobs(self, table: str, ids: Any, *, kind: str) -> list[bytes | None]:
        """Read variable-length values (dense chunks, bookkeeping) of unique `ids`."""
        id_array = as_ids(ids, table=table)
        out: list[bytes | None] = [None] * id_array.shape[0]

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            values = await self._mg_blobs(node, keys)
            for i, value in zip(index.tolist(), values, strict=True):
                out[i] = value

        await self._fan_out(table, kind, id_array, one, check_sentinel=True)
        return out

    async def set_blobs(
        self,
        table: str,
        ids: Any,
        values: Sequence[bytes],
        *,
        kind: str,
        add: bool = False,
        ttl_s: int = 0,
    ) -> NDArray[np.bool_]:
        """Write variable-length values of unique `ids`; returns which were stored.

        `add` stores only absent keys; `ttl_s` > 0 lets the values expire.
        """
        id_array = as_ids(ids, table=table)
        if len(values) != id_array.shape[0]:
            raise ValueError(f"{id_array.shape[0]} ids but {len(values)} values")
        self._require_unique(table, id_array)
        stored = np.zeros(id_array.shape[0], dtype=bool)

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            stored[index] = await self._ms(
                node, keys, [values[i] for i in index.tolist()], add=add, ttl_s=ttl_s
            )

        await self._fan_out(table, kind, id_array, one, check_sentinel=True)
        if not add and not stored.all():
            raise StoreError(f"memcached did not store {int((~stored).sum())} values of {table!r}")
        return stored

    async def delete_blobs(self, table: str, ids: Any, *, kind: str) -> NDArray[np.bool_]:
        """Delete the values of unique `ids`; returns which existed."""
        id_array = as_ids(ids, table=table)
        existed = np.zeros(id_array.shape[0], dtype=bool)

        async def one(node: Node, index: NDArray[np.intp], keys: Keys) -> None:
            existed[index] = await self._md(node, keys)

        await self._fan_out(table, kind, id_array, one, check_sentinel=True)
        return existed

    # ------------------------------------------------------------ sentinels

    async def sentinels(self) -> dict[str, bytes | None]:
        """Each node's sentinel value (None where it is missing), one round trip per node."""
        key = [self._sentinel_key]

        async def read(node: Node) -> bytes | None:
            return (await self._mg_blobs(node, key, check=False))[0]

        values = await _gather([read(node) for node in self._nodes])
        return dict(zip(self.nodes, values, strict=True))

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
                    "namespace": self.namespace,
                    "node": node.address,
                    "cluster_id": cluster_id,
                    "created": time.time(),
                }
            ).encode()
            stored = await self._ms(node, [self._sentinel_key], [value], add=True, check=False)
            return bool(stored[0])

        targets = [n for n in self._nodes if n.address in wanted]
        results = await _gather([write(node) for node in targets])
        return {n.address: ok for n, ok in zip(targets, results, strict=True)}

    async def stats(self) -> dict[str, dict[str, str]]:
        """memcached `stats` of every node (values as text), each on its own connection."""
        values = await _gather(
            [commands.stats(spec, self.config.store) for spec in self.config.memcached]
        )
        return dict(zip(self.nodes, values, strict=True))

    # ------------------------------------------------------------ internals

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

    def _require_unique(self, table: str, ids: IdArray) -> None:
        ordered = np.sort(ids)
        if ordered.shape[0] > 1 and (ordered[1:] == ordered[:-1]).any():
            raise ValueError(f"a write to table {table!r} has duplicate ids; sum or dedupe first")

    def _prepare_write(
        self,
        table: str,
        ids: Any,
        values: NDArray[np.float32],
        kind: str,
        *,
        unique: bool = False,
    ) -> tuple[IdArray, NDArray[np.uint8]]:
        id_array = self._table_ids(table, ids) if kind == Kind.ROW else as_ids(ids, table=table)
        arr = np.asarray(values)
        if arr.ndim != 2 or arr.shape[0] != id_array.shape[0]:
            raise ValueError(
                f"values for table {table!r} must be (n, width) with n={id_array.shape[0]} "
                f"ids; got shape {arr.shape}"
            )
        if kind == Kind.ROW and arr.shape[1] != self.config.table(table).dim:
            raise ValueError(
                f"table {table!r} has dim={self.config.table(table).dim} but the rows have "
                f"{arr.shape[1]} floats"
            )
        if not unique:
            self._require_unique(table, id_array)
        return id_array, encode_rows(arr, arr.shape[1])

    async def _fan_out(
        self,
        table: str,
        kind: str,
        ids: IdArray,
        job: Callable[[Node, NDArray[np.intp], Keys], Coroutine[Any, Any, None]],
        *,
        check_sentinel: bool,
    ) -> None:
        """Split ids by node (and max_batch_keys) and run `job` on every part concurrently."""
        if ids.shape[0] == 0:
            return
        keys_all = _keys_for(self.namespace, table, kind, ids)
        placement = node_of(table, ids, self.nodes)
        order = np.argsort(placement, kind="stable")
        bounds = np.searchsorted(placement[order], np.arange(len(self._nodes) + 1))
        step = self.config.store.max_batch_keys
        jobs: list[Coroutine[Any, Any, None]] = []
        for j, node in enumerate(self._nodes):
            part = order[bounds[j] : bounds[j + 1]]
            for start in range(0, part.shape[0], step):
                index = part[start : start + step]
                keys = (
                    keys_all[index]
                    if isinstance(keys_all, np.ndarray)
                    else [keys_all[i] for i in index.tolist()]
                )
                jobs.append(job(node, index, keys))
        try:
            await _gather(jobs)
        except DataLossError as exc:
            if check_sentinel and not any(v is not None for v in (await self.sentinels()).values()):
                raise ClusterNotInitializedError(
                    f"namespace {self.namespace!r} is not initialized on any memcached node "
                    f"({', '.join(self.nodes)}): run `lookup-table-admin init --config FILE` "
                    f"(deploy/cluster.sh up does it)"
                ) from exc
            raise

    def _sentinel_request(self) -> bytes:
        return protocol.build_mg([self._sentinel_key]) if self._check_sentinels else b""

    def _check_sentinel(self, node: Node, data: bytes, *, writes: bool = False) -> int | None:
        """Parse the sentinel reply at the start of `data`; return the offset after it.

        The commands pipelined behind the sentinel read ran whatever it found: the writes
        of a batch (`writes`) may have reached a node that has lost its data.
        """
        if not self._check_sentinels:
            return 0
        reply = protocol.parse_mg(data, 0, 1)
        if reply is None:
            return None
        if reply.errors:
            raise StoreError(
                f"memcached node {node.address} answered {reply.errors[0]!r}", node=node.address
            )
        if not reply.found[0]:
            done = (
                "This batch's writes may have reached it, but nothing is read from it until "
                "you restore"
                if writes
                else "Nothing was created on it. Restore"
            )
            raise DataLossError(
                f"memcached node {node.address} has lost its data: its sentinel "
                f"{self._sentinel_key.decode()!r} is gone (the server restarted or was "
                f"flushed). {done} a checkpoint (lookup-table-checkpoint restore) or accept "
                f"the loss (lookup-table-admin reinit --yes)",
                nodes=(node.address,),
            )
        return reply.end

    async def _batch(
        self,
        node: Node,
        keys: Keys,
        commands: bytes,
        parse_reply: Callable[[bytes, int], protocol.MgReply | protocol.MsReply | None],
        finish: Callable[[bytes, Any], T],
        *,
        check: bool = True,
        writes: bool = False,
    ) -> T:
        """One pipelined round trip: [sentinel read] + `commands` + `mn`.

        `parse_reply(data, pos)` parses the commands' replies from `pos` (None while
        incomplete); the sentinel, completeness and per-key error lines are checked
        here once for every kind of batch, then `finish(data, reply)` builds the result.
        """
        check = check and self._check_sentinels
        request = (self._sentinel_request() if check else b"") + commands

        def parse(data: bytes) -> T | None:
            pos = self._check_sentinel(node, data, writes=writes) if check else 0
            if pos is None:
                return None
            reply = parse_reply(data, pos)
            if reply is None or data[reply.end :] != protocol.END_REPLY:
                return self._incomplete(node, data, reply)
            quiet = isinstance(reply, protocol.MgReply) and reply.quiet
            self._raise_reply_errors(node, keys, reply.errors, quiet=quiet)
            return finish(data, reply)

        return await node.roundtrip(request, parse)

    async def _mg_fixed(
        self, node: Node, keys: Keys, nbytes: int
    ) -> tuple[NDArray[np.uint8], NDArray[np.bool_]]:
        n = _num_keys(keys)

        def finish(
            data: bytes, reply: protocol.MgReply
        ) -> tuple[NDArray[np.uint8], NDArray[np.bool_]]:
            found = reply.found
            bad = np.flatnonzero(found & (reply.sizes != nbytes))
            if bad.size:
                i = int(bad[0])
                raise CorruptValueError(
                    f"value of key {_key_text(keys, i)!r} on memcached node {node.address} has "
                    f"{int(reply.sizes[i])} bytes, expected {nbytes} ({nbytes // 4} float32): the "
                    f"table's dim changed or the value is corrupt; restore the table's dim or "
                    f"use a new table name",
                    node=node.address,
                )
            return protocol.gather_values(data, reply, nbytes), found

        # Quiet reads: misses send nothing, so hits and misses in any mix parse as one
        # fixed-stride block (protocol.parse_mg_quiet); the sentinel read in front is
        # not quiet, so its miss is an explicit EN.
        return await self._batch(
            node,
            keys,
            protocol.build_mg_quiet(keys),
            lambda data, pos: protocol.parse_mg_quiet(data, pos, n, nbytes=nbytes),
            finish,
        )

    async def _mg_blobs(self, node: Node, keys: Keys, *, check: bool = True) -> list[bytes | None]:
        n = _num_keys(keys)

        def finish(data: bytes, reply: protocol.MgReply) -> list[bytes | None]:
            return [
                data[s : s + z] if s >= 0 else None
                for s, z in zip(reply.starts.tolist(), reply.sizes.tolist(), strict=True)
            ]

        return await self._batch(
            node,
            keys,
            protocol.build_mg(keys),
            lambda data, pos: protocol.parse_mg(data, pos, n),
            finish,
            check=check,
        )

    async def _ms(
        self,
        node: Node,
        keys: Keys,
        values: NDArray[np.uint8] | list[bytes],
        *,
        add: bool,
        check: bool = True,
        ttl_s: int = 0,
    ) -> NDArray[np.bool_]:
        n = _num_keys(keys)

        def finish(data: bytes, reply: protocol.MsReply) -> NDArray[np.bool_]:
            ok: NDArray[np.bool_] = np.equal(reply.status, protocol.STATUS_STORED)
            if not add and not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                raise StoreError(
                    f"memcached node {node.address} did not store key {_key_text(keys, i)!r} "
                    f"(status {int(reply.status[i])})",
                    node=node.address,
                )
            if add and (~ok & (reply.status != protocol.STATUS_NOT_STORED)).any():
                raise ProtocolError(
                    f"memcached node {node.address} answered an add with an unexpected status",
                    node=node.address,
                )
            return ok

        return await self._batch(
            node,
            keys,
            protocol.build_ms(keys, values, add=add, ttl_s=ttl_s),
            lambda data, pos: protocol.parse_ms(data, pos, n),
            finish,
            check=check,
            writes=True,
        )

    async def _md(self, node: Node, keys: Keys) -> NDArray[np.bool_]:
        n = _num_keys(keys)

        def finish(data: bytes, reply: protocol.MsReply) -> NDArray[np.bool_]:
            existed: NDArray[np.bool_] = np.equal(reply.status, protocol.STATUS_STORED)
            return existed

        return await self._batch(
            node,
            keys,
            protocol.build_md(keys),
            lambda data, pos: protocol.parse_ms(data, pos, n),
            finish,
        )

    @staticmethod
    def _incomplete(node: Node, data: bytes, reply: object) -> None:
        if reply is not None and len(data) > getattr(reply, "end", 0) + len(protocol.END_REPLY):
            raise ProtocolError(
                f"memcached node {node.address} sent more replies than commands",
                node=node.address,
            )
        return None

    @staticmethod
    def _raise_reply_errors(
        node: Node, keys: Keys, errors: dict[int, bytes], *, quiet: bool = False
    ) -> None:
        """Raise for the first error line; `quiet`: its position is only the lowest possible."""
        if not errors:
            return
        i, line = next(iter(errors.items()))
        # A quiet read's error line carries no token: it answers this key or a later one.
        key = (
            f"{_key_text(keys, i)!r} or a later key of the batch"
            if quiet
            else repr(_key_text(keys, i))
        )
        if b"out of memory" in line:
            raise StoreFullError(
                f"memcached node {node.address} is out of memory (started with -M) and refused "
                f"key {key}: {line.decode('ascii', 'replace')}. Add memory (-m) or nodes; "
                f"rows already stored stay readable",
                node=node.address,
            )
        raise StoreError(
            f"memcached node {node.address} refused key {key}: {line.decode('ascii', 'replace')}",
            node=node.address,
        )
