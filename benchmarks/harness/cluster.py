"""Local clusters: a cluster file (deploy/demo.toml's, fresh ports and namespace),
its memcached nodes and optimizer replicas started with `python -m
lookup_table.ops.localcluster up` and always stopped, their pids and logs; one
optimizer replica on its own; a role of a benchmark run in its own process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT
from lookup_table.ops.localcluster import free_port, stop_process

DEMO_CONFIG = ROOT / "deploy" / "demo.toml"
MEMCACHED_MEMORY_MB = 512  # -m of each node of `local_cluster`
SERVICE_START_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- the cluster file


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(raw: Mapping[str, Any]) -> str:
    """Scalars and lists on top, then [tables], then [[arrays of tables]]."""

    def is_table_array(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and isinstance(v[0], dict)

    lines = [
        f"{k} = {_toml_value(v)}"
        for k, v in raw.items()
        if not isinstance(v, dict) and not is_table_array(v)
    ]
    for k, v in raw.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]", *(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())]
    for k, v in raw.items():
        if is_table_array(v):
            for item in v:
                lines += ["", f"[[{k}]]", *(f"{kk} = {_toml_value(vv)}" for kk, vv in item.items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- a local cluster


def write_cluster_file(
    path: Path,
    *,
    mode: str = "async",
    workers: int = 1,
    prefix: str = "benchtrain",
    service: Mapping[str, Any] | None = None,
    replicas: int = 1,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """deploy/demo.toml with fresh ports, a fresh namespace (`prefix` + 8 hex digits),
    `workers`, `mode` and `service`'s keys set in its `[service]` table: 2 memcached nodes
    and `replicas` optimizer replicas (the demo's: 1). `tables`: table name -> keys set in
    that `[[tables]]` entry (a dtype, an optimizer, a seed); the other tables stay the demo's."""
    from lookup_table.config import load_config

    raw = tomllib.loads(DEMO_CONFIG.read_text())
    changed = dict(tables or {})
    unknown = sorted(set(changed) - {t["name"] for t in raw["tables"]})
    if unknown:
        raise ValueError(f"deploy/demo.toml has no tables {unknown} to change")
    raw["tables"] = [{**t, **changed.get(t["name"], {})} for t in raw["tables"]]
    mc1, mc2, *opts = free_ports(2 + replicas)
    raw.update(
        namespace=prefix + uuid.uuid4().hex[:8],
        memcached=[f"127.0.0.1:{mc1}", f"127.0.0.1:{mc2}"],
        optimizers=[f"http://127.0.0.1:{opt}" for opt in opts],
        workers=workers,
        mode=mode,
    )
    raw["service"] = {**raw.get("service", {}), **(service or {})}
    path.write_text(to_toml(raw))
    ours, demo = load_config(path), load_config(DEMO_CONFIG)
    kept = [(a, b) for a, b in zip(ours.tables, demo.tables, strict=True) if a.name not in changed]
    if any(a != b for a, b in kept) or ours.optimizer != demo.optimizer:
        raise RuntimeError(f"{path} does not reproduce deploy/demo.toml's tables and optimizer")
    return {
        "namespace": ours.namespace,
        "memcached": list(ours.node_addresses),
        "optimizers": list(ours.optimizers),
        "mode": ours.mode,
        "workers": ours.workers,
    }


def _localcluster(
    command: str, config: Path, run_dir: Path, memory_mb: int, env: Mapping[str, str] | None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "lookup_table.ops.localcluster", command, "--config", str(config)]
    cmd += ["--run-dir", str(run_dir)]
    if command == "up":
        cmd += ["--memory-mb", str(memory_mb)]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=None if env is None else dict(env),
        check=False,
    )


