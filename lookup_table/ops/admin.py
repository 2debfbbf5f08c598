"""`lookup-table-admin`: initialize a namespace on the fleet, inspect it, accept a loss.

    lookup-table-admin init   --config C        # write the sentinels (fresh cluster), or
                                                # record the layouts of tables added since
    lookup-table-admin stats  --config C [--json] [--table NAME ...]
    lookup-table-admin reinit --config C --yes  # accept that a node lost its data
    lookup-table-admin reset  --config C --yes  # start the namespace over (deletes it all)

What each refuses and why: docs/operations.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.keys import encode_key
from lookup_table.core.keyspace import (
    DENSE_CURRENT_ID,
    DENSE_TABLE,
    META_TABLE,
    SENTINEL_ID,
    Kind,
    journal_id,
    layout_id,
    version_id,
)
from lookup_table.errors import (
    ConfigError,
    DataLossError,
    LookupTableError,
    ReplicaUnavailableError,
    StoreError,
)
from lookup_table.memcached import commands
from lookup_table.ops.checkpoint.listing import namespace_keys
from lookup_table.ops.checkpoint.pipeline import DEFAULT_PAUSE_TIMEOUT_S
from lookup_table.ops.stats import only_tables, render_stats, table_stats
from lookup_table.store import EmbeddingStore

__all__ = ["init_cluster", "main", "reinit_cluster", "reset_namespace"]

logger = logging.getLogger(__name__)


# ================================================================ init, reinit


async def init_cluster(config: ClusterConfig) -> dict[str, str]:
    """Write the sentinels of a fresh namespace; on an initialized one, check the stored
    layouts of its tables and record those of tables its sentinels do not record (added
    to the cluster file since), as their first use would. Returns each node's state.

    Raises:
        DataLossError: some nodes have a sentinel and others lost theirs.
        StorageFormatError: the namespace holds another storage format's data, or a table
            in another layout than the cluster file's (nothing is written).
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
        recorded = await store.record_layouts()
    states = {}
    for node in present:
        state = "initialized" if written.get(node) else "already initialized"
        if recorded.get(node):
            tables = ", ".join(repr(t) for t in recorded[node])
            state += f"; recorded the stored layout of tables added since: {tables}"
        states[node] = state
    return states


async def reinit_cluster(config: ClusterConfig) -> dict[str, str]:
    """Write the sentinel on every node that lacks one (accepting lost rows)."""
    async with EmbeddingStore(config, check_sentinels=False) as store:
        present = await store.sentinels()
        missing = [node for node, value in present.items() if value is None]
        written = await store.write_sentinels(missing) if missing else {}
    return {node: ("re-initialized" if written.get(node) else "ok") for node in present}


# ================================================================ reset

_RESET_ROUNDS = 8  # listings until two in a row find nothing left
_RELIST_S = 0.2  # between them: memcached relinks the items read last in the background
# optimizer_service.engine.journal.MAX_JOURNAL_SLOTS (lookup_table does not import the service)
_JOURNAL_SLOTS_AT_MOST = 64


