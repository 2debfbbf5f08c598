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
The per-element work is compiled, each float32 operation in this order.
"""

# formula: pytorch/FBGEMM fbgemm_gpu/codegen/genscript/optimizers.py, partial_rowwise_adam()

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import numpy as np
from numba import njit, types
from numpy.typing import NDArray

from lookup_table.core.jit import A1, A2, C1, C2, PREFETCH_AHEAD, RC1, RC2, compiled, prefetch_row
from lookup_table.core.optimizers.adam import power_tables, step_sizes
from lookup_table.core.optimizers.base import (
    Float32Array,
    StoredSlot,
    items_at,
    step,
    update_at_args,
)
from lookup_table.core.optimizers.rowwise_adagrad import row_mean_square
from lookup_table.core.precision import MAX_FINITE, bf16_nearest_bits, check_values_fit

if TYPE_CHECKING:  # the runtime imports stay numpy + numba + stdlib
    from lookup_table.config import RowwiseAdamConfig

__all__ = ["RowwiseAdam"]

_F32 = np.float32
_BF16_MAX = np.float32(MAX_FINITE["bfloat16"])
_AT = types.Array(types.intp, 1, "C")  # `update_at`'s positions (the caller's array)
_EMPTY = np.empty(0, dtype=np.float32)  # `_stepped_at` without an alpha or tables


@njit(inline="always")
def _step_slots(g, m, v, one_minus_beta_1, one_minus_beta_2, bfloat16, m_out, m_bits):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Writes a row's new m to `m_out` (its bits `m_bits`: rounded to bfloat16 when
    `bfloat16`); returns its new v and False when an m is beyond bfloat16's range."""
    for j in range(g.shape[0]):
        m_out[j] = (g[j] - m[j]) * one_minus_beta_1 + m[j]
    if bfloat16:
        for j in range(g.shape[0]):
            if abs(m_out[j]) > _BF16_MAX:  # NaN compares False: it is kept as NaN
                return v, False
            m_bits[j] = bf16_nearest_bits(m_bits[j]) << np.uint32(16)
    return (row_mean_square(g) - v) * one_minus_beta_2 + v, True


