"""Row-wise Adagrad: one float32 accumulator per row (FBGEMM's EXACT_ROWWISE_ADAGRAD).

    G  += mean(g**2 over the row)
    w  -= g * (lr / (sqrt(G) + epsilon))

FBGEMM's formula and conventions, float32 operation for float32 operation as its CPU
kernel (no weight decay): G starts at 0 (`initial_accumulator_value`), epsilon goes
after the sqrt (Keras' Adagrad puts it inside), the mean sums the squares in column
order. One float of state a row instead of `dim`: every coordinate of a row shares one
adaptive rate, which suits embedding rows (their coordinates see the same ids). The
per-element work is compiled (`lookup_table.core.jit`), the same float32 operations in
the same order as the formula's numpy expression.
"""

# formula: pytorch/FBGEMM fbgemm_gpu/codegen/genscript/optimizers.py, rowwise_adagrad()

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import njit, types
from numpy.typing import NDArray

from lookup_table.core.jit import A2, C1, C2, PREFETCH_AHEAD, RC2, compiled, prefetch_row
from lookup_table.core.optimizers.base import (
    Float32Array,
    StoredSlot,
    step,
    update_at_args,
)

if TYPE_CHECKING:  # the runtime imports stay numpy + stdlib
    from lookup_table.config import RowwiseAdagradConfig

__all__ = ["RowwiseAdagrad", "mean_square"]

_F32 = np.float32
_AT = types.Array(types.intp, 1, "C")  # `update_at`'s positions (the caller's array)


@njit(inline="always")
def row_mean_square(g):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """(g[0]**2 + g[1]**2 + ...) / dim of one row, added in column order in float32:
    FBGEMM's CPU loop, and the same bits on every CPU (no reordering without fastmath)."""
    acc = np.float32(0)
    for j in range(g.shape[0]):
        acc += g[j] * g[j]
    return acc / np.float32(g.shape[0])


@compiled([types.void(layout, C1) for layout in (C2, RC2, A2)])
def _mean_square(grads, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out[i] = row i's mean of g**2 (`row_mean_square`)."""
    for i in range(grads.shape[0]):
        out[i] = row_mean_square(grads[i])


@compiled(
    [
        types.void(layout, layout, layout, types.float32, types.float32, C2)
        for layout in (C2, RC2, A2)
    ]
)
def _moved(weights, grads, new_slots, learning_rate, epsilon, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """w - g * (lr / (sqrt(G) + epsilon)), the multiplier once a row, float32 in order."""
    for i in range(weights.shape[0]):
        multiplier = learning_rate / (np.sqrt(new_slots[i, 0]) + epsilon)
        w = weights[i]
        g = grads[i]
        o = out[i]
        for j in range(w.shape[0]):
            o[j] = w[j] - g[j] * multiplier


@compiled(
    [
        types.void(C2, _AT, C2, grads, types.float32, types.float32, C2, C2)
        for grads in (C2, RC2, A2)
    ]
)
def _stepped_at(values, at, extra, grads, learning_rate, epsilon, rows, items):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`next_slots` then `finish` on items (a row, G) read where they are: `values[at[i]]`,
    or `extra[-1 - at[i]]` where at[i] < 0; the same float32 operations in the same order,
    one pass. The new items go to `items`, the new rows also to `rows`."""
    dim = grads.shape[1]
    n = at.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n and at[i + PREFETCH_AHEAD] >= 0:
            prefetch_row(values, at[i + PREFETCH_AHEAD])
        p = at[i]
        src = values[p] if p >= 0 else extra[-1 - p]
        g = grads[i]
        accumulator = src[dim] + row_mean_square(g)
        multiplier = learning_rate / (np.sqrt(accumulator) + epsilon)
        w = src[:dim]
        r = rows[i]
        out = items[i]
        for j in range(dim):
            r[j] = w[j] - g[j] * multiplier
        for j in range(dim):
            out[j] = r[j]
        out[dim] = accumulator


def mean_square(grads: Float32Array) -> Float32Array:
    """Each row's mean of g**2, float32 (n,), its squares added in column order."""
    if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.ndim != 2:
        raise ValueError(f"grads: expected a float32 array of shape (n, dim), got {grads!r:.80}")
    if grads.shape[1] == 0:
        raise ValueError("grads: rows of dim 0 have no mean")
    out = np.empty(grads.shape[0], dtype=np.float32)
    _mean_square(grads, out)
    return out


@dataclass(frozen=True, slots=True)
class RowwiseAdagrad:
    """Row-wise Adagrad on rows; slots per row: accumulator (1)."""

    config: RowwiseAdagradConfig

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("accumulator",)

    def slot_width(self, dim: int) -> int:
        return 1

    def slot_storage(self, dim: int) -> tuple[StoredSlot, ...]:
        return (StoredSlot("accumulator", 1),)

    def initial_slots(self, n: int, dim: int) -> Float32Array:
        """Every accumulator at float32(initial_accumulator_value) (FBGEMM: 0)."""
        return np.full((n, 1), _F32(self.config.initial_accumulator_value), dtype=np.float32)

    def next_slots(self, grads: Float32Array, slots: Float32Array) -> Float32Array:
        """The accumulator plus the row's mean of `g**2`."""
        if slots.shape != (grads.shape[0], 1):
            raise ValueError(f"slots {slots.shape} do not fit grads {grads.shape}")
        return slots + mean_square(grads)[:, None]

    def finish(
        self, weights: Float32Array, grads: Float32Array, new_slots: Float32Array
    ) -> Float32Array:
        """The rows moved by `g * lr / (sqrt(G) + epsilon)`, one multiplier a row."""
        c = self.config
        if new_slots.shape != (weights.shape[0], 1):
            raise ValueError(f"slots {new_slots.shape} do not fit rows {weights.shape}")
        out = np.empty(weights.shape, dtype=np.float32)
        _moved(weights, grads, new_slots, _F32(c.learning_rate), _F32(c.epsilon), out)
        return out

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One row-wise Adagrad step on rows (see module docstring)."""
        return step(self, weights, grads, slots)

    def update_at(
        self,
        values: Float32Array,
        at: NDArray[np.intp],
        extra: Float32Array,
        grads: Float32Array,
    ) -> tuple[Float32Array, Float32Array]:
        """`update` of items read where they are (`Optimizer.update_at`): one compiled pass
        from the items to the new ones, the same bits."""
        c = self.config
        dim, values, at, extra, rows, items = update_at_args(
            values, at, extra, grads, self.slot_width
        )
        learning_rate, epsilon = _F32(c.learning_rate), _F32(c.epsilon)
        _stepped_at(values, at, extra, grads, learning_rate, epsilon, rows, items)
        return rows, items
