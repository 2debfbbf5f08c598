"""Adam (Kingma & Ba, 2015): Keras 3's `Adam.update_step` op for op in float32, with
each row's own step count for the bias correction.

The per-element work is one compiled pass (`lookup_table.core.jit`); `beta**t` comes
from the C library's `powf`, as TF's scalar Pow computes it. docs/optimizers.md#adam
gives the formula and why each convention is what it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.jit import A1, A2, C1, C2, PREFETCH_AHEAD, RC1, RC2, compiled, prefetch_row
from lookup_table.core.optimizers.base import Float32Array, StoredSlot, step, update_at_args

if TYPE_CHECKING:  # the runtime imports stay pure (numpy, numba, stdlib)
    from lookup_table.config import AdamConfig

__all__ = ["Adam", "column_at", "step_sizes"]

_F32 = np.float32
_F32_TINY = float(np.finfo(np.float32).tiny)


def _load_powf() -> Callable[[float, float], float] | None:
    """The C library's `powf` (what TF's scalar Pow calls), or None if there is none."""
    for name in (ctypes.util.find_library("m"), None):  # None: the symbols already loaded
        try:
            powf = ctypes.CDLL(name).powf
        except (OSError, AttributeError, TypeError):  # no such library or symbol
            continue
        powf.argtypes = (ctypes.c_float, ctypes.c_float)
        powf.restype = ctypes.c_float
        return powf
    return None


_POWF = _load_powf()


@functools.lru_cache(maxsize=4096)
def _scalar_power(beta: float, t: float) -> float:
    """float32 `beta**t` as TF computes it for scalars (both arguments float32 values)."""
    if _POWF is not None:
        power = _POWF(beta, t)
    else:
        power = float(_F32(math.pow(beta, t)))
    return 0.0 if abs(power) < _F32_TINY else power  # TF flushes subnormals to zero


_TABLE_STEPS = 1 << 20  # step counts tabulated (4 MB a table); larger ones: one powf each
_POWER_TABLES: dict[float, Float32Array] = {}  # float32 beta -> beta**t for t = 0, 1, ...


def _power_table(beta_32: float, size: int) -> Float32Array:
    """`beta**t` for t in 0..size-1 at least (one `powf` call per t, ever: the table grows
    by doubling). Threads may grow it at once: each builds a whole table, the last wins."""
    table = _POWER_TABLES.get(beta_32)
    if table is None or table.shape[0] < size:
        have = 0 if table is None else table.shape[0]
        grown = np.empty(min(max(size, 2 * have, 1024), _TABLE_STEPS), dtype=np.float32)
        if table is not None:
            grown[:have] = table
        grown[have:] = [_scalar_power(beta_32, float(t)) for t in range(have, grown.shape[0])]
        _POWER_TABLES[beta_32] = table = grown
    return table


def _beta_powers(beta: float, t: Float32Array) -> Float32Array:
    """float32 `beta**t` elementwise, bit for bit TF's scalar pow; any shape of t.

    Step counts (whole numbers below `_TABLE_STEPS`) are gathered from `beta`'s table;
    anything else takes one `powf` call per distinct value. `beta` is rounded to
    float32 first, as Keras casts it.
    """
    beta_32 = float(_F32(beta))
    flat = t.reshape(-1)
    if not flat.size:
        return np.empty(t.shape, dtype=np.float32)
    if flat.size == 1:  # one row (a dense parameter is one): Python scalars, not 8 numpy calls
        one = float(flat[0])
        if one.is_integer() and 0 <= one < _TABLE_STEPS:
            value = _power_table(beta_32, int(one) + 1)[int(one)]
        else:
            value = _F32(_scalar_power(beta_32, one))
        return np.full(t.shape, value, dtype=np.float32)
    if np.isfinite(flat).all():
        whole = flat.astype(np.intp)
        top = int(whole.max())
        if top < _TABLE_STEPS and int(whole.min()) >= 0 and np.array_equal(whole, flat):
            return np.take(_power_table(beta_32, top + 1), whole).reshape(t.shape)
    steps, inverse = np.unique(flat, return_inverse=True)
    table = np.array([_scalar_power(beta_32, s) for s in steps.tolist()], dtype=np.float32)
    return table[inverse.reshape(-1)].reshape(t.shape)


def power_tables(beta_1: float, beta_2: float) -> tuple[Float32Array, Float32Array]:
    """`beta_1**t` and `beta_2**t` for whole t below each table's length, the tables as
    they are (not grown): what a compiled pass looks a row's alpha up in."""
    return _power_table(float(_F32(beta_1)), 1), _power_table(float(_F32(beta_2)), 1)


