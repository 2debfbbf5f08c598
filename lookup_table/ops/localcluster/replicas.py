"""The optimizer replicas of a cluster file: their health, whether the process on a
replica's address is this file's replica, and starting those that do not run."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lookup_table.ops.localcluster.files import (
    Part,
    down_hint,
    read_pid,
    running,
    taken_message,
)
from lookup_table.ops.localcluster.pids import holds_port
from lookup_table.ops.localcluster.servers import port_taken

__all__ = [
    "adopt_index_pid_file",
    "healthz",
    "mismatch",
    "namespace_served",
    "replica_state",
    "start_optimizers",
]


def healthz(url: str, *, timeout_s: float = 2.0) -> tuple[int, str]:
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


def namespace_served(url: str, token: str, *, timeout_s: float = 2.0) -> tuple[str, int] | str:
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


def mismatch(served: tuple[str, int] | str, namespace: str, replica: int) -> str | None:
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


def adopt_index_pid_file(part: Part) -> None:
    """A run dir of an older `cluster.sh` keyed replicas by index (`optimizer-K.pid`): when
    that process serves this replica's address, its pid file takes the address's name."""
    old = part.run_dir / f"optimizer-{part.replica}.pid"
    pid = read_pid(old)
    if pid is not None and not part.pid_path.exists() and holds_port(pid, part.port):
        old.rename(part.pid_path)
        with contextlib.suppress(FileNotFoundError):
            (part.run_dir / f"optimizer-{part.replica}.log").rename(part.log_path)


def replica_state(part: Part, config: Any, config_path: str) -> tuple[int | None, str | None]:
    """(pid, None): this file's replica already runs there; (None, error): the address is
    held by something else (another namespace's replica, a foreign process); (None,
    None): free, start it."""
    adopt_index_pid_file(part)
    pid, note = running(part)
    if note:
        print(f"{part.label}: {note}")
    if pid is not None:
        served = namespace_served(part.url, config.token, timeout_s=5.0)
        problem = mismatch(served, config.namespace, part.replica)
        if problem is None:
            return pid, None
        owner = part.owner()
        whose = f"it belongs to {down_hint(owner, part.run_dir)}" if owner else "stop it"
        return None, (
            f"{part.label}: the port is held by pid {pid}, but {problem}: {whose}; or give "
            f"{config_path} other ports"
        )
    if part.local and port_taken(part.host, part.port):
        return None, taken_message(part, config_path)
    return None, None


def start_optimizers(config_path: str, config: Any, replicas: Sequence[Part]) -> int:
    for part in replicas:
        pid, error = replica_state(part, config, config_path)
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
            status, body = healthz(part.url)
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
