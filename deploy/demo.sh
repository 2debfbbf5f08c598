#!/usr/bin/env bash
# The main job on a fresh machine: installs what is missing, starts a local cluster
# (2 memcached nodes from deploy/demo.toml), runs the demo, prints what it did and
# the per-node metrics, and stops the cluster (also when something fails).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ensure_memcached
ensure_python train
cd "$REPO"
CONFIG="${LOOKUP_TABLE_CONFIG:-deploy/demo.toml}"
RUN_DIR="${LOOKUP_TABLE_RUN_DIR:-$REPO/run/demo}"

cleanup() { "$PY" -m lookup_table.localcluster down --config "$CONFIG" --run-dir "$RUN_DIR" || true; }
trap cleanup EXIT

echo "==> starting the local cluster ($CONFIG)"
"$PY" -m lookup_table.localcluster up --config "$CONFIG" --run-dir "$RUN_DIR" --memory-mb 512
echo "==> storage + optimizer service demo"
"$PY" deploy/demo_store.py --config "$CONFIG"
echo "==> cluster status"
"$PY" -m lookup_table.localcluster status --config "$CONFIG" --run-dir "$RUN_DIR"
echo "==> stopping the cluster"
