"""Row-wise Adagrad: one float32 accumulator per row (FBGEMM's EXACT_ROWWISE_ADAGRAD).

    G  += mean(g**2 over the row)
    w  -= g * (lr / (sqrt(G) + epsilon))

FBGEMM's formula and conventions, float32 operation for float32 operation as its CPU
kernel (no weight decay): G starts at 0 (`initial_accumulator_value`), epsilon goes
after the sqrt (Keras' Adagrad puts it inside), the mean sums the squares in column
order. One float of state a row instead of `dim`: every coordinate of a row shares one
adaptive rate, which suits embedding rows (their coordinates see the same ids).
"""

# formula: pytorch/FBGEMM fbgemm_gpu/codegen/genscript/optimizers.py, rowwise_adagrad()

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import types

from lookup_table.core.jit import A2, C1, C2, RC2, compiled
from lookup_table.core.optimizers.base import Float32Array, GatheredUpdateAt, StoredSlot, step

if TYPE_CHECKING:  # the runtime imports stay numpy + stdlib
    from lookup_table.config import RowwiseAdagradConfig

__all__ = ["RowwiseAdagrad", "mean_square"]

_F32 = np.float32


@compiled([types.void(layout, C1) for layout in (C2, RC2, A2)])
def _mean_square(grads, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out[i] = (g[i,0]**2 + g[i,1]**2 + ...) / dim, added in column order in float32:
    FBGEMM's CPU loop, and the same bits on every CPU (no reordering without fastmath)."""
    dim = grads.shape[1]
    d = np.float32(dim)
    for i in range(grads.shape[0]):
        g = grads[i]
        acc = np.float32(0)
        for j in range(dim):
            acc += g[j] * g[j]
        out[i] = acc / d


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
class RowwiseAdagrad(GatheredUpdateAt):
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
        multiplier = _F32(c.learning_rate) / (np.sqrt(new_slots) + _F32(c.epsilon))
        return weights - grads * multiplier

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One row-wise Adagrad step on rows (see module docstring)."""
        return step(self, weights, grads, slots)
