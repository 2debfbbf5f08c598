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
  1.5x its size, a random half-and-more leaves in random order. The order is a
  pure function of (seed, epoch) computed with counter-based hashes, so every
  worker sees the same shuffled stream (their batches stay disjoint) on any
  machine, and each epoch has another order. Without it, examples come in
  source order, every epoch.
* Missing numeric values (empty, NaN): readers keep them as NaN; `batches`
  fills them with 0.0, or a numeric transform (`with_numeric`, see
  `trainer.numeric`) with the training mean. `raw_batches` keeps the NaN.
"""

from __future__ import annotations

import abc
import csv
import dataclasses
import gzip
import io
import itertools
import math
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, Protocol, TypeAlias, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.errors import LookupTableError
from lookup_table.hashing import combine, mix64, stable_hash

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

IdDtype: TypeAlias = Literal["int64", "string"]
Split: TypeAlias = Literal["train", "eval", "all"]
IdArray: TypeAlias = "NDArray[np.int64] | NDArray[np.object_]"
Feature: TypeAlias = "NDArray[np.int64] | NDArray[np.object_] | NDArray[np.float32] | Ragged"

_ID_DTYPES = ("int64", "string")
_SPLITS = ("train", "eval", "all")
_CHUNK_CHARS = 1 << 18  # text read per chunk: ~1k Criteo rows, ~3 MB of parsed fields
_PLAN_ROWS = 1 << 16  # synthetic rows whose split is decided at a time
_EVAL_KEY = np.uint64(stable_hash("trainer.data/eval-split"))
_SHUFFLE_KEY = stable_hash("trainer.data/shuffle")
_U53 = np.uint64(11)
_U32 = np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
# What reading a text file can raise on bad bytes: not UTF-8, corrupt or truncated gzip.
_READ_ERRORS = (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error)


class DataError(LookupTableError, ValueError):
    """The data or its spec is wrong: unknown kind or column, missing file, bad value.

    The message names the file, the row (1-based, header excluded) or the column,
    and, for column errors, lists the columns the file has.
    """


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True, slots=True, eq=False)
class Ragged:
    """Variable-length ids per example: example i has `values[row_splits[i]:row_splits[i+1]]`.

    `values` is (nnz,) int64 or object str; `row_splits` is int64 (b+1,), starts
    at 0, ends at nnz and never decreases (`tf.RaggedTensor.from_row_splits`).
    """

    values: IdArray
    row_splits: NDArray[np.int64]

    def __post_init__(self) -> None:
        splits = self.row_splits
        if not (isinstance(splits, np.ndarray) and splits.dtype == np.int64 and splits.ndim == 1):
            raise ValueError(f"row_splits must be a 1-D int64 array, got {splits!r:.80}")
        if (
            splits.size == 0
            or splits[0] != 0
            or splits[-1] != len(self.values)
            or bool((splits[1:] < splits[:-1]).any())
        ):
            raise ValueError(
                f"row_splits must rise from 0 to len(values)={len(self.values)}, got {splits!r:.80}"
            )

    def __len__(self) -> int:
        return int(self.row_splits.shape[0]) - 1

    def row_lengths(self) -> NDArray[np.int64]:
        """Number of ids of each example, (b,)."""
        return np.diff(self.row_splits)


@dataclass(frozen=True, slots=True, eq=False)
class Batch:
    """One minibatch: b examples.

    `features` maps a column name to a categorical column (int64 or object-str
    ids, (b,)), a numeric column (float32, (b,)) or a multivalued column
    (`Ragged` with b rows). `labels` is float32 (b,).
    """

    features: dict[str, Feature]
    labels: NDArray[np.float32]

    def __post_init__(self) -> None:
        if self.labels.dtype != np.float32 or self.labels.ndim != 1:
            raise ValueError(
                f"labels must be float32 (b,), got {self.labels.dtype} {self.labels.shape}"
            )
        size = self.labels.shape[0]
        wrong = {name: len(col) for name, col in self.features.items() if len(col) != size}
        if wrong:
            raise ValueError(f"every feature must have {size} rows like the labels, got {wrong}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class Schema:
    """The columns of a source and their types.

    Args:
        categorical: one id per example: name -> "int64" or "string".
        numeric: float32 features.
        multivalued: a list of ids per example (`Ragged`): name -> id dtype.
        label: the name of the label column (not a feature).
    """

    categorical: dict[str, IdDtype] = field(default_factory=dict)
    numeric: tuple[str, ...] = ()
    multivalued: dict[str, IdDtype] = field(default_factory=dict)
    label: str = "label"

    def __post_init__(self) -> None:
        for group in (self.categorical, self.multivalued):
            bad = {name: dtype for name, dtype in group.items() if dtype not in _ID_DTYPES}
            if bad:
                raise ValueError(f"id dtypes must be one of {_ID_DTYPES}, got {bad}")
        names = self.feature_names
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"a column can have one role only; repeated: {duplicates}")
        if self.label in names:
            raise ValueError(f"the label column {self.label!r} cannot also be a feature")

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Every feature, in batch order: categorical, numeric, multivalued."""
        return (*self.categorical, *self.numeric, *self.multivalued)


def _slice_feature(col: Feature, start: int, stop: int) -> Feature:
    if isinstance(col, Ragged):
        lo, hi = int(col.row_splits[start]), int(col.row_splits[stop])
        return Ragged(col.values[lo:hi], col.row_splits[start : stop + 1] - lo)
    return col[start:stop]


def _take_feature(col: Feature, index: NDArray[np.intp]) -> Feature:
    if isinstance(col, Ragged):
        lengths = np.diff(col.row_splits)[index]
        splits = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=splits[1:])
        gather = np.repeat(col.row_splits[:-1][index] - splits[:-1], lengths)
        gather += np.arange(splits[-1], dtype=np.int64)
        return Ragged(col.values[gather], splits)
    return col[index]


def _concat_feature(cols: Sequence[Feature]) -> Feature:
    first = cols[0]
    if isinstance(first, Ragged):
        parts = [c for c in cols if isinstance(c, Ragged)]
        offsets = np.cumsum([0] + [len(c.values) for c in parts[:-1]], dtype=np.int64)
        splits = [parts[0].row_splits[:1]] + [
            c.row_splits[1:] + off for c, off in zip(parts, offsets, strict=True)
        ]
        return Ragged(np.concatenate([c.values for c in parts]), np.concatenate(splits))
    # the first column is not Ragged, so none is (they are columns of one feature)
    return np.concatenate(cast("Sequence[NDArray[Any]]", cols))


def _slice(batch: Batch, start: int, stop: int) -> Batch:
    features = {k: _slice_feature(v, start, stop) for k, v in batch.features.items()}
    return Batch(features, batch.labels[start:stop])


def _take(batch: Batch, index: NDArray[np.intp]) -> Batch:
    features = {k: _take_feature(v, index) for k, v in batch.features.items()}
    return Batch(features, batch.labels[index])


