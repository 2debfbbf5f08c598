"""An item's stored bytes per row: the row in its table's dtype, then each slot as its
optimizer stores it (`Optimizer.slot_storage`), little-endian, no header, no padding.

Items in memory are float32 (n, dim + slot_width): the row, then its slots, as the
optimizers take them. `encode_items` rounds the row to the table's dtype (to nearest or
stochastically, `lookup_table.core.precision`) and each slot column to its own dtype (to
nearest: the optimizers give slot values that are already that dtype's, so nothing is
lost); `decode_items` gives the float32 items back. With float32 rows and float32 slots
the bytes are the float32 items as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.optimizers.base import Float32Array, Optimizer, StoredSlot
from lookup_table.core.precision import Rounding, RowDtype, check_dtype, decode, encode, itemsize

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
        ValueError: items not float32 (n, dim + slot_width).
        RowOverflowError: a row value beyond its dtype's range (`precision.encode`).
    """
    layout = item_layout(optimizer, dim, dtype)
    width = dim + optimizer.slot_width(dim)
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
    out = np.empty((items.shape[0], value_bytes(optimizer, dim, dtype)), dtype=np.uint8)
    column = offset = 0
    for part in layout:
        if not part.width:
            continue
        values = items[:, column : column + part.width]
        if part.name == "row":
            words = encode(values, part.dtype, rounding=rounding, keys=keys, table=table, ids=ids)
        else:
            words = encode(values, part.dtype, table=f"{table} {part.name}", ids=ids)
        size = part.width * itemsize(part.dtype)
        out[:, offset : offset + size] = words.view(np.uint8).reshape(items.shape[0], size)
        column += part.width
        offset += size
    return out


def decode_items(
    values: NDArray[np.uint8], optimizer: Optimizer, dim: int, dtype: RowDtype
) -> Float32Array:
    """The float32 items (n, dim + slot_width) of stored values (n, value_bytes), exactly.

    Raises:
        ValueError: values not a uint8 (n, value_bytes) array.
    """
    layout = item_layout(optimizer, dim, dtype)
    size = value_bytes(optimizer, dim, dtype)
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
    n = values.shape[0]
    out = np.empty((n, dim + optimizer.slot_width(dim)), dtype=np.float32)
    column = offset = 0
    for part in layout:
        nbytes = part.width * itemsize(part.dtype)
        if not nbytes:
            continue
        raw = np.ascontiguousarray(values[:, offset : offset + nbytes])
        words = raw.view(_word(part.dtype)).reshape(n, part.width)
        out[:, column : column + part.width] = decode(words, part.dtype)
        column += part.width
        offset += nbytes
    return out


def _word(dtype: RowDtype) -> np.dtype[Any]:
    return np.dtype("<f4") if dtype == "float32" else np.dtype("<u2")
