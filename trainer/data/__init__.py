"""Data readers of the trainer: minibatches of ids, numeric features and labels.

A `DataSource` streams `Batch`es without holding a file in memory: `SyntheticSource`
(seeded, Criteo-like), `CriteoSource` (TSV, plain or gzip), `CsvSource` and
`ParquetSource`; `parse_data_spec` builds one from the CLI's `--data SPEC`. Every source
splits, shards and shuffles the same way (a stable eval subset of examples, worker I of
N gets every N-th batch, a bounded shuffle that is a pure function of seed and epoch):
docs/training.md#the-command-line-lookup-table-train.
"""

from __future__ import annotations

from trainer.data.batch import Batch, Ragged, Schema
from trainer.data.batch import Feature as Feature
from trainer.data.batch import IdDtype as IdDtype
from trainer.data.criteo import CriteoSource
from trainer.data.csvfile import CsvSource
from trainer.data.errors import DataError
from trainer.data.parquet import ParquetSource
from trainer.data.plan import Split as Split
from trainer.data.source import BatchTransform, DataSource
from trainer.data.spec import parse_data_spec
from trainer.data.synthetic import SyntheticSource, write_synthetic_criteo

__all__ = [
    "Batch",
    "BatchTransform",
    "CriteoSource",
    "CsvSource",
    "DataError",
    "DataSource",
    "ParquetSource",
    "Ragged",
    "Schema",
    "SyntheticSource",
    "parse_data_spec",
    "write_synthetic_criteo",
]
