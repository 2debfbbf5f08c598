"""The service's client side: `OptimizerClient` (pushes, rows, dense parameters, pause and
resume, the agreement check) and `RowReader` (a trainer's reads of rows).

`optimizer` is the client, `requests` and `answers` what its requests carry and its
answers hold on the wire, `rows` the reader.
"""

from __future__ import annotations

from lookup_table.client.optimizer import OptimizerClient
from lookup_table.client.rows import RowReader

__all__ = ["OptimizerClient", "RowReader"]
