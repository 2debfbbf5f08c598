"""Row-wise Adam: the first moment per element, the second one float32 per row
(FBGEMM's PARTIAL_ROWWISE_ADAM), with our Adam's per-row step and epsilon.

    t     = step + 1
    alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
    m    += (g - m) * (1 - beta_1)               then stored as `momentum_dtype`
    v    += (mean(g**2 over the row) - v) * (1 - beta_2)
    w    -= m * alpha / (sqrt(v) + epsilon)

At dim 1 with a float32 m this is `adam`, bit for bit. FBGEMM's eps equals
`epsilon / sqrt(1 - beta_2**t)` and its step is global (module `adam`: why per row). A
bfloat16 m is rounded to nearest before anything uses it: the slots are what is stored.
"""

# formula: pytorch/FBGEMM fbgemm_gpu/codegen/genscript/optimizers.py, partial_rowwise_adam()

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lookup_table.core.optimizers.adam import step_sizes
from lookup_table.core.optimizers.base import Float32Array, GatheredUpdateAt, StoredSlot, step
from lookup_table.core.optimizers.rowwise_adagrad import mean_square
from lookup_table.core.precision import round_to

if TYPE_CHECKING:  # the runtime imports stay numpy + stdlib
    from lookup_table.config import RowwiseAdamConfig

__all__ = ["RowwiseAdam"]

_F32 = np.float32


@dataclass(frozen=True, slots=True)
class RowwiseAdam(GatheredUpdateAt):
    """Row-wise Adam on rows; slots per row: momentum (dim), velocity (1), step (1)."""

    config: RowwiseAdamConfig

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "velocity", "step")

    def slot_width(self, dim: int) -> int:
        return dim + 2

    def slot_storage(self, dim: int) -> tuple[StoredSlot, ...]:
        return (
            StoredSlot("momentum", dim, self.config.momentum_dtype),
            StoredSlot("velocity", 1),
            StoredSlot("step", 1),
        )

    def initial_slots(self, n: int, dim: int) -> Float32Array:
        """All zeros: m = v = 0 and step 0 (the first update uses t = 1)."""
        return np.zeros((n, dim + 2), dtype=np.float32)

    def next_slots(self, grads: Float32Array, slots: Float32Array) -> Float32Array:
        """m, the row's v and the step after one step (see module docstring)."""
        c = self.config
        n, dim = grads.shape
        if slots.shape != (n, dim + 2):
            raise ValueError(f"slots {slots.shape} do not fit grads {grads.shape}")
        m = slots[:, :dim]
        v = slots[:, dim]
        out = np.empty_like(slots)
        new_m = grads - m
        new_m *= _F32(1 - c.beta_1)
        new_m += m
        if c.momentum_dtype == "bfloat16":
            new_m = round_to(new_m, "bfloat16")
        out[:, :dim] = new_m
        new_v = mean_square(grads)
        new_v -= v
        new_v *= _F32(1 - c.beta_2)
        new_v += v
        out[:, dim] = new_v
        out[:, dim + 1] = slots[:, dim + 1] + _F32(1)
        return out

    def finish(
        self, weights: Float32Array, grads: Float32Array, new_slots: Float32Array
    ) -> Float32Array:
        """The rows moved by the new m and the row's v, bias-corrected with its step `t`."""
        c = self.config
        n, dim = weights.shape
        if new_slots.shape != (n, dim + 2):
            raise ValueError(f"slots {new_slots.shape} do not fit rows {weights.shape}")
        t = new_slots[:, dim + 1]
        alpha = step_sizes(c.learning_rate, c.beta_1, c.beta_2, t)
        denom = np.sqrt(new_slots[:, dim : dim + 1]) + _F32(c.epsilon)
        moved: Float32Array = (new_slots[:, :dim] * alpha[:, None]) / denom
        return weights - moved

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One row-wise Adam step per row, each with its own step count (module docstring)."""
        return step(self, weights, grads, slots)
