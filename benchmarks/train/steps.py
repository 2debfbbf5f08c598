"""The data both sides train on and the timed window of steps."""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.harness.cpu import cpu_snapshot, cpu_usage
from benchmarks.harness.rounds import step_window
from trainer.data import Batch
from trainer.metrics import auc, logloss


def data_digest(batches: Sequence[Batch]) -> str:
    """sha256 of every feature and label of `batches`: proves both sides saw the same data."""
    h = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch.features):
            h.update(name.encode())
            h.update(np.ascontiguousarray(batch.features[name]).tobytes())
        h.update(batch.labels.tobytes())
    return h.hexdigest()[:16]


def timing(
    ends: Sequence[float], window_end: float, warmup: int, batch_size: int
) -> dict[str, Any]:
    """examples/s over steps warmup+1..N: from the end of step `warmup` to `window_end`."""
    step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(ends[warmup - 1 :])]
    return {
        **step_window(ends, window_end, warmup, batch_size),
        "step_ms_p90": float(np.percentile(step_ms, 90)),
        "warmup_ms": [(b - a) * 1e3 for a, b in itertools.pairwise(ends[:warmup])],
    }


def stacked_columns(
    batch: Batch, columns: Sequence[str], numeric: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """A batch as a locally trained method takes it: its ids (batch, columns) int64 and its
    numbers (batch, numeric) float32, each one array (one tensor a step, not one a column)."""
    ids = np.stack([np.asarray(batch.features[c]) for c in columns], axis=1)
    numbers = np.stack([np.asarray(batch.features[c]) for c in numeric], axis=1)
    return ids.astype(np.int64, copy=False), numbers.astype(np.float32, copy=False)


@dataclass(frozen=True)
class LocalRound:
    """What a method trained in this process gets: the same batches, model shape and
    initial dense weights as the cluster's round."""

    train: Sequence[Batch]
    evals: Sequence[Batch]
    schema: Any
    dims: Mapping[str, int]
    warmup: int
    initial_dense: Sequence[np.ndarray]
    seed: int = 0  # the local tables' initial rows (`build_local_model`)


def run_in_process(
    method: str,
    step: Callable[[Any, Any], Any],
    predict: Callable[[Any], Any],
    tensors: Callable[[Batch], Any],
    r: LocalRound,
    *,
    labels: Callable[[np.ndarray], Any] | None = None,
) -> dict[str, Any]:
    """Time `step` over `train` in this process (CPU from step `warmup` on), then evaluate
    `predict` on `evals`: one round of a method that trains locally. `tensors` and `labels`
    turn a batch into the framework's inputs (`labels` default: `tf.constant`)."""
    if labels is None:
        import tensorflow as tf

        labels = tf.constant
    train, evals, warmup = r.train, r.evals, r.warmup
    pids = {method: os.getpid()}
    ends: list[float] = []
    losses: list[float] = []
    cpu_start: dict[str, Any] | None = None
    for batch in train:
        loss = float(step(tensors(batch), labels(batch.labels)))
        ends.append(time.perf_counter())
        losses.append(loss)
        if len(ends) == warmup:
            cpu_start = cpu_snapshot(pids)
    cpu_end = cpu_snapshot(pids)
    if cpu_start is None:
        raise RuntimeError(f"--warmup {warmup} needs more than {len(train)} steps")
    preds = np.concatenate([np.asarray(predict(tensors(b))).reshape(-1) for b in evals])
    truth = np.concatenate([b.labels for b in evals])
    return {
        "method": method,
        "steps": len(train),
        **timing(ends, ends[-1], warmup, len(train[0].labels)),
        "losses": losses,
        "eval_auc": auc(truth, preds),
        "eval_logloss": logloss(truth, preds),
        "eval_examples": int(truth.shape[0]),
        "cpu": cpu_usage(cpu_start, cpu_end, len(train) - warmup),
    }
