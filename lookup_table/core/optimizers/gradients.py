"""A push's gradients before the update: duplicate ids summed in a fixed order (bit for
bit reproducible), NaN/Inf refused. docs/optimizers.md says why this order and method.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.optimizers.base import Float32Array

__all__ = ["check_finite", "segment_sum"]


def segment_sum(ids: NDArray[Any], grads: Float32Array) -> tuple[NDArray[Any], Float32Array]:
    """Sum the gradients of duplicate ids.

    Args:
        ids: (n,) int64, or an object array (n,) of str.
        grads: float32 (n, dim), row i the gradient of ids[i].

    Returns:
        (unique_ids, summed): the distinct ids in ascending order (int64 by value,
        str by code point), same dtype as `ids`, and float32 (n_unique, dim) sums
        in push order (see module docstring). Both are new arrays.

    Raises:
        ValueError: wrong dtype or shape, or an object array holding a non-str.
    """
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype not in (np.int64, object):
        what = f"{ids.dtype} {ids.shape}" if isinstance(ids, np.ndarray) else "not an array"
        raise ValueError(f"ids: expected int64 (n,) or an object array (n,) of str, got {what}")
    if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.ndim != 2:
        what = f"{grads.dtype} {grads.shape}" if isinstance(grads, np.ndarray) else "not an array"
        raise ValueError(f"grads: expected float32 (n, dim), got {what}")
    if grads.shape[0] != ids.shape[0]:
        raise ValueError(f"grads: expected {ids.shape[0]} rows, one per id, got {grads.shape[0]}")
    if ids.shape[0] == 0:
        return ids.copy(), grads.copy()

    if ids.dtype != object and (ids.shape[0] == 1 or bool((ids[1:] > ids[:-1]).all())):
        # already ascending and distinct (a trainer pushes np.unique's ids): no sort
        return ids.copy(), grads.copy()
    if ids.dtype == object:
        unique_ids, inverse = _unique_str(ids)
    else:
        unique_ids, inverse = np.unique(ids, return_inverse=True)
    dim = grads.shape[1]
    if unique_ids.shape[0] == ids.shape[0]:  # no duplicates: just put the rows in id order
        summed = np.empty_like(grads)
        summed[inverse] = grads
        return unique_ids, summed
    flat = np.zeros(unique_ids.shape[0] * dim, dtype=np.float32)
    index = inverse.reshape(-1, 1) * dim + np.arange(dim)
    with np.errstate(over="ignore"):  # an overflow to inf is refused by check_finite
        np.add.at(flat, index.ravel(), grads.ravel())
    return unique_ids, flat.reshape(-1, dim)


def _unique_str(ids: NDArray[Any]) -> tuple[NDArray[Any], NDArray[np.intp]]:
    """`np.unique(ids, return_inverse=True)` for an object array of str, 2-3x faster.

    numpy sorts an object array by calling the comparison once per pair; a dict
    finds the distinct strs in one pass and Python sorts only those.
    """
    values = ids.tolist()
    bad = next((x for x in values if type(x) is not str), None)
    if bad is not None:
        raise ValueError(f"ids: an object array of ids must hold only str, got {bad!r:.40}")
    codes: dict[str, int] = {}
    first_seen = np.fromiter(
        (codes.setdefault(x, len(codes)) for x in values), dtype=np.intp, count=len(values)
    )
    distinct = list(codes)
    order = sorted(range(len(distinct)), key=distinct.__getitem__)
    rank = np.empty(len(distinct), dtype=np.intp)
    rank[order] = np.arange(len(distinct))
    unique_ids = np.empty(len(distinct), dtype=object)
    unique_ids[:] = [distinct[i] for i in order]
    return unique_ids, rank[first_seen]


def check_finite(grads: NDArray[Any], table: str, *, ids: NDArray[Any] | None = None) -> None:
    """Raise ValueError if `grads` holds a NaN or an Inf.

    Args:
        grads: the gradient of a table (n, dim) or of a dense parameter (any shape).
        table: what the message names, e.g. "tables.user" or "dense.mlp/kernel".
        ids: the ids of the rows of `grads`, to name the offending id too.

    Raises:
        ValueError: the message names `table`, the first bad position (row and
            column for 2-D grads), its value, the id when given, how many values
            are bad, and what to do.
    """
    arr = np.asarray(grads)
    if arr.dtype.kind not in "fc":
        return  # integers and bools are always finite
    finite = np.isfinite(arr)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    pos = tuple(int(i) for i in np.unravel_index(int(bad[0]), arr.shape))
    value = arr[pos]
    if arr.ndim == 2:
        where = f"row {pos[0]}, column {pos[1]}"
        if ids is not None and ids.shape[:1] == arr.shape[:1]:
            bad_id = ids[pos[0]]
            where += f" (id {bad_id.item() if isinstance(bad_id, np.generic) else bad_id!r})"
    else:
        where = f"index {list(pos)}"
    raise ValueError(
        f"{table}: gradient is not finite: {value} at {where}; {bad.size} of {arr.size} "
        f"values are NaN or Inf; check the trainer's loss for NaN or overflow, lower the "
        f"learning rate or clip the gradients"
    )
