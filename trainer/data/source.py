"""`DataSource`, the base of every reader, and its feature-selecting and transforming views."""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import Protocol, cast

import numpy as np
from numpy.typing import NDArray

from trainer.data.batch import Batch, Schema, concat_batches, rebatch, slice_batch, take_batch
from trainer.data.errors import DataError
from trainer.data.plan import BatchPlan, Split, is_int, shuffled, split_index


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


class DataSource(abc.ABC):
    """A stream of examples with a fixed schema.

    Implement `schema` and `chunks`; `batches` does splitting, batching and
    sharding the same way for every source (see the `trainer.data` docstring).
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
        plan = BatchPlan(
            batch_size=batch_size,
            split=split,
            eval_fraction=eval_fraction,
            worker_index=worker_index,
            num_workers=num_workers,
            shuffle_buffer=shuffle_buffer,
            seed=seed,
        )
        if epochs is not None and not (is_int(epochs) and epochs >= 0):
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
        plan = BatchPlan(
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

    def _epoch(self, plan: BatchPlan) -> Iterator[Batch]:
        """One pass: the split's batches that belong to this worker."""

        def split_chunks() -> Iterator[Batch]:
            first_row = 0
            for chunk in self.chunks():
                n = len(chunk)
                if plan.split != "all":
                    chunk = take_batch(
                        chunk, split_index(first_row, n, plan.split, plan.eval_fraction)
                    )
                first_row += n
                yield chunk

        stream: Iterable[Batch] = split_chunks()
        if plan.shuffle_buffer:
            stream = shuffled(stream, plan, cut=slice_batch, concat=concat_batches, take=take_batch)
        for index, batch in enumerate(rebatch(stream, plan.batch_size)):
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

    def _epoch(self, plan: BatchPlan) -> Iterator[Batch]:
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

    def _epoch(self, plan: BatchPlan) -> Iterator[Batch]:
        return self._inner._epoch(plan)

    def _prepare(self, batch: Batch) -> Batch:
        return self._transform.apply(batch)
