"""Row-wise Adagrad and Adam (lookup_table.core.optimizers): FBGEMM's formulas on the same
gradients, Adam at dim 1, sparse rows, and how every optimizer's slots are stored."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

import lookup_table.core.optimizers as optimizers
from lookup_table.config import (
    AdagradConfig,
    AdamConfig,
    RowwiseAdagradConfig,
    RowwiseAdamConfig,
    SGDConfig,
)
from lookup_table.core.optimizers import (
    Adam,
    Optimizer,
    RowwiseAdagrad,
    RowwiseAdam,
    StoredSlot,
    make_optimizer,
    mean_square,
    step_slot,
)
from lookup_table.core.optimizers.layout import (
    decode_items,
    encode_items,
    item_layout,
    value_bytes,
)
from lookup_table.core.precision import ROW_DTYPES, rounding_keys
from lookup_table.errors import ConfigError

pytestmark = pytest.mark.unit

F32 = np.float32
ROWWISE = {
    "rowwise_adagrad": RowwiseAdagradConfig(),
    "rowwise_adagrad-custom": RowwiseAdagradConfig(
        learning_rate=0.1, initial_accumulator_value=0.25, epsilon=1e-2
    ),
    "rowwise_adam": RowwiseAdamConfig(),
    "rowwise_adam-f32": RowwiseAdamConfig(momentum_dtype="float32"),
    "rowwise_adam-custom": RowwiseAdamConfig(
        learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-3
    ),
}
rowwise_params = pytest.mark.parametrize("config", list(ROWWISE.values()), ids=list(ROWWISE))
EVERY = {
    "adam": AdamConfig(),
    "sgd": SGDConfig(),
    "sgd-momentum": SGDConfig(momentum=0.9),
    "adagrad": AdagradConfig(),
    **ROWWISE,
}


def _bf16_nearest(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """bfloat16 to nearest, ties to even, by arithmetic (8 significant bits; the values
    here are normal float32)."""
    mantissa, exponent = np.frexp(x.astype(np.float64))
    return np.ldexp(np.round(np.ldexp(mantissa, 8)), exponent - 8).astype(np.float32)


def _sparse_pushes(
    n: int, dim: int, steps: int, seed: int
) -> Iterator[tuple[NDArray[np.intp], NDArray[np.float32]]]:
    """Pushes of a few rows each, rows first seen at different steps, gradients of mixed
    scale (a row-wise mean must not be dominated by one coordinate's scale alone)."""
    rng = np.random.default_rng(seed)
    for s in range(steps):
        rows = np.sort(rng.choice(n, size=max(1, n // 2), replace=False)).astype(np.intp)
        if s < n:
            rows = np.union1d(rows, [s]).astype(np.intp)
        scale = 10.0 ** rng.integers(-3, 2, (rows.size, 1))
        yield rows, (rng.standard_normal((rows.size, dim)) * scale).astype(np.float32)


# ---------------------------------------------------------------- registration and slots


def test_registered_and_exported() -> None:
    assert optimizers.__all__ == sorted(optimizers.__all__, key=lambda s: (not s.isupper(), s))
    for module in ("rowwise_adagrad", "rowwise_adam", "layout"):
        sub = __import__(f"lookup_table.core.optimizers.{module}", fromlist=["__all__"])
        for name in sub.__all__:
            assert module == "layout" or name in optimizers.__all__, name
    assert isinstance(make_optimizer(RowwiseAdagradConfig()), RowwiseAdagrad)
    assert isinstance(make_optimizer(RowwiseAdamConfig()), RowwiseAdam)


@pytest.mark.parametrize(
    ("config", "names", "width", "storage"),
    [
        (RowwiseAdagradConfig(), ("accumulator",), 1, [("accumulator", 1, "float32")]),
        (
            RowwiseAdamConfig(),
            ("momentum", "velocity", "step"),
            8 + 2,
            [("momentum", 8, "bfloat16"), ("velocity", 1, "float32"), ("step", 1, "float32")],
        ),
        (
            RowwiseAdamConfig(momentum_dtype="float32"),
            ("momentum", "velocity", "step"),
            8 + 2,
            [("momentum", 8, "float32"), ("velocity", 1, "float32"), ("step", 1, "float32")],
        ),
        (AdamConfig(), ("momentum", "velocity", "step"), 17, [
            ("momentum", 8, "float32"), ("velocity", 8, "float32"), ("step", 1, "float32")]),
        (AdagradConfig(), ("accumulator",), 8, [("accumulator", 8, "float32")]),
        (SGDConfig(momentum=0.5), ("momentum",), 8, [("momentum", 8, "float32")]),
        (SGDConfig(), (), 0, []),
    ],
    ids=["rowwise_adagrad", "rowwise_adam", "rowwise_adam-f32", "adam", "adagrad", "sgd-m", "sgd"],
)  # fmt: skip
def test_slots_and_how_they_are_stored(
    config: Any, names: tuple[str, ...], width: int, storage: list[tuple[str, int, str]]
) -> None:
    opt = make_optimizer(config)
    assert opt.config is config
    assert opt.slot_names == names
    assert opt.slot_width(8) == width
    assert [(s.name, s.width, s.dtype) for s in opt.slot_storage(8)] == storage
    assert [s.name for s in opt.slot_storage(8)] == list(names)
    slots = opt.initial_slots(5, 8)
    assert slots.dtype == np.float32 and slots.shape == (5, width)
    np.testing.assert_array_equal(slots, np.broadcast_to(opt.initial_slots(1, 8), slots.shape))


def test_initial_slots_and_step_column() -> None:
    assert not make_optimizer(RowwiseAdagradConfig()).initial_slots(3, 4).any()  # FBGEMM: 0
    acc = make_optimizer(RowwiseAdagradConfig(initial_accumulator_value=0.5)).initial_slots(2, 4)
    assert acc.tolist() == [[0.5], [0.5]]
    assert not make_optimizer(RowwiseAdamConfig()).initial_slots(3, 4).any()
    assert step_slot(make_optimizer(RowwiseAdamConfig()), 16) == 17
    assert step_slot(make_optimizer(RowwiseAdagradConfig()), 16) is None


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="momentum_dtype 'float16': expected 'float32' or"):
        RowwiseAdamConfig(momentum_dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot 'm': width must be >= 0, got -1"):
        StoredSlot("m", -1)
    with pytest.raises(ValueError, match="row dtype 'int8'"):
        StoredSlot("m", 1, "int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grads: expected a float32 array"):
        mean_square(np.zeros((2, 3)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows of dim 0"):
        mean_square(np.zeros((2, 0), np.float32))


@rowwise_params
def test_update_rejects_bad_arrays(config: Any) -> None:
    opt = make_optimizer(config)
    w = np.zeros((3, 4), dtype=np.float32)
    slots = opt.initial_slots(3, 4)
    with pytest.raises(ValueError, match=r"grads: expected a float32 array .*got float64"):
        opt.update(w, w.astype(np.float64), slots)
    with pytest.raises(ValueError, match=r"grads: expected the shape of weights \(3, 4\)"):
        opt.update(w, w[:2], slots)
    with pytest.raises(ValueError, match=r"slots: expected shape \(3, "):
        opt.update(w, w, np.zeros((3, opt.slot_width(4) + 1), dtype=np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        opt.next_slots(w, np.zeros((3, opt.slot_width(4) + 1), dtype=np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        opt.finish(w, w, np.zeros((2, opt.slot_width(4)), dtype=np.float32))


# ---------------------------------------------------------------- the row's mean of g**2


def test_mean_square_adds_in_column_order_in_every_layout() -> None:
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((200, 37)) * 10.0 ** rng.integers(-20, 10, (200, 37))).astype(F32)
    want = []
    for row in g:  # FBGEMM's CPU loop: float32 sum of squares in column order, / D
        acc = F32(0)
        for v in row:
            acc = F32(acc + v * v)
        want.append(F32(acc / F32(g.shape[1])))
    read_only = g.copy()
    read_only.flags.writeable = False
    wide = np.zeros((200, 74), dtype=np.float32)
    wide[:, ::2] = g
    for grads in (g, read_only, wide[:, ::2]):
        assert mean_square(grads).tobytes() == np.array(want, np.float32).tobytes()


# ---------------------------------------------------------------- row-wise Adagrad = FBGEMM


def _fbgemm_rowwise_adagrad(
    lr: float, eps: float, w: list[float], g: list[float], momentum: float
) -> tuple[list[float], float]:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD CPU update of one row (weight_decay_mode 0), float32
    scalars one operation at a time (codegen/genscript/optimizers.py, rowwise_adagrad):
        g_avg_square = sum(g*g) / D;  momentum1 += g_avg_square
        multiplier = learning_rate / (sqrtf(momentum1) + eps);  correction = 1.0
        w = correction * w - g * multiplier"""
    acc = F32(0)
    for v in g:
        acc = F32(acc + F32(v) * F32(v))
    new_momentum = F32(F32(momentum) + F32(acc / F32(len(g))))
    multiplier = F32(F32(lr) / F32(np.sqrt(new_momentum) + F32(eps)))
    correction = F32(1.0)
    new_w = [
        float(F32(correction * F32(x) - F32(v) * multiplier)) for x, v in zip(w, g, strict=True)
    ]
    return new_w, float(new_momentum)


@pytest.mark.parametrize("dim", [1, 4, 16])
@pytest.mark.parametrize(
    "config",
    [RowwiseAdagradConfig(), RowwiseAdagradConfig(learning_rate=0.3, epsilon=1e-2)],
    ids=["fbgemm-defaults", "large-epsilon"],
)
def test_rowwise_adagrad_is_fbgemms_formula_bit_for_bit(
    config: RowwiseAdagradConfig, dim: int
) -> None:
    """Several steps on sparse rows (first seen at different steps), against FBGEMM's CPU
    formula transcribed row by row: the same float32 operations, so the same bits."""
    n = 12
    rng = np.random.default_rng(dim)
    w = rng.uniform(-0.05, 0.05, (n, dim)).astype(np.float32)
    opt = make_optimizer(config)
    slots = opt.initial_slots(n, dim)
    ref_w = w.tolist()
    ref_m = [0.0] * n  # FBGEMM's momentum1 starts at zeros
    for rows, g in _sparse_pushes(n, dim, 8, seed=dim):
        new_w, new_s = opt.update(w[rows], g, slots[rows])
        w[rows], slots[rows] = new_w, new_s
        for k, r in enumerate(rows.tolist()):
            ref_w[r], ref_m[r] = _fbgemm_rowwise_adagrad(
                config.learning_rate, config.epsilon, ref_w[r], g[k].tolist(), ref_m[r]
            )
    assert w.tobytes() == np.array(ref_w, dtype=np.float32).tobytes()
    assert slots[:, 0].tobytes() == np.array(ref_m, dtype=np.float32).tobytes()


def test_rowwise_adagrad_epsilon_is_after_the_sqrt() -> None:
    """Keras' Adagrad puts epsilon inside the sqrt; FBGEMM (and we) after it. With a
    large epsilon the two differ far beyond rounding: the comparison above would see it."""
    c = RowwiseAdagradConfig(learning_rate=1.0, epsilon=0.5)
    w = np.zeros((1, 2), np.float32)
    g = np.array([[3.0, 4.0]], np.float32)  # mean(g**2) = 12.5
    new_w, acc = make_optimizer(c).update(w, g, make_optimizer(c).initial_slots(1, 2))
    assert acc.tolist() == [[12.5]]
    after = [-3 / (math.sqrt(12.5) + 0.5), -4 / (math.sqrt(12.5) + 0.5)]
    inside = [-3 / math.sqrt(12.5 + 0.5), -4 / math.sqrt(12.5 + 0.5)]
    assert new_w[0].tolist() == pytest.approx(after, rel=1e-6)
    assert new_w[0].tolist() != pytest.approx(inside, rel=1e-3)


# ---------------------------------------------------------------- row-wise Adam


def _fbgemm_partial_rowwise_adam(
    c: RowwiseAdamConfig,
    w: NDArray[np.float64],
    g: NDArray[np.float64],
    m: NDArray[np.float64],
    v: float,
    t: int,
) -> tuple[NDArray[np.float64], NDArray[np.float64], float]:
    """FBGEMM's PARTIAL_ROWWISE_ADAM update of one row in float64 (weight_decay 0;
    codegen/genscript/optimizers.py, partial_rowwise_adam), its global `iter` replaced by
    the row's own step `t`, and its eps given as ours: FBGEMM adds eps to sqrt(v_hat),
    Keras (and we) to sqrt(v), i.e. eps_fbgemm = epsilon / sqrt(1 - beta_2**t).
        v = g_avg_square * (1 - beta2) + v * beta2;  v_hat = v / (1 - beta2**iter)
        m = m * beta1 + (1 - beta1) * g
        w -= lr * (m / (1 - beta1**iter) / (sqrtf(v_hat) + eps))"""
    b1, b2 = float(F32(c.beta_1)), float(F32(c.beta_2))  # the powers: of float32 betas
    # the EMA weights as Keras casts them: 1 - beta rounded to float32 once (FBGEMM takes
    # 1 - float32(beta): 1e-5 apart in v for beta_2 = 0.999, a convention, not the formula)
    one_minus_b1, one_minus_b2 = float(F32(1 - c.beta_1)), float(F32(1 - c.beta_2))
    eps = c.epsilon / math.sqrt(1 - b2**t)
    v = float(np.mean(g * g)) * one_minus_b2 + v * (1 - one_minus_b2)
    v_hat = v / (1 - b2**t)
    m = m * (1 - one_minus_b1) + one_minus_b1 * g
    w = w - c.learning_rate * (m / (1 - b1**t) / (math.sqrt(v_hat) + eps))
    return w, m, v


@pytest.mark.parametrize("dim", [1, 3, 16, 64])
@pytest.mark.parametrize(
    "config",
    [
        RowwiseAdamConfig(momentum_dtype="float32"),
        RowwiseAdamConfig(momentum_dtype="float32", learning_rate=0.01, beta_1=0.8,
                          beta_2=0.99, epsilon=1e-3),
    ],
    ids=["defaults", "custom"],
)  # fmt: skip
def test_rowwise_adam_is_fbgemms_formula(config: RowwiseAdamConfig, dim: int) -> None:
    """Sparse rows over 10 pushes, each row's own step, against FBGEMM's formula in
    float64: equal to float32 rounding (a wrong epsilon placement is ~1e-3 off with
    epsilon 1e-3, a global step instead of the row's ~1e-1)."""
    n = 10
    rng = np.random.default_rng(100 + dim)
    w = rng.uniform(-0.05, 0.05, (n, dim)).astype(np.float32)
    ref_w = w.astype(np.float64)
    ref_m = np.zeros((n, dim))
    ref_v = np.zeros(n)
    ref_t = np.zeros(n, dtype=np.int64)
    opt = make_optimizer(config)
    slots = opt.initial_slots(n, dim)
    for rows, g in _sparse_pushes(n, dim, 10, seed=dim):
        new_w, new_s = opt.update(w[rows], g, slots[rows])
        w[rows], slots[rows] = new_w, new_s
        for k, r in enumerate(rows.tolist()):
            ref_t[r] += 1
            ref_w[r], ref_m[r], ref_v[r] = _fbgemm_partial_rowwise_adam(
                config, ref_w[r], g[k].astype(np.float64), ref_m[r], ref_v[r], int(ref_t[r])
            )
    np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=1e-7)
    # m cancels (g - m): judged against its scale, as float32 rounds it
    np.testing.assert_allclose(slots[:, :dim], ref_m, rtol=1e-5, atol=1e-6 * np.abs(ref_m).max())
    np.testing.assert_allclose(slots[:, dim], ref_v, rtol=1e-5)
    assert slots[:, dim + 1].tolist() == ref_t.tolist()
    assert len(set(ref_t.tolist())) > 2  # rows at different steps


def _rowwise_adam_numpy(
    c: RowwiseAdamConfig, w: NDArray[np.float32], g: NDArray[np.float32], s: NDArray[np.float32]
) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """The module docstring's formulas, numpy float32 one operation at a time, m rounded
    to bfloat16 by arithmetic (not by lookup_table.core.precision)."""
    dim = w.shape[1]
    m, v, step = s[:, :dim], s[:, dim : dim + 1], s[:, dim + 1 :]
    new_m = (g - m) * F32(1 - c.beta_1) + m
    if c.momentum_dtype == "bfloat16":
        new_m = _bf16_nearest(new_m)
    squares = np.zeros((w.shape[0], 1), np.float32)
    for j in range(dim):
        squares += g[:, j : j + 1] * g[:, j : j + 1]
    new_v = (squares / F32(dim) - v) * F32(1 - c.beta_2) + v
    t = step + F32(1)
    b1 = np.array([[F32(c.beta_1) ** F32(x)] for x in t[:, 0]], np.float32)
    b2 = np.array([[F32(c.beta_2) ** F32(x)] for x in t[:, 0]], np.float32)
    alpha = F32(c.learning_rate) * np.sqrt(F32(1) - b2) / (F32(1) - b1)
    new_w = w - new_m * alpha / (np.sqrt(new_v) + F32(c.epsilon))
    return new_w, np.concatenate([new_m, new_v, t], axis=1)


@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "float32"])
def test_rowwise_adam_is_its_formulas_in_float32(momentum_dtype: Any) -> None:
    """Op for op as the docstring says, with bfloat16's rounding of m in between
    (to 2 ulp: the powers come from libm's powf here, numpy's there)."""
    c = RowwiseAdamConfig(learning_rate=0.0123, beta_1=0.85, beta_2=0.997, epsilon=1e-6,
                          momentum_dtype=momentum_dtype)  # fmt: skip
    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 16)).astype(np.float32)
    g = (rng.standard_normal((300, 16)) * 10.0 ** rng.integers(-8, 3, (300, 1))).astype(F32)
    s = np.abs(rng.standard_normal((300, 18))).astype(np.float32)
    s[:, 16:17] *= F32(1e-3)
    s[:, 17] = rng.integers(0, 50, 300)
    got_w, got_s = make_optimizer(c).update(w, g, s)
    want_w, want_s = _rowwise_adam_numpy(c, w, g, s)
    np.testing.assert_array_max_ulp(got_s, want_s, maxulp=0)
    np.testing.assert_array_max_ulp(got_w, want_w, maxulp=2)
    if momentum_dtype == "bfloat16":  # m is what bfloat16 stores: nothing lost storing it
        assert not (got_s[:, :16].view(np.uint32) & np.uint32(0xFFFF)).any()


def test_rowwise_adam_at_dim_1_is_adam_bit_for_bit() -> None:
    """One coordinate: its mean of g**2 is g**2, and row-wise Adam is Adam, per-row steps
    and all (m stored as float32)."""
    kw = {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-3}
    adam = Adam(AdamConfig(**kw))  # type: ignore[arg-type]
    rowwise = RowwiseAdam(RowwiseAdamConfig(momentum_dtype="float32", **kw))  # type: ignore[arg-type]
    n = 40
    w_a = np.random.default_rng(1).standard_normal((n, 1)).astype(np.float32)
    w_r = w_a.copy()
    s_a, s_r = adam.initial_slots(n, 1), rowwise.initial_slots(n, 1)
    for rows, g in _sparse_pushes(n, 1, 30, seed=2):
        w_a[rows], s_a[rows] = adam.update(w_a[rows], g, s_a[rows])
        w_r[rows], s_r[rows] = rowwise.update(w_r[rows], g, s_r[rows])
    assert w_r.tobytes() == w_a.tobytes()
    assert s_r.tobytes() == s_a.tobytes()  # m, v, step: the same columns at dim 1
    assert len(set(s_a[:, 2].tolist())) > 5  # rows at many different steps


@pytest.fixture(scope="module")
def tf() -> Iterator[Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    yield pytest.importorskip(
        "tensorflow", reason="tensorflow is not importable: the Keras comparison needs it"
    )


def test_rowwise_adam_at_dim_1_matches_keras_adam(tf: Any) -> None:
    """50 rows of one coordinate, every row every step, 30 steps: Keras' Adam within 1e-6."""
    rng = np.random.default_rng(20240611)
    w0 = rng.uniform(-0.05, 0.05, (50, 1)).astype(np.float32)
    var = tf.Variable(w0)
    keras_opt = tf.keras.optimizers.Adam()
    opt = make_optimizer(RowwiseAdamConfig(momentum_dtype="float32"))
    w, slots = w0, opt.initial_slots(50, 1)
    for _ in range(30):
        g = rng.standard_normal((50, 1), dtype=np.float32)
        keras_opt.apply_gradients([(tf.constant(g), var)])
        w, slots = opt.update(w, g, slots)
    np.testing.assert_allclose(w, var.numpy(), rtol=1e-6, atol=1e-9)
    assert np.abs(w - w0).max() > 1e-2


def test_rowwise_adam_rows_use_their_own_step() -> None:
    opt = make_optimizer(RowwiseAdamConfig())
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 8), dtype=np.float32)
    slots = opt.initial_slots(4, 8)
    w_start = w.copy()
    for rows in ([0, 1], [1, 2], [0, 1, 2, 3]):
        g = rng.standard_normal((len(rows), 8), dtype=np.float32)
        w[rows], slots[rows] = opt.update(w[rows], g, slots[rows])
    assert slots[:, -1].tolist() == [2.0, 3.0, 2.0, 1.0]
    fresh_w, fresh_s = opt.update(w_start[3:], g[3:], opt.initial_slots(1, 8))
    assert fresh_w.tobytes() == w[3:].tobytes() and fresh_s.tobytes() == slots[3:].tobytes()


# ---------------------------------------------------------------- the protocol's guarantees


@rowwise_params
def test_update_is_pure_and_layout_independent(config: Any) -> None:
    opt = make_optimizer(config)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((6, 5), dtype=np.float32)
    slots = opt.initial_slots(6, 5)
    w, slots = opt.update(w, rng.standard_normal((6, 5), dtype=np.float32), slots)
    g = rng.standard_normal((6, 5), dtype=np.float32)
    want_w, want_s = opt.update(w, g, slots)
    copies = [a.copy() for a in (w, g, slots)]
    for a in copies:
        a.flags.writeable = False
    strided = []
    for a in (w, g, slots):
        wide = np.zeros((a.shape[0], 2 * a.shape[1]), dtype=np.float32)
        wide[:, ::2] = a
        strided.append(wide[:, ::2])
    for inputs in (copies, strided):
        got_w, got_s = opt.update(*inputs)
        assert got_w.tobytes() == want_w.tobytes() and got_s.tobytes() == want_s.tobytes()
        assert got_w.flags.writeable and not np.shares_memory(got_w, inputs[0])
    assert [a.tobytes() for a in copies] == [a.tobytes() for a in (w, g, slots)]


@rowwise_params
def test_update_at_equals_update(config: Any) -> None:
    opt = make_optimizer(config)
    rng = np.random.default_rng(11)
    dim = 6
    width = dim + opt.slot_width(dim)
    values = rng.standard_normal((50, width)).astype(np.float32)
    values[:, dim:] = np.abs(values[:, dim:])  # accumulators, v and steps are >= 0
    extra = values[40:].copy()
    at = rng.permutation(40)[:20].astype(np.intp)
    at[::3] = -1 - rng.permutation(10)[: at[::3].shape[0]]
    items = np.where((at >= 0)[:, None], values[np.maximum(at, 0)], extra[np.maximum(-1 - at, 0)])
    g = rng.standard_normal((20, dim), dtype=np.float32)
    want_w, want_s = opt.update(items[:, :dim], g, items[:, dim:])
    rows, new_items = opt.update_at(values, at, extra, g)
    assert rows.tobytes() == want_w.tobytes()
    assert new_items[:, dim:].tobytes() == want_s.tobytes()


@rowwise_params
def test_next_slots_never_read_the_rows(config: Any) -> None:
    """A replay recomputes slots from the gradients alone: `update` is `finish` of them."""
    opt = make_optimizer(config)
    rng = np.random.default_rng(2)
    g = rng.standard_normal((5, 4), dtype=np.float32)
    s = opt.next_slots(g, opt.initial_slots(5, 4))
    for w in (np.zeros((5, 4), np.float32), rng.standard_normal((5, 4), dtype=np.float32)):
        new_w, new_s = opt.update(w, g, opt.initial_slots(5, 4))
        assert new_s.tobytes() == s.tobytes()
        assert new_w.tobytes() == opt.finish(w, g, s).tobytes()


# ---------------------------------------------------------------- stored bytes


# bytes of one row's stored value (the item without its key): dim 16 and 64
VALUE_BYTES = {
    ("adam", "float32"): (196, 772),
    ("adam", "float16"): (164, 644),
    ("sgd", "float32"): (64, 256),
    ("sgd", "bfloat16"): (32, 128),
    ("adagrad", "float32"): (128, 512),
    ("rowwise_adagrad", "float32"): (68, 260),
    ("rowwise_adagrad", "float16"): (36, 132),
    ("rowwise_adam", "float32"): (104, 392),  # m as bfloat16, v and step float32
    ("rowwise_adam", "float16"): (72, 264),
    ("rowwise_adam-f32", "float16"): (104, 392),
}


@pytest.mark.parametrize(
    ("case", "dtype"), list(VALUE_BYTES), ids=[f"{c}-{d}" for c, d in VALUE_BYTES]
)
def test_value_bytes_per_row(case: str, dtype: Any) -> None:
    opt = make_optimizer(EVERY[case])
    assert (value_bytes(opt, 16, dtype), value_bytes(opt, 64, dtype)) == VALUE_BYTES[case, dtype]


def _items(opt: Optimizer, n: int, dim: int, seed: int) -> NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, dim), dtype=np.float32)
    slots = opt.initial_slots(n, dim)
    for _ in range(3):
        w, slots = opt.update(w, rng.standard_normal((n, dim), dtype=np.float32), slots)
    return np.concatenate([w, slots], axis=1)


@pytest.mark.parametrize("case", list(EVERY))
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_items_round_trip_through_their_bytes(case: str, dtype: Any) -> None:
    """Slots come back bit for bit in every dtype (a bfloat16 m is stored exactly); the
    row as its dtype rounds it; float32 items are their float32 bytes, as stored today."""
    opt = make_optimizer(EVERY[case])
    dim = 5
    items = _items(opt, 30, dim, seed=len(case))
    for rounding in ("nearest", "stochastic"):
        keys = rounding_keys(1, np.arange(30, dtype=np.uint64), 0)
        stored = encode_items(items, opt, dim, dtype, rounding=rounding, keys=keys)  # type: ignore[arg-type]
        assert stored.shape == (30, value_bytes(opt, dim, dtype)) and stored.dtype == np.uint8
        back = decode_items(stored, opt, dim, dtype)
        assert back[:, dim:].tobytes() == items[:, dim:].tobytes()
        assert np.allclose(back[:, :dim], items[:, :dim], rtol=2**-7)
        if all(part.dtype == "float32" for part in item_layout(opt, dim, dtype)):
            assert stored.tobytes() == items.astype("<f4").tobytes()
            assert back.tobytes() == items.tobytes()


def test_item_layout_and_bad_items() -> None:
    opt = make_optimizer(RowwiseAdamConfig())
    assert [(p.name, p.width, p.dtype) for p in item_layout(opt, 4, "float16")] == [
        ("row", 4, "float16"), ("momentum", 4, "bfloat16"), ("velocity", 1, "float32"),
        ("step", 1, "float32")]  # fmt: skip
    items = _items(opt, 3, 4, seed=1)
    with pytest.raises(ValueError, match=r"items: expected float32 \(n, 10\) for dim 4 .* got"):
        encode_items(items[:, :9].copy(), opt, 4, "float16")
    stored = encode_items(items, opt, 4, "float16")
    with pytest.raises(ValueError, match=r"values: expected uint8 \(n, 24\) for dim 4 as float16"):
        decode_items(stored[:, :-1], opt, 4, "float16")
    with pytest.raises(ValueError, match="dim: expected >= 1, got 0"):
        value_bytes(opt, 0, "float16")
