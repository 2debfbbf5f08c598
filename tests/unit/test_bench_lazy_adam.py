"""`benchmarks.train.lazy_adam`: the local baseline applies the service's Adam, row by
row with each row's own step, and leaves every other row alone."""

from __future__ import annotations

import numpy as np
import pytest

from lookup_table.config import AdamConfig
from lookup_table.core.optimizers import Adam

pytestmark = pytest.mark.unit
tf = pytest.importorskip("tensorflow", reason="tensorflow is not importable: the baseline needs it")

VOCABULARY, DIM, TABLES = 50, 4, 2


def test_lazy_adam_steps_the_batch_rows_as_the_services_adam_does() -> None:
    from benchmarks.train.lazy_adam import LazyAdamTables

    rng = np.random.default_rng(7)
    initial = [rng.uniform(-0.05, 0.05, (VOCABULARY, DIM)).astype(np.float32) for _ in range(2)]
    tables = LazyAdamTables(initial, vocabulary=VOCABULARY, learning_rate=0.01)
    adam = Adam(AdamConfig(learning_rate=0.01))
    # the service's items: row, then m, v and step
    expected = np.concatenate(
        [np.concatenate(initial), adam.initial_slots(TABLES * VOCABULARY, DIM)], axis=1
    )
    for _ in range(6):  # random subsets: the rows' step counts drift apart
        unique = rng.choice(TABLES * VOCABULARY, size=30, replace=False)
        grads = rng.normal(0, 0.1, (30, DIM)).astype(np.float32)
        tables.apply(tf.constant(unique, tf.int64), tf.constant(grads))
        rows, slots = adam.update(expected[unique, :DIM], grads, expected[unique, DIM:])
        expected[unique] = np.concatenate([rows, slots], axis=1)

    got = tables.items.numpy()
    steps = expected[:, 3 * DIM]
    assert len(set(steps.tolist())) > 3  # rows at different steps: the per-row correction
    np.testing.assert_array_equal(got[:, 3 * DIM], steps)
    never = steps == 0
    assert never.any()
    np.testing.assert_array_equal(got[never], expected[never])  # untouched rows stay
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)  # float32 rounding


def test_places_keeps_the_tables_apart_and_maps_every_id_to_its_row() -> None:
    from benchmarks.train.lazy_adam import LazyAdamTables

    initial = [np.full((VOCABULARY, DIM), k, dtype=np.float32) for k in range(TABLES)]
    tables = LazyAdamTables(initial, vocabulary=VOCABULARY)
    ids = tf.constant([[3, 3], [3 + VOCABULARY, 9], [-1, 9]], tf.int64)  # batch 3, 2 tables
    unique, at = tables.places(ids)
    # id 3 and 3 + VOCABULARY share a row of a table; -1 is row VOCABULARY - 1
    assert sorted(unique.numpy().tolist()) == [3, VOCABULARY - 1, VOCABULARY + 3, VOCABULARY + 9]
    assert at.shape == (3, 2)
    looked_up = tables.lookup(ids).numpy()
    assert looked_up.shape == (3, TABLES * DIM)
    np.testing.assert_array_equal(looked_up[:, :DIM], 0)
    np.testing.assert_array_equal(looked_up[:, DIM:], 1)