async def reset_namespace(
    config: ClusterConfig, *, replicas_stopped: bool = False
) -> dict[str, Any]:
    """Start the namespace of `config` over: delete every key of it on every node, write
    fresh sentinels, and make the running replicas forget what they hold of it.

    The replicas are paused first (a plain pause, which loses nothing if the reset stops
    there), then told to drop what they have not written (rows written behind, replays
    of failed writes, a dense flush under way), and resumed with a reload once the
    namespace is empty: they serve version 0 and read rows and dense parameters afresh.
    The sentinels go first, so a trainer that reads meanwhile gets DataLossError instead
    of rows of a half-deleted model. Stop the trainers before a reset.

    Returns `{"namespace", "deleted": {table: {kind label: keys}}, "deleted_keys",
    "nodes": {address: keys}, "sentinels", "replicas_reloaded", "replicas_not_running"}`.

    Raises:
        ReplicaUnavailableError: a replica does not answer and `replicas_stopped` is
            false (nothing was deleted).
        ConfigError: a replica of the cluster file serves another namespace or partition
            (nothing was deleted).
        StoreError, NodeUnavailableError: memcached failed part-way; the namespace may be
            left without sentinels (trainers get DataLossError): run the reset again.
    """
    ns = config.namespace
    client = OptimizerClient(config, max_retries=1, backoff_s=0.2) if config.optimizers else None
    told: list[int] = []
    down: list[str] = []
    try:
        if client is not None:
            down = await _check_replicas(client, config)
            if down and not replicas_stopped:
                raise ReplicaUnavailableError(
                    f"optimizer replicas {', '.join(down)} do not answer, so they cannot be "
                    f"told to drop what they hold of namespace {ns!r}: a running replica "
                    f"would write its rows and dense parameters back after the reset. Start "
                    f"them (deploy/cluster.sh up) and reset again, or, if they are stopped, "
                    f"pass --replicas-stopped (a replica reads the empty namespace when it "
                    f"starts). Nothing was deleted"
                )
            live = [k for k, url in enumerate(config.optimizers) if url not in down]
            for k in live:  # a plain pause first: if one refuses, nothing is lost
                await client.pause(timeout_s=DEFAULT_PAUSE_TIMEOUT_S, replicas=[k])
                told.append(k)
            if told:
                await client.pause(
                    timeout_s=DEFAULT_PAUSE_TIMEOUT_S, replicas=told, drop_unfinished=True
                )
        deleted, per_node = await _delete_namespace(config)
        async with EmbeddingStore(config, check_sentinels=False) as store:
            written = await store.write_sentinels()
        if client is not None and told:
            await client.resume(reload=True, replicas=told)
            told = []
    finally:
        if client is not None:
            if told:  # failed before the reset was done: let them go (they auto-resume)
                try:
                    await client.resume(replicas=told)
                except LookupTableError as exc:
                    logger.warning("could not resume replicas %s: %s", told, exc)
            await client.close()
    return {
        "namespace": ns,
        "deleted": deleted,
        "deleted_keys": sum(per_node.values()),
        "nodes": per_node,
        "sentinels": written,
        "replicas_reloaded": [url for url in config.optimizers if url not in down],
        "replicas_not_running": down,
    }


async def _check_replicas(client: OptimizerClient, config: ClusterConfig) -> list[str]:
    """The replicas that do not answer; ConfigError if one answers for another namespace
    or partition (the cluster file's `optimizers` points at another cluster's replica)."""
    down = []
    for k, url in enumerate(config.optimizers):
        try:
            doc = await client.tables(replica=k)
        except ReplicaUnavailableError:
            down.append(url)
            continue
        if doc.get("namespace") != config.namespace or doc.get("replica") != k:
            raise ConfigError(
                f"optimizer replica {k} ({url}) serves namespace {doc.get('namespace')!r} as "
                f"replica {doc.get('replica')}, not namespace {config.namespace!r} as replica "
                f"{k}: `optimizers` of the cluster file points at another cluster's replica "
                f"(deploy/cluster.sh status shows it); fix the file or stop that replica. "
                f"Nothing was deleted"
            )
    return down


def _kind_label(kind: str) -> str:
    try:
        return Kind(kind).label
    except ValueError:  # a kind this version does not write (an older format's)
        return kind


