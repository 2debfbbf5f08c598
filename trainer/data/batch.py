"""Minibatches: `Ragged` ids, `Batch`, `Schema`, and slicing, gathering and rebatching them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.keys import IdArray

IdDtype: TypeAlias = Literal["int64", "string"]
Feature: TypeAlias = "NDArray[np.int64] | NDArray[np.object_] | NDArray[np.float32] | Ragged"

ID_DTYPES = ("int64", "string")


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
            bad = {name: dtype for name, dtype in group.items() if dtype not in ID_DTYPES}
            if bad:
                raise ValueError(f"id dtypes must be one of {ID_DTYPES}, got {bad}")
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


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    features = {k: _slice_feature(v, start, stop) for k, v in batch.features.items()}
    return Batch(features, batch.labels[start:stop])


def take_batch(batch: Batch, index: NDArray[np.intp]) -> Batch:
    features = {k: _take_feature(v, index) for k, v in batch.features.items()}
    return Batch(features, batch.labels[index])


def concat_batches(batches: Sequence[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    names = batches[0].features
    features = {k: _concat_feature([b.features[k] for b in batches]) for k in names}
    return Batch(features, np.concatenate([b.labels for b in batches]))


def rebatch(chunks: Iterable[Batch], batch_size: int) -> Iterator[Batch]:
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
            yield concat_batches([*pending, slice_batch(chunk, 0, need)])
            pending, count, start = [], 0, need
        while n - start >= batch_size:
            yield slice_batch(chunk, start, start + batch_size)
            start += batch_size
        if start < n:
            pending, count = [slice_batch(chunk, start, n)], n - start
    if count:
        yield concat_batches(pending)
