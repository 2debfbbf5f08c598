#!/usr/bin/env bash
# deploy/cluster.sh up|down|status --config C [--run-dir D] [--memory-mb M]
# Starts/stops/inspects the local memcached nodes and optimizer replicas of a cluster
# file. The run dir (default ./run) keeps a pid file, log and owner (cluster file,
# namespace) per process, named by its address, so cluster files can share it; `up`
# waits until every node answers, writes the data-loss sentinels (lookup-table-admin
# init) and waits until every replica is healthy; `down` stops only this file's processes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if [ "${1:-}" = "up" ]; then ensure_memcached; fi
ensure_python "${LOOKUP_TABLE_EXTRAS:-train}"
exec "$PY" -m lookup_table.ops.localcluster "$@"
