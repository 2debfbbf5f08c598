"""Benchmark `lookup-table-checkpoint` save and restore against the raw ceiling.

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.checkpoint            # 1,000,000 rows of dim 16, 2 nodes, 3 rounds
    python -m benchmarks.checkpoint --quick    # smoke run: 50,000 rows, 2 rounds, -m 64
"""

from __future__ import annotations

import asyncio
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from benchmarks.harness.data import SEED, spread_ids
from benchmarks.harness.options import Options
from benchmarks.harness.report import (
    lookup_table_fingerprint,
    machine_info,
    met,
    report_head,
    save,
)
from benchmarks.harness.rounds import interleaved, paired_ratio, timed
from lookup_table.config import ClusterConfig, NodeSpec, parse_config
from lookup_table.core.keys import INT_ID_BYTES, INT_ID_DIGITS, int_key_matrix, key_prefix
from lookup_table.memcached import commands
from lookup_table.memcached.protocol import Wire, build_mg, build_ms
from lookup_table.ops import checkpoint
from lookup_table.ops.localcluster import memcached_cluster
from lookup_table.store import EmbeddingStore

NODES = 2
DIM = 16
MEMORY_MB = 3072
# --quick: `lru_crawler metadump hash` (the ceiling's read, every save's enumeration and
# every clear) walks the node's whole hash table, whose size follows -m (`hashpower_for`:
# 2^24 buckets at 3 GiB, seconds a walk however few the rows). 64 MiB (2^18 buckets) holds
# the quick run's data with room to spare: at most a case's 50,000 rows and one restored
# copy live at once, ~300 bytes an item with Adam slots, ~15 MiB a node.
QUICK_MEMORY_MB = 64
CHUNK = 65_536
METHODS = ("ceiling_read", "save", "restore", "ceiling_write")
ACCEPT = 0.5
_READ = 1 << 20
_LIMIT = 1 << 22


# ---------------------------------------------------------------- raw ceiling


