"""The distributed side: a fresh local cluster and one trainer process (this module's
`--role trainer`) running `trainer.Trainer.fit` with per-step timestamps."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import costs, pyspy
from benchmarks.harness.cluster import cluster_pids, local_cluster, run_role, service_log_errors
from benchmarks.harness.cpu import cpu_snapshot, cpu_usage
from benchmarks.harness.data import HIDDEN, MODEL, MODEL_SEED, demo_batches
from benchmarks.harness.variants import BASE_VARIANT
from benchmarks.train.compact import check_cluster, method_of
from benchmarks.train.local import assign_dense, load_weights
from benchmarks.train.steps import data_digest, timing

PY_SPY_RATE_HZ = 100


def run_distributed(
    args: argparse.Namespace,
    work_dir: Path,
    *,
    initial_weights: Path,
    columns: Sequence[str],
    py_spy_dir: Path | None = None,
    variant: str = BASE_VARIANT,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """One distributed round: a fresh cluster and one trainer process. The cluster's
    tables of `columns` are `variant`'s, `tables` their keys changed from the demo's
    (`compact.table_changes`), checked before the trainer starts."""
    from lookup_table.config import load_config

    service = {} if args.row_flush_pushes is None else {"row_flush_pushes": args.row_flush_pushes}
    with local_cluster(work_dir, mode=args.mode, service=service, tables=tables) as (
        config_path,
        run_dir,
        info,
    ):
        check_cluster(load_config(config_path), columns, variant, tables or {})
        output = work_dir / "trainer.json"
        cmd = [sys.executable, "-m", "benchmarks.train", "--role", "trainer"]
        cmd += ["--config", str(config_path), "--run-dir", str(run_dir), "--output", str(output)]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--batch-size", str(args.batch_size), "--eval-batches", str(args.eval_batches)]
        cmd += ["--initial-weights", str(initial_weights)]
        if args.pushes_in_flight is not None:
            cmd += ["--pushes-in-flight", str(args.pushes_in_flight)]
        if py_spy_dir is not None:
            cmd += ["--py-spy-dir", str(py_spy_dir)]
        result = run_role(
            cmd,
            output,
            work_dir / "trainer.log",
            timeout_s=120 + 10 * args.steps,
            what="the trainer process",
        )
        result["cluster"] = info
        result["method"], result["variant"] = method_of(variant), variant
        result["service_log_errors"] = service_log_errors(config_path, run_dir)
        return result


# ---------------------------------------------------------------- the trainer process


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
    source, train, evals = demo_batches(args.steps, args.batch_size, args.eval_batches)
    model = build_model(MODEL, source.schema, config, hidden=HIDDEN, seed=MODEL_SEED)
    # the local run's initial dense weights; the trainer offers them to /v1/dense/init and,
    # the namespace being fresh, they win
    assign_dense(model, load_weights(Path(args.initial_weights)))
    pids = {"trainer": os.getpid(), **cluster_pids(Path(args.config), Path(args.run_dir))}
    nodes = list(config.node_addresses)
    warmup = args.warmup
    ends: list[float] = []
    marks: dict[str, Any] = {}
    spies: dict[str, pyspy.Spy] = {}

    class TimedTrainer(Trainer):
        """Timestamps at the end of each step; the window closes when evaluation starts."""

        def train_step(self, features: Any, labels: Any) -> float:
            loss = super().train_step(features, labels)
            ends.append(time.perf_counter())
            if len(ends) == warmup:
                if args.py_spy_dir:
                    spy_dir = Path(args.py_spy_dir)
                    for who, pid in (("trainer", os.getpid()), ("service", pids["optimizer"])):
                        for idle, kind in ((True, ""), (False, ".cpu")):
                            spies[who + kind] = pyspy.record(
                                pid,
                                spy_dir / f"train-{who}{kind}.pyspy.txt",
                                rate_hz=PY_SPY_RATE_HZ,
                                flag="--profile",
                                idle=idle,
                            )
                    marks["tasks_start"] = costs.snapshot(pids)
                marks["cpu_start"] = cpu_snapshot(pids, nodes)
            return loss

        def evaluate(self, batches: Any) -> dict[str, float]:
            if "end" not in marks:
                asyncio.run(_write_behind_now(config))
                marks["end"] = time.perf_counter()
                marks["cpu_end"] = cpu_snapshot(pids, nodes)
                if args.py_spy_dir:
                    marks["tasks_end"] = costs.snapshot(pids)
                for spy in spies.values():
                    pyspy.stop(spy)
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
    if "tasks_start" in marks:
        out["thread_cpu_s"] = {"start": marks["tasks_start"], "end": marks["tasks_end"]}
    Path(args.output).write_text(json.dumps(out))
    return 0


def cost_table(result: dict[str, Any], py_spy_dir: Path) -> dict[str, dict[str, Any]]:
    """The profiled run's cost table (`benchmarks.harness.costs`): the trainer and the
    replica split by their CPU samples, memcached by kernel and user time."""
    steps = result["timed_steps"]
    start, end = result["thread_cpu_s"]["start"], result["thread_cpu_s"]["end"]
    out: dict[str, dict[str, Any]] = {}
    # TensorFlow's op threads run the model's kernels; the replica's have no Python
    for name, who, native in (("trainer", "trainer", "math"), ("optimizer", "service", "else")):
        samples = costs.samples_by_thread(py_spy_dir / f"train-{who}.cpu.pyspy.txt")
        out[name] = costs.python_process(
            samples, start[name], end[name], steps=steps, native_category=native
        )
    for name in sorted(n for n in start if n.startswith("memcached-")):
        out[name] = costs.memcached_process(start[name], end[name], steps=steps)
    return out
