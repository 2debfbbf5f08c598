"""py-spy attached to a benchmark's process (`py-spy record --threads --idle
--nonblocking`, raw collapsed stacks) and the two summaries of its file: a service's
main thread per push, and every thread per step."""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a frame of the raw format: "function (file:line)"
_FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>.*):\d+\)$")
_PROJECT_FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>[^:]*):\d+\)$")
MIN_LIFETIME_S = 3.0  # py-spy's attach (reading the target's memory maps) before a SIGINT
# leaves where a thread waits: an idle event loop, or a future / lock of another thread
_WAITING_LEAVES = ("EpollSelector.select", "Condition.wait", "Event.wait", "Thread.join")


def record(pid: int, out_path: Path, *, rate_hz: int, flag: str, idle: bool = True) -> Spy:
    """py-spy recording `pid` into `out_path` until `stop`; `flag` is the option that
    asked for it (in the error when py-spy is missing). `idle=False`: only samples of
    threads on a CPU (what `benchmarks.harness.costs` splits)."""
    # the venv's py-spy when the venv's python runs without the venv on PATH
    beside = Path(sys.executable).parent / "py-spy"
    exe = shutil.which("py-spy") or (str(beside) if beside.exists() else "py-spy")
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate_hz), "--format"]
    cmd += ["raw", "--threads", *(["--idle"] if idle else []), "--nonblocking"]
    cmd += ["--output", str(out_path)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise RuntimeError(f"{flag} needs py-spy on PATH: pip install py-spy") from None
    return Spy(proc, out_path, time.monotonic())


@dataclass(frozen=True)
class Spy:
    """A running `py-spy record` and the file it writes when stopped."""

    proc: subprocess.Popen[bytes]
    out_path: Path
    started: float  # time.monotonic()


def stop(spy: Spy) -> None:
    """SIGINT py-spy, which then writes its file. A SIGINT during its attach kills it
    before it handles the signal: it gets MIN_LIFETIME_S first, and a missing file is an
    error, not an empty profile."""
    time.sleep(max(0.0, spy.started + MIN_LIFETIME_S - time.monotonic()))
    spy.proc.send_signal(signal.SIGINT)
    _, err = spy.proc.communicate(timeout=120)
    if spy.proc.returncode not in (0, -signal.SIGINT) or not spy.out_path.exists():
        raise RuntimeError(
            f"py-spy failed (exit {spy.proc.returncode}, {spy.out_path} "
            f"{'written' if spy.out_path.exists() else 'not written'}): "
            f"{err.decode(errors='replace')}"
        )


def main_thread_per_push(path: Path, *, pushes: int, rate_hz: int) -> dict[str, Any]:
    """Busy ms per push of the service's main thread, total and by project function."""
    busy = idle = 0
    inclusive: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or "MainThread" not in frames[0]:
            continue
        n = int(count)
        if frames[-1].startswith(("EpollSelector.select", "KqueueSelector.select")):
            idle += n
            continue
        busy += n
        seen = set()
        for frame in frames[1:]:
            m = _PROJECT_FRAME_RE.match(frame)
            if (
                m is None
                or not m["file"].startswith(("lookup_table/", "optimizer_service/"))
                or m["func"] in ("<module>", "main")  # the service's entry point: every sample
            ):
                continue
            name = f"{m['file']}:{m['func']}"
            if name not in seen:
                seen.add(name)
                inclusive[name] = inclusive.get(name, 0) + n
    per_push = 1e3 / rate_hz / pushes
    top = sorted(inclusive.items(), key=lambda kv: -kv[1])[:30]
    return {
        "file": path.name,
        "pushes": pushes,
        "rate_hz": rate_hz,
        "main_thread_busy_ms_per_push": busy * per_push,
        "main_thread_idle_ms_per_push": idle * per_push,
        "note": "idle includes about 1 s of attach time before the pushes",
        "inclusive_ms_per_push": {name: n * per_push for name, n in top},
    }


def _frame_name(frame: str) -> str:
    m = _FRAME_RE.match(frame)
    return f"{m['func']} ({m['file']})" if m else frame


def threads_per_step(path: Path, *, steps: int, rate_hz: int, top: int = 15) -> dict[str, Any]:
    """Per thread: ms per step (wall: `--idle` keeps blocked samples) in total, by
    function (inclusive, each function once per sample) and by leaf function."""
    per_ms = 1e3 / rate_hz / steps
    threads: dict[str, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = frames[0]
        name = head.split(": ", 1)[1] if ": " in head else head
        n = int(count)
        t = threads.setdefault(
            name,
            {
                "samples": 0,
                "waiting": 0,
                "inclusive": collections.Counter(),
                "leaf": collections.Counter(),
            },
        )
        t["samples"] += n
        names = [_frame_name(f) for f in frames[1:]]
        for fn in set(names):
            t["inclusive"][fn] += n
        leaf = names[-1] if names else "(no python frame)"
        t["leaf"][leaf] += n
        if leaf.startswith(_WAITING_LEAVES):
            t["waiting"] += n
    out: dict[str, Any] = {"file": path.name, "rate_hz": rate_hz, "steps": steps}
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
        out[name] = {
            "wall_ms_per_step": t["samples"] * per_ms,
            "waiting_ms_per_step": t["waiting"] * per_ms,
            "inclusive_ms_per_step": {
                k: round(v * per_ms, 2) for k, v in t["inclusive"].most_common(top)
            },
            "leaf_ms_per_step": {k: round(v * per_ms, 2) for k, v in t["leaf"].most_common(top)},
        }
    return out
