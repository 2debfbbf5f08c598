"""`deploy/cluster.sh` (lookup_table.ops.localcluster): up twice, status, down leaves nothing."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from lookup_table.ops.localcluster import (
    REQUESTS_PER_EVENT,
    MemcachedProcess,
    free_port,
    hashpower_for,
    local_threads,
    start_memcached,
)
from lookup_table.ops.localcluster.servers import server_pid
from tests.conftest import assert_lru_options, memcached_settings
from tests.reliability.harness import cluster_command, localcluster, process_running

pytestmark = pytest.mark.integration


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
        first = localcluster("up", *args, cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        assert first.stdout.count("started") == 3
        pids = sorted(int(p.read_text()) for p in run.glob("*.pid"))
        assert len(pids) == 3 and all(process_running(p) for p in pids)

        second = cluster_command("up", *args)
        assert second.returncode == 0, second.stderr
        assert second.stdout.count("already running") == 3
        assert sorted(int(p.read_text()) for p in run.glob("*.pid")) == pids

        # another run dir (no pid files): the nodes' ports are taken by processes it did
        # not start, and it says so rather than starting anything
        other = ["--config", str(config), "--run-dir", str(tmp_path / "other")]
        taken = cluster_command("up", *other, "--memory-mb", "16")
        assert taken.returncode == 1 and "the port is taken" in taken.stderr, taken.stderr
        assert not list((tmp_path / "other").glob("*.pid"))

        status = cluster_command("status", *args)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "sentinel ok" in status.stdout and "healthy" in status.stdout
    finally:
        down = cluster_command("down", *args)
    assert down.returncode == 0, down.stderr
    assert not list(run.glob("*.pid"))
    assert not any(process_running(p) for p in pids)
    after = cluster_command("status", *args)
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
        assert server_pid(holder.host, holder.port) == holder.pid
    finally:
        holder.stop()


def _file(path: Path, namespace: str, nodes: list[int], replica: int) -> Path:
    addresses = ", ".join(f'"127.0.0.1:{p}"' for p in nodes)
    path.write_text(
        f'namespace = "{namespace}"\n'
        f"memcached = [{addresses}]\n"
        f'optimizers = ["http://127.0.0.1:{replica}"]\n'
        '[[tables]]\nname = "user"\ndim = 4\n'
    )
    return path


@pytest.mark.timeout(240)
def test_two_cluster_files_share_a_run_dir_and_a_foreign_replica_port_is_refused(
    tmp_path: Path,
) -> None:
    """Pid files are keyed by address: `b` runs beside `a` (sharing one memcached node),
    `c` lists `a`'s replica port under another namespace and is refused before it starts
    anything, `status` flags a replica of another namespace, and each `down` stops only
    its own file's processes."""
    shared, own_b, own_c, port_a, port_b = (free_port() for _ in range(5))
    tag = uuid.uuid4().hex[:6]
    a = _file(tmp_path / "a.toml", f"a{tag}", [shared], port_a)
    b = _file(tmp_path / "b.toml", f"b{tag}", [shared, own_b], port_b)
    c = _file(tmp_path / "c.toml", f"c{tag}", [own_c], port_a)
    d = _file(tmp_path / "d.toml", f"a{tag}x", [shared], port_a)
    run = ["--run-dir", str(tmp_path / "run")]
    mem = ["--memory-mb", "16"]
    try:
        up_a = cluster_command("up", "--config", str(a), *run, *mem)
        assert up_a.returncode == 0, up_a.stderr
        up_b = cluster_command("up", "--config", str(b), *run, *mem)
        assert up_b.returncode == 0, up_b.stderr
        assert f"memcached 127.0.0.1:{shared}: already running" in up_b.stdout
        assert f"shared with the cluster file {a}" in up_b.stdout
        assert up_b.stdout.count("started") == 2, up_b.stdout  # its own node and replica
        pid_files = sorted(p.name for p in (tmp_path / "run").glob("*.pid"))
        assert pid_files == sorted(
            [
                f"memcached-127.0.0.1-{shared}.pid",
                f"memcached-127.0.0.1-{own_b}.pid",
                f"optimizer-127.0.0.1-{port_a}.pid",
                f"optimizer-127.0.0.1-{port_b}.pid",
            ]
        )
        pid_a = int((tmp_path / "run" / f"optimizer-127.0.0.1-{port_a}.pid").read_text())

        up_c = cluster_command("up", "--config", str(c), *run, *mem)
        assert up_c.returncode == 1, up_c.stdout
        assert "already running" not in up_c.stdout
        assert f"held by pid {pid_a}" in up_c.stderr and f"namespace 'a{tag}'" in up_c.stderr
        assert f"down --config {a}" in up_c.stderr, up_c.stderr
        assert not (tmp_path / "run" / f"memcached-127.0.0.1-{own_c}.pid").exists()

        status_b = cluster_command("status", "--config", str(b), *run)
        assert status_b.returncode == 0, status_b.stdout + status_b.stderr
        assert f"healthy, namespace 'b{tag}'" in status_b.stdout
        assert f"sentinel ok (namespace 'b{tag}')" in status_b.stdout

        status_d = cluster_command("status", "--config", str(d), *run)
        assert status_d.returncode == 1
        assert f"MISMATCH (it serves namespace 'a{tag}' as replica 0" in status_d.stdout
        assert "healthy" not in status_d.stdout.replace("UNHEALTHY", "")

        down_b = cluster_command("down", "--config", str(b), *run)
        assert down_b.returncode == 0, down_b.stderr
        assert f"memcached 127.0.0.1:{shared}: left running" in down_b.stdout
        status_a = cluster_command("status", "--config", str(a), *run)
        assert status_a.returncode == 0, status_a.stdout + status_a.stderr
    finally:
        pids = [int(p.read_text()) for p in (tmp_path / "run").glob("*.pid")]
        for config in (b, a):
            down = cluster_command("down", "--config", str(config), *run)
            assert down.returncode == 0, down.stderr
    assert not any(process_running(p) for p in pids)
    assert not list((tmp_path / "run").glob("*.pid"))


