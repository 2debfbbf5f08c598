"""numpy arrays handed to TensorFlow (lookup_table.keras.tensors): an aligned array is
shared, not copied, and computes as a copy would; anything TensorFlow could not take
as it is (unaligned: a kernel would abort the process; read-only, strided, other
dtypes, empty) is copied."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from lookup_table.keras.tensors import ALIGN, aligned_empty, aligned_zeros, as_tensor, copied_tensor

pytestmark = pytest.mark.unit


def _shares(array: np.ndarray, tensor: tf.Tensor) -> bool:
    """Whether a write into `array` shows in `tensor` (the array is changed)."""
    flat = array.reshape(-1)
    before = tensor.numpy().reshape(-1)[0]
    flat[0] = flat[0] + 1
    return bool(tensor.numpy().reshape(-1)[0] != before)


@given(
    rows=st.integers(0, 5000),
    cols=st.integers(1, 33),
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.uint8]),
)
def test_aligned_arrays_start_at_the_boundary(rows: int, cols: int, dtype: type) -> None:
    a = aligned_empty((rows, cols), dtype)
    assert a.shape == (rows, cols) and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    z = aligned_zeros(rows * cols, dtype)
    assert z.shape == (rows * cols,) and not z.any()
    if rows:  # an empty array has no data to align (`as_tensor` never shares one)
        assert a.ctypes.data % ALIGN == 0 and z.ctypes.data % ALIGN == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_an_aligned_array_is_shared_and_computes_as_a_copy(dtype: type) -> None:
    rng = np.random.default_rng(0)
    a = aligned_empty((20_000, 16), dtype)
    a[...] = rng.integers(-100, 100, a.shape)
    index = aligned_empty(5000, np.int64)
    index[...] = rng.integers(0, 20_000, 5000)
    t, i = as_tensor(a), as_tensor(index)
    expected = tf.gather(tf.constant(a), tf.constant(index)).numpy()
    np.testing.assert_array_equal(tf.gather(t, i).numpy(), expected)
    np.testing.assert_array_equal((t * 2).numpy(), a * 2)
    assert t.dtype == tf.as_dtype(dtype) and t.shape == a.shape
    assert _shares(a, t)


def _unaligned(n: int) -> np.ndarray:
    raw = aligned_empty(n * 4 + ALIGN, np.uint8)
    return raw[16 : 16 + n * 4].view(np.float32)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _unaligned(4096).reshape(256, 16), id="unaligned"),
        pytest.param(lambda: aligned_zeros((256, 16), np.float32)[:, :8], id="not contiguous"),
        pytest.param(lambda: aligned_zeros((256, 16), np.float16), id="float16"),
        pytest.param(lambda: aligned_zeros((0, 16), np.float32), id="empty"),
    ],
)
def test_what_tensorflow_cannot_take_as_it_is_is_copied(make: object) -> None:
    a = make()  # type: ignore[operator]
    a[...] = 3
    t = as_tensor(a)
    np.testing.assert_array_equal(t.numpy(), a)
    assert t.shape == a.shape
    if a.size:
        # a kernel reads it (an unaligned tensor would abort the process here)
        np.testing.assert_array_equal(tf.gather(t, [0, 1]).numpy(), a[[0, 1]])
        assert not _shares(a, t)


def test_a_read_only_array_is_copied() -> None:
    a = aligned_zeros((64, 16), np.float32)
    a[...] = 5
    a.flags.writeable = False
    t = as_tensor(a)
    np.testing.assert_array_equal(t.numpy(), a)
    a.flags.writeable = True
    assert not _shares(a, t)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: aligned_zeros((256, 16), np.float32), id="aligned"),
        pytest.param(lambda: _unaligned(4096).reshape(256, 16), id="unaligned"),
        pytest.param(lambda: aligned_zeros((256, 16), np.int64)[:, :8], id="not contiguous"),
        pytest.param(lambda: np.zeros(27, np.int64), id="a few numbers"),
        pytest.param(lambda: aligned_zeros((256, 16), np.float16), id="float16"),
        pytest.param(lambda: aligned_zeros((0, 16), np.float32), id="empty"),
    ],
)
def test_a_copied_tensor_keeps_its_values_when_the_array_is_written_again(
    make: object,
) -> None:
    a = make()  # type: ignore[operator]
    a[...] = np.arange(a.size).reshape(a.shape)
    expected = a.copy()
    t = copied_tensor(a)
    assert t.dtype == tf.as_dtype(a.dtype) and t.shape == a.shape
    a[...] = -1
    np.testing.assert_array_equal(t.numpy(), expected)
    if a.size:  # a kernel reads it
        np.testing.assert_array_equal(tf.gather(t, [0, 1]).numpy(), expected[[0, 1]])