def step_sizes(learning_rate: float, beta_1: float, beta_2: float, t: Float32Array) -> Float32Array:
    """Each row's `alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)` for its new step
    `t`, float32 as Keras computes it (the powers: `_beta_powers`)."""
    beta_1_power = _beta_powers(beta_1, t)
    beta_2_power = _beta_powers(beta_2, t)
    alpha: Float32Array = (
        _F32(learning_rate) * np.sqrt(_F32(1) - beta_2_power) / (_F32(1) - beta_1_power)
    )
    return alpha


@compiled(
    [
        types.void(C2, C2, types.float32, types.float32, C2),
        types.void(RC2, RC2, types.float32, types.float32, C2),
        types.void(A2, A2, types.float32, types.float32, C2),
    ]
)
def _next_slots(grads, slots, one_minus_beta_1, one_minus_beta_2, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """m += (g - m) * (1 - beta_1); v += (g**2 - v) * (1 - beta_2); step += 1, each
    float32 operation rounded as numpy's and Keras' are (in this order).

    The inner loops index 1-D views of a row (its m, its v), not the 2-D arrays: LLVM
    then vectorizes them fully (2-D indexing, `slots[i, dim + j]`, ran 2.5-4.5 times
    slower, and 1 x 109,824 dense parameters the slowest). Same operations, same bits."""
    dim = grads.shape[1]
    for i in range(grads.shape[0]):
        g = grads[i]
        m = slots[i, :dim]
        v = slots[i, dim : 2 * dim]
        m_out = out[i, :dim]
        v_out = out[i, dim : 2 * dim]
        for j in range(dim):  # m, then v: one stream of stores a loop (it vectorizes)
            m_out[j] = (g[j] - m[j]) * one_minus_beta_1 + m[j]
        for j in range(dim):
            v_out[j] = (g[j] * g[j] - v[j]) * one_minus_beta_2 + v[j]
        out[i, 2 * dim] = slots[i, 2 * dim] + np.float32(1)


@compiled(
    [
        types.void(C2, C2, C1, types.float32, C2),
        types.void(RC2, RC2, RC1, types.float32, C2),
        types.void(A2, A2, A1, types.float32, C2),
    ]
)
def _moved(weights, new_slots, alpha, epsilon, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """w - m * alpha / (sqrt(v) + epsilon), each float32 operation in Keras' order
    (1-D views of a row, as in `_next_slots`: 2-D indexing ran 2-12 times slower)."""
    dim = weights.shape[1]
    for i in range(weights.shape[0]):
        a = alpha[i]
        w = weights[i]
        m = new_slots[i, :dim]
        v = new_slots[i, dim : 2 * dim]
        o = out[i]
        for j in range(dim):
            o[j] = w[j] - (m[j] * a) / (np.sqrt(v[j]) + epsilon)


_AT = types.Array(types.intp, 1, "C")  # `update_at`'s positions (the caller's array)


@compiled(types.void(C2, _AT, C2, types.intp, C1))
def _column_at(values, at, extra, column, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """out[i] = column `column` of item i (`values[at[i]]`, or `extra[-1 - at[i]]`)."""
    n = at.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n and at[i + PREFETCH_AHEAD] >= 0:
            prefetch_row(values, at[i + PREFETCH_AHEAD])
        p = at[i]
        out[i] = values[p, column] if p >= 0 else extra[-1 - p, column]


def column_at(
    values: Float32Array, at: NDArray[np.intp], extra: Float32Array, column: int
) -> Float32Array:
    """Column `column` of the items where they are (as `Optimizer.update_at` reads them):
    a new (n,) array."""
    values, extra = (a if a.flags.writeable else a.copy() for a in (values, extra))
    out = np.empty(at.shape[0], dtype=np.float32)
    _column_at(values, at if at.flags.writeable else at.copy(), extra, column, out)
    return out


_EMPTY = np.empty(0, dtype=np.float32)  # `_stepped_at` without an alpha or tables


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
    rows,
    items,
):
    """`_next_slots` then `_moved` on items (a row, m, v, step) read where they are:
    `values[at[i]]`, or `extra[-1 - at[i]]` where at[i] < 0; the same float32 operations
    in the same order (the same bits), one pass. The new items go to `items`, the new
    rows also to `rows` (what the push's answer sends).

    Row i's `alpha` is `alpha[i]`; with `alpha` empty the pass computes it: its new
    step's powers looked up in `powers_1`/`powers_2` (beta_1**t and beta_2**t for whole
    t below their lengths: `_power_table`), then `finish`'s numpy expression, the same
    float32 operations in the same order. Returns -1 when every row is done, else the
    first row whose new step the tables do not hold (that row and those after it are not
    written: the caller computes `alpha` and passes it)."""
    dim = grads.shape[1]
    n = at.shape[0]
    given = alpha.shape[0] > 0
    size_1 = powers_1.shape[0]
    size_2 = powers_2.shape[0]
    one = np.float32(1)
    for i in range(n):
        if i + PREFETCH_AHEAD < n and at[i + PREFETCH_AHEAD] >= 0:
            prefetch_row(values, at[i + PREFETCH_AHEAD])
        p = at[i]
        src = values[p] if p >= 0 else extra[-1 - p]
        t = src[3 * dim] + one
        if given:
            a = alpha[i]
        else:
            if not (t >= 0 and t < size_1 and t < size_2) or t != np.floor(t):  # NaN: no
                return i
            k = np.intp(t)
            a = learning_rate * np.sqrt(one - powers_2[k]) / (one - powers_1[k])
        g = grads[i]
        w = src[:dim]
        m = src[dim : 2 * dim]
        v = src[2 * dim : 3 * dim]
        out = items[i]
        w_out = out[:dim]
        m_out = out[dim : 2 * dim]
        v_out = out[2 * dim : 3 * dim]
        for j in range(dim):
            m_out[j] = (g[j] - m[j]) * one_minus_beta_1 + m[j]
        for j in range(dim):
            v_out[j] = (g[j] * g[j] - v[j]) * one_minus_beta_2 + v[j]
        out[3 * dim] = t
        r = rows[i]
        for j in range(dim):
            r[j] = w[j] - (m_out[j] * a) / (np.sqrt(v_out[j]) + epsilon)
        for j in range(dim):
            w_out[j] = r[j]
    return -1


@dataclass(frozen=True, slots=True)
class Adam:
    """Adam on rows; slots per row: momentum (dim), velocity (dim), step (1)."""

    config: AdamConfig

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "velocity", "step")

    def slot_width(self, dim: int) -> int:
        return 2 * dim + 1

    def slot_storage(self, dim: int) -> tuple[StoredSlot, ...]:
        return (StoredSlot("momentum", dim), StoredSlot("velocity", dim), StoredSlot("step", 1))

    def initial_slots(self, n: int, dim: int) -> Float32Array:
        """All zeros: m = v = 0 and step 0 (the first update uses t = 1)."""
        return np.zeros((n, self.slot_width(dim)), dtype=np.float32)

    def next_slots(self, grads: Float32Array, slots: Float32Array) -> Float32Array:
        """m, v and the step after one step (see module docstring)."""
        c = self.config
        if slots.shape != (grads.shape[0], self.slot_width(grads.shape[1])):
            raise ValueError(f"slots {slots.shape} do not fit grads {grads.shape}")
        new_slots = np.empty_like(slots)
        _next_slots(grads, slots, _F32(1 - c.beta_1), _F32(1 - c.beta_2), new_slots)
        return new_slots

    def finish(
        self, weights: Float32Array, grads: Float32Array, new_slots: Float32Array
    ) -> Float32Array:
        """The rows moved by the new m and v, bias-corrected with the new step `t`."""
        c = self.config
        dim = weights.shape[1]
        if new_slots.shape != (weights.shape[0], self.slot_width(dim)):
            raise ValueError(f"slots {new_slots.shape} do not fit rows {weights.shape}")
        t = new_slots[:, 2 * dim]
        # one alpha a row (its own step): numpy, per row; the rest per element, compiled
        alpha = step_sizes(c.learning_rate, c.beta_1, c.beta_2, t)
        out = np.empty_like(weights)
        _moved(weights, new_slots, alpha, _F32(c.epsilon), out)
        return out

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One Adam step per row, each with its own step count (see module docstring)."""
        return step(self, weights, grads, slots)

    def update_at(
        self,
        values: Float32Array,
        at: NDArray[np.intp],
        extra: Float32Array,
        grads: Float32Array,
    ) -> tuple[Float32Array, Float32Array]:
        """`update` of items read where they are (`Optimizer.update_at`): one compiled
        pass from the items to the new ones, instead of gathering them, stepping the slots
        and then the rows into new arrays, and laying those out as items again. Each
        row's `alpha` comes from its new step as in `finish`: the same bits."""
        c = self.config
        dim, values, at, extra, rows, items = update_at_args(
            values, at, extra, grads, self.slot_width
        )
        n = at.shape[0]
        # alpha in the pass, from the powers' tables as they are (not grown here): one
        # pass over the items instead of two, and no numpy calls per row's alpha
        powers_1, powers_2 = power_tables(c.beta_1, c.beta_2)
        constants = (
            _F32(c.learning_rate),
            _F32(1 - c.beta_1),
            _F32(1 - c.beta_2),
            _F32(c.epsilon),
        )
        # fmt: off
        if _stepped_at(
            values, at, extra, grads, _EMPTY, powers_1, powers_2, *constants, rows, items
        ) < 0:
            return rows, items
        # fmt: on
        # a step past the tables (or not a whole number): their general lookup grows them
        t = np.empty(n, dtype=np.float32)
        _column_at(values, at, extra, 3 * dim, t)
        t += _F32(1)
        alpha = step_sizes(c.learning_rate, c.beta_1, c.beta_2, t)
        _stepped_at(values, at, extra, grads, alpha, _EMPTY, _EMPTY, *constants, rows, items)
        return rows, items
