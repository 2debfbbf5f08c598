#!/usr/bin/env bash
# The main job on a fresh machine: installs what is missing, starts a local cluster
# (2 memcached nodes + 1 optimizer replica from deploy/demo.toml), shows the storage
# layer and the optimizer service at work, trains one model with 2 trainer processes
# on the built-in Criteo-like data, prints their summaries and lines of /metrics,
# writes the loss/AUC plot, and stops the cluster (also when something fails).
#   DEMO_STEPS=300 deploy/demo.sh     # longer training (default 150 steps per trainer)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ensure_memcached
ensure_python train
cd "$REPO"
CONFIG="${LOOKUP_TABLE_CONFIG:-deploy/demo.toml}"
RUN_DIR="${LOOKUP_TABLE_RUN_DIR:-$REPO/run/demo}"
OUT="${DEMO_OUTPUT:-$REPO/demo-output}"
STEPS="${DEMO_STEPS:-150}"
mkdir -p "$OUT"

cleanup() { "$PY" -m lookup_table.ops.localcluster down --config "$CONFIG" --run-dir "$RUN_DIR" || true; }
trap cleanup EXIT

echo "==> starting the local cluster ($CONFIG)"
"$PY" -m lookup_table.ops.localcluster down --config "$CONFIG" --run-dir "$RUN_DIR" >/dev/null 2>&1 || true
"$PY" -m lookup_table.ops.localcluster up --config "$CONFIG" --run-dir "$RUN_DIR" --memory-mb 1024

echo "==> storage + optimizer service demo"
"$PY" deploy/demo_store.py --config "$CONFIG"

echo "==> training: 2 trainer processes, $STEPS steps each, on the built-in data"
export TF_CPP_MIN_LOG_LEVEL=3
train() {
  "$PY" -m trainer.cli --config "$CONFIG" --data synthetic:1000000 --batch-size 1024 \
    --steps "$STEPS" --eval-every 50 --eval-batches 10 \
    --worker-index "$1" --num-workers 2 --output "$OUT/summary-$1.json" "${@:2}"
}
train 1 --no-progress > "$OUT/trainer-1.log" 2>&1 &
worker1=$!
train 0 2> >(grep -v -e "cuda" -e "absl" -e "oneDNN" >&2) | tee "$OUT/trainer-0.log" >/dev/null
if ! wait "$worker1"; then
  echo "trainer 1 failed; its log:" >&2
  tail -30 "$OUT/trainer-1.log" >&2
  exit 1
fi

echo "==> summaries"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for p in sorted(out.glob("summary-*.json")):
    s = json.loads(p.read_text())
    rows = sum(s["rows_created"].values())
    print(f"worker {s['worker']}: {s['steps']} steps, {s['examples']:,} examples, "
          f"{s['examples_per_s']:,.0f} examples/s, train loss {s['train_loss']:.4f}, "
          f"eval AUC {s['eval_auc']:.4f}, eval logloss {s['eval_logloss']:.4f}, "
          f"rows created {rows:,}, model version {s['final_version']}")
PYEOF
"$PY" -m trainer.plot "$OUT"/summary-*.json --out "$OUT/loss.png"
echo "plot: $OUT/loss.png"

echo "==> a few lines of /metrics"
URL="$("$PY" -c "from lookup_table import load_config; print(load_config('$CONFIG').optimizers[0])")"
"$PY" - "$URL/metrics" <<'PYEOF'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
keep = ("lookup_table_pushes_total", "lookup_table_rows_updated_total{table=\"C1\"",
        "lookup_table_rejected_pushes_total", "lookup_table_push_latency_seconds_count",
        "lookup_table_push_latency_seconds_sum", "lookup_table_version",
        "lookup_table_node_items", "lookup_table_node_fill_ratio", "lookup_table_node_evictions",
        "lookup_table_info", "lookup_table_worker_examples_total",
        "lookup_table_worker_last_push_timestamp_seconds", "lookup_table_worker_loss",
        "lookup_table_unwritten_rows")
for line in text.splitlines():
    if line.startswith(keep):
        print("   ", line)
PYEOF

echo "==> cluster status"
"$PY" -m lookup_table.ops.localcluster status --config "$CONFIG" --run-dir "$RUN_DIR" || true
echo "==> stopping the cluster"
