"""The files `deploy/cluster.sh up` keeps in its run dir for each process, keyed by ADDRESS.

`memcached-{host}-{port}.pid` and `optimizer-{host}-{port}.pid` (+ `.log`, and `.owner`:
the cluster file and namespace that started it). So several cluster files share one run
dir: each sees its own processes, a memcached node two files list is shared (namespaces
are key prefixes), and a replica port another file's replica holds is refused, naming
that file. A pid file counts only while its process is the one listening on the address:
a reused pid (another program now) is stale, never "already running" and never stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lookup_table.ops.localcluster.pids import holds_port, listener_pid, pid_alive
from lookup_table.ops.localcluster.servers import server_pid

__all__ = [
    "Part",
    "cluster_parts",
    "down_hint",
    "read_pid",
    "running",
    "same_file",
    "taken_message",
]


_LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1"}


def read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid_alive(pid) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
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
            return server_pid(self.host, self.port) == pid
        listens = holds_port(pid, self.port)
        return listens if listens is not None else pid_alive(pid)

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


def cluster_parts(config: Any, run_dir: Path) -> tuple[list[Part], list[Part]]:
    """The memcached nodes and the optimizer replicas of a cluster file."""
    from urllib.parse import urlsplit

    nodes = [
        Part(
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
            Part(
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


def running(part: Part, *, tidy: bool = True) -> tuple[int | None, str | None]:
    """(pid, None) when the pid file's process serves the address; (None, note) when the
    pid file is stale (its process is gone, or is not the one on the address: with
    `tidy`, the files are removed); (None, None) without a pid file."""
    try:
        raw = part.pid_path.read_text().strip()
    except FileNotFoundError:
        return None, None
    pid = read_pid(part.pid_path)
    if pid is not None and part.listener(pid):
        return pid, None
    why = "has exited" if pid is None else "is not the process serving the address"
    if not tidy:
        return None, f"stale pid file (pid {raw} {why})"
    part.forget()
    return None, f"stale pid file removed (pid {raw} {why})"


def same_file(owner: dict[str, Any] | None, config_path: str) -> bool:
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


def _holder(part: Part) -> tuple[int | None, dict[str, Any] | None]:
    """Who holds a taken port: its pid (when this machine can tell) and, when the pid
    file of that process is in this run dir, its owner (cluster file, namespace)."""
    if part.kind == "memcached":
        pid = server_pid(part.host, part.port) or listener_pid(part.port)
    else:
        pid = listener_pid(part.port)
    if pid is None:
        return None, None
    for pid_path in part.run_dir.glob("*.pid"):
        if read_pid(pid_path) == pid:
            return pid, _read_owner(pid_path.with_suffix(".owner"))
    return pid, None


def down_hint(owner: dict[str, Any], run_dir: Path) -> str:
    config = owner.get("config", "?")
    return (
        f"the cluster file {config} (namespace {owner.get('namespace')!r}); stop it with "
        f"`deploy/cluster.sh down --config {config} --run-dir {run_dir}`"
    )


def taken_message(part: Part, config_path: str) -> str:
    pid, owner = _holder(part)
    who = f"pid {pid}" if pid is not None else "another process"
    if owner is not None:
        return (
            f"{part.label}: the port is taken by {who}, which belongs to "
            f"{down_hint(owner, part.run_dir)}; or give {config_path} other ports"
        )
    return (
        f"{part.label}: the port is taken by {who}, a process we did not start (no pid file "
        f"in {part.run_dir}); stop it or change the address in {config_path}"
    )
