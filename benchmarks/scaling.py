"""Benchmark what a trainer costs each component, to size a fleet: CPU per 1,000 examples.

Checked with 2 trainers; docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.scaling            # 1 and 2 trainers, 100 steps each, 2 rounds
    python -m benchmarks.scaling --quick    # smoke run: 10 steps, 1 round
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import ROOT
from benchmarks.harness.cluster import (
    begin,
    checkout_env,
    cluster_pids,
    local_cluster,
    service_log_errors,
)
from benchmarks.harness.cpu import machine_busy_s, proc_cpu_s
from benchmarks.harness.data import DATA_SEED, EVAL_FRACTION, HIDDEN, MODEL, MODEL_SEED
from benchmarks.harness.options import Options
from benchmarks.harness.plot import figure
from benchmarks.harness.report import code_fingerprint, machine_info, report_head, save
from benchmarks.harness.rounds import DISTURBED_SHARE, abba, undisturbed, with_retries
from lookup_table.ops.localcluster import stop_process

TRAINER_COUNTS = (1, 2)
SAMPLE_S = 0.2  # CPU sampling period
PER = 1000  # examples: figures are per 1,000 examples
COMPONENTS = ("trainer", "optimizer", "memcached-1", "memcached-2")
COLORS = dict(zip(COMPONENTS, ("tab:orange", "tab:green", "tab:gray", "silver"), strict=True))


# ---------------------------------------------------------------- the trainer process


def wait_for_files(paths: Sequence[Path], *, timeout_s: float = 300.0) -> None:
    """Poll until every one of `paths` exists (a barrier between processes)."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise RuntimeError(f"no {', '.join(missing)} after {timeout_s:.0f} s")
        time.sleep(0.01)


def trainer_role(args: argparse.Namespace) -> int:
    """One trainer: its batches, the model, the barrier, Trainer.fit with step end times."""
    from lookup_table.config import load_config
    from trainer.data import SyntheticSource
    from trainer.loop import Trainer
    from trainer.models import build_model

    config = load_config(args.config)
    rows = math.ceil((args.steps + 1) * args.num_workers * args.batch_size / (1 - EVAL_FRACTION))
    source = SyntheticSource(int(rows * 1.1), seed=DATA_SEED)  # 10% headroom: full batches
    batches = list(
        source.batches(
            args.batch_size,
            worker_index=args.worker_index,
            num_workers=args.num_workers,
            split="train",
            eval_fraction=EVAL_FRACTION,
        )
    )[: args.steps]
    if len(batches) != args.steps or any(len(b.labels) != args.batch_size for b in batches):
        raise RuntimeError(f"wanted {args.steps} full batches, got {len(batches)}")
    model = build_model(MODEL, source.schema, config, hidden=HIDDEN, seed=MODEL_SEED)
    ends: list[float] = []

    class TimedTrainer(Trainer):
        def train_step(self, features: Any, labels: Any) -> float:
            loss = super().train_step(features, labels)
            ends.append(time.monotonic())  # CLOCK_MONOTONIC: one clock for every process
            if len(ends) == args.warmup:
                # every trainer starts its timed steps together: a trainer slow to warm up
                # (a page-fault stall, TF's tracing) does not leave the others' timed steps
                # outside the common window
                barrier(Path(args.go_file).with_name(f"warm-{args.worker_index}"))
                ends[-1] = time.monotonic()  # the timed steps start here, not before the wait
            return loss

    def barrier(mine: Path) -> None:
        mine.touch()
        others = [mine.with_name(f"warm-{i}") for i in range(args.num_workers)]
        wait_for_files(others)

    with TimedTrainer(config, model, worker_index=args.worker_index, progress=False) as trainer:
        Path(args.ready_file).touch()
        wait_for_files([Path(args.go_file)])
        result = trainer.fit(batches, steps=args.steps)
        pushes_in_flight = trainer.max_pushes_in_flight
    out = {
        "worker": args.worker_index,
        "pid": os.getpid(),
        "steps": result.steps,
        "ends": ends,
        "losses": [loss for _, loss in result.losses],
        "pushes_in_flight": pushes_in_flight,
    }
    Path(args.output).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------- sampling


