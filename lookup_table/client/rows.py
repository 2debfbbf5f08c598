"""`RowReader`: where a trainer reads rows, memcached or the replicas that own them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.client.optimizer import OptimizerClient
from lookup_table.store import EmbeddingStore

__all__ = ["RowReader"]


class RowReader:
    """Where a trainer reads rows: memcached (`EmbeddingStore.lookup_many`: missing rows
    created with `add`), or, for tables whose rows are written behind
    (`ClusterConfig.reads_through_owner`), their owning replicas (`OptimizerClient.rows`:
    memcached may not hold the newest values yet; a missing row gets its initial value
    and its first push creates it)."""

    def __init__(self, store: EmbeddingStore, client: OptimizerClient) -> None:
        self.config = store.config
        self._store = store
        self._client = client
        config = store.config
        self._owned = {t.name for t in config.tables if config.reads_through_owner(t.name)}

    async def lookup(self, table: str, ids: Any, *, create: bool = True) -> NDArray[np.float32]:
        return (await self.lookup_many({table: ids}, create=create))[table]

    async def lookup_many(
        self, ids: Mapping[str, Any], *, create: bool = True
    ) -> dict[str, NDArray[np.float32]]:
        """`EmbeddingStore.lookup_many`'s answer, each table read where it must be (the
        store and the replicas at once)."""
        owned = {t: i for t, i in ids.items() if t in self._owned}
        rest = {t: i for t, i in ids.items() if t not in self._owned}
        if not owned:
            return await self._store.lookup_many(rest, create=create)
        if rest:
            from_store, from_owners = await asyncio.gather(
                self._store.lookup_many(rest, create=create), self._client.rows(owned)
            )
        else:
            from_store, from_owners = {}, await self._client.rows(owned)
        return {**from_store, **{table: rows for table, (rows, _) in from_owners.items()}}
