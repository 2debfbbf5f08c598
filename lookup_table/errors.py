"""The one error hierarchy of the lookup table, rooted at `LookupTableError`.

Every message names the node, table, key or config key involved and, where there is
one, what the user can do about it. docs/architecture.md#errors draws the tree.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ClusterMismatchError",
    "ClusterNotInitializedError",
    "ConfigError",
    "CorruptValueError",
    "DataLossError",
    "DenseParamError",
    "ExportTooLargeError",
    "KeyEncodingError",
    "LookupTableError",
    "NamespaceNotEmptyError",
    "NodeUnavailableError",
    "ProtocolError",
    "PushRejectedError",
    "ReplicaUnavailableError",
    "RowOverflowError",
    "StorageFormatError",
    "StoreError",
    "StoreFullError",
    "StoreTimeoutError",
    "WireError",
]


class LookupTableError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(LookupTableError, ValueError):
    """The cluster file or an argument is wrong; the message names the key path."""


class ClusterMismatchError(ConfigError):
    """An optimizer replica runs with another cluster file than this process: they
    disagree on what `ClusterConfig.agreement` holds (namespace, memcached nodes,
    tables, optimizers, mode, the replicas), or the replica has another index than its
    place in `optimizers`. Nothing was pushed. The message names each field that
    differs with both values; `.replica` is the replica's index and `.differences`
    the (field path, this file's value, the replica's value) triples (empty when the
    replica refused a push naming only its fingerprint).
    """

    def __init__(
        self,
        message: str,
        *,
        replica: int,
        differences: tuple[tuple[str, object, object], ...] = (),
    ) -> None:
        super().__init__(message)
        self.replica = replica
        self.differences = differences


class KeyEncodingError(LookupTableError, ValueError):
    """An id, table name or namespace cannot be encoded as a memcached key."""


class DenseParamError(LookupTableError, ValueError):
    """Dense parameters or gradients that do not fit the stored model: an unknown name,
    a wrong shape, or initial values that are not finite (the caller's bug: a 400).

    `.reason` is a short label for metrics ("unknown_dense", "shape", "nan").
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RowOverflowError(LookupTableError, ValueError):
    """A row value beyond the largest finite value of its table's dtype (float16: 65504)
    was to be stored: refused instead of stored as inf. Nothing was written.

    `.table`, `.dtype` and `.value` (the first value that does not fit) name it.
    """

    def __init__(self, message: str, *, table: str, dtype: str, value: float) -> None:
        super().__init__(message)
        self.table = table
        self.dtype = dtype
        self.value = value


class ClusterNotInitializedError(LookupTableError):
    """No node of the namespace has a sentinel: `lookup-table-admin init` was never run."""


class CheckpointError(LookupTableError):
    """A checkpoint directory is missing, partial or corrupt, or does not fit the config.

    The message names the file (and the table or parameter) at fault. Nothing was
    written to memcached when this is raised by a restore's verification.
    """


class NamespaceNotEmptyError(LookupTableError):
    """A restore found keys of the namespace (other than its sentinels) on the nodes.

    Restore with `--force` (the namespace's keys are deleted first) or into a new namespace.
    """


class DataLossError(LookupTableError):
    """A node's sentinel is gone, so its rows are gone: nothing is re-created there.

    Restore a checkpoint, or accept the loss with `lookup-table-admin reinit --yes`.
    """

    def __init__(self, message: str, *, nodes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.nodes = nodes


class StoreError(LookupTableError):
    """memcached answered something we cannot use, or did not answer."""

    def __init__(self, message: str, *, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class StoreFullError(StoreError):
    """A node started with `-M` is out of memory and refused a write."""


class CorruptValueError(StoreError):
    """A stored value has the wrong length for its table: corruption, never a cache miss."""


class StorageFormatError(StoreError):
    """Stored data in a format this version does not read: a node's sentinel records
    another storage format (`core.keyspace.STORAGE_FORMAT`), whose rows would read as
    corrupt or missing, or a replica's journal was written by a newer service."""


class ProtocolError(StoreError):
    """memcached's reply did not follow the protocol we spoke (bug or version mismatch)."""


class NodeUnavailableError(StoreError, OSError):
    """A node refused, reset or closed the connection (transient: retry later)."""


class StoreTimeoutError(NodeUnavailableError, TimeoutError):
    """A node did not answer within the configured timeout."""


class ExportTooLargeError(LookupTableError, MemoryError):
    """An export would need more memory than is available (or than the limit given).

    Raised before anything is written; `.needed_bytes` and `.limit_bytes` are the
    estimate and the limit the message names.
    """

    def __init__(self, message: str, *, needed_bytes: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes


class PushRejectedError(LookupTableError):
    """The optimizer service refused a push with a 4xx; `.status` and the message say why."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class ReplicaUnavailableError(LookupTableError, OSError):
    """An optimizer replica refused, cut or timed out a request through every retry.

    Transient on the service side (a replica restarting, overloaded or not
    started): the message names the replica and its URL.
    """


class WireError(LookupTableError, ValueError):
    """A message that does not follow the wire format; the message names the field."""
