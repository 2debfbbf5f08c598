"""`lookup-table-train` against a real local cluster: --save-model and ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lookup_table import load_config
from lookup_table.client import OptimizerClient
from tests.integration.test_trainer import (
    _PEOPLE_TABLES,
    REPO,
    _cluster_file,
    _people_csv,
    _running,
)

pytestmark = pytest.mark.integration

_COLUMNS = ["--label", "label", "--categorical", "job,city", "--numeric", "income,gain"]
_COLUMNS += ["--multivalued", "tags"]


@pytest.fixture
def people_cluster(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "cluster.toml"
    config = _cluster_file(path, mode="async", workers=1, tables=_PEOPLE_TABLES)
    with _running(config, tmp_path / "run"):
        yield config


def _cli(config: Path, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "trainer.cli", "--config", str(config), *_COLUMNS]
    return [*cmd, "--hidden", "32,16", "--no-progress", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], *, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """`cmd` in the repository, quiet TensorFlow, its output captured."""
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_env(), check=False
    )


def _signature_inputs(batch: Any) -> dict[str, Any]:
    """A raw batch as the SavedModel's serving_default takes it (ragged: values, lengths)."""
    import tensorflow as tf

    f = batch.features
    tags = f["tags"]
    return {
        "income": tf.constant(np.asarray(f["income"], np.float32)),
        "gain": tf.constant(np.asarray(f["gain"], np.float32)),
        "job": tf.constant(np.asarray(f["job"]).tolist(), tf.string),
        "city": tf.constant(np.asarray(f["city"]).tolist(), tf.string),
        "tags_values": tf.constant(np.asarray(tags.values).tolist(), tf.string),
        "tags_row_lengths": tf.constant(np.diff(tags.row_splits), tf.int64),
    }


def _served(path: Path, batches: list[Any]) -> np.ndarray:
    import tensorflow as tf

    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    out = []
    for batch in batches:
        (value,) = serve(**_signature_inputs(batch)).values()
        out.append(np.asarray(value, np.float32).reshape(-1))
    return np.concatenate(out)


@pytest.mark.timeout(600)
def test_save_model_serves_raw_rows_as_the_trained_model_predicts(
    people_cluster: Path, tmp_path: Path
) -> None:
    """Issue: a model trained with lookup-table-train could not be served (no model file,
    and it expected numbers standardized outside it). --save-model writes a SavedModel
    of the raw columns, which predicts what the trained model predicts."""
    import keras

    from trainer import Trainer
    from trainer.data import CsvSource
    from trainer.models import build_model
    from trainer.numeric import NumericStats

    train, _ = _people_csv(tmp_path / "train.csv", 3_000, seed=1)
    evals, _ = _people_csv(tmp_path / "eval.csv", 700, seed=2)
    saved = tmp_path / "models" / "people" / "1"
    out = tmp_path / "summary.json"
    cmd = _cli(people_cluster, "--data", f"csv:{train}", "--eval-data", f"csv:{evals}")
    cmd += ["--batch-size", "128", "--epochs", "2", "--output", str(out)]
    done = _run([*cmd, "--save-model", str(saved)], timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "wrote the SavedModel" in done.stderr
    summary = json.loads(out.read_text())
    raw = CsvSource(
        evals,
        label="label",
        categorical=["job", "city"],
        numeric=["income", "gain"],
        multivalued={"tags": "|"},
    )
    raw_batches = list(raw.raw_batches(100, split="all"))  # missing numbers as NaN
    assert any(np.isnan(np.asarray(b.features["income"])).any() for b in raw_batches)

    # the trained model: the same architecture, its rows and dense weights from the cluster,
    # fed the rows standardized as training fed them
    config = load_config(people_cluster)
    keras.backend.clear_session()  # the same layer names (dense weights by path) as the CLI's
    model = build_model("mlp", raw.schema, config, hidden=(32, 16), seed=0)
    stats = NumericStats.from_dict(summary["numeric_stats"])
    standardized = raw.with_numeric(stats)
    with Trainer(config, model, progress=False) as trainer:
        trained = trainer.predict(b.features for b in standardized.batches(100, split="all"))
    assert trained.shape == (700,) and 0.05 < trained.mean() < 0.95

    served = _served(saved, raw_batches)
    np.testing.assert_allclose(served, trained, atol=1e-5, rtol=0)
    labels = np.concatenate([b.labels for b in raw_batches])
    from trainer.metrics import logloss

    assert logloss(labels, served) == pytest.approx(summary["eval_logloss"], abs=1e-5)

    # the Keras model beside it exports the same from a checkpoint taken later (the
    # checkpoint tool's command line, in this process: TensorFlow is imported already)
    from lookup_table.ops.checkpoint.cli import main as checkpoint_tool

    ckpt, again = tmp_path / "ckpt", tmp_path / "models" / "people" / "2"
    save = ["save", "--config", str(people_cluster), "--dir", str(ckpt), "--no-progress"]
    assert checkpoint_tool(save) == 0
    export = ["export", "--dir", str(ckpt), "--format", "savedmodel"]
    assert checkpoint_tool([*export, "--model", f"{saved}.keras", "--out", str(again)]) == 0
    np.testing.assert_allclose(_served(again, raw_batches), trained, atol=1e-5, rtol=0)

    # bad input: the target exists -> refused before training, nothing written
    started = time.monotonic()
    refused = _run([*cmd, "--save-model", str(saved)], timeout=200)
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert f"--save-model {saved}: it exists and is not an empty directory" in refused.stderr
    assert "numeric statistics" not in refused.stderr and time.monotonic() - started < 60


@pytest.mark.timeout(600)
def test_ctrl_c_stops_training_cleanly_with_a_partial_summary(
    people_cluster: Path, tmp_path: Path
) -> None:
    """Issue: ctrl-C ended on a raw KeyboardInterrupt traceback and no summary. Now the
    step under way finishes, its push lands, the summary and plot are written, exit 130."""
    train, _ = _people_csv(tmp_path / "train.csv", 4_000, seed=1)
    out, plot = tmp_path / "summary.json", tmp_path / "loss.png"
    cmd = _cli(people_cluster, "--data", f"csv:{train}", "--batch-size", "64")
    cmd += ["--epochs", "1000", "--eval-every", "5", "--eval-batches", "2"]
    proc = subprocess.Popen(
        [*cmd, "--output", str(out), "--plot", str(plot)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 10: eval"):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines) + rest
    assert proc.returncode == 130, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert "interrupted: stopping after the step under way" in log
    summary = json.loads(out.read_text())
    assert summary["interrupted"] is True
    assert 10 <= summary["steps"] <= 20, summary["steps"]  # stopped within a step or two
    assert f"interrupted after {summary['steps']} steps" in log
    assert summary["train_loss"] is not None and summary["eval_step"] >= 10
    assert not any(e.get("final") for e in summary["history"]["evals"])  # skipped
    assert plot.stat().st_size > 10_000
    # every step's push landed, none after: one version a push (async, one worker)
    assert summary["final_version"] == summary["steps"]

    async def service_version() -> int:
        async with OptimizerClient(load_config(people_cluster)) as client:
            return await client.version()

    assert asyncio.run(service_version()) == summary["steps"]
