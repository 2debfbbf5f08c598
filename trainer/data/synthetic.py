"""`SyntheticSource`, a seeded Criteo-like generator, and `write_synthetic_criteo`."""

from __future__ import annotations

import gzip
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from lookup_table.hashing import mix64, stable_hash
from trainer.data.batch import Batch, Feature, Schema
from trainer.data.criteo import CATEGORICAL_NAMES, NUM_CATEGORICAL, NUM_NUMERIC, NUMERIC_NAMES
from trainer.data.errors import DataError
from trainer.data.plan import BatchPlan, is_int, shuffled, split_index
from trainer.data.source import DataSource

_PLAN_ROWS = 1 << 16  # synthetic rows whose split is decided at a time
_U53 = np.uint64(11)
_U32 = np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
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
        if not (is_int(num_examples) and num_examples >= 0):
            raise ValueError(f"num_examples must be a non-negative int, got {num_examples!r}")
        self._num_examples = num_examples
        self._seed = seed
        self._row_key = _keys(seed, "row", 1)[0]
        self._count_keys = _keys(seed, "count", NUM_NUMERIC)
        self._rank_keys = _keys(seed, "rank", NUM_CATEGORICAL)
        self._id_keys = _keys(seed, "id", NUM_CATEGORICAL)
        self._weight_keys = _keys(seed, "weight", NUM_CATEGORICAL)
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
            categorical=dict.fromkeys(CATEGORICAL_NAMES, "int64"),
            numeric=NUMERIC_NAMES,
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
        features: dict[str, Feature] = dict(zip(CATEGORICAL_NAMES, ids, strict=True))
        features.update(zip(NUMERIC_NAMES, numeric, strict=True))
        return Batch(features, raw.labels)

    def logits(self, batch: Batch) -> NDArray[np.float32]:
        """The hidden model's noise-free logit of each example, (b,).

        Its AUC on the labels (~0.84) is the ceiling for any model; use it as a
        reference in reports. Needs every feature of this source's schema.
        """
        missing = [n for n in self._schema.feature_names if n not in batch.features]
        if missing:
            raise DataError(f"logits need every synthetic feature; the batch lacks {missing}")
        numeric = np.stack([np.asarray(batch.features[n]) for n in NUMERIC_NAMES], axis=1)
        ids = np.stack([np.asarray(batch.features[n]) for n in CATEGORICAL_NAMES], axis=1)
        return self._clean_logits(numeric.astype(np.float32), ids.astype(np.int64)).astype(
            np.float32
        )

    def chunks(self) -> Iterator[Batch]:
        for start in range(0, self._num_examples, _PLAN_ROWS):
            stop = min(start + _PLAN_ROWS, self._num_examples)
            yield self._batch(np.arange(start, stop, dtype=np.int64))

    def _epoch(self, plan: BatchPlan) -> Iterator[Batch]:
        # Examples are a pure function of their position: decide the split and the
        # batches on positions only, and generate just this worker's batches.
        def positions() -> Iterator[NDArray[np.int64]]:
            for start in range(0, self._num_examples, _PLAN_ROWS):
                rows = np.arange(start, min(start + _PLAN_ROWS, self._num_examples), dtype=np.int64)
                if plan.split != "all":
                    rows = rows[split_index(start, len(rows), plan.split, plan.eval_fraction)]
                yield rows

        stream: Iterable[NDArray[np.int64]] = positions()
        if plan.shuffle_buffer:
            stream = shuffled(
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
