#!/usr/bin/env bash
# deploy/cluster.sh up|down|status --config C [--run-dir D] [--memory-mb M]
# Starts/stops/inspects the local memcached nodes of a cluster file (pid files and
# logs in the run dir, default ./run); `up` waits until every node answers and
# writes the data-loss sentinels (lookup-table-admin init).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
if [ "${1:-}" = "up" ]; then ensure_memcached; fi
ensure_python "${LOOKUP_TABLE_EXTRAS:-train}"
exec "$PY" -m lookup_table.ops.localcluster "$@"
