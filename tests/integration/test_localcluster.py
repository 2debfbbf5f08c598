"""`deploy/cluster.sh` (lookup_table.ops.localcluster): up twice, status, down leaves nothing."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest

from lookup_table import EmbeddingStore
from lookup_table.memcached import commands
from lookup_table.ops.localcluster import (
    LRU_OPTIONS,
    REQUESTS_PER_EVENT,
    MemcachedProcess,
    free_port,
    hashpower_for,
    local_threads,
    start_memcached,
)
from lookup_table.ops.localcluster.options import (
    SLAB_CHUNK_MAX,
    default_slab_classes,
    item_bytes,
    row_item_bytes,
    slab_sizes,
)
from lookup_table.ops.localcluster.servers import memcached_binary, server_pid
from tests.conftest import assert_lru_options, make_config, memcached_settings
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


# ---------------------------------------------------------------- item bytes

SIZED_TABLES = [
    {"name": "user", "dim": 16, "seed": 1},  # Adam: 196 bytes of value
    {"name": "item_category", "dim": 8, "seed": 2, "optimizer": {"name": "sgd"}},  # 32
    {"name": "wide", "dim": 64, "seed": 3},  # Adam: 772
]


@pytest.mark.timeout(60)
async def test_a_row_item_takes_a_chunk_of_its_own_size_and_no_cas() -> None:
    """memcached's own accounting of a node started with the cluster file's classes: each
    table's rows sit in a class of their item's size (`row_item_bytes`, rounded up to 8),
    and each item is the bytes `item_bytes` counts (the header, no CAS, key, value)."""
    namespace = "t" + uuid.uuid4().hex[:12]
    sizes = row_item_bytes(make_config(["127.0.0.1:1"], tables=SIZED_TABLES, namespace=namespace))
    defaults = default_slab_classes()
    assert not {-(-s // 8) * 8 for s in sizes.values()} <= set(defaults)  # the test is needed
    node = start_memcached(memory_mb=16, slab_sizes=slab_sizes(sizes.values()))
    try:
        config = make_config([node.address], tables=SIZED_TABLES, namespace=namespace)
        ids = np.arange(500, dtype=np.int64) * 7
        async with EmbeddingStore(config) as store:
            await store.write_sentinels()
            for table in sizes:
                await store.lookup(table, ids)
        (spec,) = config.memcached
        settings = await commands.stats(spec, config.store, "settings")
        slabs = await commands.stats(spec, config.store, "slabs")
        items = await commands.stats(spec, config.store, "items")
    finally:
        node.stop()
    assert settings["cas_enabled"] == "no"
    used = {
        int(slabs[f"{c}:chunk_size"]): (
            int(slabs[f"{c}:used_chunks"]),
            int(items[f"items:{c}:mem_requested"]),
        )
        for c in {name.split(":", 1)[0] for name in slabs if ":" in name}
    }
    for table, size in sizes.items():
        chunks, requested = used[-(-size // 8) * 8]
        assert chunks == ids.shape[0], table
        assert requested == ids.shape[0] * size, table
    expected = {
        table: item_bytes(len(f"{config.namespace}/{table}/w/") + 12, 4 * width)
        for table, width in (("user", 16 * 3 + 1), ("item_category", 8), ("wide", 64 * 3 + 1))
    }
    assert sizes == expected


def test_slab_sizes_add_a_class_of_each_row_size_to_memcacheds_own() -> None:
    defaults = default_slab_classes()
    assert defaults[:6] == [96, 120, 152, 192, 240, 304] and defaults[-1] < SLAB_CHUNK_MAX
    classes = [int(s) for s in slab_sizes([284, 116, 152, 61]).split("-")]
    assert classes[:8] == [64, 96, 120, 152, 192, 240, 288, 304]
    assert classes[8:] == defaults[6:]
    # memcached wants classes more than 8 bytes apart: the default one gives way
    assert [int(s) for s in slab_sizes([298]).split("-")][:6] == [96, 120, 152, 192, 240, 304]
    assert [int(s) for s in slab_sizes([290, 298]).split("-")][:6] == [96, 120, 152, 192, 240, 304]
    with pytest.raises(ValueError, match="at most 62"):
        slab_sizes(range(50, 5000, 40))
    with pytest.raises(ValueError, match="from 48"):
        slab_sizes([SLAB_CHUNK_MAX])


@pytest.mark.timeout(30)
def test_memcached_takes_the_slab_sizes_it_is_given() -> None:
    """memcached's own classes (its `-vv` start-up lines) are `slab_sizes`' classes."""
    classes = slab_sizes([284, 152, 61, 7000])
    argv = [memcached_binary(), "-p", "0", "-U", "0", "-vv", "-C", "-o", f"slab_sizes={classes}"]
    if os.geteuid() == 0:
        argv += ["-u", "root"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = []
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode()
            if "slab class" in line:
                lines.append(int(line.split("chunk size")[1].split()[0]))
            if str(SLAB_CHUNK_MAX) in line:
                break
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert lines == [*map(int, classes.split("-")), SLAB_CHUNK_MAX]


def test_memcached_options_prints_what_a_node_of_the_cluster_file_runs_with(
    tmp_path: Path,
) -> None:
    """For nodes started another way (deploy/k8s, deploy/systemd)."""
    config = tmp_path / "cluster.toml"
    config.write_text(
        'namespace = "demo"\nmemcached = ["127.0.0.1:1"]\n'
        '[[tables]]\nname = "user"\ndim = 16\n'
        '[[tables]]\nname = "word"\ndim = 16\nid_type = "string"\n'
    )
    done = localcluster(
        "memcached-options", "--config", str(config), "--memory-mb", "64", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    row = item_bytes(len(b"demo/user/w/") + 12, 4 * (16 * 3 + 1))  # 271: a 272-byte class
    assert done.stdout.split() == [
        "-M",
        "-m",
        "64",
        "-C",
        "-o",
        f"hashpower={hashpower_for(64)},{LRU_OPTIONS},slab_sizes={slab_sizes([row])}",
    ]
    assert "-240-272-304-" in done.stdout


def test_nodes_of_string_tables_only_keep_memcacheds_own_slab_classes(tmp_path: Path) -> None:
    """A string id's key has no one size: no class is added, and `up` says so."""
    config = tmp_path / "cluster.toml"
    config.write_text(
        f'namespace = "s{uuid.uuid4().hex[:8]}"\nmemcached = ["127.0.0.1:{free_port()}"]\n'
        '[[tables]]\nname = "word"\ndim = 16\nid_type = "string"\n'
    )
    args = ["--config", str(config), "--run-dir", str(tmp_path / "run"), "--memory-mb", "16"]
    options = localcluster("memcached-options", *args[:2], "--memory-mb", "16", cwd=tmp_path)
    assert options.returncode == 0, options.stderr
    assert "slab_sizes" not in options.stdout
    try:
        up = localcluster("up", *args, cwd=tmp_path)
        assert up.returncode == 0, up.stderr
        assert "default slab classes" in up.stdout and "rows of [" not in up.stdout, up.stdout
    finally:
        down = cluster_command("down", *args)
    assert down.returncode == 0, down.stderr
