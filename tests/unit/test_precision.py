"""Row precision (lookup_table.core.precision): the codec, both roundings, overflow."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from lookup_table.core.hashing import id_hashes, mix64
from lookup_table.core.precision import (
    MAX_FINITE,
    ROW_DTYPES,
    RowDtype,
    decode,
    encode,
    itemsize,
    round_to,
    rounding_keys,
    storage_dtype,
)
from lookup_table.errors import ConfigError, RowOverflowError

pytestmark = pytest.mark.unit

F32 = np.float32
HALF = ("float16", "bfloat16")


def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _mixed_values(n: int, seed: int) -> NDArray[np.float32]:
    """Values of every magnitude a row may hold: large, tiny, subnormal, zeros of both signs."""
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.integers(-40, 15, n)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    x[:8] = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-24, 2.0**-25]
    return x.reshape(-1, 8)


def _keys(n: int, seed: int = 3, step: int = 0) -> NDArray[np.uint64]:
    return rounding_keys(seed, id_hashes(np.arange(n, dtype=np.int64)), step)


# ---------------------------------------------------------------- sizes and float32


def test_sizes_and_storage_dtypes() -> None:
    assert ROW_DTYPES == ("float32", "float16", "bfloat16")
    assert [itemsize(d) for d in ROW_DTYPES] == [4, 2, 2]
    assert [storage_dtype(d).str for d in ROW_DTYPES] == ["<f4", "<u2", "<u2"]
    assert MAX_FINITE["float16"] == 65504.0
    assert MAX_FINITE["bfloat16"] == float(_f32(0x7F7F0000))


def test_float32_is_the_identity_bit_for_bit() -> None:
    bits = np.random.default_rng(1).integers(0, 2**32, size=(64, 16), dtype=np.uint64)
    rows = bits.astype(np.uint32).view(np.float32)  # every pattern: NaNs, infs, subnormals
    for rounding in ("nearest", "stochastic"):
        words = encode(rows, "float32", rounding=rounding, keys=_keys(64))  # type: ignore[arg-type]
        assert words.dtype == np.dtype("<f4") and words.tobytes() == rows.tobytes()
        assert not np.shares_memory(words, rows)
        assert decode(words, "float32").tobytes() == rows.tobytes()


def test_stored_bytes_are_little_endian() -> None:
    rows = np.array([[1.0, -2.0]], dtype=np.float32)
    assert encode(rows, "bfloat16").tobytes() == b"\x80\x3f\x00\xc0"
    assert encode(rows, "float16").tobytes() == b"\x00\x3c\x00\xc0"
    assert encode(rows, "float32").tobytes() == b"\x00\x00\x80\x3f\x00\x00\x00\xc0"


# ---------------------------------------------------------------- round to nearest


def _bf16_reference(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """Nearest bfloat16, ties to even, by arithmetic instead of bits: 8 significant bits
    (frexp's mantissa in [0.5, 1) times 2**8, numpy's round: half to even), and the
    subnormal grid 2**-133 below 2**-126. For finite values within bfloat16's range."""
    v = x.astype(np.float64)
    mantissa, exponent = np.frexp(v)
    normal = np.ldexp(np.round(np.ldexp(mantissa, 8)), exponent - 8)
    subnormal = np.round(v * 2.0**133) * 2.0**-133
    return np.where(np.abs(v) < 2.0**-126, subnormal, normal).astype(np.float32)


def test_bfloat16_nearest_matches_arithmetic_rounding() -> None:
    rows = _mixed_values(40_000, 2)
    rows[1, :] = [_f32(b) for b in (0x3F808000, 0x3F818000, 0x00008000, 0x00018000,
                                    0x3F80FFFF, 0x7F7EFFFF, 0x80000001, 0x807FFFFF)]  # fmt: skip
    got = decode(encode(rows, "bfloat16"), "bfloat16")
    want = _bf16_reference(rows)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


