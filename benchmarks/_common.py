"""Helpers the benchmark scripts share: machine and code description, report head
and file, paired-round ratios, progress, timing, the cluster file, machine CPU,
per-process CPU from /proc, waiting for a quiet machine, a local demo cluster.

Not a benchmark. The scripts run as `python benchmarks/<name>.py`, so they import
this module as `_common` (their own folder is put first on `sys.path`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _measure_this_checkout() -> None:
    """Measure this checkout's code, in this process and in every process it starts (a
    cluster, a trainer role), never the checkout the environment has installed (an
    editable install of another worktree is found first otherwise, and silently)."""
    for name in ("lookup_table", "optimizer_service", "trainer"):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None)
        if where is not None and not Path(where).resolve().is_relative_to(ROOT):
            raise SystemExit(
                f"{name} was imported from {Path(where).parent}, not from this checkout "
                f"({ROOT}): run with PYTHONPATH={ROOT}"
            )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    )


_measure_this_checkout()
DEMO_CONFIG = ROOT / "deploy" / "demo.toml"
MEMCACHED_MEMORY_MB = 512  # -m of each node of `local_cluster`
QUIET_SHARE = 0.25  # of all cores: `wait_for_quiet` waits until the machine is below it
DISTURBED_SHARE = 0.15  # other processes' share of the machine that makes a timed window disturbed
_CLK_TCK = os.sysconf("SC_CLK_TCK")

# The demo's training shape (deploy/demo.toml, deploy/demo.sh), as train.py and scaling.py run
# it: the `mlp` model, batch 1024, SyntheticSource (seed 0) with 20% held out.
MODEL = "mlp"
HIDDEN = (256, 128)
BATCH_SIZE = 1024
EVAL_FRACTION = 0.2
DATA_SEED = 0
MODEL_SEED = 0


# ---------------------------------------------------------------- the machine


def _cpu_model() -> str:
    """The first `model name` of /proc/cpuinfo; "" where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            return next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), ""
            )
    except OSError:
        return ""


