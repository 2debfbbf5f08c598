"""Deterministic initial rows (lookup_table.core.initializers)."""

from __future__ import annotations

import decimal
import hashlib
import importlib.util
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lookup_table.core.initializers as initializers
from lookup_table.core.initializers import (
    INITIALIZER_DEFAULTS,
    InitializerSpec,
    initial_rows,
    initial_rows_many,
)
from lookup_table.core.keys import as_ids
from tests.strategies import int_id_arrays, str_id_lists
from tests.unit._fresh import fresh_json

pytestmark = pytest.mark.unit

ALL_NAMES = [
    "zeros",
    "zero",
    "constant",
    "uniform",
    "random_uniform",
    "normal",
    "random_normal",
    "truncated_normal",
]
RANDOM_NAMES = ["uniform", "normal", "truncated_normal"]
N_ROWS = 100_000
TRUNCATED_STD_FACTOR = 0.87962566103423978  # std of N(0, 1) truncated to [-2, 2]


def spec(name: str, **params: float) -> InitializerSpec:
    return InitializerSpec.from_dict({"name": name, **params})


def int_ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ------------------------------------------------------------------ golden rows
# The first floats of a new row, as float32 bit patterns: every trainer computes
# them, and rows created before a change would no longer match rows created after.

GOLDEN_ROW_BITS = {
    # initializer: (bits of row(seed=1, id=7)[:4], bits of row(seed=1, id="banana")[:4])
    "uniform": [3170977810, 3146197937, 3164652986, 1009709352],
    "normal": [1023127699, 1003898225, 3170099651, 3175635889],
}
GOLDEN_UNIFORM_BANANA = [
    0.02843598648905754,
    -0.035379309207201004,
    -0.022298559546470642,
    0.02110411785542965,
]
GOLDEN_NORMAL_BANANA = [
    -0.0522521547973156,
    0.02743110992014408,
    -0.03133375942707062,
    0.07305845618247986,
]


@pytest.mark.parametrize("name", ["uniform", "normal"])
def test_golden_first_floats_of_int_id(name: str) -> None:
    row = initial_rows(spec(name), seed=1, ids=int_ids(7, -1), dim=4)[0]
    assert row.view(np.uint32).tolist() == GOLDEN_ROW_BITS[name]


def test_golden_first_floats_of_str_id() -> None:
    banana = as_ids(["banana"])
    uniform = initial_rows(spec("uniform"), seed=1, ids=banana, dim=4)[0]
    normal = initial_rows(spec("normal"), seed=1, ids=banana, dim=4)[0]
    assert uniform.tolist() == [np.float32(v) for v in GOLDEN_UNIFORM_BANANA]
    assert normal.tolist() == [np.float32(v) for v in GOLDEN_NORMAL_BANANA]


def test_golden_rows_are_a_prefix_of_wider_rows() -> None:
    # counters are per column: a wider row starts with the same floats (uniform)
    wide = initial_rows(spec("uniform"), seed=1, ids=int_ids(7), dim=64)[0]
    assert wide[:4].view(np.uint32).tolist() == GOLDEN_ROW_BITS["uniform"]


def test_same_rows_in_a_fresh_interpreter() -> None:
    ids = np.random.default_rng(9).integers(-(2**63), 2**63 - 1, size=256, dtype=np.int64)
    got = fresh_json(
        f"""
        import json
        import numpy as np
        from lookup_table.core.initializers import InitializerSpec, initial_rows
        from lookup_table.core.keys import as_ids
        ids = np.random.default_rng(9).integers(-2**63, 2**63 - 1, size=256, dtype=np.int64)
        out = {{}}
        for name in {RANDOM_NAMES!r}:
            spec = InitializerSpec.from_dict({{"name": name}})
            out[name] = initial_rows(spec, seed=5, ids=ids, dim=16).view(np.uint32).tolist()
            out[name + "/str"] = initial_rows(
                spec, seed=5, ids=as_ids(["banana", "a b"]), dim=16).view(np.uint32).tolist()
        print(json.dumps(out))
        """
    )
    for name in RANDOM_NAMES:
        here = initial_rows(spec(name), seed=5, ids=ids, dim=16)
        assert got[name] == here.view(np.uint32).tolist(), name
        here_str = initial_rows(spec(name), seed=5, ids=as_ids(["banana", "a b"]), dim=16)
        assert got[name + "/str"] == here_str.view(np.uint32).tolist(), name


