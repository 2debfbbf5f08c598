"""No lost and no doubled update: 8 client processes, 2 optimizer replicas, hot rows.

Eight `tests.reliability._pusher` processes push 200 steps each at once, over Zipf-hot ids
that repeat within a push, through `OptimizerClient` to two real replicas on a fresh
2-node cluster; the crash variant (100 steps each) kill -9's replica 1 three times
meanwhile. Every row is then read back: SGD rows equal init - lr * (sum of their
gradients), computed from the workload; every Adam row's step equals the pushes that
touched it; untouched ids have no row (or the one a lookup created). docs/guarantees.md
states the promise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from lookup_table import EmbeddingStore, initial_rows
from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.sharding import owner_of
from lookup_table.ops.localcluster import MemcachedProcess, free_port
from tests.reliability import _pusher
from tests.reliability.harness import REPO, ServiceProcess, cluster_file, wait_healthy

logger = logging.getLogger(__name__)

N_PROCS = 8
N_PUSHES = 200
# The crash run's kills land in its first seconds (each once pushes flow through the
# restarted replica): the pushes after the last one add time, not proof.
CRASH_PUSHES = 100
N_REPLICAS = 2
KILLS = 3
VICTIM = 1  # the replica the crash test kills
RUN_BUDGET_S = 90.0  # a hang bound: a run takes 15-60 s on a loaded 2-core machine


# ------------------------------------------------------------------ the expectation


@dataclass
class _Expected:
    """What the store must hold after every push was applied exactly once."""

    grad_sums: dict[str, np.ndarray] = field(default_factory=dict)  # float64 (pool, dim)
    touches: dict[str, np.ndarray] = field(default_factory=dict)  # int (pool,): pushes per id


def _expected(n_pushes: int) -> _Expected:
    out = _Expected()
    index = {t: {v: k for k, v in enumerate(_pusher.pool(t).tolist())} for t in _pusher.DIMS}
    for table, dim in _pusher.DIMS.items():
        out.grad_sums[table] = np.zeros((_pusher.POOL_SIZE, dim), dtype=np.float64)
        out.touches[table] = np.zeros(_pusher.POOL_SIZE, dtype=np.int64)
    for proc in range(N_PROCS):
        for i in range(n_pushes):
            for table, (ids, grads) in _pusher.make_push(proc, i).items():
                rows = np.array([index[table][v] for v in ids.tolist()], dtype=np.intp)
                np.add.at(out.grad_sums[table], rows, grads.astype(np.float64))
                out.touches[table][np.unique(rows)] += 1
    return out


# ------------------------------------------------------------------ processes


class _Pushers:
    """The client processes, each in its own session (killed with its group in `kill`)."""

    def __init__(self, config_path: Path, tmp_path: Path, run: str) -> None:
        self.dir = tmp_path / "pushers"
        self.dir.mkdir()
        self.start_file = self.dir / "start"
        self.config_path = config_path
        self.run = run
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, *, pushes: int, max_retries: int, backoff_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if k != "LOOKUP_TABLE_TOKEN"}
        for proc in range(N_PROCS):
            cmd = [
                sys.executable,
                "-m",
                "tests.reliability._pusher",
                "--config",
                str(self.config_path),
                "--proc",
                str(proc),
                "--pushes",
                str(pushes),
                "--run",
                self.run,
                "--ready",
                str(self.dir / f"{proc}.ready"),
                "--start",
                str(self.start_file),
                "--out",
                str(self.dir / f"{proc}.json"),
                "--max-retries",
                str(max_retries),
                "--backoff-s",
                str(backoff_s),
            ]
            with open(self.dir / f"{proc}.log", "ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=REPO,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def log(self, proc: int) -> str:
        path = self.dir / f"{proc}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    async def release(self, *, timeout_s: float = 45.0) -> float:
        """Wait until every process is ready, then open the barrier; returns the time."""
        deadline = time.monotonic() + timeout_s
        while not all((self.dir / f"{k}.ready").exists() for k in range(N_PROCS)):
            for k, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise AssertionError(f"pusher {k} exited ({p.returncode}):\n{self.log(k)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the pushers were not ready within {timeout_s} s")
            await asyncio.sleep(0.02)
        began = time.time()
        self.start_file.touch()
        return began

    async def wait(self, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the pushers did not finish within {timeout_s} s (a push hangs or the "
                    f"service is too slow)"
                )
            await asyncio.sleep(0.05)

    def reports(self) -> list[dict[str, Any]]:
        out = []
        for k, p in enumerate(self.procs):
            path = self.dir / f"{k}.json"
            assert p.returncode is not None
            assert path.exists(), (
                f"pusher {k} exited {p.returncode} without a report:\n" + (self.log(k)[-3000:])
            )
            report: dict[str, Any] = json.loads(path.read_text())
            assert report["error"] is None and p.returncode == 0, (
                f"pusher {k} failed: {report['error']}\n{report.get('traceback', '')}"
            )
            out.append(report)
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)


_METRIC_RE = re.compile(r"^(lookup_table_\w+)\{([^}]*)\}\s+(\S+)$", re.MULTILINE)


async def _scrape(http: aiohttp.ClientSession, service: ServiceProcess) -> dict[str, float]:
    """Counters of one replica: applied pushes, and HTTP answers by status class."""
    async with http.get(service.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out = {"applied": 0.0, "duplicate": 0.0, "4xx": 0.0, "5xx": 0.0}
    for name, labels, value in _METRIC_RE.findall(text):
        if name == "lookup_table_pushes_total" and 'status="applied"' in labels:
            out["applied"] += float(value)
        elif name == "lookup_table_pushes_total" and 'status="duplicate"' in labels:
            out["duplicate"] += float(value)
        elif name == "lookup_table_http_requests_total":
            status = re.search(r'status="(\d)\d\d"', labels)
            if status and status.group(1) in "45":
                out[f"{status.group(1)}xx"] += float(value)
    return out


# ------------------------------------------------------------------ the run


@dataclass
class _Outcome:
    config: ClusterConfig
    reports: list[dict[str, Any]]
    began: float
    elapsed_s: float
    # (kill time, restart time, healthy-again time) of the victim
    kills: list[tuple[float, float, float]]
    metrics: list[dict[str, float]]  # each replica at the end (the victim: since its restart)
    victim_5xx: list[float]  # the victim's 5xx count just before each kill
    logs: list[str]


async def _killer(
    services: list[ServiceProcess], pushers: _Pushers, kills: list[tuple[float, float, float]]
) -> list[float]:
    """kill -9 the victim KILLS times, each at a random moment after pushes went through it
    since its (re)start; restart it and wait until it serves again."""
    victim = services[VICTIM]
    rng = random.Random(20_24_08)
    five_xx: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for _ in range(KILLS):
            while pushers.running():
                metrics = await _scrape(http, victim)
                if metrics["applied"] >= 3:  # pushes are flowing through this incarnation
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(rng.uniform(0.05, 1.0))
            if not pushers.running():
                return five_xx
            five_xx.append((await _scrape(http, victim))["5xx"])
            killed_at = time.time()
            victim.kill()
            victim.start()
            restarted_at = time.time()
            await wait_healthy(victim, timeout_s=30)
            kills.append((killed_at, restarted_at, time.time()))
    return five_xx


async def _run_load(nodes: list[str], tmp_path: Path, *, pushes: int, crash: bool) -> _Outcome:
    ports = [free_port() for _ in range(N_REPLICAS)]
    path = cluster_file(tmp_path, nodes, ports, tables=_pusher.TABLES)
    config = load_config(path)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        for table in _pusher.DIMS:  # half the cold ids get a row, none is ever pushed
            await store.lookup(table, _pusher.cold_ids(table)[:4])

    services = [
        ServiceProcess(path, port, tmp_path, replica=k, name=f"replica{k}")
        for k, port in enumerate(ports)
    ]
    pushers = _Pushers(path, tmp_path, uuid.uuid4().hex[:8])
    kills: list[tuple[float, float, float]] = []
    victim_5xx: list[float] = []
    try:
        for s in services:
            s.start()
        await asyncio.gather(*(wait_healthy(s) for s in services))
        # with a crash, a push waits for the restart (~1-3 s): retry often, for long enough
        pushers.spawn(
            pushes=pushes, max_retries=80 if crash else 6, backoff_s=0.02 if crash else 0.1
        )
        began = await pushers.release()
        if crash:  # the killer stops by itself when the pushers are done
            async with asyncio.TaskGroup() as group:
                killer = group.create_task(_killer(services, pushers, kills))
                group.create_task(pushers.wait(timeout_s=RUN_BUDGET_S))
            victim_5xx = killer.result()
        else:
            await pushers.wait(timeout_s=RUN_BUDGET_S)
        elapsed_s = time.time() - began
        reports = pushers.reports()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            metrics = [await _scrape(http, s) for s in services]
        for s in services:
            s.terminate()
    finally:
        pushers.kill()
        for s in services:
            s.kill()
    return _Outcome(
        config=config,
        reports=reports,
        began=began,
        elapsed_s=elapsed_s,
        kills=kills,
        metrics=metrics,
        victim_5xx=victim_5xx,
        logs=[s.log() for s in services],
    )


# ------------------------------------------------------------------ the checks


async def _check_store(config: ClusterConfig, expected: _Expected) -> None:
    """Every row and slot against the exactly-once expectation (see the module docstring)."""
    problems: list[str] = []
    async with EmbeddingStore(config) as store:
        for table, dim in _pusher.DIMS.items():
            spec = config.table(table)
            ids = _pusher.pool(table)
            touched = expected.touches[table] > 0
            assert touched.sum() >= _pusher.POOL_SIZE // 2, "the workload touches too few ids"
            assert 0 < (owner_of(table, ids[touched], N_REPLICAS) == 1).mean() < 1, (
                f"{table}: the touched ids are not split across both replicas"
            )
            items, found = await store.get(table, ids, slots=True)
            rows = items[:, :dim]
            if not np.array_equal(found, touched):
                problems.append(
                    f"{table}: rows exist for {int(found.sum())} ids, pushes touched "
                    f"{int(touched.sum())}; extra: {ids[found & ~touched][:5].tolist()}, "
                    f"missing: {ids[touched & ~found][:5].tolist()}"
                )
            init = initial_rows(spec.initializer, seed=spec.seed, ids=ids, dim=dim)
            if table in _pusher.LEARNING_RATES:
                lr = _pusher.LEARNING_RATES[table]
                want = init.astype(np.float64) - lr * expected.grad_sums[table]
                error = np.abs(rows.astype(np.float64) - want).max(axis=1)
                # words: dyadic gradients, every float32 sum is exact -> equality
                tolerance = 0.0 if table == "words" else 1e-5
                bad = np.flatnonzero(touched & (error > tolerance))
                if bad.size:
                    problems.append(
                        f"{table}: {bad.size} of {int(touched.sum())} rows differ from "
                        f"init - lr * sum(grads) by up to {error[bad].max():.3g} (> {tolerance}); "
                        f"e.g. id {ids.tolist()[bad[0]]!r} (touched by "
                        f"{expected.touches[table][bad[0]]} pushes) is off by "
                        f"{error[bad[0]]:.3g}: a push was lost or applied twice"
                    )
            else:  # adam: the per-row step count is the number of pushes applied to it
                assert items.shape[1] == dim + 2 * dim + 1  # the row, then m, v and its step
                steps = items[:, dim + 2 * dim].astype(np.int64)
                want_steps = expected.touches[table]
                bad = np.flatnonzero(touched & (steps != want_steps))
                if bad.size:
                    problems.append(
                        f"{table}: {bad.size} rows have a step count != the number of pushes "
                        f"that touched them (total {int(steps[touched].sum())} stored vs "
                        f"{int(want_steps.sum())} pushed); e.g. id {ids.tolist()[bad[0]]!r}: step "
                        f"{steps[bad[0]]}, pushes {want_steps[bad[0]]}"
                    )
                if (
                    not np.isfinite(rows[touched]).all()
                    or (rows[touched] == init[touched]).all(axis=1).any()
                ):
                    problems.append(f"{table}: a pushed row is not finite or did not move")
            # ids no push ever named: the looked-up half keeps its initial row and slots
            cold = _pusher.cold_ids(table)
            cold_items, cold_found = await store.get(table, cold, slots=True)
            cold_rows = cold_items[:, :dim]
            if cold_found.tolist() != [True] * 4 + [False] * (cold.size - 4):
                problems.append(f"{table}: cold ids changed existence: {cold_found.tolist()}")
            cold_init = initial_rows(spec.initializer, seed=spec.seed, ids=cold[:4], dim=dim)
            if not np.array_equal(cold_rows[:4], cold_init):
                problems.append(f"{table}: a row no push named changed")
            if table not in _pusher.LEARNING_RATES and cold_items[:, dim:].any():
                problems.append(f"{table}: the slots of an id no push named changed")
    assert not problems, "\n".join(problems)


def _check_logs(outcome: _Outcome) -> None:
    for k, log in enumerate(outcome.logs):
        assert "unexpected error" not in log and "Traceback" not in log, (
            f"replica {k} logged an error:\n{log[-3000:]}"
        )
        # the access log (a push answered just before a kill -9 may miss its line)
        statuses = re.findall(r'"POST /v1/gradients HTTP/1.1" (\d\d\d) ', log)
        assert statuses, f"replica {k}: no access log lines for pushes:\n{log[-2000:]}"
        assert set(statuses) == {"200"}, f"replica {k} answered {sorted(set(statuses))}"
    for k, m in enumerate(outcome.metrics):
        assert m["5xx"] == 0 and m["4xx"] == 0, f"replica {k} metrics: {m}"
    assert not any(outcome.victim_5xx), f"5xx before the kills: {outcome.victim_5xx}"


def _check_reports(outcome: _Outcome, n_pushes: int) -> list[dict[str, Any]]:
    pushes = [p for r in outcome.reports for p in r["pushes"]]
    assert len(pushes) == N_PROCS * n_pushes
    assert all(p["replicas"] == list(range(N_REPLICAS)) for p in pushes), (
        "a push did not reach both replicas"
    )
    # the processes really ran at the same time: every one pushed before any finished
    first_end = min(max(p["end"] for p in r["pushes"]) for r in outcome.reports)
    last_start = max(r["pushes"][0]["start"] for r in outcome.reports)
    assert last_start < first_end, "the pusher processes did not overlap"
    return pushes


# ------------------------------------------------------------------ the tests


@pytest.mark.timeout(150)
async def test_concurrent_processes_lose_and_double_no_update(
    own_nodes: list[MemcachedProcess], tmp_path: Path
) -> None:
    """8 processes x 200 pushes, Zipf-hot overlapping ids, 2 replicas: SGD rows ==
    init - lr * sum(grads), Adam step counts == pushes per row, untouched ids untouched."""
    expected = _expected(N_PUSHES)
    nodes = [n.address for n in own_nodes]
    outcome = await _run_load(nodes, tmp_path, pushes=N_PUSHES, crash=False)
    logger.info("no-crash run: %.1f s for %d pushes", outcome.elapsed_s, N_PROCS * N_PUSHES)
    pushes = _check_reports(outcome, N_PUSHES)
    assert all(p["applied"] and not p["duplicate"] for p in pushes)
    # each replica's own count: every part of every push applied exactly once
    assert [m["applied"] for m in outcome.metrics] == [len(pushes)] * N_REPLICAS, outcome.metrics
    _check_logs(outcome)
    await _check_store(outcome.config, expected)


@pytest.mark.timeout(150)
async def test_replica_killed_mid_run_applies_every_push_exactly_once(
    own_nodes: list[MemcachedProcess], tmp_path: Path
) -> None:
    """The same load (100 pushes a process) while replica 1 is kill -9'ed 3 times with
    pushes in flight and restarted (journal replay before serving); clients retry with the
    same push_id. The same exact checks hold: nothing lost, nothing applied twice."""
    expected = _expected(CRASH_PUSHES)
    nodes = [n.address for n in own_nodes]
    outcome = await _run_load(nodes, tmp_path, pushes=CRASH_PUSHES, crash=True)
    pushes = _check_reports(outcome, CRASH_PUSHES)
    logger.info(
        "crash run: %.1f s, kills (s after start, outage s): %s, journal replays: %d, "
        "pushes answered as duplicates (a retry found the done record): %d",
        outcome.elapsed_s,
        [(round(k - outcome.began, 2), round(h - k, 2)) for k, _, h in outcome.kills],
        outcome.logs[VICTIM].count("replaying journaled push"),
        sum(p["duplicate"] for p in pushes),
    )
    assert len(outcome.kills) == KILLS, f"only {len(outcome.kills)} kills landed mid-run"
    for n, (killed_at, restarted_at, healthy_at) in enumerate(outcome.kills):
        before = sum(p["end"] < killed_at for p in pushes)
        # in flight at the kill and done only once the new process was up: it waited out
        # the outage (it may finish before the killer's health poll sees the replica back)
        spanning = sum(p["start"] < killed_at and p["end"] > restarted_at for p in pushes)
        after = sum(p["start"] > healthy_at for p in pushes)
        assert before and spanning and after, (
            f"kill {n}: {before} pushes done before it, {spanning} in flight across it, "
            f"{after} started after the restart: the kill did not land mid-run"
        )
    _check_logs(outcome)
    await _check_store(outcome.config, expected)