def _concat(batches: Sequence[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    names = batches[0].features
    features = {k: _concat_feature([b.features[k] for b in batches]) for k in names}
    return Batch(features, np.concatenate([b.labels for b in batches]))


def _rebatch(chunks: Iterable[Batch], batch_size: int) -> Iterator[Batch]:
    """Cut a stream of chunks of any size into batches of `batch_size` (the last may be short).

    Whole batches inside a chunk are views of it; only a batch that straddles
    chunks is copied.
    """
    pending: list[Batch] = []
    count = 0
    for chunk in chunks:
        n, start = len(chunk), 0
        if count:
            need = batch_size - count
            if n < need:
                pending.append(chunk)
                count += n
                continue
            yield _concat([*pending, _slice(chunk, 0, need)])
            pending, count, start = [], 0, need
        while n - start >= batch_size:
            yield _slice(chunk, start, start + batch_size)
            start += batch_size
        if start < n:
            pending, count = [_slice(chunk, start, n)], n - start
    if count:
        yield _concat(pending)


def _eval_mask(rows: NDArray[np.int64], eval_fraction: float) -> NDArray[np.bool_]:
    """Which examples (0-based positions in the source) belong to the eval split."""
    h = mix64(rows.view(np.uint64) ^ _EVAL_KEY)
    return (h >> _U53).astype(np.float64) * 2.0**-53 < eval_fraction


def _split_index(first_row: int, n: int, split: Split, eval_fraction: float) -> NDArray[np.intp]:
    """Positions, within a chunk of n examples starting at `first_row`, of the split's examples."""
    is_eval = _eval_mask(np.arange(first_row, first_row + n, dtype=np.int64), eval_fraction)
    return np.flatnonzero(is_eval if split == "eval" else ~is_eval)


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    batch_size: int
    split: Split
    eval_fraction: float
    worker_index: int
    num_workers: int
    shuffle_buffer: int = 0
    seed: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        if not (_is_int(self.batch_size) and self.batch_size > 0):
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if not (_is_int(self.num_workers) and self.num_workers > 0):
            raise ValueError(f"num_workers must be a positive int, got {self.num_workers!r}")
        if not (_is_int(self.worker_index) and 0 <= self.worker_index < self.num_workers):
            raise ValueError(
                f"worker_index must be in [0, {self.num_workers}), got {self.worker_index!r}"
            )
        if self.split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {self.split!r}")
        if not 0.0 <= self.eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {self.eval_fraction!r}")
        if not (_is_int(self.shuffle_buffer) and self.shuffle_buffer >= 0):
            raise ValueError(
                f"shuffle_buffer must be a non-negative int (0: no shuffling), "
                f"got {self.shuffle_buffer!r}"
            )
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def mine(self, batch_index: int) -> bool:
        return batch_index % self.num_workers == self.worker_index


_T = TypeVar("_T", bound=Sized)  # a Batch or an array of positions


def _shuffle_order(n: int, key: int) -> NDArray[np.intp]:
    """A permutation of range(n), a pure function of (n, key): the same on every machine."""
    salt = int(combine(np.array([key], dtype=np.uint64), _SHUFFLE_KEY)[0])
    return np.argsort(combine(np.arange(n, dtype=np.uint64), salt), kind="stable")


def _shuffled(
    items: Iterable[_T],
    plan: _Plan,
    *,
    cut: Callable[[_T, int, int], _T],
    concat: Callable[[list[_T]], _T],
    take: Callable[[_T, NDArray[np.intp]], _T],
) -> Iterator[_T]:
    """The examples of `items` through a bounded shuffle buffer of `plan.shuffle_buffer`.

    Vectorized `tf.data.Dataset.shuffle`: examples collect until the buffer holds
    1.5x its size (a long chunk is cut to fit); then the held examples are
    permuted, all but `shuffle_buffer` leave (in that random order) and the rest
    stay for the next round, so an example can leave late and far from where it
    came in, but never more than 1.5 buffers early. At the end the buffer leaves
    in random order. Each round's permutation depends on (seed, epoch, round).
    """
    buffer = plan.shuffle_buffer
    threshold = buffer + max(1, buffer // 2)
    seed_key = int(
        combine(np.array([plan.seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64), plan.epoch)[0]
    )
    held: list[_T] = []
    count = 0
    round_ = 0
    for item in items:
        n = len(item)
        start = 0
        while start < n:
            stop = min(n, start + threshold - count)
            held.append(cut(item, start, stop))
            count += stop - start
            start = stop
            if count == threshold:
                whole = concat(held)
                order = _shuffle_order(count, seed_key ^ round_)
                round_ += 1
                yield take(whole, order[: count - buffer])
                held, count = [take(whole, order[count - buffer :])], buffer
    if count:
        yield take(concat(held), _shuffle_order(count, seed_key ^ round_))


def _fill_missing(batch: Batch, numeric: Iterable[str]) -> Batch:
    """`batch` with NaN (missing) numeric values replaced by 0.0."""
    features = dict(batch.features)
    for name in numeric:
        x = cast("NDArray[np.float32]", features[name])
        missing = np.isnan(x)
        if missing.any():
            features[name] = np.where(missing, np.float32(0), x)
    return Batch(features, batch.labels)


class BatchTransform(Protocol):
    """Maps a raw batch (NaN where a numeric value is missing) to what the model reads."""

    def apply(self, batch: Batch) -> Batch: ...


# --------------------------------------------------------------------------- sources


class DataSource(abc.ABC):
    """A stream of examples with a fixed schema.

    Implement `schema` and `chunks`; `batches` does splitting, batching and
    sharding the same way for every source (see the module docstring).
    """

    @property
    @abc.abstractmethod
    def schema(self) -> Schema:
        """The columns every batch has."""

    @property
    def num_examples(self) -> int | None:
        """Examples in one pass over the source, if known without reading it (for progress)."""
        return None

    @abc.abstractmethod
    def chunks(self) -> Iterator[Batch]:
        """One pass over every example, in source order, in chunks of any size."""

    def batches(
        self,
        batch_size: int,
        *,
        worker_index: int = 0,
        num_workers: int = 1,
        split: Split = "train",
        eval_fraction: float = 0.2,
        epochs: int | None = 1,
        shuffle_buffer: int = 0,
        seed: int = 0,
    ) -> Iterator[Batch]:
        """Stream this worker's batches of one split.

        Args:
            batch_size: examples per batch; the last batch of an epoch may be smaller.
            worker_index: this worker, in [0, num_workers).
            num_workers: workers sharing the split; worker I gets batches I, I+N, ...
            split: "train", "eval" (a stable `eval_fraction` of the examples) or "all".
            eval_fraction: the share of examples held out for eval, in [0, 1].
            epochs: passes over the source; None repeats forever.
            shuffle_buffer: examples in the shuffle buffer; 0 keeps the source order.
            seed: the shuffle's seed; with the epoch number it fixes each epoch's order.

        Raises:
            ValueError: a bad argument (raised here, not at the first `next`).
            DataError: while iterating, a value the source cannot parse.
        """
        plan = _Plan(
            batch_size=batch_size,
            split=split,
            eval_fraction=eval_fraction,
            worker_index=worker_index,
            num_workers=num_workers,
            shuffle_buffer=shuffle_buffer,
            seed=seed,
        )
        if epochs is not None and not (_is_int(epochs) and epochs >= 0):
            raise ValueError(f"epochs must be a non-negative int or None, got {epochs!r}")
        passes = itertools.count() if epochs is None else range(epochs)
        return (
            self._prepare(batch)
            for epoch in passes
            for batch in self._epoch(dataclasses.replace(plan, epoch=epoch))
        )

    def raw_batches(
        self, batch_size: int, *, split: Split = "train", eval_fraction: float = 0.2
    ) -> Iterator[Batch]:
        """One pass over a split in source order, every worker's batches, missing
        numeric values as NaN (what numeric statistics are computed from)."""
        plan = _Plan(
            batch_size=batch_size,
            split=split,
            eval_fraction=eval_fraction,
            worker_index=0,
            num_workers=1,
        )
        return self._epoch(plan)

    def with_numeric(self, transform: BatchTransform) -> DataSource:
        """The same source whose `batches` pass through `transform` instead of filling
        missing numeric values with 0.0 (e.g. `trainer.numeric.NumericStats`)."""
        return _Transformed(self, transform)

    def _prepare(self, batch: Batch) -> Batch:
        """What `batches` yields for a raw batch: missing numeric values -> 0.0."""
        return _fill_missing(batch, self.schema.numeric)

    def select(self, names: Iterable[str]) -> DataSource:
        """The same source with only the features `names` (the label is kept).

        Raises:
            DataError: a name that is not a feature of this source.
        """
        return _Selected(self, tuple(names))

    def _epoch(self, plan: _Plan) -> Iterator[Batch]:
        """One pass: the split's batches that belong to this worker."""

        def split_chunks() -> Iterator[Batch]:
            first_row = 0
            for chunk in self.chunks():
                n = len(chunk)
                if plan.split != "all":
                    chunk = _take(chunk, _split_index(first_row, n, plan.split, plan.eval_fraction))
                first_row += n
                yield chunk

        stream: Iterable[Batch] = split_chunks()
        if plan.shuffle_buffer:
            stream = _shuffled(stream, plan, cut=_slice, concat=_concat, take=_take)
        for index, batch in enumerate(_rebatch(stream, plan.batch_size)):
            if plan.mine(index):
                yield batch


class _Selected(DataSource):
    """A source restricted to some of its features (see `DataSource.select`)."""

    def __init__(self, inner: DataSource, names: tuple[str, ...]) -> None:
        full = inner.schema
        unknown = [n for n in names if n not in full.feature_names]
        if unknown or not names:
            raise DataError(
                f"unknown features {unknown} (or none chosen); "
                f"the source has: {', '.join(full.feature_names)}"
            )
        keep = set(names)
        self._inner = inner
        self._schema = Schema(
            categorical={k: v for k, v in full.categorical.items() if k in keep},
            numeric=tuple(n for n in full.numeric if n in keep),
            multivalued={k: v for k, v in full.multivalued.items() if k in keep},
            label=full.label,
        )

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def num_examples(self) -> int | None:
        return self._inner.num_examples

    def _narrow(self, batch: Batch) -> Batch:
        return Batch({k: batch.features[k] for k in self._schema.feature_names}, batch.labels)

    def chunks(self) -> Iterator[Batch]:
        return map(self._narrow, self._inner.chunks())

    def _epoch(self, plan: _Plan) -> Iterator[Batch]:
        return map(self._narrow, self._inner._epoch(plan))


class _Transformed(DataSource):
    """A source whose batches pass through a transform (see `DataSource.with_numeric`)."""

    def __init__(self, inner: DataSource, transform: BatchTransform) -> None:
        self._inner = inner
        self._transform = transform

    @property
    def schema(self) -> Schema:
        return self._inner.schema

    @property
    def num_examples(self) -> int | None:
        return self._inner.num_examples

    def chunks(self) -> Iterator[Batch]:
        return self._inner.chunks()

    def _epoch(self, plan: _Plan) -> Iterator[Batch]:
        return self._inner._epoch(plan)

    def _prepare(self, batch: Batch) -> Batch:
        return self._transform.apply(batch)


# --------------------------------------------------------------------------- synthetic

_NUM_NUMERIC = 13
_NUM_CATEGORICAL = 26
_NUMERIC_NAMES = tuple(f"I{j}" for j in range(1, _NUM_NUMERIC + 1))
_CATEGORICAL_NAMES = tuple(f"C{j}" for j in range(1, _NUM_CATEGORICAL + 1))
_ZIPF_EXPONENT = 1.2
# The Criteo Kaggle (display advertising challenge) cardinalities of C1..C26: the
# synthetic columns draw Zipf ranks truncated to these vocabularies.
_VOCABULARY = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# Counts are Lomax (Pareto II): floor(scale * (u**(-1/alpha) - 1)), missing (0) at a
# Criteo-like rate per column.
_COUNT_SCALE = (2.0, 50.0, 10.0, 5.0, 5000.0, 50.0, 10.0, 10.0, 50.0, 0.5, 2.0, 0.5, 5.0)
_COUNT_ALPHA = (1.2, 1.0, 1.1, 1.5, 1.0, 1.1, 1.2, 1.5, 1.1, 2.0, 1.5, 2.0, 1.3)
_COUNT_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.76, 0.22)
_COUNT_MAX = 1e12
# The hidden model: logit = bias + sum_j NUMERIC_WEIGHT[j] * I_j
#                          + sum_c ID_SCALE[c] * g(c, id_c) + NOISE_STD * g(row),
# where g is a stable hash mapped to a zero-mean, unit-variance (triangular) value.
_NUMERIC_WEIGHT = (0.3, -0.1, 0.05, 0.2, -0.05, 0.1, 0.25, -0.1, 0.05, 0.4, 0.2, 0.15, -0.05)
_ID_SCALE = (
    0.5, 0.3, 0.4, 0.3, 0.4, 0.3, 0.35, 0.2, 0.3, 0.3, 0.3, 0.4, 0.3,
    0.3, 0.3, 0.4, 0.3, 0.3, 0.2, 0.3, 0.4, 0.3, 0.3, 0.3, 0.2, 0.3,
)  # fmt: skip
_NOISE_STD = 0.5
_POSITIVE_RATE = 0.25
_CALIBRATION_ROWS = 8192


def _keys(seed: int, purpose: str, count: int) -> NDArray[np.uint64]:
    return np.array(
        [stable_hash(f"trainer.data/synthetic/{seed}/{purpose}/{i}") for i in range(count)],
        dtype=np.uint64,
    )


def _unit53(h: NDArray[np.uint64]) -> NDArray[np.float64]:
    """Uniform in (0, 1) from the top 53 bits of a hash."""
    return ((h >> _U53).astype(np.float64) + 0.5) * 2.0**-53


def _unit32_pair(h: NDArray[np.uint64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Two independent uniforms in (0, 1) from the high and low 32 bits of a hash."""
    high = ((h >> _U32).astype(np.float64) + 0.5) * 2.0**-32
    low = ((h & _LOW32).astype(np.float64) + 0.5) * 2.0**-32
    return high, low


def _unit_normalish(h: NDArray[np.uint64]) -> NDArray[np.float64]:
    """A zero-mean, unit-variance value from a hash (a triangular distribution)."""
    a, b = _unit32_pair(h)
    return (a + b - 1.0) * math.sqrt(6.0)


@dataclass(frozen=True, slots=True)
class _RawRows:
    """Generated examples before formatting: what a Criteo file would hold."""

    counts: NDArray[np.int64]  # (n, 13), 0 where missing
    missing: NDArray[np.bool_]  # (n, 13)
    ids: NDArray[np.int64]  # (n, 26)
    labels: NDArray[np.float32]  # (n,)


class SyntheticSource(DataSource):
    """Criteo-like examples from a seeded generator with a hidden logistic model.

    Schema: numeric `I1..I13` (float32, `log1p` of heavy-tailed counts, 0 when
    missing as in Criteo), categorical `C1..C26` (int64 ids), label "label".

    * Ids: per column a Zipf(1.2)-like rank (a discretized power law truncated to
      the column's Criteo vocabulary size, from 3 to ~10M), mapped through a
      seeded bijective 64-bit mix, so ids look random and span the whole int64
      range, negative values too.
    * Labels: Bernoulli(sigmoid(logit)) with logit = bias + numeric weights +
      a hidden weight per (column, id) derived from a hash of it + noise; the
      bias is calibrated so about 25% of labels are positive. `logits(batch)`
      gives the noise-free logit, the best score a model can learn.
    * Deterministic: example r is a pure function of (seed, r) built from
      counter-based hashes (no `np.random` stream, whose values numpy only
      promises on one build), so every process, worker and batch size sees the
      same examples.
    """

    def __init__(self, num_examples: int = 100_000, *, seed: int = 0) -> None:
        if not (_is_int(num_examples) and num_examples >= 0):
            raise ValueError(f"num_examples must be a non-negative int, got {num_examples!r}")
        self._num_examples = num_examples
        self._seed = seed
        self._row_key = _keys(seed, "row", 1)[0]
        self._count_keys = _keys(seed, "count", _NUM_NUMERIC)
        self._rank_keys = _keys(seed, "rank", _NUM_CATEGORICAL)
        self._id_keys = _keys(seed, "id", _NUM_CATEGORICAL)
        self._weight_keys = _keys(seed, "weight", _NUM_CATEGORICAL)
        self._noise_key, self._label_key = _keys(seed, "label", 2)
        self._count_scale = np.array(_COUNT_SCALE)
        self._count_inv_alpha = -1.0 / np.array(_COUNT_ALPHA)
        self._count_missing = np.array(_COUNT_MISSING)
        # A power law with P(rank >= x) ~ x**-(s-1), truncated to [1, V + 1) and floored
        # to ranks 1..V: rank = floor((lo + u * (1 - lo)) ** (-1/(s-1))), lo = (V+1)**-(s-1).
        self._tail = _ZIPF_EXPONENT - 1.0
        self._vocab = np.array(_VOCABULARY, dtype=np.float64)
        self._rank_lo = (self._vocab + 1.0) ** -self._tail
        self._numeric_weight = np.array(_NUMERIC_WEIGHT)
        self._id_scale = np.array(_ID_SCALE)
        self._bias = 0.0
        self._bias = self._calibrated_bias()
        self._schema = Schema(
            categorical=dict.fromkeys(_CATEGORICAL_NAMES, "int64"),
            numeric=_NUMERIC_NAMES,
            label="label",
        )

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def num_examples(self) -> int:
        return self._num_examples

    @property
    def seed(self) -> int:
        return self._seed

    def _row_hashes(self, rows: NDArray[np.int64]) -> NDArray[np.uint64]:
        return mix64(rows.view(np.uint64) ^ self._row_key)

    def _features(
        self, h: NDArray[np.uint64]
    ) -> tuple[NDArray[np.int64], NDArray[np.bool_], NDArray[np.int64]]:
        """Counts (n, 13), missing (n, 13) and ids (n, 26) of the rows with hashes h."""
        u_count, u_missing = _unit32_pair(mix64(h[:, None] ^ self._count_keys))
        missing = u_missing < self._count_missing
        raw = self._count_scale * (u_count**self._count_inv_alpha - 1.0)
        counts = np.floor(np.minimum(raw, _COUNT_MAX)).astype(np.int64)
        counts[missing] = 0
        u_rank = _unit53(mix64(h[:, None] ^ self._rank_keys))
        ranks = np.floor((self._rank_lo + u_rank * (1.0 - self._rank_lo)) ** (-1.0 / self._tail))
        ranks = np.clip(ranks, 1.0, self._vocab).astype(np.uint64)
        ids = mix64(ranks ^ self._id_keys).view(np.int64)
        return counts, missing, ids

    def _clean_logits(
        self, numeric: NDArray[np.float32], ids: NDArray[np.int64]
    ) -> NDArray[np.float64]:
        """The hidden logit without noise from numeric (n, 13) and ids (n, 26)."""
        id_weights = _unit_normalish(mix64(ids.view(np.uint64) ^ self._weight_keys))
        logit: NDArray[np.float64] = numeric.astype(np.float64) @ self._numeric_weight
        logit += id_weights @ self._id_scale
        return logit + self._bias

    def _noise(self, h: NDArray[np.uint64]) -> NDArray[np.float64]:
        return _NOISE_STD * _unit_normalish(mix64(h ^ self._noise_key))

    def _calibrated_bias(self) -> float:
        """The bias that makes the first rows' mean probability the target positive rate."""
        h = self._row_hashes(np.arange(_CALIBRATION_ROWS, dtype=np.int64))
        counts, _, ids = self._features(h)
        logit = self._clean_logits(np.log1p(counts).astype(np.float32), ids) + self._noise(h)
        lo, hi = -30.0, 30.0
        for _ in range(60):  # bisection: deterministic, unlike a float-order-dependent solver
            mid = (lo + hi) / 2
            rate = float(np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))))
            lo, hi = (mid, hi) if rate < _POSITIVE_RATE else (lo, mid)
        return (lo + hi) / 2

    def _raw(self, rows: NDArray[np.int64]) -> _RawRows:
        h = self._row_hashes(rows)
        counts, missing, ids = self._features(h)
        logit = self._clean_logits(np.log1p(counts).astype(np.float32), ids) + self._noise(h)
        with np.errstate(over="ignore"):  # exp overflow -> inf -> probability 0, as it should
            probability = 1.0 / (1.0 + np.exp(-logit))
        labels = (_unit53(mix64(h ^ self._label_key)) < probability).astype(np.float32)
        return _RawRows(counts=counts, missing=missing, ids=ids, labels=labels)

    def _batch(self, rows: NDArray[np.int64]) -> Batch:
        raw = self._raw(rows)
        numeric = np.log1p(raw.counts).astype(np.float32).T.copy()
        ids = raw.ids.T.copy()
        features: dict[str, Feature] = dict(zip(_CATEGORICAL_NAMES, ids, strict=True))
        features.update(zip(_NUMERIC_NAMES, numeric, strict=True))
        return Batch(features, raw.labels)

    def logits(self, batch: Batch) -> NDArray[np.float32]:
        """The hidden model's noise-free logit of each example, (b,).

        Its AUC on the labels (~0.84) is the ceiling for any model; use it as a
        reference in reports. Needs every feature of this source's schema.
        """
        missing = [n for n in self._schema.feature_names if n not in batch.features]
        if missing:
            raise DataError(f"logits need every synthetic feature; the batch lacks {missing}")
        numeric = np.stack([np.asarray(batch.features[n]) for n in _NUMERIC_NAMES], axis=1)
        ids = np.stack([np.asarray(batch.features[n]) for n in _CATEGORICAL_NAMES], axis=1)
        return self._clean_logits(numeric.astype(np.float32), ids.astype(np.int64)).astype(
            np.float32
        )

    def chunks(self) -> Iterator[Batch]:
        for start in range(0, self._num_examples, _PLAN_ROWS):
            stop = min(start + _PLAN_ROWS, self._num_examples)
            yield self._batch(np.arange(start, stop, dtype=np.int64))

    def _epoch(self, plan: _Plan) -> Iterator[Batch]:
        # Examples are a pure function of their position: decide the split and the
        # batches on positions only, and generate just this worker's batches.
        def positions() -> Iterator[NDArray[np.int64]]:
            for start in range(0, self._num_examples, _PLAN_ROWS):
                rows = np.arange(start, min(start + _PLAN_ROWS, self._num_examples), dtype=np.int64)
                if plan.split != "all":
                    rows = rows[_split_index(start, len(rows), plan.split, plan.eval_fraction)]
                yield rows

        stream: Iterable[NDArray[np.int64]] = positions()
        if plan.shuffle_buffer:
            stream = _shuffled(
                stream,
                plan,
                cut=lambda rows, lo, hi: rows[lo:hi],
                concat=np.concatenate,
                take=lambda rows, i: rows[i],
            )
        pending = np.empty(0, dtype=np.int64)
        index = 0
        for rows in stream:
            pending = np.concatenate([pending, rows])
            full = len(pending) - len(pending) % plan.batch_size
            for lo in range(0, full, plan.batch_size):
                if plan.mine(index):
                    yield self._batch(pending[lo : lo + plan.batch_size])
                index += 1
            pending = pending[full:]
        if len(pending) and plan.mine(index):
            yield self._batch(pending)


_HEX_PAIRS = np.frombuffer(
    b"".join(f"{i:02x}".encode() for i in range(256)), dtype=np.uint8
).reshape(256, 2)


def _hex_ids(ids: NDArray[np.int64]) -> NDArray[np.bytes_]:
    """16 lowercase hex digits of each id's two's complement, vectorized (same shape)."""
    digits = _HEX_PAIRS[ids.astype(">i8").view(np.uint8)]  # (..., 8, 2) big-endian bytes
    return digits.reshape(*ids.shape, 16).copy().view("S16")[..., 0]


def write_synthetic_criteo(path: str | os.PathLike[str], n: int, seed: int = 0) -> Path:
    """Write the first n examples of `SyntheticSource(n, seed=seed)` as a Criteo TSV.

    Counts are written as integers (missing ones as empty fields) and ids as 16
    hex digits of their two's complement, so `CriteoSource` reads the same
    numeric features and labels back, with string ids. A path ending in ".gz"
    is gzip-compressed. Returns the path.
    """
    path = Path(path)
    source = SyntheticSource(n, seed=seed)
    gz = path.suffix == ".gz"
    with gzip.open(path, "wb", compresslevel=6) if gz else path.open("wb") as out:
        for start in range(0, n, _PLAN_ROWS):
            raw = source._raw(np.arange(start, min(start + _PLAN_ROWS, n), dtype=np.int64))
            counts = raw.counts.astype("S20")
            counts[raw.missing] = b""
            labels = raw.labels.astype(np.int8).astype("S1")[:, None]
            table = np.concatenate([labels, counts, _hex_ids(raw.ids)], axis=1)
            out.writelines(b"\t".join(row) + b"\n" for row in table.tolist())
    return path


# --------------------------------------------------------------------------- text files


def _open_text(path: Path) -> IO[str]:
    """Open a UTF-8 text file, gunzipping it if it starts with the gzip magic bytes."""
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    if gzipped:
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return path.open(encoding="utf-8-sig")


def _check_file(path: str | os.PathLike[str], kind: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{kind} file not found: {str(p)!r} (cwd {os.getcwd()!r})")
    return p


def _text_chunks(f: IO[str], *, quoted: bool) -> Iterator[str]:
    """~_CHUNK_CHARS of whole lines at a time, ending in a newline.

    With `quoted`, a chunk never ends inside a quoted field (CSV doubles quotes
    inside quoted fields, so an odd count of quote characters means we are in one).
    """
    while True:
        text = f.read(_CHUNK_CHARS)
        if not text:
            return
        if not text.endswith("\n"):
            text += f.readline()
        odd = quoted and text.count('"') % 2 == 1
        while odd:
            more = f.readline()
            if not more:
                break  # an unterminated quote: the csv parser reports it
            text += more
            odd ^= more.count('"') % 2 == 1
        if not text.endswith("\n"):
            text += "\n"
        yield text


class _Fields:
    """The fields of one text chunk, by column: a (nrows, ncols) table of str."""

    def __init__(self, columns: Callable[[int], Sequence[str]], nrows: int) -> None:
        self.column = columns
        self.nrows = nrows


def _split_text(
    text: str, *, delimiter: str, ncols: int, quoted: bool, path: Path, first_row: int
) -> _Fields:
    """Split a chunk of whole lines into fields; blank lines are skipped.

    Fast path: one `split` over the whole chunk, with a marker field at each line
    end so a line with a wrong field count can never shift fields into its
    neighbour unnoticed. Otherwise (quotes, blank or bad lines) line by line.
    """
    if not (quoted and '"' in text):
        nrows = text.count("\n")
        parts = text.replace("\n", f"{delimiter}\n{delimiter}").split(delimiter)
        parts.pop()  # the empty field after the last line's marker
        stride = ncols + 1
        if len(parts) == nrows * stride and parts[ncols::stride].count("\n") == nrows:
            return _Fields(lambda j: parts[j::stride], nrows)
    if quoted:
        reader: Iterable[list[str]] = csv.reader(
            io.StringIO(text), delimiter=delimiter, strict=True
        )
    else:
        reader = (line.split(delimiter) for line in text.split("\n"))
    rows: list[list[str]] = []
    try:
        for row in reader:
            if not row or row == [""]:
                continue
            if len(row) != ncols:
                shown = delimiter.join(row)
                raise DataError(
                    f"{path}: row {first_row + len(rows) + 1} has {len(row)} fields, "
                    f"expected {ncols}: {shown[:80]!r}"
                )
            rows.append(row)
    except csv.Error as exc:
        raise DataError(f"{path}: bad CSV after row {first_row + len(rows)}: {exc}") from exc
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in range(ncols)]
    return _Fields(lambda j: columns[j], len(rows))


def _bad_value(
    values: Sequence[str], parse: Callable[[str], object], path: Path, column: str, first_row: int
) -> DataError:
    for i, value in enumerate(values):
        try:
            parse(value)
        except (ValueError, OverflowError):
            what = f"cannot parse {value[:40]!r}" if value else "empty value"
            return DataError(f"{path}: row {first_row + i + 1}, column {column!r}: {what}")
    return DataError(f"{path}: column {column!r} near row {first_row + 1}: cannot parse")


def _parse_numbers(
    values: Sequence[str], *, path: Path, column: str, first_row: int, ints_first: bool
) -> NDArray[np.float64]:
    """Numbers as float64; empty and NaN -> NaN (missing); infinity is an error.

    `ints_first` tries int64 parsing first, ~3x faster when every value is an int.
    """
    has_empty = "" in values
    filled = [v or "0" for v in values] if has_empty else values
    out: NDArray[np.float64] | None = None
    if ints_first:
        try:
            out = np.array(filled, dtype=np.int64).astype(np.float64)
        except (ValueError, OverflowError):
            pass
    if out is None:
        try:
            out = np.array(filled, dtype=np.float64)
        except ValueError:
            raise _bad_value(filled, float, path, column, first_row) from None
    if has_empty:
        out[np.array(values, dtype=object) == ""] = np.nan
    if np.isinf(out).any():
        row = first_row + int(np.flatnonzero(np.isinf(out))[0]) + 1
        raise DataError(f"{path}: row {row}, column {column!r}: infinite value")
    return out


def _parse_labels(
    values: Sequence[str], *, path: Path, column: str, first_row: int
) -> NDArray[np.float32]:
    """Labels as float32; an empty, NaN or infinite label is an error."""
    try:
        out = np.array(values, dtype=np.int64).astype(np.float32)
    except (ValueError, OverflowError):
        try:
            out = np.array(values, dtype=np.float64).astype(np.float32)
        except ValueError:
            raise _bad_value(values, float, path, column, first_row) from None
    if not np.isfinite(out).all():
        row = first_row + int(np.flatnonzero(~np.isfinite(out))[0]) + 1
        raise DataError(f"{path}: row {row}, label column {column!r}: not a finite number")
    return out


def _string_ids(values: Sequence[str]) -> NDArray[np.object_]:
    return np.fromiter(values, dtype=object, count=len(values))


def _int_ids(
    values: Sequence[str], *, path: Path, column: str, first_row: int
) -> NDArray[np.int64]:
    try:
        return np.array(values, dtype=np.int64).reshape(len(values))
    except (ValueError, OverflowError):
        raise _bad_value(values, int, path, column, first_row) from None


def _split_ids(values: Sequence[str], sep: str) -> Ragged:
    """Split each value on `sep` into string ids; an empty value or item gives no id."""
    lists = [[p for p in v.split(sep) if p] if v else [] for v in values]
    splits = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, lists), dtype=np.int64, count=len(lists)), out=splits[1:])
    flat = list(itertools.chain.from_iterable(lists))
    return Ragged(_string_ids(flat), splits)


