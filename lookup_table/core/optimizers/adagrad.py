"""Adagrad (Duchi, Hazan & Singer, 2011): Keras 3's `Adagrad.update_step` op for op in
float32, epsilon inside the sqrt, the accumulator from 0.1 (docs/optimizers.md#adagrad).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lookup_table.core.optimizers.base import Float32Array, GatheredUpdateAt, StoredSlot, step

if TYPE_CHECKING:  # the runtime imports stay numpy + stdlib
    from lookup_table.config import AdagradConfig

__all__ = ["Adagrad"]

_F32 = np.float32


@dataclass(frozen=True, slots=True)
class Adagrad(GatheredUpdateAt):
    """Adagrad on rows; slots per row: accumulator (dim)."""

    config: AdagradConfig

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("accumulator",)

    def slot_width(self, dim: int) -> int:
        return dim

    def slot_storage(self, dim: int) -> tuple[StoredSlot, ...]:
        return (StoredSlot("accumulator", dim),)

    def initial_slots(self, n: int, dim: int) -> Float32Array:
        """Every accumulator at float32(initial_accumulator_value)."""
        return np.full((n, dim), _F32(self.config.initial_accumulator_value), dtype=np.float32)

    def next_slots(self, grads: Float32Array, slots: Float32Array) -> Float32Array:
        """The accumulator plus `g**2`."""
        new_acc = np.square(grads)
        new_acc += slots  # Keras: accumulator + g**2; addition commutes bit for bit
        return new_acc

    def finish(
        self, weights: Float32Array, grads: Float32Array, new_slots: Float32Array
    ) -> Float32Array:
        """The rows moved by `lr * g / sqrt(accumulator + epsilon)`."""
        c = self.config
        delta = _F32(c.learning_rate) * grads
        denom = new_slots + _F32(c.epsilon)
        np.sqrt(denom, out=denom)
        delta /= denom
        return weights - delta

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One Adagrad step on rows (see module docstring)."""
        return step(self, weights, grads, slots)
