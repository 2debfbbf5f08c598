"""The report: the machine and the code the figures come from, the report's head,
its JSON file in the out dir (benchmarks/results/ by default) and the lines every
benchmark prints about it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import ROOT

RESULTS_DIR = ROOT / "benchmarks" / "results"


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


# ---------------------------------------------------------------- the code


def _sha256_16(files: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256_16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


PACKAGES = ("lookup_table", "optimizer_service", "trainer")


def code_fingerprint(packages: Sequence[str] = PACKAGES) -> dict[str, Any]:
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


def fmt_rate(rate: float) -> str:
    """1.23M or 456k."""
    return f"{rate / 1e6:.2f}M" if rate >= 1e6 else f"{rate / 1e3:.0f}k"


def met(ok: bool) -> str:
    """An acceptance target's verdict as the tables print it."""
    return "met" if ok else "NOT MET"


def check_code(report: dict[str, Any], now: Mapping[str, Any]) -> None:
    """Mark the report if the code hashed at start (`report["code"]`) differs from `now`
    (the same fingerprint taken again at the end): this process kept the code it
    imported at start, which `code.files` describes."""
    if now["sha256_16"] != report["code"]["sha256_16"]:
        report["code"]["changed_on_disk_during_run"] = True
        print(
            "warning: the code changed on disk during the run; the figures belong to the "
            f"code imported at start (sha256_16 {report['code']['sha256_16']})",
            file=sys.stderr,
        )


def save(
    report: dict[str, Any],
    out_dir: Path,
    *,
    code_at_end: Mapping[str, Any] | None = None,
    plot: Callable[[Path], None] | None = None,
) -> None:
    """`<out_dir>/<benchmark>.json` (and `.png` drawn by `plot`), then say so; with
    `code_at_end`, the report's code fingerprint taken again, `check_code` first."""
    if code_at_end is not None:
        check_code(report, code_at_end)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{report['benchmark']}.json"
    write_json(json_path, report)
    if plot is None:
        print(f"\nwrote {json_path}")
        return
    png_path = json_path.with_suffix(".png")
    plot(png_path)
    print(f"\nwrote {json_path} and {png_path}")
