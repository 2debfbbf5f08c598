"""Shared fixtures: real memcached processes on free 127.0.0.1 ports, always cleaned up.

`--memcached host:port` (repeatable) uses outside servers instead of starting
our own for the session-wide cluster; tests that kill or restart nodes always
start their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from pymemcache.client.base import Client as SyncClient

from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, parse_config
from lookup_table.ops.localcluster import (
    LRU_OPTIONS,
    MemcachedProcess,
    free_port,
    memcached_cluster,
    stop_process,
    wait_for_port,
)
from lookup_table.store import EmbeddingStore

# With filterwarnings=error, a failing hypothesis test would crash the session
# (INTERNALERROR) instead of reporting: on failure the plugin imports its patch
# helper, whose libcst import warns (mypy_extensions.TypedDict is deprecated).
# Import it once here, with that warning ignored.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # libcst not installed: the plugin skips the patch
        pass

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--memcached",
        action="append",
        default=[],
        help="use this memcached host:port instead of starting servers (repeatable)",
    )


@pytest.fixture(scope="session")
def memcached_nodes(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Addresses of a 2-node memcached cluster shared by the whole session."""
    outside: list[str] = request.config.getoption("--memcached")
    if outside:
        yield outside
        return
    with memcached_cluster(2, memory_mb=256) as servers:
        yield [s.address for s in servers]


@pytest.fixture
def own_nodes() -> Iterator[list[MemcachedProcess]]:
    """Two memcached servers of this test alone (to kill, restart or fill)."""
    with memcached_cluster(2, memory_mb=64) as servers:
        yield servers


DEFAULT_TABLES: list[dict[str, Any]] = [
    {"name": "user", "dim": 16, "seed": 1},
    {"name": "item", "dim": 64, "seed": 2, "initializer": {"name": "normal", "stddev": 0.1}},
    {"name": "word", "dim": 8, "seed": 3, "id_type": "string"},
]


# Two SGD tables (exact values to check; one with string ids) and an Adam one (slots).
SERVICE_TABLES: list[dict[str, Any]] = [
    {"name": "user", "dim": 8, "seed": 1, "optimizer": {"name": "sgd", "learning_rate": 0.5}},
    {
        "name": "word",
        "dim": 4,
        "seed": 2,
        "id_type": "string",
        "optimizer": {"name": "sgd", "learning_rate": 0.25},
    },
    {"name": "ads", "dim": 16, "seed": 3},  # adam, the default
]


def make_config(
    nodes: list[str], *, tables: list[dict[str, Any]] | None = None, **overrides: Any
) -> ClusterConfig:
    """A cluster config over `nodes` with a fresh namespace (tests never share rows)."""
    raw: dict[str, Any] = {
        "namespace": "t" + uuid.uuid4().hex[:12],
        "memcached": nodes,
        "tables": DEFAULT_TABLES if tables is None else tables,
        "store": {"timeout_s": 5.0},
    }
    raw.update(overrides)
    return parse_config(raw, env={})


async def written(config: ClusterConfig, *, timeout_s: float = 30.0) -> None:
    """Rows written behind (`service.row_flush_pushes` > 1) reach memcached at a flush:
    pause every replica (a pause flushes) and resume. Tests that read memcached after
    pushes call this first; nothing to do when rows are written through."""
    if config.service.row_flush_pushes <= 1:
        return

    async with OptimizerClient(config) as client:
        await client.pause(timeout_s=timeout_s)
        await client.resume()


async def serve_replica(config: ClusterConfig, aiohttp_server: Any, replica: int) -> Any:
    """Replica `replica` of `config`: the real app, on its port of `config.optimizers`."""
    from prometheus_client import CollectorRegistry

    from optimizer_service.app import make_app

    port = int(config.optimizers[replica].rsplit(":", 1)[1])
    return await aiohttp_server(
        make_app(config, replica=replica, registry=CollectorRegistry()), port=port
    )


