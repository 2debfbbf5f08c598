"""Row precision: rows stepped in float32, stored as float32, float16 or bfloat16.

`encode` rounds float32 values to a dtype's stored little-endian words (`<f4`, or `<u2`
bits for the 16-bit dtypes); `decode` gives them back as float32, exactly (every float16
and bfloat16 value is a float32). float32 is the identity, bit for bit. Rounding is to
nearest, ties to even, or stochastic and unbiased, its random bits a counter-based hash
of (table seed, id hash, step, element): the same bits in a replay and on every CPU.
NaN stays NaN; a finite value beyond the dtype's largest is a `RowOverflowError`, never
an inf.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias, get_args

import numpy as np
from numba import njit, types
from numpy.typing import NDArray

from lookup_table.core.hashing import mix64, mix64_one
from lookup_table.core.jit import compiled
from lookup_table.errors import ConfigError, RowOverflowError

__all__ = [
    "MAX_FINITE",
    "ROUNDINGS",
    "ROW_DTYPES",
    "RowDtype",
    "Rounding",
    "bf16_nearest_bits",
    "bf16_stochastic_bits",
    "check_dtype",
    "check_row_keys",
    "check_values_fit",
    "decode",
    "encode",
    "f16_nearest_bits",
    "f16_stochastic_bits",
    "f16_widened_bits",
    "itemsize",
    "round_to",
    "rounding_keys",
    "rounding_salt",
    "salted_rounding_keys",
    "storage_dtype",
    "stored_words",
    "widened",
]

RowDtype: TypeAlias = Literal["float32", "float16", "bfloat16"]
Rounding: TypeAlias = Literal["nearest", "stochastic"]
ROW_DTYPES: tuple[RowDtype, ...] = get_args(RowDtype)
ROUNDINGS: tuple[Rounding, ...] = get_args(Rounding)

# the largest finite value of each dtype: anything beyond it is refused (module doc)
MAX_FINITE: dict[RowDtype, float] = {
    "float32": float(np.finfo(np.float32).max),
    "float16": 65504.0,
    "bfloat16": float(np.uint32(0x7F7F0000).view(np.float32)),  # 3.3895314e38
}
_STORED: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<u2"),
    "bfloat16": np.dtype("<u2"),
}

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: counters spread over 2**64
_ROUND_TAG = 0x726F756E642D7372  # "round-sr": rounding's keys are no other hash's
_U16 = np.uint32(16)
_WORDS = types.Array(types.uint16, 2, "C")
_KEYS = types.Array(types.uint64, 1, "C", readonly=True)
_VALUES = types.Array(types.float32, 2, "C", readonly=True)


def check_dtype(dtype: object) -> RowDtype:
    """`dtype` if it is a row dtype; ConfigError saying which ones there are otherwise."""
    if dtype not in ROW_DTYPES:
        raise ConfigError(
            f"row dtype {dtype!r} is not one of {', '.join(ROW_DTYPES)}; "
            f"set the table's dtype to one of them (float32, the default, stores rows as is)"
        )
    return dtype  # narrowed by `in ROW_DTYPES`


def itemsize(dtype: RowDtype) -> int:
    """Bytes one stored element of `dtype` takes: 4 for float32, 2 for the others."""
    return int(_STORED[check_dtype(dtype)].itemsize)


def storage_dtype(dtype: RowDtype) -> np.dtype[Any]:
    """The numpy dtype of `encode`'s words: `<f4` for float32, `<u2` (the bits) otherwise."""
    return _STORED[check_dtype(dtype)]


def rounding_salt(seed: int) -> np.uint64:
    """A table's part of its rows' rounding keys (`rounding_keys`), from its seed."""
    salt: np.uint64 = mix64(np.array([(seed ^ _ROUND_TAG) & 0xFFFFFFFFFFFFFFFF], np.uint64))[0]
    return salt


def rounding_keys(
    seed: int, id_hashes: NDArray[np.uint64], steps: int | NDArray[np.integer[Any]]
) -> NDArray[np.uint64]:
    """One key a row for stochastic rounding: a hash of the table's seed, the id's hash
    (`hashing.id_hashes`) and the step (broadcast: one for all rows, or one a row).

    The step must be what a replay of the same update sees again, and differ between
    successive updates of a row (its update count before the step): the same key twice
    rounds the same way twice, and the errors no longer average out.
    """
    hashes = np.asarray(id_hashes)
    salt = np.full(1 if hashes.ndim != 1 else hashes.shape[0], rounding_salt(seed))
    return salted_rounding_keys(salt, hashes, steps)


