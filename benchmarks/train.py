"""Benchmark end-to-end training: the `mlp` model on a local cluster against plain Keras.

Run from the repository root::

    python benchmarks/train.py                 # 150 steps of 1,024 examples, 2 rounds each
    python benchmarks/train.py --quick         # smoke run: 12 steps, 1 round each
    python benchmarks/train.py --profile       # plus one distributed run under py-spy

The same model (`trainer.models.build_model("mlp")`: 26 embeddings of dim 16, the
13 numeric columns, Dense 256-128-1 with ReLU and a sigmoid output) trains on the
same `SyntheticSource` batches (seed 0, batch 1024, eval fraction 0.2) two ways:

* `local`: plain Keras in this process. Each categorical column gets its own
  `keras.layers.Embedding(100_000, 16)` (26 tables of 100k rows: what fits a
  single machine's Keras baseline); a column's int64 ids enter as `id mod 100_000`
  (`keras.ops.mod` inside the model). The synthetic ids already are the output of a
  bijective 64-bit mix, so the residue is a fixed hash; ids that collide share a
  row. Two Keras `Adam` optimizers, as the cluster file has them: learning rate 0.01
  on the embedding tables, 0.001 on the dense weights (beta_1 0.9, beta_2 0.999,
  epsilon 1e-7 on both sides). Keras 3's Adam updates every row of every table each step (m, v and
  the row move even for ids not in the batch); the service's Adam touches only the
  rows of the push, with a per-row step. The train step is one `tf.function`
  (forward, backward, both `apply_gradients`); each step's numpy batch is turned
  into tensors and its loss read back (`float(loss)`), as `Trainer.train_step` does.
* `distributed`: a local cluster from a temporary cluster file (deploy/demo.toml's
  tables and optimizer settings, fresh free ports, a fresh namespace, `workers =
  1`): 2 memcached nodes and 1 optimizer replica started with `python -m
  lookup_table.ops.localcluster up` and always stopped with `... down`; then one
  trainer process (this script with `--role trainer`, so TF state is its own)
  runs `trainer.Trainer.fit` with the Trainer's defaults (async mode, graph
  steps, dense weights refreshed every step, `max_pushes_in_flight` as the
  Trainer sets it unless `--pushes-in-flight` is given; the report records the
  value used) on the same model built by `build_model("mlp", ...)`.

Timing: both sides time steps `warmup+1 .. steps` (the first `--warmup`, default
10, are not timed: tracing, first connections, first rows). A step ends when its
loss is back in Python; the distributed window also includes the final drain of
pushes in flight and the dense-weight read before evaluation, and then the writes the
replicas still hold behind (a pause writes every row and the dense parameters to
memcached; then they resume): the window pays for every write its pushes deferred,
whatever `--row-flush-pushes` is (without it, a longer flush interval left more of
them out of a 150-step window). examples/s =
timed steps x batch / window seconds. Every round of each method builds a new
model (and a new cluster and namespace); rounds run in ABBA order (local,
distributed, distributed, local, ...) so a drift of the machine's load hits both.
Figures are medians over rounds; the ratio is distributed / local examples/s.
The machine is shared: a round whose window saw other processes use more than
15% of the machine is marked disturbed and run again (`--retries`, default 2);
the summary uses the undisturbed rounds of a method if it has any (every attempt
stays in the report's `rounds`).

Quality: after the same steps, both evaluate AUC and log loss on the same
held-out batches (`split="eval"`, the first `--eval-batches`, default 20). The
AUC of the data's own noise-free logit on those batches is the ceiling.

CPU: /proc/<pid>/stat (utime + stime) of every process taking part is read at the
start and end of the timed window (the cluster's pids from its run dir), and
/proc/stat for the whole machine: CPU ms per step per process, and the share of
the machine other processes used (the machine has 2 cores, shared). Examples per
CPU-second (of every process taking part) is reported too: on a shared machine
it moves much less with other jobs' load than examples/s does, and with 2 cores
total CPU bounds throughput. Before each round the script waits (up to
`--quiet-wait-s`) for the machine to be quiet.

With `--profile`, one more distributed run (not in the table) has `py-spy
record --threads --idle --nonblocking` attached to the trainer and to the
optimizer service for the timed window; raw stacks go to
`<out-dir>/train-{trainer,service}.pyspy.txt` and the report gets, per thread,
ms per step by function (inclusive and leaf). `--idle` keeps blocked samples,
so a thread's figures are wall time, not CPU time; `waiting_ms_per_step` counts
the samples spent in an idle event loop or waiting on another thread.

The memcached nodes' `stats` counters (keys read and written, bytes in and out)
are read at the same two points as the CPU times: key operations per step, printed with
memcached's CPU per key operation (the same line as `push_replay.py`'s).

`--mode sync` (no prefetch, each step waits for its push: no staleness) and
`--pushes-in-flight N` change the distributed side only, to measure what
asynchrony costs in AUC; use `--out-dir` to keep such runs apart.

Results go to `<out-dir>/train.json` and `<out-dir>/train.png` (default
`benchmarks/results/`). The targets (issue 14): distributed >= 1.0 x local
examples/s and examples per CPU-second, the infrastructure's CPU (service and
memcached) <= 0.6 x the trainer's, and eval AUC within 0.01 of local after the
same steps (they are reported, not enforced). Any failure
exits non-zero; the cluster is always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import Batch, SyntheticSource
from trainer.metrics import auc, logloss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BATCH_SIZE,
    DATA_SEED,
    DEMO_CONFIG,
    DISTURBED_SHARE,
    EVAL_FRACTION,
    HIDDEN,
    MEMCACHED_MEMORY_MB,
    MODEL,
    MODEL_SEED,
    add_quiet_options,
    cluster_pids,
    code_fingerprint,
    cpu_snapshot,
    cpu_usage,
    local_cluster,
    machine_info,
    memcached_work,
    quiet_options,
    report_head,
    service_log_errors,
    wait_for_quiet,
    write_json,
)

from lookup_table.config import MAX_ROW_FLUSH_PUSHES
from lookup_table.ops.localcluster import stop_process

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"
PACKAGES = ("lookup_table", "optimizer_service", "trainer")  # whose source files `code` hashes

VOCABULARY = 100_000  # rows per local Keras table
EMBEDDING_LR = 0.01  # deploy/demo.toml: C1..C26 Adam 0.01
DENSE_LR = 0.001  # deploy/demo.toml: [optimizer] Adam 0.001
TARGET_RATIO = 1.0
TARGET_CPU_RATIO = 1.0  # examples per CPU-second, distributed / local
TARGET_INFRA_SHARE = 0.6  # (service + memcached CPU) / trainer CPU
TARGET_AUC_GAP = 0.01
PY_SPY_RATE_HZ = 100
METHODS = ("local", "distributed")
LABELS = {"local": "local Keras", "distributed": "distributed"}
CPU_COLORS = {"optimizer": "tab:green", "memcached-1": "tab:gray", "memcached-2": "silver"}


# ---------------------------------------------------------------- data


def make_data(steps: int, batch_size: int, eval_batches: int) -> tuple[Any, list[Any], list[Any]]:
    """The source, `steps` full train batches and `eval_batches` held-out batches.

    Both processes call this with the same arguments and get the same batches
    (SyntheticSource is a pure function of (seed, row)); `data_digest` checks it.
    """
    # 10% headroom so no batch is an epoch's short last one
    need_train = (steps + 1) * batch_size / (1 - EVAL_FRACTION)
    need_eval = (eval_batches + 1) * batch_size / EVAL_FRACTION
    source = SyntheticSource(int(math.ceil(max(need_train, need_eval) * 1.1)), seed=DATA_SEED)
    train = list(
        itertools.islice(
            source.batches(batch_size, split="train", eval_fraction=EVAL_FRACTION), steps
        )
    )
    evals = list(
        itertools.islice(
            source.batches(batch_size, split="eval", eval_fraction=EVAL_FRACTION), eval_batches
        )
    )
    short = [len(b.labels) for b in train + evals if len(b.labels) != batch_size]
    if len(train) != steps or len(evals) != eval_batches or short:
        raise RuntimeError(
            f"wanted {steps} train and {eval_batches} eval batches of {batch_size}, got "
            f"{len(train)} and {len(evals)} (short batches: {short})"
        )
    return source, train, evals


def data_digest(batches: Sequence[Batch]) -> str:
    """sha256 of every feature and label of `batches`: proves both sides saw the same data."""
    h = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch.features):
            h.update(name.encode())
            h.update(np.ascontiguousarray(batch.features[name]).tobytes())
        h.update(batch.labels.tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- step timing


def timing(
    ends: Sequence[float], window_end: float, warmup: int, batch_size: int
) -> dict[str, Any]:
    """examples/s over steps warmup+1..N: from the end of step `warmup` to `window_end`."""
    timed = len(ends) - warmup
    seconds = window_end - ends[warmup - 1]
    step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(ends[warmup - 1 :])]
    return {
        "timed_steps": timed,
        "seconds": seconds,
        "examples_per_s": timed * batch_size / seconds,
        "step_ms_median": statistics.median(step_ms),
        "step_ms_p90": float(np.percentile(step_ms, 90)),
        "warmup_ms": [(b - a) * 1e3 for a, b in itertools.pairwise(ends[:warmup])],
    }


# ---------------------------------------------------------------- (a) local Keras


def build_local_model(schema: Any, dims: Mapping[str, int]) -> Any:
    """`build_model("mlp")` with a `keras.layers.Embedding(VOCABULARY, dim)` per column."""
    import keras
    from keras import ops

    keras.utils.set_random_seed(MODEL_SEED)
    inputs: dict[str, Any] = {}
    embedded = []
    for column in schema.categorical:
        inputs[column] = keras.Input(shape=(), dtype="int64", name=column)
        bucket = ops.mod(inputs[column], VOCABULARY)  # ids are mixed already: a fixed hash
        layer = keras.layers.Embedding(VOCABULARY, dims[column], name=f"embedding_{column}")
        embedded.append(layer(bucket))
    numeric = []
    for column in schema.numeric:
        inputs[column] = keras.Input(shape=(), dtype="float32", name=column)
        numeric.append(ops.expand_dims(inputs[column], -1))
    x = ops.concatenate(embedded + [ops.concatenate(numeric, axis=-1)], axis=-1)
    for width in HIDDEN:
        x = keras.layers.Dense(width, activation="relu")(x)
    out = keras.layers.Activation("sigmoid")(keras.layers.Dense(1)(x))
    return keras.Model(inputs, out, name="mlp_local")


def dense_weights(model: Any) -> list[Any]:
    """The trainable weights that are not embedding tables, in creation order."""
    return [w for w in model.trainable_weights if "embedding" not in w.path]


def assign_dense(model: Any, values: Sequence[np.ndarray]) -> None:
    """Give `model` the initial dense weights `values` (shapes checked)."""
    weights = dense_weights(model)
    shapes = [tuple(w.shape) for w in weights]
    if shapes != [v.shape for v in values]:
        raise RuntimeError(
            f"the model's dense weights {shapes} differ from build_model('mlp')'s "
            f"{[v.shape for v in values]}"
        )
    for w, v in zip(weights, values, strict=True):
        w.assign(v)


def save_weights(path: Path, values: Sequence[np.ndarray]) -> None:
    np.savez(path, *values)


def load_weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def run_local(
    train: Sequence[Batch],
    evals: Sequence[Batch],
    schema: Any,
    dims: Mapping[str, int],
    *,
    warmup: int,
    initial_dense: Sequence[np.ndarray],
) -> dict[str, Any]:
    """Train the local Keras model on `train` in this process; time, CPU, eval."""
    import keras
    import tensorflow as tf

    model = build_local_model(schema, dims)
    assign_dense(model, initial_dense)
    dense_vars = dense_weights(model)
    emb_vars = [w for w in model.trainable_weights if "embedding" in w.path]
    emb_opt = keras.optimizers.Adam(learning_rate=EMBEDDING_LR)
    dense_opt = keras.optimizers.Adam(learning_rate=DENSE_LR)
    emb_opt.build(emb_vars)
    dense_opt.build(dense_vars)
    loss_fn = keras.losses.BinaryCrossentropy()
    names = [t.name for t in model.inputs]
    n_emb = len(emb_vars)

    @tf.function(reduce_retracing=True)
    def step(inputs: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            preds = model(inputs, training=True)
            loss = loss_fn(tf.reshape(labels, (-1, 1)), tf.reshape(preds, (-1, 1)))
        grads = tape.gradient(loss, emb_vars + dense_vars)
        emb_opt.apply_gradients(zip(grads[:n_emb], emb_vars, strict=True))
        dense_opt.apply_gradients(zip(grads[n_emb:], dense_vars, strict=True))
        return loss

    @tf.function(reduce_retracing=True)
    def predict(inputs: Any) -> Any:
        return model(inputs, training=False)

    def tensors(batch: Batch) -> dict[str, Any]:
        return {n: tf.constant(np.asarray(batch.features[n])) for n in names}

    pids = {"local": os.getpid()}
    ends: list[float] = []
    losses: list[float] = []
    cpu_start: dict[str, Any] | None = None
    for batch in train:
        loss = float(step(tensors(batch), tf.constant(batch.labels)))
        ends.append(time.perf_counter())
        losses.append(loss)
        if len(ends) == warmup:
            cpu_start = cpu_snapshot(pids)
    cpu_end = cpu_snapshot(pids)
    if cpu_start is None:
        raise RuntimeError(f"--warmup {warmup} needs more than {len(train)} steps")
    preds = np.concatenate([np.asarray(predict(tensors(b))).reshape(-1) for b in evals])
    labels = np.concatenate([b.labels for b in evals])
    return {
        "method": "local",
        "steps": len(train),
        **timing(ends, ends[-1], warmup, len(train[0].labels)),
        "losses": losses,
        "eval_auc": auc(labels, preds),
        "eval_logloss": logloss(labels, preds),
        "eval_examples": int(labels.shape[0]),
        "cpu": cpu_usage(cpu_start, cpu_end, len(train) - warmup),
    }


def run_distributed(
    args: argparse.Namespace,
    work_dir: Path,
    *,
    initial_weights: Path,
    py_spy_dir: Path | None = None,
) -> dict[str, Any]:
    """One distributed round: a fresh cluster and one trainer process."""
    service = {} if args.row_flush_pushes is None else {"row_flush_pushes": args.row_flush_pushes}
    with local_cluster(work_dir, mode=args.mode, service=service) as (config_path, run_dir, info):
        output = work_dir / "trainer.json"
        log_path = work_dir / "trainer.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "trainer"]
        cmd += ["--config", str(config_path), "--run-dir", str(run_dir), "--output", str(output)]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--batch-size", str(args.batch_size), "--eval-batches", str(args.eval_batches)]
        cmd += ["--initial-weights", str(initial_weights)]
        if args.pushes_in_flight is not None:
            cmd += ["--pushes-in-flight", str(args.pushes_in_flight)]
        if py_spy_dir is not None:
            cmd += ["--py-spy-dir", str(py_spy_dir)]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=env)
            try:
                proc.wait(timeout=120 + 10 * args.steps)
            finally:
                stop_process(proc)
        if proc.returncode != 0 or not output.exists():
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the trainer process failed ({proc.returncode}); its log:\n{tail}")
        result: dict[str, Any] = json.loads(output.read_text())
        result["cluster"] = info
        result["service_log_errors"] = service_log_errors(run_dir)
        return result


# ---------------------------------------------------------------- the trainer process


def _py_spy(pid: int, out_path: Path) -> subprocess.Popen[bytes]:
    cmd = ["py-spy", "record", "--pid", str(pid), "--rate", str(PY_SPY_RATE_HZ), "--format"]
    cmd += ["raw", "--threads", "--idle", "--nonblocking", "--output", str(out_path)]
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise RuntimeError("--profile needs py-spy on PATH: pip install py-spy") from None


def _stop_py_spy(spy: subprocess.Popen[bytes]) -> None:
    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    _, err = spy.communicate(timeout=120)
    if spy.returncode not in (0, -signal.SIGINT):
        raise RuntimeError(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')}")


async def _write_behind_now(config: Any) -> None:
    """What the replicas hold written behind (rows, dense parameters) goes to memcached:
    a pause writes it all, then they resume."""
    from lookup_table import OptimizerClient

    async with OptimizerClient(config) as client:
        unfinished = await client.pause(timeout_s=60.0)
        await client.resume()
    if any(unfinished.values()):
        raise RuntimeError(
            f"writing behind at the window's end left pushes unwritten: {unfinished}"
        )


def trainer_role(args: argparse.Namespace) -> int:
    """The distributed side, in its own process: Trainer.fit with per-step timestamps."""
    from lookup_table.config import load_config
    from trainer.loop import Trainer
    from trainer.models import build_model

    config = load_config(args.config)
    source, train, evals = make_data(args.steps, args.batch_size, args.eval_batches)
    model = build_model(MODEL, source.schema, config, hidden=HIDDEN, seed=MODEL_SEED)
    # the local run's initial dense weights; the trainer offers them to /v1/dense/init and,
    # the namespace being fresh, they win
    assign_dense(model, load_weights(Path(args.initial_weights)))
    pids = {"trainer": os.getpid(), **cluster_pids(Path(args.run_dir))}
    nodes = list(config.node_addresses)
    warmup = args.warmup
    ends: list[float] = []
    marks: dict[str, Any] = {}
    spies: dict[str, subprocess.Popen[bytes]] = {}

    class TimedTrainer(Trainer):
        """Timestamps at the end of each step; the window closes when evaluation starts."""

        def train_step(self, features: Any, labels: Any) -> float:
            loss = super().train_step(features, labels)
            ends.append(time.perf_counter())
            if len(ends) == warmup:
                if args.py_spy_dir:
                    spy_dir = Path(args.py_spy_dir)
                    spies["trainer"] = _py_spy(os.getpid(), spy_dir / "train-trainer.pyspy.txt")
                    spies["service"] = _py_spy(
                        pids["optimizer"], spy_dir / "train-service.pyspy.txt"
                    )
                marks["cpu_start"] = cpu_snapshot(pids, nodes)
            return loss

        def evaluate(self, batches: Any) -> dict[str, float]:
            if "end" not in marks:
                asyncio.run(_write_behind_now(config))
                marks["end"] = time.perf_counter()
                marks["cpu_end"] = cpu_snapshot(pids, nodes)
                for spy in spies.values():
                    _stop_py_spy(spy)
            return super().evaluate(batches)

    options = (
        {} if args.pushes_in_flight is None else {"max_pushes_in_flight": args.pushes_in_flight}
    )
    with TimedTrainer(config, model, progress=False, **options) as trainer:
        pushes_in_flight = trainer.max_pushes_in_flight
        result = trainer.fit(train, steps=len(train), eval_batches=evals)
        rows_created = trainer.rows_created
        version = trainer.version
    if "cpu_start" not in marks or "end" not in marks:
        raise RuntimeError(f"--warmup {warmup} needs more than {len(train)} steps")
    last = result.evals[-1]
    out = {
        "method": "distributed",
        "steps": result.steps,
        **timing(ends, marks["end"], warmup, args.batch_size),
        "losses": [loss for _, loss in result.losses],
        "eval_auc": last["auc"],
        "eval_logloss": last["logloss"],
        "eval_examples": int(last["examples"]),
        "cpu": cpu_usage(marks["cpu_start"], marks["cpu_end"], result.steps - warmup),
        "rows_created": sum(rows_created.values()),
        "final_version": version,
        "pushes_in_flight": pushes_in_flight,
        "fit_seconds_all_steps": result.seconds,
        "data_digest": data_digest(train + evals),
        "profiled": bool(args.py_spy_dir),
    }
    Path(args.output).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------- py-spy summaries

_FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>.*):\d+\)$")
# leaves where a thread waits: an idle event loop, or a future / lock of another thread
_WAITING_LEAVES = ("EpollSelector.select", "Condition.wait", "Event.wait", "Thread.join")


def _frame_name(frame: str) -> str:
    m = _FRAME_RE.match(frame)
    return f"{m['func']} ({m['file']})" if m else frame


def summarize_py_spy(path: Path, *, steps: int, top: int = 15) -> dict[str, Any]:
    """Per thread: ms per step (wall: `--idle` keeps blocked samples) in total, by
    function (inclusive, each function once per sample) and by leaf function."""
    per_ms = 1e3 / PY_SPY_RATE_HZ / steps
    threads: dict[str, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = frames[0]
        name = head.split(": ", 1)[1] if ": " in head else head
        n = int(count)
        t = threads.setdefault(
            name,
            {
                "samples": 0,
                "waiting": 0,
                "inclusive": collections.Counter(),
                "leaf": collections.Counter(),
            },
        )
        t["samples"] += n
        names = [_frame_name(f) for f in frames[1:]]
        for fn in set(names):
            t["inclusive"][fn] += n
        leaf = names[-1] if names else "(no python frame)"
        t["leaf"][leaf] += n
        if leaf.startswith(_WAITING_LEAVES):
            t["waiting"] += n
    out: dict[str, Any] = {"file": path.name, "rate_hz": PY_SPY_RATE_HZ, "steps": steps}
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
        out[name] = {
            "wall_ms_per_step": t["samples"] * per_ms,
            "waiting_ms_per_step": t["waiting"] * per_ms,
            "inclusive_ms_per_step": {
                k: round(v * per_ms, 2) for k, v in t["inclusive"].most_common(top)
            },
            "leaf_ms_per_step": {k: round(v * per_ms, 2) for k, v in t["leaf"].most_common(top)},
        }
    return out


# ---------------------------------------------------------------- reporting


def summarize(
    rounds: Sequence[Mapping[str, Any]], reference_auc: float, batch_size: int
) -> dict[str, Any]:
    by: dict[str, list[Mapping[str, Any]]] = {}
    out: dict[str, Any] = {}
    for m in METHODS:
        tried = [r for r in rounds if r["method"] == m]
        # undisturbed rounds only, unless every round of the method was disturbed
        rs = by[m] = [r for r in tried if not r["disturbed"]] or tried
        cpu_names = sorted({k for r in rs for k in r["cpu"]["cpu_ms_per_step"]})
        out[m] = {
            "rounds_used": [f"{r['round']}.{r['attempt']}" for r in rs],
            "rounds_run": len(tried),
            "all_used_rounds_disturbed": all(r["disturbed"] for r in rs),
            "examples_per_s": statistics.median(r["examples_per_s"] for r in rs),
            "examples_per_s_rounds": [r["examples_per_s"] for r in rs],
            "step_ms_median": statistics.median(r["step_ms_median"] for r in rs),
            "eval_auc": statistics.fmean(r["eval_auc"] for r in rs),
            "eval_auc_rounds": [r["eval_auc"] for r in rs],
            "eval_logloss": statistics.fmean(r["eval_logloss"] for r in rs),
            "final_train_loss_last10": statistics.fmean(
                statistics.fmean(r["losses"][-10:]) for r in rs
            ),
            "cpu_ms_per_step": {
                k: statistics.median(r["cpu"]["cpu_ms_per_step"][k] for r in rs) for k in cpu_names
            },
            "total_cpu_ms_per_step": statistics.median(
                r["cpu"]["total_cpu_ms_per_step"] for r in rs
            ),
            # load-robust: examples per CPU-second of every process taking part
            "examples_per_cpu_s": statistics.median(
                batch_size * 1e3 / r["cpu"]["total_cpu_ms_per_step"] for r in rs
            ),
            "other_processes_share": statistics.median(
                r["cpu"]["other_processes_share"] for r in rs
            ),
        }
        memcached = [c for r in rs if (c := r["cpu"].get("memcached_per_step"))]
        if memcached:
            out[m]["memcached_per_step"] = {
                k: statistics.median(c[k] for c in memcached) for k in memcached[0]
            }
    ratio = out["distributed"]["examples_per_s"] / out["local"]["examples_per_s"]
    # rounds are ABBA: pair the k-th local round used with the k-th distributed one
    paired = statistics.median(
        d["examples_per_s"] / lo["examples_per_s"]
        for lo, d in zip(by["local"], by["distributed"], strict=False)
    )
    gap = out["distributed"]["eval_auc"] - out["local"]["eval_auc"]
    out["ratio_distributed_vs_local"] = ratio
    out["ratio_median_of_paired_rounds"] = paired
    out["ratio_examples_per_cpu_s"] = (
        out["distributed"]["examples_per_cpu_s"] / out["local"]["examples_per_cpu_s"]
    )
    out["auc_gap_distributed_minus_local"] = gap
    out["reference_auc_hidden_model"] = reference_auc
    cpu = out["distributed"]["cpu_ms_per_step"]
    trainer_ms = cpu.get("trainer", 0.0)
    infra = sum(v for k, v in cpu.items() if k != "trainer")
    out["infrastructure_cpu_per_trainer_cpu"] = infra / trainer_ms if trainer_ms else math.nan
    out["acceptance"] = {
        f"distributed/local examples/s >= {TARGET_RATIO}": ratio >= TARGET_RATIO,
        f"|eval AUC gap| <= {TARGET_AUC_GAP}": abs(gap) <= TARGET_AUC_GAP,
        f"distributed/local examples per CPU-second >= {TARGET_CPU_RATIO}": (
            out["ratio_examples_per_cpu_s"] >= TARGET_CPU_RATIO
        ),
        f"infrastructure CPU / trainer CPU <= {TARGET_INFRA_SHARE}": (
            out["infrastructure_cpu_per_trainer_cpu"] <= TARGET_INFRA_SHARE
        ),
    }
    return out


def render_table(summary: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    lines = [
        f"{MODEL} {HIDDEN}, 26 tables dim 16, batch {params['batch_size']}, {params['steps']} "
        f"steps ({params['warmup']} warm-up steps not timed), {params['rounds']} round(s) each, "
        f"eval on {params['eval_batches']} held-out batches; distributed: {params['mode']} "
        f"mode, max_pushes_in_flight {params['pushes_in_flight']}",
        "rounds used (other processes under "
        f"{DISTURBED_SHARE * 100:.0f}% of the machine): "
        + ", ".join(
            f"{LABELS[m]} {len(summary[m]['rounds_used'])} of {summary[m]['rounds_run']}"
            + (" (all disturbed)" if summary[m]["all_used_rounds_disturbed"] else "")
            for m in METHODS
        ),
        "",
        f"{'method':<13} {'examples/s':>10} {'ms/step':>8} {'eval AUC':>9} {'logloss':>8} "
        f"{'CPU ms/step':>11} {'ex/CPU-s':>9} {'other CPU':>9}",
    ]
    for m in METHODS:
        s = summary[m]
        lines.append(
            f"{LABELS[m]:<13} {s['examples_per_s']:>10,.0f} {s['step_ms_median']:>8.1f} "
            f"{s['eval_auc']:>9.4f} {s['eval_logloss']:>8.4f} {s['total_cpu_ms_per_step']:>11.0f} "
            f"{s['examples_per_cpu_s']:>9,.0f} {s['other_processes_share']:>9.0%}"
        )
    ok = list(summary["acceptance"].values())
    lines += [
        "",
        f"distributed/local examples/s: {summary['ratio_distributed_vs_local']:.2f} "
        f"(paired rounds {summary['ratio_median_of_paired_rounds']:.2f})  "
        f"target >= {TARGET_RATIO}: {'met' if ok[0] else 'NOT MET'}",
        f"distributed/local examples per CPU-second (all processes; robust to other load): "
        f"{summary['ratio_examples_per_cpu_s']:.2f}  target >= {TARGET_CPU_RATIO}: "
        f"{'met' if ok[2] else 'NOT MET'}",
        f"eval AUC distributed - local: {summary['auc_gap_distributed_minus_local']:+.4f}  "
        f"target |gap| <= {TARGET_AUC_GAP}: {'met' if ok[1] else 'NOT MET'}",
        f"AUC of the data's noise-free logit on the same batches (ceiling): "
        f"{summary['reference_auc_hidden_model']:.4f}",
        "",
        "distributed CPU ms/step: "
        + ", ".join(f"{k} {v:.1f}" for k, v in summary["distributed"]["cpu_ms_per_step"].items())
        + f" (total {summary['distributed']['total_cpu_ms_per_step']:.1f} over "
        f"{summary['distributed']['step_ms_median']:.0f} ms wall, {os.cpu_count()} cores)",
        *memcached_lines(summary["distributed"]),
        f"infrastructure (service + memcached) CPU / trainer CPU: "
        f"{summary['infrastructure_cpu_per_trainer_cpu']:.2f}  target <= {TARGET_INFRA_SHARE}: "
        f"{'met' if ok[3] else 'NOT MET'}",
    ]
    return "\n".join(lines)


def memcached_lines(side: Mapping[str, Any]) -> list[str]:
    """The memcached line of a method's summary (`memcached_work`), if it has counters."""
    per_step = side.get("memcached_per_step")
    if not per_step:
        return []
    cpu = sum(v for k, v in side["cpu_ms_per_step"].items() if k.startswith("memcached-"))
    return [memcached_work(per_step, cpu)]


