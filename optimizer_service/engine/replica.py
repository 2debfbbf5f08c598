"""What every room of the engine shares: one replica's config, store, row cache,
journal, locks and dense parameters, its version, its stamps' epoch, and the
background tasks that pause and close wait for."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from typing import Any

from lookup_table.config import ClusterConfig
from lookup_table.core.keyspace import META_TABLE, Kind, push_record_id
from lookup_table.core.optimizers import make_optimizer, step_slot
from lookup_table.core.rowcache import RowCache
from lookup_table.store import EmbeddingStore
from optimizer_service.engine.dense import DenseReplica
from optimizer_service.engine.journal import Journal
from optimizer_service.engine.locks import RowLocks
from optimizer_service.engine.rounding import RowRounder


class ReplicaState:
    """The state of one replica that the engine's rooms (and the `Updater`) share."""

    def __init__(
        self,
        config: ClusterConfig,
        store: EmbeddingStore,
        *,
        replica: int,
        push_record_ttl_s: int,
    ) -> None:
        self.config = config
        self.store = store
        self.replica = replica
        self.push_record_ttl_s = push_record_ttl_s
        self.optimizers = {t.name: make_optimizer(t.optimizer) for t in config.tables}
        # each table's step column (Adam): its journal written behind keeps the gradients
        # and steps (module journal). Not with `ttl_s`: a row that expired before a replay
        # would look like a lost update; its values are journaled
        self.step_slots = {
            t.name: step_slot(self.optimizers[t.name], t.dim) if t.ttl_s is None else None
            for t in config.tables
        }
        # float16/bfloat16 tables: their stepped rows rounded as stored (module rounding)
        self.rounders = {t.name: RowRounder(t, self.optimizers[t.name]) for t in config.tables}
        self.dense = DenseReplica(store, make_optimizer(config.optimizer))
        self.locks = RowLocks()
        # rows written behind (docs/write-behind.md): every row_flush_pushes pushes
        self.flush_every = config.service.row_flush_pushes
        self.journal = Journal(
            store, replica=replica, behind=self.flush_every if self.flush_every > 1 else 0
        )
        self.cache = RowCache(
            {
                t.name: (t.dim, self.optimizers[t.name].slot_width(t.dim))
                for t in config.tables
                if t.id_type == "int64"
                and t.ttl_s is None  # see lookup_table.core.rowcache
                # rows written behind: only those trainers read through this replica
                and (self.flush_every == 1 or config.reads_through_owner(t.name))
            },
            config.service.cache_mb * 2**20,
        )
        self.sentinels: dict[str, bytes | None] | None = None  # None: cache not in use
        # an answer's `stamp`: this replica's rows as it knows them (a new epoch when it
        # may not any more) and how many pushes changed them
        self.epoch = uuid.uuid4().hex[:16]
        self.changes = 0
        self.version = 0
        self.version_changed = asyncio.Condition()
        self.finishers: set[asyncio.Task[None]] = set()
        self.cleanups: set[asyncio.Task[object]] = set()
        self.recording: set[str] = set()  # written pushes whose done record is on its way
        self.admitting = asyncio.Event()  # cleared while paused
        self.admitting.set()

    @property
    def paused(self) -> bool:
        return not self.admitting.is_set()

    def record_id(self, push_id: str) -> str:
        return push_record_id(self.replica, push_id)

    async def is_done(self, push_id: str) -> bool:
        if push_id in self.recording:
            return True
        (value,) = await self.store.get_blobs(
            META_TABLE, [self.record_id(push_id)], kind=Kind.PUSH_RECORD
        )
        return value is not None

    def forget_rows(self) -> None:
        """Drop the row cache: what this replica knew of its rows may not hold any more
        (a restore, a node's new sentinel). A new epoch tells trainers the same."""
        self.cache.forget()
        self.epoch = uuid.uuid4().hex[:16]

    async def set_version(self, version: int) -> None:
        async with self.version_changed:
            self.version = max(self.version, version)
            self.version_changed.notify_all()

    async def cache_sentinels(self) -> dict[str, bytes | None] | None:
        """The nodes' sentinels, which the cache's rows belong to; None (no cache) while
        a node lacks one, or when the cache is off."""
        if self.config.service.cache_mb <= 0:
            return None
        sentinels = await self.store.sentinels()
        return sentinels if all(sentinels.values()) else None

    def in_background(self, job: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        """Run `job` as a task that `pause` and `close` wait for (`cleanups`)."""
        task = asyncio.get_running_loop().create_task(job)
        self.cleanups.add(task)
        task.add_done_callback(self.cleanups.discard)
        return task