def salted_rounding_keys(
    salts: NDArray[np.uint64],
    id_hashes: NDArray[np.uint64],
    steps: int | NDArray[np.integer[Any]],
) -> NDArray[np.uint64]:
    """`rounding_keys` of rows of several tables at once: `salts` (n,) is each row's
    table's `rounding_salt`; the same keys, bit for bit, as each table's own call."""
    hashes = np.asarray(id_hashes)
    if hashes.dtype != np.uint64 or hashes.ndim != 1:
        raise ValueError(
            f"id_hashes: expected a uint64 array (n,), got {hashes.dtype} {hashes.shape}"
        )
    if salts.dtype != np.uint64 or salts.shape != hashes.shape:
        raise ValueError(
            f"salts: expected a uint64 array ({hashes.shape[0]},), got {salts.dtype} {salts.shape}"
        )
    step_arr = np.asarray(steps)
    if step_arr.dtype.kind not in "iu" or step_arr.ndim > 1:
        raise ValueError(
            f"steps: expected an int or an integer array (n,), got {step_arr.dtype} "
            f"{step_arr.shape}; convert a float32 step slot with .astype(np.int64)"
        )
    if step_arr.ndim == 1 and step_arr.shape != hashes.shape:
        raise ValueError(
            f"steps: expected one step or one a row ({hashes.shape[0]},), got {step_arr.shape}"
        )
    if step_arr.dtype.kind == "i" and step_arr.size and int(step_arr.min()) < 0:
        raise ValueError(f"steps: expected counts >= 0, got {int(step_arr.min())}")
    counts = np.ascontiguousarray(np.broadcast_to(step_arr, hashes.shape), dtype=np.uint64)
    out = np.empty(hashes.shape, dtype=np.uint64)
    _rounding_keys(np.ascontiguousarray(salts), np.ascontiguousarray(hashes), counts, out)
    return out