def machine_info(
    versions: Mapping[str, str] | None = None,
    *,
    memcached: bool = True,
    cpu: bool = True,
    nproc_usable: bool = True,
) -> dict[str, Any]:
    """The machine the figures come from.

    `versions`: the benchmark's own packages (name -> version), reported after
    numpy's. `memcached`, `cpu`, `nproc_usable`: whether to report the memcached
    binary's `-V`, the CPU model and the usable CPU count.
    """
    info: dict[str, Any] = {"nproc": os.cpu_count()}
    if nproc_usable:
        info["nproc_usable"] = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        )
    if cpu:
        info["cpu"] = _cpu_model()
    info["platform"] = platform.platform()
    info["python"] = platform.python_version()
    info["numpy"] = np.__version__
    info.update(versions or {})
    if memcached:
        from lookup_table.ops.localcluster import memcached_binary

        info["memcached"] = subprocess.run(
            [memcached_binary(), "-V"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    info["loadavg_at_start"] = list(os.getloadavg())
    return info


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all but idle and iowait)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


# ---------------------------------------------------------------- the code


def _sha256_16(files: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256_16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def code_fingerprint(packages: Sequence[str]) -> dict[str, Any]:
    """sha256 of every source file of `packages` (folders of the repository root)."""
    files = {
        str(p.relative_to(ROOT)): _file_sha256_16(p)
        for pkg in packages
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }
    return {"root": str(ROOT), "sha256_16": _sha256_16(files), "files": files}


def lookup_table_fingerprint() -> dict[str, Any]:
    """sha256 of every lookup_table source file: which code these figures belong to."""
    import lookup_table

    root = Path(lookup_table.__file__).parent
    files = {str(p.relative_to(root)): _file_sha256_16(p) for p in sorted(root.rglob("*.py"))}
    return {"lookup_table": str(root), "sha256_16": _sha256_16(files), "files": files}


# ---------------------------------------------------------------- the report


def report_head(
    benchmark: str,
    started: float,
    machine: dict[str, Any],
    code: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The first keys of every report: name, start time, wall time, machine (and code)."""
    head = {
        "benchmark": benchmark,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_seconds": time.time() - started,
        "machine": machine,
    }
    if code is not None:
        head["code"] = code
    return head


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over rounds of the rate ratio num/den of one round (den seconds / num seconds)."""
    return statistics.median(d / n for n, d in zip(num, den, strict=True))


def fmt_rate(rate: float) -> str:
    """1.23M or 456k."""
    return f"{rate / 1e6:.2f}M" if rate >= 1e6 else f"{rate / 1e3:.0f}k"


def plot_rates(
    summary: Mapping[str, Any],
    path: Path,
    *,
    methods: Sequence[str],
    labels: Mapping[str, str],
    dims: Sequence[int],
    xticks: Sequence[str],
    ylabel: str,
    title: str,
) -> None:
    """Bars of thousand rows/s (`summary["dim<d>"]["rows_per_s"]`), one group per dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(methods)
    x = np.arange(len(dims))
    for i, m in enumerate(methods):
        rates = [summary[f"dim{d}"]["rows_per_s"][m] / 1e3 for d in dims]
        bars = ax.bar(x + (i - (len(methods) - 1) / 2) * width, rates, width, label=labels[m])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(x, list(xticks))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- running


def progress(total: int, desc: str) -> Iterator[int]:
    """tqdm on a terminal, one plain line per step otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(range(total), desc=desc, file=sys.stderr, leave=False)
        return
    for i in range(total):
        print(f"  {desc}: round {i + 1}/{total}", file=sys.stderr, flush=True)
        yield i


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    gc.collect()
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


# ---------------------------------------------------------------- the cluster file


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(raw: Mapping[str, Any]) -> str:
    """Scalars and lists on top, then [tables], then [[arrays of tables]]."""

    def is_table_array(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and isinstance(v[0], dict)

    lines = [
        f"{k} = {_toml_value(v)}"
        for k, v in raw.items()
        if not isinstance(v, dict) and not is_table_array(v)
    ]
    for k, v in raw.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]", *(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())]
    for k, v in raw.items():
        if is_table_array(v):
            for item in v:
                lines += ["", f"[[{k}]]", *(f"{kk} = {_toml_value(vv)}" for kk, vv in item.items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- CPU accounting


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads) in seconds; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # fields[0] is field 3, "state"
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process's live threads, summed by thread name (comm)."""
    out: dict[str, float] = collections.defaultdict(float)
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                text = (task / "stat").read_text()
            except OSError:
                continue
            comm = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            out[re.sub(r"\d+$", "#", comm)] += (int(fields[11]) + int(fields[12])) / _CLK_TCK
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


def add_quiet_options(parser: Any, *, unit: str, wait_s: float) -> None:
    """`--quiet-wait-s` and `--retries` of a benchmark whose `unit`s (a round, a run) are
    timed windows on a shared machine; `quiet_options` fills in their defaults."""
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        default=None,
        help=f"before each {unit}, wait up to this long for other processes to use less than "
        f"{QUIET_SHARE * 100:.0f}%% of the machine (default {wait_s:.0f}; 0 with --quick)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        help=f"repeat a {unit} (up to this many times) when other processes used more than "
        f"{DISTURBED_SHARE * 100:.0f}%% of the machine during its window "
        "(default 2; 0 with --quick)",
    )


def quiet_options(args: Any, *, wait_s: float) -> None:
    """The defaults of `add_quiet_options`: `wait_s` and 2 retries, none with `--quick`."""
    if args.quiet_wait_s is None:
        args.quiet_wait_s = 0.0 if args.quick else wait_s
    if args.retries is None:
        args.retries = 0 if args.quick else 2


def wait_for_quiet(max_wait_s: float, quiet_share: float = QUIET_SHARE) -> dict[str, Any]:
    """Wait (up to `max_wait_s`) until the machine was less than `quiet_share` busy for 2 s.

    The machine is shared: another job's burst would land in one method's window.
    Returns the busy share last seen and how long we waited. With `max_wait_s` <= 0
    (`--quick`) nothing waits: the share is sampled over 0.2 s, only to be reported.
    """
    cpus = os.cpu_count() or 1
    start = time.monotonic()
    share = float("nan")
    sample_s = 2.0 if max_wait_s > 0 else 0.2
    while True:
        before, t0 = machine_busy_s(), time.monotonic()
        time.sleep(sample_s)
        share = (machine_busy_s() - before) / ((time.monotonic() - t0) * cpus)
        waited = time.monotonic() - start
        if share < quiet_share or waited >= max_wait_s:
            return {"busy_share": share, "waited_s": waited, "quiet": share < quiet_share}


# ---------------------------------------------------------------- a local cluster


def write_cluster_file(
    path: Path,
    *,
    mode: str = "async",
    workers: int = 1,
    prefix: str = "benchtrain",
    service: Mapping[str, Any] | None = None,
    replicas: int = 1,
) -> dict[str, Any]:
    """deploy/demo.toml with fresh ports, a fresh namespace (`prefix` + 8 hex digits),
    `workers`, `mode` and `service`'s keys set in its `[service]` table: 2 memcached nodes
    and `replicas` optimizer replicas (the demo's: 1)."""
    from lookup_table.config import load_config
    from lookup_table.ops.localcluster import free_port

    raw = tomllib.loads(DEMO_CONFIG.read_text())
    ports: set[int] = set()
    while len(ports) < 2 + replicas:  # distinct ports that were free a moment ago
        ports.add(free_port())
    mc1, mc2, *opts = sorted(ports)
    raw.update(
        namespace=prefix + uuid.uuid4().hex[:8],
        memcached=[f"127.0.0.1:{mc1}", f"127.0.0.1:{mc2}"],
        optimizers=[f"http://127.0.0.1:{opt}" for opt in opts],
        workers=workers,
        mode=mode,
    )
    raw["service"] = {**raw.get("service", {}), **(service or {})}
    path.write_text(to_toml(raw))
    ours, demo = load_config(path), load_config(DEMO_CONFIG)
    if ours.tables != demo.tables or ours.optimizer != demo.optimizer:
        raise RuntimeError(f"{path} does not reproduce deploy/demo.toml's tables and optimizer")
    return {
        "namespace": ours.namespace,
        "memcached": list(ours.node_addresses),
        "optimizers": list(ours.optimizers),
        "mode": ours.mode,
        "workers": ours.workers,
    }


def _localcluster(
    command: str, config: Path, run_dir: Path, memory_mb: int, env: Mapping[str, str] | None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "lookup_table.ops.localcluster", command, "--config", str(config)]
    cmd += ["--run-dir", str(run_dir)]
    if command == "up":
        cmd += ["--memory-mb", str(memory_mb)]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=None if env is None else dict(env),
        check=False,
    )


@contextlib.contextmanager
def running_cluster(
    config_path: Path,
    run_dir: Path,
    *,
    memory_mb: int = MEMCACHED_MEMORY_MB,
    env: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """The memcached nodes and optimizer replicas of `config_path`, started with
    `python -m lookup_table.ops.localcluster up` (pid files and logs in `run_dir`) and
    always stopped with `... down`; a stop that leaves pid files is a warning."""
    try:
        up = _localcluster("up", config_path, run_dir, memory_mb, env)
        if up.returncode != 0:
            raise RuntimeError(f"cluster up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
        yield
    finally:
        down = _localcluster("down", config_path, run_dir, memory_mb, env)
        left = sorted(p.name for p in run_dir.glob("*.pid"))
        if down.returncode != 0 or left:
            print(
                f"warning: cluster down ({down.returncode}) left {left}:\n{down.stdout}"
                f"{down.stderr}",
                file=sys.stderr,
            )


@contextlib.contextmanager
def local_cluster(
    work_dir: Path,
    *,
    mode: str = "async",
    workers: int = 1,
    prefix: str = "benchtrain",
    memory_mb: int = MEMCACHED_MEMORY_MB,
    service: Mapping[str, Any] | None = None,
    replicas: int = 1,
) -> Iterator[tuple[Path, Path, dict[str, Any]]]:
    """2 memcached nodes + `replicas` optimizer replicas from a fresh cluster file (see
    `write_cluster_file`), in a `running_cluster`. Yields the cluster file, the run dir
    (pid files, logs) and a summary of the cluster."""
    work_dir.mkdir(parents=True)
    config_path, run_dir = work_dir / "cluster.toml", work_dir / "run"
    info = write_cluster_file(
        config_path,
        mode=mode,
        workers=workers,
        prefix=prefix,
        service=service,
        replicas=replicas,
    )
    with running_cluster(config_path, run_dir, memory_mb=memory_mb):
        yield config_path, run_dir, info


def service_log_errors(run_dir: Path, replica: int = 0) -> list[str]:
    """The first 5 ERROR lines of an optimizer replica's log in `run_dir` ([] if none)."""
    log = run_dir / f"optimizer-{replica}.log"
    if not log.exists():
        return []
    return [ln for ln in log.read_text(errors="replace").splitlines() if " ERROR " in ln][:5]


def cluster_pids(run_dir: Path) -> dict[str, int]:
    """{"optimizer": pid, "memcached-1": pid, ...} from the pid files of `localcluster up`."""
    pids: dict[str, int] = {}
    for path in sorted(run_dir.glob("optimizer-*.pid")):
        pids["optimizer" if path.stem == "optimizer-0" else path.stem] = int(path.read_text())
    for k, path in enumerate(sorted(run_dir.glob("memcached-*.pid")), start=1):
        pids[f"memcached-{k}"] = int(path.read_text())
    return pids
