"""Benchmark a gradient push through the optimizer service against the bare in-process update.

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.optimizer            # 15 rounds, 16,384 ids per push
    python -m benchmarks.optimizer --quick    # smoke run: 3 rounds, 4,096 ids
    python -m benchmarks.optimizer --py-spy   # also profile the service (pip install py-spy)
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from benchmarks.harness import pyspy
from benchmarks.harness.cluster import service_process, to_toml
from benchmarks.harness.cpu import machine_busy_s
from benchmarks.harness.data import SEED, unique_id_blocks
from benchmarks.harness.options import Options
from benchmarks.harness.plot import plot_rates
from benchmarks.harness.report import (
    code_fingerprint,
    fmt_rate,
    machine_info,
    met,
    report_head,
    save,
)
from benchmarks.harness.rounds import Timings, interleaved, paired_ratio, timed
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.optimizers import Optimizer, make_optimizer
from lookup_table.ops.localcluster import free_port, memcached_cluster
from lookup_table.store import EmbeddingStore, TableWrite
from optimizer_service.malloc import tune_malloc

DIMS = (16, 64)
NODES = 2
MEMORY_MB = 1024
GRAD_SCALE = 0.01
METHODS = ("http", "inprocess")
LABELS = {
    "http": "OptimizerClient.push -> service (HTTP)",
    "inprocess": "in-process get_many + Adam + set_many",
}
ACCEPT_HTTP_VS_INPROCESS = 0.8  # the HTTP path keeps at least 80 % of in-process speed
OTHER_CPU_WARNING = 0.10
PACKAGES = ("lookup_table", "optimizer_service")  # whose source files `code` hashes


# ---------------------------------------------------------------- the cluster file


def cluster_file(addresses: list[str], port: int, cache_mb: int = 0) -> dict[str, Any]:
    return {
        "namespace": "bench" + uuid.uuid4().hex[:8],
        "memcached": addresses,
        "optimizers": [f"http://127.0.0.1:{port}"],
        "token": uuid.uuid4().hex,  # auth on, as in a deployment
        # the row cache off by default: every round pushes the same ids, which a cache
        # would serve without the reads the in-process baseline makes (--cache-mb)
        "service": {"cache_mb": cache_mb},
        "tables": [
            {"name": f"emb{d}", "dim": d, "seed": d, "optimizer": {"name": "adam"}} for d in DIMS
        ],
    }


# ---------------------------------------------------------------- the service's figures


_SUM_RE = re.compile(r"^lookup_table_push_latency_seconds_sum (\S+)$", re.M)
_COUNT_RE = re.compile(r"^lookup_table_push_latency_seconds_count (\S+)$", re.M)


async def apply_latency(client: OptimizerClient, base_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the service's push latency histogram (inside `apply`)."""
    session = client._get_session()  # the client's one session; /metrics needs no token
    async with session.get(base_url + "/metrics") as resp:
        text = await resp.text()
    total, count = _SUM_RE.search(text), _COUNT_RE.search(text)
    if total is None or count is None:
        raise RuntimeError("the service's /metrics has no lookup_table_push_latency_seconds")
    return float(total.group(1)), float(count.group(1))


PY_SPY_RATE_HZ = 250


async def profile_pushes(
    client: OptimizerClient,
    table: str,
    ids: NDArray[np.int64],
    grads: list[NDArray[np.float32]],
    *,
    pid: int,
    out_path: Path,
) -> dict[str, Any]:
    """Extra HTTP pushes (after the timed rounds) under `py-spy record` of the service.

    Writes py-spy's raw collapsed stacks (one `frame;frame;... count` line per
    stack, `--threads --idle`) to `out_path` and returns, per push, the busy time of
    the service's event-loop thread by project function (inclusive).
    """
    spy = pyspy.record(pid, out_path, rate_hz=PY_SPY_RATE_HZ, flag="--py-spy")
    await asyncio.sleep(1.0)  # let it attach
    try:
        for g in grads:
            await client.push({table: (ids, g)})
    finally:
        await asyncio.to_thread(pyspy.stop, spy)
    return await asyncio.to_thread(
        pyspy.main_thread_per_push, out_path, pushes=len(grads), rate_hz=PY_SPY_RATE_HZ
    )


# ---------------------------------------------------------------- the in-process baseline


async def inprocess_update(
    store: EmbeddingStore,
    optimizer: Optimizer,
    table: str,
    ids: NDArray[np.int64],
    grads: NDArray[np.float32],
    *,
    dim: int,
) -> None:
    """Read rows + slots (one item each), one Adam step, write both back: nothing else."""
    items, _ = await store.get(table, ids, unique=True, slots=True)
    new_rows, new_slots = optimizer.update(items[:, :dim], grads, items[:, dim:])
    await store.set_many([TableWrite(table, ids, new_rows, slots=new_slots)])


