"""Our side: `lookup-table-train` (the real CLI) against a fresh local cluster whose
tables are what `--print-tables` gives for the columns."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shlex
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import ROOT
from benchmarks.harness.cluster import (
    checkout_env,
    free_ports,
    run_role,
    running_cluster,
    service_log_errors,
    to_toml,
)
from benchmarks.harness.variants import VARIANTS, check_tables
from benchmarks.real_data import (
    ADAM,
    BATCH_SIZE,
    EMBEDDING_DIM,
    HIDDEN,
    INIT_RANGE,
    MEMCACHED_MEMORY_MB,
    MODEL,
    SEED,
)
from benchmarks.real_data.prep import Dataset


def _column_options(ds: Dataset) -> list[str]:
    """The CLI's column options for `ds`."""
    opts = ["--label", ds.label, "--categorical", ",".join(ds.categorical)]
    if ds.numeric:
        opts += ["--numeric", ",".join(ds.numeric)]
    for column, sep in ds.multivalued.items():
        opts += ["--multivalued", f"{column}:{sep}"]
    return opts


def print_tables(ds: Dataset, train_path: Path) -> str:
    """The `[[tables]]` TOML that `lookup-table-train --print-tables --tables-only` prints."""
    cmd = [sys.executable, "-m", "trainer.cli", "--print-tables", "--tables-only"]
    cmd += ["--data", f"csv:{train_path}"]
    cmd += [*_column_options(ds), "--dim", str(EMBEDDING_DIM)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=checkout_env(), check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"--print-tables failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def with_variant(tables_toml: str, variant: str) -> str:
    """The `[[tables]]` TOML with every table given `variant`'s dtype and optimizer (its
    row-wise Adam at the cluster's Adam rate)."""
    tables = tomllib.loads(tables_toml)["tables"]
    keys = VARIANTS[variant].table_keys(ADAM)
    return to_toml({"tables": [{**t, **keys} for t in tables]})


def write_cluster_file(
    path: Path, ds: Dataset, train_path: Path, *, variant: str = "fp32-adam"
) -> dict[str, Any]:
    """2 memcached nodes + 1 optimizer replica on fresh ports, a fresh namespace, adam lr
    0.001, and the `[[tables]]` that `--print-tables` gives for the columns (checked:
    one per categorical and multivalued column, dim 16, string ids, uniform +-0.05), each
    with `variant`'s dtype and optimizer."""
    from lookup_table.config import load_config

    mc1, mc2, opt = free_ports(3)
    raw = {
        "namespace": f"real{ds.name[:5]}{uuid.uuid4().hex[:8]}",
        "memcached": [f"127.0.0.1:{mc1}", f"127.0.0.1:{mc2}"],
        "optimizers": [f"http://127.0.0.1:{opt}"],
        "mode": "async",
        "workers": 1,
        "optimizer": dataclasses.asdict(ADAM),
        "service": {"max_body_bytes": 64 * 2**20},
        "store": {"timeout_s": 5.0, "pool_size": 4},
    }
    tables = with_variant(print_tables(ds, train_path), variant)
    path.write_text(to_toml(raw) + "\n" + tables)
    config = load_config(path)  # rejects a bad file now, not in the trainer
    columns = [*ds.categorical, *ds.multivalued]
    got = {
        t.name: (t.dim, t.id_type, t.initializer.name, dict(t.initializer.params))
        for t in config.tables
    }
    want = (EMBEDDING_DIM, "string", "uniform", {"minval": -INIT_RANGE, "maxval": INIT_RANGE})
    if set(got) != set(columns) or any(v != want for v in got.values()):
        raise RuntimeError(
            f"--print-tables gave {got}; expected {columns} each with (dim, id_type, "
            f"initializer) = {want}"
        )
    check_tables(variant, config.tables)
    return {
        "variant": variant,
        "namespace": config.namespace,
        "memcached": list(config.node_addresses),
        "optimizers": list(config.optimizers),
        "tables_toml": tables,
    }


@contextlib.contextmanager
def local_cluster(
    work_dir: Path, ds: Dataset, train_path: Path, *, variant: str = "fp32-adam"
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Start the cluster of a fresh cluster file; always stop it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path, run_dir = work_dir / "cluster.toml", work_dir / "run"
    info = write_cluster_file(config_path, ds, train_path, variant=variant)
    try:
        with running_cluster(
            config_path, run_dir, memory_mb=MEMCACHED_MEMORY_MB, env=checkout_env()
        ):
            yield config_path, info
    finally:
        info["service_log_errors"] = service_log_errors(config_path, run_dir)


def cli_command(
    ds: Dataset,
    config: Path,
    train_path: Path,
    eval_path: Path,
    *,
    epochs: int,
    output: Path,
    seed: int = SEED,
) -> list[str]:
    """The `lookup-table-train` arguments a user would type for this data set."""
    cmd = ["--config", str(config), "--data", f"csv:{train_path}"]
    cmd += ["--eval-data", f"csv:{eval_path}", *_column_options(ds)]
    cmd += ["--model", MODEL, "--hidden", ",".join(map(str, HIDDEN))]
    cmd += ["--batch-size", str(BATCH_SIZE), "--epochs", str(epochs)]
    cmd += ["--numeric-transform", "standardize", "--seed", str(seed)]
    cmd += ["--output", str(output), "--no-progress"]
    return cmd


def run_ours(
    ds: Dataset,
    train_path: Path,
    eval_path: Path,
    *,
    epochs: int,
    work_dir: Path,
    seed: int = SEED,
    variant: str = "fp32-adam",
) -> dict[str, Any]:
    """The CLI against a fresh local cluster whose tables are of `variant`; its summary
    plus what we measured around it."""
    with local_cluster(work_dir, ds, train_path, variant=variant) as (config_path, info):
        output = work_dir / "summary.json"
        args = cli_command(
            ds, config_path, train_path, eval_path, epochs=epochs, output=output, seed=seed
        )
        cmd = [sys.executable, "-m", "trainer.cli", *args]
        start = time.perf_counter()
        summary = run_role(
            cmd, output, work_dir / "trainer.log", timeout_s=3600, what="lookup-table-train"
        )
        wall = time.perf_counter() - start
    losses = [loss for _, loss in summary.get("history", {}).get("losses", [])]
    steps_per_epoch = max(1, math.ceil(summary.get("examples", 0) / max(1, epochs) / BATCH_SIZE))
    return {
        "side": "ours",
        "variant": variant,
        "seed": seed,
        "epochs": epochs,
        "command": "lookup-table-train " + shlex.join(args),
        "process_wall_seconds": wall,
        "seconds": summary.get("seconds"),
        "examples": summary.get("examples"),
        "examples_per_s": summary["examples_per_s"],
        "first_step_loss": losses[0] if losses else None,
        "epoch_train_loss": [
            float(np.mean(losses[k : k + steps_per_epoch]))
            for k in range(0, len(losses), steps_per_epoch)
        ],
        "eval_auc": summary["eval_auc"],
        "eval_logloss": summary["eval_logloss"],
        "eval_examples": summary.get("eval_examples"),
        "summary": {k: v for k, v in summary.items() if k != "history"},
        "cluster": info,
    }