@dataclass(frozen=True, slots=True)
class _Column:
    """How to turn one text column into a feature (or the labels)."""

    name: str
    index: int  # position in the file's fields
    kind: Literal["label", "numeric", "log1p", "int64", "string", "multivalued"]
    sep: str = ""


class _TextSource(DataSource):
    """A delimited text file (plain or gzip) read in chunks of whole lines."""

    def __init__(
        self,
        path: Path,
        *,
        delimiter: str,
        ncols: int,
        quoted: bool,
        header: bool,
        columns: Sequence[_Column],
        schema: Schema,
    ) -> None:
        self._path = path
        self._delimiter = delimiter
        self._ncols = ncols
        self._quoted = quoted
        self._header = header
        self._columns = tuple(columns)
        self._schema = schema

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def path(self) -> Path:
        return self._path

    def chunks(self) -> Iterator[Batch]:
        first_row = 0
        try:
            with _open_text(self._path) as f:
                if self._header:
                    _read_header(f, self._delimiter, self._path)
                for text in _text_chunks(f, quoted=self._quoted):
                    fields = _split_text(
                        text,
                        delimiter=self._delimiter,
                        ncols=self._ncols,
                        quoted=self._quoted,
                        path=self._path,
                        first_row=first_row,
                    )
                    if fields.nrows:
                        yield self._convert(fields, first_row)
                    first_row += fields.nrows
        except _READ_ERRORS as exc:
            raise DataError(
                f"{self._path}: cannot read after row {first_row}: {exc} "
                "(expected UTF-8 text, plain or gzip)"
            ) from exc

    def _convert(self, fields: _Fields, first_row: int) -> Batch:
        where: dict[str, Any] = {"path": self._path, "first_row": first_row}
        features: dict[str, Feature] = {}
        labels = np.empty(0, dtype=np.float32)
        for col in self._columns:
            values = fields.column(col.index)
            if col.kind == "label":
                labels = _parse_labels(values, column=col.name, **where)
            elif col.kind in ("numeric", "log1p"):
                x = _parse_numbers(values, column=col.name, ints_first=col.kind == "log1p", **where)
                if col.kind == "log1p":
                    x = np.log1p(np.maximum(x, 0.0))  # NaN (missing) stays NaN
                features[col.name] = x.astype(np.float32)
            elif col.kind == "int64":
                features[col.name] = _int_ids(values, column=col.name, **where)
            elif col.kind == "string":
                features[col.name] = _string_ids(values)
            else:
                features[col.name] = _split_ids(values, col.sep)
        return Batch({n: features[n] for n in self._schema.feature_names}, labels)


