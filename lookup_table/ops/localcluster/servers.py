"""One local memcached server we start and always stop, free ports, and the clusters of
servers tests and benchmarks start.

Every server runs with `-M` (return an error instead of evicting: a cache that
drops an embedding row loses training) and listens on 127.0.0.1 unless told
otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lookup_table.ops.localcluster.options import (
    NO_CAS,
    REQUESTS_PER_EVENT,
    local_threads,
    memcached_options,
)

__all__ = [
    "MemcachedProcess",
    "free_port",
    "memcached_binary",
    "memcached_cluster",
    "port_taken",
    "server_pid",
    "start_memcached",
    "stop_process",
    "wait_for_port",
]


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


_GIVEN_PORTS: collections.deque[int] = collections.deque(maxlen=1024)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close) and that this
    process has not handed out lately: the kernel may offer a port again as soon as it
    is closed, and two servers of one cluster file must not be given the same one."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.append(port)
            return port
    raise RuntimeError(f"the kernel kept offering ports this process handed out on {host}")


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


def port_taken(host: str, port: int) -> bool:
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
        if port_taken(host, port):
            return True
        time.sleep(0.02)
    return False


def server_pid(host: str, port: int) -> int | None:
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
    slab_sizes: str | None = None  # -o slab_sizes (`options.slab_sizes`); None: the defaults
    cas: bool = False  # keep memcached's CAS unique per item (no -C): its default
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
            *([] if self.cas else [NO_CAS]),
            "-o",
            memcached_options(self.memory_mb, slab_sizes=self.slab_sizes),
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
            # env given, not inherited: a thread that starts a node would otherwise
            # exec with the C `environ`, which another thread's setenv may move
            # meanwhile (exec then fails with EFAULT, "Bad address").
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=dict(os.environ),
            )
        deadline = time.monotonic() + timeout_s
        other = None
        while wait_for_port(
            self.host, self.port, timeout_s=deadline - time.monotonic(), proc=self.proc
        ):
            # something accepts: ours, or a server that held the port before ours (which
            # then exits, unable to bind): memcached's `stats` tells its pid
            other = server_pid(self.host, self.port)
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

    def terminate(self) -> None:
        """SIGTERM without waiting: `stop` then waits for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

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
    slab_sizes: str | None = None,
    cas: bool = False,
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
            slab_sizes=slab_sizes,
            cas=cas,
        )
        try:
            server.start()
            return server
        except RuntimeError as exc:
            last = exc
    raise RuntimeError(f"could not start memcached: {last}") from last


@contextlib.contextmanager
def memcached_cluster(
    count: int, *, memory_mb: int = 64, slab_sizes: str | None = None, cas: bool = False
) -> Iterator[list[MemcachedProcess]]:
    """`count` local servers on free ports, stopped on exit whatever happens."""
    servers: list[MemcachedProcess] = []
    try:
        for _ in range(count):
            # one at a time, so the ones started are stopped if a later one fails
            servers.append(  # noqa: PERF401
                start_memcached(
                    memory_mb=memory_mb,
                    threads=local_threads(count),
                    slab_sizes=slab_sizes,
                    cas=cas,
                )
            )
        yield servers
    finally:
        # memcached takes up to a second to exit (its LRU maintainer's sleep): all told
        # first, they exit side by side
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()