def test_bfloat16_nearest_matches_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the reference here")
    bits = np.random.default_rng(4).integers(0, 2**32, size=(2000, 50), dtype=np.uint64)
    rows = bits.astype(np.uint32).view(np.float32)
    rows[~np.isfinite(rows) | (np.abs(rows) > MAX_FINITE["bfloat16"])] = 1.5
    want = rows.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert encode(rows, "bfloat16").tolist() == want.tolist()


def test_float16_nearest_is_ieee_and_keeps_subnormals() -> None:
    rows = np.array([[65504.0, 65500.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1 + 2.0**-11,
                      1 + 3 * 2.0**-11, -0.0]], dtype=np.float32)  # fmt: skip
    got = decode(encode(rows, "float16"), "float16")[0].tolist()
    # ties to even: 2**-25 is half of the smallest subnormal (to 0), 1 + 2**-11 to 1
    assert got == [65504.0, 65504.0, 2.0**-24, 0.0, 2.0**-24, 1.0, 1 + 2.0**-9, -0.0]
    assert np.signbit(got[-1])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_stored_value_round_trips_exactly(dtype: Any, rounding: Any) -> None:
    """All 65,536 patterns of a 16-bit dtype: decoded, then encoded again, they are the
    same bits (exact values never move, in either rounding); NaN stays NaN."""
    words = np.arange(2**16, dtype=np.uint16).reshape(256, 256)
    values = decode(words, dtype)
    finite = np.isfinite(values)
    rows = np.where(finite, values, F32(0))
    again = encode(rows, dtype, rounding=rounding, keys=_keys(256))
    assert again[finite].tolist() == words[finite].tolist()
    nan_rows = np.where(np.isnan(values), values, F32(0))
    back = decode(encode(nan_rows, dtype, rounding=rounding, keys=_keys(256)), dtype)
    assert np.array_equal(np.isnan(back), np.isnan(values))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(-65504, 65504, width=32), min_size=2, max_size=40),
    st.sampled_from(HALF),
)
def test_nearest_is_monotonic_and_within_half_a_step(values: list[float], dtype: Any) -> None:
    x = np.sort(np.array(values, dtype=np.float32)).reshape(1, -1)
    y = round_to(x, dtype)
    assert (np.diff(y[0].astype(np.float64)) >= 0).all()
    # the nearest: neither stored value one code away (in magnitude) is closer
    words = encode(x, dtype).astype(np.int64)
    sign, magnitude = words & 0x8000, words & 0x7FFF
    top = 0x7BFF if dtype == "float16" else 0x7F7F  # the largest finite
    for step in (-1, 1):
        other_words = sign | np.clip(magnitude + step, 0, top)
        other = decode(other_words.astype(np.uint16), dtype).astype(np.float64)
        assert (np.abs(y - x.astype(np.float64)) <= np.abs(other - x)).all()


# ---------------------------------------------------------------- stochastic rounding
# The rule in numpy, op by op as docs/storage.md states it: the exhaustive tests below
# hold it to exactness, and the compiled encoders are held to it bit for bit.

_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _element_bits(keys: NDArray[np.uint64], width: int) -> NDArray[np.uint64]:
    """64 random bits per element: splitmix64 of the row's key plus (j + 1) * GAMMA."""
    counters = (np.arange(1, width + 1, dtype=np.uint64) * _GAMMA)[None, :]
    return mix64(keys[:, None] + counters)


def _bf16_stochastic_rule(
    bits: NDArray[np.uint32], random16: NDArray[np.uint32]
) -> NDArray[np.uint16]:
    """Add 16 uniform bits to the dropped ones, truncate."""
    return ((bits + random16) >> np.uint32(16)).astype(np.uint16)


