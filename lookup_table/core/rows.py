"""The row codec (pure): a row is exactly `width` little-endian float32, nothing else.

Storage format 2: the value of a `w` key is the row's `dim` x `<f4`, then its
optimizer's slot width x `<f4` (none for plain SGD). No header, no padding.
A value of any other length is corruption: `CorruptValueError`, never a reshape,
a pad, or a cache miss (a miss would make us create a fresh row over it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.hashing import mix64
from lookup_table.errors import CorruptValueError

__all__ = [
    "NOT_UPDATED",
    "ROW_DTYPE",
    "UNCHANGED",
    "blocks",
    "change_witnesses",
    "decode_row",
    "encode_rows",
    "row_bytes",
    "still_old",
    "value_hashes",
]

ROW_DTYPE = np.dtype("<f4")

# Keys of the values' hash, one per 32-bit word: odd 64-bit constants from a fixed seed.
_HASH_KEYS = np.random.default_rng(0x6A6F75726E616C).integers(
    0, 2**63, size=4096, dtype=np.uint64
) * np.uint64(2) + np.uint64(1)


_HASH_SLICE_BYTES = 2 * 1024 * 1024


def blocks(values: NDArray[Any], counts: Sequence[int]) -> list[NDArray[Any]]:
    """`values` cut into consecutive blocks of `counts` rows (views): the tables of a
    batch worked as one, back apart. Plain slices: `np.split` costs ~10 times more a
    block (a push cuts 26 tables' rows several times)."""
    out = []
    start = 0
    for n in counts:
        out.append(values[start : start + n])
        start += n
    return out


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


# A change witness (`change_witnesses`) packs a word's position into the high 32 bits and
# the word's old bits into the low 32; these two have no word:
UNCHANGED = np.int64(-1 << 32)
"""The update leaves the item as it was, bit for bit: recomputing it gives it again."""
NOT_UPDATED = np.int64(-2 << 32)
"""The push does not update the id (admission dropped its gradient): never recomputed."""


def change_witnesses(
    old: tuple[NDArray[np.float32], ...], new: tuple[NDArray[np.float32], ...]
) -> NDArray[np.int64]:
    """Per item (row i of the blocks, side by side: a row, then its slots), one word that
    an update changes: its position among the item's 32-bit words in the high 32 bits,
    its bits *before* the update in the low 32; `UNCHANGED` where the update leaves every
    word as it was. (n,) int64.

    Tells exactly, without a hash, whether a stored item is the old value or the new one
    (`still_old`): an item is written whole or not at all, and the witness word differs
    between the two. The first changed word is taken (a row's first float, as a rule).

    Raises:
        ValueError: old and new blocks of other shapes, or not (n, width) alike in n.
    """
    if [np.shape(b) for b in old] != [np.shape(b) for b in new]:
        shapes = [np.shape(b) for b in (*old, *new)]
        raise ValueError(f"expected old and new blocks of equal shapes, got {shapes}")
    n = np.shape(old[0])[0] if old else 0
    if any(np.ndim(b) != 2 or np.shape(b)[0] != n for b in (*old, *new)):
        shapes = [np.shape(b) for b in (*old, *new)]
        raise ValueError(f"expected blocks of shape (n, width), n alike, got {shapes}")
    out = np.full(n, UNCHANGED, dtype=np.int64)
    todo = np.arange(n)  # items without a changed word found yet
    offset = 0
    for o, w in zip(old, new, strict=True):
        width = np.shape(o)[1]
        if width == 0 or not todo.size:
            offset += width
            continue
        before = np.asarray(o, dtype=ROW_DTYPE).view(np.uint32)  # same itemsize: any strides
        after = np.asarray(w, dtype=ROW_DTYPE).view(np.uint32)
        # the block's first word tells most items (an update moves every float of a row);
        # only the others are compared whole
        first = before[todo, 0] != after[todo, 0]
        done = todo[first]
        out[done] = (np.int64(offset) << 32) | before[done, 0].astype(np.int64)
        todo = todo[~first]
        if todo.size and width > 1:
            changed = before[todo] != after[todo]
            at = changed.argmax(axis=1)
            found = changed[np.arange(todo.size), at]
            done, at = todo[found], at[found]
            out[done] = ((offset + at).astype(np.int64) << 32) | before[done, at].astype(np.int64)
            todo = todo[~found]
        offset += width
    return out


def still_old(witnesses: NDArray[np.int64], *stored: NDArray[np.float32]) -> NDArray[np.bool_]:
    """Which stored items an update with these `change_witnesses` did not write yet: those
    whose witness word still has its old bits, and those it leaves `UNCHANGED`
    (recomputing them gives the same item); never those `NOT_UPDATED`. `stored`: the
    items as read now, as blocks (a row, then its slots), (n,) bool.

    Raises:
        ValueError: blocks not (n, width) with n the number of witnesses, or a witness
            pointing past the item's width (a journal of another table layout).
    """
    n = witnesses.shape[0]
    if any(np.ndim(b) != 2 or np.shape(b)[0] != n for b in stored):
        shapes = [np.shape(b) for b in stored]
        raise ValueError(f"expected {n} stored items as blocks (n, width), got {shapes}")
    words = (
        np.concatenate([np.asarray(b, dtype=ROW_DTYPE).view(np.uint32) for b in stored], axis=1)
        if stored
        else np.empty((n, 0), dtype=np.uint32)
    )
    at = witnesses >> 32
    has = at >= 0
    if has.any() and int(at[has].max()) >= words.shape[1]:
        raise ValueError(
            f"a witness names word {int(at[has].max())} of items of {words.shape[1]} words"
        )
    bits = (witnesses & 0xFFFFFFFF).astype(np.uint32)
    now = words[np.arange(n), np.where(has, at, 0)] if words.shape[1] else bits
    old: NDArray[np.bool_] = (witnesses == UNCHANGED) | (has & (now == bits))
    return old
