"""memcached's options for the nodes of a local cluster: `-R`, `-t`, `-C`, `-o hashpower`,
the LRU's segments and the slab classes a cluster file's rows fit (`slab_sizes`)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lookup_table.core.keys import INT_ID_BYTES, key_prefix
from lookup_table.core.keyspace import Kind

if TYPE_CHECKING:
    from lookup_table.config import ClusterConfig

__all__ = [
    "CAS_BYTES",
    "ITEM_HEADER_BYTES",
    "LRU_OPTIONS",
    "NO_CAS",
    "REQUESTS_PER_EVENT",
    "SLAB_CHUNK_MAX",
    "SMALL_ITEM_BYTES",
    "default_slab_classes",
    "hashpower_for",
    "item_bytes",
    "local_threads",
    "memcached_options",
    "row_item_bytes",
    "slab_sizes",
]


# memcached serves at most `-R` requests of one connection before it turns to the others
# (default 20). Our clients pipeline thousands of requests per batch, so at 20 a node goes
# back to epoll after every 20 (system time: docs/operations.md), while 1000 requests
# still take well under a millisecond, so no connection waits long behind another.
REQUESTS_PER_EVENT = 1000

# memcached's hash table starts at 2^16 buckets and doubles whenever it holds 1.5 items a
# bucket: a background thread moves every item while lookups search both tables, and
# until then chains grow towards 1.5 items, which every miss walks to its end (most of a
# training step's reads are of ids with no row yet). Our nodes fill up with small items (a
# dim-16 row with its Adam slots is ~250 bytes), so each node's table is sized at start
# for a full node of such items: at most 1.5 a bucket then, as memcached would end up
# anyway, for 8 bytes a bucket (32 MiB beside `-m 1024`): no table grows under load
# (docs/operations.md).
SMALL_ITEM_BYTES = 256


# memcached's LRU maintainer thread moves items between the HOT, WARM and COLD segments of
# each slab class's LRU. By default HOT holds at most 20 % of a class's bytes, and items
# older than 0.2x the COLD tail's age leave it, so nearly every item a replica writes is
# moved once more by that thread, under the LRU's lock. Our nodes run with -M: nothing is
# evicted, so the segments choose no victim, and the thread's other jobs (slab page
# rebalancing, scheduling the crawler that reclaims expired TTL rows) are still needed.
# A HOT segment of up to 70 % (WARM 5 %: HOT + WARM may not pass 80 %) and ages of 100x
# the COLD tail's keep most written items where they are, so the thread moves fewer
# (docs/operations.md). 100x, not more: memcached keeps that age in 32 bits, and 100x a
# year's COLD age still fits.
LRU_OPTIONS = "hot_lru_pct=70,warm_lru_pct=5,hot_max_factor=100,warm_max_factor=100"


def local_threads(nodes: int) -> int:
    """memcached's `-t` (worker threads) for each of `nodes` nodes sharing this machine
    with the replicas and trainers: half of the usable cores split between the nodes, at
    least 1, at most 4.

    A node's worker threads share its hash table's and LRU's locks; where they outnumber
    the cores the node can have, they wait on each other instead of working
    (docs/operations.md). A dedicated memcached host takes `-t` about its cores
    (deploy/systemd/memcached.env, deploy/k8s).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // (2 * max(1, nodes))))


def memcached_options(memory_mb: int, *, slab_sizes: str | None = None) -> str:
    """memcached's `-o` for a node of `memory_mb` MiB: its hash table's size at start
    (`hashpower_for`), the LRU's segments (`LRU_OPTIONS`) and, given, its slab classes
    (`slab_sizes`)."""
    classes = f",slab_sizes={slab_sizes}" if slab_sizes else ""
    return f"hashpower={hashpower_for(memory_mb)},{LRU_OPTIONS}{classes}"


def hashpower_for(memory_mb: int) -> int:
    """memcached's `-o hashpower` for a node of `memory_mb` MiB of small items (16-32)."""
    buckets = memory_mb * 2**20 / SMALL_ITEM_BYTES / 1.5
    return min(32, max(16, math.ceil(math.log2(max(buckets, 1.0)))))


# ---------------------------------------------------------------- item bytes

