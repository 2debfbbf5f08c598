"""How much memory a SavedModel export needs, and refusing one that would not fit.

The peak an export reaches, and the memory this process may use (MemAvailable and the
cgroup's limit), compared before anything is read or written.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

from lookup_table.errors import ExportTooLargeError

__all__ = [
    "available_memory_bytes",
    "check_export_memory",
    "estimate_export_bytes",
    "hash_table_buckets",
]

logger = logging.getLogger(__name__)

_FIXED_BYTES = 64 << 20  # tracing, the graph, TF's own buffers
_MAX_LOAD_FACTOR = 0.8  # DenseHashTable's default


def estimate_export_bytes(
    *, count: int, dim: int, id_type: str, id_bytes: int = 0, itemsize: int = 4
) -> int:
    """Peak memory an export of one table needs, in bytes, never below what
    benchmarks/export_size.py measures.

    Args:
        count: rows exported.
        dim: the table's dim.
        id_type: "int64" or "string".
        id_bytes: total UTF-8 bytes of the string ids (0 for int64 ids).
        itemsize: bytes of an exported row value (2 for float16/bfloat16 tables).
    """
    buckets = hash_table_buckets(count)
    key = 8 if id_type == "int64" else 32  # a tf.string key is a 32-byte tstring
    rows = itemsize * dim * (count + 1)
    # Python str ids (object array, str objects) and their UTF-8 while inserted
    source_ids = 8 * count if id_type == "int64" else 70 * count + id_bytes
    # the float32 source rows and the variable; the hash table and the copy its save makes
    return 4 * dim * (count + 1) + rows + source_ids + 2 * buckets * (key + 8) + _FIXED_BYTES


def hash_table_buckets(count: int) -> int:
    """A DenseHashTable's buckets for `count` keys without a resize: a power of two."""
    need = max(8, math.ceil((count + 1) / _MAX_LOAD_FACTOR))
    return 1 << (need - 1).bit_length()


def available_memory_bytes() -> int | None:
    """Memory this process may still use: /proc/meminfo's MemAvailable, lowered to the
    cgroup v2 limit's headroom (memory.max - memory.current) when there is one; None
    when neither can be read (not Linux)."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    if not found:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - current))
    return min(found) if found else None


def check_export_memory(
    needed_bytes: int, *, limit_bytes: int | None = None, what: str = "the export"
) -> None:
    """Refuse an export that would not fit in memory.

    Args:
        needed_bytes: from `estimate_export_bytes`, summed over the tables.
        limit_bytes: the memory it may use; None: `available_memory_bytes()`.
        what: named in the message.

    Raises:
        ExportTooLargeError: naming both sizes and what to do.
    """
    source = "the limit given"
    if limit_bytes is None:
        limit_bytes = available_memory_bytes()
        source = "the memory available (MemAvailable, cgroup memory.max)"
        if limit_bytes is None:
            logger.warning("cannot tell the memory available: %s is not checked", what)
            return
    if needed_bytes > limit_bytes:
        raise ExportTooLargeError(
            f"{what} needs about {needed_bytes:,} bytes ({needed_bytes / 2**30:.2f} GiB) of "
            f"memory but {source} is {limit_bytes:,} bytes ({limit_bytes / 2**30:.2f} GiB); "
            f"nothing was written. Export fewer ids (ids=...), or on a machine with more "
            f"memory",
            needed_bytes=needed_bytes,
            limit_bytes=limit_bytes,
        )
