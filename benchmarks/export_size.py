"""Measure how big a SavedModel export gets, and the memory exporting and serving it take.

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.export_size            # 1,000,000 rows per case
    python -m benchmarks.export_size --quick    # smoke run: 20,000 rows per case
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT
from benchmarks.harness.cluster import checkout_env
from benchmarks.harness.options import Options
from benchmarks.harness.report import machine_info, report_head, save

DIMS = (16, 64)
ID_TYPES = ("int64", "string")


def _vm(field: str) -> int:
    """A VmXXX field of /proc/self/status, bytes."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _export_case(dim: int, id_type: str, rows: int, out: Path) -> dict[str, Any]:
    """In a fresh process: build the rows, export them, measure."""
    import keras
    import numpy as np

    from lookup_table.config import TableSpec
    from lookup_table.keras import DistributedEmbedding, export_saved_model
    from lookup_table.keras.serving import TableRows, estimate_export_bytes

    spec = TableSpec(name="user", dim=dim, seed=1, id_type=id_type)  # type: ignore[arg-type]
    ids_in = keras.Input(shape=(), dtype="int64" if id_type == "int64" else "string", name="id")
    model = keras.Model(ids_in, DistributedEmbedding(spec)(ids_in))
    before = _vm("VmRSS")
    rng = np.random.default_rng(0)
    if id_type == "int64":
        ids = np.unique(rng.integers(-(2**62), 2**62, rows, dtype=np.int64))
        id_bytes = 0
    else:
        ids = np.array([f"user:{i}" for i in range(rows)], dtype=object)
        id_bytes = sum(len(s) for s in ids.tolist())
    values = rng.standard_normal((ids.shape[0], dim), dtype=np.float32)
    table = TableRows(spec=spec, ids=ids, rows=values)
    estimate = estimate_export_bytes(
        count=int(ids.shape[0]), dim=dim, id_type=id_type, id_bytes=id_bytes
    )
    started = time.perf_counter()
    info = export_saved_model(model, out, rows={"user": table})
    seconds = time.perf_counter() - started
    variables = sum(p.stat().st_size for p in (out / "variables").iterdir())
    n = int(ids.shape[0])
    return {
        "dim": dim,
        "id_type": id_type,
        "rows": n,
        "mean_id_bytes": id_bytes / n if id_type == "string" else 8,
        "bytes": info["bytes"],
        "variables_bytes": variables,
        "graph_bytes": (out / "saved_model.pb").stat().st_size,
        "bytes_per_row": info["bytes"] / n,
        "buckets": 1 << (max(8, math.ceil((n + 1) / 0.8)) - 1).bit_length(),
        "export_seconds": seconds,
        "export_peak_bytes": _vm("VmHWM") - before,
        "estimate_bytes": estimate,
    }


def _serve_case(path: Path, id_type: str) -> dict[str, Any]:
    """In a fresh process that imports only TensorFlow: load, then one request."""
    import tensorflow as tf

    before = _vm("VmRSS")
    started = time.perf_counter()
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    loaded = time.perf_counter() - started
    query = (
        tf.constant([5, 6, 7], tf.int64)
        if id_type == "int64"
        else tf.constant(["user:5", "user:6", "never"])
    )
    started = time.perf_counter()
    serve(id=query)
    return {
        "load_seconds": loaded,
        "first_request_seconds": time.perf_counter() - started,
        "serve_peak_bytes": _vm("VmHWM") - before,
        "serve_rss_bytes": _vm("VmRSS") - before,
    }


def _child(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.export_size", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=checkout_env(TF_CPP_MIN_LOG_LEVEL="3"),
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{args}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'dim':>4} {'ids':>7} {'rows':>10} {'bytes/row':>10} {'on disk':>12} "
        f"{'export peak':>12} {'estimate':>12} {'est/peak':>8} {'serve RSS':>12}"
    ]
    lines += [
        f"{r['dim']:>4} {r['id_type']:>7} {r['rows']:>10,} {r['bytes_per_row']:>10.1f} "
        f"{r['bytes']:>12,} {r['export_peak_bytes']:>12,} {r['estimate_bytes']:>12,} "
        f"{r['estimate_bytes'] / r['export_peak_bytes']:>8.2f} {r['serve_rss_bytes']:>12,}"
        for r in results
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="20,000 rows per case")
    options.count("--rows", full=1_000_000, quick=20_000, help="rows per case")
    # the processes it starts: one case's export, one case's serving
    options.add_argument("--export-case", nargs=4, help=argparse.SUPPRESS)
    options.add_argument("--serve-case", nargs=2, help=argparse.SUPPRESS)
    args = options.parse(argv)
    if args.export_case:
        dim, id_type, rows, out = args.export_case
        print(json.dumps(_export_case(int(dim), id_type, int(rows), Path(out))))
        return 0
    if args.serve_case:
        print(json.dumps(_serve_case(Path(args.serve_case[0]), args.serve_case[1])))
        return 0
    n = args.rows
    machine = machine_info(memcached=False, cpu=False, nproc_usable=False)
    started = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="export-size-") as tmp:
        for dim in DIMS:
            for id_type in ID_TYPES:
                out = Path(tmp) / f"{dim}-{id_type}"
                result = _child(["--export-case", str(dim), id_type, str(n), str(out)])
                result.update(_child(["--serve-case", str(out), id_type]))
                shutil.rmtree(out)
                print(f"  dim {dim} {id_type}: {result['bytes']:,} bytes", file=sys.stderr)
                results.append(result)
    print(render(results))
    report = {
        **report_head("export_size", started, machine),
        "parameters": {
            "rows": n,
            "quick": args.quick,
            "dims": list(DIMS),
            "id_types": list(ID_TYPES),
            "notes": [
                "one DistributedEmbedding table per SavedModel, exported with "
                "lookup_table.keras.export_saved_model(rows=...)",
                "int ids: n random int64s (unique); string ids: 'user:<i>'",
                "export_peak_bytes: VmHWM growth of the exporting process from before the "
                "rows were built (they count in the estimate); serve_*: growth of a process "
                "that imports only TensorFlow, over tf.saved_model.load and one request",
            ],
        },
        "results": results,
    }
    save(report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
