"""The lines of an `lru_crawler metadump` reply that list one namespace's keys (pure numpy).

memcached URL-encodes every key byte but A-Za-z0-9 -._~ in a metadump line ("/"
is `%2F`), so the key of a line of namespace `ns` starts `key=ns%2F{table}%2F{kind}%2F`.
Checkpoints (`checkpoint.listing`) decode the ids of those lines and
`lookup-table-admin stats` (`stats`) sums their sizes; both find them here,
without a Python loop per line.
"""

from __future__ import annotations

from urllib.parse import quote, unquote_to_bytes

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keys import MAX_KIND_BYTES, MAX_NAME_BYTES

__all__ = [
    "LABEL_BYTES",
    "SEP",
    "key_body",
    "metadump_key",
    "metadump_prefix",
    "namespace_lines",
    "void_rows",
]

SEP = np.frombuffer(b"%2F", dtype=np.uint8)
""""/" as memcached's metadump writes it."""
LABEL_BYTES = MAX_NAME_BYTES + len(SEP) + MAX_KIND_BYTES + len(SEP)
"""The longest `{table}%2F{kind}%2F` after the namespace of a metadump key."""


def metadump_key(key: str | bytes) -> bytes:
    """`key=` and the key as a metadump line lists it (memcached URL-encodes keys)."""
    return b"key=" + quote(key, safe="").encode("ascii")


def metadump_prefix(namespace: str) -> bytes:
    """How every metadump line of a key of `namespace` starts."""
    return metadump_key(namespace + "/")


def key_body(body: bytes) -> bytes:
    """A metadump key body (memcached URL-encodes keys) as the key codec wrote it."""
    return unquote_to_bytes(body) if b"%" in body else body


def void_rows(matrix: NDArray[np.uint8]) -> NDArray[np.void]:
    """Rows of a uint8 matrix as one opaque value each (compared with memcmp)."""
    width = matrix.shape[1]
    return np.ascontiguousarray(matrix).view(np.dtype((np.void, width)))[:, 0]


def namespace_lines(
    data: bytes, namespace: str
) -> tuple[NDArray[np.uint8], NDArray[np.int64], NDArray[np.int64]]:
    """The lines of an `lru_crawler metadump` reply that list a key of `namespace`.

    Returns `(arr, starts, ends)`: the reply as uint8 (a view, no copy), and each
    such line's first byte and its terminating `\\n`, int64 (n,), in reply order.
    Found with numpy, without a Python loop per line.
    """
    prefix = metadump_prefix(namespace)
    arr = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(arr == ord("\n")).astype(np.int64, copy=False)
    starts = np.zeros_like(ends)
    starts[1:] = ends[:-1] + 1
    long_enough = ends - starts > len(prefix)
    starts, ends = starts[long_enough], ends[long_enough]
    if starts.shape[0] == 0:
        return arr, starts, ends
    windows = np.lib.stride_tricks.sliding_window_view(arr, len(prefix))
    mine = void_rows(windows[starts]) == np.void(prefix)
    return arr, starts[mine], ends[mine]