def _read_header(f: IO[str], delimiter: str, path: Path) -> list[str]:
    line = f.readline()
    while line.count('"') % 2 == 1:  # a quoted header name with a newline in it
        more = f.readline()
        if not more:
            break
        line += more
    try:
        names = next(csv.reader([line], delimiter=delimiter, strict=True), [])
    except csv.Error as exc:
        raise DataError(f"{path}: bad CSV header: {exc}") from exc
    if not names or names == [""]:
        raise DataError(f"{path}: empty file; a CSV file needs a header row of column names")
    return names


class CriteoSource(_TextSource):
    """Criteo's display-advertising TSV: label, I1-I13, C1-C26, no header; plain or gzip.

    * Numeric `I1..I13`: integer counts, `log1p(max(x, 0))`, float32; empty is missing
      (see `CsvSource`).
    * Categorical `C1..C26`: string ids as written (hex); an empty field is the
      string id "" (a real "missing" value that gets its own row).
    * Label "label": 0 or 1.

    Raises:
        DataError: the file is missing, its first line is not 40 tab-separated
            fields, or (while reading) a row is malformed.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = _check_file(path, "criteo")
        columns = [_Column("label", 0, "label")]
        columns += [_Column(n, 1 + j, "log1p") for j, n in enumerate(_NUMERIC_NAMES)]
        columns += [_Column(n, 14 + j, "string") for j, n in enumerate(_CATEGORICAL_NAMES)]
        schema = Schema(
            categorical=dict.fromkeys(_CATEGORICAL_NAMES, "string"),
            numeric=_NUMERIC_NAMES,
            label="label",
        )
        ncols = 1 + _NUM_NUMERIC + _NUM_CATEGORICAL
        super().__init__(
            p,
            delimiter="\t",
            ncols=ncols,
            quoted=False,
            header=False,
            columns=columns,
            schema=schema,
        )
        try:
            with _open_text(p) as f:
                first = f.readline().rstrip("\n")
        except _READ_ERRORS as exc:
            raise DataError(
                f"{p}: not a readable Criteo TSV (UTF-8, plain or gzip): {exc}"
            ) from exc
        if first and first.count("\t") != ncols - 1:
            raise DataError(
                f"{p}: a Criteo line has {ncols} tab-separated fields "
                f"(label, I1-I13, C1-C26), the first line has {first.count(chr(9)) + 1}: "
                f"{first[:80]!r}"
            )
        if first.startswith("label\t"):
            raise DataError(f"{p}: Criteo files have no header; remove the first line")

    def _convert(self, fields: _Fields, first_row: int) -> Batch:
        batch = super()._convert(fields, first_row)
        bad = np.flatnonzero((batch.labels != 0) & (batch.labels != 1))
        if bad.size:
            row, value = first_row + int(bad[0]) + 1, batch.labels[bad[0]]
            raise DataError(f"{self._path}: row {row}: a Criteo label is 0 or 1, got {value}")
        return batch


def _columns_error(path: Path, problem: str, available: Sequence[str]) -> DataError:
    return DataError(f"{path}: {problem}; the file has columns: {', '.join(available)}")


def _resolve_columns(
    path: Path,
    available: Sequence[str],
    *,
    label: str | None,
    categorical: Mapping[str, IdDtype | None],
    numeric: Sequence[str],
    multivalued: Mapping[str, str],
) -> str:
    """Check that the chosen columns exist, are distinct, and include a label and a feature.

    Returns the label column.
    """
    if not label:
        raise _columns_error(path, "no label column given (--label COL)", available)
    chosen = [label, *categorical, *numeric, *multivalued]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise _columns_error(path, f"unknown columns {unknown}", available)
    if len(chosen) == 1:
        raise _columns_error(
            path, "no feature columns given (--categorical, --numeric, --multivalued)", available
        )
    repeated = sorted({n for n in chosen if chosen.count(n) > 1})
    if repeated:
        raise _columns_error(path, f"columns given more than one role: {repeated}", available)
    return label


class CsvSource(_TextSource):
    """A CSV file with a header row; plain or gzip. Only the chosen columns are read.

    * categorical: string ids as written (an empty field is the id ""), unless
      declared "int64" (`{"user": "int64"}`, CLI `--categorical user:int64`):
      then every value must be an integer. Ids are never guessed from the data,
      so a late non-integer value cannot change a column's type mid-training.
    * numeric: floats; empty or NaN is missing (NaN in `raw_batches`; `batches`
      fills it with 0.0, or with the training mean under `trainer.numeric`).
    * multivalued: name -> separator (CLI `--multivalued genres:|`, default "|"):
      each field splits into string ids; an empty field or item gives no id.
    * label: a float per row; empty is an error.

    Quoted fields (RFC 4180, also with newlines inside) are supported; a UTF-8
    BOM and CRLF line ends are fine. `columns` is the file's header.

    Raises:
        DataError: a missing file, or a missing/unknown/repeated column; the
            message lists the file's columns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        label: str | None,
        categorical: Mapping[str, IdDtype | None] | Sequence[str] = (),
        numeric: Sequence[str] = (),
        multivalued: Mapping[str, str] | Sequence[str] = (),
        delimiter: str = ",",
    ) -> None:
        p = _check_file(path, "csv")
        cat = _as_mapping(categorical, None)
        multi = _as_mapping(multivalued, "|")
        try:
            with _open_text(p) as f:
                available = _read_header(f, delimiter, p)
        except _READ_ERRORS as exc:
            raise DataError(f"{p}: not a readable CSV file (UTF-8, plain or gzip): {exc}") from exc
        duplicates = sorted({n for n in available if available.count(n) > 1})
        if duplicates:
            raise _columns_error(p, f"repeated column names {duplicates}", available)
        label = _resolve_columns(
            p, available, label=label, categorical=cat, numeric=numeric, multivalued=multi
        )
        for name, dtype in cat.items():
            if dtype not in (None, *_ID_DTYPES):
                raise DataError(f"column {name!r}: id dtype must be int64 or string, got {dtype!r}")
        index = {name: i for i, name in enumerate(available)}
        columns = [_Column(label, index[label], "label")]
        columns += [
            _Column(n, index[n], "int64" if t == "int64" else "string") for n, t in cat.items()
        ]
        columns += [_Column(n, index[n], "numeric") for n in numeric]
        columns += [_Column(n, index[n], "multivalued", sep) for n, sep in multi.items()]
        schema = Schema(
            categorical={n: "int64" if t == "int64" else "string" for n, t in cat.items()},
            numeric=tuple(numeric),
            multivalued=dict.fromkeys(multi, "string"),
            label=label,
        )
        super().__init__(
            p,
            delimiter=delimiter,
            ncols=len(available),
            quoted=True,
            header=True,
            columns=columns,
            schema=schema,
        )
        self.columns = tuple(available)


