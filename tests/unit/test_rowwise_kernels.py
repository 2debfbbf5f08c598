"""Row-wise Adam's and Adagrad's compiled passes against their formulas in numpy, float32
operation for float32 operation: the same bits, gathered or not, and the same errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from lookup_table.config import RowwiseAdagradConfig, RowwiseAdamConfig
from lookup_table.core.optimizers import RowwiseAdagrad, RowwiseAdam, step_sizes
from lookup_table.core.precision import round_to
from lookup_table.errors import RowOverflowError

pytestmark = pytest.mark.unit

F32 = np.float32
Rows = NDArray[np.float32]


def _mean_square_reference(g: Rows) -> Rows:
    """Each row's mean of g**2, its squares added in column order (FBGEMM's loop)."""
    acc = np.zeros(g.shape[0], np.float32)
    for j in range(g.shape[1]):
        acc += g[:, j] * g[:, j]
    return acc / F32(g.shape[1])


def _rowwise_adam_reference(
    c: RowwiseAdamConfig, w: Rows, g: Rows, slots: Rows
) -> tuple[Rows, Rows]:
    """The module docstring's formulas as numpy expressions: next_slots, then finish."""
    n, dim = g.shape
    m = slots[:, :dim]
    v = slots[:, dim]
    out = np.empty_like(slots)
    new_m = g - m
    new_m *= F32(1 - c.beta_1)
    new_m += m
    if c.momentum_dtype == "bfloat16":
        new_m = round_to(new_m, "bfloat16")
    out[:, :dim] = new_m
    new_v = _mean_square_reference(g)
    new_v -= v
    new_v *= F32(1 - c.beta_2)
    new_v += v
    out[:, dim] = new_v
    out[:, dim + 1] = slots[:, dim + 1] + F32(1)
    alpha = step_sizes(c.learning_rate, c.beta_1, c.beta_2, out[:, dim + 1])
    denom = np.sqrt(out[:, dim : dim + 1]) + F32(c.epsilon)
    moved = (out[:, :dim] * alpha[:, None]) / denom
    return w - moved, out


def _rowwise_adagrad_reference(
    c: RowwiseAdagradConfig, w: Rows, g: Rows, slots: Rows
) -> tuple[Rows, Rows]:
    new_slots = slots + _mean_square_reference(g)[:, None]
    multiplier = F32(c.learning_rate) / (np.sqrt(new_slots) + F32(c.epsilon))
    return w - g * multiplier, new_slots


def _case(
    data: Any, kind: str, dim: int, n: int, momentum_dtype: str
) -> tuple[RowwiseAdam | RowwiseAdagrad, Any]:
    lr = data.draw(st.sampled_from([0.001, 0.0123, 0.5]))
    eps = data.draw(st.sampled_from([1e-7, 1e-3]))
    if kind == "adam":
        config = RowwiseAdamConfig(
            learning_rate=lr, beta_1=data.draw(st.sampled_from([0.9, 0.81])),
            beta_2=data.draw(st.sampled_from([0.999, 0.97])), epsilon=eps,
            momentum_dtype=momentum_dtype,  # type: ignore[arg-type]
        )  # fmt: skip
        return RowwiseAdam(config), _rowwise_adam_reference
    return RowwiseAdagrad(RowwiseAdagradConfig(learning_rate=lr, epsilon=eps)), (
        _rowwise_adagrad_reference
    )


def _items(rng: np.random.Generator, opt: Any, n: int, dim: int, steps: int) -> Rows:
    width = dim + opt.slot_width(dim)
    scale = 10.0 ** rng.integers(-30, 4, (n, 1))
    items = (rng.standard_normal((n, width)) * scale).astype(np.float32)
    items[:, dim:] = np.abs(items[:, dim:])  # v, the accumulator and steps are >= 0
    if isinstance(opt, RowwiseAdam):
        items[:, dim : 2 * dim] = round_to(items[:, dim : 2 * dim], "bfloat16")
        items[:, -1] = rng.integers(0, steps + 1, n)
    return items


@settings(max_examples=120, deadline=None)
@given(
    st.data(),
    st.sampled_from(["adam", "adagrad"]),
    st.integers(1, 130),
    st.integers(0, 60),
    st.sampled_from(["float32", "bfloat16"]),
    st.sampled_from([10, 5_000, 1_000_000]),
    st.integers(0, 2**32 - 1),
)
def test_compiled_passes_are_the_numpy_formulas_bit_for_bit(
    data: Any, kind: str, dim: int, n: int, momentum_dtype: str, steps: int, seed: int
) -> None:
    """`update`, `next_slots` + `finish` and `update_at` (items gathered from a map and
    from extra rows, at random positions without repeats) give the numpy formulas' bits:
    dims 1..130, steps up to a million (past the tabled powers), m float32 or bfloat16."""
    rng = np.random.default_rng(seed)
    opt, reference = _case(data, kind, dim, n, momentum_dtype)
    values = _items(rng, opt, n + 40, dim, steps)
    extra = _items(rng, opt, 20, dim, steps)
    g = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-20, 3, (n, 1))).astype(F32)
    at = rng.permutation(n + 40)[:n].astype(np.intp)
    from_extra = int(rng.integers(0, min(n, 20) + 1))
    at[rng.permutation(n)[:from_extra]] = -1 - rng.permutation(20)[:from_extra]
    items = np.where((at >= 0)[:, None], values[np.maximum(at, 0)], extra[np.maximum(-1 - at, 0)])
    w, slots = items[:, :dim], items[:, dim:]
    want_w, want_slots = reference(opt.config, w, g, slots)
    got_w, got_slots = opt.update(w, g, slots)
    assert got_w.tobytes() == want_w.tobytes()
    assert got_slots.tobytes() == want_slots.tobytes()
    new_slots = opt.next_slots(g, slots)
    assert new_slots.tobytes() == want_slots.tobytes()
    assert opt.finish(w, g, new_slots).tobytes() == want_w.tobytes()
    rows, new_items = opt.update_at(values, at, extra, g)
    assert rows.tobytes() == want_w.tobytes()
    assert new_items[:, :dim].tobytes() == want_w.tobytes()
    assert new_items[:, dim:].tobytes() == want_slots.tobytes()


