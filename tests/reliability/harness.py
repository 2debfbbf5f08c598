"""Real processes for the reliability suite: optimizer replicas as subprocesses, cluster
files, and checks that read memcached with pymemcache (never through our own store).

Nothing here mocks anything: a `ServiceProcess` is `python -m optimizer_service.app` that
a test can kill -9, SIGSTOP or restart, with its logs appended to files for the assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import io
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

import aiohttp
from pymemcache.client.base import Client as MemcacheClient

from lookup_table import EmbeddingStore
from lookup_table.config import ClusterConfig
from lookup_table.ops.localcluster import stop_process
from lookup_table.ops.localcluster.cli import main as cluster_cli

REPO = Path(__file__).resolve().parents[2]

# The default table of `cluster_file`: plain SGD, so a row's exact value is checkable.
SGD_TABLE: dict[str, Any] = {
    "name": "user",
    "dim": 8,
    "seed": 1,
    "optimizer": {"name": "sgd", "learning_rate": 0.5},
}


class ServiceProcess:
    """`python -m optimizer_service.app` as a real subprocess, logs appended to files."""

    def __init__(
        self,
        config_path: Path,
        port: int,
        log_dir: Path,
        *,
        log_level: str = "INFO",
        replica: int = 0,
        name: str = "service",
        access_log: bool = True,  # the kill tests audit every push's status in it
    ) -> None:
        self.cmd = [
            sys.executable,
            "-m",
            "optimizer_service.app",
            "--config",
            str(config_path),
            "--replica",
            str(replica),
            "--port",
            str(port),
            "--log-level",
            log_level,
            *(["--access-log"] if access_log else []),
        ]
        self.url = f"http://127.0.0.1:{port}"
        self.stdout_path = log_dir / f"{name}.stdout.log"
        self.stderr_path = log_dir / f"{name}.stderr.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "LOOKUP_TABLE_TOKEN"}
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.stdout_path, "ab") as out, open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """kill -9 (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM (a graceful stop that flushes the logs), then kill -9 after 10 s."""
        if self.proc is not None:
            stop_process(self.proc, timeout_s=10)

    def log(self) -> str:
        return "".join(
            p.read_text(errors="replace")
            for p in (self.stdout_path, self.stderr_path)
            if p.exists()
        )


async def wait_healthy(service: ServiceProcess, *, timeout_s: float = 30.0) -> None:
    """Poll `/healthz` until 200; fail with the log tail if the process exits or times out."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        while True:
            code = service.exit_code()
            if code is not None:
                raise AssertionError(f"the service exited ({code}):\n{service.log()[-3000:]}")
            try:
                async with session.get(service.url + "/healthz") as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"/healthz not 200 within {timeout_s} s:\n{service.log()[-3000:]}"
                )
            await asyncio.sleep(0.05)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def cluster_file(
    tmp_path: Path,
    nodes: Sequence[str],
    ports: int | Sequence[int],
    *,
    token: str = "",
    tables: Sequence[dict[str, Any]] = (SGD_TABLE,),
    mode: str = "async",
    workers: int = 1,
    sections: dict[str, dict[str, Any]] | None = None,
    name: str = "cluster.toml",
) -> Path:
    """Write a cluster file with a fresh namespace; one optimizer replica per port.

    `sections` adds top-level tables, e.g. {"store": {"timeout_s": 1.0}}; a `service`
    section defaults to request_timeout_s = 15.
    """
    port_list = [ports] if isinstance(ports, int) else list(ports)
    lines = [
        f'namespace = "k{uuid.uuid4().hex[:12]}"',
        f"memcached = {_toml_value(list(nodes))}",
        f"optimizers = {_toml_value([f'http://127.0.0.1:{p}' for p in port_list])}",
        f'mode = "{mode}"',
        f"workers = {workers}",
    ]
    if token:
        lines.append(f"token = {_toml_value(token)}")
    merged: dict[str, dict[str, Any]] = {"service": {"request_timeout_s": 15.0}}
    for section, values in (sections or {}).items():
        merged[section] = {**merged.get(section, {}), **values}
    for section, values in merged.items():
        lines += ["", f"[{section}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items())]
    for table in tables:
        lines += ["", "[[tables]]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------ memcached, read from outside


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def memcache_client(address: str) -> MemcacheClient:
    """A pymemcache client (an independent reader: not our store, not our protocol code).

    Writes and flushes wait for memcached's answer (pymemcache defaults to noreply: a
    `flush_all` still in flight erased the sentinel a following `reinit` wrote)."""
    return MemcacheClient(host_port(address), connect_timeout=2, timeout=2, default_noreply=False)


def item_counts(nodes: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(curr_items, total_items) of every node, read with pymemcache."""
    out = {}
    for address in nodes:
        client = memcache_client(address)
        try:
            stats = client.stats()
        finally:
            client.close()
        out[address] = (int(stats[b"curr_items"]), int(stats[b"total_items"]))
    return out


def node_stats(address: str) -> dict[str, int]:
    """The numeric `stats` of one node (curr_items, evictions, bytes, limit_maxbytes, ...)."""
    client = memcache_client(address)
    try:
        stats = client.stats()
    finally:
        client.close()
    out = {}
    for key, value in stats.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key.decode()] = int(value)
    return out


def delete_keys(address: str, keys: Sequence[bytes]) -> None:
    """Delete raw keys on one node with pymemcache (e.g. to free memory on a `-M` node)."""
    client = memcache_client(address)
    try:
        for start in range(0, len(keys), 1000):
            client.delete_many([k.decode("ascii") for k in keys[start : start + 1000]])
    finally:
        client.close()


async def metadump_keys(address: str) -> list[bytes]:
    """Every key on a node, raw (memcached URL-encodes them in `lru_crawler metadump`).

    The hash walk lists every item that exists during the whole dump; the LRU walk
    (`all`, for a memcached without `hash`) can miss one its LRU maintainer is moving."""
    host, port = host_port(address)
    data = b""
    walk = b"hash"
    for _ in range(50):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(b"lru_crawler metadump " + walk + b"\r\n")
            await writer.drain()
            data = b""
            while not (
                data.endswith(b"END\r\n") or data.startswith((b"BUSY", b"ERROR", b"CLIENT_ERROR"))
            ):
                chunk = await asyncio.wait_for(reader.read(1 << 16), timeout=5)
                if not chunk:
                    break
                data += chunk
        finally:
            writer.close()
            await writer.wait_closed()
        if data.endswith(b"END\r\n"):
            return [
                unquote_to_bytes(line.split(b" ", 1)[0][len(b"key=") :].decode("ascii"))
                for line in data.splitlines()
                if line.startswith(b"key=")
            ]
        if data.startswith((b"ERROR", b"CLIENT_ERROR")):
            walk = b"all"  # an older memcached
        await asyncio.sleep(0.05)  # the crawler is busy: try again
    raise AssertionError(f"lru_crawler metadump on {address} never finished: {data[:200]!r}")


async def fingerprint(
    config: ClusterConfig, created: dict[str, Any]
) -> dict[str, tuple[str, bool]]:
    """A checksum of every row and slot of the ids created beforehand, and whether all exist."""
    out: dict[str, tuple[str, bool]] = {}
    async with EmbeddingStore(config) as store:
        for table, ids in created.items():
            # a row and its slots are one item: read both
            values, found = await store.get(table, ids, slots=True)
            digest = hashlib.blake2b(values.tobytes() + found.tobytes()).hexdigest()
            out[table] = (digest, bool(found.all()))
    return out


# ------------------------------------------------------------------ processes, seen from outside


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of a live process (VmRSS of /proc/PID/status); None once it is gone."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", line
            return int(value) * 1024
    return None  # a zombie has no VmRSS line


def process_running(pid: int) -> bool:
    """Running: neither gone nor a zombie (exited; init reaps the processes `up` started,
    whose parent has exited, in its own time)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (ProcessLookupError, FileNotFoundError):
        return False


def cluster_command(*args: str) -> subprocess.CompletedProcess[str]:
    """`deploy/cluster.sh ARGS` (`localcluster`'s main) in this process, its output
    captured: the code `python -m lookup_table.ops.localcluster` runs, without a new
    interpreter importing the package each time."""
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        # `up` leaves its servers running, as the command does when it exits: their
        # Popen objects say so when dropped
        warnings.simplefilter("ignore", ResourceWarning)
        code = cluster_cli(list(args))
        gc.collect()
    return subprocess.CompletedProcess(["cluster.sh", *args], code, out.getvalue(), err.getvalue())


def localcluster(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m lookup_table.ops.localcluster ARGS` (what `deploy/cluster.sh` runs), its
    output captured, in `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "lookup_table.ops.localcluster", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