def _as_mapping(value: Mapping[str, Any] | Sequence[str], default: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        raise TypeError(f"expected a sequence of column names, got the str {value!r}")
    return dict.fromkeys(value, default)


# --------------------------------------------------------------------------- parquet


def _pyarrow() -> Any:
    """Import pyarrow (an optional dependency) or say how to install it."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as exc:
        raise DataError(
            "reading parquet needs pyarrow, which is not installed: pip install pyarrow"
        ) from exc
    return pyarrow


class ParquetSource(DataSource):
    """A parquet file, read a record batch at a time (needs pyarrow).

    `columns` is the file's column names. Types come from the file: an integer
    column gives int64 ids, a string (or
    dictionary-encoded string) column string ids; `{"col": "string"}` or
    `"int64"` casts instead. A null string id is "" (missing); a null int64 id
    is an error. Numeric columns (int, float, bool) become float32; null/NaN is
    missing (filled as for CSV). A null or NaN label is an error. A multivalued
    column is a list of ints or strings (nulls dropped), or a string column split
    on its separator (empty items dropped).

    Raises:
        DataError: pyarrow is missing, the file is missing or not parquet, or a
            column is missing, unknown or of a type that cannot serve its role;
            the message lists the file's columns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        label: str | None,
        categorical: Mapping[str, IdDtype | None] | Sequence[str] = (),
        numeric: Sequence[str] = (),
        multivalued: Mapping[str, str] | Sequence[str] = (),
        read_rows: int = 65_536,
    ) -> None:
        p = _check_file(path, "parquet")
        pa = _pyarrow()
        try:
            with pa.parquet.ParquetFile(p) as pf:
                arrow_schema = pf.schema_arrow
                self._num_examples = int(pf.metadata.num_rows)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{p}: not a readable parquet file: {exc}") from exc
        available = list(arrow_schema.names)
        cat = _as_mapping(categorical, None)
        multi = _as_mapping(multivalued, "|")
        label = _resolve_columns(
            p, available, label=label, categorical=cat, numeric=numeric, multivalued=multi
        )
        types = {name: arrow_schema.field(name).type for name in available}
        kinds = {
            "label": _is_number,
            "numeric": _is_number,
            "categorical": lambda t: _is_number(t) or _is_text(t),
        }

        def check(name: str, role: str, ok: Callable[[Any], bool]) -> None:
            if not ok(types[name]):
                raise _columns_error(
                    p, f"column {name!r} has type {types[name]}, which cannot be {role}", available
                )

        check(label, "a label", kinds["label"])
        for name in numeric:
            check(name, "numeric", kinds["numeric"])
        id_dtypes: dict[str, IdDtype] = {}
        for name, dtype in cat.items():
            check(name, "categorical ids (integer or string)", kinds["categorical"])
            if dtype not in (None, *_ID_DTYPES):
                raise DataError(f"column {name!r}: id dtype must be int64 or string, got {dtype!r}")
            id_dtypes[name] = dtype or ("string" if _is_text(types[name]) else "int64")
        multi_dtypes: dict[str, IdDtype] = {}
        for name in multi:
            t = types[name]
            if _is_list(t):
                check(name, "multivalued ids", lambda t: _is_list(t) and _is_id(t.value_type))
                multi_dtypes[name] = "string" if _is_text(t.value_type) else "int64"
            else:
                check(name, "multivalued (a list, or a string to split)", _is_text)
                multi_dtypes[name] = "string"
        self._path = p
        self._read_rows = read_rows
        self._multi_sep = multi
        self._schema = Schema(
            categorical=id_dtypes, numeric=tuple(numeric), multivalued=multi_dtypes, label=label
        )
        self.columns = tuple(available)

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def num_examples(self) -> int:
        return self._num_examples

    def chunks(self) -> Iterator[Batch]:
        pa = _pyarrow()
        wanted = [self._schema.label, *self._schema.feature_names]
        first_row = 0
        try:
            with pa.parquet.ParquetFile(self._path) as pf:
                for record_batch in pf.iter_batches(batch_size=self._read_rows, columns=wanted):
                    yield self._convert(pa, record_batch, first_row)
                    first_row += record_batch.num_rows
        except pa.ArrowException as exc:
            raise DataError(f"{self._path}: cannot read after row {first_row}: {exc}") from exc

    def _convert(self, pa: Any, record_batch: Any, first_row: int) -> Batch:
        schema = self._schema
        rows = f"{self._path}: rows {first_row + 1}-{first_row + record_batch.num_rows}"
        col = record_batch.column
        features: dict[str, Feature] = {}
        for name, dtype in schema.categorical.items():
            features[name] = _arrow_ids(pa, col(name), dtype, f"{rows}, column {name!r}")
        for name in schema.numeric:
            features[name] = _arrow_numbers(pa, col(name), f"{rows}, column {name!r}")
        for name, dtype in schema.multivalued.items():
            where = f"{rows}, column {name!r}"
            features[name] = _arrow_ragged(pa, col(name), dtype, self._multi_sep[name], where)
        labels = _arrow_numbers(pa, col(schema.label), f"{rows}, label {schema.label!r}")
        missing = np.isnan(labels)
        if missing.any():
            raise DataError(
                f"{rows}: the label column {schema.label!r} has {int(missing.sum())} "
                "null or NaN labels; every example needs a label"
            )
        return Batch(features, labels)