# ---------------------------------------------------------------- driver


@dataclass(slots=True)
class PushTimings(Timings):
    """Seconds per round for each method, the service's own time and its profile."""

    service_apply: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] | None = None


async def check_service_update(
    store: EmbeddingStore,
    client: OptimizerClient,
    optimizer: Optimizer,
    table: str,
    ids: NDArray[np.int64],
    grads: NDArray[np.float32],
    dim: int,
) -> None:
    """One untimed push: the service must write exactly `optimizer.update` of what it read."""
    items, found = await store.get(table, ids, unique=True, slots=True)
    if not found.all():
        raise RuntimeError(f"dim {dim}: rows missing after store.lookup created them")
    want_rows, want_slots = optimizer.update(items[:, :dim], grads, items[:, dim:])
    result = await client.push({table: (ids, grads)})
    if not result["applied"] or result["rows"] != ids.shape[0]:
        raise RuntimeError(f"dim {dim}: the service did not apply the warm-up push: {result}")
    got, _ = await store.get(table, ids, unique=True, slots=True)
    got_rows, got_slots = got[:, :dim], got[:, dim:]
    if not (np.array_equal(got_rows, want_rows) and np.array_equal(got_slots, want_slots)):
        raise RuntimeError(f"dim {dim}: the service's Adam update differs from optimizer.update")


async def bench_dim(
    store: EmbeddingStore,
    client: OptimizerClient,
    base_url: str,
    *,
    table: str,
    dim: int,
    ids: NDArray[np.int64],
    rounds: int,
    rng: np.random.Generator,
    service_pid: int,
    py_spy_dir: Path | None = None,
) -> PushTimings:
    optimizer = make_optimizer(store.config.table(table).optimizer)
    await store.lookup(table, ids)  # the rows exist before any push

    def grads() -> NDArray[np.float32]:
        return (rng.standard_normal((ids.shape[0], dim), dtype=np.float32) * GRAD_SCALE).astype(
            np.float32
        )

    # Warm-up (untimed): connections, the service's first push, slots created; checks.
    await check_service_update(store, client, optimizer, table, ids, grads(), dim)
    await inprocess_update(store, optimizer, table, ids, grads(), dim=dim)
    await client.push({table: (ids, grads())})

    per_round = [{m: grads() for m in METHODS} for _ in range(rounds)]
    timings = PushTimings()
    sum0, count0 = await apply_latency(client, base_url)
    for r, method in interleaved(METHODS, rounds, f"dim {dim}"):
        g = per_round[r][method]
        if method == "http":

            async def call(g: NDArray[np.float32] = g) -> None:
                result = await client.push({table: (ids, g)})
                if not result["applied"]:
                    raise RuntimeError(f"dim {dim}: push not applied: {result}")

        else:

            async def call(g: NDArray[np.float32] = g) -> None:
                await inprocess_update(store, optimizer, table, ids, g, dim=dim)

        timings.add(method, await timed(call))
    sum1, count1 = await apply_latency(client, base_url)
    if count1 - count0 != rounds:
        raise RuntimeError(f"dim {dim}: the service counted {count1 - count0} pushes, not {rounds}")
    timings.service_apply = {"mean_seconds": (sum1 - sum0) / rounds, "pushes": count1 - count0}
    if py_spy_dir is not None:  # after the timed rounds: sampling slows the service down
        timings.profile = await profile_pushes(
            client,
            table,
            ids,
            [grads() for _ in range(rounds)],
            pid=service_pid,
            out_path=py_spy_dir / f"optimizer-service-dim{dim}.pyspy.txt",
        )
    return timings


async def run_cluster(
    config: ClusterConfig,
    *,
    n_ids: int,
    rounds: int,
    service_pid: int,
    py_spy_dir: Path | None = None,
) -> dict[str, PushTimings]:
    rng = np.random.default_rng(SEED)
    (ids,) = unique_id_blocks(rng, 1, n_ids)
    results: dict[str, PushTimings] = {}
    base_url = config.optimizers[0]
    async with EmbeddingStore(config) as store, OptimizerClient(config) as client:
        for dim in DIMS:
            results[f"dim{dim}"] = await bench_dim(
                store,
                client,
                base_url,
                table=f"emb{dim}",
                dim=dim,
                ids=ids,
                rounds=rounds,
                rng=rng,
                service_pid=service_pid,
                py_spy_dir=py_spy_dir,
            )
    return results