def _f16_stochastic_rule(
    values: NDArray[np.float32], random64: NDArray[np.uint64]
) -> NDArray[np.uint16]:
    """13 dropped bits for normal float16 values, 14..23 for subnormals, and below 2**-24
    up to 2**-24 with probability |x| * 2**24 (compared to 40 bits)."""
    bits = values.view(np.uint32)
    sign = bits & np.uint32(0x80000000)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    exponent = (magnitude >> np.uint32(23)).astype(np.int32)
    dropped = np.clip(126 - exponent, 13, 23).astype(np.uint32)
    mask = (np.uint32(1) << dropped) - np.uint32(1)
    random32 = (random64 >> np.uint64(32)).astype(np.uint32)
    rounded = (magnitude + (random32 & mask)) & ~mask
    tiny = exponent < 103
    if tiny.any():
        scaled = np.floor(np.abs(values[tiny]).astype(np.float64) * 2.0**64)
        up = (random64[tiny] >> np.uint64(24)).astype(np.float64) < scaled
        rounded[tiny] = np.where(up, np.uint32(0x33800000), np.uint32(0))
    return (sign | rounded).view(np.float32).astype(np.float16).view(np.uint16)


@pytest.mark.parametrize(
    ("value", "low", "high", "draws"),
    [
        (1 + 2.0**-9, 1.0, 1 + 2.0**-7, 16),  # a quarter of the way up
        (-(3 + 5 * 2.0**-13), -3.0, -(3 + 2.0**-6), 16),  # negative: away from zero
        (float(_f32(0x00001234)), float(_f32(0x00000000)), float(_f32(0x00010000)), 16),
    ],
)
def test_bfloat16_stochastic_rounds_up_exactly_as_often_as_it_should(
    value: float, low: float, high: float, draws: int
) -> None:
    """Over every one of the 2**16 random draws, the value goes to the far neighbour
    exactly (value - low) / (high - low) of the time: unbiased, no approximation."""
    bits = np.full((2**draws,), np.array([value], np.float32).view(np.uint32)[0])
    random = np.arange(2**draws, dtype=np.uint32)
    out = (_bf16_stochastic_rule(bits, random).astype(np.uint32) << 16).view(np.float32)
    assert set(out.tolist()) <= {low, high}
    ups = int((out == F32(high)).sum())
    assert ups == (value - low) / (high - low) * 2**draws
    assert out.astype(np.float64).mean() == value  # exactly: E[decode] = x


@pytest.mark.parametrize(
    ("value", "low", "high", "dropped"),
    [
        (1 + 2.0**-12, 1.0, 1 + 2.0**-10, 13),  # normal: 13 bits dropped
        (-(1000 + 0.75), -1000.5, -1001.0, 13),
        (5 * 2.0**-25, 2 * 2.0**-24, 3 * 2.0**-24, 22),  # subnormal: the grid is 2**-24
        (2.0**-20 + 2.0**-26, 16 * 2.0**-24, 17 * 2.0**-24, 19),
        (2.0**-24 + 2.0**-30, 2.0**-24, 2.0**-23, 23),
    ],
)
def test_float16_stochastic_rounds_up_exactly_as_often_as_it_should(
    value: float, low: float, high: float, dropped: int
) -> None:
    n = 2**dropped
    values = np.full((n,), value, dtype=np.float32)
    random = np.arange(n, dtype=np.uint64) << np.uint64(32)  # every value of the used bits
    out = _f16_stochastic_rule(values, random).view(np.float16).astype(np.float64)
    assert set(out.tolist()) <= {low, high}
    assert out.mean() == value


