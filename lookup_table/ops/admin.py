"""`lookup-table-admin`: initialize a namespace on the fleet, inspect it, accept a loss.

    lookup-table-admin init   --config C        # write the sentinels (fresh cluster)
    lookup-table-admin stats  --config C [--json] [--table NAME ...]
    lookup-table-admin reinit --config C --yes  # accept that a node lost its data

`init` is safe to run twice. It refuses when some nodes have a sentinel and others
do not: that is a node that lost its data, and only `reinit --yes` (or a
checkpoint restore) may accept it.

`stats` (`lookup_table.ops.stats`) lists every key of the namespace on every node
(memcached's `lru_crawler metadump hash`, as a checkpoint does) and sums the keys
and their bytes per table and kind, per node and in total, next to each whole
node's figures. A node that does not answer is reported as DOWN (the others are
still listed), and a missing sentinel is flagged; either makes `stats` exit 1, so
it can serve as a health check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence

from lookup_table.config import ClusterConfig, load_config
from lookup_table.errors import DataLossError, LookupTableError
from lookup_table.ops.stats import only_tables, render_stats, table_stats
from lookup_table.store import EmbeddingStore

__all__ = ["init_cluster", "main", "reinit_cluster"]

logger = logging.getLogger(__name__)


# ================================================================ init, reinit


async def init_cluster(config: ClusterConfig) -> dict[str, str]:
    """Write the sentinels of a fresh namespace; returns each node's state.

    Raises:
        DataLossError: some nodes have a sentinel and others lost theirs.
        StorageFormatError: the namespace holds another storage format's data.
    """
    async with EmbeddingStore(config, check_sentinels=False) as store:
        present = await store.sentinels()
        missing = [node for node, value in present.items() if value is None]
        if missing and len(missing) < len(present):
            raise DataLossError(
                f"memcached nodes {', '.join(missing)} have no sentinel for namespace "
                f"{config.namespace!r} while the others do: they lost their data. Restore a "
                f"checkpoint (lookup-table-checkpoint restore) or accept the loss with "
                f"`lookup-table-admin reinit --yes`",
                nodes=tuple(missing),
            )
        for node, value in present.items():
            if value is not None:  # an older version's namespace: say so, write nothing
                store.check_format(node, value)
        written = await store.write_sentinels(missing) if missing else {}
    return {
        node: ("initialized" if written.get(node) else "already initialized") for node in present
    }


async def reinit_cluster(config: ClusterConfig) -> dict[str, str]:
    """Write the sentinel on every node that lacks one (accepting lost rows)."""
    async with EmbeddingStore(config, check_sentinels=False) as store:
        present = await store.sentinels()
        missing = [node for node, value in present.items() if value is None]
        written = await store.write_sentinels(missing) if missing else {}
    return {node: ("re-initialized" if written.get(node) else "ok") for node in present}


# ================================================================ command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookup-table-admin", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("init", "write the data-loss sentinels of the namespace on every node"),
        (
            "stats",
            "per table: keys and bytes per node and in total (rows, slots, bookkeeping); "
            "per node: items, bytes, memory limit, fill, evictions, sentinel. "
            "Exit 1 when a node is down or lacks its sentinel.",
        ),
        ("reinit", "accept that nodes lost their data: write their sentinels again"),
    ):
        cmd = sub.add_parser(name, help=text.split(";")[0], description=text)
        cmd.add_argument("--config", required=True, help="the cluster file (TOML)")
        if name == "reinit":
            cmd.add_argument("--yes", action="store_true", help="confirm: lost rows stay lost")
        if name == "stats":
            cmd.add_argument("--json", action="store_true", help="print JSON (for scripts)")
            cmd.add_argument(
                "--table",
                action="append",
                default=[],
                metavar="NAME",
                help="only this table (repeatable; _meta and _dense are the bookkeeping)",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        if args.command == "init":
            for node, state in asyncio.run(init_cluster(config)).items():
                print(f"{node}: {state} (namespace {config.namespace!r})")
        elif args.command == "reinit":
            if not args.yes:
                print(
                    "reinit accepts that rows on nodes without a sentinel are lost for good; "
                    "rerun with --yes to confirm, or restore a checkpoint instead",
                    file=sys.stderr,
                )
                return 2
            for node, state in asyncio.run(reinit_cluster(config)).items():
                print(f"{node}: {state}")
        elif args.command == "stats":
            report = asyncio.run(table_stats(config))
            if args.table:
                report = only_tables(report, args.table)
            print(json.dumps(report, indent=2) if args.json else render_stats(report))
            for problem in report["problems"]:
                print(f"lookup-table-admin stats: {problem}", file=sys.stderr)
            return 1 if report["problems"] else 0
    except LookupTableError as exc:
        print(f"lookup-table-admin {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
