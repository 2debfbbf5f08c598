"""numpy arrays handed to TensorFlow without a copy where it can take them: through
DLPack when they are aligned as its CPU kernels require (`aligned_empty` makes such
arrays), copied (`tf.constant`) otherwise."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from numpy.typing import DTypeLike, NDArray

__all__ = ["ALIGN", "aligned_empty", "aligned_zeros", "as_tensor", "copied_tensor"]

# bytes: EIGEN_MAX_ALIGN_BYTES of TensorFlow's AVX-512 builds, the widest of its x86-64
# builds. A kernel given a tensor not aligned so aborts the process (a CHECK), so only
# arrays aligned to it are shared.
ALIGN = 64

_SHARED = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


def aligned_empty(shape: int | tuple[int, ...], dtype: DTypeLike) -> NDArray[Any]:
    """`np.empty`, its data starting at an `ALIGN`-byte boundary (unless it is empty):
    `as_tensor` shares it."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dt).reshape(dims)


def aligned_zeros(shape: int | tuple[int, ...], dtype: DTypeLike) -> NDArray[Any]:
    """`np.zeros`, aligned as `aligned_empty`."""
    out = aligned_empty(shape, dtype)
    out.fill(0)
    return out


def as_tensor(array: NDArray[Any]) -> tf.Tensor:
    """`array` as a CPU tensor. It shares the array's memory (no copy) when the array is
    C-contiguous, writable, `ALIGN`-byte aligned and of a numeric dtype TensorFlow
    computes on: the caller then writes to it no more. Any other array is copied."""
    if (
        array.dtype in _SHARED
        and array.size
        and array.flags.c_contiguous
        and array.flags.writeable
        and array.ctypes.data % ALIGN == 0
    ):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.constant(array)


def copied_tensor(array: NDArray[Any]) -> tf.Tensor:
    """A tensor of `array`'s values in memory of its own (the caller may write `array`
    again): an aligned copy shared through `as_tensor`. Between graph steps, where the
    trainer's thread comes back to TensorFlow with cold caches, this costs less than
    `tf.constant`'s conversion path, even for a few numbers."""
    if array.dtype not in _SHARED or not array.size:
        return tf.constant(array)
    out = aligned_empty(array.shape, array.dtype)
    np.copyto(out, array)
    return as_tensor(out)
