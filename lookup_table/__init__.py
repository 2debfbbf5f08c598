"""A distributed lookup table for TensorFlow embeddings, stored in sharded memcached.

Rows live in plain memcached servers ("storage doesn't optimize"); trainers read
them in pipelined batches and an optimizer service applies the updates.

The names below are imported on first use (PEP 562): `import lookup_table.core.keys`
loads numpy, not aiohttp or the store.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ below
    from lookup_table.client import OptimizerClient
    from lookup_table.config import (
        AdagradConfig,
        AdamConfig,
        ClusterConfig,
        NodeSpec,
        OptimizerConfig,
        RowwiseAdagradConfig,
        RowwiseAdamConfig,
        ServiceConfig,
        SGDConfig,
        StoreConfig,
        TableSpec,
        load_config,
        parse_config,
    )
    from lookup_table.core.initializers import (
        InitializerSpec,
        initial_rows,
    )
    from lookup_table.core.keys import (
        decode_key,
        encode_key,
        encode_keys,
    )
    from lookup_table.errors import (
        CheckpointError,
        ClusterMismatchError,
        ClusterNotInitializedError,
        ConfigError,
        CorruptValueError,
        DataLossError,
        DenseParamError,
        ExportTooLargeError,
        KeyEncodingError,
        LookupTableError,
        NamespaceNotEmptyError,
        NodeUnavailableError,
        ProtocolError,
        PushRejectedError,
        ReplicaUnavailableError,
        RowOverflowError,
        StorageFormatError,
        StoreError,
        StoreFullError,
        StoreTimeoutError,
        WireError,
    )
    from lookup_table.store import EmbeddingStore, TableRead, TableWrite

__all__ = [
    "AdagradConfig",
    "AdamConfig",
    "CheckpointError",
    "ClusterConfig",
    "ClusterMismatchError",
    "ClusterNotInitializedError",
    "ConfigError",
    "CorruptValueError",
    "DataLossError",
    "DenseParamError",
    "EmbeddingStore",
    "ExportTooLargeError",
    "InitializerSpec",
    "KeyEncodingError",
    "LookupTableError",
    "NamespaceNotEmptyError",
    "NodeSpec",
    "NodeUnavailableError",
    "OptimizerClient",
    "OptimizerConfig",
    "ProtocolError",
    "PushRejectedError",
    "ReplicaUnavailableError",
    "RowOverflowError",
    "RowwiseAdagradConfig",
    "RowwiseAdamConfig",
    "SGDConfig",
    "ServiceConfig",
    "StorageFormatError",
    "StoreConfig",
    "StoreError",
    "StoreFullError",
    "StoreTimeoutError",
    "TableRead",
    "TableSpec",
    "TableWrite",
    "WireError",
    "decode_key",
    "encode_key",
    "encode_keys",
    "initial_rows",
    "load_config",
    "parse_config",
]

# name -> the module that defines it
_LAZY = {
    "AdagradConfig": "lookup_table.config",
    "AdamConfig": "lookup_table.config",
    "CheckpointError": "lookup_table.errors",
    "ClusterConfig": "lookup_table.config",
    "ClusterMismatchError": "lookup_table.errors",
    "ClusterNotInitializedError": "lookup_table.errors",
    "ConfigError": "lookup_table.errors",
    "CorruptValueError": "lookup_table.errors",
    "DataLossError": "lookup_table.errors",
    "DenseParamError": "lookup_table.errors",
    "EmbeddingStore": "lookup_table.store",
    "ExportTooLargeError": "lookup_table.errors",
    "InitializerSpec": "lookup_table.core.initializers",
    "KeyEncodingError": "lookup_table.errors",
    "LookupTableError": "lookup_table.errors",
    "NamespaceNotEmptyError": "lookup_table.errors",
    "NodeSpec": "lookup_table.config",
    "NodeUnavailableError": "lookup_table.errors",
    "OptimizerClient": "lookup_table.client",
    "OptimizerConfig": "lookup_table.config",
    "ProtocolError": "lookup_table.errors",
    "PushRejectedError": "lookup_table.errors",
    "ReplicaUnavailableError": "lookup_table.errors",
    "RowOverflowError": "lookup_table.errors",
    "RowwiseAdagradConfig": "lookup_table.config",
    "RowwiseAdamConfig": "lookup_table.config",
    "SGDConfig": "lookup_table.config",
    "ServiceConfig": "lookup_table.config",
    "StoreConfig": "lookup_table.config",
    "StoreError": "lookup_table.errors",
    "StoreFullError": "lookup_table.errors",
    "StorageFormatError": "lookup_table.errors",
    "StoreTimeoutError": "lookup_table.errors",
    "TableRead": "lookup_table.store",
    "TableSpec": "lookup_table.config",
    "TableWrite": "lookup_table.store",
    "WireError": "lookup_table.errors",
    "decode_key": "lookup_table.core.keys",
    "encode_key": "lookup_table.core.keys",
    "encode_keys": "lookup_table.core.keys",
    "initial_rows": "lookup_table.core.initializers",
    "load_config": "lookup_table.config",
    "parse_config": "lookup_table.config",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lookup_table' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
