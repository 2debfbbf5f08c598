"""Soak: 2 trainer processes + 1 optimizer service + 2 fresh memcached nodes for minutes.

Two real `python -m trainer.cli` processes train one model (six tables with Adam, Adagrad
and SGD) for `LOOKUP_TABLE_SOAK_S` seconds (default 60) counted from when both step,
while the test samples every process's RSS and the service's `/metrics`. The promise
(docs/guarantees.md): after warm-up the service's RSS less its row cache grows by less
than 10 %, and nothing fails. The samples go to `soak.json` and `soak.png` under the
test's tmp_path. `test_soak_10_minutes` is the long variant (`LOOKUP_TABLE_SLOW=1`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lookup_table import EmbeddingStore
from lookup_table.config import load_config
from lookup_table.ops.localcluster import MemcachedProcess, free_port, memcached_cluster
from tests.reliability.harness import (
    REPO,
    ServiceProcess,
    cluster_file,
    rss_bytes,
    wait_healthy,
)

SOAK_S = float(os.environ.get("LOOKUP_TABLE_SOAK_S", "60"))
SLOW_SOAK_S = 600.0
SAMPLE_S = 2.0
# The trainers train for soak + this, each from its own first batch: room for one of
# them to start stepping this much later than the other (TensorFlow's import and first
# trace on a loaded machine).
SKEW_ALLOWANCE_S = 20.0
STARTUP_TIMEOUT_S = 150.0  # both trainers stepping, from their launch
MAX_RSS_GROWTH = 0.10
MEMCACHED_MB = 1024  # -M: a full node would be an error; rows keep being created

# Six columns of the synthetic data: tiny (C9: 3 ids, C20: 4), hot (C1: 1460) and huge
# vocabularies (C3: 10M, C12: 8M, C16: 5M), so some rows are updated all the time and
# new rows are created every step; three optimizers (rows + slots, rows only).
COLUMNS = ["C1", "C3", "C9", "C12", "C16", "C20"]
_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "C1": {"name": "adam", "learning_rate": 0.01},
    "C3": {"name": "adam", "learning_rate": 0.01},
    "C9": {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9},
    "C12": {"name": "adagrad", "learning_rate": 0.05},
    "C16": {"name": "sgd", "learning_rate": 0.05},
    "C20": {"name": "adam", "learning_rate": 0.01},
}
TABLES = [{"name": c, "dim": 8, "optimizer": _OPTIMIZERS[c]} for c in COLUMNS]


def _budget_s(soak_s: float) -> int:
    """pytest-timeout for one soak: startup, the run, the skew allowance, teardown."""
    return int(STARTUP_TIMEOUT_S + soak_s + SKEW_ALLOWANCE_S + 90)


# ------------------------------------------------------------------ the trainers


@dataclass
class _Trainer:
    worker: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    summary_path: Path

    @classmethod
    def start(cls, config: Path, out: Path, worker: int, max_seconds: float) -> _Trainer:
        log_path = out / f"trainer-{worker}.log"
        summary_path = out / f"summary-{worker}.json"
        cmd = [
            sys.executable,
            "-m",
            "trainer.cli",
            "--config",
            str(config),
            "--data",
            "synthetic:1000000",
            "--categorical",
            ",".join(COLUMNS),
            "--numeric",
            "I1,I2,I3",
            "--batch-size",
            "128",
            "--hidden",
            "32,16",
            "--max-seconds",
            str(max_seconds),
            "--eval-batches",
            "2",
            "--worker-index",
            str(worker),
            "--num-workers",
            "2",
            "--output",
            str(summary_path),
            "--no-progress",
        ]
        if worker == 1:  # pipelined: concurrent pushes, prefetched rows, overlapping dense pulls
            cmd += ["--pushes-in-flight", "2"]
        env = {k: v for k, v in os.environ.items() if k != "LOOKUP_TABLE_TOKEN"}
        env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(worker, proc, log_path, summary_path)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def summary(self) -> dict[str, Any]:
        assert self.summary_path.exists(), (
            f"trainer {self.worker} wrote no summary; its log:\n{self.log()[-3000:]}"
        )
        summary: dict[str, Any] = json.loads(self.summary_path.read_text())
        return summary


# ------------------------------------------------------------------ sampling


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples `name` (e.g. "lookup_table_pushes_total") whose labels match."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _http_5xx(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lookup_table_http_requests_total" and sample.labels.get(
                "status", ""
            ).startswith("5"):
                key = f"{sample.labels.get('endpoint')} {sample.labels['status']}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclass
class _Run:
    soak_s: float
    max_seconds: float
    warmup_s: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    t_both: float | None = None  # both trainers initialized their dense weights
    t_end: float | None = None  # the first trainer exited
    metrics: str = ""  # the last /metrics scrape, after both trainers exited

    # -- figures

    def window(self) -> list[dict[str, Any]]:
        """The samples taken while both trainers were stepping."""
        assert self.t_both is not None and self.t_end is not None
        return [
            s
            for s in self.samples
            if self.t_both <= s["t"] < self.t_end and None not in s["trainers"]  # not exiting
        ]

    def baseline(self) -> dict[str, Any]:
        assert self.t_both is not None
        after = [s for s in self.window() if s["t"] >= self.t_both + self.warmup_s]
        assert after, f"no sample after the warm-up of {self.warmup_s:.0f} s\n{self.table()}"
        return after[0]

    def figures(self) -> dict[str, Any]:
        window = self.window()
        base, end = self.baseline(), window[-1]
        after = [s for s in window if s["t"] >= base["t"]]
        growth = (end["service"] - end["cache"] - (base["service"] - base["cache"])) / (
            base["service"] - base["cache"]
        )
        return {
            "soak_s": self.soak_s,
            "both_stepping_s": round(end["t"] - window[0]["t"], 1),
            "warmup_s": self.warmup_s,
            "service_rss_mb_start": _mb(window[0]["service"]),
            "service_rss_mb_warm": _mb(base["service"]),
            "service_rss_mb_end": _mb(end["service"]),
            "service_rss_mb_peak": _mb(max(s["service"] for s in after)),
            "service_rss_growth": round(growth, 4),
            "memcached_rss_mb_warm": [_mb(v) for v in base["memcached"]],
            "memcached_rss_mb_end": [_mb(v) for v in end["memcached"]],
            "trainer_rss_mb_warm": [_mb(v) for v in base["trainers"]],
            "trainer_rss_mb_end": [_mb(v) for v in end["trainers"]],
            "pushes_in_window": end["pushes"] - window[0]["pushes"],
        }

    def table(self) -> str:
        """Every sample, one line each: what a failure message shows."""
        lines = ["   t s  phase   service MB  memcached MB     trainers MB      pushes  dense GETs"]
        for s in self.samples:
            phase = "start"
            if self.t_both is not None and s["t"] >= self.t_both:
                phase = "warm" if s["t"] < self.t_both + self.warmup_s else "soak"
            if self.t_end is not None and s["t"] >= self.t_end:
                phase = "end"
            lines.append(
                f"{s['t']:6.1f}  {phase:6} {_mb(s['service'])!s:>10}  "
                f"{' '.join(f'{_mb(v)!s:>6}' for v in s['memcached'])}  "
                f"{' '.join(f'{_mb(v)!s:>7}' for v in s['trainers'])}  "
                f"{s['pushes']:>10.0f}  {s['dense_gets']:>10.0f}"
            )
        return "\n".join(lines)

    def write(self, out: Path) -> Path:
        path = out / "soak.json"
        doc = {
            "soak_s": self.soak_s,
            "max_seconds": self.max_seconds,
            "warmup_s": self.warmup_s,
            "t_both": self.t_both,
            "t_end": self.t_end,
            "samples": self.samples,
        }
        if self.t_both is not None and self.t_end is not None and self.window():
            try:
                doc["figures"] = self.figures()
            except AssertionError:
                pass
        path.write_text(json.dumps(doc, indent=1))
        return path

    def plot(self, out: Path) -> Path | None:
        """soak.png: RSS of every process and the push counts over time (also on failure)."""
        if not self.samples:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        def mb(value: int | None) -> float:
            return math.nan if value is None else value / 2**20

        t = [s["t"] for s in self.samples]
        fig, (ax_service, ax_rss, ax_push) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
        ax_service.plot(t, [mb(s["service"]) for s in self.samples], label="optimizer service")
        try:
            base = mb(self.baseline()["service"])
        except AssertionError:  # the run did not get past the warm-up
            base = math.nan
        if not math.isnan(base):
            ax_service.axhline(base, color="grey", linewidth=0.8, label="after the warm-up")
            ax_service.axhline(
                base * (1 + MAX_RSS_GROWTH), color="red", linewidth=0.8, label="+10 %: fails"
            )
        ax_service.set_ylabel("service RSS (MB)")
        ax_service.set_ylim(bottom=0)
        for i in range(2):
            ax_rss.plot(t, [mb(s["memcached"][i]) for s in self.samples], label=f"memcached {i}")
            ax_rss.plot(t, [mb(s["trainers"][i]) for s in self.samples], label=f"trainer {i}")
        ax_rss.set_ylabel("RSS (MB)")
        ax_push.plot(t, [s["pushes"] for s in self.samples], label="pushes applied")
        ax_push.plot(t, [s["dense_gets"] for s in self.samples], "--", label="GET /v1/dense")
        ax_push.set_ylabel("count")
        ax_push.set_xlabel("seconds since the trainers were launched")
        for ax in (ax_service, ax_rss, ax_push):
            ax.legend(fontsize="small")
            if self.t_both is not None:
                for x in (self.t_both, self.t_both + self.warmup_s, self.t_end):
                    if x is not None:
                        ax.axvline(x, color="grey", linestyle=":")
        fig.tight_layout()
        path = out / "soak.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


async def _sample_until_done(
    run: _Run,
    service: ServiceProcess,
    servers: list[MemcachedProcess],
    trainers: list[_Trainer],
) -> None:
    """Sample every SAMPLE_S seconds until both trainers have exited."""
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        while True:
            tick = time.monotonic()
            async with http.get(service.url + "/metrics") as resp:
                assert resp.status == 200, await resp.text()
                text = await resp.text()
            running = [t.proc.poll() is None for t in trainers]
            sample = {
                "t": round(tick - started, 2),
                "service": rss_bytes(service.pid),
                # the row cache grows to its bound by design (service.cache_mb): the
                # service's other memory is what must stay flat
                "cache": _metric(text, "lookup_table_row_cache_bytes"),
                "memcached": [rss_bytes(s.pid) for s in servers],
                "trainers": [
                    rss_bytes(t.proc.pid) if r else None
                    for t, r in zip(trainers, running, strict=True)
                ],
                "running": running,
                "pushes": _metric(text, "lookup_table_pushes_total", status="applied"),
                "dense_inits": _metric(
                    text, "lookup_table_http_requests_total", endpoint="/v1/dense/init"
                ),
                "dense_gets": _metric(
                    text, "lookup_table_http_requests_total", endpoint="/v1/dense"
                ),
            }
            run.samples.append(sample)
            assert sample["service"] is not None, (
                f"the optimizer service is gone (exit code {service.exit_code()}):\n"
                f"{service.log()[-3000:]}"
            )
            if run.t_both is None and sample["dense_inits"] >= 2:
                run.t_both = sample["t"]
            if run.t_end is None and not all(running):
                run.t_end = sample["t"]
                failed = [t for t in trainers if t.proc.returncode not in (None, 0)]
                assert not failed, (
                    f"trainer {failed[0].worker} exited {failed[0].proc.returncode} after "
                    f"{sample['t']:.0f} s:\n{failed[0].log()[-4000:]}\n{run.table()}"
                )
            if not any(running):
                run.metrics = text
                return
            if run.t_both is None and tick - started > STARTUP_TIMEOUT_S:
                logs = "\n".join(f"--- trainer {t.worker}\n{t.log()[-2000:]}" for t in trainers)
                raise AssertionError(
                    f"both trainers not stepping within {STARTUP_TIMEOUT_S:.0f} s\n{logs}"
                )
            if tick - started > STARTUP_TIMEOUT_S + run.max_seconds + 60:
                raise AssertionError(f"the trainers did not stop\n{run.table()}")
            await _sleep_until(tick + SAMPLE_S)


async def _sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))


# ------------------------------------------------------------------ the soak


async def _soak(soak_s: float, tmp_path: Path) -> None:
    run = _Run(
        soak_s=soak_s,
        max_seconds=soak_s + SKEW_ALLOWANCE_S,
        warmup_s=round(max(30.0, 0.3 * soak_s), 1),
    )
    with memcached_cluster(2, memory_mb=MEMCACHED_MB) as servers:
        port = free_port()
        path = cluster_file(
            tmp_path,
            [s.address for s in servers],
            port,
            tables=TABLES,
            workers=2,
            sections={"optimizer": {"name": "adam", "learning_rate": 0.002}},
        )
        config = load_config(path)
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
        service = ServiceProcess(path, port, tmp_path, log_level="INFO")
        trainers: list[_Trainer] = []
        try:
            service.start()
            await wait_healthy(service, timeout_s=60)
            trainers = [_Trainer.start(path, tmp_path, w, run.max_seconds) for w in range(2)]
            await _sample_until_done(run, service, servers, trainers)
        finally:
            for trainer in trainers:
                trainer.kill()
            service.terminate()
            service.kill()
            run.write(tmp_path)
            run.plot(tmp_path)
        log = service.log()

    # -- no error
    for t in trainers:
        assert t.proc.returncode == 0, f"trainer {t.worker}:\n{t.log()[-4000:]}"
        assert "Traceback" not in t.log(), t.log()[-4000:]
    summaries = [t.summary() for t in trainers]
    for bad in ("unexpected error", "Traceback"):
        assert bad not in log, f"{bad!r} in the service log:\n{log[-4000:]}"
    # nothing went wrong quietly either (a journal replay, a failed memcached stats, ...)
    warnings = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    assert not warnings, "\n".join(warnings[:20])
    metrics = run.metrics
    assert not _http_5xx(metrics), f"5xx answers: {_http_5xx(metrics)}"
    rejected = _metric(metrics, "lookup_table_rejected_pushes_total")
    assert rejected == 0, f"{rejected:.0f} pushes rejected"
    assert _metric(metrics, "lookup_table_node_evictions") == 0
    assert _metric(metrics, "lookup_table_node_up") == 2
    steps = [s["steps"] for s in summaries]
    pushes = _metric(metrics, "lookup_table_pushes_total", status="applied")
    version = _metric(metrics, "lookup_table_version")
    # every step pushes once (embedding rows + dense gradients), each applied exactly once,
    # and each dense update is a new model version
    assert pushes == sum(steps) > 0, (pushes, steps)
    assert version == sum(steps), (version, steps)
    for s in summaries:
        assert s["max_seconds"] == run.max_seconds
        assert s["seconds"] >= soak_s, s  # stopped by time, not by the data
        assert s["final_version"] > 0
        assert sum(s["rows_created"].values()) > 0, s["rows_created"]

    # -- both trainers stepped together for the whole soak, in a steady stream
    assert run.t_both is not None and run.t_end is not None
    window = run.window()
    both_s = window[-1]["t"] - window[0]["t"]
    assert both_s >= soak_s - 2 * SAMPLE_S, (
        f"both trainers stepped together for only {both_s:.0f} s of {soak_s:.0f}: one "
        f"started more than {SKEW_ALLOWANCE_S:.0f} s after the other\n{run.table()}"
    )
    quiet = [
        (a["t"], b["t"])
        for a, b in zip(window, window[5:], strict=False)
        if b["pushes"] <= a["pushes"]
    ]
    assert not quiet, f"no push between t={quiet[0][0]} and {quiet[0][1]} s\n{run.table()}"

    # -- the service's memory stays flat
    figures = run.figures()
    print(  # noqa: T201 - the soak's report, shown with -s
        f"\nsoak {soak_s:.0f} s: {both_s:.0f} s with both trainers stepping, steps {steps}, "
        f"{pushes:.0f} pushes, version {version:.0f}\n"
        f"service RSS {figures['service_rss_mb_start']} MB at start, "
        f"{figures['service_rss_mb_warm']} MB after the {run.warmup_s:.0f} s warm-up, "
        f"{figures['service_rss_mb_end']} MB at the end (peak {figures['service_rss_mb_peak']}):"
        f" {100 * figures['service_rss_growth']:+.1f} %\n"
        f"memcached RSS {figures['memcached_rss_mb_warm']} -> "
        f"{figures['memcached_rss_mb_end']} MB, trainers {figures['trainer_rss_mb_warm']} -> "
        f"{figures['trainer_rss_mb_end']} MB\nsamples: {tmp_path / 'soak.json'}, plot: "
        f"{tmp_path / 'soak.png'}"
    )
    assert figures["service_rss_growth"] < MAX_RSS_GROWTH, (
        f"the service's RSS grew {100 * figures['service_rss_growth']:.1f} % after the warm-up "
        f"({figures['service_rss_mb_warm']} -> {figures['service_rss_mb_end']} MB)\n"
        f"{run.table()}"
    )


@pytest.mark.timeout(_budget_s(SOAK_S))
async def test_soak_two_trainers_service_memory_stays_flat(tmp_path: Path) -> None:
    """2 trainers + 1 service + 2 memcached nodes, LOOKUP_TABLE_SOAK_S (60) seconds:
    service RSS growth < 10 % after the warm-up, no error, every push applied once."""
    await _soak(SOAK_S, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LOOKUP_TABLE_SLOW") != "1", reason="long soak: set LOOKUP_TABLE_SLOW=1"
)
@pytest.mark.timeout(_budget_s(SLOW_SOAK_S))
async def test_soak_10_minutes(tmp_path: Path) -> None:
    """The same soak for 10 minutes."""
    await _soak(SLOW_SOAK_S, tmp_path)
