"""Every key the system writes: the kinds, the bookkeeping tables and their ids (pure).

The one place that names the kinds and builds or parses the ids of bookkeeping keys;
the store, the service, checkpoints and `admin stats` all use it. The table of keys and
`STORAGE_FORMAT` (a row and its slots in one item) are in docs/wire-format.md.
"""

from __future__ import annotations

import enum
import json
import re

from lookup_table.core.keys import encode_key

__all__ = [
    "BOOKKEEPING_TABLES",
    "DENSE_CURRENT_ID",
    "DENSE_TABLE",
    "META_TABLE",
    "ROW_KINDS",
    "SENTINEL_ID",
    "STORAGE_FORMAT",
    "Kind",
    "dense_chunk_id",
    "dense_log_id",
    "is_journal_header",
    "journal_id",
    "layout_id",
    "layout_key",
    "layout_table",
    "push_record_id",
    "sentinel_format",
    "sentinel_key",
    "version_id",
    "version_replica",
]


class Kind(enum.StrEnum):
    """The kind tag of a key: what its value holds."""

    ROW = "w"  # the row and its slots (format 1 kept slots apart, under "s")
    COUNTER = "c"
    META = "m"
    PUSH_RECORD = "p"
    JOURNAL = "j"
    DENSE = "d"
    DENSE_SLOTS = "ds"
    DENSE_LOG = "dl"

    @property
    def label(self) -> str:
        """A readable plural for reports (`admin stats`): "rows", "push_records", ..."""
        return _LABELS[self]


_LABELS = {
    Kind.ROW: "rows",
    Kind.COUNTER: "counters",
    Kind.META: "meta",
    Kind.PUSH_RECORD: "push_records",
    Kind.JOURNAL: "journal",
    Kind.DENSE: "dense",
    Kind.DENSE_SLOTS: "dense_slots",
    Kind.DENSE_LOG: "dense_log",
}

ROW_KINDS = (Kind.ROW,)
"""The kinds keyed by feature ids that a checkpoint saves per table (not `c`: counters
are sightings of ids without a row, transient by design; a restore starts them over)."""

META_TABLE = "_meta"
"""Bookkeeping of the cluster and the replicas: sentinel, table layouts, versions, push
records, journals."""
DENSE_TABLE = "_dense"
"""The dense parameters (the model on top of the embeddings) and their slots."""
BOOKKEEPING_TABLES = (META_TABLE, DENSE_TABLE)

SENTINEL_ID = "sentinel"
STORAGE_FORMAT = 3
"""The layout of the stored data this version reads and writes, recorded in every sentinel
(1, the sentinels before the field existed: rows and slots as separate items; 2: int ids
in keys as 16 hex digits)."""
DENSE_CURRENT_ID = "current"

_LAYOUT_PREFIX = "layout:"
_VERSION_RE = re.compile(r"version-r(\d+)\Z")
_JOURNAL_HEADER_RE = re.compile(r"r\d+-j\d+\Z")


def version_id(replica: int) -> str:
    """`_meta/m` id of replica `replica`'s model version."""
    return f"version-r{replica}"


def version_replica(meta_id: str) -> int | None:
    """The replica whose version `meta_id` holds, or None if it is not a version id."""
    match = _VERSION_RE.match(meta_id)
    return int(match.group(1)) if match else None


def layout_id(table: str) -> str:
    """`_meta/m` id of a node's record of table `table`'s stored layout (a table that the
    node's sentinel does not record: `store.layouts`)."""
    return f"{_LAYOUT_PREFIX}{table}"


def layout_table(meta_id: str) -> str | None:
    """The table whose layout `meta_id` records, or None if it is not a layout id."""
    return meta_id[len(_LAYOUT_PREFIX) :] if meta_id.startswith(_LAYOUT_PREFIX) else None


def layout_key(namespace: str, table: str) -> bytes:
    """The key of `layout_id(table)`: the same on every node of `namespace`."""
    return encode_key(namespace, META_TABLE, Kind.META, layout_id(table))


def push_record_id(replica: int, push_id: str) -> str:
    """`_meta/p` id of the done record of `push_id` applied by `replica`."""
    return f"r{replica}:{push_id}"


def journal_id(replica: int, slot: int, chunk: int | None = None) -> str:
    """`_meta/j` id of a journal header (`chunk` None) or of one of its chunks."""
    base = f"r{replica}-j{slot}"
    return base if chunk is None else f"{base}-c{chunk}"


def is_journal_header(journal: str) -> bool:
    """Whether a `_meta/j` id is a journal header (not one of its chunks)."""
    return _JOURNAL_HEADER_RE.match(journal) is not None


def dense_chunk_id(generation: str, param: str, chunk: int) -> str:
    """`_dense/d` (or `ds`) id of chunk `chunk` of `param` in `generation`."""
    return f"{generation}/{param}/{chunk}"


def dense_log_id(version: int, chunk: int | None = None) -> str:
    """`_dense/dl` id of the log of the dense update to `version` (its index, `chunk`
    None) or of one of its chunks."""
    base = f"v{version}"
    return base if chunk is None else f"{base}-c{chunk}"


def sentinel_key(namespace: str) -> bytes:
    """The key of the sentinel every node of `namespace` holds (`_meta/m/ssentinel`)."""
    return encode_key(namespace, META_TABLE, Kind.META, SENTINEL_ID)


def sentinel_format(value: bytes) -> int:
    """The storage format a sentinel's JSON value records (1 when it has no `format`).

    Raises:
        ValueError: the value is not a sentinel's JSON object.
    """
    try:
        decoded = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"a sentinel is a JSON object, got {value[:60]!r}") from exc
    if not isinstance(decoded, dict):
        raise ValueError(f"a sentinel is a JSON object, got {value[:60]!r}")
    found = decoded.get("format", 1)
    if not isinstance(found, int) or isinstance(found, bool):
        raise ValueError(f"a sentinel's format is an integer, got {found!r}")
    return found
