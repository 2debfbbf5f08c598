"""A batch's integer id columns handled all at once, compiled (numba): per column its
sorted unique ids (padding left out) and per position its row among them, which of them
are in a sorted set, and the rows a push answered with put in; one call for every column
instead of numpy's passes per column. Pure, no I/O (`keras.rows` calls these)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.jit import compiled

__all__ = [
    "patch_segments",
    "place_segments",
    "segment_bounds",
    "segment_members",
    "unique_segments",
]

_I64 = types.Array(types.int64, 1, "C", readonly=True)
_I64_OUT = types.Array(types.int64, 1, "C")
_BOOLS = types.Array(types.bool_, 1, "C", readonly=True)
_BOOLS_OUT = types.Array(types.bool_, 1, "C")
_ROWS = types.Array(types.float32, 2, "C", readonly=True)
_ROWS_OUT = types.Array(types.float32, 2, "C")


def segment_bounds(lengths: Iterable[int]) -> NDArray[np.int64]:
    """Where each of segments of `lengths`, laid one after the other, starts, and the
    total last: the `bounds` the functions here take."""
    sizes = np.fromiter(lengths, dtype=np.int64)
    bounds = np.zeros(sizes.shape[0] + 1, np.int64)
    np.cumsum(sizes, out=bounds[1:])
    return bounds


_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of id * 2**64 / phi


@compiled(types.void(_I64, _I64, _I64, _BOOLS, _I64_OUT, _I64_OUT, _I64_OUT))
def _unique(ids, bounds, pads, padded, uniq, counts, index):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    # a column's distinct ids through a hash map (one pass), then only those sorted: a
    # batch column has far fewer distinct ids than positions
    longest = 0
    for s in range(bounds.shape[0] - 1):
        longest = max(longest, bounds[s + 1] - bounds[s])
    bits = 4
    while (1 << bits) < 2 * longest:
        bits += 1
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    keys = np.empty(1 << bits, np.int64)
    first = np.full(1 << bits, -1, np.int64)  # per slot, its id's number in arrival order
    used = np.empty(longest, np.int64)
    rank = np.empty(longest, np.int64)
    for s in range(bounds.shape[0] - 1):
        lo, hi = bounds[s], bounds[s + 1]
        n = 0
        for k in range(lo, hi):
            v = ids[k]
            if padded[s] and v == pads[s]:
                index[k] = -1
                continue
            j = np.int64((np.uint64(v) * np.uint64(_GOLDEN)) >> shift)
            while first[j] >= 0 and keys[j] != v:
                j = (j + 1) & mask
            if first[j] < 0:
                keys[j] = v
                first[j] = n
                used[n] = j
                uniq[lo + n] = v
                n += 1
            index[k] = first[j]
        # sorted in place (no index sort, no copy), then each id's arrival number found
        # again through its slot
        uniq[lo : lo + n].sort()
        for r in range(n):
            v = uniq[lo + r]
            j = np.int64((np.uint64(v) * np.uint64(_GOLDEN)) >> shift)
            while keys[j] != v:
                j = (j + 1) & mask
            rank[first[j]] = r
        for r in range(n):
            first[used[r]] = -1  # the map empty again for the next column
        for k in range(lo, hi):
            index[k] = n if index[k] < 0 else rank[index[k]]  # padding: the zero row
        counts[s] = n


def unique_segments(
    ids: NDArray[Any],
    bounds: NDArray[np.int64],
    pads: NDArray[np.int64],
    padded: NDArray[np.bool_],
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Columns `ids[bounds[s]:bounds[s + 1]]` made unique: (uniq, counts, index) with
    column s's sorted unique ids at `uniq[bounds[s]:bounds[s] + counts[s]]` (the id
    `pads[s]` left out where `padded[s]`) and, per position, its row among them
    (`counts[s]` for a padding id): what `np.unique(..., return_inverse=True)` gives
    per column."""
    uniq = np.empty(ids.shape[0], np.int64)
    counts = np.empty(max(bounds.shape[0] - 1, 0), np.int64)
    index = np.empty(ids.shape[0], np.int64)
    _unique(ids, bounds, pads, padded, uniq, counts, index)
    return uniq, counts, index


@compiled(types.void(_I64, _I64, _I64, _I64, _I64, _BOOLS_OUT))
def _members(ids, bounds, counts, among, among_bounds, hit):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for s in range(bounds.shape[0] - 1):
        lo, n = bounds[s], counts[s]
        a, b = among_bounds[s], among_bounds[s + 1]
        j = a
        for k in range(lo, lo + n):  # both sorted: one merge pass
            v = ids[k]
            while j < b and among[j] < v:
                j += 1
            hit[k] = j < b and among[j] == v


def segment_members(
    ids: NDArray[np.int64],
    bounds: NDArray[np.int64],
    counts: NDArray[np.int64],
    among: NDArray[np.int64],
    among_bounds: NDArray[np.int64],
) -> NDArray[np.bool_]:
    """Per sorted unique column `ids[bounds[s]:bounds[s] + counts[s]]`, which of its ids
    are in the sorted unique `among[among_bounds[s]:among_bounds[s + 1]]` (False
    elsewhere)."""
    hit = np.zeros(ids.shape[0], dtype=bool)
    _members(ids, bounds, counts, among, among_bounds, hit)
    return hit


@compiled(types.void(_I64, _I64, _I64, _I64, _ROWS, _ROWS_OUT, _BOOLS_OUT))
def _patch(ids, bounds, patch_ids, patch_bounds, patch_rows, rows, brought):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for s in range(bounds.shape[0] - 1):
        j, b = patch_bounds[s], patch_bounds[s + 1]
        for k in range(bounds[s], bounds[s + 1]):  # both sorted: one merge pass
            v = ids[k]
            while j < b and patch_ids[j] < v:
                j += 1
            if j < b and patch_ids[j] == v:
                rows[k, :] = patch_rows[j, :]
                brought[k] = True


def patch_segments(
    ids: NDArray[Any],
    bounds: NDArray[np.int64],
    patch_ids: NDArray[np.int64],
    patch_bounds: NDArray[np.int64],
    patch_rows: NDArray[np.float32],
    rows: NDArray[np.float32],
    brought: NDArray[np.bool_],
) -> None:
    """Per segment s, put into `rows[k]` the row of `patch_rows` whose id in
    `patch_ids[patch_bounds[s]:patch_bounds[s + 1]]` is `ids[k]`, for k in
    `bounds[s]:bounds[s + 1]` (both sorted unique), and mark it `brought`."""
    _patch(ids, bounds, patch_ids, patch_bounds, patch_rows, rows, brought)


@compiled(types.void(_I64_OUT, _I64, _I64, _I64, _I64))
def _place(index, bounds, counts, offsets, zero_rows):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for s in range(bounds.shape[0] - 1):
        n, offset, zero = counts[s], offsets[s], zero_rows[s]
        for k in range(bounds[s], bounds[s + 1]):
            v = index[k]
            index[k] = v + offset if v < n else zero


def place_segments(
    index: NDArray[np.int64],
    bounds: NDArray[np.int64],
    counts: NDArray[np.int64],
    offsets: NDArray[np.int64],
    zero_rows: NDArray[np.int64],
) -> None:
    """In place, per segment s of `index` (`bounds[s]:bounds[s + 1]`, rows among its
    `counts[s]` unique ids, `counts[s]` for padding): each row moved by `offsets[s]`,
    padding's to `zero_rows[s]` (where a table of many segments keeps them)."""
    _place(index, bounds, counts, offsets, zero_rows)