@compiled(types.void(_KEYS, _KEYS, _KEYS, types.Array(types.uint64, 1, "C")))
def _rounding_keys(salts, hashes, steps, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The key of row i: mix64(mix64(hash ^ salt) + (step + 1) * GAMMA), one pass (what
    numpy would take a dozen array passes for). A storage contract: replays redraw it."""
    for i in range(out.shape[0]):
        counter = (steps[i] + np.uint64(1)) * _GAMMA
        out[i] = mix64_one(mix64_one(hashes[i] ^ salts[i]) + counter)


def _bf16_nearest(bits: NDArray[np.uint32]) -> NDArray[np.uint16]:
    """bfloat16 bits of float32 `bits`, to nearest, ties to even: add 0x7FFF plus the
    lowest kept bit, then truncate (a carry into the exponent is the right result)."""
    kept_lsb = (bits >> _U16) & np.uint32(1)
    return ((bits + np.uint32(0x7FFF) + kept_lsb) >> _U16).astype(np.uint16)


@njit(inline="always")
def _element_bits(key, j):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """Element j's 64 random bits of a row keyed `key` (`rounding_keys`): splitmix64 of
    the key plus (j + 1) * GAMMA. A storage contract: a replay must draw the same bits."""
    return mix64_one(key + np.uint64(j + 1) * _GAMMA)


@njit(inline="always")
def bf16_nearest_bits(b):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The bfloat16 word (as a uint32) of float32 bits `b`: `_bf16_nearest`'s rule for one
    element, and a NaN a quiet NaN of its sign as `encode` makes it."""
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return (b >> np.uint32(16)) | np.uint32(0x0040)
    return (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(inline="always")
def f16_nearest_bits(b):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The float16 word (as a uint32) of float32 bits `b` with |x| <= 65504, to nearest,
    ties to even: IEEE's conversion, numpy's `astype(np.float16)` (NaN is not handled)."""
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    magnitude = b & np.uint32(0x7FFFFFFF)
    exponent = magnitude >> np.uint32(23)  # biased: 127 is 2**0
    if exponent >= np.uint32(113):  # a normal float16: the carry may move up a binade
        lsb = (magnitude >> np.uint32(13)) & np.uint32(1)
        return sign | (
            (magnitude - np.uint32(0x38000000) + np.uint32(0xFFF) + lsb) >> np.uint32(13)
        )
    if exponent < np.uint32(102):  # below 2**-25: zero (2**-25 itself ties to 0)
        return sign
    significand = (magnitude & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    shift = np.uint32(126) - exponent  # 14..24: to units of 2**-24
    kept = significand >> shift
    rest = significand & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    if rest > half or (rest == half and (kept & np.uint32(1))):
        kept += np.uint32(1)
    return sign | kept


@njit(inline="always")
def f16_widened_bits(h):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The float32 bits of float16 word `h` (a uint32), exactly (NaN is not handled)."""
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exponent = (h >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = h & np.uint32(0x3FF)
    if exponent == np.uint32(0x1F):  # an inf
        return sign | np.uint32(0x7F800000)
    if exponent == np.uint32(0):
        if mantissa == np.uint32(0):
            return sign
        biased = np.uint32(113)  # a subnormal: shift its leading bit to the implicit one
        while (mantissa & np.uint32(0x400)) == np.uint32(0):
            mantissa <<= np.uint32(1)
            biased -= np.uint32(1)
        return sign | (biased << np.uint32(23)) | ((mantissa & np.uint32(0x3FF)) << np.uint32(13))
    return sign | ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))


@njit(inline="always")
def bf16_stochastic_bits(b, key, j):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`_bf16_stochastic`'s word (as a uint32) of float32 bits `b`, element j of a row
    keyed `key`."""
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return (b >> np.uint32(16)) | np.uint32(0x0040)
    random16 = np.uint32(_element_bits(key, j) >> np.uint64(48))
    return (b + random16) >> np.uint32(16)


@njit(inline="always")
def f16_stochastic_bits(b, x, key, j):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`_f16_stochastic`'s word (as a uint32) of float32 `x` (its bits `b`), element j of
    a row keyed `key`; 0 for a NaN."""
    magnitude = b & np.uint32(0x7FFFFFFF)
    if magnitude > np.uint32(0x7F800000):
        return np.uint32(0)
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    random64 = _element_bits(key, j)
    exponent = np.int64(magnitude >> np.uint32(23))  # biased: 127 is 2**0
    if exponent < 103:  # below 2**-24
        scaled = np.floor(np.float64(abs(x)) * 2.0**64)  # < 2**40, exact
        up = np.float64(random64 >> np.uint64(24)) < scaled
        return sign | np.uint32(1) if up else sign
    dropped = 126 - exponent  # 13 for normal float16 values, up to 23 below
    if dropped < 13:
        dropped = np.int64(13)
    mask = (np.uint32(1) << np.uint32(dropped)) - np.uint32(1)
    random32 = np.uint32(random64 >> np.uint64(32))
    rounded = (magnitude + (random32 & mask)) & ~mask
    e = np.int64(rounded >> np.uint32(23))
    if e >= 113:  # a normal float16 (a carry to 2**16 gives its inf, as numpy's cast)
        mantissa = np.int64((rounded >> np.uint32(13)) & np.uint32(0x3FF))
        half = ((e - 112) << 10) | mantissa
    else:  # a subnormal one: the significand in units of 2**-24
        significand = (rounded & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        half = np.int64(significand >> np.uint32(126 - e))
    return sign | np.uint32(half)


@compiled(types.void(_VALUES, _KEYS, _WORDS))
def _bf16_stochastic(values, keys, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """bfloat16 bits of `values` (finite or NaN), rounded away from zero with probability
    (dropped bits) / 2**16: the top 16 of element j's random bits (splitmix64 of the
    row's key + (j + 1) * GAMMA) added to the dropped ones, then truncated. The grid is
    uniform within a binade and the carry moves to the next one, so each value goes up
    exactly as often as its distance from the lower neighbour says. A NaN stays a quiet
    NaN of its sign (the carry must not turn it into an inf)."""
    bits = values.view(np.uint32)
    for i in range(bits.shape[0]):
        key = keys[i]
        for j in range(bits.shape[1]):
            out[i, j] = np.uint16(bf16_stochastic_bits(bits[i, j], key, j))


@compiled(types.void(_VALUES, _KEYS, _WORDS))
def _f16_stochastic(values, keys, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """float16 bits of `values` (|x| <= 65504 or NaN), rounded stochastically.

    float16 keeps 10 of float32's 23 mantissa bits for normal values (13 dropped), fewer
    for its subnormals (14..23 dropped, one more each binade down: the grid there is
    2**-24); the dropped bits take the top 32 random bits as in `_bf16_stochastic`. Below
    2**-24 the neighbours are 0 and 2**-24: up with probability |x| * 2**24, to 2**-40.
    The rounded value is a float16 one, so its bits follow without another rounding.
    NaNs are left as 0 words: `encode` converts them as numpy does.
    """
    bits = values.view(np.uint32)
    for i in range(bits.shape[0]):
        key = keys[i]
        for j in range(bits.shape[1]):
            out[i, j] = np.uint16(f16_stochastic_bits(bits[i, j], values[i, j], key, j))


def check_values_fit(
    values: NDArray[np.float32],
    dtype: RowDtype,
    table: str,
    ids: NDArray[Any] | None,
    *,
    remedy: str | None = None,
) -> None:
    """RowOverflowError unless every non-NaN |value| <= MAX_FINITE[dtype]; its message
    ends with `remedy` (by default: another dtype, or a lower learning rate)."""
    limit = np.float32(MAX_FINITE[dtype])
    with np.errstate(invalid="ignore"):
        beyond = np.abs(values) > limit  # NaN compares False: it is kept as NaN
    if not beyond.any():
        return
    where = np.argwhere(beyond)
    row, col = (int(v) for v in where[0])
    value = float(values[row, col])
    named = ""
    if ids is not None and row < len(ids):
        bad_id = ids[row]
        named = f" (id {bad_id.item() if isinstance(bad_id, np.generic) else bad_id!r})"
    other = "bfloat16" if dtype == "float16" else "float32"
    if remedy is None:
        remedy = (
            f'Store the table as dtype = "{other}" (float32\'s range) or lower its learning rate'
        )
    raise RowOverflowError(
        f"{table}: row value {value:.8g} at row {row}, column {col}{named} does not fit "
        f"{dtype} (largest finite value {MAX_FINITE[dtype]:.8g}); {where.shape[0]} of "
        f"{values.size} values do not; nothing was stored. {remedy}",
        table=table,
        dtype=dtype,
        value=value,
    )


def _check_rows(rows: object, dtype: RowDtype, rounding: Rounding) -> None:
    """What `encode` and `round_to` take: a known dtype and rounding, float32 (n, width)."""
    check_dtype(dtype)
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding {rounding!r} is not one of {', '.join(ROUNDINGS)}")
    if not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 2:
        got = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
        raise ValueError(f"rows: expected a float32 array of shape (n, width), got {got}")


def encode(
    rows: NDArray[np.float32],
    dtype: RowDtype,
    *,
    rounding: Rounding = "nearest",
    keys: NDArray[np.uint64] | None = None,
    table: str = "rows",
    ids: NDArray[Any] | None = None,
) -> NDArray[Any]:
    """float32 rows (n, width) as `dtype` stores them: a new (n, width) array of
    `storage_dtype(dtype)` (`.tobytes()` is the stored value, little-endian).

    float32 is a copy, bit for bit, whatever `rounding`. `rounding="stochastic"` takes
    one key a row (`rounding_keys`); "nearest" rounds ties to even. `table` and `ids`
    (one a row) only name what does not fit in the error.

    Raises:
        ValueError: rows not a float32 (n, width) array, or keys missing or not (n,) uint64.
        RowOverflowError: a value beyond MAX_FINITE[dtype] (an inf is one too).
        ConfigError: an unknown dtype or rounding.
    """
    _check_rows(rows, dtype, rounding)
    if dtype == "float32":
        return np.array(rows, dtype=np.float32, order="C")  # native float32 is <f4 (x86, ARM)
    row_keys = check_row_keys(keys, rows.shape[0]) if rounding == "stochastic" else None
    values = np.ascontiguousarray(rows)
    check_values_fit(values, dtype, table, ids)
    nan = np.isnan(values)
    if dtype == "bfloat16":
        bits = values.view(np.uint32)
        if row_keys is None:
            out = _bf16_nearest(bits)
            if nan.any():  # a quiet NaN of the same sign: rounding must not carry it into inf
                out[nan] = ((bits[nan] >> _U16) | np.uint32(0x0040)).astype(np.uint16)
        else:
            out = np.empty(values.shape, np.uint16)
            _bf16_stochastic(values, row_keys, out)
        return out
    if row_keys is None:
        return values.astype(np.float16).view(np.uint16)  # IEEE conversion: ties to even
    out = np.empty(values.shape, np.uint16)
    _f16_stochastic(values, row_keys, out)
    if nan.any():
        out[nan] = values[nan].astype(np.float16).view(np.uint16)
    return out


def stored_words(rows: NDArray[np.float32], dtype: RowDtype) -> NDArray[Any]:
    """`encode(rows, dtype)` (to nearest) of rows that hold `dtype`'s values already, as a
    replica's rows do, in one compiled pass (numpy's float16 cast takes several times as
    long); a NaN, an inf or a value beyond float16 takes `encode` (which refuses the
    last two)."""
    values = np.ascontiguousarray(rows, dtype=np.float32)
    if dtype != "float32" and values.ndim == 2:
        out = np.empty(values.shape, np.uint16)
        if (_f16_words if dtype == "float16" else _bf16_words)(values, out):
            return out
    return encode(values, dtype)


def widened(words: NDArray[Any], dtype: RowDtype) -> NDArray[np.float32]:
    """`decode(words, dtype)`, bit for bit (a NaN's payload too); float16's in one
    compiled pass."""
    if (
        dtype == "float16"
        and isinstance(words, np.ndarray)
        and words.dtype == np.uint16
        and words.ndim == 2
    ):
        out = np.empty(words.shape, np.float32)
        _f16_widen(np.ascontiguousarray(words), out.view(np.uint32))
        return out
    return decode(words, dtype)


@compiled(types.boolean(_VALUES, _WORDS))
def _f16_words(values, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """float16 words of `values` to nearest (numpy's cast); False, leaving the rest,
    at the first NaN, inf or |value| beyond 65504."""
    bits = values.view(np.uint32)
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            b = bits[i, j]
            if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x477FE000):
                return False
            out[i, j] = np.uint16(f16_nearest_bits(b))
    return True


@compiled(types.boolean(_VALUES, _WORDS))
def _bf16_words(values, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """bfloat16 words of `values` to nearest (`_bf16_nearest`); False, leaving the rest,
    at the first NaN or inf."""
    bits = values.view(np.uint32)
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            b = bits[i, j]
            if (b & np.uint32(0x7FFFFFFF)) >= np.uint32(0x7F800000):
                return False
            out[i, j] = np.uint16(bf16_nearest_bits(b))
    return True


@compiled(
    types.void(types.Array(types.uint16, 2, "C", readonly=True), types.Array(types.uint32, 2, "C"))
)
def _f16_widen(words, out):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """float32 bits of float16 `words`, as numpy's cast gives them (a NaN keeps its
    payload, shifted into place)."""
    for i in range(words.shape[0]):
        for j in range(words.shape[1]):
            h = np.uint32(words[i, j])
            e = h & np.uint32(0x7C00)
            if e != np.uint32(0) and e != np.uint32(0x7C00):  # a normal value: rebias
                out[i, j] = ((h & np.uint32(0x8000)) << np.uint32(16)) | (
                    ((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(0x38000000)
                )
            elif e == np.uint32(0x7C00) and (h & np.uint32(0x3FF)):
                out[i, j] = (
                    ((h & np.uint32(0x8000)) << np.uint32(16))
                    | np.uint32(0x7F800000)
                    | ((h & np.uint32(0x3FF)) << np.uint32(13))
                )
            else:
                out[i, j] = f16_widened_bits(h)


def check_row_keys(keys: object, n: int) -> NDArray[np.uint64]:
    """`keys` if it is one uint64 key per row of `n`, else a ValueError saying so."""
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.shape != (n,):
        got = f"{keys.dtype} {keys.shape}" if isinstance(keys, np.ndarray) else repr(keys)
        raise ValueError(
            f"keys: stochastic rounding needs one uint64 key per row ({n},) from "
            f"rounding_keys(), got {got}"
        )
    return keys


def decode(words: NDArray[Any], dtype: RowDtype) -> NDArray[np.float32]:
    """The float32 values of `encode`'s words (n, width) of `dtype`, exactly; a new array.

    Raises:
        ValueError: `words` is not a 2-D array of `storage_dtype(dtype)`.
    """
    want = storage_dtype(dtype)
    if not isinstance(words, np.ndarray) or words.dtype != want or words.ndim != 2:
        got = (
            f"{words.dtype} {words.shape}"
            if isinstance(words, np.ndarray)
            else type(words).__name__
        )
        raise ValueError(
            f"words: expected a {want.str} array of shape (n, width) for {dtype}, got {got}"
        )
    if dtype == "float32":
        return np.array(words, dtype=np.float32, order="C")
    if dtype == "float16":
        return words.view(np.float16).astype(np.float32)
    return (words.astype(np.uint32) << _U16).view(np.float32)


def round_to(
    rows: NDArray[np.float32],
    dtype: RowDtype,
    *,
    rounding: Rounding = "nearest",
    keys: NDArray[np.uint64] | None = None,
    table: str = "rows",
    ids: NDArray[Any] | None = None,
    out: NDArray[np.float32] | None = None,
) -> NDArray[np.float32]:
    """`decode(encode(...))`: float32 rows holding exactly what `dtype` stores, so a
    holder of the row keeps what a reader of the store gets; one compiled pass. A new
    array, or `out` (rows' shape, float32, C order; `rows` itself rounds in place).

    Raises:
        ValueError, RowOverflowError, ConfigError: as `encode` (nothing is written).
    """
    _check_rows(rows, dtype, rounding)
    if out is None:
        out = np.empty(rows.shape, np.float32)
    elif (
        out.dtype != np.float32 or out.shape != rows.shape or not out.flags.c_contiguous
    ):  # a bug, not input
        raise ValueError(f"out: expected float32 C-order {rows.shape}, got {out.dtype} {out.shape}")
    if dtype == "float32":
        out[...] = rows
        return out
    row_keys = check_row_keys(keys, rows.shape[0]) if rounding == "stochastic" else _NO_KEYS
    values = np.ascontiguousarray(rows)
    check_values_fit(values, dtype, table, ids)
    kind = (0 if dtype == "float16" else 2) + (rounding == "stochastic")
    nans = _rounded(values, row_keys, kind, out)
    if nans:  # float16 keeps a NaN as numpy's cast does: the rare case, as `encode`
        nan = np.isnan(values)
        out[nan] = decode(encode(values[nan].reshape(-1, 1), dtype), dtype)[:, 0]
    return out


_NO_KEYS = np.zeros(0, np.uint64)
_NO_KEYS.flags.writeable = False


@compiled(types.int64(_VALUES, _KEYS, types.int64, types.Array(types.float32, 2, "C")))
def _rounded(values, keys, kind, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`decode(encode(values))` into `out` (which may be `values`), one element at a time
    with `encode`'s rules (`kind`: 0 float16 nearest, 1 float16 stochastic, 2 bfloat16
    nearest, 3 bfloat16 stochastic). float16 NaNs are left as they are and counted: the
    caller converts them as numpy does."""
    bits = values.view(np.uint32)
    got = out.view(np.uint32)
    nans = 0
    for i in range(bits.shape[0]):
        key = keys[i] if kind & 1 else np.uint64(0)
        for j in range(bits.shape[1]):
            b = bits[i, j]
            if kind >= 2:
                if kind == 2:
                    word = bf16_nearest_bits(b)
                else:
                    word = bf16_stochastic_bits(b, key, j)
                got[i, j] = word << np.uint32(16)
            elif (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                nans += 1
            else:
                if kind == 0:
                    half = f16_nearest_bits(b)
                else:
                    half = f16_stochastic_bits(b, values[i, j], key, j)
                got[i, j] = f16_widened_bits(half)
    return nans
