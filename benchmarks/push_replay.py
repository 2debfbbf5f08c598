"""Benchmark the infrastructure's CPU per push without TensorFlow: the replica and memcached.

The demo's pushes replayed in seconds, as 26 tables and as one; docs/benchmarks.md says
how it measures and how to read it::

    python -m benchmarks.push_replay            # 150 pushes (20 warm-up), 2 rounds
    python -m benchmarks.push_replay --quick    # smoke run: 20 pushes, 1 round
    python -m benchmarks.push_replay --row-flush-pushes 1    # rows written through
    python -m benchmarks.push_replay --replicas 2   # the rows split between two replicas
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from benchmarks.harness.cluster import cluster_pids, local_cluster
from benchmarks.harness.cpu import cpu_snapshot, cpu_usage, memcached_work
from benchmarks.harness.data import first_batches
from benchmarks.harness.options import Options
from benchmarks.harness.report import machine_info, report_head, save
from lookup_table.client import OptimizerClient, PushReads, RowReader
from lookup_table.config import ServiceConfig, load_config
from lookup_table.store import EmbeddingStore
from trainer.data.criteo import CATEGORICAL_NAMES

MAX_REPLICAS = 8  # each a process on this machine
BATCH = 1024
DENSE_SHAPES = {  # the demo's `mlp` (13 numeric + 26 x 16 inputs, Dense 256-128-1)
    "dense/kernel": (429, 256),
    "dense/bias": (256,),
    "dense_1/kernel": (256, 128),
    "dense_1/bias": (128,),
    "dense_2/kernel": (128, 1),
    "dense_2/bias": (1,),
}
CASES = ("tables", "one table")
_RANGE_BITS = 40  # "one table": column k's ids move to [k << 40, (k + 1) << 40)

Batch = dict[str, NDArray[np.int64]]


def make_batches(count: int) -> list[Batch]:
    return [
        {n: np.unique(np.asarray(batch.features[n]).astype(np.int64)) for n in CATEGORICAL_NAMES}
        for batch in first_batches(count, BATCH)
    ]


def as_one_table(batch: Batch) -> Batch:
    merged = [ids + (k << _RANGE_BITS) for k, ids in enumerate(batch.values())]
    return {CATEGORICAL_NAMES[0]: np.unique(np.concatenate(merged))}


async def replay(
    config_path: Path, run_dir: Path, batches: list[Batch], warmup: int
) -> dict[str, float]:
    """Push `batches` in order; CPU ms per push of the cluster's processes and of this
    one (`client`) over the pushes after `warmup`, and the share of the machine that
    other processes used meanwhile."""
    config = load_config(config_path)
    rng = np.random.default_rng(0)
    pids = {**cluster_pids(config_path, run_dir), "client": os.getpid()}
    nodes = list(config.node_addresses)
    start: dict[str, Any] = {}
    async with OptimizerClient(config) as client, EmbeddingStore(config) as store:
        reader = RowReader(store, client)
        params = {
            n: rng.standard_normal(s).astype(np.float32) * 0.05 for n, s in DENSE_SHAPES.items()
        }
        await client.dense_init(params)
        # the first batch's rows, read alone (a trainer's first step)
        reading: asyncio.Future[Any] | None = asyncio.ensure_future(reader.lookup_many(batches[0]))
        for i, batch in enumerate(batches):
            if i == warmup:
                start = cpu_snapshot(pids, nodes)
            if reading is not None:
                await reading
            # a trainer's reads of the next batch, the ids this push does not answer
            # with: rows written behind go with the push (`PushReads`), the rest are read
            # from memcached meanwhile
            upcoming = batches[i + 1] if i + 1 < len(batches) else {}
            reads = {
                name: left
                for name, ids in upcoming.items()
                if (left := np.setdiff1d(ids, batch.get(name, ids[:0]), assume_unique=True)).size
            }
            along = PushReads()
            reading = (
                asyncio.ensure_future(reader.lookup_many(reads, along=along)) if reads else None
            )
            await asyncio.sleep(0)  # its first step hands the push its reads
            tables = {
                name: (ids, (rng.standard_normal((ids.shape[0], 16)) * 1e-3).astype(np.float32))
                for name, ids in batch.items()
            }
            dense = {
                n: (rng.standard_normal(v.shape) * 1e-4).astype(np.float32)
                for n, v in params.items()
            }
            await client.push(
                tables,
                dense=dense,
                answer=("rows", "dense"),
                reads=along.take(),
                on_read=along.answered,
            )
        if reading is not None:
            await reading
        usage = cpu_usage(start, cpu_snapshot(pids, nodes), len(batches) - warmup)
    out: dict[str, float] = dict(usage["cpu_ms_per_step"])
    out["optimizer-0"] = out["optimizer"]  # `optimizer`: all the replicas together
    out["optimizer"] = sum(v for k, v in out.items() if k.startswith("optimizer-"))
    out["memcached"] = sum(v for k, v in out.items() if k.startswith("memcached-"))
    out["infrastructure"] = out["optimizer"] + out["memcached"]
    out["other_processes_share"] = usage["other_processes_share"]
    out.update({f"memcached_{k}": v for k, v in usage["memcached_per_step"].items()})
    return out


def run_case(
    case: str, batches: list[Batch], warmup: int, service: dict[str, Any], replicas: int = 1
) -> dict[str, float]:
    pushed = batches if case == "tables" else [as_one_table(b) for b in batches]
    with tempfile.TemporaryDirectory(prefix="push_replay_") as tmp:
        cluster = local_cluster(
            Path(tmp) / "w", prefix="benchreplay", service=service, replicas=replicas
        )
        with cluster as (config_path, run_dir, _):
            return asyncio.run(replay(config_path, run_dir, pushed, warmup))


def trainer_cpu_ms(path: Path) -> tuple[float, str] | None:
    """The trainer's CPU ms per step of `benchmarks.train`'s results and their time, if any."""
    try:
        report = json.loads(path.read_text())
        cpu = report["summary"]["distributed"]["cpu_ms_per_step"]["trainer"]
        return float(cpu), str(report["timestamp"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="20 pushes, 1 round")
    options.count("--steps", full=150, quick=15, help="timed pushes")
    options.count("--warmup", full=20, quick=5, minimum=0, help="untimed pushes")
    options.count("--rounds", full=2, quick=1, help="rounds of both cases")
    options.row_flush_pushes(
        default=ServiceConfig().row_flush_pushes,
        help="the cluster's service.row_flush_pushes (default "
        f"{ServiceConfig().row_flush_pushes}, the service's: rows written behind and read "
        "through their owner; 1: written through)",
    )
    options.count(
        "--replicas",
        full=1,
        help="optimizer replicas (the demo's); the replica column is all of them",
    )
    args = options.parse(argv)
    if args.replicas > MAX_REPLICAS:
        options.error(f"--replicas must be in 1..{MAX_REPLICAS}, got {args.replicas}")
    service = {"row_flush_pushes": args.row_flush_pushes}
    steps, warmup, rounds = args.steps, args.warmup, args.rounds
    started = time.time()
    batches = make_batches(steps + warmup)
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    for r in range(rounds):
        for case in CASES if r % 2 == 0 else reversed(CASES):
            got = run_case(case, batches, warmup, service, args.replicas)
            runs[case].append(got)
            print(
                f"round {r + 1}/{rounds}, {case}: CPU ms per push: replica "
                f"{got['optimizer']:.1f}, memcached {got['memcached']:.1f}, "
                f"infrastructure {got['infrastructure']:.1f} (client {got['client']:.1f})"
            )
    median = {
        case: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for case, rs in runs.items()
    }
    tables, one = median["tables"], median["one table"]
    print(
        f"\n{steps} pushes of the demo's data ({len(CATEGORICAL_NAMES)} tables, batch {BATCH}), "
        f"{rounds} round(s), medians, CPU ms per push"
    )
    print("case         replica  memcached  infrastructure  client")
    for case in CASES:
        m = median[case]
        print(
            f"{case:<12} {m['optimizer']:7.1f}  {m['memcached']:9.1f}  "
            f"{m['infrastructure']:14.1f}  {m['client']:6.1f}"
        )
    per_table = tables["infrastructure"] / one["infrastructure"]
    print(f"tables / one table, infrastructure CPU: {per_table:.2f}")
    for case in CASES:
        counters = {
            k.removeprefix("memcached_"): v
            for k, v in median[case].items()
            if k.startswith("memcached_")
        }
        print(f"{case}: {memcached_work(counters, median[case]['memcached'], 'push')}")
    trainer = trainer_cpu_ms(args.out_dir / "train.json")
    if trainer is not None:
        cpu, when = trainer
        print(
            f"infrastructure CPU per push / trainer CPU per step of train.json ({cpu:.0f} ms, "
            f"another run, {when}): {tables['infrastructure'] / cpu:.2f} (target <= 0.6)"
        )
    report = {
        **report_head("push_replay", started, machine_info()),
        "parameters": {
            "steps": steps,
            "warmup": warmup,
            "rounds": rounds,
            "batch": BATCH,
            "service": service,
            "replicas": args.replicas,
        },
        "runs": runs,
        "median": median,
        "tables_over_one_table": per_table,
        "train_json_trainer_cpu_ms_per_step": None if trainer is None else trainer[0],
    }
    save(report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
