"""`deploy/cluster.sh` (lookup_table.ops.localcluster): up twice, status, down leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lookup_table.ops.localcluster import (
    REQUESTS_PER_EVENT,
    MemcachedProcess,
    _server_pid,
    free_port,
    hashpower_for,
    local_threads,
    start_memcached,
)
from tests.conftest import assert_lru_options, memcached_settings

pytestmark = pytest.mark.integration


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lookup_table.ops.localcluster", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _alive(pid: int) -> bool:
    """Running: neither gone nor a zombie (exited; init reaps the processes `up` started,
    whose parent has exited, in its own time)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.mark.timeout(180)
def test_up_twice_status_down_leaves_no_process(tmp_path: Path) -> None:
    ports = [free_port(), free_port(), free_port()]
    config = tmp_path / "cluster.toml"
    config.write_text(
        f'namespace = "c{uuid.uuid4().hex[:8]}"\n'
        f'memcached = ["127.0.0.1:{ports[0]}", "127.0.0.1:{ports[1]}"]\n'
        f'optimizers = ["http://127.0.0.1:{ports[2]}"]\n'
        '[[tables]]\nname = "user"\ndim = 4\n'
    )
    run = tmp_path / "run"
    args = ["--config", str(config), "--run-dir", str(run), "--memory-mb", "16"]
    try:
        first = _cli("up", *args, cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        assert first.stdout.count("started") == 3
        pids = sorted(int(p.read_text()) for p in run.glob("*.pid"))
        assert len(pids) == 3 and all(_alive(p) for p in pids)

        second = _cli("up", *args, cwd=tmp_path)
        assert second.returncode == 0, second.stderr
        assert second.stdout.count("already running") == 3
        assert sorted(int(p.read_text()) for p in run.glob("*.pid")) == pids

        # another run dir (no pid files): the nodes' ports are taken by processes it did
        # not start, and it says so rather than starting anything
        other = ["--config", str(config), "--run-dir", str(tmp_path / "other")]
        taken = _cli("up", *other, "--memory-mb", "16", cwd=tmp_path)
        assert taken.returncode == 1 and "the port is taken" in taken.stderr, taken.stderr
        assert not list((tmp_path / "other").glob("*.pid"))

        status = _cli("status", *args, cwd=tmp_path)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "sentinel ok" in status.stdout and "healthy" in status.stdout
    finally:
        down = _cli("down", *args, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not list(run.glob("*.pid"))
    assert not any(_alive(p) for p in pids)
    after = _cli("status", *args, cwd=tmp_path)
    assert after.returncode == 1 and "DOWN" in after.stdout


@pytest.mark.timeout(30)
def test_local_nodes_run_without_eviction_and_serve_whole_pipelines() -> None:
    """The command line a local node really runs with (memcached's own `stats settings`)."""
    node = MemcachedProcess(host="127.0.0.1", port=free_port(), memory_mb=16, threads=3)
    settings = memcached_settings(node.command(), node.port)
    assert settings["evictions"] == "off"  # -M
    assert settings["num_threads"] == "3"
    assert settings["reqs_per_event"] == str(REQUESTS_PER_EVENT)
    assert settings["udpport"] == "0"
    assert settings["hashpower_init"] == str(hashpower_for(16))
    assert_lru_options(settings)


@pytest.mark.parametrize(
    ("cores", "nodes", "threads"),
    [(1, 1, 1), (2, 2, 1), (2, 1, 1), (4, 2, 1), (8, 2, 2), (16, 2, 4), (64, 2, 4), (8, 0, 4)],
)
def test_local_nodes_get_half_the_cores_between_them(
    monkeypatch: pytest.MonkeyPatch, cores: int, nodes: int, threads: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert local_threads(nodes) == threads


def test_a_node_removes_its_temporary_log_when_stopped_and_keeps_a_given_one(
    tmp_path: Path,
) -> None:
    """Thousands of test nodes must not leave thousands of empty logs in /tmp."""
    node = start_memcached(memory_mb=16)
    log = node.log_path
    assert log is not None and log.exists()
    node.restart_empty()  # the same log across a restart
    assert node.log_path == log and log.exists()
    node.stop()
    assert not log.exists()
    node.stop()  # twice is fine

    given = tmp_path / "node.log"
    node = start_memcached(memory_mb=16, log_path=given)
    node.stop()
    assert given.exists()  # a log the caller named is the caller's


def test_a_node_on_a_taken_port_fails_naming_the_holder_and_leaves_it_serving() -> None:
    """Another memcached accepting on the port is not taken for ours (which cannot bind it
    and exits): `start` raises naming the holder's pid, and the holder keeps serving."""
    holder = start_memcached(memory_mb=16)
    try:
        node = MemcachedProcess(host=holder.host, port=holder.port, memory_mb=16)
        with pytest.raises(RuntimeError, match=rf"taken by another process \(pid {holder.pid}\)"):
            node.start(timeout_s=5.0)
        assert node.proc is None or node.proc.poll() is not None
        assert _server_pid(holder.host, holder.port) == holder.pid
    finally:
        holder.stop()
