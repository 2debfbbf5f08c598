"""The optimizer math (lookup_table.core.optimizers): Keras parity, golden values, segment sum.

The Keras comparisons need tensorflow; they skip with a reason when it cannot be
imported. Everything else is pure numpy.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

import lookup_table.core.optimizers as optimizers
import lookup_table.core.optimizers.adam as adam_module
from lookup_table.config import (
    AdagradConfig,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    parse_config,
)
from lookup_table.core.optimizers import (
    SGD,
    Adagrad,
    Adam,
    Optimizer,
    check_finite,
    make_optimizer,
    segment_sum,
)

pytestmark = pytest.mark.unit

F32 = np.float32

# Every optimizer at its Keras defaults and with non-default hyperparameters. The
# non-default epsilons are large on purpose: epsilon outside instead of inside the
# sqrt (or the reverse) then changes the result by ~1e-4 relative, far above the
# tolerance, where at 1e-7 it would hide below float32 rounding.
CASES: dict[str, OptimizerConfig] = {
    "adam": AdamConfig(),
    "adam-custom": AdamConfig(learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-3),
    "sgd": SGDConfig(),
    "sgd-custom": SGDConfig(learning_rate=0.1),
    "sgd-momentum": SGDConfig(momentum=0.9),
    "sgd-nesterov": SGDConfig(momentum=0.9, nesterov=True),
    "sgd-nesterov-custom": SGDConfig(learning_rate=0.05, momentum=0.5, nesterov=True),
    "adagrad": AdagradConfig(),
    "adagrad-custom": AdagradConfig(learning_rate=0.1, initial_accumulator_value=0.5, epsilon=1e-3),
}
case_params = pytest.mark.parametrize("config", list(CASES.values()), ids=list(CASES))


def rel_error(actual: NDArray[Any], desired: NDArray[Any]) -> float:
    """max |a - d| / max(|d|, 1e-6 * max|D|) over the arrays, 0.0 if they are equal.

    Relative to each value, floored at a millionth of the array's largest value:
    a weight or moment that happens to sit next to zero is judged against the
    array's scale, not against its own tiny size (which would turn a harmless
    last-bit difference into a huge "relative" error). Both sides run the same
    float32 ops in the same order; the only source of difference is a math
    kernel (pow) rounding differently in the last bit, ~6e-8 relative per step,
    which stays far below 1e-6 after 30 steps. Real mistakes are far above it:
    epsilon on the wrong side of the sqrt ~1e-4 (with epsilon=1e-3), a global
    instead of per-row bias correction ~1e-1.
    """
    a = np.asarray(actual, dtype=np.float64)
    d = np.asarray(desired, dtype=np.float64)
    assert a.shape == d.shape
    if a.size == 0:
        return 0.0
    floor = max(1e-6 * float(np.max(np.abs(d))), float(np.finfo(np.float32).tiny))
    return float(np.max(np.abs(a - d) / np.maximum(np.abs(d), floor)))


def frozen(*arrays: NDArray[Any]) -> None:
    """Make arrays read-only, so that any in-place write to them raises."""
    for arr in arrays:
        arr.flags.writeable = False


# ---------------------------------------------------------------- the API


def test_all_is_sorted_and_complete() -> None:
    assert optimizers.__all__ == sorted(optimizers.__all__, key=lambda s: (not s.isupper(), s))
    for name in optimizers.__all__:
        assert hasattr(optimizers, name), name
    for module in ("adam", "sgd", "adagrad", "base", "gradients"):
        sub = getattr(optimizers, module)
        missing = set(sub.__all__) - set(optimizers.__all__)
        assert not missing, f"{module} exports {missing} but the package does not"


def test_core_imports_no_asyncio_network_or_tensorflow() -> None:
    """The core is pure: numpy, numba and the stdlib (docs/architecture.md)."""
    code = (
        "import sys, lookup_table.core.optimizers\n"
        "bad = ('asyncio', 'aiohttp', 'aiomcache', 'tensorflow', 'keras', 'lookup_table.store',\n"
        "       'lookup_table.config')\n"
        "print(sorted(m for m in bad if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("config", "cls", "slot_names", "width"),
    [
        (AdamConfig(), Adam, ("momentum", "velocity", "step"), 2 * 8 + 1),
        (SGDConfig(), SGD, (), 0),
        (SGDConfig(momentum=0.9), SGD, ("momentum",), 8),
        (SGDConfig(momentum=0.9, nesterov=True), SGD, ("momentum",), 8),
        (AdagradConfig(), Adagrad, ("accumulator",), 8),
    ],
    ids=["adam", "sgd", "sgd-momentum", "sgd-nesterov", "adagrad"],
)
def test_make_optimizer_slots(
    config: OptimizerConfig, cls: type, slot_names: tuple[str, ...], width: int
) -> None:
    opt: Optimizer = make_optimizer(config)
    assert isinstance(opt, cls)
    assert opt.config is config
    assert opt.slot_names == slot_names
    assert opt.slot_width(8) == width
    slots = opt.initial_slots(5, 8)
    assert slots.dtype == np.float32 and slots.shape == (5, width)
    # the same for every row: the store lays out new rows' items from one of them
    np.testing.assert_array_equal(slots, np.broadcast_to(opt.initial_slots(1, 8), slots.shape))


def test_initial_slots_values() -> None:
    assert not make_optimizer(AdamConfig()).initial_slots(3, 4).any()  # m, v and step all 0
    assert not make_optimizer(SGDConfig(momentum=0.5)).initial_slots(3, 4).any()
    acc = make_optimizer(AdagradConfig(initial_accumulator_value=0.25)).initial_slots(3, 4)
    assert (acc == F32(0.25)).all()
    assert (make_optimizer(AdagradConfig()).initial_slots(2, 2) == F32(0.1)).all()


def test_make_optimizer_rejects_other_configs() -> None:
    with pytest.raises(ValueError, match="unknown optimizer config .*AdamConfig, SGDConfig"):
        make_optimizer(object())  # type: ignore[arg-type]


@case_params
def test_update_rejects_bad_arrays(config: OptimizerConfig) -> None:
    opt = make_optimizer(config)
    w = np.zeros((3, 4), dtype=np.float32)
    slots = opt.initial_slots(3, 4)
    with pytest.raises(ValueError, match=r"grads: expected a float32 array .*got float64"):
        opt.update(w, w.astype(np.float64), slots)
    with pytest.raises(ValueError, match=r"grads: expected the shape of weights \(3, 4\)"):
        opt.update(w, w[:2], slots)
    with pytest.raises(ValueError, match=r"slots: expected shape \(3, "):
        opt.update(w, w, np.zeros((3, opt.slot_width(4) + 1), dtype=np.float32))


# ---------------------------------------------------------------- config round trip


@case_params
def test_config_round_trip(config: OptimizerConfig) -> None:
    """TOML -> ClusterConfig -> dict -> ClusterConfig, and the optimizer keeps it."""
    fields = dataclasses.asdict(config)
    body = "\n".join(
        f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in fields.items()
    )
    text = f'namespace = "t"\nmemcached = ["127.0.0.1:11211"]\n[optimizer]\n{body}\n'
    cluster = parse_config(tomllib.loads(text))
    assert cluster.optimizer == config
    assert parse_config(cluster.to_dict()) == cluster
    assert type(config)(**dataclasses.asdict(config)) == config
    assert make_optimizer(cluster.optimizer).config == config


# ---------------------------------------------------------------- one step by hand


def _steps(config: OptimizerConfig, grads: list[list[float]]) -> tuple[NDArray[Any], Any]:
    opt = make_optimizer(config)
    w = np.array([[1.0, -1.0]], dtype=np.float32)
    slots = opt.initial_slots(1, 2)
    for g in grads:
        w, slots = opt.update(w, np.array([g], dtype=np.float32), slots)
    return w[0], slots[0]


def test_adam_one_step_by_hand() -> None:
    # t = 1: alpha = 0.001 * sqrt(1 - 0.999) / (1 - 0.9) = 3.16227766e-4
    # g = 0.5:  m = 0.1 * 0.5 = 0.05,  v = 0.001 * 0.25 = 2.5e-4, sqrt(v) = 0.0158113883
    #           w = 1 - 0.05 * alpha / (0.0158113883 + 1e-7) = 0.999000006325
    # g = -2:   m = -0.2, v = 0.004, sqrt(v) = 0.0632455532
    #           w = -1 + 0.2 * alpha / (0.0632455532 + 1e-7) = -0.999000001581
    w, slots = _steps(AdamConfig(), [[0.5, -2.0]])
    assert w.tolist() == pytest.approx([0.999000006325, -0.999000001581], rel=1e-7)
    assert slots.tolist() == pytest.approx([0.05, -0.2, 2.5e-4, 0.004, 1.0], rel=1e-6)


def test_sgd_one_step_by_hand() -> None:
    w, slots = _steps(SGDConfig(), [[0.5, -2.0]])  # w -= 0.01 * g
    assert w.tolist() == pytest.approx([0.995, -0.98], rel=1e-7)
    assert slots.shape == (0,)


def test_sgd_momentum_two_steps_by_hand() -> None:
    # step 1: m = 0.9 * 0 - 0.01 * g = [-0.005, 0.02];  w += m -> [0.995, -0.98]
    # step 2: m = 0.9 * m - 0.01 * g = [-0.0095, 0.038]; w += m -> [0.9855, -0.942]
    w, m = _steps(SGDConfig(momentum=0.9), [[0.5, -2.0], [0.5, -2.0]])
    assert m.tolist() == pytest.approx([-0.0095, 0.038], rel=1e-6)
    assert w.tolist() == pytest.approx([0.9855, -0.942], rel=1e-6)


def test_sgd_nesterov_one_step_by_hand() -> None:
    # m = -0.01 * g = [-0.005, 0.02]; w += 0.9 * m - 0.01 * g = [-0.0095, 0.038]
    w, m = _steps(SGDConfig(momentum=0.9, nesterov=True), [[0.5, -2.0]])
    assert m.tolist() == pytest.approx([-0.005, 0.02], rel=1e-6)
    assert w.tolist() == pytest.approx([0.9905, -0.962], rel=1e-6)


def test_adagrad_one_step_by_hand() -> None:
    # accumulator = 0.1 + g**2 = [0.35, 4.1]
    # w -= 0.001 * g / sqrt(accumulator + 1e-7):
    #   1 - 0.0005 / 0.5916080...  = 0.999154845866
    #  -1 + 0.002  / 2.0248456...  = -0.999012270415
    w, acc = _steps(AdagradConfig(), [[0.5, -2.0]])
    assert acc.tolist() == pytest.approx([0.35, 4.1], rel=1e-7)
    assert w.tolist() == pytest.approx([0.999154845866, -0.999012270415], rel=1e-7)


# ---------------------------------------------------------------- golden trajectories


def _golden_inputs() -> tuple[NDArray[np.float32], list[NDArray[np.float32]]]:
    """4 x 3 rows and 3 steps of gradients, all exactly representable (no RNG)."""
    i = np.arange(4).reshape(-1, 1)
    j = np.arange(3)
    w0 = ((i - 2 * j) / 16).astype(np.float32)
    grads = [(((i + j + s) % 5 - 2) / 4).astype(np.float32) for s in range(3)]
    return w0, grads


# After 3 steps: column 0 of the rows, and the slots of row 1. Pinned as float32
# (shortest repr). SGD and Adagrad use only + - * / sqrt, which IEEE 754 rounds
# exactly: pinned to the bit. Adam also calls pow, which a numpy build with other
# math kernels may round differently: pinned to 2 ulp.
GOLDEN: dict[str, tuple[OptimizerConfig, list[str], list[str], int]] = {
    "adam": (
        AdamConfig(),
        ["0.0026527226", "0.064084157", "0.12342732", "0.18540491"],
        [
            "0.0047500003",
            "0.0725",
            "0.015249997",
            "0.00012487508",
            "0.00031243754",
            "0.0005621251",
            "3.0",
        ],
        2,
    ),
    "sgd": (SGDConfig(), ["0.0075", "0.062499996", "0.1175", "0.185"], [], 0),
    "sgd-momentum": (
        SGDConfig(momentum=0.9),
        ["0.0183", "0.066775", "0.11525001", "0.17622501"],
        ["-0.00047500012", "-0.00725", "-0.0015249997"],
        0,
    ),
    "sgd-nesterov": (
        SGDConfig(momentum=0.9, nesterov=True),
        ["0.02397", "0.0663475", "0.108725004", "0.17485249"],
        ["-0.00047500012", "-0.00725", "-0.0015249997"],
        0,
    ),
    "adagrad": (
        AdagradConfig(),
        ["0.0012344037", "0.062593125", "0.12360133", "0.18671563"],
        ["0.225", "0.4125", "0.6625"],
        0,
    ),
}


@pytest.mark.parametrize(
    ("config", "column0", "row1_slots", "max_ulp"), list(GOLDEN.values()), ids=list(GOLDEN)
)
def test_golden_trajectory(
    config: OptimizerConfig, column0: list[str], row1_slots: list[str], max_ulp: int
) -> None:
    opt = make_optimizer(config)
    w, grads = _golden_inputs()
    slots = opt.initial_slots(4, 3)
    for g in grads:
        w, slots = opt.update(w, g, slots)
    want_w = np.array(column0, dtype=np.float32)
    want_slots = np.array(row1_slots, dtype=np.float32)
    np.testing.assert_array_max_ulp(w[:, 0], want_w, maxulp=max_ulp)
    np.testing.assert_array_max_ulp(slots[1], want_slots, maxulp=max_ulp)


# ---------------------------------------------------------------- purity, sparsity


@case_params
def test_update_never_mutates_its_inputs(config: OptimizerConfig) -> None:
    opt = make_optimizer(config)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((6, 4), dtype=np.float32)
    g = rng.standard_normal((6, 4), dtype=np.float32)
    slots = opt.initial_slots(6, 4)
    w, slots = opt.update(w, g, slots)  # non-trivial slots (Adam: step 1)
    copies = [w.copy(), g.copy(), slots.copy()]
    frozen(w, g, slots)  # also what np.frombuffer rows look like: read-only
    new_w, new_slots = opt.update(w, g, slots)
    for before, after in zip(copies, (w, g, slots), strict=True):
        np.testing.assert_array_equal(before, after)
    for out in (new_w, new_slots):
        assert out.dtype == np.float32 and out.flags.writeable
        for arr in (w, g, slots):
            assert not np.shares_memory(out, arr)


@case_params
@pytest.mark.parametrize("shape", [(7, 5), (1, 20_011)], ids=["rows", "one-long-row"])
def test_every_array_layout_gives_the_same_bits(
    config: OptimizerConfig, shape: tuple[int, int]
) -> None:
    """Writable, read-only and strided inputs take different compiled kernels (Adam:
    `lookup_table.core.jit`'s layouts); they compute the same operations, so the same
    bits. One long row is how a dense parameter is stepped."""
    opt = make_optimizer(config)
    rng = np.random.default_rng(13)
    n, dim = shape
    w = rng.standard_normal(shape, dtype=np.float32)
    slots = opt.initial_slots(n, dim)
    for _ in range(2):  # non-trivial slots
        w, slots = opt.update(w, rng.standard_normal(shape, dtype=np.float32), slots)
    g = rng.standard_normal(shape, dtype=np.float32)
    want_w, want_slots = opt.update(w, g, slots)
    read_only = [a.copy() for a in (w, g, slots)]
    frozen(*read_only)
    strided = []
    for a in (w, g, slots):
        wide = np.zeros((a.shape[0], 2 * a.shape[1]), dtype=np.float32)
        wide[:, ::2] = a
        strided.append(wide[:, ::2])
    for inputs in (read_only, strided, [read_only[0], g, strided[2]]):
        got_w, got_slots = opt.update(*inputs)
        np.testing.assert_array_equal(got_w.view(np.uint32), want_w.view(np.uint32))
        np.testing.assert_array_equal(got_slots.view(np.uint32), want_slots.view(np.uint32))


def _items_with_history(
    opt: Optimizer, n: int, dim: int, rng: np.random.Generator
) -> NDArray[np.float32]:
    """n items (a row, then its slots) after a few steps each, and with Adam steps of
    every kind: first, late, past the tabulated powers and past float32's exact steps."""
    w = rng.standard_normal((n, dim), dtype=np.float32)
    slots = opt.initial_slots(n, dim)
    for _ in range(2):
        w, slots = opt.update(w, rng.standard_normal((n, dim), dtype=np.float32), slots)
    if isinstance(opt, Adam):
        slots[:, 2 * dim] = rng.choice([0, 1, 7, 4_999, (1 << 20) + 3, 1 << 24], n)
    return np.concatenate([w, slots], axis=1)


@case_params
@pytest.mark.parametrize("dim", [1, 16, 5])
def test_update_at_reads_items_where_they_are_and_equals_update_bit_for_bit(
    config: OptimizerConfig, dim: int
) -> None:
    """`update_at` steps items read in place: from a map of items (`values[at]`) or,
    where `at` < 0, from `extra` (the row cache's map and the rows it lacks). Its new
    rows and items are `update`'s on the gathered items, bit for bit (Adam's compiled
    pass, and its grads in every layout), and it writes to neither source."""
    opt = make_optimizer(config)
    rng = np.random.default_rng(dim)
    values = _items_with_history(opt, 300, dim, rng)
    extra = _items_with_history(opt, 40, dim, rng)
    at = rng.permutation(300)[:120].astype(np.intp)
    at[::3] = -1 - rng.permutation(40)[: at[::3].shape[0]]
    items = np.where((at >= 0)[:, None], values[np.maximum(at, 0)], extra[np.maximum(-1 - at, 0)])
    g = rng.standard_normal((120, dim), dtype=np.float32)
    want_rows, want_slots = opt.update(items[:, :dim], g, items[:, dim:])
    before = values.copy(), extra.copy()
    wide = np.zeros((120, 2 * dim), dtype=np.float32)
    wide[:, ::2] = g
    read_only = g.copy()
    frozen(read_only)
    for grads in (g, read_only, wide[:, ::2]):
        rows, new_items = opt.update_at(values, at, extra, grads)
        assert rows.tobytes() == want_rows.tobytes()
        assert new_items[:, :dim].tobytes() == want_rows.tobytes()
        assert new_items[:, dim:].tobytes() == want_slots.tobytes()
    assert values.tobytes() == before[0].tobytes() and extra.tobytes() == before[1].tobytes()
    rows, new_items = opt.update_at(values, np.arange(0, dtype=np.intp), extra, g[:0])
    assert rows.shape == (0, dim) and new_items.shape == (0, values.shape[1])


@pytest.mark.parametrize("dim", [1, 16])
def test_adam_update_at_takes_alpha_from_the_tabled_powers_bit_for_bit(dim: int) -> None:
    """Adam's one-pass `update_at` looks each row's beta powers up in the tables as they
    are; a step past them (or not whole) hands the call to the general path, which
    grows them. Both give `update`'s bits; the one pass covers every row of a table's
    steps, and stops at the first it cannot."""
    opt = Adam(AdamConfig(learning_rate=0.01, beta_1=0.81, beta_2=0.97, epsilon=1e-6))
    # the tables are shared by every test with these betas: start from fresh ones, so
    # one grown to its full size by another test still has room to grow here
    for beta in (0.81, 0.97):
        adam_module._POWER_TABLES.pop(float(np.float32(beta)), None)
    rng = np.random.default_rng(7 + dim)
    values = _items_with_history(opt, 200, dim, rng)
    have = adam_module._power_table(float(np.float32(0.81)), 1).shape[0]
    values[:, 3 * dim] = rng.integers(0, min(have, adam_module._power_table(
        float(np.float32(0.97)), 1).shape[0]) - 1, 200)  # fmt: skip
    extra = values[150:].copy()
    at = rng.permutation(150)[:100].astype(np.intp)
    at[::4] = -1 - rng.permutation(50)[: at[::4].shape[0]]
    g = rng.standard_normal((100, dim), dtype=np.float32)
    c = opt.config
    grown = have + 5  # past the table now, within what the general path tabulates
    for past in (None, grown, 1 << 21, 2.5, np.nan):
        if past is not None:
            values[at[37], 3 * dim] = past
        items = np.where(
            (at >= 0)[:, None], values[np.maximum(at, 0)], extra[np.maximum(-1 - at, 0)]
        )
        want_rows, want_slots = opt.update(items[:, :dim], g, items[:, dim:])
        rows, new_items = opt.update_at(values, at, extra, g)
        assert rows.tobytes() == want_rows.tobytes()
        assert new_items[:, dim:].tobytes() == want_slots.tobytes()
        stopped = adam_module._stepped_at(
            values, at, extra, g, np.empty(0, np.float32),
            adam_module._power_table(float(np.float32(c.beta_1)), 1),
            adam_module._power_table(float(np.float32(c.beta_2)), 1),
            np.float32(c.learning_rate), np.float32(1 - c.beta_1), np.float32(1 - c.beta_2),
            np.float32(c.epsilon), np.empty_like(rows), np.empty_like(new_items),
        )  # fmt: skip
        # the general path grew the tables past `grown`; 1 << 21 is past what they hold
        assert stopped == (-1 if past is None or past == grown else 37)


@case_params
def test_update_at_refuses_what_its_compiled_pass_could_read_past(config: OptimizerConfig) -> None:
    opt = make_optimizer(config)
    dim = 4
    width = dim + opt.slot_width(dim)
    values = np.zeros((10, width), np.float32)
    extra = np.zeros((2, width), np.float32)
    g = np.zeros((3, dim), np.float32)
    at = np.array([0, 9, -2], dtype=np.intp)
    opt.update_at(values, at, extra, g)  # the bounds themselves are fine
    for bad, match in (
        (np.array([0, 10, -1], dtype=np.intp), "outside 10 values"),
        (np.array([0, 1, -3], dtype=np.intp), "and 2 extra"),
        (np.array([0, 1], dtype=np.intp), "expected 3 intp positions"),
        (np.array([0, 1, 2], dtype=np.int32), "expected 3 intp positions"),
    ):
        with pytest.raises(ValueError, match=match):
            opt.update_at(values, bad, extra, g)
    with pytest.raises(ValueError, match=f"items of {width} floats"):
        opt.update_at(np.zeros((10, width + 1), np.float32), at, extra, g)
    with pytest.raises(ValueError, match="extra: expected C-contiguous"):
        opt.update_at(values, at, np.zeros((2, 2 * width), np.float32)[:, ::2], g)
    with pytest.raises(ValueError, match="grads"):
        opt.update_at(values, at, extra, g.astype(np.float64))


@case_params
def test_rows_are_independent(config: OptimizerConfig) -> None:
    """Updating rows together gives each row what updating it alone gives."""
    opt = make_optimizer(config)
    rng = np.random.default_rng(11)
    w = rng.standard_normal((5, 3), dtype=np.float32)
    slots = opt.initial_slots(5, 3)
    for _ in range(3):
        w, slots = opt.update(w, rng.standard_normal((5, 3), dtype=np.float32), slots)
    g = rng.standard_normal((5, 3), dtype=np.float32)
    together_w, together_s = opt.update(w, g, slots)
    for r in range(5):
        alone_w, alone_s = opt.update(w[r : r + 1], g[r : r + 1], slots[r : r + 1])
        np.testing.assert_array_equal(alone_w[0], together_w[r])
        np.testing.assert_array_equal(alone_s[0], together_s[r])


def test_adam_sparse_rows_use_their_own_step() -> None:
    """Rows pushed in different steps: each bias correction uses the row's own count."""
    opt = make_optimizer(AdamConfig())
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 8), dtype=np.float32)
    slots = opt.initial_slots(4, 8)
    w_start = w.copy()
    for rows in ([0, 1], [1, 2], [0, 1, 2, 3]):
        g = rng.standard_normal((len(rows), 8), dtype=np.float32)
        new_w, new_s = opt.update(w[rows], g, slots[rows])
        w[rows], slots[rows] = new_w, new_s
        if rows == [0, 1, 2, 3]:
            last_g = g
    assert slots[:, -1].tolist() == [2.0, 3.0, 2.0, 1.0]
    # Row 3 was first pushed at global step 3, yet it gets Adam's first step (t = 1):
    fresh_w, fresh_s = opt.update(w_start[3:], last_g[3:], opt.initial_slots(1, 8))
    np.testing.assert_array_equal(w[3], fresh_w[0])
    np.testing.assert_array_equal(slots[3], fresh_s[0])
    # ... whose size is about lr per coordinate (|m / sqrt(v)| = 1 at t = 1):
    np.testing.assert_allclose(np.abs(w[3] - w_start[3]), 0.001, rtol=1e-3)


