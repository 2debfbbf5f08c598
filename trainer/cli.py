"""`lookup-table-train`: train a model on a cluster, with progress, evaluation and a summary.

    lookup-table-train --config C --data synthetic:200000 [--model mlp] [--batch-size 1024]
        [--epochs E | --steps S] [--max-seconds T] [--eval-fraction 0.2]
        [--worker-index I --num-workers N] [--plot loss.png] [--output summary.json]

Training stops at the end of the data (`--epochs`, default 1), after `--steps`, or
after `--max-seconds` of training, whichever comes first; `--max-seconds` alone
repeats the data until the time is up. Worker I of N trains on every N-th batch;
every worker evaluates on the same held-out batches. The final summary (JSON, also
printed) has examples/s, the training loss, eval AUC and log loss, and the rows this
worker created per table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["main"]

logger = logging.getLogger("trainer")
T = TypeVar("T")


def _columns(text: str | None) -> list[str] | None:
    return [c for c in text.split(",") if c] if text else None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def _until(
    batches: Iterable[T], max_seconds: float, *, clock: Callable[[], float] = time.monotonic
) -> Iterator[T]:
    """`batches` until `max_seconds` have passed since the first one was taken.

    The training loop reads one batch ahead, so the step under way when the time is up
    and the one whose batch was already read still run: training ends at most one step
    after the step that crosses `max_seconds`.
    """
    start: float | None = None
    for batch in batches:
        now = clock()
        if start is None:
            start = now
        elif now - start >= max_seconds:
            return
        yield batch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lookup-table-train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the cluster file (TOML)")
    p.add_argument(
        "--data", required=True, help="synthetic[:N] | criteo:PATH | csv:PATH | parquet:PATH"
    )
    p.add_argument("--label", help="label column (csv/parquet)")
    p.add_argument("--categorical", help="categorical columns A,B,... (csv/parquet)")
    p.add_argument("--numeric", help="numeric columns X,Y,... (csv/parquet)")
    p.add_argument(
        "--multivalued",
        action="append",
        default=[],
        help="multivalued column COL[:SEP] (repeatable; SEP default '|')",
    )
    p.add_argument("--model", default="mlp", choices=["mlp", "deepfm"])
    p.add_argument("--hidden", default="256,128", help="MLP widths (default 256,128)")
    p.add_argument("--batch-size", type=int, default=1024)
    stop = p.add_mutually_exclusive_group()
    stop.add_argument(
        "--epochs", type=int, help="passes over the data (default 1; unlimited with --max-seconds)"
    )
    stop.add_argument("--steps", type=int, help="stop after this many steps")
    p.add_argument(
        "--max-seconds",
        type=_positive_seconds,
        metavar="T",
        help="stop after T seconds of training (wall time from the first batch; the step "
        "under way and the one already read ahead finish); combines with --epochs or "
        "--steps (whichever comes first), alone it repeats the data until the time is up",
    )
    p.add_argument("--eval-fraction", type=float, default=0.2)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every K steps (0: end)")
    p.add_argument("--eval-batches", type=int, default=20, help="eval batches (default 20)")
    p.add_argument("--worker-index", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--dense-refresh-steps", type=int, default=1)
    p.add_argument(
        "--pushes-in-flight",
        type=int,
        default=0,
        help="async mode: 0 waits for each push (default); K >= 1 pipelines K "
        "pushes, row prefetch and dense pulls: faster, staler",
    )
    p.add_argument("--seed", type=int, default=0, help="initial dense weights")
    p.add_argument("--plot", help="write the loss/AUC curves to this PNG")
    p.add_argument("--output", help="write the summary JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def _train_batches(source: Any, args: argparse.Namespace) -> Iterable[Any]:
    """This worker's training batches, as long as --epochs / --steps / --max-seconds say."""
    if args.steps is not None:
        epochs: int | None = None  # fit stops after --steps
    elif args.epochs is not None:
        epochs = args.epochs
    else:
        epochs = None if args.max_seconds is not None else 1
    train: Iterable[Any] = source.batches(
        args.batch_size,
        worker_index=args.worker_index,
        num_workers=args.num_workers,
        split="train",
        eval_fraction=args.eval_fraction,
        epochs=epochs,
    )
    return train if args.max_seconds is None else _until(train, args.max_seconds)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lookup_table.config import load_config
    from trainer.data import parse_data_spec
    from trainer.loop import Trainer
    from trainer.models import build_model

    if not 0 <= args.worker_index < args.num_workers:
        raise ValueError(
            f"--worker-index must be in 0..{args.num_workers - 1}, got {args.worker_index}"
        )
    if not 0 <= args.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    config = load_config(args.config)
    multivalued = dict(
        (m.split(":", 1)[0], m.split(":", 1)[1] if ":" in m else "|") for m in args.multivalued
    )
    source = parse_data_spec(
        args.data,
        label=args.label,
        categorical=_columns(args.categorical),
        numeric=_columns(args.numeric),
        multivalued=multivalued or None,
    )
    hidden = [int(h) for h in args.hidden.split(",") if h]
    model = build_model(args.model, source.schema, config, hidden=hidden, seed=args.seed)
    train = _train_batches(source, args)
    evals = (
        list(
            itertools.islice(
                source.batches(args.batch_size, split="eval", eval_fraction=args.eval_fraction),
                args.eval_batches,
            )
        )
        if args.eval_fraction > 0
        else []
    )
    with Trainer(
        config,
        model,
        worker_index=args.worker_index,
        dense_refresh_steps=args.dense_refresh_steps,
        max_pushes_in_flight=args.pushes_in_flight,
        progress=not args.no_progress,
    ) as trainer:
        result = trainer.fit(
            train, steps=args.steps, eval_batches=evals or None, eval_every=args.eval_every or None
        )
        created = trainer.rows_created
        version = trainer.version
    tail = [loss for _, loss in result.losses[-max(1, len(result.losses) // 10) :]]
    last_eval = result.evals[-1] if result.evals else {}
    return {
        "worker": args.worker_index,
        "num_workers": args.num_workers,
        "model": args.model,
        "data": args.data,
        "batch_size": args.batch_size,
        "max_seconds": args.max_seconds,
        "steps": result.steps,
        "examples": result.examples,
        "seconds": round(result.seconds, 3),
        "examples_per_s": round(result.examples_per_s, 1),
        "train_loss": float(sum(tail) / len(tail)) if tail else None,
        "eval_auc": last_eval.get("auc"),
        "eval_logloss": last_eval.get("logloss"),
        "eval_examples": last_eval.get("examples"),
        "rows_created": created,
        "final_version": version,
        "history": {"losses": result.losses, "evals": result.evals, "versions": result.versions},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from lookup_table.errors import LookupTableError

    try:
        summary = run(args)
    except (LookupTableError, ValueError, FileNotFoundError) as exc:
        logger.error("lookup-table-train: %s", exc)
        return 1
    brief = {k: v for k, v in summary.items() if k != "history"}
    print(json.dumps(brief, indent=2))  # noqa: T201 - the CLI's result
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(summary))
    if args.plot:
        from trainer.plot import plot_training

        logger.info("wrote %s", plot_training([summary], args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
