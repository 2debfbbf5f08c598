"""`deploy/cluster.sh up|down|status`: start, stop and inspect the processes of a cluster
file (`python -m lookup_table.ops.localcluster`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lookup_table.ops.localcluster.files import (
    Part,
    cluster_parts,
    down_hint,
    running,
    same_file,
    taken_message,
)
from lookup_table.ops.localcluster.options import (
    NO_CAS,
    local_threads,
    memcached_options,
    row_item_bytes,
    slab_sizes,
)
from lookup_table.ops.localcluster.pids import pid_alive
from lookup_table.ops.localcluster.replicas import (
    adopt_index_pid_file,
    healthz,
    mismatch,
    namespace_served,
    replica_state,
    start_optimizers,
)
from lookup_table.ops.localcluster.servers import MemcachedProcess, port_taken, wait_for_port

if TYPE_CHECKING:
    from lookup_table.config import ClusterConfig

__all__ = ["cluster_down", "cluster_status", "cluster_up", "main"]


def _stop_pids(pids: Sequence[int]) -> None:
    """SIGTERM to all, then wait for all (side by side: memcached takes up to a second
    to exit); SIGKILL to those still alive after 10 s."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it exited since it was found running
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    for pid in pids:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def cluster_up(config_path: str, run_dir: Path, *, memory_mb: int) -> int:
    """Start every local memcached of the cluster file (not twice), init the sentinels,
    then start the optimizer replicas (not twice)."""
    from lookup_table.config import load_config
    from lookup_table.ops.admin import init_cluster

    config = load_config(config_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    nodes, replicas = cluster_parts(config, run_dir)
    # a replica address held by another namespace's replica is refused before anything
    # starts or any sentinel is written
    for part in replicas:
        _, error = replica_state(part, config, config_path)
        if error is not None:
            print(error, file=sys.stderr)
            return 1
    threads = local_threads(sum(part.local for part in nodes))
    rows, classes = _row_classes(config)
    for part in nodes:
        pid, note = running(part)
        if note:
            print(f"{part.label}: {note}")
        if pid is not None:
            owner = part.owner()
            shared = ""
            if owner is not None and not same_file(owner, config_path):
                shared = (
                    f"; shared with the cluster file {owner.get('config')} (namespace "
                    f"{owner.get('namespace')!r}), whose `down` stops it"
                )
            print(f"{part.label}: already running (pid {pid}{shared})")
            continue
        if not part.local:
            print(f"{part.label}: not a local address, expecting it to be running")
            continue
        if port_taken(part.host, part.port):
            print(taken_message(part, config_path), file=sys.stderr)
            return 1
        server = MemcachedProcess(
            host=part.host,
            port=part.port,
            memory_mb=memory_mb,
            log_path=part.log_path,
            threads=threads,
            slab_sizes=classes,
        )
        try:
            server.start()
        except RuntimeError as exc:
            print(f"{part.label}: {exc}", file=sys.stderr)
            return 1
        pid = server.pid
        if pid is None:  # start() returned, so it runs
            raise RuntimeError(f"{part.label}: started without a process")
        part.claim(pid, config_path, config.namespace)
        print(
            f"{part.label}: started (pid {pid}, {memory_mb} MiB, -M, -C, -t {threads}, "
            f"{f'slab classes for rows of {rows} bytes' if classes else 'default slab classes'}"
            f", log {part.log_path})"
        )
    states = asyncio.run(init_cluster(config))
    for address, state in states.items():
        print(f"memcached {address}: {state} (namespace {config.namespace!r})")
    return start_optimizers(config_path, config, replicas)


def _row_classes(config: ClusterConfig) -> tuple[list[int], str | None]:
    """The row item sizes of the cluster file's int64 tables and the nodes' `-o slab_sizes`
    that gives each a class of its own (None, memcached's defaults, where it takes too
    many classes, or no int64 table: string ids' keys have no one size)."""
    rows = sorted(set(row_item_bytes(config).values()))
    if not rows:
        return rows, None
    try:
        return rows, slab_sizes(rows)
    except ValueError as exc:
        print(f"memcached keeps its default slab classes: {exc}", file=sys.stderr)
        return rows, None


def memcached_flags(config_path: str, *, memory_mb: int) -> int:
    """Print the options a node of the cluster file runs with besides its address: for a
    node started another way (deploy/k8s, deploy/systemd)."""
    from lookup_table.config import load_config

    config = load_config(config_path)
    _, classes = _row_classes(config)
    print(f"-M -m {memory_mb} {NO_CAS} -o {memcached_options(memory_mb, slab_sizes=classes)}")
    return 0


def cluster_down(config_path: str, run_dir: Path) -> int:
    """Stop exactly the processes `up` started from this cluster file (by pid file, only
    while that process still serves its address)."""
    from lookup_table.config import load_config

    config = load_config(config_path)
    nodes, replicas = cluster_parts(config, run_dir)
    for part in replicas:
        adopt_index_pid_file(part)
    # the replicas first (they write the rows they hold behind), then the nodes
    for parts in (replicas, nodes):
        ours: list[tuple[Part, int]] = []
        for part in parts:
            pid, note = running(part)
            if pid is None:
                print(f"{part.label}: not running ({note or 'no pid file'})")
                continue
            owner = part.owner()
            if not same_file(owner, config_path):
                print(
                    f"{part.label}: left running (pid {pid}): it belongs to "
                    f"{down_hint(owner or {}, run_dir)}"
                )
                continue
            ours.append((part, pid))
        _stop_pids([pid for _, pid in ours])
        for part, pid in ours:
            part.forget()
            print(f"{part.label}: stopped (pid {pid})")
    return 0


def cluster_status(config_path: str, run_dir: Path) -> int:
    """Each node: pid, reachable, items, bytes, fill, this namespace's sentinel; each
    replica: pid, health, the namespace it serves. Exit 1 if any is down, lacks its
    sentinel, or serves another namespace."""
    from lookup_table.config import load_config
    from lookup_table.errors import LookupTableError
    from lookup_table.ops.stats import node_stats

    config = load_config(config_path)
    nodes, replicas = cluster_parts(config, run_dir)
    healthy = True
    for part in nodes:
        pid, note = running(part, tidy=False)
        up = wait_for_port(part.host, part.port, timeout_s=0.5)
        healthy &= up
        extra = f"; {note}" if note else ""
        owner = part.owner() if pid is not None else None
        if owner is not None and not same_file(owner, config_path):
            extra += (
                f"; belongs to the cluster file {owner.get('config')} (namespace "
                f"{owner.get('namespace')!r})"
            )
        print(f"{part.label}: pid {pid or '-'}, {'up' if up else 'DOWN'}{extra}")
    if healthy:
        try:
            stats = asyncio.run(node_stats(config))
        except LookupTableError as exc:
            print(f"stats failed: {exc}", file=sys.stderr)
            return 1
        for address, s in stats.items():
            print(
                f"  {address}: {s['curr_items']} items, {int(s['bytes']) / 2**20:.1f} MiB of "
                f"{int(s['limit_maxbytes']) / 2**20:.0f} MiB ({float(s['fill_ratio']):.1%}), "
                f"evictions {s['evictions']}, sentinel {'ok' if s['sentinel'] else 'MISSING'} "
                f"(namespace {config.namespace!r})"
            )
            healthy &= bool(s["sentinel"])
    for part in replicas:
        pid, note = running(part, tidy=False)
        status, body = healthz(part.url)
        extra = f"; {note}" if note else ""
        if status == 0:
            state = f"UNHEALTHY (does not answer: {body[:120]})"
        else:
            served = namespace_served(part.url, config.token)
            problem = mismatch(served, config.namespace, part.replica)
            if problem is not None:
                state = f"MISMATCH ({problem})"
                status = 0
            elif status == 200:
                state = f"healthy, namespace {config.namespace!r}"
            else:
                state = f"UNHEALTHY ({status} {body[:120]})"
        healthy &= status == 200
        print(f"{part.label}: pid {pid or '-'}, {state}{extra}")
    return 0 if healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deploy/cluster.sh", description="start, stop or inspect a local cluster"
    )
    parser.add_argument(
        "command",
        choices=["up", "down", "status", "memcached-options"],
        help="memcached-options: print the memcached options of the cluster file's nodes",
    )
    parser.add_argument("--config", required=True, help="the cluster file (TOML)")
    parser.add_argument("--run-dir", default="run", help="pid files and logs (default ./run)")
    parser.add_argument("--memory-mb", type=int, default=1024, help="memcached -m (default 1024)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        if args.command == "up":
            return cluster_up(args.config, run_dir, memory_mb=args.memory_mb)
        if args.command == "memcached-options":
            return memcached_flags(args.config, memory_mb=args.memory_mb)
        if args.command == "down":
            return cluster_down(args.config, run_dir)
        return cluster_status(args.config, run_dir)
    except Exception as exc:  # the CLI boundary: one clear line, not a traceback
        print(f"cluster {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
