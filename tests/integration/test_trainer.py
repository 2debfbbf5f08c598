"""Trainers against a real local cluster (memcached + optimizer service processes)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lookup_table import EmbeddingStore, load_config
from lookup_table.localcluster import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _cluster_file(path: Path, *, mode: str, workers: int, dim: int = 8) -> Path:
    ports = [free_port(), free_port(), free_port()]
    tables = "".join(
        f'\n[[tables]]\nname = "C{i}"\ndim = {dim}\n'
        f'optimizer = {{ name = "adam", learning_rate = 0.02 }}\n'
        for i in range(1, 27)
    )
    path.write_text(
        f'namespace = "t{uuid.uuid4().hex[:10]}"\n'
        f'memcached = ["127.0.0.1:{ports[0]}", "127.0.0.1:{ports[1]}"]\n'
        f'optimizers = ["http://127.0.0.1:{ports[2]}"]\n'
        f'mode = "{mode}"\nworkers = {workers}\n'
        '[optimizer]\nname = "adam"\nlearning_rate = 0.002\n' + tables
    )
    return path


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    mode, workers = request.param
    config = _cluster_file(tmp_path / "cluster.toml", mode=mode, workers=workers)
    cmd = [sys.executable, "-m", "lookup_table.localcluster"]
    args = ["--config", str(config), "--run-dir", str(tmp_path / "run"), "--memory-mb", "128"]
    up = subprocess.run(
        [*cmd, "up", *args], capture_output=True, text=True, timeout=120, check=False
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield config
    finally:
        subprocess.run([*cmd, "down", *args], capture_output=True, timeout=60, check=False)


def _train(
    config: Path, out: Path, *, worker: int, workers: int, steps: int
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "--config",
            str(config),
            "--data",
            "synthetic:100000",
            "--batch-size",
            "512",
            "--steps",
            str(steps),
            "--hidden",
            "64,32",
            "--eval-batches",
            "8",
            "--eval-every",
            str(steps // 2),
            "--worker-index",
            str(worker),
            "--num-workers",
            str(workers),
            "--output",
            str(out),
            "--no-progress",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


@pytest.mark.timeout(420)
@pytest.mark.parametrize("cluster", [("sync", 2)], indirect=True, ids=["sync-2-workers"])
def test_two_trainer_processes_train_one_model(cluster: Path, tmp_path: Path) -> None:
    """Sync mode: both workers step through the same versions of one model, AUC rises."""
    steps = 40
    procs = [
        _train(cluster, tmp_path / f"s{w}.json", worker=w, workers=2, steps=steps) for w in range(2)
    ]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    s0, s1 = (json.loads((tmp_path / f"s{w}.json").read_text()) for w in range(2))
    # one model: the same dense weights version at every step, one version per step
    assert s0["history"]["versions"] == s1["history"]["versions"]
    assert s0["final_version"] == s1["final_version"] == steps
    for s in (s0, s1):
        assert s["eval_auc"] > 0.65, s["history"]["evals"]
        assert s["history"]["evals"][-1]["auc"] > s["history"]["evals"][0]["auc"] - 0.02
        assert sum(s["rows_created"].values()) > 0
    # both evaluated the same model on the same held-out batches
    assert s0["eval_auc"] == pytest.approx(s1["eval_auc"], abs=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [("async", 1)], indirect=True, ids=["async"])
def test_trainer_in_process_learns_and_evaluation_writes_nothing(cluster: Path) -> None:
    from trainer import Trainer
    from trainer.data import SyntheticSource
    from trainer.models import build_model

    config = load_config(cluster)
    source = SyntheticSource(60_000, seed=3)
    model = build_model("mlp", source.schema, config, hidden=(64, 32))
    evals = list(source.batches(512, split="eval"))[:8]
    with Trainer(config, model, progress=False) as trainer:
        before = trainer.evaluate(evals)  # rows never seen: evaluation must not create them
        assert trainer.rows_created == {}

        async def count() -> int:
            async with EmbeddingStore(config) as store:
                stats = await store.stats()
            return sum(int(s["curr_items"]) for s in stats.values())

        items_before = asyncio.run(count())
        trainer.evaluate(evals)
        assert asyncio.run(count()) == items_before
        result = trainer.fit(source.batches(512), steps=60, eval_batches=evals)
        assert result.steps == 60 and result.examples == 60 * 512
        assert result.evals[-1]["auc"] > max(0.65, before["auc"] + 0.05)
        losses = np.array([loss for _, loss in result.losses])
        assert losses[-10:].mean() < losses[:10].mean()
        assert result.versions[-1] >= 55  # dense weights refreshed as pushes land
        created = trainer.rows_created
    assert set(created) == {f"C{i}" for i in range(1, 27)}