@compiled(
    [
        types.boolean(layout, layout, types.float32, types.float32, types.boolean, C2)
        for layout in (C2, RC2, A2)
    ]
)
def _next_slots(grads, slots, one_minus_beta_1, one_minus_beta_2, bfloat16, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """m, v and the step after one step (module docstring), into `out`; False when an m
    is beyond bfloat16's range (`out` is then not valid)."""
    dim = grads.shape[1]
    bits = out.view(np.uint32)
    for i in range(grads.shape[0]):
        v, fits = _step_slots(
            grads[i], slots[i, :dim], slots[i, dim], one_minus_beta_1, one_minus_beta_2,
            bfloat16, out[i, :dim], bits[i, :dim],
        )  # fmt: skip
        if not fits:
            return False
        out[i, dim] = v
        out[i, dim + 1] = slots[i, dim + 1] + np.float32(1)
    return True


@compiled(
    [
        types.void(C2, C2, C1, types.float32, C2),
        types.void(RC2, RC2, RC1, types.float32, C2),
        types.void(A2, A2, A1, types.float32, C2),
    ]
)
def _moved(weights, new_slots, alpha, epsilon, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """w - (m * alpha) / (sqrt(v) + epsilon), the denominator once a row, in this order."""
    dim = weights.shape[1]
    for i in range(weights.shape[0]):
        a = alpha[i]
        denominator = np.sqrt(new_slots[i, dim]) + epsilon
        w = weights[i]
        m = new_slots[i, :dim]
        o = out[i]
        for j in range(dim):
            o[j] = w[j] - (m[j] * a) / denominator


@compiled(
    [
        types.intp(
            C2,
            _AT,
            C2,
            grads,
            C1,
            C1,
            C1,
            types.float32,
            types.float32,
            types.float32,
            types.float32,
            types.boolean,
            C2,
            C2,
        )  # fmt: skip
        for grads in (C2, RC2, A2)
    ]
)
def _stepped_at(  # type: ignore[no-untyped-def]  # pragma: no cover
    values,
    at,
    extra,
    grads,
    alpha,
    powers_1,
    powers_2,
    learning_rate,
    one_minus_beta_1,
    one_minus_beta_2,
    epsilon,
    bfloat16,
    rows,
    items,
):
    """`_next_slots` then `_moved` on items (a row, m, v, step) read where they are:
    `values[at[i]]`, or `extra[-1 - at[i]]` where at[i] < 0; one pass, the same bits.
    The new items go to `items`, the new rows also to `rows`.

    Row i's alpha is `alpha[i]`, or with `alpha` empty `finish`'s expression of its new
    step's powers looked up in `powers_1`/`powers_2` (as adam's `_stepped_at`). Returns
    -1 when every row is done, -2 when an m is beyond bfloat16's range, else the first
    row whose step the tables do not hold (the caller then passes `alpha`)."""
    dim = grads.shape[1]
    n = at.shape[0]
    given = alpha.shape[0] > 0
    size_1 = powers_1.shape[0]
    size_2 = powers_2.shape[0]
    one = np.float32(1)
    bits = items.view(np.uint32)
    for i in range(n):
        if i + PREFETCH_AHEAD < n and at[i + PREFETCH_AHEAD] >= 0:
            prefetch_row(values, at[i + PREFETCH_AHEAD])
        p = at[i]
        src = values[p] if p >= 0 else extra[-1 - p]
        t = src[2 * dim + 1] + one
        if given:
            a = alpha[i]
        else:
            if not (t >= 0 and t < size_1 and t < size_2) or t != np.floor(t):  # NaN: no
                return i
            k = np.intp(t)
            a = learning_rate * np.sqrt(one - powers_2[k]) / (one - powers_1[k])
        out = items[i]
        m_out = out[dim : 2 * dim]
        v, fits = _step_slots(
            grads[i], src[dim : 2 * dim], src[2 * dim], one_minus_beta_1, one_minus_beta_2,
            bfloat16, m_out, bits[i, dim : 2 * dim],
        )  # fmt: skip
        if not fits:
            return -2
        out[2 * dim] = v
        out[2 * dim + 1] = t
        denominator = np.sqrt(v) + epsilon
        w = src[:dim]
        r = rows[i]
        for j in range(dim):
            r[j] = w[j] - (m_out[j] * a) / denominator
        for j in range(dim):
            out[j] = r[j]
    return -1


@dataclass(frozen=True, slots=True)
class RowwiseAdam:
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
        out = np.empty(slots.shape, dtype=np.float32)
        one_minus = _F32(1 - c.beta_1), _F32(1 - c.beta_2)
        if not _next_slots(grads, slots, *one_minus, c.momentum_dtype == "bfloat16", out):
            self._refuse_momentum(grads, slots[:, :dim])
        return out

    def finish(
        self, weights: Float32Array, grads: Float32Array, new_slots: Float32Array
    ) -> Float32Array:
        """The rows moved by the new m and the row's v, bias-corrected with its step `t`."""
        c = self.config
        n, dim = weights.shape
        if new_slots.shape != (n, dim + 2):
            raise ValueError(f"slots {new_slots.shape} do not fit rows {weights.shape}")
        alpha = step_sizes(c.learning_rate, c.beta_1, c.beta_2, new_slots[:, dim + 1])
        out = np.empty(weights.shape, dtype=np.float32)
        _moved(weights, new_slots, alpha, _F32(c.epsilon), out)
        return out

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One row-wise Adam step per row, each with its own step count (module docstring)."""
        return step(self, weights, grads, slots)

    def update_at(
        self,
        values: Float32Array,
        at: NDArray[np.intp],
        extra: Float32Array,
        grads: Float32Array,
    ) -> tuple[Float32Array, Float32Array]:
        """`update` of items read where they are (`Optimizer.update_at`): one compiled
        pass from the items to the new ones, each row's alpha as adam's `update_at` takes
        it (from the powers' tables as they are, else `step_sizes`): the same bits."""
        c = self.config
        dim, values, at, extra, rows, items = update_at_args(
            values, at, extra, grads, self.slot_width
        )
        powers_1, powers_2 = power_tables(c.beta_1, c.beta_2)
        constants = (
            _F32(c.learning_rate),
            _F32(1 - c.beta_1),
            _F32(1 - c.beta_2),
            _F32(c.epsilon),
            c.momentum_dtype == "bfloat16",
        )
        # fmt: off
        done = _stepped_at(
            values, at, extra, grads, _EMPTY, powers_1, powers_2, *constants, rows, items
        )
        # fmt: on
        if done >= 0:  # a step past the tables (or not whole): their general lookup grows them
            t = items_at(values, at, extra)[:, 2 * dim + 1] + _F32(1)
            alpha = step_sizes(c.learning_rate, c.beta_1, c.beta_2, t)
            done = _stepped_at(
                values, at, extra, grads, alpha, _EMPTY, _EMPTY, *constants, rows, items
            )
        if done == -2:
            self._refuse_momentum(grads, items_at(values, at, extra)[:, dim : 2 * dim])
        return rows, items

    def _refuse_momentum(self, grads: Float32Array, momentum: Float32Array) -> NoReturn:
        """The RowOverflowError storing a new m beyond bfloat16's range raises (the
        compiled passes only find it)."""
        new_m = grads - momentum
        new_m *= _F32(1 - self.config.beta_1)
        new_m += momentum
        check_values_fit(
            new_m,
            "bfloat16",
            "rowwise_adam's first moment m",
            None,
            remedy="m follows the gradients: gradients this close to float32's limit mean "
            "the training diverged; clip them or lower the learning rate",
        )
        raise AssertionError("the compiled pass found an m beyond bfloat16, the check none")
