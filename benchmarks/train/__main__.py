"""`python -m benchmarks.train`: the rounds of both sides and the report (see
`benchmarks.train`)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import benchmarks.train
from benchmarks.harness import pyspy
from benchmarks.harness.cluster import DEMO_CONFIG, MEMCACHED_MEMORY_MB, begin
from benchmarks.harness.costs import render as render_costs
from benchmarks.harness.data import (
    DATA_SEED,
    EVAL_FRACTION,
    HIDDEN,
    MODEL,
    MODEL_SEED,
    demo_batches,
)
from benchmarks.harness.options import Options
from benchmarks.harness.report import code_fingerprint, machine_info, report_head, save
from benchmarks.harness.rounds import DISTURBED_SHARE, interleaved, rotated_within, with_retries
from benchmarks.harness.variants import (
    BASE_VARIANT,
    VARIANT_TARGET_AUC_DIFF,
    VARIANTS,
    parse_variants,
)
from benchmarks.train.compact import (
    TARGET_SPEED_RATIO,
    method_of,
    table_changes,
    variant_of,
)
from benchmarks.train.distributed import (
    PY_SPY_RATE_HZ,
    cost_table,
    run_distributed,
    trainer_role,
)
from benchmarks.train.local import (
    DENSE_LR,
    EMBEDDING_LR,
    VOCABULARY,
    dense_weights,
    save_weights,
)
from benchmarks.train.processes import TF_METHODS, run_method_process, tf_role
from benchmarks.train.report import (
    METHODS,
    TARGET_AUC_GAP,
    TARGET_CPU_RATIO,
    TARGET_LAZY_AUC_GAP,
    TARGET_LAZY_CPU_RATIO,
    TARGET_LAZY_INFRA_CPU,
    TARGET_LAZY_RATIO,
    TARGET_LAZY_TRAINER_CPU,
    TARGET_RATIO,
    TARGET_TORCH_AUC_GAP,
    TARGET_TORCHREC_RATIO,
    label,
    methods_in,
    ordered,
    plot,
    render_table,
    summarize,
)
from benchmarks.train.steps import data_digest
from benchmarks.train.torch_baselines import (
    INSTALL,
    ROWWISE_ADAGRAD,
    TORCH_METHODS,
    grouped,
    skipped,
    torch_role,
)
from trainer.metrics import auc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    options = Options(
        benchmarks.train.__doc__, quick="12 steps (2 warm-up), 1 round, 2 eval batches"
    )
    options.training(steps=(150, 12), warmup=(10, 2), rounds=(2, 1), wait_s=180.0)
    options.count("--eval-batches", full=20, quick=2, help="held-out batches evaluated")
    options.add_argument(
        "--profile",
        action="store_true",
        help="one more distributed run under py-spy (trainer and service): the cost table "
        "per process (math, bytes moved, else); not in the rounds' table (with --quick: the "
        "round's own distributed run is the profiled one)",
    )
    options.add_argument(
        "--mode",
        choices=["async", "sync"],
        default="async",
        help="the cluster's mode (default async, as deploy/demo.toml; sync: no prefetch, "
        "each step waits for its push: no staleness)",
    )
    options.row_flush_pushes(
        default=None,
        help="the cluster's service.row_flush_pushes (default: deploy/demo.toml's; > 1: rows "
        "written behind and read through their owner)",
    )
    options.add_argument(
        "--pushes-in-flight",
        type=int,
        default=None,
        help="Trainer max_pushes_in_flight (default: the Trainer's own default)",
    )
    options.add_argument(
        "--variants",
        default=BASE_VARIANT,
        help=f"comma-separated, from {', '.join(VARIANTS)}: the compact rows' variants, each "
        f"one more distributed method a round with its own cluster, held against "
        f"{BASE_VARIANT} (the distributed method); more than one writes train_variants.json "
        f"instead of train.json (default {BASE_VARIANT})",
    )
    options.add_argument(
        "--torch",
        choices=["auto", "on", "off"],
        default="auto",
        help="the PyTorch baselines (torchrec, torch_sparse_adam): auto runs those that "
        "import and says which it skipped; on fails at once if one cannot run; off skips "
        f"them (install: {INSTALL})",
    )
    options.add_argument(
        "--tf-intra-op-threads",
        type=int,
        default=0,
        help="TensorFlow's intra-op threads in every process that runs it: the local "
        "methods' and the trainer's (TF_NUM_INTRAOP_THREADS); 0: TensorFlow's own choice, a "
        "thread per core (default 0)",
    )
    options.count(
        "--seeds",
        full=1,
        help="seeds 0..N-1 of the dense weights' and the tables' initial values, round k "
        "with seed k mod N (every method of a round the same); more than 1 makes --rounds "
        "default to N and writes train_variants.json",
    )
    options.roles(
        ["trainer", "local", "torch"],
        "--config",
        "--run-dir",
        "--output",
        "--py-spy-dir",
        "--initial-weights",
        "--method",
        model_seed=MODEL_SEED,
    )
    args = options.parse(argv)
    try:
        args.variants = parse_variants(args.variants)
    except ValueError as exc:
        options.error(str(exc))
    if BASE_VARIANT not in args.variants:
        options.error(
            f"--variants must include {BASE_VARIANT}, the distributed method every variant is "
            f"held against; got {args.variants}"
        )
    if args.seeds > 1 and "--rounds" in options.defaulted:
        args.rounds = args.seeds
    if args.tf_intra_op_threads < 0:
        options.error(
            f"--tf-intra-op-threads must be 0 (TensorFlow's choice) or more, got "
            f"{args.tf_intra_op_threads}"
        )
    if args.rounds % args.seeds:
        options.error(
            f"--rounds must be a multiple of --seeds (round k trains with seed k mod seeds), got "
            f"--rounds {args.rounds} for --seeds {args.seeds}: give --rounds {args.seeds} or "
            "leave it out"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tf_intra_op_threads:  # read when TensorFlow starts; the roles inherit it
        os.environ["TF_NUM_INTRAOP_THREADS"] = str(args.tf_intra_op_threads)
    roles = {"trainer": trainer_role, "local": tf_role, "torch": torch_role}
    if (role := begin(args, roles)) is not None:
        return role
    started = time.time()
    # before TensorFlow: torchrec cannot be imported after it
    torch_skipped = skipped(args.torch)
    if args.torch == "on" and torch_skipped:
        why = "; ".join(grouped(torch_skipped))
        print(f"python -m benchmarks.train: error: --torch on, but {why}", file=sys.stderr)
        return 2
    if args.torch == "auto":
        for line in grouped({m: f"skipped: {why}" for m, why in torch_skipped.items()}):
            print(line, flush=True)
    import keras
    import tensorflow as tf

    versions = {"tensorflow": tf.__version__, "keras": keras.__version__}
    for name in ("torch", "torchrec", "fbgemm_gpu"):
        if (module := sys.modules.get(name)) is not None:
            versions[name] = str(getattr(module, "__version__", "?"))
    machine = machine_info(versions)
    code = code_fingerprint()

    from lookup_table.config import load_config
    from trainer.models import build_model

    source, train, evals = demo_batches(args.steps, args.batch_size, args.eval_batches)
    digest = data_digest(train + evals)
    demo = load_config(DEMO_CONFIG)
    columns = list(source.schema.categorical)
    seeds = range(MODEL_SEED, MODEL_SEED + args.seeds)
    # both sides start from these dense weights (build_model's, seeded), one set a seed
    initial_dense = {
        seed: [
            np.asarray(w.numpy())
            for w in dense_weights(
                build_model(MODEL, source.schema, demo, hidden=HIDDEN, seed=seed)
            )
        ]
        for seed in seeds
    }
    eval_labels = np.concatenate([b.labels for b in evals])
    reference_auc = auc(eval_labels, np.concatenate([source.logits(b) for b in evals]))

    # every method once a round, the order rotated each round; the distributed methods
    # also among their own places: a cluster run right after another may run slower (the
    # last one's memory is still being given back), which one fixed order within the
    # block would charge to the later variants every round
    methods = ordered(
        [
            *(m for m in METHODS if m not in torch_skipped),
            *(method_of(v) for v in args.variants),
        ]
    )
    clusters = [method_of(v) for v in args.variants]
    plan = rotated_within(list(interleaved(methods, args.rounds)), clusters)
    order = [m for _, m in plan]
    profile: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        weights_paths = {seed: Path(tmp) / f"initial_dense-{seed}.npz" for seed in seeds}
        for seed, path in weights_paths.items():
            save_weights(path, initial_dense[seed])
        weights_path = weights_paths[MODEL_SEED]

        profiled_runs: list[dict[str, Any]] = []

        def one_round(k: int, item: tuple[int, str], attempt: int) -> dict[str, Any]:
            paired_round, method = item
            seed = seeds[paired_round % len(seeds)]
            r = run_method(k, method, seed, attempt)
            r["paired_round"], r["seed"] = paired_round, seed
            return r

        def run_method(k: int, method: str, seed: int, attempt: int) -> dict[str, Any]:
            if method in TF_METHODS or method in TORCH_METHODS:
                r = run_method_process(
                    args,
                    "local" if method in TF_METHODS else "torch",
                    method,
                    Path(tmp) / f"{method}{k}-{attempt}",
                    initial_weights=weights_paths[seed],
                    seed=seed,
                )
                if r["data_digest"] != digest:
                    raise RuntimeError(f"the {method} process saw other batches than this one")
                return r
            variant = variant_of(method) or BASE_VARIANT
            # a smoke run's figures mean nothing: its one distributed round is the profiled run
            profiled = args.quick and args.profile and method == "distributed"
            if profiled:
                args.out_dir.mkdir(parents=True, exist_ok=True)
            r = run_distributed(
                args,
                Path(tmp) / f"cluster{k}-{attempt}",
                initial_weights=weights_paths[seed],
                variant=variant,
                columns=columns,
                tables=table_changes(demo, columns, variant, seed - MODEL_SEED),
                py_spy_dir=args.out_dir if profiled else None,
            )
            if r["data_digest"] != digest:
                raise RuntimeError("the trainer process saw other batches than the local run")
            if profiled:
                profiled_runs.append(r)
            return r

        rounds = with_retries(
            plan,
            one_round,
            retries=args.retries,
            quiet_wait_s=args.quiet_wait_s,
            share=lambda r: float(r["cpu"]["other_processes_share"]),
            title=lambda item: (
                f"{label(item[1])}, seed {seeds[item[0] % len(seeds)]}"
                if len(seeds) > 1
                else label(item[1])
            ),
            line=lambda r: (
                f"{r['examples_per_s']:,.0f} examples/s, "
                f"{r['step_ms_median']:.1f} ms/step, eval AUC {r['eval_auc']:.4f}, other processes "
                f"{r['cpu']['other_processes_share']:.0%} of the machine, CPU ms/step "
                + ", ".join(f"{n} {v:.0f}" for n, v in r["cpu"]["cpu_ms_per_step"].items())
            ),
        )
        if args.profile and profiled_runs:
            r = profiled_runs[-1]
        elif args.profile:
            print("profiling one more distributed run with py-spy ...", flush=True)
            args.out_dir.mkdir(parents=True, exist_ok=True)
            r = run_distributed(
                args,
                Path(tmp) / "profiled",
                initial_weights=weights_path,
                columns=columns,
                py_spy_dir=args.out_dir,
            )
        if args.profile:
            timed = args.steps - args.warmup
            profile = {
                "run": {k: v for k, v in r.items() if k != "losses"},
                "costs": cost_table(r, args.out_dir),
                **{
                    who: pyspy.threads_per_step(
                        args.out_dir / f"train-{who}.pyspy.txt", steps=timed, rate_hz=PY_SPY_RATE_HZ
                    )
                    for who in ("trainer", "service")
                },
            }

    compared = args.variants if len(args.variants) > 1 or args.seeds > 1 else []
    summary = summarize(rounds, reference_auc, args.batch_size, variants=compared)
    if torch_skipped:
        summary["skipped"] = {m: f"skipped: {why}" for m, why in torch_skipped.items()}
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
        "variants": args.variants,
        "seeds": list(seeds),
        "tf_intra_op_threads": args.tf_intra_op_threads,  # 0: TensorFlow's choice
    }
    table = render_table(summary, params)
    print()
    print(table)
    if profile is not None:
        print()
        print("cost table, the profiled distributed run (CPU ms per step; /proc, split by py-spy):")
        print(render_costs(profile["costs"]))
    report = {
        **report_head("train_variants" if compared else "train", started, machine, code),
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
            "lazy_adam": {
                "embedding": f"the local model's initial rows, the {VOCABULARY:,} rows of all 26 "
                "tables stacked in one tf.Variable of items (row, m, v, step)",
                "optimizers": f"Adam lr {EMBEDDING_LR} on the batch's unique rows only, a step "
                f"count per row (the service's math), scattered back; Keras Adam lr {DENSE_LR} "
                "on the dense weights",
                "train_step": "one tf.function: unique, gather, forward, backward, both updates",
                "inputs": "a step's batch as two tensors, its ids (batch, 26) int64 and its "
                "numbers (batch, 13) float32, built inside the timed step",
            },
            "torch": {
                "mode": args.torch,
                "torchrec": "torchrec FusedEmbeddingBagCollection of the 26 tables (FBGEMM "
                "table-batched embedding on the CPU, sum pooling, one id a bag, the local "
                f"model's initial rows), fused RowWiseAdagrad {ROWWISE_ADAGRAD} (FBGEMM's CPU "
                f"tables have no Adam); torch.optim.Adam lr {DENSE_LR} on the MLP",
                "torch_sparse_adam": "torch.nn.EmbeddingBag(100,000, 16, sparse=True) a table "
                f"(the local model's initial rows), torch.optim.SparseAdam lr {EMBEDDING_LR} "
                "(one step count a table); torch.optim.Adam lr "
                f"{DENSE_LR} on the MLP; Keras' betas and epsilon",
                "both": "the same batches and initial dense weights (Keras kernels transposed), "
                "logits with binary_cross_entropy_with_logits, torch.set_num_threads(2), "
                "eager steps, each round in a process of its own (--role torch)",
            },
            "mlp_floor": "lazy_adam's step without the tables' update: the MLP alone trained on "
            "embeddings held constant",
            "processes": "every method's round in a process of its own (--role local for local, "
            "lazy_adam and mlp_floor; --role torch; --role trainer)",
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
            "variant_tables": {
                v: table_changes(demo, columns, v, 0).get(columns[0], {}) for v in args.variants
            },
            "seeding": "round k: seed k mod seeds for build_model's dense weights (both sides), "
            "the local Keras tables' initial rows (keras.utils.set_random_seed) and each "
            "cluster table's seed (deploy/demo.toml's + seed); the data is the same every round",
            "timing": "steps warmup+1..steps; a step ends when its loss is back in Python; the "
            "distributed window also covers the final push drain and dense read, and the "
            "replicas' writes behind (a pause, then resume)",
        },
        "acceptance_targets": {
            "distributed/local examples/s": TARGET_RATIO,
            "distributed/local examples per CPU-second": TARGET_CPU_RATIO,
            "abs eval AUC gap": TARGET_AUC_GAP,
        },
        "lazy_adam_targets": {
            "distributed/lazy_adam examples/s": TARGET_LAZY_RATIO,
            "distributed/lazy_adam examples per CPU-second": TARGET_LAZY_CPU_RATIO,
            "abs eval AUC gap distributed - lazy_adam": TARGET_LAZY_AUC_GAP,
            "trainer CPU / lazy_adam step CPU (max)": TARGET_LAZY_TRAINER_CPU,
            "(replicas + memcached) CPU / lazy_adam step CPU (max)": TARGET_LAZY_INFRA_CPU,
        },
        "torch_targets": {
            "distributed/torchrec examples/s": TARGET_TORCHREC_RATIO,
            "abs eval AUC gap torchrec or torch_sparse_adam - lazy_adam": TARGET_TORCH_AUC_GAP,
        },
        "summary": summary,
        "rounds": rounds,
    }
    if compared:
        report["variant_targets"] = {
            f"variant/{BASE_VARIANT} examples/s, median of paired rounds": TARGET_SPEED_RATIO,
            f"variant eval AUC - {BASE_VARIANT}'s, mean over seeds, at least minus": {
                v: VARIANT_TARGET_AUC_DIFF[v] for v in compared if v in VARIANT_TARGET_AUC_DIFF
            },
        }
    if profile is not None:
        report["profile"] = profile
    disturbed = [m for m in methods_in(summary) if summary[m]["all_used_rounds_disturbed"]]
    if disturbed:
        print(
            f"warning: every round of {', '.join(disturbed)} ran while other processes used more "
            f"than {DISTURBED_SHARE:.0%} of the machine; its figures are disturbed",
            file=sys.stderr,
        )
    used = [
        r for r in rounds if f"{r['round']}.{r['attempt']}" in summary[r["method"]]["rounds_used"]
    ]
    save(
        report,
        args.out_dir,
        code_at_end=code_fingerprint(),
        plot=partial(
            plot, used, summary, params=params, costs=profile["costs"] if profile else None
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
