"""SGD with optional (Polyak or Nesterov) momentum: Keras 3's `SGD.update_step` op for
op in float32; the momentum slot already holds the learning rate (docs/optimizers.md#sgd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lookup_table.core.optimizers.base import Float32Array, GatheredUpdateAt, StoredSlot, step

if TYPE_CHECKING:  # the runtime imports stay numpy + stdlib
    from lookup_table.config import SGDConfig

__all__ = ["SGD"]

_F32 = np.float32


@dataclass(frozen=True, slots=True)
class SGD(GatheredUpdateAt):
    """SGD on rows; slots per row: momentum (dim) when momentum != 0, else none."""

    config: SGDConfig

    @property
    def slot_names(self) -> tuple[str, ...]:
        # Keras builds its `momentum` variables only when momentum != 0.
        return ("momentum",) if self.config.momentum != 0 else ()

    def slot_width(self, dim: int) -> int:
        return dim if self.config.momentum != 0 else 0

    def slot_storage(self, dim: int) -> tuple[StoredSlot, ...]:
        return (StoredSlot("momentum", dim),) if self.config.momentum != 0 else ()

    def initial_slots(self, n: int, dim: int) -> Float32Array:
        """Zero momentum, or an (n, 0) array when there is no momentum."""
        return np.zeros((n, self.slot_width(dim)), dtype=np.float32)

    def next_slots(self, grads: Float32Array, slots: Float32Array) -> Float32Array:
        """The new momentum `m * momentum - g * lr`, or no slots without momentum."""
        c = self.config
        if c.momentum == 0:
            return slots.copy()
        new_m = slots * _F32(c.momentum)
        new_m -= grads * _F32(c.learning_rate)
        return new_m

    def finish(
        self, weights: Float32Array, grads: Float32Array, new_slots: Float32Array
    ) -> Float32Array:
        """The rows moved by `-g * lr`, or by the new momentum (Nesterov: look-ahead)."""
        c = self.config
        if c.momentum == 0:
            return weights - grads * _F32(c.learning_rate)
        if c.nesterov:
            step = new_slots * _F32(c.momentum)
            step -= grads * _F32(c.learning_rate)
            return weights + step
        return weights + new_slots

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One SGD step on rows (see module docstring)."""
        return step(self, weights, grads, slots)
