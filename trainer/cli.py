"""`lookup-table-train`: train a model on a cluster, with progress, evaluation and a summary.

    lookup-table-train --config C --data synthetic:200000 [--model mlp] [--epochs E | --steps S]
        [--eval-data SPEC] [--worker-index I --num-workers N] [--output summary.json]
    lookup-table-train --data csv:PATH --label y --categorical a,b --print-tables > c.toml

Every option, and what the summary holds: docs/training.md#the-command-line-lookup-table-train.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


_DEFAULT_SHUFFLE_BUFFER = 1 << 16  # examples: ~100 MB for Criteo's 40 columns
_EVALS_PER_RUN = 10  # default --eval-every: this many evaluations over a run of known length
_FALLBACK_EVAL_EVERY = 100  # steps, when the run's length is not known in advance


def _parser() -> argparse.ArgumentParser:
    from trainer.numeric import TRANSFORMS

    p = argparse.ArgumentParser(prog="lookup-table-train", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="the cluster file (TOML); required unless --print-tables")
    p.add_argument(
        "--data", required=True, help="synthetic[:N] | criteo:PATH | csv:PATH | parquet:PATH"
    )
    p.add_argument(
        "--eval-data",
        metavar="SPEC",
        help="a separate evaluation file (same kinds and column options as --data); "
        "the whole --data file then trains, and this one is evaluated whole at the end",
    )
    p.add_argument(
        "--numeric-transform",
        choices=TRANSFORMS,
        default="standardize",
        help="numeric columns: standardize with the training rows' mean and variance "
        "(default; missing -> the mean), log1p (signed) then standardize, or none",
    )
    p.add_argument(
        "--numeric-stats",
        metavar="PATH",
        help="JSON of the numeric statistics: read when it exists, else computed and "
        "written there (give every worker the same path)",
    )
    p.add_argument(
        "--stats-rows",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="compute the numeric statistics from the first N training rows (0: all)",
    )
    p.add_argument(
        "--shuffle-buffer",
        type=_non_negative_int,
        metavar="N",
        help=f"examples in the shuffle buffer, 0 = file order (default {_DEFAULT_SHUFFLE_BUFFER} "
        "when the data is read more than once, else 0)",
    )
    p.add_argument(
        "--print-tables",
        action="store_true",
        help="print a complete cluster file for the columns and exit: the demo cluster's "
        "local addresses, Adam, one [[tables]] per categorical column (write it with "
        "> my-cluster.toml, then deploy/cluster.sh up --config my-cluster.toml)",
    )
    p.add_argument(
        "--tables-only",
        action="store_true",
        help="with --print-tables: only the [[tables]], to append to a cluster file of yours",
    )
    p.add_argument(
        "--namespace",
        help="with --print-tables: the cluster file's namespace (default: the data "
        "file's name, e.g. train for csv:train.csv)",
    )
    p.add_argument(
        "--dim", type=_positive_int, default=16, help="dim for --print-tables (default 16)"
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
    p.add_argument(
        "--eval-fraction",
        type=float,
        help="share of --data held out for evaluation (default 0.2; not with --eval-data)",
    )
    p.add_argument(
        "--eval-every",
        type=_non_negative_int,
        metavar="K",
        help="evaluate every K steps (0: only at the end; default: about 10 times over the "
        f"run when its length is known, else every {_FALLBACK_EVAL_EVERY} steps)",
    )
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
    p.add_argument(
        "--seed", type=int, default=0, help="initial dense weights and the shuffle order"
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="write this worker's curves (training and eval loss, eval AUC) to this PNG; "
        "all workers in one picture: python -m trainer.plot summary-*.json --out loss.png",
    )
    p.add_argument(
        "--output",
        metavar="JSON",
        help="write the summary JSON here, with the per-step history (python -m trainer.plot "
        "reads it)",
    )
    p.add_argument(
        "--save-model",
        metavar="DIR",
        help="after training, write a TF SavedModel to DIR that takes the raw columns "
        "(numeric transform inside) and serves with tf.saved_model.load or TF Serving, "
        "and the Keras model to DIR.keras (for lookup-table-checkpoint export --model); "
        "rows and dense weights from a checkpoint taken with the replicas paused. Give it "
        "to one worker (worker 0): it snapshots the cluster when that worker finishes",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def _epochs(args: argparse.Namespace) -> int | None:
    """Passes over the training data: None repeats (fit stops at --steps / --max-seconds)."""
    if args.steps is not None:
        return None
    if args.epochs is not None:
        return int(args.epochs)
    return None if args.max_seconds is not None else 1


def _eval_fraction(args: argparse.Namespace) -> float:
    """The held-out share of --data: 0 with --eval-data, else --eval-fraction (0.2)."""
    if args.eval_data:
        return 0.0
    return 0.2 if args.eval_fraction is None else float(args.eval_fraction)


def _train_batches(source: Any, args: argparse.Namespace) -> Iterable[Any]:
    """This worker's training batches, as long as --epochs / --steps / --max-seconds say."""
    epochs = _epochs(args)
    shuffle = args.shuffle_buffer
    if shuffle is None:
        shuffle = 0 if epochs == 1 else _DEFAULT_SHUFFLE_BUFFER
    eval_fraction = _eval_fraction(args)
    train: Iterable[Any] = source.batches(
        args.batch_size,
        worker_index=args.worker_index,
        num_workers=args.num_workers,
        split="train" if eval_fraction > 0 else "all",
        eval_fraction=eval_fraction,
        epochs=epochs,
        shuffle_buffer=shuffle,
        seed=args.seed,
    )
    return train if args.max_seconds is None else _until(train, args.max_seconds)


