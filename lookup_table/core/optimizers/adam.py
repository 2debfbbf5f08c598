"""Adam (Kingma & Ba, 2015, "Adam: A Method for Stochastic Optimization", arXiv:1412.6980).

The update is Keras 3's `keras.optimizers.Adam.update_step` (amsgrad off), op for
op in float32, so on dense updates it matches `tf.keras.optimizers.Adam` to the
last bit or within float32 rounding:

    t     = step + 1
    alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
    m    += (g - m) * (1 - beta_1)
    v    += (g**2 - v) * (1 - beta_2)
    w    -= m * alpha / (sqrt(v) + epsilon)

Conventions:

* epsilon is Keras' "epsilon hat" (default 1e-7), added after the sqrt; the bias
  correction is folded into `alpha`, the reordering given at the end of the
  paper's Section 2.
* Per-row step: a sparse row is updated only when it appears in a push, so `t`
  is the row's own count of updates plus one, stored in its slots, not a global
  iteration counter. When every row is updated every step this equals Keras'
  `iterations + 1`. A row absent from a push is not touched at all (Keras' dense
  update would decay its m and v and move it by the old momentum), and a row first
  seen late gets the full first-step bias correction, not that of step 1000.
* The step is stored as float32: exact up to 2**24 updates of a row. Past that it
  stops counting, but by then beta_2**t underflows and the bias correction is 1
  to float32 precision anyway.
* Scalars enter as Keras casts them: `1 - beta_1` is computed in Python (float64)
  and rounded to float32 once, `beta_1` itself is rounded before the power.
  `beta**t` is numpy's float32 power. On x86-64 glibc it gave the same
  `1 - beta**t` as TF's scalar pow (what Keras calls) for every t <= 5000 and
  beta in {0.8, 0.9, 0.99, 0.999}; a build with other math kernels may differ in
  the last bit. TF's pow is not correctly rounded, so computing it in float64
  would match Keras less often, not more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lookup_table.core.optimizers.base import Float32Array, check_update_args

if TYPE_CHECKING:  # the runtime imports stay numpy + stdlib
    from lookup_table.config import AdamConfig

__all__ = ["Adam"]

_F32 = np.float32


@dataclass(frozen=True, slots=True)
class Adam:
    """Adam on rows; slots per row: momentum (dim), velocity (dim), step (1)."""

    config: AdamConfig

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "velocity", "step")

    def slot_width(self, dim: int) -> int:
        return 2 * dim + 1

    def initial_slots(self, n: int, dim: int) -> Float32Array:
        """All zeros: m = v = 0 and step 0 (the first update uses t = 1)."""
        return np.zeros((n, self.slot_width(dim)), dtype=np.float32)

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One Adam step per row, each with its own step count (see module docstring)."""
        dim = check_update_args(weights, grads, slots, self.slot_width)
        c = self.config
        m = slots[:, :dim]
        v = slots[:, dim : 2 * dim]
        t = slots[:, 2 * dim :] + _F32(1)  # (n, 1): broadcasts over the row
        beta_1_power = np.power(_F32(c.beta_1), t)
        beta_2_power = np.power(_F32(c.beta_2), t)
        alpha = _F32(c.learning_rate) * np.sqrt(_F32(1) - beta_2_power) / (_F32(1) - beta_1_power)

        new_slots = np.empty_like(slots)
        new_m = new_slots[:, :dim]
        np.subtract(grads, m, out=new_m)
        new_m *= _F32(1 - c.beta_1)
        new_m += m
        new_v = new_slots[:, dim : 2 * dim]
        np.square(grads, out=new_v)
        new_v -= v
        new_v *= _F32(1 - c.beta_2)
        new_v += v
        new_slots[:, 2 * dim :] = t

        delta = new_m * alpha
        denom = np.sqrt(new_v)
        denom += _F32(c.epsilon)
        delta /= denom
        return weights - delta, new_slots