@contextlib.contextmanager
def running_cluster(
    config_path: Path,
    run_dir: Path,
    *,
    memory_mb: int = MEMCACHED_MEMORY_MB,
    env: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """The memcached nodes and optimizer replicas of `config_path`, started with
    `python -m lookup_table.ops.localcluster up` (pid files and logs in `run_dir`) and
    always stopped with `... down`; a stop that leaves pid files is a warning."""
    try:
        up = _localcluster("up", config_path, run_dir, memory_mb, env)
        if up.returncode != 0:
            raise RuntimeError(f"cluster up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
        yield
    finally:
        down = _localcluster("down", config_path, run_dir, memory_mb, env)
        left = sorted(p.name for p in run_dir.glob("*.pid"))
        if down.returncode != 0 or left:
            print(
                f"warning: cluster down ({down.returncode}) left {left}:\n{down.stdout}"
                f"{down.stderr}",
                file=sys.stderr,
            )


@contextlib.contextmanager
def local_cluster(
    work_dir: Path,
    *,
    mode: str = "async",
    workers: int = 1,
    prefix: str = "benchtrain",
    memory_mb: int = MEMCACHED_MEMORY_MB,
    service: Mapping[str, Any] | None = None,
    replicas: int = 1,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> Iterator[tuple[Path, Path, dict[str, Any]]]:
    """2 memcached nodes + `replicas` optimizer replicas from a fresh cluster file (see
    `write_cluster_file`, `tables` too), in a `running_cluster`. Yields the cluster file,
    the run dir (pid files, logs) and a summary of the cluster."""
    work_dir.mkdir(parents=True)
    config_path, run_dir = work_dir / "cluster.toml", work_dir / "run"
    info = write_cluster_file(
        config_path,
        mode=mode,
        workers=workers,
        prefix=prefix,
        service=service,
        replicas=replicas,
        tables=tables,
    )
    with running_cluster(config_path, run_dir, memory_mb=memory_mb):
        yield config_path, run_dir, info


def _parts_of(config_path: Path, run_dir: Path) -> tuple[list[Any], list[Any]]:
    """The memcached nodes and optimizer replicas of `config_path` with the pid and log
    files `localcluster up` keeps for them in `run_dir` (one per address)."""
    from lookup_table.config import load_config
    from lookup_table.ops.localcluster.files import cluster_parts

    return cluster_parts(load_config(config_path), run_dir)


def service_log_errors(config_path: Path, run_dir: Path, replica: int = 0) -> list[str]:
    """The first 5 ERROR lines of an optimizer replica's log in `run_dir` ([] if none)."""
    log: Path = _parts_of(config_path, run_dir)[1][replica].log_path
    if not log.exists():
        return []
    return [ln for ln in log.read_text(errors="replace").splitlines() if " ERROR " in ln][:5]


def cluster_pids(config_path: Path, run_dir: Path) -> dict[str, int]:
    """{"optimizer": pid, "optimizer-1": pid, ..., "memcached-1": pid, ...}: the processes
    `localcluster up` started for `config_path` (replicas and nodes in its order)."""
    nodes, replicas = _parts_of(config_path, run_dir)
    pids: dict[str, int] = {}
    for k, part in enumerate(replicas):
        pids["optimizer" if k == 0 else f"optimizer-{k}"] = int(part.pid_path.read_text())
    for k, part in enumerate(nodes, start=1):
        pids[f"memcached-{k}"] = int(part.pid_path.read_text())
    return pids


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago, in order."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment (this checkout first on PYTHONPATH: see
    `benchmarks.harness`) with `extra` set, TensorFlow's C++ logging quiet."""
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **extra}


def begin(args: Any, roles: Mapping[str, Callable[[Any], int]]) -> int | None:
    """Start a benchmark's process: TensorFlow's C++ logging quiet; then, in a process the
    benchmark started for one of its `roles` (`--role`), that role's exit code; in the
    main process None, and a SIGTERM (e.g. a test's timeout) unwinds through the
    finallys that stop the clusters and processes started."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    role = roles.get(getattr(args, "role", "main"))
    if role is not None:
        return role(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return None


def run_role(
    cmd: Sequence[str], output: Path, log_path: Path, *, timeout_s: float, what: str
) -> dict[str, Any]:
    """Run `cmd` (a benchmark's role, `what` in errors) with its output in `log_path`,
    always stopped; the JSON it wrote to `output`."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=checkout_env())
        try:
            proc.wait(timeout=timeout_s)
        finally:
            stop_process(proc)
    if proc.returncode != 0 or not output.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{what} failed ({proc.returncode}); its log:\n{tail}")
    result: dict[str, Any] = json.loads(output.read_text())
    return result


# ---------------------------------------------------------------- one optimizer replica


@contextlib.contextmanager
def service_process(config_path: Path, port: int, log_path: Path) -> Iterator[int]:
    """`python -m optimizer_service.app` on `port`, stopped on exit; yields its pid."""
    cmd = [
        sys.executable,
        "-m",
        "optimizer_service.app",
        "--config",
        str(config_path),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--log-level",
        "WARNING",
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=ROOT, env=checkout_env()
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc, log_path)
        yield proc.pid
    except BaseException:
        tail = log_path.read_text(errors="replace")[-2000:].strip()
        print(f"the optimizer service's log (tail):\n{tail or '(empty)'}", file=sys.stderr)
        raise
    finally:
        stop_process(proc, timeout_s=10)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Poll `GET /healthz` until it answers 200; RuntimeError if the service exits or stalls."""
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace")[-2000:].strip()
    raise RuntimeError(
        f"the optimizer service did not become healthy at {url} (exit code {proc.poll()}, "
        f"last answer: {last}); its log:\n{tail}"
    )