def _is_number(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_integer(t) or pt.is_floating(t) or pt.is_boolean(t) or pt.is_decimal(t))


def _is_text(t: Any) -> bool:
    import pyarrow.types as pt

    if pt.is_dictionary(t):
        t = t.value_type
    return bool(pt.is_string(t) or pt.is_large_string(t))


def _is_id(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_integer(t) or _is_text(t))


def _is_list(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t))


def _arrow_numbers(pa: Any, arr: Any, where: str) -> NDArray[np.float32]:
    """Numbers as float32; null and NaN -> NaN (missing); infinity is an error."""
    x = pa.compute.fill_null(pa.compute.cast(arr, pa.float64()), float("nan"))
    out = np.array(x.to_numpy(zero_copy_only=False), dtype=np.float64)
    if np.isinf(out).any():
        raise DataError(f"{where}: infinite value")
    return out.astype(np.float32)


def _arrow_ids(pa: Any, arr: Any, dtype: IdDtype, where: str) -> IdArray:
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if dtype == "string":
        if not _is_text(arr.type):
            arr = pa.compute.cast(arr, pa.string())
        arr = pa.compute.fill_null(arr, "")
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=object)
    try:
        arr = pa.compute.cast(arr, pa.int64())
    except pa.ArrowException as exc:
        raise DataError(f"{where}: not an int64 id: {exc}") from exc
    if arr.null_count:
        raise DataError(
            f"{where}: {arr.null_count} null int64 ids; declare the column as string ids "
            'to keep missing ids as ""'
        )
    return np.array(arr.to_numpy(), dtype=np.int64)


