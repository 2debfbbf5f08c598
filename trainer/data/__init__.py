"""Data readers of the trainer: minibatches of ids, numeric features and labels.

A `DataSource` streams `Batch`es; it never holds a file in memory (text is read
in 256 KiB chunks, parquet in record batches). Four sources:

* `SyntheticSource`: a seeded, Criteo-like generator with a hidden logistic model.
* `CriteoSource`: Criteo's TSV (label, I1-I13, C1-C26), plain or gzip.
* `CsvSource`: CSV with a header; columns chosen by name.
* `ParquetSource`: parquet via pyarrow (an optional dependency).

`parse_data_spec` builds one from the CLI's `--data SPEC` and column options.

Splits and sharding, the same for every source:

* The eval split is a fixed subset of *examples*: example `r` (its 0-based
  position in the source) is in eval iff a stable 64-bit hash of `r` falls
  below `eval_fraction`. It does not depend on the batch size, the number of
  workers, the epoch or the process, so eval examples are never trained on.
* The examples of the chosen split are cut, in source order, into batches of
  `batch_size` (the last one of an epoch may be smaller). Worker `I` of `N`
  gets the batches whose index within the split is `I mod N`: the workers'
  batches are disjoint, their union is the single-worker stream, and their
  counts differ by at most one per epoch. Every worker still reads the whole
  source; for many workers, give each its own file.
* Shuffling (`shuffle_buffer` > 0): within the chosen split, examples pass
  through a bounded buffer, like `tf.data.Dataset.shuffle`: whenever it holds
  1.5x its size, a random third of it leaves, in random order. The order is a
  pure function of (seed, epoch) computed with counter-based hashes, so every
  worker sees the same shuffled stream (their batches stay disjoint) on any
  machine, and each epoch has another order. Without it, examples come in
  source order, every epoch.
* Missing numeric values (empty, NaN): readers keep them as NaN; `batches`
  fills them with 0.0, or a numeric transform (`with_numeric`, see
  `trainer.numeric`) with the training mean. `raw_batches` keeps the NaN.
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
