"""`lookup-table-checkpoint`: consistent checkpoints that do not depend on the node count.

    lookup-table-checkpoint save    --config C --dir D [--no-pause]
    lookup-table-checkpoint restore --config C --dir D [--force] [--no-pause]
    lookup-table-checkpoint export  --dir D --out model.npz
    lookup-table-checkpoint export  --dir D --format savedmodel --model model.keras --out DIR

The command line of `save_checkpoint`, `restore_checkpoint`, `export_checkpoint`
and `export_checkpoint_saved_model` (their modules say what each does); the only
module of the package that prints.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from lookup_table.config import load_config
from lookup_table.errors import ConfigError, LookupTableError
from lookup_table.ops.checkpoint.export import export_checkpoint
from lookup_table.ops.checkpoint.pipeline import DEFAULT_BATCH_IDS, DEFAULT_PAUSE_TIMEOUT_S
from lookup_table.ops.checkpoint.restore import restore_checkpoint
from lookup_table.ops.checkpoint.save import save_checkpoint

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lookup-table-checkpoint", description=(__doc__ or "").split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="save the namespace into a new directory")
    restore = sub.add_parser("restore", help="restore a checkpoint into the cluster file's nodes")
    export = sub.add_parser(
        "export",
        help="write ids and rows of every table into one .npz, or a model as a TF SavedModel",
    )
    for cmd in (save, restore):
        cmd.add_argument("--config", required=True, help="the cluster file (TOML)")
        cmd.add_argument("--dir", required=True, help="the checkpoint directory")
        cmd.add_argument(
            "--batch-ids",
            type=int,
            default=DEFAULT_BATCH_IDS,
            help=f"ids per pipelined batch (default {DEFAULT_BATCH_IDS})",
        )
        cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    save.add_argument(
        "--no-pause",
        action="store_true",
        help="do not pause the optimizer replicas (the checkpoint may mix versions)",
    )
    save.add_argument(
        "--pause-timeout-s",
        type=float,
        default=DEFAULT_PAUSE_TIMEOUT_S,
        help="replicas resume by themselves after this (default 3600)",
    )
    restore.add_argument(
        "--no-pause",
        action="store_true",
        help="do not pause and reload the running optimizer replicas (restart them after)",
    )
    restore.add_argument(
        "--force",
        action="store_true",
        help="delete the namespace's keys first if it already holds data",
    )
    export.add_argument("--dir", required=True, help="the checkpoint directory")
    export.add_argument(
        "--out", required=True, help="the .npz, or the SavedModel directory, to write"
    )
    export.add_argument(
        "--format",
        choices=("npz", "savedmodel"),
        default="npz",
        help="npz (default): every table's ids and rows; savedmodel: a TF SavedModel of "
        "--model that serves without lookup-table (docs/serving.md)",
    )
    export.add_argument(
        "--model", help="savedmodel: the Keras model file (model.save('model.keras'))"
    )
    export.add_argument(
        "--dense",
        choices=("checkpoint", "model"),
        default="checkpoint",
        help="savedmodel: the dense weights from the checkpoint (default) or the model file",
    )
    export.add_argument(
        "--unseen",
        choices=("initializer", "zeros"),
        default="initializer",
        help="savedmodel: what an id not in the checkpoint gets: its initial row (default) "
        "or zeros",
    )
    export.add_argument(
        "--memory-limit-bytes",
        type=int,
        default=None,
        help="savedmodel: refuse an export needing more memory (default: the memory available)",
    )
    return parser


def _export_saved_model(args: argparse.Namespace) -> None:
    import keras

    from lookup_table.keras.export import export_checkpoint_saved_model
    from lookup_table.keras.layer import DistributedEmbedding

    if not args.model:
        raise ConfigError("--format savedmodel needs --model, the Keras model file to export")
    try:
        model = keras.saving.load_model(
            args.model, custom_objects={"DistributedEmbedding": DistributedEmbedding}, compile=False
        )
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"--model {args.model}: not a Keras model file: {exc}") from exc
    result = export_checkpoint_saved_model(
        args.dir,
        model,
        args.out,
        dense=args.dense,
        unseen=args.unseen,
        memory_limit_bytes=args.memory_limit_bytes,
    )
    print(
        f"exported {args.dir} as a SavedModel to {result['path']} ({result['bytes']:,} bytes, "
        f"dense weights from the {result['dense']}): "
        + ", ".join(f"{name} {n:,} rows" for name, n in result["tables"].items())
        + f"; serving_default takes {', '.join(result['inputs'])} and returns "
        + ", ".join(result["outputs"])
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    progress = False if getattr(args, "no_progress", False) else None
    try:
        if args.command in ("save", "restore"):
            if args.batch_ids < 1:
                raise ConfigError(f"--batch-ids must be >= 1, got {args.batch_ids}")
            config = load_config(args.config)
        if args.command == "save":
            manifest = save_checkpoint(
                config,
                args.dir,
                pause=not args.no_pause,
                pause_timeout_s=args.pause_timeout_s,
                batch_ids=args.batch_ids,
                progress=progress,
            )
            rows = sum(int(t["count"]) for t in manifest["tables"])
            slots = sum(int(t["with_slots"]) for t in manifest["tables"])
            timing = manifest["timing"]
            dense = manifest["dense"]
            print(
                f"saved namespace {config.namespace!r} to {args.dir}: {rows:,} rows, "
                f"{slots:,} slots in {len(manifest['tables'])} tables, "
                f"{len(dense['params']) if dense else 0} dense params "
                f"(version {dense['version'] if dense else '-'}), "
                f"{'paused' if manifest['paused'] else 'NOT paused'}; "
                f"{timing['seconds']:.2f} s, {timing['rows_per_s']:,.0f} rows/s"
            )
        elif args.command == "restore":
            summary = restore_checkpoint(
                config,
                args.dir,
                force=args.force,
                pause=not args.no_pause,
                batch_ids=args.batch_ids,
                progress=progress,
            )
            print(
                f"restored {args.dir} into namespace {config.namespace!r} on "
                f"{len(summary['nodes'])} node(s): {summary['rows']:,} rows, "
                f"{summary['slots']:,} slots, {summary['dense_params']} dense params; "
                f"{summary['seconds']:.2f} s, {summary['rows_per_s']:,.0f} rows/s"
                + (f" (deleted {summary['deleted_keys']:,} old keys)" if args.force else "")
            )
            if summary["replicas_reloaded"]:
                print(
                    "optimizer replicas paused, reloaded and resumed: "
                    + ", ".join(summary["replicas_reloaded"])
                )
            if summary["replicas_not_running"]:
                print(
                    "optimizer replicas not reached (they load the restored version when they "
                    "start): " + ", ".join(summary["replicas_not_running"])
                )
            elif config.optimizers and args.no_pause:
                print("restart the optimizer replicas: they load their version at startup")
        elif args.format == "savedmodel":
            _export_saved_model(args)
        else:
            result = export_checkpoint(args.dir, args.out)
            print(
                f"exported {args.dir} to {result['out']} ({result['bytes']:,} bytes): "
                + ", ".join(f"{name} {n:,} rows" for name, n in result["tables"].items())
            )
    except (LookupTableError, OSError) as exc:
        print(f"lookup-table-checkpoint {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
