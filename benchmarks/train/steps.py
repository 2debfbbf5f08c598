"""The data both sides train on and the timed window of steps."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.harness.rounds import step_window
from trainer.data import Batch


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