def _smooth(values: Sequence[float], window: int) -> Any:
    arr = np.asarray(values, dtype=np.float64)
    if window <= 1 or arr.shape[0] < window:
        return arr
    head = np.cumsum(arr[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(arr, np.ones(window) / window, mode="valid")])


def plot(
    rounds: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any],
    path: Path,
    params: Mapping[str, Any],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"local": "tab:blue", "distributed": "tab:orange"}
    fig, (ax_loss, ax_rate, ax_cpu) = plt.subplots(
        1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [2.2, 1, 1.2]}
    )
    seen: set[str] = set()
    window = max(1, min(10, len(rounds[0]["losses"]) // 5))
    for r in rounds:
        m = r["method"]
        steps = np.arange(1, len(r["losses"]) + 1)
        ax_loss.plot(steps, r["losses"], color=colors[m], alpha=0.15, lw=0.8)
        ax_loss.plot(
            steps,
            _smooth(r["losses"], window),
            color=colors[m],
            lw=1.6,
            label=None if m in seen else f"{LABELS[m]} (AUC {summary[m]['eval_auc']:.4f})",
        )
        seen.add(m)
    ax_loss.axvline(params["warmup"], color="grey", ls=":", lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"training loss (faint: per step; bold: mean of {window})")
    ax_loss.set_title(f"loss, batch {params['batch_size']}, same batches")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    x = np.arange(len(METHODS))
    bars = ax_rate.bar(
        x, [summary[m]["examples_per_s"] for m in METHODS], color=[colors[m] for m in METHODS]
    )
    ax_rate.bar_label(bars, fmt="%.0f")
    for i, m in enumerate(METHODS):
        pts = summary[m]["examples_per_s_rounds"]
        ax_rate.plot([i] * len(pts), pts, "k.", ms=5)
    ax_rate.set_xticks(x, [LABELS[m] for m in METHODS])
    ax_rate.set_ylabel("examples/s (median of rounds; dots: rounds)")
    ax_rate.set_title(f"distributed / local = {summary['ratio_distributed_vs_local']:.2f}")
    ax_rate.grid(alpha=0.3, axis="y")

    for i, m in enumerate(METHODS):
        bottom = 0.0
        for k, v in summary[m]["cpu_ms_per_step"].items():
            color = colors[m] if k in ("local", "trainer") else CPU_COLORS.get(k, "tab:gray")
            ax_cpu.bar(i, v, bottom=bottom, color=color, edgecolor="white")
            ax_cpu.text(i, bottom + v / 2, f"{k}\n{v:.0f}", ha="center", va="center", fontsize=7)
            bottom += v
        wall = summary[m]["step_ms_median"]
        ax_cpu.plot([i - 0.4, i + 0.4], [wall * (os.cpu_count() or 1)] * 2, "k--", lw=1)
    ax_cpu.set_xticks(x, [LABELS[m] for m in METHODS])
    ax_cpu.set_ylabel("CPU ms per step (dashed: wall ms/step x cores)")
    ax_cpu.set_title("where the CPU goes")
    ax_cpu.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="train steps (default 150)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per method (default 2)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--eval-batches", type=int, default=None, help="default 20")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 12 steps (2 warm-up), 1 round, 2 eval batches",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more distributed run under py-spy (trainer and service); not in the table",
    )
    add_quiet_options(parser, unit="round", wait_s=180.0)
    parser.add_argument(
        "--mode",
        choices=["async", "sync"],
        default="async",
        help="the cluster's mode (default async, as deploy/demo.toml; sync: no prefetch, "
        "each step waits for its push: no staleness)",
    )
    parser.add_argument(
        "--row-flush-pushes",
        type=int,
        default=None,
        help="the cluster's service.row_flush_pushes (default: deploy/demo.toml's; > 1: rows "
        "written behind and read through their owner)",
    )
    parser.add_argument(
        "--pushes-in-flight",
        type=int,
        default=None,
        help="Trainer max_pushes_in_flight (default: the Trainer's own default)",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    # the trainer process (internal)
    parser.add_argument(
        "--role", choices=["main", "trainer"], default="main", help=argparse.SUPPRESS
    )
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--py-spy-dir", help=argparse.SUPPRESS)
    parser.add_argument("--initial-weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 150)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.eval_batches = args.eval_batches or (2 if args.quick else 20)
    quiet_options(args, wait_s=180.0)
    if not 1 <= args.warmup < args.steps - 1:
        parser.error(f"--warmup must be in 1..steps-2, got {args.warmup} for {args.steps} steps")
    if args.row_flush_pushes is not None and not 1 <= args.row_flush_pushes <= MAX_ROW_FLUSH_PUSHES:
        parser.error(f"--row-flush-pushes must be in 1..{MAX_ROW_FLUSH_PUSHES}")
    if args.rounds < 1 or args.batch_size < 1 or args.eval_batches < 1:
        parser.error("--rounds, --batch-size and --eval-batches must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.role == "trainer":
        return trainer_role(args)
    # a SIGTERM (e.g. a test's timeout) unwinds through the finally that stops the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    import keras
    import tensorflow as tf

    machine = machine_info({"tensorflow": tf.__version__, "keras": keras.__version__})
    code = code_fingerprint(PACKAGES)

    from lookup_table.config import load_config
    from trainer.models import build_model

    source, train, evals = make_data(args.steps, args.batch_size, args.eval_batches)
    digest = data_digest(train + evals)
    demo = load_config(DEMO_CONFIG)
    dims = {c: demo.table(c).dim for c in source.schema.categorical}
    # both sides start from these dense weights (build_model's, seeded)
    initial_dense = [
        np.asarray(w.numpy())
        for w in dense_weights(
            build_model(MODEL, source.schema, demo, hidden=HIDDEN, seed=MODEL_SEED)
        )
    ]
    eval_labels = np.concatenate([b.labels for b in evals])
    reference_auc = auc(eval_labels, np.concatenate([source.logits(b) for b in evals]))

    order = [METHODS[(k + (k // 2)) % 2] for k in range(2 * args.rounds)]  # L D D L L D ...
    rounds: list[dict[str, Any]] = []
    profile: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        weights_path = Path(tmp) / "initial_dense.npz"
        save_weights(weights_path, initial_dense)
        for k, method in enumerate(order):
            for attempt in range(args.retries + 1):
                again = f" (again: the last try was disturbed, {attempt}/{args.retries})"
                print(
                    f"round {k + 1}/{len(order)}: {LABELS[method]}{again if attempt else ''} ...",
                    flush=True,
                )
                quiet = wait_for_quiet(args.quiet_wait_s)
                if method == "local":
                    r = run_local(
                        train,
                        evals,
                        source.schema,
                        dims,
                        warmup=args.warmup,
                        initial_dense=initial_dense,
                    )
                else:
                    r = run_distributed(
                        args, Path(tmp) / f"cluster{k}-{attempt}", initial_weights=weights_path
                    )
                    if r["data_digest"] != digest:
                        raise RuntimeError(
                            "the trainer process saw other batches than the local run"
                        )
                r["round"], r["attempt"], r["machine_before"] = k, attempt, quiet
                r["disturbed"] = r["cpu"]["other_processes_share"] > DISTURBED_SHARE
                rounds.append(r)
                print(
                    f"  {r['examples_per_s']:,.0f} examples/s, {r['step_ms_median']:.1f} ms/step, "
                    f"eval AUC {r['eval_auc']:.4f}, other processes "
                    f"{r['cpu']['other_processes_share']:.0%} of the machine, CPU ms/step "
                    + ", ".join(f"{n} {v:.0f}" for n, v in r["cpu"]["cpu_ms_per_step"].items()),
                    flush=True,
                )
                if not r["disturbed"]:
                    break
        if args.profile:
            print("profiling one more distributed run with py-spy ...", flush=True)
            args.out_dir.mkdir(parents=True, exist_ok=True)
            r = run_distributed(
                args, Path(tmp) / "profiled", initial_weights=weights_path, py_spy_dir=args.out_dir
            )
            timed = args.steps - args.warmup
            profile = {
                "run": {k: v for k, v in r.items() if k != "losses"},
                "trainer": summarize_py_spy(args.out_dir / "train-trainer.pyspy.txt", steps=timed),
                "service": summarize_py_spy(args.out_dir / "train-service.pyspy.txt", steps=timed),
            }

    summary = summarize(rounds, reference_auc, args.batch_size)
    params = {
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "eval_batches": args.eval_batches,
        "quick": args.quick,
        "mode": args.mode,
        "row_flush_pushes": args.row_flush_pushes,  # None: deploy/demo.toml's
        # as the trainer process ran (the Trainer's default unless --pushes-in-flight)
        "pushes_in_flight": next(
            (r["pushes_in_flight"] for r in rounds if r["method"] == "distributed"),
            args.pushes_in_flight,
        ),
        "retries": args.retries,
        "disturbed_share": DISTURBED_SHARE,
    }
    table = render_table(summary, params)
    print()
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        **report_head("train", started, machine, code),
        "parameters": {
            **params,
            "model": MODEL,
            "hidden": list(HIDDEN),
            "order": order,
            "data": {
                "source": "SyntheticSource",
                "seed": DATA_SEED,
                "eval_fraction": EVAL_FRACTION,
                "digest": digest,
            },
            "local": {
                "embedding": f"keras.layers.Embedding({VOCABULARY}, 16) per column, "
                f"input id mod {VOCABULARY}",
                "optimizers": f"Adam lr {EMBEDDING_LR} on the 26 tables, Adam lr {DENSE_LR} on "
                "the dense weights (Keras 3 Adam: dense update of every row every step)",
                "train_step": "one tf.function: forward, backward, both apply_gradients",
            },
            "distributed": {
                "cluster": "deploy/demo.toml's tables and optimizers, fresh ports and namespace, "
                "workers = 1; 2 memcached nodes + 1 optimizer replica "
                "(python -m lookup_table.ops.localcluster up)",
                "memcached_memory_mb": MEMCACHED_MEMORY_MB,
                "trainer": f"trainer.Trainer ({args.mode} mode, graph steps, dense refresh every "
                "step, max_pushes_in_flight "
                + (
                    "as the Trainer defaults it"
                    if args.pushes_in_flight is None
                    else str(args.pushes_in_flight)
                )
                + ") in its own process",
            },
            "timing": "steps warmup+1..steps; a step ends when its loss is back in Python; the "
            "distributed window also covers the final push drain and dense read, and the "
            "replicas' writes behind (a pause, then resume)",
        },
        "acceptance_targets": {
            "distributed/local examples/s": TARGET_RATIO,
            "distributed/local examples per CPU-second": TARGET_CPU_RATIO,
            "infrastructure CPU / trainer CPU": TARGET_INFRA_SHARE,
            "abs eval AUC gap": TARGET_AUC_GAP,
        },
        "summary": summary,
        "rounds": rounds,
    }
    if profile is not None:
        report["profile"] = profile
    changed = code_fingerprint(PACKAGES)["sha256_16"] != code["sha256_16"]
    if changed:
        report["code"]["changed_on_disk_during_run"] = True
        print("warning: the code changed on disk during the run", file=sys.stderr)
    disturbed = [m for m in METHODS if summary[m]["all_used_rounds_disturbed"]]
    if disturbed:
        print(
            f"warning: every round of {', '.join(disturbed)} ran while other processes used more "
            f"than {DISTURBED_SHARE:.0%} of the machine; its figures are disturbed",
            file=sys.stderr,
        )
    json_path = args.out_dir / "train.json"
    write_json(json_path, report)
    png_path = args.out_dir / "train.png"
    used = [
        r for r in rounds if f"{r['round']}.{r['attempt']}" in summary[r["method"]]["rounds_used"]
    ]
    plot(used, summary, png_path, params)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