async def serve_replicas(
    nodes: list[str], aiohttp_server: Any, *, count: int = 2
) -> tuple[ClusterConfig, list[Any]]:
    """A fresh namespace of SERVICE_TABLES (sentinels written) served by `count` replicas
    on free ports: (its config, their test servers)."""
    ports = [free_port() for _ in range(count)]
    config = make_config(
        nodes, tables=SERVICE_TABLES, optimizers=[f"http://127.0.0.1:{p}" for p in ports]
    )
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    return config, [await serve_replica(config, aiohttp_server, k) for k in range(count)]


def worker_metrics(config: ClusterConfig, name: str) -> dict[str, float]:
    """One per-worker series of replica 0's /metrics (e.g. `lookup_table_worker_loss`),
    by worker."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(config.optimizers[0] + "/metrics", timeout=10) as got:
        text = got.read().decode()
    return {
        s.labels["worker"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def sigstop(pid: int, *, timeout_s: float = 5.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped.

    kill() returns before the stop reaches every thread: a worker thread still
    running can answer one more request, more often on a loaded machine.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    task_dir = f"/proc/{pid}/task"
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(task_dir):
            with open(f"{task_dir}/{tid}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state in "tT" for state in states):
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP")


@pytest.fixture
def config(memcached_nodes: list[str]) -> ClusterConfig:
    return make_config(memcached_nodes)


@pytest.fixture
async def store(config: ClusterConfig) -> AsyncIterator[EmbeddingStore]:
    """An initialized store (sentinels written) on the shared cluster, fresh namespace."""
    async with EmbeddingStore(config) as s:
        await s.write_sentinels()
        yield s


@pytest.fixture(params=["inline", "thread"])
def in_order(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a creating lookup puts its rows in the ids' order: after its adds, or in
    a thread while they are in flight (`lookup_table.store.api._OVERLAP_FLOATS`), for every
    batch whatever its size."""
    import lookup_table.store.api

    monkeypatch.setattr(
        lookup_table.store.api, "_OVERLAP_FLOATS", 1 << 62 if request.param == "inline" else 0
    )
    return str(request.param)


@contextlib.contextmanager
def raw_client(address: str) -> Iterator[SyncClient]:
    """A plain pymemcache client of one node, to look at what is really stored.

    Writes wait for memcached's answer (pymemcache's default is noreply: a set could
    still be in flight when the test's next read runs, seen on a loaded machine)."""
    host, port = address.split(":")
    client = SyncClient((host, int(port)), connect_timeout=2, timeout=2, default_noreply=False)
    try:
        yield client
    finally:
        client.close()


def node_stat(address: str, name: str) -> int:
    """One `stats` counter of a memcached node."""
    with raw_client(address) as client:
        return int(client.stats()[name.encode()])


def assert_lru_options(settings: Mapping[str, str]) -> None:
    """A node's `stats settings` show `LRU_OPTIONS`, and the LRU maintainer's other jobs
    still on: slab rebalancing and the crawler that reclaims expired rows."""
    for pair in LRU_OPTIONS.split(","):
        name, value = pair.split("=")
        assert float(settings[name]) == float(value), (name, settings[name])
    assert settings["lru_maintainer_thread"] == "yes"
    assert settings["slab_automove"] == "1"
    assert settings["lru_crawler"] == "yes"


def memcached_settings(argv: list[str], port: int) -> dict[str, str]:
    """Start memcached with `argv` (listening on 127.0.0.1:`port`), return its `stats
    settings`, stop it: what a deployment's command line really configures."""
    if os.geteuid() == 0:
        argv = [*argv, "-u", "root"]  # deployments run as their own user; memcached refuses root
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for_port("127.0.0.1", port, timeout_s=10, proc=proc), proc.stdout and (
            proc.stdout.read()
        )
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"stats settings\r\n")
            data = b""
            deadline = time.monotonic() + 5
            while not data.endswith(b"END\r\n") and time.monotonic() < deadline:
                data += sock.recv(65536)
        return dict(
            line.split(" ", 2)[1:] for line in data.decode().splitlines() if line.startswith("STAT")
        )
    finally:
        stop_process(proc, timeout_s=10)
        if proc.stdout is not None:
            proc.stdout.close()