async def _delete_namespace(
    config: ClusterConfig,
) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Delete the bookkeeping keys a namespace continues from, then every key a listing
    finds, until two listings in a row find none. Returns the keys deleted per table and
    kind label, and per node."""
    ns = config.namespace
    deleted: dict[str, dict[str, int]] = {}
    per_node = {spec.address: 0 for spec in config.memcached}

    def count(table: str, kind: str, n: int) -> None:
        by_kind = deleted.setdefault(table, {})
        label = _kind_label(kind)
        by_kind[label] = by_kind.get(label, 0) + n

    # the keys that make a namespace continue are deleted by name first, on every node,
    # so that a reset stopped halfway leaves no namespace to continue from: the sentinels
    # (trainers reading meanwhile get DataLossError), the versions, the dense
    # parameters' pointer, the journal headers (a replica's start replays what they list);
    # and the tables' layout records, which a namespace started over must not inherit
    replicas = range(max(len(config.optimizers), 1))
    known = [
        (META_TABLE, Kind.META, [SENTINEL_ID]),
        (META_TABLE, Kind.META, [layout_id(t.name) for t in config.tables]),
        (META_TABLE, Kind.META, [version_id(k) for k in replicas]),
        (DENSE_TABLE, Kind.META, [DENSE_CURRENT_ID]),
        (
            META_TABLE,
            Kind.JOURNAL,
            [journal_id(k, slot) for k in replicas for slot in range(_JOURNAL_SLOTS_AT_MOST)],
        ),
    ]
    for book, book_kind, names in known:
        keys = [encode_key(ns, book, book_kind, name) for name in names]
        for spec in config.memcached:
            gone = await commands.delete_keys(spec, config.store, keys)
            per_node[spec.address] += gone
            if gone:
                count(book, book_kind, gone)
    async with EmbeddingStore(config, check_sentinels=False) as store:
        empty = 0
        for _ in range(_RESET_ROUNDS):
            dumps = await namespace_keys(store)
            if not any(found.count for found in dumps.values()):
                # twice in a row: nothing wrote to the namespace in between
                empty += 1
                if empty == 2:
                    return deleted, per_node
                await asyncio.sleep(_RELIST_S)
                continue
            empty = 0
            for spec in config.memcached:
                found = dumps[spec.address]
                if not found.count:
                    continue
                per_node[spec.address] += await commands.delete_keys(
                    spec, config.store, found.keys(ns)
                )
                for (table, kind), ids in found.int_ids.items():
                    count(table, kind, int(ids.shape[0]))
                for (table, kind), bodies in found.bodies.items():
                    count(table, kind, len(bodies))
    raise StoreError(
        f"namespace {ns!r} still holds keys after {_RESET_ROUNDS} rounds of deleting: "
        f"something writes to it (trainers, replicas of another cluster file?); stop it "
        f"and run the reset again"
    )


# ================================================================ command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookup-table-admin", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        (
            "init",
            "write the data-loss sentinels of the namespace on every node; on an "
            "initialized namespace, record the stored layout of tables added since",
        ),
        (
            "stats",
            "per table: keys and bytes per node and in total (rows, slots, bookkeeping); "
            "per node: items, bytes, memory limit, fill, evictions, sentinel. "
            "Exit 1 when a node is down or lacks its sentinel.",
        ),
        ("reinit", "accept that nodes lost their data: write their sentinels again"),
        (
            "reset",
            "start the namespace over: delete every row, slot, dense parameter, version "
            "and journal of it on every node, write fresh sentinels, and make the running "
            "replicas drop what they hold of it",
        ),
    ):
        cmd = sub.add_parser(name, help=text.split(";")[0], description=text)
        cmd.add_argument("--config", required=True, help="the cluster file (TOML)")
        if name == "reinit":
            cmd.add_argument("--yes", action="store_true", help="confirm: lost rows stay lost")
        if name == "reset":
            cmd.add_argument(
                "--yes", action="store_true", help="confirm: the namespace's model is deleted"
            )
            cmd.add_argument(
                "--replicas-stopped",
                action="store_true",
                help="reset although replicas do not answer: they are stopped (they read "
                "the empty namespace when they start)",
            )
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


def _render_reset(summary: dict[str, Any]) -> str:
    lines = [f"namespace {summary['namespace']!r} reset: {summary['deleted_keys']} keys deleted"]
    for table, kinds in sorted(summary["deleted"].items()):
        what = ", ".join(f"{n} {label}" for label, n in sorted(kinds.items()))
        lines.append(f"  {table}: {sum(kinds.values())} keys ({what})")
    for node, n in summary["nodes"].items():
        lines.append(f"  node {node}: {n} keys deleted, sentinel written")
    lines += [
        f"  replica {url}: dropped what it held, serves version 0"
        for url in summary["replicas_reloaded"]
    ]
    lines += [
        f"  replica {url}: not running (it reads the empty namespace when it starts)"
        for url in summary["replicas_not_running"]
    ]
    return "\n".join(lines)


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
        elif args.command == "reset":
            if not args.yes:
                print(
                    f"reset deletes the whole model of namespace {config.namespace!r} (every "
                    f"row, slot, dense parameter, version and journal on every node of "
                    f"{args.config}) and cannot be undone; save a checkpoint first if you "
                    f"may want it back (lookup-table-checkpoint save), then rerun with --yes",
                    file=sys.stderr,
                )
                return 2
            summary = asyncio.run(reset_namespace(config, replicas_stopped=args.replicas_stopped))
            print(_render_reset(summary))
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
