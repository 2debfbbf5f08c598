#!/usr/bin/env bash
# The whole test suite: installs memcached and the Python packages if missing, then
# runs pytest against real memcached processes. Extra arguments go to pytest
# (e.g. deploy/test.sh tests/unit -x). Slow soak variants run with LOOKUP_TABLE_SLOW=1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ensure_memcached
ensure_python test
cd "$REPO"
marker="not benchmark and not slow"
if [ "${LOOKUP_TABLE_SLOW:-0}" = "1" ]; then marker="not benchmark"; fi
exec "$PY" -m pytest -m "$marker" "$@"
