"""The row codec (pure): a row is exactly `width` little-endian float32, nothing else.

Storage format 2: the value of a `w` key is the row's `dim` x `<f4`, then its
optimizer's slot width x `<f4` (none for plain SGD). No header, no padding.
A value of any other length is corruption: `CorruptValueError`, never a reshape,
a pad, or a cache miss (a miss would make us create a fresh row over it).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.hashing import mix64
from lookup_table.errors import CorruptValueError

__all__ = ["ROW_DTYPE", "decode_row", "encode_rows", "row_bytes", "value_hashes"]

ROW_DTYPE = np.dtype("<f4")

# Keys of the values' hash, one per 32-bit word: odd 64-bit constants from a fixed seed.
_HASH_KEYS = np.random.default_rng(0x6A6F75726E616C).integers(
    0, 2**63, size=4096, dtype=np.uint64
) * np.uint64(2) + np.uint64(1)


_HASH_SLICE_BYTES = 2 * 1024 * 1024


def row_bytes(width: int) -> int:
    """Bytes of one stored value of `width` floats."""
    return width * ROW_DTYPE.itemsize


def encode_rows(values: NDArray[np.float32], width: int) -> NDArray[np.uint8]:
    """Rows (n, width) as a uint8 matrix (n, 4*width) in the stored byte order.

    Raises:
        ValueError: values is not (n, width).
    """
    arr = np.asarray(values)
    if arr.ndim != 2 or arr.shape[1] != width:
        raise ValueError(f"expected rows of shape (n, {width}), got {arr.shape}")
    return np.ascontiguousarray(arr, dtype=ROW_DTYPE).view(np.uint8)


def decode_row(
    value: bytes | bytearray | memoryview, width: int, *, key: bytes, node: str | None = None
) -> NDArray[np.float32]:
    """One stored value -> a writable float32 row (width,).

    Raises:
        CorruptValueError: the value is not exactly 4*width bytes; names the key.
    """
    if len(value) != row_bytes(width):
        where = f" on node {node}" if node else ""
        raise CorruptValueError(
            f"value of key {key.decode('ascii', 'replace')!r}{where} has {len(value)} bytes, "
            f"expected {row_bytes(width)} ({width} float32): the table's dim changed or the "
            f"value is corrupt; restore the table's dim or use a new table name",
            node=node,
        )
    return np.frombuffer(value, dtype=ROW_DTYPE).astype(np.float32)


def value_hashes(values: NDArray[np.float32], *more: NDArray[np.float32]) -> NDArray[np.uint64]:
    """A 64-bit hash of each stored value (an item: a row and its slots), (n, width)
    float32 -> (n,) uint64. Blocks of columns given apart (`value_hashes(rows, slots)`)
    hash as their concatenation, without making it.

    Tells whether a stored value is the one a journal expects (`optimizer_service`): it
    hashes the stored bytes, so -0.0 and 0.0, or two NaNs of other payloads, differ. A
    multilinear sum of the 32-bit words with odd 64-bit keys, then `mix64`: two values
    that differ in any word collide with probability about 2**-64 when they differ in low
    bits (as an optimizer step's do), never when they differ in one word only.
    """
    blocks = [np.asarray(block, dtype=ROW_DTYPE) for block in (values, *more)]
    if any(b.ndim != 2 or b.shape[0] != blocks[0].shape[0] for b in blocks):
        shapes = ", ".join(str(b.shape) for b in blocks)
        raise ValueError(f"expected values of shape (n, width), n alike, got {shapes}")
    width = sum(b.shape[1] for b in blocks)
    if width > _HASH_KEYS.size:
        raise ValueError(f"values of {width} floats: at most {_HASH_KEYS.size} are hashed")
    n = blocks[0].shape[0]
    total = np.zeros(n, dtype=np.uint64)
    # a slice of rows at a time: the uint64 words stay in the CPU's cache (~2 MiB)
    step = max(1024, _HASH_SLICE_BYTES // (8 * max(width, 1)))
    for start in range(0, n, step):
        offset = 0
        for block in blocks:
            words = block[start : start + step].view(np.uint32).astype(np.uint64)  # any strides
            words *= _HASH_KEYS[offset : offset + block.shape[1]]  # wraps modulo 2**64
            total[start : start + step] += words.sum(axis=1, dtype=np.uint64)
            offset += block.shape[1]
    total ^= np.uint64(width)
    return mix64(total)