def _source(spec: str, args: argparse.Namespace) -> Any:
    from trainer.data import parse_data_spec

    multivalued = dict(
        (m.split(":", 1)[0], m.split(":", 1)[1] if ":" in m else "|") for m in args.multivalued
    )
    return parse_data_spec(
        spec,
        label=args.label,
        categorical=_columns(args.categorical),
        numeric=_columns(args.numeric),
        multivalued=multivalued or None,
    )


def _numeric_stats(source: Any, args: argparse.Namespace) -> Any:
    """The training rows' numeric statistics: from --numeric-stats PATH, or one pass."""
    from trainer.numeric import NumericStats, fit_numeric_stats

    path = Path(args.numeric_stats) if args.numeric_stats else None
    if path is not None and path.exists():
        stats = NumericStats.load(path)
        stats.check_columns(source.schema.numeric, str(path))
        if stats.transform != args.numeric_transform:
            raise ValueError(
                f"{path} holds statistics for --numeric-transform {stats.transform}, "
                f"this run asks for {args.numeric_transform}; remove the file or change the flag"
            )
        logger.info("numeric statistics from %s (%d training rows)", path, stats.rows)
        return stats
    eval_fraction = _eval_fraction(args)
    stats = fit_numeric_stats(
        source,
        args.numeric_transform,
        split="train" if eval_fraction > 0 else "all",
        eval_fraction=eval_fraction,
        max_rows=args.stats_rows or None,
        progress=not args.no_progress,
    )
    if path is not None:
        logger.info("wrote the numeric statistics to %s", stats.save(path))
    return stats


def _check_eval_schema(train: Any, evals: Any, spec: str) -> None:
    """The eval file must give the model the same columns with the same id types."""
    if evals.schema != train.schema:
        raise ValueError(
            f"--eval-data {spec}: its columns differ from --data's: "
            f"train {train.schema}, eval {evals.schema}; give both files the same "
            "column types (or declare the id type, e.g. --categorical user:string)"
        )


# What `deploy/cluster.sh up` starts for a printed cluster file: the demo cluster's
# local addresses (deploy/demo.toml), so one recipe works on a fresh machine.
LOCAL_MEMCACHED = ("127.0.0.1:21211", "127.0.0.1:21212")
LOCAL_OPTIMIZER = "http://127.0.0.1:8470"


def namespace_for(spec: str) -> str:
    """A namespace named after the data of `spec`: `csv:data/train.csv` -> "train".

    Characters a namespace cannot hold become "-"; "data" when nothing is left.
    """
    kind, _, path = spec.partition(":")
    stem = Path(path).stem if path and kind != "synthetic" else kind
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).lstrip("_.-")[:64].rstrip("-")
    return name or "data"