def test_special_values_are_the_numpy_formulas_bit_for_bit() -> None:
    """NaN, +-inf in v, subnormal and signed-zero grads, m at bfloat16 halfway points."""
    rng = np.random.default_rng(3)
    dim = 7
    for momentum_dtype in ("float32", "bfloat16"):
        c = RowwiseAdamConfig(momentum_dtype=momentum_dtype)  # type: ignore[arg-type]
        opt = RowwiseAdam(c)
        items = _items(rng, opt, 12, dim, 100)
        g = rng.standard_normal((12, dim)).astype(F32)
        g[0] = np.nan
        g[1] = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 3e38, -3e38]
        g[2] = np.float32(1 + 2.0**-8) / F32(1 - c.beta_1)  # m near a halfway point
        items[3, dim] = np.inf
        items[4, -1] = np.nan  # a step that is no count: the general alpha
        items[5, -1] = 2.5
        with np.errstate(all="ignore"):  # the NaN and inf cases
            want = _rowwise_adam_reference(c, items[:, :dim], g, items[:, dim:])
        rows, new_items = opt.update_at(items, np.arange(12, dtype=np.intp), items[:0], g)
        assert rows.tobytes() == want[0].tobytes()
        assert new_items[:, dim:].tobytes() == want[1].tobytes()
    opt_g = RowwiseAdagrad(RowwiseAdagradConfig())
    items = _items(rng, opt_g, 4, dim, 0)
    g = rng.standard_normal((4, dim)).astype(F32)
    g[0] = np.nan
    g[1] = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 3e38, -3e38]
    items[2, dim] = np.inf
    with np.errstate(all="ignore"):
        want = _rowwise_adagrad_reference(opt_g.config, items[:, :dim], g, items[:, dim:])
    rows, new_items = opt_g.update_at(items, np.arange(4, dtype=np.intp), items[:0], g)
    assert rows.tobytes() == want[0].tobytes()
    assert new_items[:, dim:].tobytes() == want[1].tobytes()


def test_a_bfloat16_momentum_beyond_its_range_is_refused_as_storing_it_would_be() -> None:
    """An inf gradient makes m inf: the same RowOverflowError as rounding that m to
    bfloat16 raises (its row, column, count), from every path, and nothing returned."""
    c = RowwiseAdamConfig()
    opt = RowwiseAdam(c)
    rng = np.random.default_rng(5)
    items = _items(rng, opt, 6, 4, 10)
    g = rng.standard_normal((6, 4)).astype(F32)
    g[3, 2] = np.inf
    g[4, 0] = -np.inf
    with pytest.raises(RowOverflowError) as want, np.errstate(all="ignore"):
        _rowwise_adam_reference(c, items[:, :4], g, items[:, 4:])
    assert "row 3, column 2" in str(want.value) and "2 of 24 values" in str(want.value)
    at = np.array([0, 1, 2, 3, 4, 5], dtype=np.intp)
    calls = (
        lambda: opt.update(items[:, :4], g, items[:, 4:]),
        lambda: opt.next_slots(g, items[:, 4:]),
        lambda: opt.update_at(items, at, items[:0], g),
        lambda: opt.update_at(items[:0], -1 - at, items, g),
    )
    # the same finding, named as the first moment, with what to do about it
    found = str(want.value).removeprefix("rows: ").split("; nothing was stored")[0]
    for call in calls:
        with pytest.raises(RowOverflowError) as got:
            call()
        assert str(got.value).startswith(f"rowwise_adam's first moment m: {found}; nothing was")
        assert "clip them or lower the learning rate" in str(got.value)
    items[:, -1] = 2_000_000  # past the tabled powers: the second pass finds it
    with pytest.raises(RowOverflowError, match="row 3, column 2"):
        opt.update_at(items, at, items[:0], g)
    f32 = RowwiseAdam(RowwiseAdamConfig(momentum_dtype="float32"))
    rows, _ = f32.update_at(items, at, items[:0], g)  # float32 m: inf is a value
    assert np.isnan(rows[3]).any() or np.isinf(rows[3]).any()
