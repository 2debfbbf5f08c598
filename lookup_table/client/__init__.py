"""The service's client side: `OptimizerClient` (pushes, rows, dense parameters, pause and
resume, the agreement check), `RowReader` (a trainer's reads of rows) and `PushReads`
(reads a push takes along).

`optimizer` is the client, `requests` and `answers` what its requests carry and its
answers hold on the wire, `rows` the reader.
"""

from __future__ import annotations

from lookup_table.client.optimizer import OptimizerClient
from lookup_table.client.rows import PushReads, RowReader

__all__ = ["OptimizerClient", "PushReads", "RowReader"]
