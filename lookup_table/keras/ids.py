"""A batch's integer id columns handled all at once, compiled (numba): per column its
sorted unique ids (padding left out) and per position its row among them, which of them
are in a sorted set, and the rows a push answered with put in; one call for every column
instead of numpy's passes per column. Pure, no I/O (`rows` calls these)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.jit import compiled

__all__ = ["patch_segments", "segment_members", "unique_segments"]

_I64 = types.Array(types.int64, 1, "C", readonly=True)
_I64_OUT = types.Array(types.int64, 1, "C")
_BOOLS = types.Array(types.bool_, 1, "C", readonly=True)
_BOOLS_OUT = types.Array(types.bool_, 1, "C")
_ROWS = types.Array(types.float32, 2, "C", readonly=True)
_ROWS_OUT = types.Array(types.float32, 2, "C")


@compiled(types.void(_I64, _I64, _I64, _BOOLS, _I64_OUT, _I64_OUT, _I64_OUT))
def _unique(ids, bounds, pads, padded, uniq, counts, index):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    for s in range(bounds.shape[0] - 1):
        lo, hi = bounds[s], bounds[s + 1]
        order = np.argsort(ids[lo:hi])
        n = 0
        for k in range(hi - lo):
            at = lo + order[k]
            v = ids[at]
            if padded[s] and v == pads[s]:
                index[at] = -1
                continue
            if n == 0 or v != uniq[lo + n - 1]:
                uniq[lo + n] = v
                n += 1
            index[at] = n - 1
        counts[s] = n
        if padded[s]:
            for at in range(lo, hi):
                if index[at] < 0:
                    index[at] = n  # the zero row after the column's unique ids


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
