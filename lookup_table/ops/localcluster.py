"""Start and stop local memcached processes (tests, benchmarks, `deploy/cluster.sh`).

Every server runs with `-M` (return an error instead of evicting: a cache that
drops an embedding row loses training) and listens on 127.0.0.1 unless told
otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LRU_OPTIONS",
    "REQUESTS_PER_EVENT",
    "SMALL_ITEM_BYTES",
    "MemcachedProcess",
    "free_port",
    "hashpower_for",
    "local_threads",
    "memcached_binary",
    "memcached_options",
    "start_memcached",
    "stop_process",
    "wait_for_port",
]


# memcached serves at most `-R` requests of one connection before it turns to the others
# (default 20). Our clients pipeline thousands of requests per batch, so at 20 a node goes
# back to epoll after every 20: at the demo's shape, -R 1000 cuts a node's CPU per step by
# about 12 % (mostly system time), and 1000 requests still take well under a millisecond,
# so no connection waits long behind another.
REQUESTS_PER_EVENT = 1000

# memcached's hash table starts at 2^16 buckets and doubles whenever it holds 1.5 items a
# bucket: a background thread moves every item while lookups search both tables, and
# until then chains grow towards 1.5 items, which every miss walks to its end (most of a
# training step's reads are of ids with no row yet). Our nodes fill up with small items (a
# dim-16 row with its Adam slots is ~250 bytes), so each node's table is sized at start
# for a full node of such items: at most 1.5 a bucket then, as memcached would end up
# anyway, for 8 bytes a bucket (32 MiB beside `-m 1024`, 3 %). Rows written behind, at
# the demo's shape, this cut memcached's CPU a push by ~10 % (docs/operations.md).
SMALL_ITEM_BYTES = 256


# memcached's LRU maintainer thread moves items between the HOT, WARM and COLD segments of
# each slab class's LRU. By default HOT holds at most 20 % of a class's bytes, and items
# older than 0.2x the COLD tail's age leave it, so nearly every item a replica writes is
# moved once more by that thread, under the LRU's lock. Our nodes run with -M: nothing is
# evicted, so the segments choose no victim, and the thread's other jobs (slab page
# rebalancing, scheduling the crawler that reclaims expired TTL rows) are still needed.
# A HOT segment of up to 70 % (WARM 5 %: HOT + WARM may not pass 80 %) and ages of 100x
# the COLD tail's keep most written items where they are: about 10 % less of
# memcached's CPU a push at the demo's shape (docs/operations.md). 100x, not more:
# memcached keeps that age in 32 bits, and 100x a year's COLD age still fits.
LRU_OPTIONS = "hot_lru_pct=70,warm_lru_pct=5,hot_max_factor=100,warm_max_factor=100"


def local_threads(nodes: int) -> int:
    """memcached's `-t` (worker threads) for each of `nodes` nodes sharing this machine
    with the replicas and trainers: half of the usable cores split between the nodes, at
    least 1, at most 4.

    A node's worker threads share its hash table's and LRU's locks; where they outnumber
    the cores the node can have, they wait on each other instead of working: on a
    2-core machine with 2 nodes (the demo's), -t 1 instead of 2 costs memcached about
    15 % less CPU a push and a training step, and reads are as fast. A dedicated memcached host
    takes `-t` about its cores (deploy/systemd/memcached.env, deploy/k8s).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // (2 * max(1, nodes))))


def memcached_options(memory_mb: int) -> str:
    """memcached's `-o` for a node of `memory_mb` MiB: its hash table's size at start
    (`hashpower_for`) and the LRU's segments (`LRU_OPTIONS`)."""
    return f"hashpower={hashpower_for(memory_mb)},{LRU_OPTIONS}"


def hashpower_for(memory_mb: int) -> int:
    """memcached's `-o hashpower` for a node of `memory_mb` MiB of small items (16-32)."""
    buckets = memory_mb * 2**20 / SMALL_ITEM_BYTES / 1.5
    return min(32, max(16, math.ceil(math.log2(max(buckets, 1.0)))))


def memcached_binary() -> str:
    """Path of the memcached server; a clear error when it is not installed."""
    path = shutil.which("memcached") or (
        "/usr/bin/memcached" if os.path.exists("/usr/bin/memcached") else None
    )
    if path is None:
        raise FileNotFoundError(
            "memcached is not installed or not on PATH: run `apt-get install memcached` "
            "(deploy/test.sh and deploy/demo.sh do it for you)"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 20.0) -> None:
    """Terminate `proc` if it still runs; kill -9 it if it has not exited after
    `timeout_s` (and wait up to 10 s more for that)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _port_taken(host: str, port: int) -> bool:
    """Whether something accepts on host:port now: one attempt (a free port refuses at
    once; `wait_for_port` would retry it for its whole timeout)."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_for_port(
    host: str, port: int, *, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> bool:
    """Poll until something accepts on host:port; False on timeout or if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if _port_taken(host, port):
            return True
        time.sleep(0.02)
    return False


def _server_pid(host: str, port: int) -> int | None:
    """The pid the memcached on host:port reports (`stats`), None if it does not answer."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"stats\r\n")
            data = b""
            while not data.endswith(b"END\r\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                data += chunk
    except OSError:
        return None
    for line in data.split(b"\r\n"):
        if line.startswith(b"STAT pid "):
            return int(line.split()[2])
    return None


@dataclass
class MemcachedProcess:
    """One memcached server we started; `stop()` always cleans up.

    With no `log_path`, its output goes to a temporary file that `stop()` removes.
    """

    host: str
    port: int
    memory_mb: int
    extra_args: Sequence[str] = ()
    log_path: Path | None = None
    threads: int = 1  # -t: `local_threads` for the nodes of a local cluster
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _temporary_log: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        cmd = [
            memcached_binary(),
            "-l",
            self.host,
            "-p",
            str(self.port),
            "-U",
            "0",
            "-m",
            str(self.memory_mb),
            "-M",
            "-c",
            "4096",
            "-t",
            str(self.threads),
            "-R",
            str(REQUESTS_PER_EVENT),
            "-o",
            memcached_options(self.memory_mb),
            *self.extra_args,
        ]
        if os.geteuid() == 0:
            cmd += ["-u", "root"]  # memcached refuses to run as root without -u
        return cmd

    def start(self, *, timeout_s: float = 10.0) -> None:
        """Spawn the server and wait until it accepts connections.

        Raises:
            RuntimeError: it exited (port taken?) or did not accept in time.
        """
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="memcached-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            self._temporary_log = True
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        other = None
        while wait_for_port(
            self.host, self.port, timeout_s=deadline - time.monotonic(), proc=self.proc
        ):
            # something accepts: ours, or a server that held the port before ours (which
            # then exits, unable to bind): memcached's `stats` tells its pid
            other = _server_pid(self.host, self.port)
            if other == self.proc.pid:
                return
            time.sleep(0.02)
        code = self.proc.poll()
        self.kill()
        tail = self.log_path.read_text(errors="replace")[-500:].strip()
        self.stop()
        taken = f"the port is taken by another process (pid {other})" if other else ""
        raise RuntimeError(
            f"memcached on {self.address} did not start (exit code {code}): "
            f"{'; '.join(filter(None, [taken, tail])) or 'no output; is the port taken?'}"
        )

    def kill(self) -> None:
        """SIGKILL: the server and all its data are gone at once."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; removes a temporary log; safe to call twice."""
        if self.proc is not None:
            stop_process(self.proc, timeout_s=5)
        if self._temporary_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None
            self._temporary_log = False

    def restart_empty(self) -> None:
        """Kill -9 and start again on the same port: the node comes back with no data."""
        self.kill()
        self.start()


def start_memcached(
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    memory_mb: int = 64,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    attempts: int = 5,
    threads: int = 1,
) -> MemcachedProcess:
    """Start one memcached with `-M`; with no port, pick a free one (retrying if taken)."""
    last: Exception | None = None
    for _ in range(attempts if port is None else 1):
        server = MemcachedProcess(
            host=host,
            port=port or free_port(host),
            memory_mb=memory_mb,
            extra_args=extra_args,
            log_path=log_path,
            threads=threads,
        )
        try:
            server.start()
            return server
        except RuntimeError as exc:
            last = exc
    raise RuntimeError(f"could not start memcached: {last}") from last


@contextlib.contextmanager
def memcached_cluster(count: int, *, memory_mb: int = 64) -> Iterator[list[MemcachedProcess]]:
    """`count` local servers on free ports, stopped on exit whatever happens."""
    servers: list[MemcachedProcess] = []
    try:
        for _ in range(count):
            # one at a time, so the ones started are stopped if a later one fails
            servers.append(  # noqa: PERF401
                start_memcached(memory_mb=memory_mb, threads=local_threads(count))
            )
        yield servers
    finally:
        for server in servers:
            server.stop()


# ------------------------------------------------------------ deploy/cluster.sh
#
# Every process `up` starts is keyed by its ADDRESS: `memcached-{host}-{port}.pid` and
# `optimizer-{host}-{port}.pid` (+ `.log`, and `.owner`: the cluster file and namespace
# that started it). So several cluster files share one run dir: each sees its own
# processes, a memcached node two files list is shared (namespaces are key prefixes), and
# a replica port another file's replica holds is refused, naming that file.
# A pid file counts only while its process is the one listening on the address: a
# reused pid (another program now) is stale, never "already running" and never stopped.

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1"}


def _pid_alive(pid: int) -> bool:
    """Whether `pid` still runs. A zombie does not: it has exited and waits for its parent
    to reap it, which for the processes `up` started (their parent has exited) is init,
    and init may take seconds (`down` waited ~1.5 s per process for that)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # gone meanwhile, or no /proc (not Linux): kill() said alive
        return not os.path.isdir("/proc/self")
    return state not in ("Z", "X")


def _read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def _listening_inodes(port: int) -> set[str] | None:
    """The socket inodes listening on `port` (any local address), from /proc/net/tcp{,6};
    None without them (not Linux)."""
    inodes: set[str] = set()
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; st 0A is LISTEN; field 9 is the inode
            if len(fields) > 9 and fields[3] == "0A":
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes if found else None


def _listens(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the listening socket of `port`; None when this machine
    cannot tell (no /proc, or the process is another user's)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except PermissionError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class _Part:
    """One process of a cluster file: a memcached node or an optimizer replica."""

    kind: str  # "memcached" | "optimizer"
    label: str  # how messages name it
    host: str
    port: int
    run_dir: Path
    replica: int = 0  # an optimizer's partition
    url: str = ""  # an optimizer's URL

    @property
    def stem(self) -> Path:
        return self.run_dir / f"{self.kind}-{self.host}-{self.port}"

    @property
    def pid_path(self) -> Path:
        return self.stem.with_name(self.stem.name + ".pid")

    @property
    def log_path(self) -> Path:
        return self.stem.with_name(self.stem.name + ".log")

    @property
    def owner_path(self) -> Path:
        return self.stem.with_name(self.stem.name + ".owner")

    @property
    def local(self) -> bool:
        return self.host in _LOCAL_HOSTS

    def listener(self, pid: int) -> bool:
        """Whether `pid` is the process serving this address."""
        if self.kind == "memcached":
            return _server_pid(self.host, self.port) == pid
        listens = _listens(pid, self.port)
        return listens if listens is not None else _pid_alive(pid)

    def owner(self) -> dict[str, Any] | None:
        """The cluster file and namespace that started it (None: unknown)."""
        return _read_owner(self.owner_path)

    def claim(self, pid: int, config_path: str, namespace: str) -> None:
        import json

        self.pid_path.write_text(f"{pid}\n")
        owner = {"config": str(Path(config_path).resolve()), "namespace": namespace}
        self.owner_path.write_text(json.dumps(owner) + "\n")

    def forget(self) -> None:
        self.pid_path.unlink(missing_ok=True)
        self.owner_path.unlink(missing_ok=True)


def _parts(config: Any, run_dir: Path) -> tuple[list[_Part], list[_Part]]:
    """The memcached nodes and the optimizer replicas of a cluster file."""
    from urllib.parse import urlsplit

    nodes = [
        _Part(
            kind="memcached",
            label=f"memcached {node.address}",
            host=node.host,
            port=node.port,
            run_dir=run_dir,
        )
        for node in config.memcached
    ]
    replicas = []
    for k, url in enumerate(config.optimizers):
        parts = urlsplit(url)
        replicas.append(
            _Part(
                kind="optimizer",
                label=f"optimizer {k} {url}",
                host=parts.hostname or "127.0.0.1",
                port=parts.port or 80,
                run_dir=run_dir,
                replica=k,
                url=url,
            )
        )
    return nodes, replicas


def _running(part: _Part, *, tidy: bool = True) -> tuple[int | None, str | None]:
    """(pid, None) when the pid file's process serves the address; (None, note) when the
    pid file is stale (its process is gone, or is not the one on the address: with
    `tidy`, the files are removed); (None, None) without a pid file."""
    try:
        raw = part.pid_path.read_text().strip()
    except FileNotFoundError:
        return None, None
    pid = _read_pid(part.pid_path)
    if pid is not None and part.listener(pid):
        return pid, None
    why = "has exited" if pid is None else "is not the process serving the address"
    if not tidy:
        return None, f"stale pid file (pid {raw} {why})"
    part.forget()
    return None, f"stale pid file removed (pid {raw} {why})"


def _same_file(owner: dict[str, Any] | None, config_path: str) -> bool:
    """Whether a part's owner is this cluster file (an unknown owner counts as this one)."""
    return owner is None or owner.get("config") == str(Path(config_path).resolve())


def _read_owner(path: Path) -> dict[str, Any] | None:
    """An `.owner` file: the cluster file and namespace that started a process."""
    import json

    try:
        doc = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _listener_pid(port: int) -> int | None:
    """The pid of the process (of this user) listening on `port`, from /proc; None when
    none is found or this machine cannot tell."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            links = {
                os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")
            }
        except OSError:  # another user's, or gone
            continue
        if links & wanted:
            return int(entry)
    return None


def _holder(part: _Part) -> tuple[int | None, dict[str, Any] | None]:
    """Who holds a taken port: its pid (when this machine can tell) and, when the pid
    file of that process is in this run dir, its owner (cluster file, namespace)."""
    if part.kind == "memcached":
        pid = _server_pid(part.host, part.port) or _listener_pid(part.port)
    else:
        pid = _listener_pid(part.port)
    if pid is None:
        return None, None
    for pid_path in part.run_dir.glob("*.pid"):
        if _read_pid(pid_path) == pid:
            return pid, _read_owner(pid_path.with_suffix(".owner"))
    return pid, None


def _down_hint(owner: dict[str, Any], run_dir: Path) -> str:
    config = owner.get("config", "?")
    return (
        f"the cluster file {config} (namespace {owner.get('namespace')!r}); stop it with "
        f"`deploy/cluster.sh down --config {config} --run-dir {run_dir}`"
    )


def _taken_message(part: _Part, config_path: str) -> str:
    pid, owner = _holder(part)
    who = f"pid {pid}" if pid is not None else "another process"
    if owner is not None:
        return (
            f"{part.label}: the port is taken by {who}, which belongs to "
            f"{_down_hint(owner, part.run_dir)}; or give {config_path} other ports"
        )
    return (
        f"{part.label}: the port is taken by {who}, a process we did not start (no pid file "
        f"in {part.run_dir}); stop it or change the address in {config_path}"
    )


def _healthz(url: str, *, timeout_s: float = 2.0) -> tuple[int, str]:
    """GET url/healthz -> (status, body); (0, reason) when it does not answer."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/healthz", timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        return 0, str(exc)


def _served(url: str, token: str, *, timeout_s: float = 2.0) -> tuple[str, int] | str:
    """(namespace, replica) a replica serves (GET /v1/tables), or why that is unknown."""
    import urllib.error
    import urllib.request

    from lookup_table.core.wire import unpack

    request = urllib.request.Request(url + "/v1/tables")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            doc = unpack(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")[:120]
        if exc.code == 401:
            return f"refuses this file's token (401 {body}): it serves another cluster"
        return f"GET /v1/tables answered {exc.code} {body}"
    except (OSError, ValueError) as exc:
        return f"GET /v1/tables failed: {exc}"
    try:
        return str(doc["namespace"]), int(doc["replica"])
    except (KeyError, TypeError, ValueError):
        return f"GET /v1/tables answered without a namespace: {str(doc)[:120]}"


def _mismatch(served: tuple[str, int] | str, namespace: str, replica: int) -> str | None:
    """Why a replica is not this file's replica `replica` (None: it is)."""
    if isinstance(served, str):
        return served
    ns, k = served
    if ns != namespace or k != replica:
        return (
            f"it serves namespace {ns!r} as replica {k}, not this file's namespace "
            f"{namespace!r} as replica {replica}"
        )
    return None


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _adopt_index_pid_file(part: _Part) -> None:
    """A run dir of an older `cluster.sh` keyed replicas by index (`optimizer-K.pid`): when
    that process serves this replica's address, its pid file takes the address's name."""
    old = part.run_dir / f"optimizer-{part.replica}.pid"
    pid = _read_pid(old)
    if pid is not None and not part.pid_path.exists() and _listens(pid, part.port):
        old.rename(part.pid_path)
        with contextlib.suppress(FileNotFoundError):
            (part.run_dir / f"optimizer-{part.replica}.log").rename(part.log_path)


def _replica_state(part: _Part, config: Any, config_path: str) -> tuple[int | None, str | None]:
    """(pid, None): this file's replica already runs there; (None, error): the address is
    held by something else (another namespace's replica, a foreign process); (None,
    None): free, start it."""
    _adopt_index_pid_file(part)
    pid, note = _running(part)
    if note:
        print(f"{part.label}: {note}")
    if pid is not None:
        served = _served(part.url, config.token, timeout_s=5.0)
        problem = _mismatch(served, config.namespace, part.replica)
        if problem is None:
            return pid, None
        owner = part.owner()
        whose = f"it belongs to {_down_hint(owner, part.run_dir)}" if owner else "stop it"
        return None, (
            f"{part.label}: the port is held by pid {pid}, but {problem}: {whose}; or give "
            f"{config_path} other ports"
        )
    if part.local and _port_taken(part.host, part.port):
        return None, _taken_message(part, config_path)
    return None, None


def _start_optimizers(config_path: str, config: Any, replicas: Sequence[_Part]) -> int:
    for part in replicas:
        pid, error = _replica_state(part, config, config_path)
        if error is not None:
            print(error, file=sys.stderr)
            return 1
        if pid is not None:
            print(f"{part.label}: already running (pid {pid})")
            continue
        if not part.local:
            print(f"{part.label}: not a local address, expecting it to be running")
            continue
        with open(part.log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "optimizer_service.app",
                    "--config",
                    str(Path(config_path).resolve()),
                    "--replica",
                    str(part.replica),
                    "--host",
                    part.host,
                    "--port",
                    str(part.port),
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        part.claim(proc.pid, config_path, config.namespace)
        deadline = time.monotonic() + 60
        status, body = 0, ""
        while time.monotonic() < deadline and proc.poll() is None:
            status, body = _healthz(part.url)
            if status == 200:
                break
            time.sleep(0.2)
        if status != 200:
            print(
                f"{part.label}: not healthy ({status} {body[:200]}); log tail:\n"
                f"{_log_tail(part.log_path)}",
                file=sys.stderr,
            )
            return 1
        print(f"{part.label}: started (pid {proc.pid}, log {part.log_path})")
    return 0


def _stop_pid(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


def cluster_up(config_path: str, run_dir: Path, *, memory_mb: int) -> int:
    """Start every local memcached of the cluster file (not twice), init the sentinels,
    then start the optimizer replicas (not twice)."""
    from lookup_table.config import load_config
    from lookup_table.ops.admin import init_cluster

    config = load_config(config_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    nodes, replicas = _parts(config, run_dir)
    # a replica address held by another namespace's replica is refused before anything
    # starts or any sentinel is written
    for part in replicas:
        _, error = _replica_state(part, config, config_path)
        if error is not None:
            print(error, file=sys.stderr)
            return 1
    threads = local_threads(sum(part.local for part in nodes))
    for part in nodes:
        pid, note = _running(part)
        if note:
            print(f"{part.label}: {note}")
        if pid is not None:
            owner = part.owner()
            shared = ""
            if owner is not None and not _same_file(owner, config_path):
                shared = (
                    f"; shared with the cluster file {owner.get('config')} (namespace "
                    f"{owner.get('namespace')!r}), whose `down` stops it"
                )
            print(f"{part.label}: already running (pid {pid}{shared})")
            continue
        if not part.local:
            print(f"{part.label}: not a local address, expecting it to be running")
            continue
        if _port_taken(part.host, part.port):
            print(_taken_message(part, config_path), file=sys.stderr)
            return 1
        server = MemcachedProcess(
            host=part.host,
            port=part.port,
            memory_mb=memory_mb,
            log_path=part.log_path,
            threads=threads,
        )
        try:
            server.start()
        except RuntimeError as exc:
            print(f"{part.label}: {exc}", file=sys.stderr)
            return 1
        pid = server.pid
        if pid is None:  # start() returned, so it runs
            raise RuntimeError(f"{part.label}: started without a process")
        part.claim(pid, config_path, config.namespace)
        print(
            f"{part.label}: started (pid {pid}, {memory_mb} MiB, -M, -t {threads}, "
            f"log {part.log_path})"
        )
    states = asyncio.run(init_cluster(config))
    for address, state in states.items():
        print(f"memcached {address}: {state} (namespace {config.namespace!r})")
    return _start_optimizers(config_path, config, replicas)


def cluster_down(config_path: str, run_dir: Path) -> int:
    """Stop exactly the processes `up` started from this cluster file (by pid file, only
    while that process still serves its address)."""
    from lookup_table.config import load_config

    config = load_config(config_path)
    nodes, replicas = _parts(config, run_dir)
    for part in replicas:
        _adopt_index_pid_file(part)
    for part in [*replicas, *nodes]:
        pid, note = _running(part)
        if pid is None:
            print(f"{part.label}: not running ({note or 'no pid file'})")
            continue
        owner = part.owner()
        if not _same_file(owner, config_path):
            print(
                f"{part.label}: left running (pid {pid}): it belongs to "
                f"{_down_hint(owner or {}, run_dir)}"
            )
            continue
        _stop_pid(pid)
        part.forget()
        print(f"{part.label}: stopped (pid {pid})")
    return 0


def cluster_status(config_path: str, run_dir: Path) -> int:
    """Each node: pid, reachable, items, bytes, fill, this namespace's sentinel; each
    replica: pid, health, the namespace it serves. Exit 1 if any is down, lacks its
    sentinel, or serves another namespace."""
    from lookup_table.config import load_config
    from lookup_table.errors import LookupTableError
    from lookup_table.ops.stats import node_stats

    config = load_config(config_path)
    nodes, replicas = _parts(config, run_dir)
    healthy = True
    for part in nodes:
        pid, note = _running(part, tidy=False)
        up = wait_for_port(part.host, part.port, timeout_s=0.5)
        healthy &= up
        extra = f"; {note}" if note else ""
        owner = part.owner() if pid is not None else None
        if owner is not None and not _same_file(owner, config_path):
            extra += (
                f"; belongs to the cluster file {owner.get('config')} (namespace "
                f"{owner.get('namespace')!r})"
            )
        print(f"{part.label}: pid {pid or '-'}, {'up' if up else 'DOWN'}{extra}")
    if healthy:
        try:
            stats = asyncio.run(node_stats(config))
        except LookupTableError as exc:
            print(f"stats failed: {exc}", file=sys.stderr)
            return 1
        for address, s in stats.items():
            print(
                f"  {address}: {s['curr_items']} items, {int(s['bytes']) / 2**20:.1f} MiB of "
                f"{int(s['limit_maxbytes']) / 2**20:.0f} MiB ({float(s['fill_ratio']):.1%}), "
                f"evictions {s['evictions']}, sentinel {'ok' if s['sentinel'] else 'MISSING'} "
                f"(namespace {config.namespace!r})"
            )
            healthy &= bool(s["sentinel"])
    for part in replicas:
        pid, note = _running(part, tidy=False)
        status, body = _healthz(part.url)
        extra = f"; {note}" if note else ""
        if status == 0:
            state = f"UNHEALTHY (does not answer: {body[:120]})"
        else:
            served = _served(part.url, config.token)
            problem = _mismatch(served, config.namespace, part.replica)
            if problem is not None:
                state = f"MISMATCH ({problem})"
                status = 0
            elif status == 200:
                state = f"healthy, namespace {config.namespace!r}"
            else:
                state = f"UNHEALTHY ({status} {body[:120]})"
        healthy &= status == 200
        print(f"{part.label}: pid {pid or '-'}, {state}{extra}")
    return 0 if healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deploy/cluster.sh", description="start, stop or inspect a local cluster"
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--config", required=True, help="the cluster file (TOML)")
    parser.add_argument("--run-dir", default="run", help="pid files and logs (default ./run)")
    parser.add_argument("--memory-mb", type=int, default=1024, help="memcached -m (default 1024)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        if args.command == "up":
            return cluster_up(args.config, run_dir, memory_mb=args.memory_mb)
        if args.command == "down":
            return cluster_down(args.config, run_dir)
        return cluster_status(args.config, run_dir)
    except Exception as exc:  # the CLI boundary: one clear line, not a traceback
        print(f"cluster {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