class Sampler:
    """A thread that samples the CPU seconds of `pids` and of the machine every SAMPLE_S."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self.samples: list[tuple[float, dict[str, float | None], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _take(self) -> None:
        procs = {name: proc_cpu_s(pid) for name, pid in self.pids.items()}
        self.samples.append((time.monotonic(), procs, machine_busy_s()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take()
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def at(self, t: float) -> dict[str, float]:
        """CPU seconds of each process (and "machine") at monotonic time `t`, interpolated."""
        times = np.array([s[0] for s in self.samples])
        if not times[0] <= t <= times[-1]:
            raise RuntimeError(
                f"time {t:.2f} is outside the samples {times[0]:.2f}..{times[-1]:.2f}"
            )
        out = {"machine": float(np.interp(t, times, [s[2] for s in self.samples]))}
        for name in self.pids:
            values = [s[1][name] for s in self.samples]
            known = [(ts, v) for ts, v in zip(times, values, strict=True) if v is not None]
            if not known or not known[0][0] <= t <= known[-1][0]:
                raise RuntimeError(f"{name} (pid {self.pids[name]}) was not running at {t:.2f}")
            out[name] = float(np.interp(t, [k[0] for k in known], [k[1] for k in known]))
        return out


def window_figures(
    sampler: Sampler, trainers: Sequence[Mapping[str, Any]], warmup: int, batch_size: int
) -> dict[str, Any]:
    """CPU and examples over the window in which every trainer is past its warm-up."""
    t0 = max(t["ends"][warmup - 1] for t in trainers)
    t1 = min(t["ends"][-1] for t in trainers)
    if t1 <= t0:
        raise RuntimeError("the trainers did not train at the same time: no common window")
    wall = t1 - t0
    examples = {}
    for t in trainers:
        steps = np.arange(1, len(t["ends"]) + 1, dtype=np.float64)
        done = np.interp([t0, t1], t["ends"], steps)
        examples[f"trainer-{t['worker']}"] = float(done[1] - done[0]) * batch_size
    total = sum(examples.values())
    before, after = sampler.at(t0), sampler.at(t1)
    cpu_s = {name: after[name] - before[name] for name in sampler.pids}
    ours = sum(cpu_s.values())
    cores = os.cpu_count() or 1
    other = max((after["machine"] - before["machine"]) - ours, 0.0)
    per_1000: dict[str, float] = {}
    for name, s in cpu_s.items():
        n = examples[name] if name in examples else total  # a trainer: its own examples
        per_1000[name] = s * 1e3 / n * PER
    trainer_names = sorted(examples)
    per_1000["trainer"] = statistics.fmean(per_1000[n] for n in trainer_names)
    return {
        "window_s": wall,
        "examples": examples,
        "examples_total": total,
        "examples_per_s_total": total / wall,
        "examples_per_s_per_trainer": total / wall / len(trainers),
        "cpu_s": cpu_s,
        "cores_used": {name: s / wall for name, s in cpu_s.items()},
        "cpu_ms_per_1000_examples": per_1000,
        "total_cpu_ms_per_1000_examples": ours * 1e3 / total * PER,
        "other_processes_cores": other / wall,
        "other_processes_share": other / wall / cores,
    }


# ---------------------------------------------------------------- one run


def run(args: argparse.Namespace, n: int, work_dir: Path) -> dict[str, Any]:
    """A fresh cluster and `n` trainer processes; CPU per component over the common window."""
    with local_cluster(work_dir, workers=n, prefix="benchscale") as (config_path, run_dir, info):
        env = checkout_env()
        go = work_dir / "go"
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "benchmarks.scaling", "--role", "trainer"]
                cmd += ["--config", str(config_path), "--worker-index", str(i)]
                cmd += ["--num-workers", str(n), "--steps", str(args.steps)]
                cmd += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
                cmd += ["--output", str(work_dir / f"trainer-{i}.json")]
                cmd += ["--ready-file", str(work_dir / f"ready-{i}"), "--go-file", str(go)]
                log = open(work_dir / f"trainer-{i}.log", "wb")  # closed in the finally
                logs.append(log)
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=env))
            deadline = time.monotonic() + 300
            while not all((work_dir / f"ready-{i}").exists() for i in range(n)):
                failed = [i for i, p in enumerate(procs) if p.poll() is not None]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"trainer(s) {failed} exited before training (or 300 s)")
                time.sleep(0.05)
            pids = {f"trainer-{i}": p.pid for i, p in enumerate(procs)}
            pids.update(cluster_pids(config_path, run_dir))
            with Sampler(pids) as sampler:
                time.sleep(2 * SAMPLE_S)  # a sample before any trainer's first step
                go.touch()
                for p in procs:
                    p.wait(timeout=120 + 10 * args.steps)
        finally:
            for p in procs:
                stop_process(p)
            for log in logs:
                log.close()
        outputs = []
        for i, p in enumerate(procs):
            out = work_dir / f"trainer-{i}.json"
            if p.returncode != 0 or not out.exists():
                tail = (work_dir / f"trainer-{i}.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"trainer {i} failed ({p.returncode}); its log:\n{tail}")
            outputs.append(json.loads(out.read_text()))
        result = window_figures(sampler, outputs, args.warmup, args.batch_size)
    errors = service_log_errors(config_path, run_dir)  # the cluster is down: its log is complete
    return {
        "trainers": n,
        **result,
        "pushes_in_flight": outputs[0]["pushes_in_flight"],
        "losses_last": [o["losses"][-1] for o in outputs],
        "cluster": info,
        "service_log_errors": errors,
    }


# ---------------------------------------------------------------- the model


def _ratio(a: float, b: float) -> float | None:
    """a / b, or None (JSON null) when b is 0: a process that used less than one clock tick
    of CPU over a short run (`--quick`, a node with nothing to do)."""
    return a / b if b else None


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians per trainer count, the sizing table (from 1 trainer) and the 2-trainer check."""
    by: dict[int, dict[str, Any]] = {}
    for n in TRAINER_COUNTS:
        tried = [r for r in runs if r["trainers"] == n]
        rs = undisturbed(tried)
        by[n] = {
            "runs_used": [f"{r['run']}.{r['attempt']}" for r in rs],
            "runs_run": len(tried),
            "all_used_runs_disturbed": all(r["disturbed"] for r in rs),
            "cpu_ms_per_1000_examples": {
                c: statistics.median(r["cpu_ms_per_1000_examples"][c] for r in rs)
                for c in COMPONENTS
            },
            "total_cpu_ms_per_1000_examples": statistics.median(
                r["total_cpu_ms_per_1000_examples"] for r in rs
            ),
            "examples_per_s_total": statistics.median(r["examples_per_s_total"] for r in rs),
            "examples_per_s_per_trainer": statistics.median(
                r["examples_per_s_per_trainer"] for r in rs
            ),
            "cores_used": {
                c: statistics.median(r["cores_used"][c] for r in rs)
                for c in ("optimizer", "memcached-1", "memcached-2")
            },
            "cores_used_total": statistics.median(sum(r["cores_used"].values()) for r in rs),
            "other_processes_cores": statistics.median(r["other_processes_cores"] for r in rs),
            "other_processes_share": statistics.median(r["other_processes_share"] for r in rs),
        }
    one, two = by[1], by[2]
    rate = one["examples_per_s_per_trainer"]
    sizing = {}
    for c in COMPONENTS:
        ms = one["cpu_ms_per_1000_examples"][c]
        cores = ms / 1e3 * rate / PER  # CPU-s per 1,000 examples x examples/s / 1,000
        sizing[c] = {
            "cpu_ms_per_1000_examples": ms,
            "cores_per_trainer": cores,
            "trainers_per_core": 1 / cores if cores > 0 else math.inf,
        }
    # memcached as a fleet: both nodes together, per node-core
    mc = sum(one["cpu_ms_per_1000_examples"][c] for c in ("memcached-1", "memcached-2"))
    mc_cores = mc / 1e3 * rate / PER
    sizing["memcached (all nodes)"] = {
        "cpu_ms_per_1000_examples": mc,
        "cores_per_trainer": mc_cores,
        "trainers_per_core": 1 / mc_cores if mc_cores > 0 else math.inf,
    }
    total = sum(s["cores_per_trainer"] for c, s in sizing.items() if c in COMPONENTS)
    sizing["all (per trainer)"] = {
        "cpu_ms_per_1000_examples": sum(one["cpu_ms_per_1000_examples"][c] for c in COMPONENTS),
        "cores_per_trainer": total,
        "trainers_per_core": 1 / total if total > 0 else math.inf,
    }
    # the 2-trainer check. (a) load: the sizing rule, cores = CPU-s per 1,000 examples (from
    # 1 trainer) x the examples/s measured with 2 / 1,000. (b) throughput: each trainer keeps
    # its 1-trainer speed unless the machine runs out of cores. An example passes through one
    # trainer, so the CPU per example of the whole system is the sum over the components.
    measured_rate = two["examples_per_s_total"]
    predicted_cores = {
        c: one["cpu_ms_per_1000_examples"][c] / 1e3 * measured_rate / PER
        for c in ("optimizer", "memcached-1", "memcached-2")
    }
    total_s_per_example = sizing["all (per trainer)"]["cpu_ms_per_1000_examples"] / 1e3 / PER
    cores_available = (os.cpu_count() or 1) - two["other_processes_cores"]
    predicted_rate = min(2 * rate, cores_available / total_s_per_example)
    validation = {
        "per_1000_ratio_2_vs_1": {
            c: _ratio(two["cpu_ms_per_1000_examples"][c], one["cpu_ms_per_1000_examples"][c])
            for c in COMPONENTS
        },
        "cores": {
            c: {
                "predicted": predicted_cores[c],
                "measured": two["cores_used"][c],
                "measured/predicted": _ratio(two["cores_used"][c], predicted_cores[c]),
            }
            for c in predicted_cores
        },
        "cores_available": cores_available,
        "cores_used_total": two["cores_used_total"],
        "cpu_bound": predicted_rate < 2 * rate,
        "examples_per_s_total": {
            "predicted": predicted_rate,
            "measured": measured_rate,
            "measured/predicted": measured_rate / predicted_rate,
        },
    }
    return {
        "by_trainers": {str(n): v for n, v in by.items()},
        "trainer_examples_per_s": rate,
        "sizing": sizing,
        "validation_2_trainers": validation,
    }