@pytest.mark.timeout(180)
def test_a_pid_file_of_a_live_unrelated_process_is_not_running(tmp_path: Path) -> None:
    """A pid reused by another program: `status` does not count it, `up` starts the node
    and the replica, `down` never signals that program."""
    node, replica = free_port(), free_port()
    config = _file(tmp_path / "c.toml", f"s{uuid.uuid4().hex[:6]}", [node], replica)
    run = tmp_path / "run"
    run.mkdir()
    args = ["--config", str(config), "--run-dir", str(run)]
    other = subprocess.Popen(["sleep", "120"])
    try:
        for name in (f"memcached-127.0.0.1-{node}.pid", f"optimizer-127.0.0.1-{replica}.pid"):
            (run / name).write_text(f"{other.pid}\n")
        status = cluster_command("status", *args)
        assert status.returncode == 1 and "DOWN" in status.stdout
        assert f"stale pid file (pid {other.pid} is not the process serving" in status.stdout
        up = cluster_command("up", *args, "--memory-mb", "16")
        assert up.returncode == 0, up.stderr
        assert "already running" not in up.stdout
        assert up.stdout.count("stale pid file removed") == 2
        assert up.stdout.count("started") == 2
        pids = [int(p.read_text()) for p in run.glob("*.pid")]
        assert other.pid not in pids and all(process_running(p) for p in pids)
        down = cluster_command("down", *args)
        assert down.returncode == 0, down.stderr
        assert not any(process_running(p) for p in pids)
        # its pid files back: `down` says they are stale and leaves the program alone
        for name in (f"memcached-127.0.0.1-{node}.pid", f"optimizer-127.0.0.1-{replica}.pid"):
            (run / name).write_text(f"{other.pid}\n")
        down = cluster_command("down", *args)
        assert down.returncode == 0 and "stopped" not in down.stdout, down.stdout
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        cluster_command("down", *args)
