"""The benchmarks must keep running: `benchmarks/store.py --quick` end to end.

The figures of a quick run mean nothing (3 rounds of 8,192 ids); this only checks
that the script starts its cluster, measures every method and writes its report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "store.py"
METHODS = ("ceiling", "lookup", "create", "pymemcache")
RATIOS = ("lookup/ceiling", "lookup/pymemcache", "create/ceiling")


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_store_benchmark_quick_run_writes_its_report(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "lookup/ceiling" in proc.stdout

    report = json.loads((tmp_path / "store.json").read_text())
    assert {"timestamp", "machine", "code", "parameters", "dim16", "dim64", "key_encoding"} <= set(
        report
    )
    assert {"nproc", "python", "numpy", "memcached"} <= set(report["machine"])
    assert report["machine"]["memcached"].startswith("memcached ")
    params = report["parameters"]
    assert (params["rounds"], params["ids_per_batch"], params["quick"]) == (3, 8192, True)
    assert params["dims"] == [16, 64]

    for dim in (16, 64):
        result = report[f"dim{dim}"]
        for method in METHODS:
            rounds = result["seconds_per_round"][method]
            assert len(rounds) == 3 and all(t > 0 for t in rounds), (dim, method, rounds)
            assert result["median_seconds"][method] > 0
            assert result["rows_per_s"][method] > 0
        assert set(result["ratios"]) == set(RATIOS)
        assert all(r > 0 for r in result["ratios"].values())

    keys = report["key_encoding"]
    assert set(keys["ratios"]) == {"naive_loop/encode_keys", "naive_loop/int_key_matrix"}
    assert (tmp_path / "store.png").stat().st_size > 0
