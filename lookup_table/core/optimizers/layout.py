"""An item's stored bytes per row: the row in its table's dtype, then each slot as its
optimizer stores it (`Optimizer.slot_storage`), little-endian, no header, no padding.

Items in memory are float32 (n, dim + slot_width): the row, then its slots, as the
optimizers take them. `encode_items` rounds the row to the table's dtype (to nearest or
stochastically, `lookup_table.core.precision`) and each slot column to its own dtype (to
nearest: the optimizers give slot values that are already that dtype's, so nothing is
lost); `decode_items` gives the float32 items back. With float32 rows and float32 slots
the bytes are the float32 items as they are. Items with 16-bit parts take one compiled
pass each way, every part by `precision`'s rules for one element.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.jit import C2, compiled
from lookup_table.core.optimizers.base import Float32Array, Optimizer, StoredSlot
from lookup_table.core.precision import (
    MAX_FINITE,
    ROUNDINGS,
    Rounding,
    RowDtype,
    bf16_nearest_bits,
    bf16_stochastic_bits,
    check_dtype,
    check_row_keys,
    check_values_fit,
    f16_nearest_bits,
    f16_stochastic_bits,
    f16_widened_bits,
    itemsize,
)
from lookup_table.errors import ConfigError

__all__ = ["decode_items", "encode_items", "item_layout", "value_bytes"]


def item_layout(optimizer: Optimizer, dim: int, dtype: RowDtype) -> tuple[StoredSlot, ...]:
    """The item's columns in order: the row ("row", dim, the table's dtype), then the slots."""
    if dim < 1:
        raise ValueError(f"dim: expected >= 1, got {dim}")
    slots = optimizer.slot_storage(dim)
    if sum(s.width for s in slots) != optimizer.slot_width(dim):
        raise ValueError(
            f"{type(optimizer).__name__}.slot_storage({dim}) describes "
            f"{sum(s.width for s in slots)} columns, its slot_width is {optimizer.slot_width(dim)}"
        )
    return (StoredSlot("row", dim, check_dtype(dtype)), *slots)


def value_bytes(optimizer: Optimizer, dim: int, dtype: RowDtype) -> int:
    """Bytes of one row's stored value (the item memcached holds, without its key)."""
    return sum(s.width * itemsize(s.dtype) for s in item_layout(optimizer, dim, dtype))


# a part's coding in the compiled passes: float32 as is, or a 16-bit dtype and rounding
_F32, _F16, _BF16, _F16_STOCHASTIC, _BF16_STOCHASTIC = range(5)
_F16_MAX = np.float32(MAX_FINITE["float16"])
_BF16_MAX = np.float32(MAX_FINITE["bfloat16"])
_OVERFLOW = 1  # a 16-bit value beyond its dtype's range: nothing the pass wrote is valid
_F16_NAN = 2  # float16 NaNs left as 0 words (or values): numpy converts them

_PARTS = types.Array(types.int64, 2, "C", readonly=True)  # (kind, column, width, word)
# read-only or writable: each an exact signature (a conversion costs every call more)
_ITEMS = types.Array(types.float32, 2, "C", readonly=True)
_WRITABLE_ITEMS = types.Array(types.float32, 2, "C")
_KEYS = types.Array(types.uint64, 1, "C", readonly=True)
_WRITABLE_KEYS = types.Array(types.uint64, 1, "C")
_STORED = types.Array(types.uint16, 2, "C", readonly=True)
_WRITABLE_STORED = types.Array(types.uint16, 2, "C")


