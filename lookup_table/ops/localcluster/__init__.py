"""Local memcached servers and optimizer replicas, for tests, benchmarks and
`deploy/cluster.sh`.

`options` holds memcached's options for our nodes, `servers` one server we start and
stop, `pids` what /proc tells of a process, `files` the pid, log and owner files of a
run dir, `replicas` the optimizer replicas of a cluster file, `cli` the `up`, `down` and
`status` commands (`python -m lookup_table.ops.localcluster`).
"""

from __future__ import annotations

from lookup_table.ops.localcluster.options import (
    LRU_OPTIONS,
    REQUESTS_PER_EVENT,
    SMALL_ITEM_BYTES,
    hashpower_for,
    local_threads,
    memcached_options,
)
from lookup_table.ops.localcluster.servers import (
    MemcachedProcess,
    free_port,
    memcached_binary,
    memcached_cluster,
    start_memcached,
    stop_process,
    wait_for_port,
)

__all__ = [
    "LRU_OPTIONS",
    "REQUESTS_PER_EVENT",
    "SMALL_ITEM_BYTES",
    "MemcachedProcess",
    "free_port",
    "hashpower_for",
    "local_threads",
    "memcached_binary",
    "memcached_cluster",
    "memcached_options",
    "start_memcached",
    "stop_process",
    "wait_for_port",
]