# Nothing here reads or compares an item's CAS unique (no `gets`/`cas`, no meta `c`/`C`
# flags), so the nodes run with -C and each item is 8 bytes smaller.
NO_CAS = "-C"
CAS_BYTES = 8
ITEM_HEADER_BYTES = 48
"""memcached's item header on a 64-bit build (`sizeof(item)`, memcached.h): the LRU and
hash chain pointers, times, sizes, refcount, flags, slab class and key length."""
SLAB_CHUNK_MAX = 512 * 1024  # memcached's slab_chunk_max: larger items take several chunks
_SMALLEST_CHUNK = 96  # memcached's smallest class: the header and -n 48
_GROWTH = 1.25  # memcached's -f
_ALIGN = 8  # memcached rounds every class up to 8 bytes, and wants them more than 8 apart
_MAX_CLASSES = 62  # memcached's `-o slab_sizes` limit (it adds the slab_chunk_max class)


def item_bytes(key_bytes: int, value_bytes: int, *, cas: bool = False) -> int:
    """memcached's bytes for one item (`ITEM_ntotal`): the header, the CAS unique unless
    -C, the key and its terminating NUL, the value and its "\\r\\n". No client flags: the
    store sets none, and memcached then keeps none."""
    return ITEM_HEADER_BYTES + (CAS_BYTES if cas else 0) + key_bytes + 1 + value_bytes + 2


def default_slab_classes() -> list[int]:
    """memcached's chunk sizes with its default -n and -f (96, 120, 152, 192, ...: 25 %
    apart), without the last one (`SLAB_CHUNK_MAX`)."""
    sizes: list[int] = []
    size = _SMALLEST_CHUNK
    while size < SLAB_CHUNK_MAX / _GROWTH:
        size = _aligned(size)
        sizes.append(size)
        size = int(size * _GROWTH)
    return sizes


def slab_sizes(item_sizes: Iterable[int]) -> str:
    """`-o slab_sizes=` for nodes that hold items of `item_sizes` bytes: memcached's
    default classes, and a class of each of these sizes (rounded up to 8), so such an item
    takes a chunk of its own size instead of the next default class (up to 25 % more). A
    default class within 8 bytes of an added one gives way to it.

    Raises:
        ValueError: a size out of memcached's range, or more classes than it takes.
    """
    added = {_aligned(s) for s in item_sizes}
    for size in sorted(added):
        if not ITEM_HEADER_BYTES <= size < SLAB_CHUNK_MAX / _GROWTH:
            raise ValueError(
                f"an item of {size} bytes gets no class of its own: memcached takes slab "
                f"sizes from {ITEM_HEADER_BYTES} to {int(SLAB_CHUNK_MAX / _GROWTH)} bytes"
            )
    classes: list[int] = []
    for size in sorted(added | set(default_slab_classes())):
        if classes and size <= classes[-1] + _ALIGN:
            if size in added:  # the larger added class takes the other's items too
                classes[-1] = size
            continue
        classes.append(size)
    if len(classes) > _MAX_CLASSES:
        raise ValueError(
            f"{len(added)} item sizes make {len(classes)} slab classes, and memcached takes "
            f"at most {_MAX_CLASSES}: leave the nodes' default classes (no slab_sizes)"
        )
    return "-".join(map(str, classes))


def row_item_bytes(config: ClusterConfig) -> dict[str, int]:
    """memcached's bytes of a row item of each int64 table of `config` (a string id's key
    has its own length), on nodes run with -C."""
    # imported here: the optimizers import numba (seconds), and starting or stopping
    # nodes needs none of it
    from lookup_table.core.optimizers import make_optimizer
    from lookup_table.core.optimizers.layout import value_bytes
    from lookup_table.core.precision import check_dtype

    sizes: dict[str, int] = {}
    for spec in config.tables:
        if spec.id_type != "int64":
            continue
        key = len(key_prefix(config.namespace, spec.name, Kind.ROW)) + INT_ID_BYTES
        dtype = check_dtype(spec.dtype)
        value = value_bytes(make_optimizer(spec.optimizer), spec.dim, dtype)
        sizes[spec.name] = item_bytes(key, value)
    return sizes


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
