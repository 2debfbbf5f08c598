"""Per-node fan-out: a batch's parts split into one request per node (per
`store.max_batch_keys` keys), run concurrently, and their failures mapped to one error.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.keys import IdArray, as_ids, prefixed_keys
from lookup_table.core.rows import ROW_DTYPE
from lookup_table.errors import ClusterNotInitializedError, CorruptValueError, DataLossError
from lookup_table.memcached import batch
from lookup_table.memcached.batch import Segment
from lookup_table.memcached.node import Node
from lookup_table.memcached.protocol import Keys
from lookup_table.store.gathering import gather
from lookup_table.store.items import Items
from lookup_table.store.layouts import TableLayouts
from lookup_table.store.placement import Part, Placement
from lookup_table.store.sentinels import Sentinels

__all__ = ["FanOut"]


class FanOut:
    """Runs the parts of a batch on the nodes: one pipelined request per node.

    `check_sentinels`: every batch reads the node's sentinel in front of its commands,
    and the first batch of a table checks its stored layout (`layouts`).
    """

    def __init__(
        self,
        config: ClusterConfig,
        placement: Placement,
        items: Items,
        sentinels: Sentinels,
        *,
        check_sentinels: bool,
    ) -> None:
        self.config = config
        self.namespace = config.namespace
        self.nodes: tuple[str, ...] = config.node_addresses
        self._nodes = [Node(spec, config.store) for spec in config.memcached]
        self._placement = placement
        self._items = items
        self._sentinels = sentinels
        self._check_sentinels = check_sentinels
        # what every batch reads in front of its commands (None: nothing)
        self.guard = sentinels if check_sentinels else None
        self.layouts = TableLayouts(config.namespace, self._nodes, sentinels)

    @property
    def connections(self) -> list[Node]:
        """Each node's connection pool, in the order of `nodes`."""
        return self._nodes

    async def close(self) -> None:
        """Close every connection."""
        for node in self._nodes:
            await node.close()

    async def sentinels(self) -> dict[str, bytes | None]:
        """`EmbeddingStore.sentinels`."""
        sentinels, _ = await self.peek([])
        return sentinels

    async def peek(
        self, reads: Sequence[tuple[str, Any, str]]
    ) -> tuple[dict[str, bytes | None], list[list[bytes | None]]]:
        """`EmbeddingStore.peek`: every node's sentinel and the blobs of `reads`, one
        round trip per node."""
        placed = self._placement.place_many(
            [(table, as_ids(ids, table=table)) for table, ids, _ in reads]
        )
        parts = [
            Part(p, self._placement.prefix(p, kind), p.by_node)
            for p, (_, _, kind) in zip(placed, reads, strict=True)
        ]
        if self._check_sentinels:
            await self.layouts.ensure(parts)
        out: list[list[bytes | None]] = [[None] * p.ids.shape[0] for p in placed]
        segments: dict[Node, list[Segment]] = {node: [] for node in self._nodes}
        for node, chunk in self.chunks(parts):  # a node's keys: one request, however many
            segments[node] += chunk

        async def read(node: Node) -> bytes | None:
            keys = [self._sentinels.key]
            for s in segments[node]:
                keys += [bytes(k) for k in s.keys] if isinstance(s.keys, np.ndarray) else s.keys
            sentinel, *values = await batch.mg_blobs(node, keys, sentinel=None)
            if segments[node] and self._check_sentinels:
                if sentinel is None:
                    raise self._sentinels.lost(node, writes=False)
                self._sentinels.accept(node.address, sentinel)
            got = iter(values)
            for s in segments[node]:
                for i in s.index.tolist():
                    out[s.part][i] = next(got)
            return sentinel

        sentinels = await gather([read(node) for node in self._nodes])
        return dict(zip(self.nodes, sentinels, strict=True)), out

    def chunks(self, parts: Sequence[Part]) -> list[tuple[Node, list[Segment]]]:
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

    async def run(self, jobs: Sequence[Coroutine[Any, Any, None]]) -> None:
        """Run the round trips of a batch; a batch on an uninitialized cluster says so."""
        if not jobs:
            return
        try:
            await gather(jobs)
        except DataLossError as exc:
            if not any(v is not None for v in (await self.sentinels()).values()):
                raise ClusterNotInitializedError(
                    f"namespace {self.namespace!r} is not initialized on any memcached node "
                    f"({', '.join(self.nodes)}): run `lookup-table-admin init --config FILE` "
                    f"(deploy/cluster.sh up does it)"
                ) from exc
            raise

    async def read(
        self, parts: Sequence[Part]
    ) -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        """Fixed-width reads of every part: one request per node (per max_batch_keys)."""
        # the values' bytes (uint8) where a part decodes them, float32 otherwise
        results: list[tuple[NDArray[Any], NDArray[np.bool_]]] = [
            (
                np.zeros((p.placed.ids.shape[0], p.kept), dtype=np.uint8)
                if p.decode is not None
                else np.zeros((p.placed.ids.shape[0], p.kept // ROW_DTYPE.itemsize), np.float32),
                np.zeros(p.placed.ids.shape[0], dtype=bool),
            )
            for p in parts
        ]
        chunks = self.chunks(parts)
        describe = self._items.describer(parts)
        jobs = [
            batch.mg_rows(node, parts, segs, results, sentinel=self.guard, describe=describe)
            for node, segs in chunks
        ]
        try:
            await self.run(jobs)
        except CorruptValueError:
            # a value of another size than the layout's: another layout, if one is recorded
            if self._check_sentinels:
                await self.layouts.ensure(parts)
            raise
        # the batch read the sentinels in front (the tables they record are checked): the
        # tables they do not are checked before the values are used
        if self._check_sentinels:
            await self.layouts.ensure(parts)
        return [
            (values if p.decode is None else p.decode(values), found)
            for p, (values, found) in zip(parts, results, strict=True)
        ]

    async def write(self, parts: Sequence[Part], *, add: bool) -> list[NDArray[np.bool_]]:
        """`ms` (or `add`) of every part: one request per node (per max_batch_keys)."""
        stored, _ = await self.add_and_count(parts, [], add=add)
        return stored

    async def add_and_count(
        self, writes: Sequence[Part], counts: Sequence[Part], *, add: bool = True
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
                sentinel=self.guard,
            )
            for s, ok in zip(sets, flags, strict=True):
                stored[s.part][s.index] = ok
            for s, got in zip(mas, values, strict=True):
                counted[s.part - len(writes)][s.index] = got

        chunks = self.chunks(parts)
        if self._check_sentinels:
            await self.layouts.ensure(parts)
        await self.run([one(node, segments) for node, segments in chunks])
        return stored, counted

    async def fan_out(
        self,
        table: str,
        kind: str,
        ids: IdArray,
        job: Callable[[Node, NDArray[np.intp], Keys], Coroutine[Any, Any, None]],
    ) -> None:
        """Split the ids of one (table, kind) by node (and max_batch_keys); run `job` on each."""
        if ids.shape[0] == 0:
            return
        placed = self._placement.place(table, ids)
        part = Part(placed, self._placement.prefix(placed, kind), placed.by_node)
        chunks = self.chunks([part])
        if self._check_sentinels:
            await self.layouts.ensure([part])
        await self.run([job(node, s.index, s.keys) for node, (s,) in chunks])