@compiled(
    [
        types.intp(items, keys, _PARTS, types.Array(types.uint16, 2, "C"))
        for items in (_ITEMS, _WRITABLE_ITEMS)
        for keys in (_KEYS, _WRITABLE_KEYS)
    ]
)
def _encode_pass(items, keys, parts, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Each item's parts as stored, into `out` (16-bit words): float32 bits as two words
    (low first), 16-bit values rounded by `precision`'s rules (row i's key `keys[i]`
    when stochastic). Returns `_OVERFLOW` at the first part holding a value beyond its
    dtype (before rounding it), else `_F16_NAN` if a float16 part holds a NaN, else 0.

    A part at a time over all rows: each inner loop is then one rule on 1-D views indexed
    from 0, which LLVM vectorizes (a branch on the part inside the row loop stops it)."""
    bits = items.view(np.uint32)
    n = items.shape[0]
    nan = False
    for p in range(parts.shape[0]):
        kind = parts[p, 0]
        start = parts[p, 1]
        width = parts[p, 2]
        word = parts[p, 3]
        if kind == _F32:
            for i in range(n):
                b = bits[i, start : start + width]
                o = out[i, word : word + 2 * width]
                for j in range(width):
                    o[2 * j] = np.uint16(b[j] & np.uint32(0xFFFF))
                    o[2 * j + 1] = np.uint16(b[j] >> np.uint32(16))
            continue
        f16 = kind == _F16 or kind == _F16_STOCHASTIC
        limit = _F16_MAX if f16 else _BF16_MAX
        beyond = False
        for i in range(n):
            x = items[i, start : start + width]
            for j in range(width):
                beyond |= abs(x[j]) > limit  # NaN compares False: it is stored as NaN
                nan |= f16 and x[j] != x[j]
        if beyond:
            return _OVERFLOW
        for i in range(n):
            b = bits[i, start : start + width]
            o = out[i, word : word + width]
            if kind == _F16:
                for j in range(width):
                    o[j] = np.uint16(f16_nearest_bits(b[j]))
            elif kind == _BF16:
                for j in range(width):
                    o[j] = np.uint16(bf16_nearest_bits(b[j]))
            elif kind == _F16_STOCHASTIC:
                x = items[i, start : start + width]
                for j in range(width):
                    o[j] = np.uint16(f16_stochastic_bits(b[j], x[j], keys[i], j))
            else:
                for j in range(width):
                    o[j] = np.uint16(bf16_stochastic_bits(b[j], keys[i], j))
    return _F16_NAN if nan else 0


@compiled([types.intp(words, _PARTS, C2) for words in (_STORED, _WRITABLE_STORED)])
def _decode_pass(words, parts, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Each stored value's parts as float32 items, exactly (a part at a time, as in
    `_encode_pass`); returns `_F16_NAN` if a float16 word is a NaN (left for numpy to
    convert), else 0."""
    bits = out.view(np.uint32)
    n = words.shape[0]
    nan = False
    for p in range(parts.shape[0]):
        kind = parts[p, 0]
        start = parts[p, 1]
        width = parts[p, 2]
        word = parts[p, 3]
        if kind == _F32:
            for i in range(n):
                w = words[i, word : word + 2 * width]
                o = bits[i, start : start + width]
                for j in range(width):
                    o[j] = np.uint32(w[2 * j]) | (np.uint32(w[2 * j + 1]) << np.uint32(16))
        elif kind == _BF16 or kind == _BF16_STOCHASTIC:
            for i in range(n):
                w = words[i, word : word + width]
                o = bits[i, start : start + width]
                for j in range(width):
                    o[j] = np.uint32(w[j]) << np.uint32(16)
        else:
            for i in range(n):
                w = words[i, word : word + width]
                o = bits[i, start : start + width]
                for j in range(width):
                    h = np.uint32(w[j])
                    if (h & np.uint32(0x7FFF)) > np.uint32(0x7C00):
                        nan = True
                    o[j] = f16_widened_bits(h)
    return _F16_NAN if nan else 0


class _Coding(NamedTuple):
    """What the compiled passes need of a layout: one (kind, first column, width, first
    16-bit word) a part with columns, the row rounded to nearest or stochastically."""

    layout: tuple[StoredSlot, ...]
    width: int
    nbytes: int
    nearest: NDArray[np.int64]
    stochastic: NDArray[np.int64]
    float32: bool  # every part float32


def _parts(layout: tuple[StoredSlot, ...], rounding: Rounding) -> NDArray[np.int64]:
    rows = []
    column = word = 0
    for part in layout:
        if part.width:
            stochastic = part.name == "row" and rounding == "stochastic"
            kind = {
                "float32": _F32,
                "float16": _F16_STOCHASTIC if stochastic else _F16,
                "bfloat16": _BF16_STOCHASTIC if stochastic else _BF16,
            }[part.dtype]
            rows.append((kind, column, part.width, word))
        column += part.width
        word += part.width * itemsize(part.dtype) // 2
    parts = np.array(rows, dtype=np.int64).reshape(-1, 4)
    parts.flags.writeable = False
    return parts


@functools.lru_cache(maxsize=1024)
def _cached_coding(optimizer: Optimizer, dim: int, dtype: RowDtype) -> _Coding:
    layout = item_layout(optimizer, dim, dtype)
    return _Coding(
        layout,
        sum(part.width for part in layout),
        sum(part.width * itemsize(part.dtype) for part in layout),
        _parts(layout, "nearest"),
        _parts(layout, "stochastic"),
        all(part.dtype == "float32" for part in layout),
    )


def _coding(optimizer: Optimizer, dim: int, dtype: RowDtype) -> _Coding:
    """A table's `_Coding`, worked out once (a push codes every table's items)."""
    try:
        return _cached_coding(optimizer, dim, dtype)  # type: ignore[arg-type]  # hashed here
    except TypeError:  # an optimizer that is not hashable: worked out each call
        return _cached_coding.__wrapped__(optimizer, dim, dtype)


