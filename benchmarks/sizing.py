"""Measure how much memcached memory a row takes, with and without Adam slots, on nodes
with memcached's own defaults and on nodes as the local cluster starts them (-C, a slab
class of the row's item size), and where each byte of a row's item goes; then the compact
rows (16-bit rows, row-wise optimizers) on such nodes, against their targets.

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.sizing            # 500,000 rows per case, dims 8, 16, 64
    python -m benchmarks.sizing --quick    # smoke run: 10,000 rows per case, -m 256
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from typing import Any

import numpy as np
from aiohttp.test_utils import TestServer
from numpy.typing import NDArray
from prometheus_client import CollectorRegistry

from benchmarks.harness.data import SEED, spread_ids
from benchmarks.harness.options import Options
from benchmarks.harness.report import (
    lookup_table_fingerprint,
    machine_info,
    report_head,
    save,
)
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, parse_config
from lookup_table.core.keys import INT_ID_BYTES, key_prefix
from lookup_table.core.keyspace import META_TABLE
from lookup_table.core.optimizers import make_optimizer
from lookup_table.core.optimizers.layout import value_bytes
from lookup_table.core.precision import check_dtype
from lookup_table.memcached import commands
from lookup_table.ops.localcluster import MemcachedProcess, memcached_cluster
from lookup_table.ops.localcluster.options import (
    CAS_BYTES,
    ITEM_HEADER_BYTES,
    item_bytes,
    row_item_bytes,
    slab_sizes,
)
from lookup_table.ops.stats import table_stats
from lookup_table.store import EmbeddingStore
from optimizer_service.app import make_app
from optimizer_service.engine.journal import JOURNAL_SLOTS

DIMS = (8, 16, 64)
OPTIMIZERS = ("sgd", "adam")
NODES = ("defaults", "compact")
"""defaults: memcached's own options (a CAS unique per item, classes 25 % apart);
compact: as the local cluster starts its nodes (-C, a slab class of the row item's size)."""
# the compact rows, measured on compact nodes: (dtype, optimizer, dim, the slab chunk per
# row each should reach, or None where there is no target)
COMPACT = (
    ("float16", "rowwise_adam", 16, 152),
    ("float16", "rowwise_adam", 64, 400),
    ("float16", "rowwise_adagrad", 16, 120),
    ("float16", "rowwise_adagrad", 64, None),
    ("bfloat16", "adam", 16, None),
    ("bfloat16", "adam", 64, None),
)
NAMESPACE = "demo"  # the key length depends on the names: see "key_bytes" in the report
TABLE = "user"
MEMORY_MB = 2048
# --quick: `table_stats` lists the keys with `lru_crawler metadump`, which walks the
# node's whole hash table, sized by -m (`hashpower_for`: 2^23 buckets at 2 GiB, ~1.5 s
# a case however few the rows). 256 MiB (2^20 buckets) holds a quick case (10,000 rows
# and the journals of its pushes) many times over; no per-row figure depends on -m.
QUICK_MEMORY_MB = 256
BATCH_IDS = 16_384
HEADROOM = 0.15
PROJECT_ROWS = 100_000_000
_PAGE = 2**20


# ---------------------------------------------------------------- measuring


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def snapshot(config: ClusterConfig, server: MemcachedProcess) -> dict[str, int]:
    """memcached's own accounting of the node, and its RSS."""
    (spec,) = config.memcached
    stats = await commands.stats(spec, config.store)
    slabs = await commands.stats(spec, config.store, "slabs")
    chunks = sum(
        int(slabs[f"{c}:chunk_size"]) * int(slabs[f"{c}:used_chunks"])
        for c in {name.split(":", 1)[0] for name in slabs if ":" in name}
    )
    if server.pid is None:
        raise RuntimeError("memcached is not running")
    return {
        "curr_items": int(stats["curr_items"]),
        "bytes": int(stats["bytes"]),
        "chunk_bytes": chunks,
        "malloced_bytes": int(slabs["total_malloced"]),
        "hash_bytes": int(stats["hash_bytes"]),
        "rss_bytes": _rss_bytes(server.pid),
        "store_no_memory": int(stats["store_no_memory"]),
        "evictions": int(stats["evictions"]),
    }


def slab_classes(slabs: dict[str, str]) -> list[dict[str, int]]:
    classes = sorted({int(name.split(":", 1)[0]) for name in slabs if ":" in name})
    return [
        {
            "class": c,
            "chunk_size": int(slabs[f"{c}:chunk_size"]),
            "chunks_per_page": int(slabs[f"{c}:chunks_per_page"]),
            "used_chunks": int(slabs[f"{c}:used_chunks"]),
            "total_pages": int(slabs[f"{c}:total_pages"]),
        }
        for c in classes
    ]


def slab_class_of(item_bytes: int, classes: list[dict[str, int]]) -> dict[str, int]:
    """The slab class memcached stores an item of `item_bytes` in.

    The smallest class whose chunk fits it; among the classes that have pages,
    which include that one (the items are there).
    """
    fits = [c for c in classes if c["chunk_size"] >= item_bytes and c["used_chunks"]]
    if not fits:
        raise RuntimeError(f"no slab class holds items of {item_bytes} bytes: {classes}")
    return min(fits, key=lambda c: c["chunk_size"])


# ---------------------------------------------------------------- one case


def case_config(address: str, dim: int, optimizer: str, dtype: str = "float32") -> ClusterConfig:
    opt = {"name": "sgd", "learning_rate": 0.01} if optimizer == "sgd" else {"name": optimizer}
    table = {"name": TABLE, "dim": dim, "seed": 1, "dtype": dtype, "optimizer": opt}
    return parse_config(
        {
            "namespace": NAMESPACE,
            "memcached": [address],
            "tables": [table],
            "store": {"timeout_s": 30.0},
        },
        env={},
    )


async def fill(
    store: EmbeddingStore, client: OptimizerClient, ids: NDArray[np.int64], dim: int
) -> None:
    """Create the rows of `ids` (lookup), then push one gradient for each (the service)."""
    rng = np.random.default_rng(SEED + dim)
    for s in range(0, ids.shape[0], BATCH_IDS):
        await store.lookup(TABLE, ids[s : s + BATCH_IDS])
    for s in range(0, ids.shape[0], BATCH_IDS):
        part = ids[s : s + BATCH_IDS]
        grads = (rng.standard_normal((part.shape[0], dim)) * 0.01).astype(np.float32)
        result = await client.push({TABLE: (part, grads)})
        if result["rows"] != part.shape[0]:
            raise RuntimeError(f"the service updated {result['rows']} of {part.shape[0]} rows")


async def run_case(
    server: MemcachedProcess,
    dim: int,
    optimizer: str,
    n: int,
    *,
    nodes: str = "defaults",
    dtype: str = "float32",
) -> dict[str, Any]:
    config = case_config(server.address, dim, optimizer, dtype)
    made = make_optimizer(config.table(TABLE).optimizer)
    slot_width = made.slot_width(dim)
    ids = spread_ids(np.random.default_rng(SEED), n)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        app = make_app(config, replica=0, registry=CollectorRegistry())
        service = TestServer(app, host="127.0.0.1")
        await service.start_server()
        try:
            served = dataclasses.replace(
                config, optimizers=(str(service.make_url("")).rstrip("/"),)
            )
            async with OptimizerClient(served) as client:
                empty = await snapshot(config, server)
                started = time.perf_counter()
                await fill(store, client, ids[: n // 2], dim)
                await client.pause(timeout_s=120)  # writes the rows written behind
                half = await snapshot(config, server)
                await client.resume()
                await fill(store, client, ids[n // 2 :], dim)
                await client.pause(timeout_s=120)
                seconds = time.perf_counter() - started
                full = await snapshot(config, server)
                await client.resume()
        finally:
            await service.close()
    stats = await table_stats(config)
    slabs = await commands.stats(config.memcached[0], config.store, "slabs")
    in_items = await commands.stats(config.memcached[0], config.store, "items")
    kinds = stats["tables"][TABLE]["kinds"]
    if kinds["rows"]["keys"] != n or set(kinds) != {"rows"}:
        raise RuntimeError(f"dim {dim} {optimizer}: expected {n} rows (with slots), got {kinds}")
    if full["store_no_memory"] or full["evictions"]:
        raise RuntimeError(f"dim {dim} {optimizer}: memcached ran out of memory: {full}")
    bookkeeping = {
        f"{name}/{kind}": k["bytes"]
        for name, t in stats["tables"].items()
        if name != TABLE
        for kind, k in t["kinds"].items()
    }
    classes = slab_classes(slabs)
    items = {"row": kinds["rows"]["bytes"] // n}  # the row and its slots: one item
    if items["row"] * n != kinds["rows"]["bytes"]:  # int ids: every key and value alike
        raise RuntimeError(f"dim {dim} {optimizer}: row items differ in size")
    held_in = {kind: slab_class_of(size, classes) for kind, size in items.items()}
    grown = {name: full[name] - empty[name] for name in empty}
    second = {name: full[name] - half[name] for name in empty}
    m_bytes = sum(_PAGE / c["chunks_per_page"] for c in held_in.values())
    per_row = {
        "item_bytes": float(sum(items.values())),
        "chunk_bytes": float(sum(c["chunk_size"] for c in held_in.values())),
        "m_bytes": m_bytes,
        "m_bytes_measured": grown["malloced_bytes"] / n,
        "m_bytes_measured_marginal": second["malloced_bytes"] / (n - n // 2),
        "rss_bytes_measured": grown["rss_bytes"] / n,
        # other items the namespace holds once everything is written (journals, done
        # records, versions), per row
        "bookkeeping_bytes": sum(bookkeeping.values()) / n,
    }
    prefix = len(key_prefix(NAMESPACE, TABLE, "w"))
    value = value_bytes(made, dim, check_dtype(dtype))
    breakdown = item_breakdown(
        key=prefix + INT_ID_BYTES,
        value=value,
        cas=nodes == "defaults",
        measured=items["row"],
        chunk=held_in["row"]["chunk_size"],
    )
    row_class = held_in["row"]["class"]
    requested = int(in_items[f"items:{row_class}:mem_requested"])  # the class's items' bytes
    if requested < breakdown["item"] * n:
        raise RuntimeError(f"dim {dim} {optimizer}: memcached's stats items disagree: {in_items}")
    pushes = -(-(n // 2) // BATCH_IDS) + -(-(n - n // 2) // BATCH_IDS)
    return {
        "dim": dim,
        "optimizer": optimizer,
        "dtype": dtype,
        "nodes": nodes,
        "memcached_args": server.command()[1:],
        "slot_width": slot_width,
        "rows": n,
        "fill_seconds": seconds,
        "key_bytes": {"row": prefix + INT_ID_BYTES},
        "value_bytes": {"row": value},
        "item_bytes": items,
        "item_breakdown": breakdown,
        "slab_class": held_in,
        "per_row": per_row,
        "bookkeeping_item_bytes": bookkeeping,
        "pushes": pushes,
        "biggest_push_ids": min(BATCH_IDS, n - n // 2),
        "journal_item_bytes_per_slot": bookkeeping.get(f"{META_TABLE}/journal", 0)
        / min(JOURNAL_SLOTS, pushes),
        "fixed_m_bytes": grown["malloced_bytes"] - m_bytes * n,
        "hash_bytes": full["hash_bytes"],
        "gib_of_m_per_100m_rows": m_bytes * PROJECT_ROWS / 2**30,
        "gib_of_m_per_100m_rows_with_headroom": m_bytes * PROJECT_ROWS * (1 + HEADROOM) / 2**30,
        "snapshots": {"empty": empty, "half": half, "full": full},
        "slab_classes": classes,
    }


def item_breakdown(*, key: int, value: int, cas: bool, measured: int, chunk: int) -> dict[str, int]:
    """Where the bytes of a row's item and its chunk go, as memcached lays an item out
    (items.c `item_make_header`): the header, the CAS unique (unless -C), the key and its
    NUL, no client flags (the store sets none), the value and its CRLF; then the chunk's
    bytes past the item. Raises if they do not add up to what memcached counts."""
    parts = {
        "header": ITEM_HEADER_BYTES,
        "cas": CAS_BYTES if cas else 0,
        "key": key,
        "key_end": 1,
        "value": value,
        "value_end": 2,
    }
    total = sum(parts.values())
    if total != measured or total != item_bytes(key, value, cas=cas):
        raise RuntimeError(f"an item of {measured} bytes is not {parts} ({total})")
    return {**parts, "item": total, "class_rounding": chunk - total, "chunk": chunk}


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compact rows as measured (chunk, -m and memcached's malloced bytes per row),
    each beside the fp32 Adam row of its dim on the same kind of node and its target."""
    base = {
        r["dim"]: r
        for r in results
        if r["nodes"] == "compact" and r["dtype"] == "float32" and r["optimizer"] == "adam"
    }
    out = []
    for dtype, optimizer, dim, target in COMPACT:
        (r,) = (
            r
            for r in results
            if r["nodes"] == "compact"
            and (r["dtype"], r["optimizer"], r["dim"]) == (dtype, optimizer, dim)
        )
        p = r["per_row"]
        fp32 = base.get(dim)
        out.append(
            {
                "option": f"{dtype} {optimizer}",
                "dtype": dtype,
                "optimizer": optimizer,
                "dim": dim,
                "nodes": r["nodes"],
                "value_bytes": r["value_bytes"]["row"],
                "item_bytes": r["item_bytes"]["row"],
                "chunk_bytes": int(p["chunk_bytes"]),
                "m_bytes": p["m_bytes"],
                "m_bytes_measured": p["m_bytes_measured"],
                "gib_of_m_per_100m_rows": r["gib_of_m_per_100m_rows"],
                "fp32_adam_chunk_bytes": int(fp32["per_row"]["chunk_bytes"]) if fp32 else None,
                "target_chunk_bytes": target,
                "met": None if target is None else p["chunk_bytes"] <= target,
            }
        )
    return out


# ---------------------------------------------------------------- report


def _table(header: list[str], rows: list[list[str]], *, left: int = 1) -> list[str]:
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        for cells in [header, *rows]
    ]


def _option(r: dict[str, Any]) -> str:
    if r["dtype"] != "float32":
        return f"{r['dtype']} {r['optimizer']}"
    return "adam (rows + slots)" if r["optimizer"] == "adam" else "sgd (rows only)"


def render(
    results: list[dict[str, Any]], n: int, memory_mb: int, compact: list[dict[str, Any]]
) -> str:
    r0 = results[0]
    lines = [
        f"{n:,} rows per case, a fresh memcached each (-M -m {memory_mb}), namespace "
        f"{NAMESPACE!r}, table {TABLE!r}: keys of {r0['key_bytes']['row']} bytes",
        "nodes: defaults = memcached's own options (a CAS unique per item, slab classes 25 % "
        "apart); compact = -C and a slab class of the row item's size",
        "",
        "bytes per row    item: memcached's item size (header + key + the row and its slots)",
        "                 chunk: the slab chunks they occupy (item rounded up to its class)",
        "                 -m: what a row takes from the -m limit (1 MiB pages / chunks per page)",
        "                 measured: growth of total_malloced / rows (all, and the second half)",
        "                 RSS: growth of the server's RSS / rows (adds the hash table)",
        "                 other: the namespace's other items once all is written, / rows",
        "",
    ]
    header = [
        "nodes",
        "dim",
        "optimizer",
        "floats",
        "item",
        "chunk",
        "-m",
        "measured",
        "2nd half",
        "RSS",
        "other",
        "fixed MiB",
        f"GiB of -m per {PROJECT_ROWS / 1e6:.0f}M rows",
        f"+{HEADROOM:.0%}",
    ]
    rows = []
    for r in results:
        p = r["per_row"]
        rows.append(
            [
                r["nodes"],
                str(r["dim"]),
                _option(r),
                str(r["dim"] + r["slot_width"]),
                f"{p['item_bytes']:.0f}",
                f"{p['chunk_bytes']:.0f}",
                f"{p['m_bytes']:.0f}",
                f"{p['m_bytes_measured']:.0f}",
                f"{p['m_bytes_measured_marginal']:.0f}",
                f"{p['rss_bytes_measured']:.0f}",
                f"{p['bookkeeping_bytes']:.1f}",
                f"{r['fixed_m_bytes'] / 2**20:.0f}",
                f"{r['gib_of_m_per_100m_rows']:.1f}",
                f"{r['gib_of_m_per_100m_rows_with_headroom']:.1f}",
            ]
        )
    lines += _table(header, rows, left=1)
    parts = ["header", "cas", "key", "key_end", "value", "value_end", "item"]
    lines += ["", "where a row's chunk goes (bytes; memcached's item layout, items.c)", ""]
    lines += _table(
        ["nodes", "dim", "optimizer", *parts, "class rounding", "chunk"],
        [
            [
                r["nodes"],
                str(r["dim"]),
                r["optimizer"],
                *(str(r["item_breakdown"][k]) for k in parts),
                str(r["item_breakdown"]["class_rounding"]),
                str(r["item_breakdown"]["chunk"]),
            ]
            for r in results
        ],
    )
    lines += [
        "",
        "the compact rows on compact nodes, measured above (stats slabs), against the targets",
        "",
    ]
    lines += _table(
        ["option", "dim", "value", "item", "chunk", "-m", "measured", "fp32 adam chunk", "target"],
        [
            [
                p["option"],
                str(p["dim"]),
                str(p["value_bytes"]),
                str(p["item_bytes"]),
                str(p["chunk_bytes"]),
                f"{p['m_bytes']:.0f}",
                f"{p['m_bytes_measured']:.0f}",
                str(p["fp32_adam_chunk_bytes"]),
                "-"
                if p["target_chunk_bytes"] is None
                else f"<= {p['target_chunk_bytes']}: {'met' if p['met'] else 'NOT MET'}",
            ]
            for p in compact
        ],
    )
    biggest = max(results, key=lambda r: r["journal_item_bytes_per_slot"])
    journal, push_ids = biggest["journal_item_bytes_per_slot"], biggest["biggest_push_ids"]
    lines += [
        "",
        f"-m per node = rows on the node x '-m' bytes x (1 + {HEADROOM:.0%} headroom) + the "
        "fixed part ('fixed MiB': the first page of each slab class,",
        f"and the journals: each replica keeps up to {JOURNAL_SLOTS} journals of pushes in "
        f"flight and those of rows not written yet in memcached, each as large as its push",
        f"(about {journal / 2**20:.1f} MiB a slot for {push_ids:,} ids at dim {biggest['dim']} "
        f"with {biggest['optimizer']}, once all is written: the empty headers), spread over the "
        "nodes). Leave RAM beyond -m for the hash table",
        "(8 bytes per bucket, 5-11 bytes per item) and connection buffers.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="10,000 rows per case, -m 256")
    options.count("--rows", full=500_000, quick=10_000, minimum=2, help="rows per case")
    args = options.parse(argv)
    n = args.rows
    memory_mb = QUICK_MEMORY_MB if args.quick and n <= 10_000 else MEMORY_MB
    machine = machine_info(cpu=False, nproc_usable=False)
    code = lookup_table_fingerprint()
    started = time.time()
    cases = [
        (nodes, dim, optimizer, "float32")
        for nodes in NODES
        for dim in DIMS
        for optimizer in OPTIMIZERS
    ] + [("compact", dim, optimizer, dtype) for dtype, optimizer, dim, _ in COMPACT]
    results = []
    for nodes, dim, optimizer, dtype in cases:
        compact = nodes == "compact"
        rows = row_item_bytes(case_config("127.0.0.1:1", dim, optimizer, dtype))
        with memcached_cluster(
            1,
            memory_mb=memory_mb,
            slab_sizes=slab_sizes(rows.values()) if compact else None,
            cas=not compact,
        ) as (server,):
            result = asyncio.run(run_case(server, dim, optimizer, n, nodes=nodes, dtype=dtype))
        print(
            f"  {nodes} nodes, dim {dim} {dtype} {optimizer}: {n:,} rows in "
            f"{result['fill_seconds']:.1f} s",
            file=sys.stderr,
        )
        results.append(result)
    measured = targets(results)
    print(render(results, n, memory_mb, measured))
    report = {
        **report_head("sizing", started, machine, code),
        "parameters": {
            "rows": n,
            "quick": args.quick,
            "dims": list(DIMS),
            "optimizers": list(OPTIMIZERS),
            "nodes": list(NODES),
            "compact": [
                {"dtype": d, "optimizer": o, "dim": dim, "target_chunk_bytes": t}
                for d, o, dim, t in COMPACT
            ],
            "namespace": NAMESPACE,
            "table": TABLE,
            "memcached_memory_mb": memory_mb,
            "memcached_nodes": 1,
            "push_batch_ids": BATCH_IDS,
            "headroom": HEADROOM,
            "project_rows": PROJECT_ROWS,
            "notes": [
                "rows created with EmbeddingStore.lookup, then one push per row through the "
                "in-process optimizer service (aiohttp TestServer, OptimizerClient.push)",
                "item bytes: memcached `stats bytes`; chunk bytes: sum of chunk_size x "
                "used_chunks; -m bytes: `stats slabs` total_malloced (1 MiB pages)",
                "per-row figures are growth over the empty node (after the sentinel) / rows; "
                "'marginal' is growth between half and full / the second half's rows",
                "fixed_m_bytes: total_malloced growth minus rows x '-m' bytes: the first page "
                "of each slab class and the journals (JOURNAL_SLOTS x the biggest push)",
                "a longer namespace or table name adds 1 byte per character per row (one "
                "key: the row and its slots are one item); that can move an item to the "
                "next slab class",
                "the half and full snapshots follow a pause of the replica, which writes "
                "the rows it holds written behind; bookkeeping_item_bytes: the other items "
                "of the namespace after the last",
                "item_breakdown: memcached's item layout (items.c item_make_header: the "
                "48-byte header, the CAS unique unless -C, key + NUL, no client flags, "
                "value + CRLF), checked against its stats bytes and stats items "
                "mem_requested; class_rounding: the chunk's bytes past the item",
                "compact: 16-bit rows (float16 with rowwise_adam, rowwise_adagrad; bfloat16 "
                "with adam), each a case of its own on compact nodes, measured as the others; "
                "targets: those cases' chunk and -m bytes per row beside their target",
            ],
        },
        "results": results,
        "targets": measured,
    }
    save(report, args.out_dir, code_at_end=lookup_table_fingerprint())
    return 0


if __name__ == "__main__":
    sys.exit(main())