def test_float16_stochastic_below_the_smallest_subnormal() -> None:
    """Below 2**-24 the neighbours are 0 and 2**-24: up a quarter of the time for 2**-26,
    counted over evenly spread draws of the 40 bits it compares."""
    values = np.full((2**16,), 2.0**-26, dtype=np.float32)
    random = np.arange(2**16, dtype=np.uint64) << np.uint64(48)
    out = _f16_stochastic_rule(values, random).view(np.float16).astype(np.float64)
    assert set(out.tolist()) == {0.0, 2.0**-24}
    assert out.mean() == 2.0**-26
    zero = _f16_stochastic_rule(np.zeros(4, np.float32), np.full(4, 2**64 - 1, np.uint64))
    assert zero.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_is_unbiased_statistically(dtype: Any) -> None:
    """Through the public API (hashed bits): 200,000 rows of one value each, for values
    all over the range; the mean lands within 5 standard errors of the value."""
    values = np.array([1 + 2.0**-12, -0.1, 3e-6, 1e-9, 40_000.3, 7.77e-3], dtype=np.float32)
    if dtype == "bfloat16":
        values = np.append(values, np.float32(1e-40))  # a float32 subnormal
    n = 200_000
    rows = np.tile(values, (n, 1))
    out = round_to(rows, dtype, rounding="stochastic", keys=_keys(n, seed=11, step=5))
    spread = np.abs(out.astype(np.float64) - values.astype(np.float64)).max(axis=0)
    error = out.astype(np.float64).mean(axis=0) - values.astype(np.float64)
    assert (np.abs(error) <= 5 * spread / np.sqrt(n)).all(), (error, spread)
    assert (spread > 0).all()  # every value was between two stored ones: the test measures


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-65504, 65504, width=32), min_size=1, max_size=30),
    st.sampled_from(HALF),
    st.integers(0, 2**63),
    st.integers(0, 1000),
)
def test_stochastic_gives_a_neighbour_deterministically(
    values: list[float], dtype: Any, seed: int, step: int
) -> None:
    x = np.array(values, dtype=np.float32).reshape(1, -1)
    keys = rounding_keys(seed, id_hashes(np.array([42], np.int64)), step)
    words = encode(x, dtype, rounding="stochastic", keys=keys)
    assert (
        encode(x.copy(), dtype, rounding="stochastic", keys=keys.copy()).tolist() == words.tolist()
    )
    # the stored value toward zero from x, or (x not stored exactly) the next one away
    nearest = encode(x, dtype).astype(np.int64)
    above = np.abs(decode(nearest.astype(np.uint16), dtype)) > np.abs(x)
    toward = (nearest & 0x7FFF) - above
    exact = decode(((nearest & 0x8000) | toward).astype(np.uint16), dtype) == x
    got = words.astype(np.int64)
    assert ((got & 0x8000) == (nearest & 0x8000)).all()
    magnitude = got & 0x7FFF
    assert ((magnitude == toward) | (~exact & (magnitude == toward + 1))).all()