def encode_items(
    items: Float32Array,
    optimizer: Optimizer,
    dim: int,
    dtype: RowDtype,
    *,
    rounding: Rounding = "nearest",
    keys: NDArray[np.uint64] | None = None,
    table: str = "rows",
    ids: NDArray[Any] | None = None,
) -> NDArray[np.uint8]:
    """float32 items (n, dim + slot_width) as stored: a new uint8 array (n, value_bytes).

    The row columns are rounded with `rounding` (and `keys`, one a row, when stochastic);
    slot columns stored as 16-bit dtypes to nearest.

    Raises:
        ValueError: items not float32 (n, dim + slot_width), or keys not one a row.
        RowOverflowError: a value beyond its dtype's range (`precision.encode`).
        ConfigError: an unknown rounding.
    """
    coding = _coding(optimizer, dim, dtype)
    width = coding.width
    if (
        not isinstance(items, np.ndarray)
        or items.dtype != np.float32
        or items.ndim != 2
        or items.shape[1] != width
    ):
        got = f"{items.dtype} {items.shape}" if isinstance(items, np.ndarray) else repr(items)
        raise ValueError(
            f"items: expected float32 (n, {width}) for dim {dim} with "
            f"{type(optimizer).__name__}, got {got}"
        )
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding {rounding!r} is not one of {', '.join(ROUNDINGS)}")
    if coding.float32:
        return np.array(items, dtype=np.float32, order="C").view(np.uint8)  # <f4 (x86, ARM)
    n = items.shape[0]
    stochastic = rounding == "stochastic" and dtype != "float32"
    row_keys = check_row_keys(keys, n) if stochastic else _NO_KEYS
    values = np.ascontiguousarray(items)
    out = np.empty((n, coding.nbytes // 2), dtype=np.uint16)
    parts = coding.stochastic if stochastic else coding.nearest
    status = _encode_pass(values, row_keys, parts, out)
    if status == _OVERFLOW:
        _refuse_overflow(values, coding.layout, table, ids)
    if status == _F16_NAN:
        for kind, column, part_width, word in parts.tolist():
            if kind in (_F16, _F16_STOCHASTIC):
                part = values[:, column : column + part_width]
                nan = np.isnan(part)
                out[:, word : word + part_width][nan] = part[nan].astype(np.float16).view(np.uint16)
    return out.view(np.uint8)


_NO_KEYS = np.empty(0, dtype=np.uint64)


def _refuse_overflow(
    values: Float32Array, layout: tuple[StoredSlot, ...], table: str, ids: NDArray[Any] | None
) -> None:
    """The RowOverflowError `precision.encode` raises for the first part with a value
    beyond its dtype (the row's, then the slots' in order)."""
    column = 0
    for part in layout:
        if part.dtype != "float32":
            name = table if part.name == "row" else f"{table} {part.name}"
            check_values_fit(values[:, column : column + part.width], part.dtype, name, ids)
        column += part.width
    raise AssertionError("the compiled pass found a value beyond its dtype, the check none")


def decode_items(
    values: NDArray[np.uint8], optimizer: Optimizer, dim: int, dtype: RowDtype
) -> Float32Array:
    """The float32 items (n, dim + slot_width) of stored values (n, value_bytes), exactly.

    Raises:
        ValueError: values not a uint8 (n, value_bytes) array.
    """
    coding = _coding(optimizer, dim, dtype)
    size = coding.nbytes
    if (
        not isinstance(values, np.ndarray)
        or values.dtype != np.uint8
        or values.ndim != 2
        or values.shape[1] != size
    ):
        got = f"{values.dtype} {values.shape}" if isinstance(values, np.ndarray) else repr(values)
        raise ValueError(
            f"values: expected uint8 (n, {size}) for dim {dim} as {dtype} with "
            f"{type(optimizer).__name__}, got {got}"
        )
    if coding.float32:
        return np.ascontiguousarray(values).view(np.float32).copy()
    words = np.ascontiguousarray(values).view(np.uint16)
    if not words.flags.aligned:
        words = words.copy()
    out = np.empty((values.shape[0], coding.width), dtype=np.float32)
    if _decode_pass(words, coding.nearest, out) == _F16_NAN:
        for kind, column, part_width, word in coding.nearest.tolist():
            if kind == _F16:
                half = words[:, word : word + part_width]
                nan = (half & np.uint16(0x7FFF)) > np.uint16(0x7C00)
                out[:, column : column + part_width][nan] = half[nan].view(np.float16)
    return out
