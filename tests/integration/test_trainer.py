"""Trainers against a real local cluster (memcached + optimizer service processes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lookup_table import EmbeddingStore, load_config
from lookup_table.client import OptimizerClient
from lookup_table.ops.localcluster import free_port
from tests.conftest import worker_metrics
from tests.reliability.harness import cluster_command

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _cluster_file(
    path: Path,
    *,
    mode: str,
    workers: int,
    dim: int = 8,
    tables: str | None = None,
    store: str = "",
    replicas: int = 1,
) -> Path:
    ports = [free_port() for _ in range(2 + replicas)]
    urls = ", ".join(f'"http://127.0.0.1:{p}"' for p in ports[2:])
    if tables is None:
        tables = "".join(
            f'\n[[tables]]\nname = "C{i}"\ndim = {dim}\n'
            f'optimizer = {{ name = "adam", learning_rate = 0.02 }}\n'
            for i in range(1, 27)
        )
    path.write_text(
        f'namespace = "t{uuid.uuid4().hex[:10]}"\n'
        f'memcached = ["127.0.0.1:{ports[0]}", "127.0.0.1:{ports[1]}"]\n'
        f"optimizers = [{urls}]\n"
        f'mode = "{mode}"\nworkers = {workers}\n'
        '[optimizer]\nname = "adam"\nlearning_rate = 0.002\n' + store + tables
    )
    return path


@contextlib.contextmanager
def _running(config: Path, run_dir: Path) -> Iterator[Path]:
    """A local cluster (2 memcached nodes, 1 replica) of `config`, always stopped."""
    args = ["--config", str(config), "--run-dir", str(run_dir), "--memory-mb", "128"]
    up = cluster_command("up", *args)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield config
    finally:
        cluster_command("down", *args)


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    mode, workers, *tables = request.param
    config = _cluster_file(
        tmp_path / "cluster.toml", mode=mode, workers=workers, tables=tables[0] if tables else None
    )
    with _running(config, tmp_path / "run"):
        yield config


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
    # rows written through are created by each worker's lookups; written behind, by the
    # round that first pushes them, counted by the worker whose push applied it
    assert sum(s0["rows_created"].values()) + sum(s1["rows_created"].values()) > 0
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
        # one trace for batches of every count of unique ids
        assert trainer._graph_step is not None and trainer._graph_step.traces == 1
        created = trainer.rows_created
    # each push reported its examples and loss to the service's /metrics
    assert worker_metrics(config, "lookup_table_worker_examples_total") == {"0": 60 * 512}
    assert worker_metrics(config, "lookup_table_worker_pushes_total") == {"0": 60}
    assert worker_metrics(config, "lookup_table_worker_loss") == {"0": result.losses[-1][1]}
    assert set(created) == {f"C{i}" for i in range(1, 27)}


TrainedRun = tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], int, dict[str, int]]


def _train_fresh(
    tmp_path: Path,
    tag: str,
    *,
    in_graph: bool = False,
    replicas: int = 1,
    flush_pushes: int = 1,
    tables: str | None = None,
    through_owner: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> TrainedRun:
    """Train 14 batches on a new cluster from fixed weights; returns the losses, the
    service's dense weights and rows afterwards, how many layers were fed rows and the
    rows the trainer created. `in_graph` drops the layers' `feature`, so every lookup
    runs inside the graph step (a py_function each, nothing prefetched); `flush_pushes`
    is `service.row_flush_pushes`: 1 writes every push's rows through to memcached, more
    writes them behind, read through their owner; `through_owner`, if given, gets the
    rows read through their owner after training, before the pause that writes them."""
    import keras

    from trainer import Trainer
    from trainer.data import SyntheticSource
    from trainer.models import build_model

    source = SyntheticSource(20_000, seed=5)
    batches = list(source.batches(256))[:14]  # consecutive batches share hot ids
    behind = flush_pushes > 1
    store = f"[service]\nrow_flush_pushes = {flush_pushes}\nrow_flush_s = 600\n"
    path = _cluster_file(
        tmp_path / f"{tag}.toml",
        mode="async",
        workers=1,
        replicas=replicas,
        store=store,
        tables=tables,
    )
    with _running(path, tmp_path / f"run-{tag}"):
        config = load_config(path)
        keras.utils.set_random_seed(1)
        model = build_model("mlp", source.schema, config, hidden=(32, 16), seed=3)
        features = {}
        for layer in model._flatten_layers(include_self=False):
            if getattr(layer, "feature", None):
                features[layer.table] = layer.feature
                if in_graph:
                    layer.feature = None
        with Trainer(config, model, progress=False, **trainer_kwargs) as trainer:
            result = trainer.fit(batches)
            fed = len(trainer.fed_layers)
            created = trainer.rows_created
            if trainer_kwargs.get("read_your_writes", True) and not in_graph and not behind:
                # from the third step on, ids of earlier batches come from their answers
                # (with every replica's stamps following on)
                assert trainer.rows_answered > 0
            if trainer_kwargs.get("read_your_writes", True) and not in_graph and behind:
                # read through their owner: the first batch's rows alone, every later
                # batch's with the push before it, none kept from the answers
                assert _reads_alone(config) == 1
                assert trainer.rows_answered == 0
        ids = {
            table: np.unique(np.concatenate([np.asarray(b.features[f]) for b in batches]))
            for table, f in features.items()
        }

        async def stored() -> tuple[Any, Any]:
            async with EmbeddingStore(config) as store, OptimizerClient(config) as client:
                if through_owner is not None:  # as trainers read them: POST /v1/rows
                    owned = await client.rows(ids)
                    through_owner.update({t: rows for t, (rows, _) in owned.items()})
                await client.pause()  # rows written behind: written now
                try:
                    rows = {t: await store.lookup(t, i, create=False) for t, i in ids.items()}
                finally:
                    await client.resume()
                return rows, (await client.dense())[1]

        rows, dense = asyncio.run(stored())
    return np.array([loss for _, loss in result.losses]), dense, rows, fed, created


def _reads_alone(config: Any) -> int:
    """`POST /v1/rows` requests the replicas answered (their /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0
    for url in config.optimizers:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as got:
            text = got.read().decode()
        total += sum(
            int(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "lookup_table_http_requests_total" and s.labels["endpoint"] == "/v1/rows"
        )
    return total


def _assert_same_training(a: Any, b: Any) -> None:
    (loss_a, dense_a, rows_a, *_), (loss_b, dense_b, rows_b, *_) = a, b
    assert loss_a.shape == (14,)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5)
    assert len(dense_a) == len(dense_b)  # Keras names the two models' layers apart
    for x, y in zip(dense_a.values(), dense_b.values(), strict=True):
        np.testing.assert_allclose(y, x, atol=1e-6)
    assert rows_a.keys() == rows_b.keys()
    for table in rows_a:
        np.testing.assert_allclose(rows_b[table], rows_a[table], atol=1e-6)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """`_train_fresh` with its defaults (rows written through, every layer fed, answered
    rows kept, one replica): the run each variant below must train exactly as. It is the
    same run for every test (same data, weights and seeds on a fresh cluster), so it runs
    once per module."""
    return _train_fresh(tmp_path_factory.mktemp("default"), "default")


@pytest.fixture(scope="module")
def read_after_every_push(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """`_train_fresh` reading every row and the dense weights after each push
    (`read_your_writes=False`): nothing taken from a push's answer."""
    return _train_fresh(tmp_path_factory.mktemp("fresh"), "fresh", read_your_writes=False)


@pytest.mark.timeout(420)
def test_read_your_writes_trains_exactly_as_reading_after_every_push(
    default_run: TrainedRun, read_after_every_push: TrainedRun
) -> None:
    """One worker, async: the default (the push answers with its rows and the dense
    weights before its writes land; the next batch's rows are fetched during the step
    and patched from the answers) gives the same losses, dense weights and rows as
    reading everything after each push (`read_your_writes=False`), on the same data from
    the same weights. A stale row or weight would differ by a whole Adam step (~0.02)."""
    fresh, answered = read_after_every_push, default_run
    assert fresh[3] == answered[3] == 26  # every layer's rows fed to the graph step
    _assert_same_training(fresh, answered)


@pytest.mark.timeout(420)
def test_rows_written_behind_and_read_through_their_owner_train_as_written_through(
    tmp_path: Path, default_run: TrainedRun
) -> None:
    """One worker, rows written behind every 5 pushes (`service.row_flush_pushes`): the
    trainer reads them through their owner (`POST /v1/rows`: the replica's memory, where
    memcached lags by up to 4 pushes), and trains exactly as with rows written through
    and read from memcached: the same losses, dense weights and rows (after a pause, which
    writes them); the rows it counts as created (read as new from their owner, not
    `add`ed) are the same too. A row read from memcached while written behind would be
    up to four Adam steps (~0.08) behind."""
    through = default_run
    behind = _train_fresh(tmp_path, "behind", flush_pushes=5)
    _assert_same_training(through, behind)
    assert behind[4] == through[4] and sum(through[4].values()) > 0


def _train_in_turns(
    tmp_path: Path, tag: str, *, cache_mb: int
) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """Worker 0 trains 4 batches, worker 1 the next 4 (the same hot ids), worker 0 the
    last 4, one at a time; returns every loss, the rows afterwards and how many rows
    worker 0 took from its pushes' answers (`[store] trainer_cache_mb = cache_mb`)."""
    import keras

    from trainer import Trainer
    from trainer.data import SyntheticSource
    from trainer.models import build_model

    source = SyntheticSource(20_000, seed=5)
    batches = list(source.batches(256))[:12]
    # rows written through: rows read through their owner are not kept from answers
    store = f"[store]\ntrainer_cache_mb = {cache_mb}\n[service]\nrow_flush_pushes = 1\n"
    path = _cluster_file(tmp_path / f"{tag}.toml", mode="async", workers=2, store=store)
    with _running(path, tmp_path / f"run-{tag}"):
        config = load_config(path)
        models = []
        for _ in range(2):  # the same layer names (hence dense parameter names) twice
            keras.backend.clear_session()
            keras.utils.set_random_seed(1)
            models.append(build_model("mlp", source.schema, config, hidden=(32, 16), seed=3))
        with (
            Trainer(config, models[0], progress=False, worker_index=0) as first,
            Trainer(config, models[1], progress=False, worker_index=1) as second,
        ):
            results = [
                first.fit(batches[:4]),
                second.fit(batches[4:8]),
                first.fit(batches[8:]),
            ]
            answered = first.rows_answered
        ids = {
            f"C{i}": np.unique(np.concatenate([np.asarray(b.features[f"C{i}"]) for b in batches]))
            for i in range(1, 27)
        }

        async def stored() -> dict[str, Any]:
            # a pause writes what the replica holds behind: memcached alone may be one
            # timed flush behind in one run and not in the other
            async with OptimizerClient(config) as client:
                await client.pause(timeout_s=30)
                await client.resume()
            async with EmbeddingStore(config) as store:
                return {t: await store.lookup(t, i, create=False) for t, i in ids.items()}

        rows = asyncio.run(stored())
    losses = np.array([loss for r in results for _, loss in r.losses])
    return losses, rows, answered


@pytest.mark.timeout(420)
def test_answered_rows_are_read_again_after_another_workers_pushes(tmp_path: Path) -> None:
    """A trainer takes the rows of ids its earlier pushes answered with instead of
    reading them, only while the replica's stamps show no other push in between: when
    worker 1 trained meanwhile, worker 0's next push shows it, and the rows worker 0
    had taken from its answers for the following batch are read again from the store.
    The same turns with the answers' rows never used (`trainer_cache_mb = 0`) train the
    same; a row not read again would be a whole Adam step (~0.02) behind."""
    plain = _train_in_turns(tmp_path, "plain", cache_mb=0)
    cached = _train_in_turns(tmp_path, "cached", cache_mb=64)
    assert plain[2] == 0 and cached[2] > 0
    assert plain[0].shape == (12,)
    np.testing.assert_allclose(cached[0], plain[0], rtol=1e-5)
    assert plain[1].keys() == cached[1].keys()
    for table in plain[1]:
        np.testing.assert_allclose(cached[1][table], plain[1][table], atol=1e-6)


@pytest.mark.timeout(420)
def test_answered_rows_with_two_replicas_train_as_reading_them(
    tmp_path: Path, read_after_every_push: TrainedRun
) -> None:
    """Two replicas each stamp their share of every push; one worker keeps the rows of
    both shares (the test inside `_train_fresh`) and trains exactly as reading every row
    after each push with one replica (nothing taken from any answer; each row is updated
    by the one replica that owns it, so the number of replicas changes no value)."""
    kept = _train_fresh(tmp_path, "kept", replicas=2)
    _assert_same_training(read_after_every_push, kept)


# the compact options, one dim each: each dim's tables travel as one group of 16-bit words
_COMPACT_TABLES = "".join(
    f'\n[[tables]]\nname = "C{i}"\n'
    + (
        'dim = 8\ndtype = "float16"\noptimizer = { name = "rowwise_adam", learning_rate = 0.02 }\n'
        if i <= 13
        else 'dim = 4\ndtype = "bfloat16"\noptimizer = { name = "adam", learning_rate = 0.02 }\n'
    )
    for i in range(1, 27)
)


@pytest.mark.timeout(420)
def test_compact_rows_answered_and_read_through_their_owner_train_as_read_from_memcached(
    tmp_path: Path,
) -> None:
    """float16 (rowwise_adam) and bfloat16 (adam) tables, rows written behind: the pushes'
    answers and the reads through the owner carry them as 16-bit words. The rows read
    through the owner are, bit for bit, those memcached holds once written, and training
    is the same as reading every row after each push (written through, nothing taken
    from an answer): the same losses, dense weights and stored rows."""
    read = _train_fresh(tmp_path, "c-read", tables=_COMPACT_TABLES, read_your_writes=False)
    owned: dict[str, Any] = {}
    kept = _train_fresh(
        tmp_path, "c-kept", tables=_COMPACT_TABLES, flush_pushes=5, through_owner=owned
    )
    assert read[3] == kept[3] == 26
    _assert_same_training(read, kept)
    assert owned.keys() == kept[2].keys()
    for table, rows in kept[2].items():
        np.testing.assert_array_equal(owned[table].view(np.uint32), rows.view(np.uint32))


@pytest.mark.timeout(420)
def test_rows_fed_to_the_graph_step_train_as_lookups_inside_it(
    tmp_path: Path, default_run: TrainedRun
) -> None:
    """Layers that name their batch column get their rows as arguments of the step's
    tf.function (looked up and deduplicated outside it); without `feature` every layer
    looks up inside the graph (a py_function each, reading after the last push's answer
    patched in): both train the same."""
    fed = default_run
    in_graph = _train_fresh(tmp_path, "in-graph", in_graph=True)
    assert (fed[3], in_graph[3]) == (26, 0)
    _assert_same_training(fed, in_graph)


_PEOPLE_TABLES = "".join(
    f'\n[[tables]]\nname = "{name}"\ndim = 8\nid_type = "string"\n'
    'optimizer = { name = "adam", learning_rate = 0.02 }\n'
    for name in ("job", "city", "tags")
)


def _people_csv(path: Path, rows: int, *, seed: int) -> tuple[Path, float]:
    """An Adult-like CSV, sorted by job as exported files often are: unscaled numbers
    (income ~ 1e5, a heavy-tailed gain up to 1e5, empties), text categories and a
    multivalued column. Returns the file and the AUC of the hidden model's logit."""
    rng = np.random.default_rng(seed)
    job = rng.integers(0, 8, rows)
    city = rng.integers(0, 50, rows)
    income = rng.normal(1.9e5, 1.0e5, rows).round()
    gain = np.where(rng.random(rows) < 0.85, 0.0, rng.pareto(1.1, rows) * 3000).clip(0, 99_999)
    ntags = rng.integers(0, 4, rows)
    tags = [[f"t{t}" for t in rng.integers(0, 12, k)] for k in ntags]
    hidden = np.random.default_rng(0)  # one hidden model for every file
    job_w, city_w, tag_w = hidden.normal(0, 1, 8), hidden.normal(0, 1, 50), hidden.normal(0, 1, 12)
    tag_mean = np.array([np.mean([tag_w[int(t[1:])] for t in ts]) if ts else 0.0 for ts in tags])
    logit = (
        job_w[job] + city_w[city] + tag_mean + 1.2 * (income - 1.9e5) / 1e5 + 1.5 * (gain > 0) - 0.8
    )
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    order = np.argsort(job, kind="stable")
    lines = ["income,job,gain,city,tags,label"]
    for i in order.tolist():
        inc = "" if i % 31 == 0 else repr(float(income[i]))
        lines.append(
            f"{inc},job{job[i]},{gain[i]:.0f},city{city[i]},{'|'.join(tags[i])},{labels[i]}"
        )
    path.write_text("\n".join(lines) + "\n")
    from trainer.metrics import auc

    return path, auc(labels.astype(np.float32), logit.astype(np.float32))


def _train_csv(config: Path, train: Path, evals: Path, out: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "trainer.cli", "--config", str(config)]
    cmd += ["--data", f"csv:{train}", "--eval-data", f"csv:{evals}", "--label", "label"]
    cmd += ["--categorical", "job,city", "--numeric", "income,gain", "--multivalued", "tags"]
    cmd += ["--batch-size", "256", "--hidden", "32,16", "--output", str(out), "--no-progress"]
    done = subprocess.run(
        [*cmd, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        check=False,
    )
    return f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("cluster", [("async", 1, _PEOPLE_TABLES)], indirect=True, ids=["csv"])
def test_a_raw_csv_with_unscaled_numbers_trains_and_evaluates_a_separate_file(
    cluster: Path, tmp_path: Path
) -> None:
    """Issue: a raw CSV (numbers ~1e5) collapsed to AUC 0.5. Standardized with the training
    rows' statistics, shuffled across epochs, evaluated on a file of its own, it learns."""
    from trainer.data import CsvSource
    from trainer.numeric import fit_numeric_stats

    train, _ = _people_csv(tmp_path / "train.csv", 12_000, seed=1)
    evals, best_auc = _people_csv(tmp_path / "eval.csv", 3_001, seed=2)
    out = tmp_path / "summary.json"
    stats_path = tmp_path / "run" / "stats.json"
    log = _train_csv(
        cluster, train, evals, out, "--epochs", "3", "--numeric-stats", str(stats_path)
    )
    assert log.startswith("exit 0"), log
    s = json.loads(out.read_text())
    assert s["eval_examples"] == 3_001  # the whole eval file, not --eval-batches of it
    assert s["examples"] == 3 * 12_000  # the whole train file, every epoch
    first_loss = s["history"]["losses"][0][1]
    assert first_loss < 1.0, first_loss  # unscaled numbers saturated the sigmoid: ~12
    assert s["eval_auc"] > best_auc - 0.08 and s["eval_auc"] > 0.7, (s["eval_auc"], best_auc)
    # the statistics are the training file's, saved with the run and in the summary
    want = fit_numeric_stats(
        CsvSource(train, label="label", numeric=["income", "gain"]), split="all"
    )
    assert s["numeric_stats"] == json.loads(stats_path.read_text()) == want.to_dict()
    # bad input: an empty eval file, an eval file lacking a column: clear errors, exit 1
    empty = tmp_path / "empty.csv"
    empty.write_text("income,job,gain,city,tags,label\n")
    log = _train_csv(cluster, train, empty, out, "--numeric-stats", str(stats_path))
    assert log.startswith("exit 1") and "the file has no examples" in log, log
    lacking = tmp_path / "lacking.csv"
    lacking.write_text("income,job,city,tags,label\n1,job1,city1,t1,0\n")
    log = _train_csv(cluster, train, lacking, out)
    assert log.startswith("exit 1") and "unknown columns ['gain']" in log, log
