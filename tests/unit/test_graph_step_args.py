"""The graph step's arguments as tensors alone (lookup_table.keras.steps._flatten,
_rebuild): the layout tells apart what the tensors alone cannot, and the nest comes back
as it was."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from lookup_table.keras.steps import _flatten, _NotFlat, _rebuild

pytestmark = pytest.mark.unit


def _nest() -> Any:
    ragged = tf.RaggedTensor.from_row_splits(
        tf.constant([3, 4, 5], tf.int64), tf.constant([0, 1, 3], tf.int64)
    )
    sparse = tf.sparse.from_dense(tf.constant([[0.0, 2.0]]))
    packs = ((("C1", "C2"), tf.constant(np.arange(6).reshape(2, 3))),)
    return (({"r": ragged, "s": sparse, "w": None}, packs), [tf.constant([1.0]), 2, True])


def _same(a: Any, b: Any) -> None:
    tf.nest.assert_same_structure(a, b, expand_composites=True)
    for x, y in zip(
        tf.nest.flatten(a, expand_composites=True),
        tf.nest.flatten(b, expand_composites=True),
        strict=True,
    ):
        if isinstance(x, tf.Tensor):
            np.testing.assert_array_equal(x.numpy(), y.numpy())
        else:
            assert type(x) is type(y) and x == y


def test_rebuilt_eagerly_and_in_a_graph() -> None:
    nest = _nest()
    tensors: list[Any] = []
    layout = _flatten(nest, tensors)
    assert all(isinstance(t, tf.Tensor) for t in tensors)
    _same(_rebuild(layout, iter(tensors)), nest)

    @tf.function
    def identity(*parts: Any) -> Any:
        rebuilt = _rebuild(layout, iter(parts))
        tf.nest.assert_same_structure(rebuilt, nest, expand_composites=True)
        leaves = tf.nest.flatten(rebuilt, expand_composites=True)
        constants = [x for x in tf.nest.flatten(nest) if not tf.is_tensor(x)]
        assert [x for x in tf.nest.flatten(rebuilt) if not tf.is_tensor(x)] == constants
        return [x for x in leaves if isinstance(x, tf.Tensor)]

    for got, want in zip(identity(*tensors), tensors, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_layouts_tell_apart_what_tensors_do_not() -> None:
    x = tf.constant([1.0])

    def layout(value: Any) -> Any:
        return _flatten(value, [])

    # the same tensors under other keys, in other containers, beside other constants
    assert layout({"a": x, "b": x}) != layout({"a": x, "c": x})
    assert layout((x, x)) != layout([x, x])
    assert layout((x, 1)) != layout((x, True))
    assert layout((x, ("C1", "C2"))) != layout((x, ("C2", "C1")))
    assert layout({"a": x}) == layout({"a": tf.constant([2.0])})
    hash(layout(_nest()))


def test_what_it_cannot_take_apart() -> None:
    for value in (np.zeros(2), tf.Variable(1.0), object()):
        with pytest.raises(_NotFlat):
            _flatten((tf.constant(1), value), [])
