"""The batch plan of one pass: the eval split, shuffling and this worker's batches.

See the `trainer.data` docstring for the rules every source follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Literal, TypeAlias, TypeVar

import numpy as np
from numpy.typing import NDArray

from lookup_table.hashing import combine, mix64, stable_hash

Split: TypeAlias = Literal["train", "eval", "all"]

_SPLITS = ("train", "eval", "all")
_EVAL_KEY = np.uint64(stable_hash("trainer.data/eval-split"))
_SHUFFLE_KEY = stable_hash("trainer.data/shuffle")
_U53 = np.uint64(11)


def _eval_mask(rows: NDArray[np.int64], eval_fraction: float) -> NDArray[np.bool_]:
    """Which examples (0-based positions in the source) belong to the eval split."""
    h = mix64(rows.view(np.uint64) ^ _EVAL_KEY)
    return (h >> _U53).astype(np.float64) * 2.0**-53 < eval_fraction


def split_index(first_row: int, n: int, split: Split, eval_fraction: float) -> NDArray[np.intp]:
    """Positions, within a chunk of n examples starting at `first_row`, of the split's examples."""
    is_eval = _eval_mask(np.arange(first_row, first_row + n, dtype=np.int64), eval_fraction)
    return np.flatnonzero(is_eval if split == "eval" else ~is_eval)


def is_int(value: object) -> bool:
    """An int or a numpy integer, but not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPlan:
    """How one pass is cut: the split, the shuffle, the batch size and this worker's share."""

    batch_size: int
    split: Split
    eval_fraction: float
    worker_index: int
    num_workers: int
    shuffle_buffer: int = 0
    seed: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        if not (is_int(self.batch_size) and self.batch_size > 0):
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if not (is_int(self.num_workers) and self.num_workers > 0):
            raise ValueError(f"num_workers must be a positive int, got {self.num_workers!r}")
        if not (is_int(self.worker_index) and 0 <= self.worker_index < self.num_workers):
            raise ValueError(
                f"worker_index must be in [0, {self.num_workers}), got {self.worker_index!r}"
            )
        if self.split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {self.split!r}")
        if not 0.0 <= self.eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {self.eval_fraction!r}")
        if not (is_int(self.shuffle_buffer) and self.shuffle_buffer >= 0):
            raise ValueError(
                f"shuffle_buffer must be a non-negative int (0: no shuffling), "
                f"got {self.shuffle_buffer!r}"
            )
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def mine(self, batch_index: int) -> bool:
        return batch_index % self.num_workers == self.worker_index


_T = TypeVar("_T", bound=Sized)  # a Batch or an array of positions


def _shuffle_order(n: int, key: int) -> NDArray[np.intp]:
    """A permutation of range(n), a pure function of (n, key): the same on every machine."""
    salt = int(combine(np.array([key], dtype=np.uint64), _SHUFFLE_KEY)[0])
    return np.argsort(combine(np.arange(n, dtype=np.uint64), salt), kind="stable")


def shuffled(
    items: Iterable[_T],
    plan: BatchPlan,
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
