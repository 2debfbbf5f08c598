"""`lookup-table-admin`: initialize a namespace on the fleet, inspect it, accept a loss.

    lookup-table-admin init   --config C        # write the sentinels (fresh cluster)
    lookup-table-admin stats  --config C [--json]
    lookup-table-admin reinit --config C --yes  # accept that a node lost its data

`init` is safe to run twice. It refuses when some nodes have a sentinel and others
do not: that is a node that lost its data, and only `reinit --yes` (or a
checkpoint restore) may accept it.
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
from lookup_table.store import EmbeddingStore

__all__ = ["init_cluster", "main", "reinit_cluster"]

logger = logging.getLogger(__name__)


async def init_cluster(config: ClusterConfig) -> dict[str, str]:
    """Write the sentinels of a fresh namespace; returns each node's state.

    Raises:
        DataLossError: some nodes have a sentinel and others lost theirs.
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


async def node_stats(config: ClusterConfig) -> dict[str, dict[str, float | int | str | bool]]:
    """Per node: items, bytes, memory limit, fill ratio, evictions, sentinel present."""
    async with EmbeddingStore(config, check_sentinels=False) as store:
        stats = await store.stats()
        sentinels = await store.sentinels()
    out: dict[str, dict[str, float | int | str | bool]] = {}
    for node, s in stats.items():
        used, limit = int(s.get("bytes", 0)), int(s.get("limit_maxbytes", 1))
        out[node] = {
            "version": s.get("version", "?"),
            "curr_items": int(s.get("curr_items", 0)),
            "bytes": used,
            "limit_maxbytes": limit,
            "fill_ratio": used / limit if limit else 0.0,
            "evictions": int(s.get("evictions", 0)),
            "sentinel": sentinels[node] is not None,
        }
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookup-table-admin", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("init", "write the data-loss sentinels of the namespace on every node"),
        ("stats", "per node: items, bytes, fill, evictions, sentinel"),
        ("reinit", "accept that nodes lost their data: write their sentinels again"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--config", required=True, help="the cluster file (TOML)")
        if name == "reinit":
            cmd.add_argument("--yes", action="store_true", help="confirm: lost rows stay lost")
        if name == "stats":
            cmd.add_argument("--json", action="store_true", help="print JSON")
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
            stats = asyncio.run(node_stats(config))
            if args.json:
                print(json.dumps(stats, indent=2))
            else:
                print(
                    f"{'node':<22} {'items':>10} {'MiB':>9} {'limit MiB':>9} {'fill':>6} "
                    f"{'evicted':>8} sentinel"
                )
                for node, s in stats.items():
                    print(
                        f"{node:<22} {s['curr_items']:>10} {int(s['bytes']) / 2**20:>9.1f} "
                        f"{int(s['limit_maxbytes']) / 2**20:>9.0f} {float(s['fill_ratio']):>6.1%} "
                        f"{s['evictions']:>8} {'yes' if s['sentinel'] else 'MISSING'}"
                    )
    except LookupTableError as exc:
        print(f"lookup-table-admin {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
