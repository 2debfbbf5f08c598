"""Numeric features as a model wants them: statistics of the training rows, applied everywhere.

`NumericStats` is what a Keras `Normalization` layer adapted on the training rows holds,
computed once by `fit_numeric_stats` (one pass, float64, a pure function of the training
split) and applied to every batch of every worker (`DataSource.with_numeric`), so all of
them read the same features. Transforms `standardize`, `log1p`, `none`; missing values
and constant columns: docs/training.md#the-command-line-lookup-table-train.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np
from numpy.typing import NDArray

from trainer.data import Batch, DataError, DataSource, Split

__all__ = ["TRANSFORMS", "NumericStats", "fit_numeric_stats"]

logger = logging.getLogger(__name__)

Transform: TypeAlias = Literal["standardize", "log1p", "none"]
TRANSFORMS: tuple[Transform, ...] = ("standardize", "log1p", "none")
_FORMAT = "lookup-table/numeric-stats/1"
_READ_ROWS = 1 << 16  # examples per batch of the statistics pass


def _signed_log1p(x: NDArray[np.float64]) -> NDArray[np.float64]:
    out: NDArray[np.float64] = np.sign(x) * np.log1p(np.abs(x))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class NumericStats:
    """Per numeric column: the training rows' mean and variance, after `transform`.

    Args:
        transform: "standardize", "log1p" or "none".
        columns: the numeric columns, in schema order.
        mean: per column, float64 (0.0 for a column with no value).
        variance: per column, population variance (0.0: constant, enters as 0).
        count: per column, the training rows that had a value.
        rows: training rows read.
    """

    transform: Transform
    columns: tuple[str, ...]
    mean: tuple[float, ...]
    variance: tuple[float, ...]
    count: tuple[int, ...]
    rows: int

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(
                f"numeric transform must be one of {', '.join(TRANSFORMS)}, got {self.transform!r}"
            )
        k = len(self.columns)
        lengths = {len(self.mean), len(self.variance), len(self.count)}
        if lengths != {k}:
            raise ValueError(f"numeric stats need {k} means, variances and counts, got {lengths}")
        values = [*self.mean, *self.variance]
        if not all(math.isfinite(v) for v in values) or any(v < 0 for v in self.variance):
            raise ValueError("numeric stats must be finite with non-negative variances")

    def apply(self, batch: Batch) -> Batch:
        """`batch` with its numeric columns transformed (float32); the rest untouched.

        Raises:
            DataError: the batch lacks one of `columns`.
        """
        missing = [c for c in self.columns if c not in batch.features]
        if missing:
            raise DataError(
                f"the numeric statistics are for columns {list(self.columns)}; "
                f"the data lacks {missing}"
            )
        features = dict(batch.features)
        for j, name in enumerate(self.columns):
            x = np.asarray(features[name], dtype=np.float64)
            if self.transform == "none":
                out = np.nan_to_num(x, nan=0.0)
            else:
                if self.transform == "log1p":
                    x = _signed_log1p(x)
                var = self.variance[j]
                scale = 1.0 / math.sqrt(var) if var > 0 else 0.0
                out = (x - self.mean[j]) * scale
                out[np.isnan(out)] = 0.0  # missing -> the training mean
            features[name] = out.astype(np.float32)
        return Batch(features, batch.labels)

    def keras_transform(self, x: Any, column: str) -> Any:
        """`apply` for one column as Keras ops on a float32 tensor (the model's own layer).

        What a saved model runs on raw inputs: the same transform in float64, then
        float32, built only of Keras' serializable ops (a `.keras` file and a
        SavedModel keep it without this project).

        Raises:
            DataError: `column` is not one of `columns`.
        """
        from keras import ops

        if column not in self.columns:
            raise DataError(f"no numeric statistics for column {column!r}: {list(self.columns)}")
        j = self.columns.index(column)
        v = ops.cast(x, "float64")
        if self.transform != "none":
            if self.transform == "log1p":
                v = ops.sign(v) * ops.log1p(ops.abs(v))
            var = self.variance[j]
            scale = 1.0 / math.sqrt(var) if var > 0 else 0.0
            v = (v - self.mean[j]) * scale
        v = ops.where(ops.isnan(v), ops.zeros_like(v), v)  # missing -> the training mean
        return ops.cast(v, "float32")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: {"format", "transform", "rows", "columns": {name: {...}}}."""
        return {
            "format": _FORMAT,
            "transform": self.transform,
            "rows": self.rows,
            "columns": {
                name: {"mean": m, "variance": v, "count": c}
                for name, m, v, c in zip(
                    self.columns, self.mean, self.variance, self.count, strict=True
                )
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NumericStats:
        """Inverse of `to_dict`.

        Raises:
            DataError: not numeric statistics of this format.
        """
        try:
            if data.get("format") != _FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {_FORMAT!r}")
            cols = data["columns"]
            return cls(
                transform=data["transform"],
                columns=tuple(cols),
                mean=tuple(float(c["mean"]) for c in cols.values()),
                variance=tuple(float(c["variance"]) for c in cols.values()),
                count=tuple(int(c["count"]) for c in cols.values()),
                rows=int(data["rows"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataError(f"not valid numeric statistics: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON atomically (workers may write the same file at once)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NumericStats:
        """Read statistics written by `save`.

        Raises:
            DataError: unreadable or not numeric statistics (naming the file).
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text())
            if not isinstance(data, dict):
                raise DataError("not a JSON object")
            return cls.from_dict(data)
        except (OSError, json.JSONDecodeError, DataError) as exc:
            raise DataError(f"{p}: cannot read numeric statistics: {exc}") from exc

    def check_columns(self, columns: tuple[str, ...], what: str) -> None:
        """Raise DataError unless `columns` are exactly the columns these stats are for."""
        if columns != self.columns:
            raise DataError(
                f"{what}: the numeric statistics are for columns {list(self.columns)} "
                f"(transform {self.transform}), the data has {list(columns)}; "
                "compute them again (remove the file) or pass the same --numeric columns"
            )


def fit_numeric_stats(
    source: DataSource,
    transform: Transform = "standardize",
    *,
    split: Split = "train",
    eval_fraction: float = 0.2,
    max_rows: int | None = None,
    progress: bool = False,
) -> NumericStats:
    """Compute the numeric statistics of a source's training split in one streaming pass.

    Args:
        source: any DataSource; only its numeric columns are used.
        transform: "standardize", "log1p" or "none" (no pass is made for "none").
        split: the rows the statistics come from: "train" (with `eval_fraction`)
            or "all" (when evaluation has a file of its own).
        max_rows: stop after this many rows (the first ones, in source order).
        progress: show a tqdm bar (rows read).
    """
    if transform not in TRANSFORMS:
        raise ValueError(
            f"numeric transform must be one of {', '.join(TRANSFORMS)}, got {transform!r}"
        )
    columns = source.schema.numeric
    k = len(columns)
    zeros = (0.0,) * k
    if transform == "none" or k == 0:
        return NumericStats(
            transform=transform, columns=columns, mean=zeros, variance=zeros, count=(0,) * k, rows=0
        )
    from tqdm import tqdm

    total = source.num_examples
    if max_rows is not None:
        total = max_rows if total is None else min(total, max_rows)
    n = np.zeros(k, dtype=np.int64)
    mean = np.zeros(k)
    m2 = np.zeros(k)
    rows = 0
    with tqdm(total=total, disable=not progress, unit="ex", desc="numeric statistics") as bar:
        for batch in source.raw_batches(_READ_ROWS, split=split, eval_fraction=eval_fraction):
            if max_rows is not None and rows + len(batch) > max_rows:
                keep = max_rows - rows
                head = {c: np.asarray(batch.features[c])[:keep] for c in columns}
                batch = Batch(dict(head), batch.labels[:keep])
            x = np.stack([np.asarray(batch.features[c], dtype=np.float64) for c in columns], 1)
            if transform == "log1p":
                x = _signed_log1p(x)
            seen = ~np.isnan(x)
            n_b = seen.sum(axis=0)
            x = np.where(seen, x, 0.0)
            mean_b = x.sum(axis=0) / np.maximum(n_b, 1)
            m2_b = (np.where(seen, x - mean_b, 0.0) ** 2).sum(axis=0)
            # Chan et al.'s pairwise merge of (count, mean, M2): exact in any batch split
            total_n = n + n_b
            delta = mean_b - mean
            share = np.divide(n_b, total_n, out=np.zeros(k), where=total_n > 0)
            mean += delta * share
            m2 += m2_b + delta**2 * n * share
            n = total_n
            rows += len(batch)
            bar.update(len(batch))
            if max_rows is not None and rows >= max_rows:
                break
    variance = np.divide(m2, n, out=np.zeros(k), where=n > 0)
    stats = NumericStats(
        transform=transform,
        columns=columns,
        mean=tuple(float(v) for v in mean),
        variance=tuple(float(v) for v in variance),
        count=tuple(int(v) for v in n),
        rows=rows,
    )
    if rows == 0:
        raise DataError("no training rows to compute numeric statistics from (empty data?)")
    for name, var, count in zip(columns, stats.variance, stats.count, strict=True):
        if count == 0:
            logger.warning(
                "numeric column %r has no value in the training rows: it enters as 0", name
            )
        elif var == 0:
            logger.warning(
                "numeric column %r is constant in the training rows: it carries no "
                "information and enters as 0",
                name,
            )
    return stats
