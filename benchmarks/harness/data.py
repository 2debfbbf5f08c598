"""The data the benchmarks measure with: the demo's training shape and its synthetic
batches, and random int64 ids."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

# The demo's training shape (deploy/demo.toml, deploy/demo.sh), as the train, keras_fit and
# scaling benchmarks run it: the `mlp` model, batch 1024, SyntheticSource (seed 0) with 20%
# held out.
MODEL = "mlp"
HIDDEN = (256, 128)
BATCH_SIZE = 1024
EVAL_FRACTION = 0.2
DATA_SEED = 0
MODEL_SEED = 0
# the random ids, rows and gradients of the store, optimizer, checkpoint, sizing and
# segment_sum benchmarks
SEED = 20240611


def demo_batches(
    steps: int, batch_size: int, eval_batches: int = 0
) -> tuple[Any, list[Any], list[Any]]:
    """The source, `steps` full train batches and `eval_batches` held-out batches.

    Every process that calls this with the same arguments gets the same batches
    (SyntheticSource is a pure function of (seed, row)).
    """
    from trainer.data import SyntheticSource

    # 10% headroom so no batch is an epoch's short last one
    need_train = (steps + 1) * batch_size / (1 - EVAL_FRACTION)
    need_eval = (eval_batches + 1) * batch_size / EVAL_FRACTION
    source = SyntheticSource(int(math.ceil(max(need_train, need_eval) * 1.1)), seed=DATA_SEED)
    train = list(
        itertools.islice(
            source.batches(batch_size, split="train", eval_fraction=EVAL_FRACTION), steps
        )
    )
    evals = list(
        itertools.islice(
            source.batches(batch_size, split="eval", eval_fraction=EVAL_FRACTION), eval_batches
        )
    )
    short = [len(b.labels) for b in train + evals if len(b.labels) != batch_size]
    if len(train) != steps or len(evals) != eval_batches or short:
        raise RuntimeError(
            f"wanted {steps} train and {eval_batches} eval batches of {batch_size}, got "
            f"{len(train)} and {len(evals)} (short batches: {short})"
        )
    return source, train, evals


def first_batches(count: int, batch_size: int) -> list[Any]:
    """The first `count` batches of the demo's data, no split (`SyntheticSource`'s
    default seed)."""
    from trainer.data.synthetic import SyntheticSource

    source = SyntheticSource(max(1_000_000, count * batch_size))
    return list(itertools.islice(source.batches(batch_size), count))


def unique_id_blocks(rng: np.random.Generator, blocks: int, n: int) -> list[NDArray[np.int64]]:
    """`blocks` disjoint arrays of n unique random int64 ids (the full int64 range)."""
    total = blocks * n
    while True:
        ids = rng.integers(
            np.iinfo(np.int64).min,
            np.iinfo(np.int64).max,
            size=total,
            dtype=np.int64,
            endpoint=True,
        )
        if np.unique(ids).shape[0] == total:
            return [ids[b * n : (b + 1) * n].copy() for b in range(blocks)]


def spread_ids(rng: np.random.Generator, n: int) -> NDArray[np.int64]:
    """n unique random int64 ids over the whole int64 range, in random order."""
    ids = np.empty(0, dtype=np.int64)
    while ids.shape[0] < n:
        more = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=n)
        ids = np.unique(np.concatenate([ids, more]))
    out: NDArray[np.int64] = rng.permutation(ids)[:n]
    return out
