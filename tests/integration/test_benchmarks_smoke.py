"""The benchmarks must keep running: `python -m benchmarks.<name> --quick` end to end for
store, optimizer, train, checkpoint, sizing, scaling and push_replay (and
write_coalescing, which needs no server).

The figures of a quick run mean nothing (3 rounds of 8,192 or 4,096 ids, or 10
or 12 training steps); this only checks that each script starts its cluster (and
service), measures every method, writes its report and stops what it started. A run
is mostly imports and start-ups that keep one core busy at most, so the selected runs
go two at a time from the first test on, each test checking its own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("ceiling", "lookup", "create", "mixed", "mixed_eval", "pymemcache")
RATIOS = (
    "lookup/ceiling",
    "lookup/pymemcache",
    "create/ceiling",
    "mixed/lookup",
    "mixed_eval/lookup",
)
SIDE_BY_SIDE = 2  # quick runs at once: the machine's cores in CI


@dataclass(frozen=True)
class QuickRun:
    """How a test runs its benchmark: extra arguments and the seconds it may take alone."""

    args: tuple[str, ...] = ()
    timeout_s: float = 120.0


# the test of benchmark <name> is test_<name>_benchmark_...
QUICK_RUNS = {
    # the PyTorch baselines have their own test (test_benchmarks_torch.py)
    "train": QuickRun(("--profile", "--torch", "off"), timeout_s=270),
    "scaling": QuickRun(timeout_s=130),
    "push_replay": QuickRun(("--row-flush-pushes", "4", "--replicas", "2")),
    "sizing": QuickRun(timeout_s=130),
    "checkpoint": QuickRun(timeout_s=180),
    "store": QuickRun(),
    "optimizer": QuickRun(timeout_s=140),
    "write_coalescing": QuickRun(),
}


@dataclass
class _Done:
    returncode: int | None  # None: timed out (then terminated)
    stdout: str
    stderr: str


class QuickRuns:
    """The quick runs of the selected tests, SIDE_BY_SIDE at a time; `report(name)` waits
    for one."""

    def __init__(self, names: Sequence[str], out_dir: Path) -> None:
        self._out_dir = out_dir
        self._procs: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        self._closing = False
        self._pool = ThreadPoolExecutor(SIDE_BY_SIDE, thread_name_prefix="quick-run")
        self._runs: dict[str, Future[_Done]] = {
            name: self._pool.submit(self._run, name) for name in names
        }

    def _run(self, name: str) -> _Done:
        """`python -m benchmarks.<name> --quick [args]`; on a timeout it gets SIGTERM, so it
        stops the cluster it started."""
        run = QUICK_RUNS[name]
        (self._out_dir / name).mkdir()
        with self._lock:
            if self._closing:
                return _Done(None, "", "not started: the tests ended")
            # An explicit environment: with env=None the child execs with the C
            # `environ`, which a test on the main thread may reallocate (setenv)
            # while this thread's vfork child reads it; exec then fails with
            # EFAULT ("Bad address").
            proc = subprocess.Popen(
                [sys.executable, "-m", f"benchmarks.{name}", "--quick", *run.args]
                + ["--out-dir", str(self._out_dir / name)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=dict(os.environ),
            )
            self._procs.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            stdout, stderr = proc.communicate(timeout=25)
            return _Done(None, stdout, stderr)
        return _Done(proc.returncode, stdout, stderr)

    def report(self, name: str, *, expect: str) -> tuple[dict[str, Any], Path]:
        """Wait for `name`'s run; check it succeeded and printed `expect`; return its JSON
        report and the directory it wrote to."""
        done = self._runs[name].result()
        output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        if done.returncode is None:
            pytest.fail(f"timed out; {output}")
        assert done.returncode == 0, output
        assert expect in done.stdout, done.stdout
        out = self._out_dir / name
        report: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
        return report, out

    def close(self) -> None:
        """Stop what still runs (a test failed or was interrupted before its run ended)."""
        with self._lock:
            self._closing = True
            for proc in self._procs:
                if proc.poll() is None:
                    proc.terminate()
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def quick_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[QuickRuns]:
    """The runs of this module's selected tests, started in the tests' order when the first
    of them starts: when a test starts, the runs of the tests before it have ended, so it
    waits for its own run alone."""
    here = Path(__file__)
    names = []
    for item in request.session.items:
        if Path(item.path) == here:
            name = item.name.removeprefix("test_").partition("_benchmark_")[0]
            assert name in QUICK_RUNS, f"{item.name}: no quick run for {name!r}"
            names.append(name)
    runs = QuickRuns(names, tmp_path_factory.mktemp("quick-runs"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_store_benchmark_quick_run_writes_its_report(quick_runs: QuickRuns) -> None:
    report, out = quick_runs.report("store", expect="lookup/ceiling")
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

    many = report["many_tables"]
    assert (many["tables"], many["unique_ids_per_table"]) == (26, 400)
    for method in ("many", "concurrent", "many_mixed", "concurrent_mixed"):
        assert len(many["seconds_per_round"][method]) == 3
    assert set(many["speedup_median_of_paired_rounds"]) == {
        "concurrent/many",
        "concurrent_mixed/many_mixed",
    }
    assert all(r > 0 for r in many["speedup_median_of_paired_rounds"].values())

    life = report["lifecycle"]
    for method in (
        "hit",
        "hit_ttl",
        "mixed",
        "mixed_ttl",
        "mixed_admit_count",
        "mixed_admit_add",
    ):
        assert len(life["seconds_per_round"][method]) == 3
    assert set(life["ratios"]) == {
        "hit_ttl/hit",
        "mixed_ttl/mixed",
        "mixed_admit_count/mixed",
        "mixed_admit_add/mixed",
    }
    assert all(r > 0 for r in life["ratios_median_of_paired_rounds"].values())

    keys = report["key_encoding"]
    assert set(keys["ratios"]) == {"naive_loop/encode_keys", "naive_loop/int_key_matrix"}
    assert (out / "store.png").stat().st_size > 0


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_optimizer_benchmark_quick_run_writes_its_report(quick_runs: QuickRuns) -> None:
    report, out = quick_runs.report("optimizer", expect="http/inprocess")
    assert report["benchmark"] == "optimizer"
    assert {"timestamp", "machine", "code", "parameters", "acceptance_targets"} <= set(report)
    assert {"dim16", "dim64"} <= set(report)
    assert {"nproc", "python", "numpy", "aiohttp", "memcached"} <= set(report["machine"])
    assert report["machine"]["memcached"].startswith("memcached ")
    params = report["parameters"]
    assert (params["rounds"], params["ids_per_push"], params["quick"]) == (3, 4096, True)
    assert params["dims"] == [16, 64]
    assert report["acceptance_targets"] == {"http/inprocess": 0.8}
    assert params["cache_mb"] == 0  # the row cache off: the baseline makes the same reads

    for dim in (16, 64):
        result = report[f"dim{dim}"]
        for method in ("http", "inprocess"):
            rounds = result["seconds_per_round"][method]
            assert len(rounds) == 3 and all(t > 0 for t in rounds), (dim, method, rounds)
            assert result["median_seconds"][method] > 0
            assert result["rows_per_s"][method] > 0
        ratio = result["ratio_http_vs_inprocess"]
        assert ratio == pytest.approx(
            result["rows_per_s"]["http"] / result["rows_per_s"]["inprocess"]
        )
        assert ratio > 0 and result["ratio_median_of_paired_rounds"] > 0
        split = result["http_split_mean_seconds"]
        assert 0 < split["inside_apply"] < split["total"]
        assert set(result["acceptance"]) == {"http/inprocess >= 0.8"}
    assert (out / "optimizer.png").stat().st_size > 0


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_train_benchmark_quick_run_writes_its_report(quick_runs: QuickRuns) -> None:
    """`python -m benchmarks.train --quick --profile`: Keras dense Adam, lazy Adam, a local
    cluster and the MLP alone, 12 steps each; then the profiled run's cost table."""
    from lookup_table.ops.localcluster import wait_for_port

    report, out = quick_runs.report("train", expect="distributed/lazy Adam examples/s")
    assert report["benchmark"] == "train"
    assert {"timestamp", "machine", "code", "parameters", "summary", "rounds"} <= set(report)
    assert {"nproc", "python", "tensorflow", "keras", "memcached"} <= set(report["machine"])
    params = report["parameters"]
    assert (params["steps"], params["warmup"], params["rounds"], params["quick"]) == (
        12,
        2,
        1,
        True,
    )
    assert params["batch_size"] == 1024
    assert report["acceptance_targets"] == {
        "distributed/local examples/s": 1.0,
        "distributed/local examples per CPU-second": 1.0,
        "abs eval AUC gap": 0.01,
    }

    rounds = report["rounds"]
    assert [r["method"] for r in rounds] == ["local", "lazy_adam", "distributed", "mlp_floor"]
    assert report["summary"]["skipped"] == {
        "torchrec": "skipped: --torch off",
        "torch_sparse_adam": "skipped: --torch off",
    }
    for r in rounds:
        assert r["steps"] == 12 and r["timed_steps"] == 10
        assert len(r["losses"]) == 12 and all(0 < x < 10 for x in r["losses"])
        assert r["examples_per_s"] > 0 and r["seconds"] > 0
        assert 0 <= r["eval_auc"] <= 1 and r["eval_logloss"] > 0
        assert r["eval_examples"] == 2 * 1024
        assert r["attempt"] == 0 and isinstance(r["disturbed"], bool)  # --quick: no retries
        assert all(v >= 0 for v in r["cpu"]["cpu_ms_per_step"].values())
    local, lazy, dist, floor = rounds
    for r in (local, lazy, floor):
        assert set(r["cpu"]["cpu_ms_per_step"]) == {r["method"]}
    assert set(dist["cpu"]["cpu_ms_per_step"]) == {
        "trainer",
        "optimizer",
        "memcached-1",
        "memcached-2",
    }
    assert dist["data_digest"] == params["data"]["digest"]
    assert dist["rows_created"] > 0 and dist["final_version"] >= 12
    assert dist["service_log_errors"] == []

    summary = report["summary"]
    assert summary["ratio_distributed_vs_local"] == pytest.approx(
        summary["distributed"]["examples_per_s"] / summary["local"]["examples_per_s"]
    )
    assert summary["auc_gap_distributed_minus_local"] == pytest.approx(
        summary["distributed"]["eval_auc"] - summary["local"]["eval_auc"]
    )
    assert summary["ratio_examples_per_cpu_s"] > 0
    assert summary["ratio_distributed_vs_lazy_adam"] == pytest.approx(
        summary["distributed"]["examples_per_s"] / summary["lazy_adam"]["examples_per_s"]
    )
    assert summary["ratio_examples_per_cpu_s_vs_lazy_adam"] == pytest.approx(
        summary["distributed"]["examples_per_cpu_s"] / summary["lazy_adam"]["examples_per_cpu_s"]
    )
    assert summary["auc_gap_distributed_minus_lazy_adam"] == pytest.approx(
        summary["distributed"]["eval_auc"] - summary["lazy_adam"]["eval_auc"]
    )
    per_process = summary["distributed"]["cpu_ms_per_step"]
    lazy_step = summary["lazy_adam"]["total_cpu_ms_per_step"]
    assert summary["ratio_trainer_cpu_vs_lazy_adam_step"] == pytest.approx(
        per_process["trainer"] / lazy_step
    )
    assert summary["ratio_infrastructure_cpu_vs_lazy_adam_step"] == pytest.approx(
        (per_process["optimizer"] + per_process["memcached-1"] + per_process["memcached-2"])
        / lazy_step
    )
    assert len(summary["lazy_adam_acceptance"]) == 5 and len(report["lazy_adam_targets"]) == 5
    costs = report["profile"]["costs"]
    assert set(costs) == {"trainer", "optimizer", "memcached-1", "memcached-2"}
    for c in costs.values():  # the split adds up to the process's CPU
        split = c["math_ms_per_step"] + c["bytes_ms_per_step"] + c["else_ms_per_step"]
        assert c["cpu_ms_per_step"] > 0 and split == pytest.approx(c["cpu_ms_per_step"])
    assert costs["trainer"]["samples"] > 0 and costs["optimizer"]["samples"] > 0
    assert 0.5 < summary["reference_auc_hidden_model"] <= 1
    assert len(summary["acceptance"]) == 3
    assert (out / "train.png").stat().st_size > 0

    # the cluster was stopped: nothing listens on its ports any more
    for address in dist["cluster"]["memcached"]:
        host, port = address.rsplit(":", 1)
        assert not wait_for_port(host, int(port), timeout_s=0.2), address
    service = dist["cluster"]["optimizers"][0].removeprefix("http://")
    host, port = service.rsplit(":", 1)
    assert not wait_for_port(host, int(port), timeout_s=0.2), service


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_checkpoint_benchmark_quick_run_writes_its_report(quick_runs: QuickRuns) -> None:
    """`python -m benchmarks.checkpoint --quick`: 50,000 rows, 2 rounds, both cases."""
    report, _ = quick_runs.report("checkpoint", expect="save/ceiling_read")
    assert report["benchmark"] == "checkpoint"
    assert {"timestamp", "machine", "code", "parameters", "acceptance_targets"} <= set(report)
    assert report["machine"]["memcached"].startswith("memcached ")
    params = report["parameters"]
    assert (params["rows"], params["rounds"], params["quick"]) == (50_000, 2, True)
    assert params["cases"] == ["rows", "adam"] and params["nodes"] == 2
    assert report["acceptance_targets"] == {"save/ceiling_read": 0.5, "restore/ceiling_read": 0.5}
    for case in ("rows", "adam"):
        result = report[case]
        for method in ("ceiling_read", "save", "restore", "ceiling_write"):
            rounds = result["seconds_per_round"][method]
            assert len(rounds) == 2 and all(t > 0 for t in rounds), (case, method, rounds)
            assert result["rows_per_s"][method] == pytest.approx(
                50_000 / result["median_seconds"][method]
            )
        assert set(result["ratios"]) == {
            "save/ceiling_read",
            "restore/ceiling_read",
            "restore/ceiling_write",
        }
        assert all(r > 0 for r in result["ratios"].values())
        assert len(result["acceptance"]) == 2


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_sizing_benchmark_quick_run_writes_its_report(quick_runs: QuickRuns) -> None:
    """`python -m benchmarks.sizing --quick`: 10,000 rows per case, dims 8/16/64, sgd and adam."""
    report, _ = quick_runs.report("sizing", expect="GiB of -m per 100M rows")
    assert report["benchmark"] == "sizing"
    assert {"timestamp", "machine", "code", "parameters", "results"} <= set(report)
    assert report["machine"]["memcached"].startswith("memcached ")
    params = report["parameters"]
    assert (params["rows"], params["quick"]) == (10_000, True)
    assert params["dims"] == [8, 16, 64] and params["optimizers"] == ["sgd", "adam"]
    assert params["nodes"] == ["defaults", "compact"]
    fp32 = [r for r in report["results"] if r["dtype"] == "float32"]
    every = {(r["nodes"], r["dim"], r["optimizer"]): r for r in fp32}
    assert len(every) == len(fp32) == 12 and len(report["results"]) == 18
    results = {(d, o): r for (nodes, d, o), r in every.items() if nodes == "defaults"}
    assert set(results) == {(d, o) for d in (8, 16, 64) for o in ("sgd", "adam")}
    for (dim, optimizer), r in results.items():
        assert r["rows"] == 10_000
        assert r["slot_width"] == (2 * dim + 1 if optimizer == "adam" else 0)
        # an item is memcached's header + key + value: more than key and value alone
        payload = sum(r["key_bytes"].values()) + 4 * (dim + r["slot_width"])
        p = r["per_row"]
        assert payload < p["item_bytes"] < payload + 64  # one item: the row and its slots
        assert p["item_bytes"] <= p["chunk_bytes"] <= p["m_bytes"] * 1.01
        assert p["m_bytes_measured"] > 0 and p["rss_bytes_measured"] > 0
        assert r["gib_of_m_per_100m_rows"] == pytest.approx(p["m_bytes"] * 1e8 / 2**30)
        assert r["snapshots"]["full"]["curr_items"] >= 10_000
    for dim in (8, 16, 64):  # slots cost memory
        assert (
            results[(dim, "adam")]["per_row"]["m_bytes"]
            > results[(dim, "sgd")]["per_row"]["m_bytes"]
        )
    for (nodes, dim, optimizer), r in every.items():
        b = r["item_breakdown"]  # adds up to memcached's own item size (checked as it ran)
        assert b["item"] == r["item_bytes"]["row"] and b["chunk"] == r["per_row"]["chunk_bytes"]
        assert b["cas"] == (8 if nodes == "defaults" else 0)
        if nodes == "compact":  # a class of the item's own size: 8 bytes of rounding at most
            assert 0 <= b["class_rounding"] < 8
            assert (
                r["per_row"]["chunk_bytes"]
                < every[("defaults", dim, optimizer)]["per_row"]["chunk_bytes"]
            )
        assert r["per_row"]["bookkeeping_bytes"] < 1  # the journals' chunks are gone
    compact = {(p["option"], p["dim"]): p for p in report["targets"]}
    assert len(compact) == 6  # each measured on its own compact node
    for p in compact.values():
        assert p["chunk_bytes"] < p["fp32_adam_chunk_bytes"]
        assert p["met"] is None or p["chunk_bytes"] <= p["target_chunk_bytes"]
    assert [p["met"] for p in compact.values() if p["target_chunk_bytes"]] == [True] * 3


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_scaling_benchmark_quick_run_writes_its_report(quick_runs: QuickRuns) -> None:
    """`python -m benchmarks.scaling --quick`: 1 trainer, then 2, 10 steps each, on fresh
    clusters."""
    from lookup_table.ops.localcluster import wait_for_port

    report, out = quick_runs.report("scaling", expect="trainers/core")
    assert report["benchmark"] == "scaling"
    assert {"timestamp", "machine", "code", "parameters", "summary", "runs"} <= set(report)
    params = report["parameters"]
    assert (params["steps"], params["warmup"], params["rounds"], params["quick"]) == (
        10,
        3,
        1,
        True,
    )
    assert params["batch_size"] == 1024 and params["order"] == [1, 2]

    components = {"trainer", "optimizer", "memcached-1", "memcached-2"}
    for r, n in zip(report["runs"], (1, 2), strict=True):
        assert r["trainers"] == n and r["window_s"] > 0
        assert set(r["examples"]) == {f"trainer-{i}" for i in range(n)}
        assert r["examples_total"] == pytest.approx(sum(r["examples"].values()))
        assert all(v > 0 for v in r["examples"].values())
        per_1000 = r["cpu_ms_per_1000_examples"]
        assert components <= set(per_1000)
        assert per_1000["trainer"] > 0 and per_1000["optimizer"] > 0
        # rows written behind, a node has little to do in a quick run: maybe not one tick
        assert per_1000["memcached-1"] >= 0 and per_1000["memcached-2"] >= 0
        assert r["service_log_errors"] == []
        # the cluster was stopped: nothing listens on its ports any more
        for address in [*r["cluster"]["memcached"], *r["cluster"]["optimizers"]]:
            host, port = address.removeprefix("http://").rsplit(":", 1)
            assert not wait_for_port(host, int(port), timeout_s=0.2), address

    summary = report["summary"]
    sizing = summary["sizing"]
    assert components | {"memcached (all nodes)", "all (per trainer)"} == set(sizing)
    rate = summary["trainer_examples_per_s"]
    for row in sizing.values():
        cores = row["cpu_ms_per_1000_examples"] / 1e3 * rate / 1e3
        assert row["cores_per_trainer"] == pytest.approx(cores)
        assert row["trainers_per_core"] == (pytest.approx(1 / cores) if cores else math.inf)
    val = summary["validation_2_trainers"]
    assert set(val["per_1000_ratio_2_vs_1"]) == components
    assert set(val["cores"]) == {"optimizer", "memcached-1", "memcached-2"}
    assert val["cores"]["optimizer"]["predicted"] > 0 and val["cores"]["optimizer"]["measured"] > 0
    assert all(v["predicted"] >= 0 and v["measured"] >= 0 for v in val["cores"].values())
    assert val["examples_per_s_total"]["predicted"] > 0
    assert (out / "scaling.png").stat().st_size > 0