def render_table(summary: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    by, sizing, val = summary["by_trainers"], summary["sizing"], summary["validation_2_trainers"]
    rate = summary["trainer_examples_per_s"]
    lines = [
        f"{MODEL} {HIDDEN}, 26 tables dim 16 (Adam), batch {params['batch_size']}, async, "
        f"{params['steps']} steps per trainer ({params['warmup']} warm-up), "
        f"{params['rounds']} round(s); 1 optimizer replica, 2 memcached nodes, "
        f"{os.cpu_count()} cores",
        f"runs used (other processes under {DISTURBED_SHARE:.0%} of the machine): "
        + ", ".join(
            f"{n} trainer(s) {len(by[n]['runs_used'])} of {by[n]['runs_run']}"
            + (" (all disturbed)" if by[n]["all_used_runs_disturbed"] else "")
            for n in ("1", "2")
        )
        + f"; other processes used {by['1']['other_processes_share']:.0%} (1 trainer) and "
        f"{by['2']['other_processes_share']:.0%} (2 trainers) of the machine",
        "",
        f"sizing (from 1 trainer at {rate:,.0f} examples/s; cores per trainer = CPU-s per "
        "1,000 examples x examples/s / 1,000)",
        f"{'component':<22} {'CPU ms/1k ex':>12} {'cores/trainer':>13} {'trainers/core':>13}",
    ]
    for c, s in sizing.items():
        lines.append(
            f"{c:<22} {s['cpu_ms_per_1000_examples']:>12.1f} {s['cores_per_trainer']:>13.2f} "
            f"{s['trainers_per_core']:>13.2f}"
        )
    lines += [
        "",
        "1 vs 2 trainers: CPU ms per 1,000 examples (2/1 should be ~1.0)",
        f"{'component':<22} {'1 trainer':>10} {'2 trainers':>10} {'2/1':>6}",
    ]
    for c in COMPONENTS:
        one = by["1"]["cpu_ms_per_1000_examples"][c]
        two = by["2"]["cpu_ms_per_1000_examples"][c]
        lines.append(f"{c:<22} {one:>10.1f} {two:>10.1f} {_fixed(_ratio(two, one)):>6}")
    ex = val["examples_per_s_total"]
    lines += [
        "",
        f"2 trainers: load predicted from 1 trainer's CPU per 1,000 examples at the measured "
        f"{ex['measured']:,.0f} examples/s",
        f"{'':<22} {'predicted':>10} {'measured':>10} {'m/p':>6}",
    ]
    for c, v in val["cores"].items():
        lines.append(
            f"{c + ' cores':<22} {v['predicted']:>10.2f} {v['measured']:>10.2f} "
            f"{_fixed(v['measured/predicted']):>6}"
        )
    bound = "CPU-bound" if val["cpu_bound"] else "not CPU-bound"
    lines += [
        f"{'examples/s (total)':<22} {ex['predicted']:>10,.0f} {ex['measured']:>10,.0f} "
        f"{ex['measured/predicted']:>6.2f}   predicted: min(2 x 1 trainer's, cores available / "
        f"CPU per example): {bound}, {val['cores_available']:.2f} cores available, "
        f"{val['cores_used_total']:.2f} used",
    ]
    return "\n".join(lines)


def _fixed(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(summary: Mapping[str, Any], path: Path) -> None:
    by, val = summary["by_trainers"], summary["validation_2_trainers"]
    with figure(path, nrows=1, ncols=2, figsize=(12, 4.5)) as (_, (ax_cpu, ax_val)):
        _plot_cpu(ax_cpu, by)
        _plot_validation(ax_val, val)


def _plot_cpu(ax_cpu: Any, by: Mapping[str, Any]) -> None:
    x = np.arange(len(COMPONENTS))
    for k, n in enumerate(("1", "2")):
        values = [by[n]["cpu_ms_per_1000_examples"][c] for c in COMPONENTS]
        bars = ax_cpu.bar(
            x + (k - 0.5) * 0.4,
            values,
            0.4,
            color=[COLORS[c] for c in COMPONENTS],
            alpha=1.0 if n == "1" else 0.55,
            hatch=None if n == "1" else "//",
            edgecolor="white",
            label=f"{n} trainer{'s' if n == '2' else ''}",
        )
        ax_cpu.bar_label(bars, fmt="%.0f", fontsize=8)
    ax_cpu.set_xticks(x, ["trainer\n(each)", "optimizer\nreplica", "memcached-1", "memcached-2"])
    ax_cpu.set_ylabel("CPU ms per 1,000 examples")
    ax_cpu.set_title("CPU per 1,000 examples: 1 vs 2 trainers (solid: 1, hatched: 2)")
    ax_cpu.grid(alpha=0.3, axis="y")


def _plot_validation(ax_val: Any, val: Mapping[str, Any]) -> None:
    names = list(val["cores"])
    x2 = np.arange(len(names))
    pred = [val["cores"][c]["predicted"] for c in names]
    meas = [val["cores"][c]["measured"] for c in names]
    b1 = ax_val.bar(x2 - 0.2, pred, 0.4, label="predicted from 1 trainer", color="tab:blue")
    b2 = ax_val.bar(x2 + 0.2, meas, 0.4, label="measured", color="tab:orange")
    ax_val.bar_label(b1, fmt="%.2f", fontsize=8)
    ax_val.bar_label(b2, fmt="%.2f", fontsize=8)
    ex = val["examples_per_s_total"]
    ax_val.set_xticks(x2, names)
    ax_val.set_ylabel("cores used")
    ax_val.set_title(
        f"2 trainers at the measured {ex['measured']:,.0f} examples/s: load predicted vs measured"
        f"\n(throughput predicted from 1 trainer: {ex['predicted']:,.0f} examples/s)",
        fontsize=10,
    )
    ax_val.legend(fontsize=8)
    ax_val.grid(alpha=0.3, axis="y")


# ---------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    options = Options(__doc__, quick="10 steps (3 warm-up), 1 round")
    options.training(steps=(100, 10), warmup=(10, 3), rounds=(2, 1), wait_s=120.0, unit="run")
    options.roles(
        ["trainer"],
        "--config",
        "--output",
        "--ready-file",
        "--go-file",
        worker_index=0,
        num_workers=1,
    )
    args = options.parse(argv)
    if (role := begin(args, {"trainer": trainer_role})) is not None:
        return role
    started = time.time()
    from importlib.metadata import version  # the trainers import TensorFlow, not this process

    machine = machine_info({"tensorflow": version("tensorflow"), "keras": version("keras")})
    code = code_fingerprint()
    order = abba(TRAINER_COUNTS, args.rounds)  # 1 2 2 1 ..
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        runs = with_retries(
            order,
            lambda k, n, attempt: run(args, n, Path(tmp) / f"run{k}-{attempt}"),
            retries=args.retries,
            quiet_wait_s=args.quiet_wait_s,
            share=lambda r: float(r["other_processes_share"]),
            title=lambda n: f"{n} trainer(s)",
            line=lambda r: (
                f"{r['examples_per_s_total']:,.0f} examples/s over "
                f"{r['window_s']:.1f} s, other processes {r['other_processes_share']:.0%} of the "
                "machine; CPU ms per 1,000 examples: "
                + ", ".join(f"{c} {v:.0f}" for c, v in r["cpu_ms_per_1000_examples"].items())
            ),
            unit="run",
        )
    summary = summarize(runs)
    params = {
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "quick": args.quick,
        "trainer_counts": list(TRAINER_COUNTS),
        "order": order,
        "sample_s": SAMPLE_S,
        "pushes_in_flight": runs[0]["pushes_in_flight"],
        "retries": args.retries,
        "quiet_wait_s": args.quiet_wait_s,
        "disturbed_share": DISTURBED_SHARE,
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    print()
    print(render_table(summary, params))
    report = {
        **report_head("scaling", started, machine, code),
        "parameters": {
            **params,
            "model": MODEL,
            "hidden": list(HIDDEN),
            "tables": "deploy/demo.toml C1..C26: dim 16, Adam lr 0.01; dense Adam lr 0.001",
            "data": {
                "source": "SyntheticSource",
                "seed": DATA_SEED,
                "eval_fraction": EVAL_FRACTION,
            },
            "cluster": "2 memcached nodes + 1 optimizer replica, async, fresh per run "
            "(python -m lookup_table.ops.localcluster up)",
            "window": "from the last trainer's warm-up end to the first trainer's last step",
        },
        "summary": summary,
        "runs": runs,
    }
    save(report, args.out_dir, code_at_end=code_fingerprint(), plot=partial(plot, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
