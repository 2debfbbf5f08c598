"""CPU accounting from /proc: the whole machine's busy time, a process's and its
threads' CPU seconds, memcached's `stats` counters, and their use over a timed window."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all but idle and iowait)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads) in seconds; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # fields[0] is field 3, "state"
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def task_stats(pid: int) -> dict[str, tuple[str, float, float]]:
    """{tid: (thread name, user s, system s)} of a process's live threads ({} if gone)."""
    out: dict[str, tuple[str, float, float]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                text = (task / "stat").read_text()
            except OSError:
                continue
            comm = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            out[task.name] = (comm, int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK)
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process's live threads, summed by thread name (comm)."""
    out: dict[str, float] = collections.defaultdict(float)
    for comm, user, system in task_stats(pid).values():
        out[re.sub(r"\d+$", "#", comm)] += user + system
    return dict(out)


MEMCACHED_COUNTERS = (
    "cmd_get",
    "get_hits",
    "get_misses",
    "cmd_set",
    "delete_hits",
    "bytes_read",
    "bytes_written",
    "total_connections",
)


def memcached_counters(addresses: Sequence[str]) -> dict[str, int]:
    """MEMCACHED_COUNTERS summed over the nodes (`stats` over a plain socket)."""
    import socket

    total = dict.fromkeys(MEMCACHED_COUNTERS, 0)
    for address in addresses:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"stats\r\n")
            data = b""
            while not data.endswith(b"END\r\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        for line in data.decode("ascii", "replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "STAT" and parts[1] in total:
                total[parts[1]] += int(parts[2])
    return total


def memcached_work(per_step: Mapping[str, float], cpu_ms: float, unit: str = "step") -> str:
    """memcached's key operations per `unit` (`stats` deltas summed over the nodes, as
    `cpu_usage` gives them) and its CPU per key operation: the figure that says whether
    the same work cost memcached more in one run than in another, whatever else changed."""
    ops = per_step.get("cmd_get", 0.0) + per_step.get("cmd_set", 0.0)
    per_op = f"{cpu_ms * 1e3 / ops:.2f} us" if ops else "n/a"
    return (
        f"memcached, all nodes, per {unit}: {per_step.get('cmd_get', 0.0):,.0f} keys read "
        f"({per_step.get('get_misses', 0.0):,.0f} missing), {per_step.get('cmd_set', 0.0):,.0f} "
        f"written, {per_step.get('bytes_read', 0.0) / 1e6:.2f} MB received; "
        f"its CPU per key operation {per_op}"
    )


def cpu_snapshot(pids: Mapping[str, int], nodes: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "time": time.perf_counter(),
        "machine": machine_busy_s(),
        "procs": {name: proc_cpu_s(pid) for name, pid in pids.items()},
        "threads": thread_cpu_s(os.getpid()),
        "memcached": memcached_counters(nodes) if nodes else {},
    }


def cpu_usage(start: Mapping[str, Any], end: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """CPU ms per step of each process and of the rest of the machine, over one window."""
    wall = end["time"] - start["time"]
    per_proc: dict[str, float] = {}
    for name, before in start["procs"].items():
        after = end["procs"].get(name)
        if before is not None and after is not None:
            per_proc[name] = (after - before) * 1e3 / steps
    ours = sum(per_proc.values())
    busy = (end["machine"] - start["machine"]) * 1e3 / steps
    cpus = os.cpu_count() or 1
    threads = {
        name: (end["threads"].get(name, 0.0) - start["threads"].get(name, 0.0)) * 1e3 / steps
        for name in set(start["threads"]) | set(end["threads"])
    }
    memcached = {
        k: (end["memcached"][k] - v) / steps for k, v in start.get("memcached", {}).items()
    }
    return {
        "wall_ms_per_step": wall * 1e3 / steps,
        "cpu_ms_per_step": per_proc,
        "total_cpu_ms_per_step": ours,
        "cores_used": ours / (wall * 1e3 / steps) if wall > 0 else float("nan"),
        "other_processes_cpu_ms_per_step": max(busy - ours, 0.0),
        "other_processes_share": max(busy - ours, 0.0) / (cpus * wall * 1e3 / steps)
        if wall > 0
        else float("nan"),
        "this_process_threads_cpu_ms_per_step": {
            k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0
        },
        **({"memcached_per_step": memcached} if memcached else {}),
    }
