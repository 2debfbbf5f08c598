"""The PyTorch baselines of `python -m benchmarks.train`: a quick run with them (where
the torch-baselines extra is installed), and `--torch on` where torch does not import."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "pip install -e '.[torch-baselines]'"


def _train(
    args: list[str], out: Path, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.train", "--quick", *args, "--out-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout_s,
    )


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_torch_on_without_torch_fails_at_once_with_the_install_command(tmp_path: Path) -> None:
    """A directory first on the path whose `torch` does not import stands for a machine
    without the extra: the run stops before TensorFlow, a cluster or a round starts."""
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "torch.py").write_text(
        'raise ModuleNotFoundError("No module named \'torch\'", name="torch")\n'
    )
    path = os.pathsep.join([str(hidden), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    started = time.monotonic()
    done = _train(["--torch", "on"], tmp_path / "out", env, timeout_s=80)
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 2, output
    assert "--torch on, but" in done.stderr, output
    assert "torch does not import (ModuleNotFoundError: No module named 'torch')" in done.stderr
    assert INSTALL in done.stderr, output
    assert "round 1/" not in done.stdout, output
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - started < 60, output


@pytest.mark.integration
@pytest.mark.timeout(480)
def test_torch_baselines_quick_run_trains_and_reports_the_ratios(tmp_path: Path) -> None:
    """`--quick --torch on`: TorchRec and PyTorch SparseAdam train the model next to the
    others, and the report holds their rows, their ratios and their AUC against lazy Adam."""
    pytest.importorskip("torch")
    # found, not imported: torchrec after TensorFlow (another test's) crashes the process
    for name in ("torchrec", "fbgemm_gpu"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed ({INSTALL})")
    done = _train(["--torch", "on"], tmp_path, dict(os.environ), timeout_s=450)
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, output
    for line in (
        "distributed/TorchRec (FBGEMM) examples/s:",
        "distributed/PyTorch SparseAdam examples/s:",
        "eval AUC TorchRec (FBGEMM) - lazy Adam:",
        "eval AUC PyTorch SparseAdam - lazy Adam:",
    ):
        assert line in done.stdout, output
    assert "skipped" not in done.stdout, output

    report = json.loads((tmp_path / "train.json").read_text())
    assert {"torch", "torchrec", "fbgemm_gpu"} <= set(report["machine"])
    assert report["parameters"]["torch"]["mode"] == "on"
    rounds = {r["method"]: r for r in report["rounds"]}
    assert set(rounds) == {
        "local",
        "lazy_adam",
        "torchrec",
        "torch_sparse_adam",
        "distributed",
        "mlp_floor",
    }
    summary = report["summary"]
    assert "skipped" not in summary
    for m in ("torchrec", "torch_sparse_adam"):
        r = rounds[m]
        assert set(r["cpu"]["cpu_ms_per_step"]) == {m}
        assert r["steps"] == 12 and r["timed_steps"] == 10 and r["examples_per_s"] > 0
        assert r["eval_examples"] == 2 * 1024
        assert math.isfinite(r["eval_auc"]) and r["eval_auc"] > 0.6
        # the same batches and initial weights: the first loss before any update is equal
        assert r["losses"][0] == pytest.approx(rounds["lazy_adam"]["losses"][0], rel=1e-4)
        assert summary[f"ratio_distributed_vs_{m}"] == pytest.approx(
            summary["distributed"]["examples_per_s"] / summary[m]["examples_per_s"]
        )
        assert summary[f"ratio_examples_per_cpu_s_vs_{m}"] > 0
        assert summary[f"auc_gap_{m}_minus_lazy_adam"] == pytest.approx(
            summary[m]["eval_auc"] - summary["lazy_adam"]["eval_auc"]
        )
    assert set(summary["torch_acceptance"]) == {
        "distributed/torchrec examples/s >= 1.0",
        "|eval AUC torchrec - lazy_adam| <= 0.005",
        "|eval AUC torch_sparse_adam - lazy_adam| <= 0.005",
    }
    assert report["torch_targets"]["distributed/torchrec examples/s"] == 1.0
    assert (tmp_path / "train.png").stat().st_size > 0