def tables_toml(schema: Any, *, dim: int, spec: str) -> str:
    """The `[[tables]]` entries a model over `schema` needs, as cluster-file TOML."""
    from lookup_table.core.keys import validate_name
    from lookup_table.errors import LookupTableError

    lines = [f"# the tables for the columns of {spec} (one per categorical column)"]
    groups = [("categorical", schema.categorical), ("multivalued", schema.multivalued)]
    for kind, columns in groups:
        for name, id_type in columns.items():
            try:
                validate_name(name, "table name")
            except LookupTableError as exc:
                lines.append(f"# column {name!r} cannot name a table: {exc}; rename it")
                continue
            lines += ["", "[[tables]]", f"name = {json.dumps(name)}", f"dim = {dim}"]
            lines.append(
                f'id_type = "{id_type}"' + ("  # multivalued" if kind != "categorical" else "")
            )
    return "\n".join(lines) + "\n"


def cluster_toml(schema: Any, *, dim: int, spec: str, namespace: str | None = None) -> str:
    """A complete cluster file for a model over `schema`: `deploy/cluster.sh up` starts it.

    Two local memcached nodes and one optimizer replica on the demo cluster's ports,
    async training with Adam, then the tables (`tables_toml`).

    Raises:
        ConfigError: `namespace` is not a valid namespace.
    """
    from lookup_table.core.keys import validate_name
    from lookup_table.errors import ConfigError, LookupTableError

    if namespace is None:
        namespace = namespace_for(spec)
    else:
        try:
            validate_name(namespace, "--namespace")
        except LookupTableError as exc:
            raise ConfigError(str(exc)) from None
    header = [
        f"# A cluster file for training on {spec} (lookup-table-train --print-tables).",
        "# Start it with deploy/cluster.sh up --config THIS_FILE; every key is in",
        "# docs/configuration.md. The addresses are the demo cluster's (deploy/demo.toml):",
        "# run one of the two at a time, or change the ports here.",
        f"namespace = {json.dumps(namespace)}",
        "memcached = [" + ", ".join(json.dumps(a) for a in LOCAL_MEMCACHED) + "]",
        f"optimizers = [{json.dumps(LOCAL_OPTIMIZER)}]",
        'mode = "async"  # "sync" with workers = N: N trainers step through one version',
        "",
        "[optimizer]  # of every table and the dense weights",
        'name = "adam"',
        "learning_rate = 0.001",
        "",
    ]
    return "\n".join(header) + "\n" + tables_toml(schema, dim=dim, spec=spec)


def _printed_tables(args: argparse.Namespace) -> str:
    """What --print-tables prints: a complete cluster file, or with --tables-only the tables."""
    schema = _source(args.data, args).schema
    if args.tables_only:
        if args.namespace is not None:
            raise ValueError(
                "--namespace names the cluster file's namespace, which --tables-only does "
                "not print: give one of them"
            )
        return tables_toml(schema, dim=args.dim, spec=args.data)
    return cluster_toml(schema, dim=args.dim, spec=args.data, namespace=args.namespace)


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.worker_index < args.num_workers:
        raise ValueError(
            f"--worker-index must be in 0..{args.num_workers - 1}, got {args.worker_index}"
        )
    if args.eval_data and args.eval_fraction is not None:
        raise ValueError(
            "--eval-fraction holds out part of --data; with --eval-data the whole --data "
            "file trains: give one of them"
        )
    if not 0 <= _eval_fraction(args) < 1:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.config is None:
        raise ValueError("--config is required (the cluster file), except with --print-tables")


def _eval_every(args: argparse.Namespace, source: Any, stats: Any) -> int:
    """Steps between evaluations: --eval-every, else about `_EVALS_PER_RUN` over the run."""
    if args.eval_every is not None:
        return int(args.eval_every)
    total: int | None = args.steps
    epochs = _epochs(args)
    if total is None and epochs is not None:
        rows = source.num_examples
        if rows is not None:
            rows = int(rows * (1 - _eval_fraction(args)))
        elif stats.rows and not args.stats_rows:  # the statistics pass counted them
            rows = stats.rows
        if rows:
            total = epochs * math.ceil(rows / args.num_workers / args.batch_size)
    if total is None:
        return _FALLBACK_EVAL_EVERY
    return max(1, math.ceil(total / _EVALS_PER_RUN))


