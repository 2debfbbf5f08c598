"""`RemoteOptimizer` without a cluster: arguments, serialization, and Keras models
without `DistributedEmbedding` layers left to Keras' own functions."""

from __future__ import annotations

import numpy as np
import pytest

from lookup_table.config import parse_config
from lookup_table.errors import ConfigError

pytestmark = pytest.mark.unit


def _config(**overrides: object) -> object:
    raw = {
        "namespace": "unit",
        "memcached": ["127.0.0.1:1"],
        "optimizers": ["http://127.0.0.1:2"],
        "token": "s3cret",
        "tables": [{"name": "C1", "dim": 4}],
        **overrides,
    }
    return parse_config(raw, env={})


def test_config_round_trip_keeps_the_cluster_but_never_the_token() -> None:
    from lookup_table.keras import RemoteOptimizer

    opt = RemoteOptimizer(_config(), worker_index=1, num_workers=3, max_pushes_in_flight=2)
    config = opt.get_config()
    assert "token" not in config["config"] and "s3cret" not in repr(config)
    again = RemoteOptimizer.from_config(config)
    assert again.config.namespace == "unit" and again.config.tables == opt.config.tables
    assert (again.worker_index, again.num_workers, again.max_pushes_in_flight) == (1, 3, 2)
    assert again.get_config() == config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clipnorm": 1.0}, "got clipnorm: the optimizer service applies the optimizer"),
        ({"worker_index": 2, "num_workers": 2}, "worker_index must be in 0..1"),
        ({"num_workers": 0}, "num_workers must be >= 1"),
        ({"max_pushes_in_flight": -1}, "max_pushes_in_flight must be >= 0"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    from lookup_table.keras import RemoteOptimizer

    with pytest.raises(ConfigError, match=message):
        RemoteOptimizer(_config(workers=4), **kwargs)  # type: ignore[arg-type]


def test_a_path_is_not_a_cluster_config() -> None:
    from lookup_table.keras import RemoteOptimizer

    with pytest.raises(ConfigError, match="lookup_table.load_config"):
        RemoteOptimizer("cluster.toml")  # type: ignore[arg-type]


def test_it_applies_nothing_itself() -> None:
    from lookup_table.keras import RemoteOptimizer

    with pytest.raises(RuntimeError, match="the optimizer service does"):
        RemoteOptimizer(_config()).apply([np.zeros(1)])


def test_models_without_distributed_embeddings_keep_keras_functions() -> None:
    """The make_*_function wrappers hand a plain model to Keras: it trains locally."""
    import keras

    import lookup_table.keras  # noqa: F401 (installs the wrappers)

    assert keras.Model.make_train_function.__wrapped__ is not None  # type: ignore[attr-defined]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.ones((8, 3), np.float32)
    before = model.get_weights()[0].copy()
    model.fit(x, np.zeros((8, 1), np.float32), epochs=1, verbose=0)
    assert not np.array_equal(model.get_weights()[0], before)
    assert model.predict(x, verbose=0).shape == (8, 1)
