"""Helpers the benchmark scripts share: machine and code description, report head
and file, paired-round ratios, progress, timing, the cluster file, machine CPU.

Not a benchmark. The scripts run as `python benchmarks/<name>.py`, so they import
this module as `_common` (their own folder is put first on `sys.path`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


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
    files = {p.name: _file_sha256_16(p) for p in sorted(root.glob("*.py"))}
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
