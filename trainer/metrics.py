"""Evaluation metrics on numpy arrays (pure): ROC AUC and log loss."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["auc", "logloss"]


def auc(labels: NDArray[np.floating], scores: NDArray[np.floating]) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney U) formula, ties getting average ranks.

    Returns NaN when only one class is present.
    """
    y = np.asarray(labels, dtype=np.float64).reshape(-1) > 0.5
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    n_pos = int(y.sum())
    n_neg = y.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty(s.shape[0], dtype=np.float64)
    # average ranks over ties
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.shape[0]]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels: NDArray[np.floating], probs: NDArray[np.floating], eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities, clipped to [eps, 1-eps] like Keras."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
