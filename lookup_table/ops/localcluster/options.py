"""memcached's options for the nodes of a local cluster: `-R`, `-t`, `-o hashpower` and
the LRU's segments."""

from __future__ import annotations

import math
import os

__all__ = [
    "LRU_OPTIONS",
    "REQUESTS_PER_EVENT",
    "SMALL_ITEM_BYTES",
    "hashpower_for",
    "local_threads",
    "memcached_options",
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


def memcached_options(memory_mb: int) -> str:
    """memcached's `-o` for a node of `memory_mb` MiB: its hash table's size at start
    (`hashpower_for`) and the LRU's segments (`LRU_OPTIONS`)."""
    return f"hashpower={hashpower_for(memory_mb)},{LRU_OPTIONS}"


def hashpower_for(memory_mb: int) -> int:
    """memcached's `-o hashpower` for a node of `memory_mb` MiB of small items (16-32)."""
    buckets = memory_mb * 2**20 / SMALL_ITEM_BYTES / 1.5
    return min(32, max(16, math.ceil(math.log2(max(buckets, 1.0)))))
