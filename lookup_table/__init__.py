"""A distributed lookup table for TensorFlow embeddings, stored in sharded memcached.

Rows live in plain memcached servers ("storage doesn't optimize"); trainers read
them in pipelined batches and an optimizer service applies the updates.
"""

from __future__ import annotations

from lookup_table.client import OptimizerClient
from lookup_table.config import (
    AdagradConfig,
    AdamConfig,
    ClusterConfig,
    NodeSpec,
    OptimizerConfig,
    ServiceConfig,
    SGDConfig,
    StoreConfig,
    TableSpec,
    load_config,
    parse_config,
)
from lookup_table.errors import (
    CheckpointError,
    ClusterNotInitializedError,
    ConfigError,
    CorruptValueError,
    DataLossError,
    KeyEncodingError,
    LookupTableError,
    NamespaceNotEmptyError,
    NodeUnavailableError,
    ProtocolError,
    PushRejectedError,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
)
from lookup_table.initializers import InitializerSpec, initial_rows
from lookup_table.keys import decode_key, encode_key, encode_keys
from lookup_table.store import EmbeddingStore

__all__ = [
    "AdagradConfig",
    "AdamConfig",
    "CheckpointError",
    "ClusterConfig",
    "ClusterNotInitializedError",
    "ConfigError",
    "CorruptValueError",
    "DataLossError",
    "EmbeddingStore",
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
    "SGDConfig",
    "ServiceConfig",
    "StoreConfig",
    "StoreError",
    "StoreFullError",
    "StoreTimeoutError",
    "TableSpec",
    "decode_key",
    "encode_key",
    "encode_keys",
    "initial_rows",
    "load_config",
    "parse_config",
]