@pytest.mark.parametrize("dtype", HALF)
def test_compiled_stochastic_rounding_is_the_rule_bit_for_bit(dtype: Any) -> None:
    """`encode`'s compiled pass against the numpy rule above, over every binade of
    float16 and bfloat16 (subnormals, below 2**-24, near the largest value, both signs,
    zeros and NaNs) and hashed keys."""
    rng = np.random.default_rng(5)
    values = _mixed_values(20_000, 3).reshape(-1)
    if dtype == "float16":
        values = values[np.abs(values) <= 65504]
        tiny = (rng.random(4000) * 2.0**-23).astype(np.float32)  # around 2**-24
        subnormal = (rng.random(4000) * 2.0**-14).astype(np.float32)
        edge = np.array([65504, -65504, 65503.9, 2.0**-24, 2.0**-25, 0.0, -0.0], np.float32)
        values = np.concatenate([values, tiny, -subnormal, edge])
    values = np.append(values, np.float32(np.nan))
    width = 7
    values = np.resize(values, (values.shape[0] // width + 1) * width).reshape(-1, width)
    keys = rounding_keys(99, id_hashes(np.arange(values.shape[0], dtype=np.int64)), 3)
    got = encode(values, dtype, rounding="stochastic", keys=keys)
    random = _element_bits(keys, width)
    finite = np.where(np.isnan(values), np.float32(0), values)
    if dtype == "float16":
        want = _f16_stochastic_rule(finite, random)
    else:
        random16 = (random >> np.uint64(48)).astype(np.uint32)
        want = _bf16_stochastic_rule(values.view(np.uint32), random16)
    nan = np.isnan(values)
    assert nan.any()
    assert (got[~nan] == want[~nan]).all()
    assert np.isnan(decode(got, dtype)[nan]).all()


def test_stochastic_bits_are_pinned() -> None:
    """The hash is a storage contract (a replay elsewhere must round the same way):
    changing a constant changes these digests."""
    rows = _mixed_values(4096, 9) / F32(3)
    hashes = id_hashes(np.arange(rows.shape[0], dtype=np.int64) * 7919)
    keys = rounding_keys(-12345, hashes, np.arange(rows.shape[0], dtype=np.int64) % 5)
    digests = {
        dtype: hashlib.sha256(
            encode(rows, dtype, rounding="stochastic", keys=keys).tobytes()
        ).hexdigest()[:16]
        for dtype in HALF
    }
    assert digests == {"float16": "7a0d32512017143e", "bfloat16": "ba8668134e3f745d"}


def test_keys_change_with_seed_id_and_step() -> None:
    hashes = id_hashes(np.arange(1000, dtype=np.int64))
    base = rounding_keys(1, hashes, 0)
    for other in (rounding_keys(2, hashes, 0), rounding_keys(1, hashes, 1)):
        assert (other != base).all()
    assert len(set(base.tolist())) == 1000
    per_row = rounding_keys(1, hashes, np.zeros(1000, np.int64))
    assert per_row.tolist() == base.tolist()
    x = np.full((1000, 16), 1 + 2.0**-9, dtype=np.float32)
    a = encode(x, "bfloat16", rounding="stochastic", keys=base)
    b = encode(x, "bfloat16", rounding="stochastic", keys=rounding_keys(1, hashes, 1))
    assert 0.3 < (a != b).mean() < 0.45  # independent draws: 2 * 1/4 * 3/4 apart


# ---------------------------------------------------------------- overflow, NaN


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float16_overflow_is_refused_naming_the_table(rounding: Any) -> None:
    ok = np.array([[65504.0, -65504.0, 1.0]], dtype=np.float32)
    assert decode(encode(ok, "float16", rounding=rounding, keys=_keys(1)), "float16").tolist() == [
        [65504.0, -65504.0, 1.0]
    ]
    bad = np.array([[1.0, 2.0], [3.0, -65505.0], [np.inf, 70000.0]], dtype=np.float32)
    ids = np.array([7, -42, 9], dtype=np.int64)
    with pytest.raises(RowOverflowError) as info:
        encode(bad, "float16", rounding=rounding, keys=_keys(3), table="tables.user", ids=ids)
    message = str(info.value)
    assert message.startswith(
        "tables.user: row value -65505 at row 1, column 1 (id -42) does not fit float16 "
        "(largest finite value 65504); 3 of 6 values do not; nothing was stored."
    )
    assert 'dtype = "bfloat16"' in message and "learning rate" in message
    assert info.value.table == "tables.user" and info.value.dtype == "float16"
    assert info.value.value == -65505.0
    assert isinstance(info.value, ValueError)


def test_bfloat16_overflow_is_refused_and_points_to_float32() -> None:
    limit = F32(MAX_FINITE["bfloat16"])
    fine = np.array([[limit, -limit]], dtype=np.float32)
    assert decode(encode(fine, "bfloat16"), "bfloat16").tolist() == fine.tolist()
    with pytest.raises(RowOverflowError, match=r'does not fit bfloat16 .*dtype = "float32"'):
        encode(np.array([[np.nextafter(limit, np.inf)]], np.float32), "bfloat16")
    with pytest.raises(RowOverflowError, match=r"row value -inf"):
        encode(np.array([[-np.inf]], np.float32), "bfloat16", rounding="stochastic", keys=_keys(1))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nan_stays_nan(dtype: Any, rounding: Any) -> None:
    """A NaN whose payload sits in the dropped bits only would round into inf by the bits."""
    nans = [_f32(b) for b in (0x7F800001, 0xFF800001, 0x7FC00000, 0x7F80FFFF, 0x7FFFFFFF)]
    rows = np.array([nans], dtype=np.float32)
    out = round_to(rows, dtype, rounding=rounding, keys=_keys(1))
    assert np.isnan(out).all()
    assert np.signbit(out[0]).tolist() == [False, True, False, False, False]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_round_to_is_decode_of_encode_bit_for_bit(dtype: Any, rounding: Any) -> None:
    """`round_to`'s one compiled pass against the two it stands for: random float32 bits
    (NaNs of every payload, infs and beyond-range values replaced), the float32 values
    next to every 16-bit word (where ties and carries are), zeros, subnormals; a new
    array, into `out`, and in place."""
    rng = np.random.default_rng(17)
    bits = rng.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    words = np.arange(1 << 16, dtype=np.uint32)
    stored = words << 16 if dtype == "bfloat16" else f16_widened(words)
    near = np.concatenate([stored.astype(np.int64) + d for d in (-1, 0, 1, 0x1000, 0x7FFF, 0x8000)])
    values = np.concatenate([bits, (near % 2**32).astype(np.uint32)]).view(np.float32)
    limit = F32(MAX_FINITE[dtype])
    values = np.where(np.abs(values) > limit, F32(0.5), values)  # NaN compares False: kept
    rows = np.ascontiguousarray(values[: values.shape[0] // 64 * 64].reshape(-1, 64))
    keys = _keys(rows.shape[0], seed=9, step=4) if rounding == "stochastic" else None
    want = decode(encode(rows, dtype, rounding=rounding, keys=keys), dtype)
    assert np.isnan(rows).any()
    assert round_to(rows, dtype, rounding=rounding, keys=keys).tobytes() == want.tobytes()
    out = np.full(rows.shape, 7.0, np.float32)
    assert round_to(rows, dtype, rounding=rounding, keys=keys, out=out) is out
    assert out.tobytes() == want.tobytes()
    inplace = rows.copy()
    round_to(inplace, dtype, rounding=rounding, keys=keys, out=inplace)
    assert inplace.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", HALF)
def test_round_to_writes_nothing_when_a_value_does_not_fit(dtype: Any) -> None:
    rows = _mixed_values(64, 2)
    rows[5, 3] = np.inf
    before = rows.copy()
    with pytest.raises(RowOverflowError, match=r"at row 5, column 3"):
        round_to(rows, dtype, out=rows)
    assert rows.tobytes() == before.tobytes()


def f16_widened(words: NDArray[np.uint32]) -> NDArray[np.uint32]:
    """float32 bits of float16 words, by numpy's cast."""
    return words.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)


# ---------------------------------------------------------------- bad input


def test_bad_input_says_what_is_wrong() -> None:
    rows = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(ConfigError, match=r"row dtype 'float64' is not one of float32, float16"):
        encode(rows, "float64")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rounding 'up' is not one of nearest, stochastic"):
        encode(rows, "float16", rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rows: expected a float32 .* got float64 \(2, 3\)"):
        encode(rows.astype(np.float64), "float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rows: expected .* got float32 \(3,\)"):
        encode(np.zeros(3, np.float32), "bfloat16")
    with pytest.raises(ValueError, match=r"keys: stochastic rounding needs one uint64 key per row"):
        encode(rows, "float16", rounding="stochastic")
    with pytest.raises(ValueError, match=r"\(2,\) from rounding_keys\(\), got uint64 \(3,\)"):
        encode(rows, "float16", rounding="stochastic", keys=_keys(3))
    with pytest.raises(
        ValueError, match=r"words: expected a <u2 array .* for float16, got float32"
    ):
        decode(rows, "float16")
    with pytest.raises(ValueError, match=r"steps: expected an int or an integer array"):
        rounding_keys(1, id_hashes(np.arange(2)), np.zeros(2, np.float32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"steps: expected counts >= 0, got -1"):
        rounding_keys(1, id_hashes(np.arange(2)), np.array([0, -1]))
    with pytest.raises(ValueError, match=r"one a row \(2,\), got \(3,\)"):
        rounding_keys(1, id_hashes(np.arange(2)), np.arange(3))
    with pytest.raises(ValueError, match=r"id_hashes: expected a uint64 array"):
        rounding_keys(1, np.arange(2), 0)  # type: ignore[arg-type]


def test_encode_leaves_its_input_alone() -> None:
    rows = _mixed_values(800, 5)
    before = rows.copy()
    rows.flags.writeable = False
    strided = np.zeros((rows.shape[0], 16), dtype=np.float32)
    strided[:, ::2] = rows
    for dtype in HALF:
        words = encode(rows, dtype, rounding="stochastic", keys=_keys(rows.shape[0]))
        assert encode(strided[:, ::2], dtype, rounding="stochastic", keys=_keys(100)).tolist() == (
            words.tolist()
        )
    assert rows.tobytes() == before.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_tables_rounding_key_picks_stochastic_or_nearest_rounding_of_stepped_rows(
    dtype: RowDtype,
) -> None:
    from lookup_table.config import parse_config
    from lookup_table.core.optimizers import make_optimizer
    from optimizer_service.engine.rounding import RowRounder

    def rounder(**rounding: str) -> RowRounder:
        table = {"name": "t", "dim": 8, "seed": 3, "dtype": dtype, **rounding}
        raw = {"namespace": "n", "memcached": ["127.0.0.1:1"], "tables": [table]}
        spec = parse_config(raw, env={}).tables[0]
        return RowRounder(spec, make_optimizer(spec.optimizer))

    rng = np.random.default_rng(4)
    ids = np.arange(64, dtype=np.int64)
    rows = rng.uniform(-1, 1, (64, 8)).astype(np.float32)
    old_slots = np.zeros((64, 17), dtype=np.float32)
    old_slots[:, -1] = rng.integers(0, 100, 64)  # adam's step: the key of the random bits
    new_slots = old_slots + 1
    nearest = round_to(rows, dtype)
    stochastic = rounder().round(ids, old_slots, rows, new_slots)
    assert not np.array_equal(stochastic, nearest)  # the default: stochastic
    assert np.array_equal(
        rounder(rounding="nearest").round(ids, old_slots, rows, new_slots), nearest
    )
    assert np.array_equal(
        rounder(rounding="stochastic").round(ids, old_slots, rows, new_slots), stochastic
    )


def test_widened_float16_is_numpys_cast_for_every_word() -> None:
    """All 65,536 float16 words, NaN payloads, infs, zeros and subnormals included."""
    from lookup_table.core.precision import widened

    words = np.arange(2**16, dtype=np.uint16).reshape(256, 256)
    want = words.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(widened(words, "float16").view(np.uint32), want.view(np.uint32))
    bf = np.arange(2**16, dtype=np.uint16).reshape(256, 256)
    np.testing.assert_array_equal(widened(bf, "bfloat16"), decode(bf, "bfloat16"))


def test_stored_words_are_encodes_and_refuse_what_encode_refuses() -> None:
    """Every finite float16 value, and values rounded to nearest on the way (numpy's cast);
    a value beyond float16 raises as `encode` does, a NaN converts as `encode` does."""
    from lookup_table.core.precision import stored_words

    every = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = every[np.isfinite(every)].reshape(-1, 2)
    np.testing.assert_array_equal(stored_words(finite, "float16"), encode(finite, "float16"))
    rng = np.random.default_rng(3)
    between = (rng.standard_normal((500, 16)) * 300).astype(np.float32)  # not float16's own
    np.testing.assert_array_equal(stored_words(between, "float16"), encode(between, "float16"))
    np.testing.assert_array_equal(stored_words(between, "bfloat16"), encode(between, "bfloat16"))
    every_bf16 = decode(np.arange(2**16, dtype=np.uint16).reshape(-1, 2), "bfloat16")
    finite_bf16 = every_bf16[np.isfinite(every_bf16).all(axis=1)]
    np.testing.assert_array_equal(
        stored_words(finite_bf16, "bfloat16"), encode(finite_bf16, "bfloat16")
    )
    odd = between.copy()
    odd[4, 4] = np.nan  # a quiet NaN of its sign, as `encode` makes it
    np.testing.assert_array_equal(stored_words(odd, "bfloat16"), encode(odd, "bfloat16"))
    odd[4, 4] = np.inf
    with pytest.raises(RowOverflowError):
        stored_words(odd, "bfloat16")
    with_nan = between.copy()
    with_nan[7, 3] = np.nan
    np.testing.assert_array_equal(stored_words(with_nan, "float16"), encode(with_nan, "float16"))
    beyond = between.copy()
    beyond[2, 1] = 65520.0
    with pytest.raises(RowOverflowError, match="does not fit float16"):
        stored_words(beyond, "float16")