async def write_sentinels(config: ClusterConfig) -> None:
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()


# ---------------------------------------------------------------- reporting


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, CPU s busy on the whole machine, CPU s of this process and its reaped children).

    Other processes' share of the run, (busy - ours) / (wall * nproc), says how
    much the figures were disturbed (they vary 15-30% between runs anyway).
    """
    busy = machine_busy_s()
    ours = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return time.monotonic(), busy, ours


def foreign_cpu(
    start: tuple[float, float, float], end: tuple[float, float, float]
) -> dict[str, Any]:
    wall, busy, ours = (e - s for s, e in zip(start, end, strict=True))
    cpus = os.cpu_count() or 1
    other = max(busy - ours, 0.0)
    return {
        "wall_s": wall,
        "machine_busy_cpu_s": busy,
        "benchmark_cpu_s": ours,
        "other_processes_cpu_s": other,
        "other_processes_share": other / (wall * cpus) if wall > 0 else float("nan"),
        "note": "benchmark = this process, the service and memcached; other = the rest of "
        "the machine, as a share of all CPUs over the run",
    }


def summarize(results: dict[str, PushTimings], n_ids: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for dim in DIMS:
        t = results[f"dim{dim}"]
        med = {m: t.median(m) for m in METHODS}
        rate = {m: n_ids / med[m] for m in METHODS}
        ratio = rate["http"] / rate["inprocess"]
        paired = paired_ratio(t.rounds["http"], t.rounds["inprocess"])
        mean_http = statistics.fmean(t.rounds["http"])
        inside = t.service_apply["mean_seconds"]
        summary[f"dim{dim}"] = {
            "seconds_per_round": t.rounds,
            "median_seconds": med,
            "rows_per_s": rate,
            "ratio_http_vs_inprocess": ratio,
            "ratio_median_of_paired_rounds": paired,
            "http_split_mean_seconds": {
                "total": mean_http,
                "inside_apply": inside,
                "outside_apply": mean_http - inside,
                "note": "inside_apply: the service's push latency histogram (Updater.apply); "
                "outside: client encoding + HTTP + unpack + parse_push",
            },
            **({"service_profile": t.profile} if t.profile is not None else {}),
            "acceptance": {
                f"http/inprocess >= {ACCEPT_HTTP_VS_INPROCESS}": ratio >= ACCEPT_HTTP_VS_INPROCESS
            },
        }
    return summary


def render_table(summary: dict[str, Any], n_ids: int, rounds: int) -> str:
    lines = [
        f"Adam push of {n_ids:,} unique int64 ids, 2 memcached nodes, median of {rounds} rounds"
    ]
    for dim in DIMS:
        s = summary[f"dim{dim}"]
        lines.append("")
        lines.append(f"dim {dim}")
        lines.append(f"  {'method':<40} {'median ms':>10} {'rows/s':>9}")
        lines.extend(
            f"  {LABELS[m]:<40} {s['median_seconds'][m] * 1e3:>10.1f} "
            f"{fmt_rate(s['rows_per_s'][m]):>9}"
            for m in METHODS
        )
        split = s["http_split_mean_seconds"]
        ok = s["acceptance"][f"http/inprocess >= {ACCEPT_HTTP_VS_INPROCESS}"]
        lines.append(
            f"  http/inprocess {s['ratio_http_vs_inprocess']:.3f}  "
            f"(paired {s['ratio_median_of_paired_rounds']:.3f})  "
            f"target >= {ACCEPT_HTTP_VS_INPROCESS}: {met(ok)}"
        )
        lines.append(
            f"  http mean {split['total'] * 1e3:.1f} ms = inside Updater.apply "
            f"{split['inside_apply'] * 1e3:.1f} ms + outside (client, HTTP, parse_push) "
            f"{split['outside_apply'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path, *, n_ids: int, rounds: int) -> None:
    plot_rates(
        summary,
        path,
        methods=METHODS,
        labels=LABELS,
        dims=DIMS,
        xticks=[
            f"dim {d}\nhttp/inprocess = {summary[f'dim{d}']['ratio_http_vs_inprocess']:.2f}"
            for d in DIMS
        ],
        ylabel="thousand rows/s updated (median)",
        title=f"Adam push of {n_ids:,} rows, 2 memcached nodes, median of {rounds} rounds",
    )


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="3 rounds of 4,096 ids (unless given)")
    options.count("--rounds", full=15, quick=3, help="timed rounds")
    options.count("--ids", full=16384, quick=4096, help="ids per push")
    options.add_argument(
        "--cache-mb",
        type=int,
        default=0,
        help="the service's row cache (service.cache_mb; default 0: off, a fair baseline)",
    )
    options.add_argument(
        "--py-spy",
        action="store_true",
        help="after the timed rounds, profile `rounds` more HTTP pushes per dim with py-spy "
        "attached to the service (pip install py-spy); raw stacks go to the out dir",
    )
    args = options.parse(argv)
    import aiohttp
    import msgpack

    # the in-process baseline gets the service's malloc policy too (not its periodic
    # trim): with glibc's own, its blocks are faulted in again whenever free() gives the
    # heap's top back, which would flatter the service
    baseline_malloc = "service policy (tune_malloc)" if tune_malloc() else "glibc default"

    machine = machine_info(
        {"aiohttp": aiohttp.__version__, "msgpack": ".".join(map(str, msgpack.version))}
    )
    code = code_fingerprint(PACKAGES)
    started = time.time()
    cpu_start = cpu_snapshot()
    with (
        tempfile.TemporaryDirectory(prefix="bench-optimizer-") as tmp,
        memcached_cluster(NODES, memory_mb=MEMORY_MB) as servers,
    ):
        port = free_port()
        config_path = Path(tmp) / "cluster.toml"
        config_path.write_text(
            to_toml(cluster_file([s.address for s in servers], port, args.cache_mb))
        )
        config = load_config(config_path)  # exactly what the service reads
        asyncio.run(write_sentinels(config))
        with service_process(config_path, port, Path(tmp) / "service.log") as service_pid:
            if args.py_spy:
                args.out_dir.mkdir(parents=True, exist_ok=True)
            results = asyncio.run(
                run_cluster(
                    config,
                    n_ids=args.ids,
                    rounds=args.rounds,
                    service_pid=service_pid,
                    py_spy_dir=args.out_dir if args.py_spy else None,
                )
            )
    cpu = foreign_cpu(cpu_start, cpu_snapshot())
    machine["loadavg_at_end"] = list(os.getloadavg())
    machine["cpu_during_run"] = cpu
    summary = summarize(results, args.ids)
    print(render_table(summary, args.ids, args.rounds))
    print(
        f"\nother processes used {cpu['other_processes_share']:.0%} of the machine's CPUs "
        f"during the run"
    )
    if cpu["other_processes_share"] > OTHER_CPU_WARNING:
        print(
            f"warning: other processes used {cpu['other_processes_share']:.0%} of the CPUs "
            f"during the run ({cpu['other_processes_cpu_s']:.1f} CPU s): the figures are "
            f"disturbed; rerun on a quiet machine",
            file=sys.stderr,
        )

    report = {
        **report_head("optimizer", started, machine, code),
        "parameters": {
            "rounds": args.rounds,
            "ids_per_push": args.ids,
            "quick": args.quick,
            "py_spy": args.py_spy,
            "cache_mb": args.cache_mb,
            "dims": list(DIMS),
            "optimizer": "adam (Keras defaults: learning_rate 0.001, beta_1 0.9, "
            "beta_2 0.999, epsilon 1e-7)",
            "nodes": NODES,
            "replicas": 1,
            "memcached_memory_mb": MEMORY_MB,
            "id_seed": SEED,
            "grads": f"standard normal * {GRAD_SCALE}, float32, fresh every round and method",
            "store": {
                "pool_size": config.store.pool_size,
                "max_batch_keys": config.store.max_batch_keys,
                "timeout_s": config.store.timeout_s,
            },
            "service": {
                "command": "python -m optimizer_service.app --config FILE --port P",
                "pid": service_pid,
                "auth": "bearer token",
            },
            "event_loop": "asyncio default (both processes)",
            "malloc": {
                "service": "tune_malloc + trim every 30 s (optimizer_service/malloc.py)",
                "this process (client and in-process baseline)": baseline_malloc,
            },
            "notes": [
                "http: OptimizerClient.push in this process -> the service process -> "
                "memcached; the whole exactly-once path",
                "inprocess: store.get of the rows with their slots (one item per row), "
                "optimizer.update inline, store.set of both; no HTTP, validation, journal "
                "or done record",
                "methods interleaved round by round, order alternated; gc.collect() before each",
                "an untimed warm-up push checks the service's update bit for bit against "
                "optimizer.update",
            ],
        },
        "acceptance_targets": {"http/inprocess": ACCEPT_HTTP_VS_INPROCESS},
        **summary,
    }
    save(
        report,
        args.out_dir,
        code_at_end=code_fingerprint(PACKAGES),
        plot=partial(plot, summary, n_ids=args.ids, rounds=args.rounds),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
