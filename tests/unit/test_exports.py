"""The package's public API: `lookup_table.__all__` is sorted, complete and real."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types

import pytest

import lookup_table
from lookup_table import errors
from tests.unit._fresh import fresh_json

pytestmark = pytest.mark.unit

# Modules whose whole __all__ is public API, and modules that export only a few
# names at the top level (the rest is for the library's own use).
FULLY_PUBLIC = ["lookup_table.errors", "lookup_table.config"]
PARTLY_PUBLIC = {
    "lookup_table.client": ["OptimizerClient"],
    "lookup_table.core.keys": ["decode_key", "encode_key", "encode_keys"],
    "lookup_table.core.initializers": ["InitializerSpec", "initial_rows"],
    "lookup_table.store": ["EmbeddingStore", "TableRead", "TableWrite"],
}
# The top-level Python API the README shows.
API_NAMES = ["load_config", "EmbeddingStore", "OptimizerClient"]


def _existing(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_all_is_sorted_without_duplicates() -> None:
    assert lookup_table.__all__ == sorted(set(lookup_table.__all__))


def test_every_exported_name_exists() -> None:
    missing = [name for name in lookup_table.__all__ if not hasattr(lookup_table, name)]
    assert missing == []
    assert all(not name.startswith("_") for name in lookup_table.__all__)


def test_all_lists_every_public_name_of_the_package() -> None:
    """Nothing importable from `lookup_table` is missing from __all__ (httpx's check)."""
    for name in lookup_table.__all__:  # the names are lazy: load them all first
        getattr(lookup_table, name)
    assert set(lookup_table.__all__) <= set(dir(lookup_table))
    public = {
        name
        for name, value in vars(lookup_table).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"  # from __future__ import annotations
    }
    assert sorted(public) == lookup_table.__all__


@pytest.mark.parametrize("module_name", [m for m in FULLY_PUBLIC if _existing(m)])
def test_public_modules_are_re_exported(module_name: str) -> None:
    module = importlib.import_module(module_name)
    missing = sorted(set(module.__all__) - set(lookup_table.__all__))
    assert missing == [], f"{module_name} exports {missing}; add them to lookup_table.__all__"
    for name in module.__all__:
        assert getattr(lookup_table, name) is getattr(module, name)


@pytest.mark.parametrize("module_name", sorted(PARTLY_PUBLIC))
def test_chosen_names_are_re_exported(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in PARTLY_PUBLIC[module_name]:
        assert name in module.__all__
        assert name in lookup_table.__all__
        assert getattr(lookup_table, name) is getattr(module, name)


def test_module_all_names_exist() -> None:
    for module_name in [*FULLY_PUBLIC, *PARTLY_PUBLIC]:
        if not _existing(module_name):
            continue
        module = importlib.import_module(module_name)
        assert [n for n in module.__all__ if not hasattr(module, n)] == [], module_name


def test_every_error_class_is_exported() -> None:
    classes = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.LookupTableError)
    }
    assert classes <= set(errors.__all__)
    assert classes <= set(lookup_table.__all__)


def test_api_names() -> None:
    for name in API_NAMES:
        assert name in lookup_table.__all__, name


def test_error_tree_matches_design() -> None:
    e = errors
    assert issubclass(e.ConfigError, ValueError)
    assert issubclass(e.KeyEncodingError, ValueError)
    for cls in (e.StoreFullError, e.CorruptValueError, e.ProtocolError, e.NodeUnavailableError):
        assert issubclass(cls, e.StoreError)
    assert issubclass(e.NodeUnavailableError, OSError)
    assert issubclass(e.StoreTimeoutError, e.NodeUnavailableError)
    assert issubclass(e.StoreTimeoutError, TimeoutError)
    for cls in (
        e.ConfigError,
        e.DataLossError,
        e.StoreError,
        e.PushRejectedError,
        e.ClusterNotInitializedError,
    ):
        assert issubclass(cls, e.LookupTableError)
    assert e.PushRejectedError("no", status=400).status == 400
    assert e.DataLossError("lost", nodes=("a:1",)).nodes == ("a:1",)
    assert e.StoreError("x", node="a:1").node == "a:1"


def test_the_pure_core_loads_without_the_network_stack() -> None:
    """`import lookup_table.core.keys` pulls in numpy only: no aiohttp, aiomcache, store, TF."""
    loaded = fresh_json(
        """
        import json, sys
        import lookup_table.core.keys, lookup_table.core.sharding, lookup_table.core.initializers
        import lookup_table.core.keyspace, lookup_table.core.optimizers
        heavy = ["aiohttp", "aiomcache", "tensorflow", "keras", "lookup_table.store"]
        print(json.dumps([m for m in heavy if m in sys.modules]))
        """
    )
    assert loaded == []


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lookup_table.nope  # noqa: B018


def test_wire_and_replica_errors_are_in_the_tree() -> None:
    from lookup_table.core.wire import WireError

    assert WireError is errors.WireError
    assert issubclass(errors.WireError, errors.LookupTableError)
    assert issubclass(errors.WireError, ValueError)
    assert issubclass(errors.ReplicaUnavailableError, errors.LookupTableError)
    assert issubclass(errors.ReplicaUnavailableError, OSError)
    # an unreachable optimizer replica is not a memcached node
    assert not issubclass(errors.ReplicaUnavailableError, errors.StoreError)