async def _exchange(spec: NodeSpec, request: bytes, end: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(spec.host, spec.port, limit=_LIMIT)
    try:
        writer.write(request)
        chunks: list[bytes] = []
        tail = b""
        async with asyncio.timeout(120):
            while True:
                chunk = await reader.read(_READ)
                if not chunk:
                    raise ConnectionError(f"{spec.address} closed the connection")
                chunks.append(chunk)
                tail = (tail + chunk)[-len(end) :]
                if tail == end:
                    return b"".join(chunks)
    finally:
        writer.close()


async def _pipeline(
    spec: NodeSpec, requests: list[list[Wire]], parse: Callable[[bytes, int], None]
) -> None:
    """Requests ending in `mn` (each in parts), one after the other on one connection."""
    reader, writer = await asyncio.open_connection(spec.host, spec.port, limit=_LIMIT)
    try:
        for i, request in enumerate(requests):
            for part in request:
                writer.write(part)
            chunks: list[bytes] = []
            tail = b""
            async with asyncio.timeout(60):
                while tail != b"MN\r\n":
                    chunk = await reader.read(_READ)
                    if not chunk:
                        raise ConnectionError(f"{spec.address} closed the connection")
                    chunks.append(chunk)
                    tail = (tail + chunk)[-4:]
            parse(b"".join(chunks), i)
    finally:
        writer.close()


def _kind_pattern(namespace: str, table: str, kind: str) -> re.Pattern[bytes]:
    return re.compile(
        rb"key="
        + f"{namespace}%2F{table}%2F{kind}%2F".encode()
        + rb"(i[A-Za-z0-9_-]{%d}) " % INT_ID_DIGITS
    )


async def ceiling_read(
    config: ClusterConfig, table: str, widths: dict[str, int]
) -> dict[str, tuple[NDArray[np.uint8], NDArray[np.float32]]]:
    """Per kind: (every key body, uint8 (n, INT_ID_BYTES); its value, float32 (n, width))."""
    dumps = await asyncio.gather(
        *(_exchange(s, b"lru_crawler metadump hash\r\n", b"END\r\n") for s in config.memcached)
    )
    out: dict[str, tuple[NDArray[np.uint8], NDArray[np.float32]]] = {}
    for kind, width in widths.items():
        pattern = _kind_pattern(config.namespace, table, kind)
        prefix = key_prefix(config.namespace, table, kind)
        nbytes = 4 * width
        header = np.frombuffer(b"VA %d\r\n" % nbytes, dtype=np.uint8)
        stride = header.shape[0] + nbytes + 2
        parts_bodies: list[NDArray[np.uint8]] = []
        parts_values: list[NDArray[np.float32]] = []
        jobs = []
        for spec, dump in zip(config.memcached, dumps, strict=True):
            found = pattern.findall(dump)
            bodies = np.frombuffer(b"".join(found), dtype=np.uint8).reshape(-1, INT_ID_BYTES)
            keys = np.empty((bodies.shape[0], len(prefix) + INT_ID_BYTES), dtype=np.uint8)
            keys[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
            keys[:, len(prefix) :] = bodies
            values = np.empty((bodies.shape[0], width), dtype=np.float32)
            starts = list(range(0, keys.shape[0], CHUNK))
            requests: list[list[Wire]] = [
                [build_mg(keys[s : s + CHUNK]), b"mn\r\n"] for s in starts
            ]

            def parse(
                data: bytes,
                i: int,
                values: Any = values,
                starts: list[int] = starts,
                stride: int = stride,
                header: NDArray[np.uint8] = header,
                nbytes: int = nbytes,
            ) -> None:
                m = min(CHUNK, values.shape[0] - starts[i])
                if len(data) != m * stride + 4:
                    raise RuntimeError("ceiling: a miss or an error reply")
                block = np.frombuffer(data, dtype=np.uint8, count=m * stride).reshape(m, stride)
                if not (block[:, : header.shape[0]] == header).all():
                    raise RuntimeError("ceiling: bad reply framing")
                rows = block[:, header.shape[0] : header.shape[0] + nbytes]
                values[starts[i] : starts[i] + m] = rows.view("<f4")

            jobs.append(_pipeline(spec, requests, parse))
            parts_bodies.append(bodies)
            parts_values.append(values)
        await asyncio.gather(*jobs)
        out[kind] = (np.concatenate(parts_bodies), np.concatenate(parts_values))
    return out


async def ceiling_write(
    config: ClusterConfig,
    table: str,
    ids: NDArray[np.int64],
    values: dict[str, NDArray[np.float32]],
) -> None:
    """Raw pipelined `ms` of every kind's values into `config`'s namespace."""
    from lookup_table.core.sharding import node_of

    placement = node_of(table, ids, config.node_addresses)
    jobs = []
    for j, spec in enumerate(config.memcached):
        index = np.flatnonzero(placement == j)
        requests = []
        for kind, array in values.items():
            keys = int_key_matrix(key_prefix(config.namespace, table, kind), ids[index])
            raw = np.ascontiguousarray(array[index], dtype="<f4").view(np.uint8)
            requests += [
                [build_ms(keys[s : s + CHUNK], raw[s : s + CHUNK]), b"mn\r\n"]
                for s in range(0, index.shape[0], CHUNK)
            ]

        def parse(data: bytes, i: int) -> None:
            codes = np.frombuffer(data, dtype="<u4", count=(len(data) - 4) // 4)
            if len(data) % 4 or not (codes == np.frombuffer(b"HD\r\n", "<u4")[0]).all():
                raise RuntimeError("ceiling_write: a write was refused")

        jobs.append(_pipeline(spec, requests, parse))
    await asyncio.gather(*jobs)


# ---------------------------------------------------------------- driver


def case_config(addresses: list[str], case: str) -> ClusterConfig:
    optimizer = {"name": "sgd", "learning_rate": 0.01} if case == "rows" else {"name": "adam"}
    return parse_config(
        {
            "namespace": f"ck{case}{uuid.uuid4().hex[:6]}",
            "memcached": addresses,
            "tables": [{"name": "emb", "dim": DIM, "seed": 1, "optimizer": optimizer}],
        },
        env={},
    )


def fresh(config: ClusterConfig) -> ClusterConfig:
    from dataclasses import replace

    return replace(config, namespace=config.namespace + "r" + uuid.uuid4().hex[:4])


async def fill(config: ClusterConfig, ids: NDArray[np.int64], slot_width: int) -> None:
    rng = np.random.default_rng(SEED)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        for s in range(0, ids.shape[0], 4 * CHUNK):
            part = ids[s : s + 4 * CHUNK]
            rows = rng.standard_normal((part.size, DIM), dtype=np.float32)
            slots = rng.standard_normal((part.size, slot_width), dtype=np.float32)
            await store.set("emb", part, rows, slots=slots)  # (n, 0) without slots


async def clear(config: ClusterConfig) -> None:
    """Delete every key of the namespace (untimed, between rounds)."""
    async with EmbeddingStore(config, check_sentinels=False) as store:
        found = await checkpoint.namespace_keys(store)
        for spec in config.memcached:
            keys = found[spec.address].keys(config.namespace)
            if keys:
                await commands.delete_keys(spec, config.store, keys)


async def run_case(
    addresses: list[str], case: str, n: int, rounds: int, work: Path
) -> dict[str, list[float]]:
    config = case_config(addresses, case)
    width = 2 * DIM + 1 if case == "adam" else 0
    widths = {"w": DIM + width}  # a row and its slots are one item
    ids = spread_ids(np.random.default_rng(SEED), n)
    await fill(config, ids, width)

    # warm-up: one of each, and the ceiling and the checkpoint must hold the same rows
    base = work / f"{case}-base"
    manifest = await checkpoint.save_checkpoint_async(config, base, pause=False, progress=False)
    raw = await ceiling_read(config, "emb", widths)
    table = manifest["tables"][0]
    saved_ids = np.load(base / table["files"]["ids"])
    bodies, values = raw["w"]
    got_ids = checkpoint.decode_int_bodies([bytes(b) for b in bodies])
    order = np.argsort(got_ids)
    parts = {"rows": values[order][:, :DIM], "slots": values[order][:, DIM:]}
    for name in ("rows", "slots") if width else ("rows",):
        if not (
            np.array_equal(got_ids[order], saved_ids)
            and np.array_equal(parts[name], np.load(base / table["files"][name]))
        ):
            raise RuntimeError(f"{case}: the ceiling and the checkpoint read different {name}")
    target = fresh(config)
    await checkpoint.restore_checkpoint_async(target, base, progress=False)
    await clear(target)
    target = fresh(config)
    items = np.load(base / table["files"]["rows"])
    if width:  # each row followed by its slots, as the store keeps them
        items = np.hstack([items, np.load(base / table["files"]["slots"])])
    rows_values = {"w": items}
    await ceiling_write(target, "emb", saved_ids, rows_values)
    await clear(target)

    timings: dict[str, list[float]] = {m: [] for m in METHODS}
    for r, method in interleaved(METHODS, rounds):
        if method == "ceiling_read":
            seconds = await timed(lambda: ceiling_read(config, "emb", widths))
        elif method == "save":
            out = work / f"{case}-{r}"
            seconds = await timed(
                partial(checkpoint.save_checkpoint_async, config, out, pause=False, progress=False)
            )
            shutil.rmtree(out)
        elif method == "restore":
            target = fresh(config)
            seconds = await timed(
                partial(checkpoint.restore_checkpoint_async, target, base, progress=False)
            )
            await clear(target)
        else:
            target = fresh(config)
            seconds = await timed(partial(ceiling_write, target, "emb", saved_ids, rows_values))
            await clear(target)
        timings[method].append(seconds)
        print(f"  {case} round {r + 1}/{rounds} {method}: {seconds:.2f} s", file=sys.stderr)
    await clear(config)  # the next case's dumps list only its own keys
    return timings


def summarize(timings: dict[str, list[float]], n: int) -> dict[str, Any]:
    med = {m: statistics.median(t) for m, t in timings.items()}
    rate = {m: n / s for m, s in med.items()}
    paired = {
        f"{num}/{den}": paired_ratio(timings[num], timings[den])
        for num, den in (
            ("save", "ceiling_read"),
            ("restore", "ceiling_read"),
            ("restore", "ceiling_write"),
        )
    }
    ratios = {
        "save/ceiling_read": rate["save"] / rate["ceiling_read"],
        "restore/ceiling_read": rate["restore"] / rate["ceiling_read"],
        "restore/ceiling_write": rate["restore"] / rate["ceiling_write"],
    }
    return {
        "seconds_per_round": timings,
        "median_seconds": med,
        "rows_per_s": rate,
        "ratios": ratios,
        "ratios_median_of_paired_rounds": paired,
        "acceptance": {
            f"save/ceiling_read >= {ACCEPT}": ratios["save/ceiling_read"] >= ACCEPT,
            f"restore/ceiling_read >= {ACCEPT}": ratios["restore/ceiling_read"] >= ACCEPT,
        },
    }


def render(summary: dict[str, Any], n: int, rounds: int) -> str:
    lines = [f"{n:,} rows of dim {DIM}, {NODES} nodes, median of {rounds} rounds"]
    for case, s in summary.items():
        lines.append("")
        lines.append(
            f"{case}: {'rows only (sgd, no slots)' if case == 'rows' else 'rows + Adam slots'}"
        )
        lines.append(f"  {'method':<16} {'median s':>9} {'rows/s':>11}")
        lines.extend(
            f"  {m:<16} {s['median_seconds'][m]:>9.2f} {s['rows_per_s'][m]:>11,.0f}"
            for m in METHODS
        )
        r, p = s["ratios"], s["ratios_median_of_paired_rounds"]
        for name in r:
            target = f"  target >= {ACCEPT}: " if name.endswith("ceiling_read") else ""
            verdict = met(r[name] >= ACCEPT) if target else ""
            lines.append(f"  {name:<22} {r[name]:5.2f}  (paired {p[name]:.2f}){target}{verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="50,000 rows, 2 rounds, nodes of 64 MiB")
    options.count("--rows", full=1_000_000, quick=50_000, help="rows")
    options.count("--rounds", full=3, quick=2, help="timed rounds")
    options.add_argument("--no-adam", action="store_true", help="skip the case with Adam slots")
    args = options.parse(argv)
    n, rounds = args.rows, args.rounds
    cases = ["rows"] if args.no_adam else ["rows", "adam"]
    memory_mb = QUICK_MEMORY_MB if args.quick and n <= 50_000 else MEMORY_MB
    machine = machine_info(cpu=False, nproc_usable=False)
    code = lookup_table_fingerprint()
    started = time.time()
    summary: dict[str, Any] = {}
    with (
        memcached_cluster(NODES, memory_mb=memory_mb) as servers,
        tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as work,
    ):
        addresses = [s.address for s in servers]
        for case in cases:
            timings = asyncio.run(run_case(addresses, case, n, rounds, Path(work)))
            summary[case] = summarize(timings, n)
    print(render(summary, n, rounds))
    report = {
        **report_head("checkpoint", started, machine, code),
        "parameters": {
            "rows": n,
            "dim": DIM,
            "rounds": rounds,
            "quick": args.quick,
            "nodes": NODES,
            "memcached_memory_mb": memory_mb,
            "cases": cases,
            "raw_chunk_keys": CHUNK,
            "checkpoint_batch_ids": checkpoint.DEFAULT_BATCH_IDS,
            "notes": [
                "rows/s = table rows / seconds; in the adam case each row moves 2 values",
                "save runs with pause=False (no optimizer service in this benchmark)",
                "save and restore include files, sha256 and fsync; the ceilings do not",
                "methods interleaved round by round, order rotated; gc.collect() before each",
            ],
        },
        "acceptance_targets": {"save/ceiling_read": ACCEPT, "restore/ceiling_read": ACCEPT},
        **summary,
    }
    save(report, args.out_dir, code_at_end=lookup_table_fingerprint())
    return 0


if __name__ == "__main__":
    sys.exit(main())