def test_adam_step_saturates_at_2_24() -> None:
    """float32 counts exactly to 2**24; after that the step stops, bias correction is 1."""
    opt = make_optimizer(AdamConfig())
    slots = np.zeros((2, 3), dtype=np.float32)
    slots[:, 2] = [2.0**24 - 1, 2.0**24]
    w = np.zeros((2, 1), dtype=np.float32)
    g = np.ones((2, 1), dtype=np.float32)
    new_w, new_s = opt.update(w, g, slots)
    assert new_s[:, 2].tolist() == [2.0**24, 2.0**24]
    # m = 0.1, v = 0.001, alpha = lr: w = -0.001 * 0.1 / (sqrt(0.001) + 1e-7)
    assert new_w[:, 0].tolist() == pytest.approx([-0.0031622677] * 2, rel=1e-6)


# ---------------------------------------------------------------- parity with Keras


@pytest.fixture(scope="module")
def tf() -> Iterator[Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    yield pytest.importorskip(
        "tensorflow", reason="tensorflow is not importable: the Keras parity tests need it"
    )


KERAS_CLASSES = {"adam": "Adam", "sgd": "SGD", "adagrad": "Adagrad"}


def _keras_optimizer(tf: Any, config: OptimizerConfig) -> Any:
    kwargs = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
    return getattr(tf.keras.optimizers, KERAS_CLASSES[config.name])(**kwargs)


def _keras_slot(keras_opt: Any, name: str) -> NDArray[np.float32]:
    matches = [v for v in keras_opt.variables if v.path.endswith(f"_{name}")]
    assert len(matches) == 1, [v.path for v in keras_opt.variables]
    return np.asarray(matches[0].numpy())


@case_params
def test_config_names_and_defaults_are_keras(tf: Any, config: OptimizerConfig) -> None:
    """Every field is a Keras constructor argument, and the defaults are Keras' defaults."""
    keras_config = _keras_optimizer(tf, config).get_config()
    keras_defaults = getattr(tf.keras.optimizers, KERAS_CLASSES[config.name])().get_config()
    for field in dataclasses.fields(config):
        if field.name != "name":
            assert keras_config[field.name] == pytest.approx(getattr(config, field.name))
            assert keras_defaults[field.name] == pytest.approx(field.default), field.name


@case_params
def test_matches_keras(tf: Any, config: OptimizerConfig) -> None:
    """30 steps, 50 rows x 8, every row updated every step: equal to Keras within 1e-6."""
    n, dim, steps = 50, 8, 30
    rng = np.random.default_rng(20240611)
    w0 = rng.uniform(-0.05, 0.05, (n, dim)).astype(np.float32)
    grads = rng.standard_normal((steps, n, dim), dtype=np.float32)

    keras_opt = _keras_optimizer(tf, config)
    var = tf.Variable(w0)
    opt = make_optimizer(config)
    w, slots = w0, opt.initial_slots(n, dim)
    for g in grads:
        keras_opt.apply_gradients([(tf.constant(g), var)])
        w, slots = opt.update(w, g, slots)

    errors = {"weights": rel_error(w, var.numpy())}
    for k, name in enumerate(opt.slot_names):
        if name == "step":
            assert (slots[:, k * dim] == int(keras_opt.iterations.numpy())).all()
        else:
            errors[name] = rel_error(
                slots[:, k * dim : (k + 1) * dim], _keras_slot(keras_opt, name)
            )
    assert max(errors.values()) <= 1e-6, errors
    assert rel_error(w, w0) > 1e-3  # the rows did move: the comparison is not vacuous


def _adam_numpy(
    c: AdamConfig, w: NDArray[np.float32], g: NDArray[np.float32], s: NDArray[np.float32]
) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """The module docstring's formulas, one numpy float32 operation at a time."""
    f = np.float32
    dim = w.shape[1]
    m, v, step = s[:, :dim], s[:, dim : 2 * dim], s[:, 2 * dim :]
    new_m = (g - m) * f(1 - c.beta_1) + m
    new_v = (np.square(g) - v) * f(1 - c.beta_2) + v
    t = step + f(1)
    b1 = adam_module._beta_powers(c.beta_1, t)
    b2 = adam_module._beta_powers(c.beta_2, t)
    alpha = f(c.learning_rate) * np.sqrt(f(1) - b2) / (f(1) - b1)
    new_w = w - new_m * alpha / (np.sqrt(new_v) + f(c.epsilon))
    return new_w, np.concatenate([new_m, new_v, t], axis=1)


@pytest.mark.parametrize("dim", [1, 3, 16, 64])
def test_adam_compiled_equals_numpy_op_for_op(dim: int) -> None:
    """The compiled Adam (`lookup_table.core.jit`) is the formulas in numpy float32, bit
    for bit: large and tiny gradients, zeros, first and late steps, non-contiguous
    inputs (no fused multiply-add, no float64 on the way)."""
    rng = np.random.default_rng(dim)
    n = 500
    c = AdamConfig(learning_rate=0.0123, beta_1=0.85, beta_2=0.997, epsilon=1e-6)
    w = rng.standard_normal((n, dim)).astype(np.float32)
    g = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-30, 5, (n, 1))).astype(np.float32)
    g[::7] = 0
    s = np.abs(rng.standard_normal((n, 2 * dim + 1))).astype(np.float32)
    s[:, 2 * dim] = rng.integers(0, 5000, n)
    s[::5] = 0  # first steps
    opt = Adam(c)
    wide = np.zeros((n, dim + 2), dtype=np.float32)
    wide[:, 1 : dim + 1] = w  # a view with a stride of its own
    for weights in (w, wide[:, 1 : dim + 1]):
        got_w, got_s = opt.update(weights, g, s)
        want_w, want_s = _adam_numpy(c, w, g, s)
        assert got_w.tobytes() == want_w.tobytes()
        assert got_s.tobytes() == want_s.tobytes()