@pytest.mark.timeout(150)
def test_write_coalescing_benchmark_quick_run_counts_every_interval(quick_runs: QuickRuns) -> None:
    """`python -m benchmarks.write_coalescing --quick`: no servers, the demo's data replayed."""
    report, _ = quick_runs.report("write_coalescing", expect="of write-through")
    assert report["benchmark"] == "write_coalescing"
    assert report["parameters"] == {"batches": 60, "batch_size": 1024, "tables": 26}
    per_push = report["unique_ids_per_push"]
    assert 0 < report["in_previous_push"] <= report["in_any_earlier_push"] <= per_push
    rows = report["intervals"]
    assert [r["every_pushes"] for r in rows] == [1, 2, 5, 10, 20]  # those within 30 batches
    assert rows[0]["ratio"] == pytest.approx(1.0)
    ratios = [r["ratio"] for r in rows]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 1.0


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_push_replay_benchmark_quick_run_measures_both_cases(quick_runs: QuickRuns) -> None:
    """`python -m benchmarks.push_replay --quick --row-flush-pushes 4 --replicas 2`: two fresh
    clusters of two replicas writing rows behind (the reads go through the owners), each
    stopped; every process of each measured, the replicas summed."""
    report, _ = quick_runs.report("push_replay", expect="tables / one table")
    assert report["benchmark"] == "push_replay"
    assert report["parameters"] == {
        "steps": 15,
        "warmup": 5,
        "rounds": 1,
        "batch": 1024,
        "service": {"row_flush_pushes": 4},
        "replicas": 2,
    }
    for case in ("tables", "one table"):
        (run,) = report["runs"][case]
        assert {"optimizer-0", "optimizer-1", "memcached-1", "memcached-2", "client"} <= set(run)
        assert run["optimizer-0"] > 0 and run["optimizer-1"] > 0
        assert run["memcached-1"] > 0 and run["memcached-2"] > 0
        assert run["optimizer"] == pytest.approx(run["optimizer-0"] + run["optimizer-1"])
        assert run["memcached"] == pytest.approx(run["memcached-1"] + run["memcached-2"])
        assert run["infrastructure"] == pytest.approx(run["optimizer"] + run["memcached"])
    assert report["tables_over_one_table"] == pytest.approx(
        report["median"]["tables"]["infrastructure"]
        / report["median"]["one table"]["infrastructure"]
    )
