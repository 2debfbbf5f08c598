"""`RowReader`: where a trainer reads rows, memcached or the replicas that own them;
`PushReads`: reads that go with a push instead of a request of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.client.optimizer import OptimizerClient
from lookup_table.store import EmbeddingStore

__all__ = ["PushReads", "RowReader"]


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
        self, ids: Mapping[str, Any], *, create: bool = True, along: PushReads | None = None
    ) -> dict[str, NDArray[np.float32]]:
        """`EmbeddingStore.lookup_many`'s answer, each table read where it must be (the
        store and the replicas at once). With `along`, the tables read through their
        owners go with the push that takes them (`PushReads`)."""
        owned = {t: i for t, i in ids.items() if t in self._owned}
        rest = {t: i for t, i in ids.items() if t not in self._owned}
        if not owned:
            return await self._store.lookup_many(rest, create=create)
        # asked before anything is awaited: a push sent after this call was made takes them
        pushed = along.ask(owned) if along is not None else None
        owners = self._owners(owned, pushed)
        if rest:
            from_store, from_owners = await asyncio.gather(
                self._store.lookup_many(rest, create=create), owners
            )
        else:
            from_store, from_owners = {}, await owners
        return {**from_store, **{table: rows for table, (rows, _) in from_owners.items()}}

    async def _owners(
        self, owned: Mapping[str, Any], pushed: asyncio.Future[Any] | None
    ) -> dict[str, tuple[NDArray[np.float32], int]]:
        got = await pushed if pushed is not None else None
        return got if got is not None else await self._client.rows(owned)


class PushReads:
    """Rows read with a push (`OptimizerClient.push(reads=...)`) instead of a request of
    their own: a trainer's next batch, read once the push's new values are computed.

    `RowReader.lookup_many(..., along=reads)` hands it the ids of its tables read through
    their owners (`ask`); the push that takes them (`take`) hands their rows back
    (`answered`) or its error (`failed`). Ids asked after a push took it, or left when it
    is `close`d without one, are read by a request of their own. All of it runs on the
    client's event loop."""

    def __init__(self) -> None:
        self._ids: dict[str, Any] | None = None
        self._rows: asyncio.Future[dict[str, tuple[NDArray[np.float32], int]] | None] | None = None
        self._open = True
        self._taken = False

    def ask(self, ids: Mapping[str, Any]) -> asyncio.Future[Any] | None:
        """Leave `ids` (`{table: ids}`) to the push: a future of what `OptimizerClient.rows`
        returns for them (None: read them alone), or None when a push took this already."""
        if not self._open or self._ids is not None:
            return None
        self._ids = dict(ids)
        self._rows = asyncio.get_running_loop().create_future()
        return self._rows

    def take(self) -> dict[str, Any] | None:
        """(The push.) The ids asked, if any; later ones are read alone."""
        self._open = False
        self._taken = self._ids is not None
        return self._ids

    def answered(self, rows: dict[str, tuple[NDArray[np.float32], int]]) -> None:
        if self._rows is not None and not self._rows.done():
            self._rows.set_result(rows)

    def failed(self, error: BaseException) -> None:
        if self._rows is not None and not self._rows.done():
            self._rows.set_exception(error)

    def close(self) -> None:
        """No push (more) takes them: ids asked and not taken are read alone."""
        self._open = False
        if not self._taken and self._rows is not None and not self._rows.done():
            self._rows.set_result(None)