class _StopOnSigint:
    """While entered: the first SIGINT (ctrl-C) asks training to stop after the step
    under way (`requested`, polled by `Trainer.fit`); a second one raises
    KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _StopOnSigint:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning(
            "interrupted: stopping after the step under way, then writing the summary "
            "(ctrl-C again to quit at once)"
        )

    def __call__(self) -> bool:
        return self.requested


def _check_save_target(path: str) -> None:
    """--save-model DIR: DIR new or empty and DIR.keras new, checked before training."""
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(
            f"--save-model {path}: it exists and is not an empty directory; give a new "
            "directory (e.g. the next version number for TF Serving: models/income/2)"
        )
    keras_file = _keras_path(path)
    if keras_file.exists():
        raise ValueError(
            f"--save-model {path}: {keras_file} (the Keras model written beside it) exists "
            "already; give a new directory or remove that file"
        )


def _keras_path(path: str) -> Path:
    target = Path(path)
    return target.with_name(target.name + ".keras")


def _save_model(config: Any, model: Any, stats: Any, path: str) -> dict[str, Any]:
    """Write the model of the raw columns as a SavedModel at `path` and a `.keras` beside.

    The rows and dense weights come from a checkpoint saved (replicas paused, so
    every row the replicas keep in memory is written first) into a temporary
    directory beside `path` and removed after.
    """
    import tempfile

    from lookup_table.keras import export_checkpoint_saved_model
    from lookup_table.ops.checkpoint import save_checkpoint
    from trainer.models import serving_model

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    raw_model = serving_model(model, stats)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        save_checkpoint(config, checkpoint, progress=False)
        keras_tmp = Path(tmp) / "model.keras"
        raw_model.save(keras_tmp)  # before the export assigns the checkpoint's weights
        result = export_checkpoint_saved_model(checkpoint, raw_model, target, dense="checkpoint")
        keras_tmp.replace(_keras_path(path))
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train as the flags say; returns the summary (with "interrupted" after a ctrl-C)."""
    _check_args(args)  # bad flags are refused before TensorFlow's import
    if args.save_model:
        _check_save_target(args.save_model)
    from lookup_table.config import load_config
    from trainer.data import DataError

    config = load_config(args.config)
    try:
        raw = _source(args.data, args)
    except DataError as exc:
        if args.eval_data and "unknown columns" in str(exc):
            _source(args.eval_data, args)  # raises too if the eval file lacks them as well
            raise DataError(
                f"{exc} (the --eval-data file has them, but the model trains on --data: "
                "a column must be in both)"
            ) from exc
        raise
    eval_raw = _source(args.eval_data, args) if args.eval_data else None
    if eval_raw is not None:
        _check_eval_schema(raw, eval_raw, args.eval_data)
    stats = _numeric_stats(raw, args)
    eval_every = _eval_every(args, raw, stats)
    source = raw.with_numeric(stats)
    train = _train_batches(source, args)
    final_eval: Iterable[Any] | None = None
    if eval_raw is not None:
        eval_source = eval_raw.with_numeric(stats)
        evals = list(
            itertools.islice(
                eval_source.batches(args.batch_size, split="all"), max(1, args.eval_batches)
            )
        )
        if not evals:
            raise DataError(f"--eval-data {args.eval_data}: the file has no examples")
        final_eval = eval_source.batches(args.batch_size, split="all")
        if not eval_every:
            evals = []  # only the whole file, at the end
    elif _eval_fraction(args) > 0:
        evals = list(
            itertools.islice(
                source.batches(args.batch_size, split="eval", eval_fraction=_eval_fraction(args)),
                args.eval_batches,
            )
        )
    else:
        evals = []
    # the data is checked first: a bad file is refused without TensorFlow's import
    from trainer.loop import Trainer
    from trainer.models import build_model

    hidden = [int(h) for h in args.hidden.split(",") if h]
    model = build_model(args.model, raw.schema, config, hidden=hidden, seed=args.seed)
    with (
        Trainer(
            config,
            model,
            worker_index=args.worker_index,
            dense_refresh_steps=args.dense_refresh_steps,
            max_pushes_in_flight=args.pushes_in_flight,
            progress=not args.no_progress,
        ) as trainer,
        _StopOnSigint() as stop,
    ):
        result = trainer.fit(
            train,
            steps=args.steps,
            eval_batches=evals or None,
            eval_every=eval_every or None,
            final_eval=final_eval,
            should_stop=stop,
        )
        created = trainer.rows_created
        version = trainer.version
    tail = [loss for _, loss in result.losses[-max(1, len(result.losses) // 10) :]]
    last_eval = result.evals[-1] if result.evals else {}
    summary = {
        "worker": args.worker_index,
        "num_workers": args.num_workers,
        "model": args.model,
        "data": args.data,
        "eval_data": args.eval_data,
        "batch_size": args.batch_size,
        "max_seconds": args.max_seconds,
        "interrupted": result.interrupted,
        "steps": result.steps,
        "examples": result.examples,
        "seconds": round(result.seconds, 3),
        "examples_per_s": round(result.examples_per_s, 1),
        "train_loss": float(sum(tail) / len(tail)) if tail else None,
        "eval_auc": last_eval.get("auc"),
        "eval_logloss": last_eval.get("logloss"),
        "eval_examples": last_eval.get("examples"),
        "eval_step": last_eval.get("step"),
        "rows_created": created,
        "final_version": version,
        "numeric_stats": stats.to_dict(),
        "history": {"losses": result.losses, "evals": result.evals, "versions": result.versions},
    }
    return {**summary, "_trained": (config, model, stats)}


def _interrupted_line(summary: Mapping[str, Any]) -> str:
    line = (
        f"interrupted after {summary['steps']} steps ({summary['examples']:,} examples, "
        f"{summary['seconds']:.1f} s)"
    )
    if summary["train_loss"] is not None:
        line += f": training loss {summary['train_loss']:.4f} (last tenth of the steps)"
    if summary["eval_auc"] is not None:
        line += (
            f", eval AUC {summary['eval_auc']:.4f} and log loss {summary['eval_logloss']:.4f} "
            f"at step {summary['eval_step']} (no final evaluation)"
        )
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; exit status 0, 1 (bad input, a failure) or 130 (ctrl-C)."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from lookup_table.errors import LookupTableError

    written: list[str] = []
    try:
        if args.print_tables:
            print(_printed_tables(args), end="")  # noqa: T201 - the CLI's result
            return 0
        summary = run(args)
        config, model, stats = summary.pop("_trained")
        brief = {k: v for k, v in summary.items() if k != "history"}
        print(json.dumps(brief, indent=2))  # noqa: T201 - the CLI's result
        if summary["interrupted"]:
            logger.warning("%s", _interrupted_line(summary))
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(summary))
            written.append(args.output)
        if args.plot:
            from trainer.plot import plot_training

            written.append(str(plot_training([summary], args.plot)))
        if args.save_model:
            saved = _save_model(config, model, stats, args.save_model)
            written += [saved["path"], str(_keras_path(args.save_model))]
            logger.info(
                "wrote the SavedModel %s (serving_default takes %s; %s) and the Keras model %s",
                saved["path"],
                ", ".join(saved["inputs"]),
                ", ".join(f"{name} {n:,} rows" for name, n in saved["tables"].items()),
                _keras_path(args.save_model),
            )
    except (LookupTableError, ValueError, FileNotFoundError) as exc:
        logger.error("lookup-table-train: %s", exc)
        return 1
    except KeyboardInterrupt:
        logger.error(
            "lookup-table-train: interrupted; %s",
            "wrote " + ", ".join(written) if written else "nothing written",
        )
        return 130
    if written:
        logger.info("wrote %s", ", ".join(written))
    return 130 if summary["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