def _arrow_ragged(pa: Any, arr: Any, dtype: IdDtype, sep: str, where: str) -> Ragged:
    """A list column (null items dropped) or a string column split on `sep` (empty items
    dropped too) as a Ragged of ids."""
    pc = pa.compute
    split = not _is_list(arr.type)
    if split:
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        arr = pc.split_pattern(arr, sep)
    values = pc.list_flatten(arr)
    parents = pc.list_parent_indices(arr)
    keep = pc.is_valid(values)
    if split:
        keep = pc.and_(keep, pc.fill_null(pc.not_equal(values, ""), False))
    values, parents = values.filter(keep), parents.filter(keep)
    lengths = np.bincount(np.asarray(parents.to_numpy(), dtype=np.int64), minlength=len(arr))
    splits = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=splits[1:])
    return Ragged(_arrow_ids(pa, values, dtype, where), splits)


# --------------------------------------------------------------------------- specs

_SPEC_KINDS = "synthetic[:N], criteo:PATH, csv:PATH or parquet:PATH"


def _name_list(value: str | Iterable[str] | None) -> list[str]:
    """Column names from "A,B" or ["A", "B"]; blanks dropped."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return [item.strip() for item in items if item and item.strip()]


def _typed_names(value: str | Iterable[str] | None) -> dict[str, IdDtype | None]:
    """Categorical columns "A,B:int64" -> {"A": None, "B": "int64"}."""
    out: dict[str, IdDtype | None] = {}
    for item in _name_list(value):
        name, colon, dtype = item.rpartition(":")
        if colon and dtype in _ID_DTYPES:
            out[name] = "int64" if dtype == "int64" else "string"
        else:
            out[item] = None
    return out


def _multi_names(value: str | Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """Multivalued columns "COL[:SEP]" (SEP default "|") -> {COL: SEP}."""
    if isinstance(value, Mapping):
        return {str(k).strip(): (v or "|") for k, v in value.items()}
    out: dict[str, str] = {}
    for item in _name_list(value):
        name, _, sep = item.partition(":")
        out[name] = sep or "|"
    return out


def _fixed_schema(
    source: DataSource,
    spec: str,
    *,
    label: str | None,
    categorical: str | Iterable[str] | None,
    numeric: str | Iterable[str] | None,
    multivalued: object,
) -> DataSource:
    """Apply column options to a source with a fixed schema: a subset of its features."""
    schema = source.schema
    if label not in (None, schema.label):
        raise DataError(f"{spec}: the label is {schema.label!r}, --label {label!r} does not apply")
    if multivalued:
        raise DataError(f"{spec}: has no multivalued columns; --multivalued applies to csv/parquet")
    if categorical is None and numeric is None:
        return source
    chosen_cat = _name_list(categorical) if categorical is not None else list(schema.categorical)
    chosen_num = _name_list(numeric) if numeric is not None else list(schema.numeric)
    bad = [n for n in chosen_cat if n not in schema.categorical]
    bad += [n for n in chosen_num if n not in schema.numeric]
    if bad:
        raise DataError(
            f"{spec}: unknown columns {bad}; categorical: {', '.join(schema.categorical)}; "
            f"numeric: {', '.join(schema.numeric)}"
        )
    return source.select([*chosen_cat, *chosen_num])


def parse_data_spec(
    spec: str,
    *,
    label: str | None = None,
    categorical: str | Iterable[str] | None = None,
    numeric: str | Iterable[str] | None = None,
    multivalued: str | Iterable[str] | Mapping[str, str] | None = None,
) -> DataSource:
    """Build the source the CLI's `--data SPEC` and column options describe.

    Specs: `synthetic` or `synthetic:N` (N examples, default 100_000), `criteo:PATH`,
    `csv:PATH` (tab-separated if PATH ends in .tsv or .tsv.gz) and `parquet:PATH`.
    Column options take "A,B" or a list: `categorical` items may end in ":int64"
    or ":string"; `multivalued` items are "COL[:SEP]" (SEP default "|") or a
    {COL: SEP} mapping. For csv and parquet, `label` and at least one feature are
    required. For synthetic and criteo the schema is fixed; `categorical` or
    `numeric` choose a subset of its columns (a group left as None keeps all).

    Raises:
        DataError: an unknown kind, a missing file, or a missing/unknown column
            (the message lists the columns the file has).
    """
    kind, colon, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "synthetic":
        try:
            n = int(arg) if colon else 100_000
        except ValueError:
            raise DataError(f"synthetic:N needs a whole number N, got {arg!r}") from None
        if n < 0:
            raise DataError(f"synthetic:N needs N >= 0, got {n}")
        return _fixed_schema(
            SyntheticSource(n),
            spec,
            label=label,
            categorical=categorical,
            numeric=numeric,
            multivalued=multivalued,
        )
    if kind in ("criteo", "csv", "parquet") and not arg:
        raise DataError(f"{kind}:PATH needs a path, got {spec!r}")
    if kind == "criteo":
        return _fixed_schema(
            CriteoSource(arg),
            spec,
            label=label,
            categorical=categorical,
            numeric=numeric,
            multivalued=multivalued,
        )
    columns: dict[str, Any] = {
        "label": label,
        "categorical": _typed_names(categorical),
        "numeric": _name_list(numeric),
        "multivalued": _multi_names(multivalued),
    }
    if kind == "csv":
        tsv = arg.endswith((".tsv", ".tsv.gz"))
        return CsvSource(arg, delimiter="\t" if tsv else ",", **columns)
    if kind == "parquet":
        return ParquetSource(arg, **columns)
    raise DataError(f"unknown data spec {spec!r}; use {_SPEC_KINDS}")
