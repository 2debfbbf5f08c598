"""Each locally trained method's round in a process of its own (`--role local` for the
TensorFlow methods, `--role torch` for the PyTorch ones), as the trainer has its own: a
process that ran other methods' steps before (their variables, traces and thread pools)
runs the next one slower, which would charge one method for another."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.cluster import DEMO_CONFIG, run_role
from benchmarks.harness.data import demo_batches
from benchmarks.train.local import load_weights
from benchmarks.train.steps import LocalRound, data_digest

TF_METHODS = ("local", "lazy_adam", "mlp_floor")


def run_method_process(
    args: argparse.Namespace,
    role: str,
    method: str,
    work_dir: Path,
    *,
    initial_weights: Path,
    seed: int,
) -> dict[str, Any]:
    """One round of `method` in a new `python -m benchmarks.train --role role` process;
    its result, which carries the digest of the batches it trained on."""
    work_dir.mkdir(parents=True)
    output = work_dir / f"{method}.json"
    cmd = [sys.executable, "-m", "benchmarks.train", "--role", role, "--method", method]
    cmd += ["--output", str(output), "--initial-weights", str(initial_weights)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--batch-size", str(args.batch_size), "--eval-batches", str(args.eval_batches)]
    cmd += ["--model-seed", str(seed)]
    return run_role(
        cmd,
        output,
        work_dir / f"{method}.log",
        timeout_s=120 + 10 * args.steps,
        what=f"the {method} process",
    )


def method_role(args: argparse.Namespace, run: Callable[[LocalRound], dict[str, Any]]) -> int:
    """A role's round: the benchmark's batches and `args.initial_weights`, trained by
    `run`; the result, with the data's digest, to `args.output`."""
    from lookup_table.config import load_config

    source, train, evals = demo_batches(args.steps, args.batch_size, args.eval_batches)
    demo = load_config(DEMO_CONFIG)
    dims = {c: demo.table(c).dim for c in source.schema.categorical}
    dense = load_weights(Path(args.initial_weights))
    local = LocalRound(train, evals, source.schema, dims, args.warmup, dense, args.model_seed)
    result = run(local)
    result["data_digest"] = data_digest([*train, *evals])
    Path(args.output).write_text(json.dumps(result))
    return 0


def tf_role(args: argparse.Namespace) -> int:
    """`--role local`: a round of one of TF_METHODS."""
    from benchmarks.train.lazy_adam import run_lazy_adam
    from benchmarks.train.local import run_local

    if args.method == "local":
        return method_role(args, run_local)
    if args.method in ("lazy_adam", "mlp_floor"):
        floor = args.method == "mlp_floor"
        return method_role(args, lambda r: run_lazy_adam(r, floor=floor))
    raise ValueError(f"--role local runs one of {', '.join(TF_METHODS)}, not {args.method!r}")