# ------------------------------------------------------------------ the same on every CPU

# sha256 of the rows of 50,000 ids x 16 (seed 7, mean 0.25): 800,000 values whose
# log1p/cos go through numpy's SIMD kernels. test_cpu_features.py reruns this file
# with AVX-512 and AVX2 dispatch disabled; the digests must not move.
GOLDEN_DIGESTS = {
    "normal": "7e133ae09283a93c4dbfb62d49f52faccbb4008fa8a79b1e4fdc89dd93b69d1a",
    "truncated_normal": "a7743441a9250b1cbd20417c7ce63a40319838e1b16b883fe13952c4612b5325",
}


@pytest.mark.parametrize("name", sorted(GOLDEN_DIGESTS))
def test_golden_digest_of_many_normal_rows(name: str) -> None:
    ids = np.arange(-25_000, 25_000, dtype=np.int64)
    rows = initial_rows(spec(name, mean=0.25), seed=7, ids=ids, dim=16)
    assert hashlib.sha256(rows.tobytes()).hexdigest() == GOLDEN_DIGESTS[name]


def _numpy_uniform01(base: np.ndarray, first: int, count: int) -> np.ndarray:
    """The module's formula for the uniform draws, in plain numpy (what the compiled
    `_uniform_block` replaces)."""
    counters = np.arange(first, first + count, dtype=np.uint64)
    bits = initializers.mix64(
        base[:, None] + (counters[None, :] + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    )
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


@pytest.mark.parametrize(("minval", "maxval"), [(-0.05, 0.05), (0.0, 1.0), (-3.0, 1e-3)])
def test_compiled_uniform_draws_and_rows_are_the_numpy_formulas_bits(
    minval: float, maxval: float
) -> None:
    """The uniform draws and uniform rows run compiled (one pass); the same bits as the
    formula in numpy float64 math, whatever the bases (all 64 bits used)."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 2**64, size=3000, dtype=np.uint64, endpoint=False)
    for first, count in [(0, 16), (32, 64), (5, 3)]:
        got = initializers._uniform01(base, first, count)
        assert got.tobytes() == _numpy_uniform01(base, first, count).tobytes()
    rows = initializers._rows_from(spec("uniform", minval=minval, maxval=maxval), base, 3000, 40)
    want = (minval + (maxval - minval) * _numpy_uniform01(base, 0, 40)).astype(np.float32)
    want = np.minimum(want, np.nextafter(np.float32(maxval), np.float32(minval)))
    assert rows.tobytes() == want.tobytes()
    assert rows.min() >= np.float32(minval) and rows.max() < np.float32(maxval)


@pytest.mark.parametrize(
    ("name", "mean"), [("normal", 0.0), ("normal", 0.3), ("truncated_normal", -1.0)]
)
def test_exact_path_agrees_with_float64(
    monkeypatch: pytest.MonkeyPatch, name: str, mean: float
) -> None:
    """Every value through the decimal path: the same floats as the float64 path."""
    ids = np.arange(400, dtype=np.int64)
    fast = initial_rows(spec(name, mean=mean), seed=7, ids=ids, dim=16)
    monkeypatch.setattr(initializers, "_HARD_MARGIN", math.inf)
    exact = initial_rows(spec(name, mean=mean), seed=7, ids=ids, dim=16)
    assert exact.tobytes() == fast.tobytes()


def test_hard_cases_are_rare_and_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, float]] = []
    exact_normal = initializers._exact_normal

    def counting(u1: float, u2: float) -> Any:
        calls.append((u1, u2))
        return exact_normal(u1, u2)

    monkeypatch.setattr(initializers, "_exact_normal", counting)
    initial_rows(spec("normal"), seed=7, ids=np.arange(100_000, dtype=np.int64), dim=16)
    assert 5 <= len(calls) <= 200  # ~1 in 47,000 of 1.6M values near a float32 tie


def test_nearest_float32_rounds_once() -> None:
    one, above = np.float32(1.0), np.nextafter(np.float32(1.0), np.float32(2.0))
    with decimal.localcontext(prec=50):  # the default 28 digits would drop the nudge
        tie = (decimal.Decimal(1) + decimal.Decimal(float(above))) / 2
        nudge = decimal.Decimal("1e-40")  # invisible in float64: float() rounds to the tie
        up, down = tie + nudge, tie - nudge
    assert initializers._nearest_float32(up) == above
    assert initializers._nearest_float32(down) == one
    assert initializers._nearest_float32(tie) == one  # ties to even
    assert initializers._nearest_float32(decimal.Decimal("-0.1")) == np.float32(-0.1)


# ------------------------------------------------------------------ shape and type


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("n", [0, 1, 5])
def test_every_initializer_is_float32_n_by_dim(name: str, n: int) -> None:
    rows = initial_rows(spec(name), seed=3, ids=np.arange(n, dtype=np.int64), dim=7)
    assert rows.dtype == np.float32
    assert rows.shape == (n, 7)
    assert np.isfinite(rows).all()
    str_rows = initial_rows(spec(name), seed=3, ids=as_ids([str(i) for i in range(n)]), dim=7)
    assert str_rows.dtype == np.float32
    assert str_rows.shape == (n, 7)


def test_zeros_and_constant() -> None:
    ids = int_ids(1, 2, 3)
    assert (initial_rows(spec("zeros"), seed=1, ids=ids, dim=4) == 0).all()
    assert (initial_rows(spec("constant"), seed=1, ids=ids, dim=4) == 0).all()
    rows = initial_rows(spec("constant", value=0.25), seed=1, ids=ids, dim=4)
    assert (rows == np.float32(0.25)).all()


@pytest.mark.parametrize(
    ("alias", "name"),
    [("random_uniform", "uniform"), ("random_normal", "normal"), ("zero", "zeros")],
)
def test_aliases_are_the_keras_names(alias: str, name: str) -> None:
    assert spec(alias) == spec(name)
    assert spec(alias).name == name
    ids = int_ids(1, 2, 3)
    a = initial_rows(spec(alias), seed=2, ids=ids, dim=8)
    b = initial_rows(spec(name), seed=2, ids=ids, dim=8)
    assert a.tobytes() == b.tobytes()


# ------------------------------------------------------------------ determinism


@given(name=st.sampled_from(RANDOM_NAMES), ids=int_id_arrays(max_size=40), data=st.data())
def test_same_id_same_row_in_any_batch(name: str, ids: np.ndarray, data: st.DataObject) -> None:
    dim = 8
    rows = initial_rows(spec(name), seed=11, ids=ids, dim=dim)
    order = data.draw(st.permutations(range(ids.shape[0])))
    shuffled = initial_rows(spec(name), seed=11, ids=ids[list(order)], dim=dim)
    assert shuffled.tobytes() == rows[list(order)].tobytes()
    for i in range(min(3, ids.shape[0])):
        alone = initial_rows(spec(name), seed=11, ids=ids[i : i + 1], dim=dim)
        assert alone.tobytes() == rows[i : i + 1].tobytes()


@given(name=st.sampled_from(RANDOM_NAMES), values=str_id_lists(max_size=10))
def test_same_str_id_same_row_in_any_batch(name: str, values: list[str]) -> None:
    rows = initial_rows(spec(name), seed=11, ids=as_ids(values), dim=4)
    for i, value in enumerate(values):
        alone = initial_rows(spec(name), seed=11, ids=as_ids([value]), dim=4)
        assert alone.tobytes() == rows[i : i + 1].tobytes()


@st.composite
def _parts(draw: st.DrawFn) -> tuple[InitializerSpec, int, np.ndarray, int]:
    name = draw(st.sampled_from(ALL_NAMES))
    params = {"value": 0.25} if name == "constant" else {}
    if name in ("uniform", "random_uniform") and draw(st.booleans()):
        params = {"minval": -1.0, "maxval": 3.0}
    ids = (
        as_ids(draw(str_id_lists(max_size=5)))
        if draw(st.integers(0, 5)) == 0
        else draw(int_id_arrays(max_size=30))
    )
    return spec(name, **params), draw(st.integers(0, 3)), ids, draw(st.sampled_from([1, 4, 8]))


@given(parts=st.lists(_parts(), max_size=8))
def test_many_tables_at_once_are_each_tables_rows(
    parts: list[tuple[InitializerSpec, int, np.ndarray, int]],
) -> None:
    """Tables of the same initializer and dim computed as one batch (different seeds,
    int and str ids, empty tables) give each table's rows bit for bit."""
    got = initial_rows_many(parts)
    assert len(got) == len(parts)
    for (init, seed, ids, dim), rows in zip(parts, got, strict=True):
        alone = initial_rows(init, seed=seed, ids=ids, dim=dim)
        assert rows.dtype == np.float32 and rows.shape == (ids.shape[0], dim)
        assert rows.tobytes() == alone.tobytes()


def test_many_tables_of_one_initializer_share_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """26 tables of one initializer and dim: one pass (one call of the row formula)."""
    calls = []
    real = initializers._rows_from
    monkeypatch.setattr(
        initializers,
        "_rows_from",
        lambda *a: calls.append(a[2]) or real(*a),  # type: ignore[func-returns-value]
    )
    parts = [(spec("uniform"), seed, np.arange(seed, seed + 50), 16) for seed in range(26)]
    got = initial_rows_many(parts)
    assert calls == [26 * 50]
    assert (
        got[3].tobytes() == initial_rows(spec("uniform"), seed=3, ids=parts[3][2], dim=16).tobytes()
    )


def test_truncated_normal_redraws_do_not_depend_on_the_batch() -> None:
    # With dim=64 about 95% of rows need a redraw round: the rows that do must get
    # the same values whichever other rows (and how many) share their batch.
    ids = np.arange(2000, dtype=np.int64)
    rows = initial_rows(spec("truncated_normal"), seed=3, ids=ids, dim=64)
    for chunk in (ids[::7], ids[1000:1003], ids[::-1]):
        again = initial_rows(spec("truncated_normal"), seed=3, ids=chunk, dim=64)
        assert again.tobytes() == rows[chunk].tobytes()


@pytest.mark.parametrize("dim", [1, 5, 64])
def test_truncated_normal_redraws_are_the_next_rounds_counters(dim: int) -> None:
    """The definition, computed whole: every round's normal values for every entry
    (`_normal` of full rows), and each entry takes the first round where |z| <= 2. The
    initializer computes only the entries it redraws: the same bits."""
    ids = np.arange(-3000, 3000, dtype=np.int64)
    p = spec("truncated_normal", mean=0.25, stddev=0.5).params
    base = initializers.combine(
        initializers.id_hashes(ids), initializers.stable_hash("init-seed:9")
    )
    rounds = [initializers._normal(base, r, dim) for r in range(6)]
    z, u1, u2 = (np.array(part) for part in rounds[0])
    pending = initializers._beyond_two(z, u1, u2)
    assert pending.any()
    for r in range(1, 6):
        rz, ru1, ru2 = rounds[r]
        z[pending], u1[pending], u2[pending] = rz[pending], ru1[pending], ru2[pending]
        pending &= initializers._beyond_two(rz, ru1, ru2)
    assert not pending.any()  # no entry of these ids needs a 7th round
    expected = initializers._normal_to_float32(p["mean"], p["stddev"], z, u1, u2)
    got = initial_rows(spec("truncated_normal", mean=0.25, stddev=0.5), seed=9, ids=ids, dim=dim)
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", RANDOM_NAMES)
def test_different_seeds_and_ids_differ(name: str) -> None:
    ids = np.arange(1000, dtype=np.int64)
    a = initial_rows(spec(name), seed=1, ids=ids, dim=16)
    b = initial_rows(spec(name), seed=2, ids=ids, dim=16)
    assert (a != b).any(axis=1).all()  # every row changes with the seed
    assert np.unique(a, axis=0).shape[0] == 1000  # no two ids share a row
    s = initial_rows(spec(name), seed=1, ids=as_ids([str(i) for i in range(1000)]), dim=16)
    assert (a != s).any(axis=1).all()  # 7 and "7" get different rows


# ------------------------------------------------------------------ distributions


@pytest.fixture(scope="module")
def stat_ids() -> np.ndarray:
    return np.random.default_rng(0).integers(-(2**63), 2**63 - 1, size=N_ROWS, dtype=np.int64)


def test_uniform_matches_keras_defaults(stat_ids: np.ndarray) -> None:
    rows = initial_rows(spec("uniform"), seed=1, ids=stat_ids, dim=8)
    assert rows.min() >= np.float32(-0.05)
    assert rows.max() < np.float32(0.05)
    assert rows.mean() == pytest.approx(0.0, abs=2e-4)
    assert rows.std() == pytest.approx(0.05 / math.sqrt(3), rel=0.01)
    # evenly filled: each of 10 bins holds ~10%
    hist, _ = np.histogram(rows, bins=10, range=(-0.05, 0.05))
    assert np.abs(hist / rows.size - 0.1).max() < 0.003


def test_uniform_custom_range_is_half_open() -> None:
    ids = np.arange(N_ROWS, dtype=np.int64)
    rows = initial_rows(spec("uniform", minval=1.0, maxval=1.0 + 2**-20), seed=1, ids=ids, dim=4)
    assert rows.min() >= np.float32(1.0)
    assert rows.max() < np.float32(1.0 + 2**-20)  # float32 rounding never reaches maxval


def test_normal_matches_keras_defaults(stat_ids: np.ndarray) -> None:
    rows = initial_rows(spec("normal"), seed=1, ids=stat_ids, dim=8).astype(np.float64)
    assert rows.mean() == pytest.approx(0.0, abs=3e-4)
    assert rows.std() == pytest.approx(0.05, rel=0.01)
    z = rows / 0.05
    assert np.mean(np.abs(z) <= 1) == pytest.approx(0.6827, abs=0.005)
    assert np.mean(np.abs(z) <= 2) == pytest.approx(0.9545, abs=0.003)
    assert np.mean(z**3) == pytest.approx(0.0, abs=0.02)  # symmetric
    assert np.mean(z**4) == pytest.approx(3.0, abs=0.05)  # normal tails


def test_normal_mean_and_stddev_params() -> None:
    ids = np.arange(N_ROWS, dtype=np.int64)
    rows = initial_rows(spec("normal", mean=1.0, stddev=0.5), seed=1, ids=ids, dim=4)
    assert rows.mean() == pytest.approx(1.0, abs=0.005)
    assert rows.std() == pytest.approx(0.5, rel=0.01)


def test_truncated_normal_matches_keras_defaults(stat_ids: np.ndarray) -> None:
    rows = initial_rows(spec("truncated_normal"), seed=1, ids=stat_ids, dim=8)
    assert np.abs(rows).max() <= np.float32(0.1)  # within 2 stddev
    assert rows.mean() == pytest.approx(0.0, abs=3e-4)
    assert rows.std() == pytest.approx(0.05 * TRUNCATED_STD_FACTOR, rel=0.01)

    # redrawn, not clipped: the band next to the bounds holds what the truncated
    # density says (clipping would pile ~4.6% of the values onto +-0.1)
    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    band = 2 * (phi(2.0) - phi(1.98)) / (2 * phi(2.0) - 1)  # |z| in (1.98, 2]
    assert np.mean(np.abs(rows) > np.float32(0.099)) == pytest.approx(band, rel=0.1)
    assert np.mean(np.abs(rows) == np.float32(0.1)) < 1e-4


def test_values_within_and_across_rows_are_uncorrelated(stat_ids: np.ndarray) -> None:
    rows = initial_rows(spec("normal"), seed=1, ids=stat_ids, dim=8).astype(np.float64)
    corr = np.corrcoef(rows, rowvar=False)  # columns of one row
    assert np.abs(corr - np.eye(8)).max() < 0.015
    seq = initial_rows(spec("normal"), seed=1, ids=np.arange(N_ROWS, dtype=np.int64), dim=8)
    neighbours = np.corrcoef(seq[:-1, 0], seq[1:, 0])[0, 1]  # ids i and i+1
    assert abs(neighbours) < 0.015


TF_AVAILABLE = importlib.util.find_spec("keras") is not None


@pytest.mark.skipif(not TF_AVAILABLE, reason="keras (tensorflow) is not installed")
def test_summary_statistics_match_keras(stat_ids: np.ndarray) -> None:
    """Same distribution as Keras' initializers (not the same values: ours are counter-based).

    Keras runs in a subprocess: importing TensorFlow takes seconds and must not
    change this process (warnings filters, threads).
    """
    keras_stats = fresh_json(
        """
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import json
        import numpy as np
        import keras
        out = {}
        for name, init in (
            ("uniform", keras.initializers.RandomUniform(seed=1)),
            ("normal", keras.initializers.RandomNormal(seed=1)),
            ("truncated_normal", keras.initializers.TruncatedNormal(seed=1)),
        ):
            v = np.asarray(init(shape=(100000, 8)), dtype=np.float64)
            out[name] = [v.mean(), v.std(), v.min(), v.max()]
        print(json.dumps(out))
        """
    )
    for name in RANDOM_NAMES:
        ours = initial_rows(spec(name), seed=1, ids=stat_ids, dim=8).astype(np.float64)
        mean, std, lo, hi = keras_stats[name]
        assert ours.mean() == pytest.approx(mean, abs=5e-4), name
        assert ours.std() == pytest.approx(std, rel=0.01), name
        if name != "normal":  # bounded: same support
            assert ours.min() == pytest.approx(lo, abs=1e-3), name
            assert ours.max() == pytest.approx(hi, abs=1e-3), name


# ------------------------------------------------------------------ InitializerSpec


def test_defaults_are_keras_defaults() -> None:
    assert InitializerSpec() == spec("uniform")
    assert spec("uniform").params == {"minval": -0.05, "maxval": 0.05}
    assert spec("normal").params == {"mean": 0.0, "stddev": 0.05}
    assert spec("truncated_normal").params == {"mean": 0.0, "stddev": 0.05}
    assert spec("constant").params == {"value": 0.0}
    assert spec("zeros").params == {}
    assert InitializerSpec.from_dict({}) == InitializerSpec()  # name defaults to uniform


@pytest.mark.parametrize("name", sorted(INITIALIZER_DEFAULTS))
def test_to_dict_round_trip(name: str) -> None:
    original = spec(name)
    assert InitializerSpec.from_dict(original.to_dict()) == original
    assert original.to_dict()["name"] == name


def test_params_are_floats() -> None:
    s = spec("uniform", minval=-1, maxval=2)
    assert s.params == {"minval": -1.0, "maxval": 2.0}
    assert all(type(v) is float for v in s.params.values())


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        ({"name": "glorot"}, r"^init\.name: unknown initializer 'glorot'.*uniform"),
        ({"name": 3}, r"^init\.name: expected a string, got 3"),
        ({"name": "uniform", "stddev": 1.0}, r"^init\.stddev: unknown parameter.*minval"),
        ({"name": "zeros", "value": 1.0}, r"^init\.value: unknown parameter.*no parameters"),
        ({"name": "normal", "seed": 1}, r"^init\.seed: unknown parameter"),
        ({"name": "normal", "stddev": "0.1"}, r"^init\.stddev: expected a number, got '0\.1'"),
        ({"name": "normal", "mean": True}, r"^init\.mean: expected a number, got True"),
        ({"name": "normal", "mean": None}, r"^init\.mean: expected a number, got None"),
        ({"name": "normal", "mean": float("nan")}, r"^init\.mean: expected a finite number"),
        ({"name": "constant", "value": float("inf")}, r"^init\.value: expected a finite"),
        ({"name": "uniform", "minval": 0.1, "maxval": 0.1}, r"^init: expected minval < maxval"),
        ({"name": "uniform", "minval": 1, "maxval": -1}, r"minval=1\.0, maxval=-1\.0"),
        ({"name": "uniform", "maxval": -0.06}, r"minval < maxval"),
        ({"name": "normal", "stddev": 0}, r"^init\.stddev: expected a positive number, got 0"),
        ({"name": "truncated_normal", "stddev": -1}, r"^init\.stddev: expected a positive"),
    ],
    ids=repr,
)
def test_from_dict_rejects_bad_values_naming_the_key(raw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        InitializerSpec.from_dict(raw, where="init")


def test_from_dict_default_where() -> None:
    with pytest.raises(ValueError, match=r"^initializer\.name:"):
        InitializerSpec.from_dict({"name": "nope"})
