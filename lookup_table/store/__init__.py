"""The store: `EmbeddingStore`, batched async access to every table's rows in memcached.

`api` is the public class; it composes `placement` (ids placed on nodes once per
call, a batch's parts), `items` (what a row's item holds, new rows, TTLs, admission),
`fanout` (one request per node, errors mapped; `gathering`), `sentinels` (data loss,
storage format) and `layouts` (the layouts of tables the sentinels do not record).
One node's request is `lookup_table.memcached.batch`'s.
"""

from __future__ import annotations

from lookup_table.store.api import EmbeddingStore
from lookup_table.store.placement import TableRead, TableWrite

__all__ = ["EmbeddingStore", "TableRead", "TableWrite"]