def test_adam_steps_check_shapes_before_the_compiled_pass() -> None:
    """`next_slots` and `finish` are public: slots that do not fit the rows are a
    ValueError, never a read past an array in the compiled loop."""
    opt = Adam(AdamConfig())
    g = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        opt.next_slots(g, np.zeros((4, 6), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        opt.next_slots(g, np.zeros((3, 7), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        opt.finish(g, g, np.zeros((4, 5), np.float32))


@pytest.mark.parametrize("beta", [0.8, 0.9, 0.99, 0.999, 0.9999])
def test_beta_powers_match_tf_scalar_pow(tf: Any, beta: float) -> None:
    """beta**t bit for bit as TF's Pow on 0-d float32 tensors (what Keras' Adam calls).

    np.power's float32 SIMD kernels (AVX-512) are not correctly rounded and differ
    from TF's scalar path (libm powf, subnormals flushed to zero) in ~20% of t.
    """
    chunk = 1000

    @tf.function
    def scalar_pows(b: Any, ts: Any) -> Any:  # one 0-d Pow per element, as in Keras
        return tf.stack([tf.pow(b, t) for t in tf.unstack(ts, num=chunk)])

    t = np.arange(1, 20_001, dtype=np.float32)  # reaches the subnormal range for beta <= 0.99
    expected = np.concatenate(
        [scalar_pows(tf.constant(F32(beta)), tf.constant(c)).numpy() for c in t.reshape(-1, chunk)]
    )
    got = adam_module._beta_powers(beta, t.reshape(-1, 1)).reshape(-1)
    assert got.view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    eager = [tf.pow(tf.constant(F32(beta)), tf.constant(v)).numpy() for v in t[::997]]
    assert np.array(eager, dtype=np.float32).tobytes() == got[::997].tobytes()


@pytest.mark.parametrize("beta", [0.9, 0.999])
def test_beta_powers_of_one_step_are_the_batch_bits(beta: float) -> None:
    """One row's step (a dense parameter's) takes a scalar path: the same bits as the
    same step among others, tabulated, past the table, fractional, negative, NaN, inf."""
    steps = [0, 1, 2, 17, 2**20 - 1, 2**20, 2**20 + 3, 2.5, -1, float("nan"), float("inf")]
    for t in steps:
        one = adam_module._beta_powers(beta, np.array([[t]], np.float32))
        batch = adam_module._beta_powers(beta, np.array([[t], [t], [1.5]], np.float32))
        assert one.shape == (1, 1)
        assert one.tobytes() == batch[:1].tobytes(), t


# ---------------------------------------------------------------- segment_sum


def naive_segment_sum(ids: list[Any], grads: NDArray[np.float32]) -> dict[Any, list[float]]:
    """The obvious dict loop: float32 sums in push order."""
    acc: dict[Any, NDArray[np.float32]] = {}
    for i, key in enumerate(ids):
        if key in acc:
            acc[key] = acc[key] + grads[i]
        else:
            acc[key] = grads[i].copy()
    return {k: v.tolist() for k, v in acc.items()}


def _object_ids(values: list[str]) -> NDArray[np.object_]:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


@pytest.mark.parametrize("kind", ["int64", "str"])
def test_segment_sum_matches_a_dict_loop_bit_for_bit(kind: str) -> None:
    rng = np.random.default_rng(5)
    raw = rng.zipf(1.3, size=4000) * 7919 - 50_000  # heavy duplicates, negative ids too
    ids: NDArray[Any] = (
        raw.astype(np.int64) if kind == "int64" else _object_ids([f"id-{v}" for v in raw.tolist()])
    )
    grads = rng.standard_normal((4000, 16), dtype=np.float32) * 100
    frozen(ids, grads)
    uniq, summed = segment_sum(ids, grads)
    assert uniq.dtype == ids.dtype and summed.dtype == np.float32
    assert uniq.tolist() == sorted(set(ids.tolist()))
    want = naive_segment_sum(ids.tolist(), grads)
    assert summed.shape == (len(want), 16)
    got = dict(zip(uniq.tolist(), summed.tolist(), strict=True))
    assert got == want  # exact: the same float32 additions in the same order


def test_segment_sum_without_duplicates_sorts_rows() -> None:
    ids = np.array([30, -4, 7], dtype=np.int64)
    grads = np.arange(6, dtype=np.float32).reshape(3, 2)
    uniq, summed = segment_sum(ids, grads)
    assert uniq.tolist() == [-4, 7, 30]
    assert summed.tolist() == [[2.0, 3.0], [4.0, 5.0], [0.0, 1.0]]
    assert not np.shares_memory(summed, grads)


@pytest.mark.parametrize(
    ("ids", "want"),
    [
        ([-4, 7, 30], [-4, 7, 30]),  # ascending and distinct: taken as they are
        ([-4, 7, 7, 30], [-4, 7, 30]),  # ascending with a duplicate: summed
        ([5], [5]),
        ([30, 7, -4], [-4, 7, 30]),
    ],
)
def test_segment_sum_of_sorted_or_unsorted_ids_equals_the_dict_loop(
    ids: list[int], want: list[int]
) -> None:
    arr = np.array(ids, dtype=np.int64)
    grads = np.arange(2 * len(ids), dtype=np.float32).reshape(-1, 2) + 0.5
    uniq, summed = segment_sum(arr, grads)
    assert uniq.tolist() == want
    naive = naive_segment_sum(ids, grads)
    assert dict(zip(uniq.tolist(), summed.tolist(), strict=True)) == naive
    assert not np.shares_memory(summed, grads) and not np.shares_memory(uniq, arr)


def test_segment_sum_small_example() -> None:
    ids = _object_ids(["banana", "apple", "banana", "banana"])
    grads = np.array([[1.0], [2.0], [0.5], [0.25]], dtype=np.float32)
    uniq, summed = segment_sum(ids, grads)
    assert uniq.tolist() == ["apple", "banana"]
    assert summed[:, 0].tolist() == [2.0, 1.75]


@pytest.mark.parametrize("dtype", [np.int64, object], ids=["int64", "str"])
def test_segment_sum_empty(dtype: Any) -> None:
    uniq, summed = segment_sum(np.empty(0, dtype=dtype), np.empty((0, 4), dtype=np.float32))
    assert uniq.shape == (0,) and uniq.dtype == dtype
    assert summed.shape == (0, 4) and summed.dtype == np.float32


def test_segment_sum_rejects_bad_input() -> None:
    g = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="ids: expected int64 .* got int32"):
        segment_sum(np.zeros(2, dtype=np.int32), g)
    with pytest.raises(ValueError, match="grads: expected float32 .* got float64"):
        segment_sum(np.zeros(2, dtype=np.int64), g.astype(np.float64))
    with pytest.raises(ValueError, match="grads: expected 3 rows, one per id, got 2"):
        segment_sum(np.zeros(3, dtype=np.int64), g)
    mixed = np.empty(2, dtype=object)
    mixed[:] = ["a", 7]
    with pytest.raises(ValueError, match="must hold only str, got 7"):
        segment_sum(mixed, g)


# ---------------------------------------------------------------- check_finite


def test_check_finite_passes_finite_and_integer_arrays() -> None:
    check_finite(np.full((3, 2), 3e38, dtype=np.float32), "tables.user")
    check_finite(np.arange(6).reshape(2, 3), "tables.user")
    check_finite(np.empty((0, 4), dtype=np.float32), "tables.user")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_check_finite_names_table_position_and_value(bad: float) -> None:
    grads = np.zeros((4, 3), dtype=np.float32)
    grads[2, 1] = bad
    grads[3, 0] = np.nan
    text = {"nan": "nan", "inf": "inf", "-inf": "-inf"}[str(bad)]
    with pytest.raises(ValueError) as info:
        check_finite(grads, "tables.user")
    assert str(info.value).startswith(
        f"tables.user: gradient is not finite: {text} at row 2, column 1; 2 of 12 values "
        "are NaN or Inf; check the trainer's loss"
    )


def test_check_finite_names_the_id() -> None:
    grads = np.zeros((2, 2), dtype=np.float32)
    grads[1, 1] = np.inf
    with pytest.raises(ValueError, match=r"row 1, column 1 \(id 'banana'\)"):
        check_finite(grads, "tables.fruit", ids=_object_ids(["apple", "banana"]))
    with pytest.raises(ValueError, match=r"row 1, column 1 \(id -42\)"):
        check_finite(grads, "tables.user", ids=np.array([7, -42], dtype=np.int64))


def test_check_finite_other_shapes() -> None:
    grads = np.zeros((2, 3, 4), dtype=np.float32)
    grads[1, 2, 3] = np.nan
    with pytest.raises(
        ValueError,
        match=r"^dense.mlp/kernel: gradient is not finite: nan at "
        r"index \[1, 2, 3\]; 1 of 24 values",
    ):
        check_finite(grads, "dense.mlp/kernel")
