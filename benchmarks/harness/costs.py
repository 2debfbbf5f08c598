"""The cost table of a timed window: each process's CPU per step (/proc, thread by
thread) split into the model's own math, the bytes moved and everything else.

A Python process's threads are split by py-spy's CPU samples (no `--idle`): each
sample goes to a category by its innermost Python frame (`category`), and each
thread's /proc CPU is shared out in its samples' proportions. Threads py-spy never
sampled (TensorFlow's op threads) count whole as `native_category`. memcached has no
Python: its kernel time (socket syscalls) is bytes moved, its user time (parsing,
hashing, copying) everything else.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness.cpu import task_stats

CATEGORIES = ("math", "bytes", "else")
_HEAD_RE = re.compile(r"^thread \((?P<tid>\d+)\)")
_FRAME_RE = re.compile(r"^(?P<func>.*) \((?P<file>.*):\d+\)$")

# (path fragment of the innermost frame's file, its function or "" for any)
_MATH = (
    ("tensorflow/python/eager/execute.py", ""),  # a tf.function's or an op's kernels
    ("tensorflow/python/eager/context.py", "call_function"),
    ("tensorflow/python/ops/gen_", ""),  # an eager op's fast path
    ("lookup_table/core/optimizers/", ""),  # the optimizers' compiled passes
)
# the event loop woken by another thread (its self-pipe): a wake-up, not the data's bytes
_WAKEUPS = (
    ("asyncio/selector_events.py", "BaseSelectorEventLoop._write_to_self"),
    ("asyncio/selector_events.py", "BaseSelectorEventLoop._read_from_self"),
    ("asyncio/selector_events.py", "BaseSelectorEventLoop._process_self_data"),
)
_BYTES = (
    ("msgpack", ""),
    ("lookup_table/core/wire.py", ""),
    ("lookup_table/client/answers.py", ""),
    ("lookup_table/memcached/protocol.py", ""),
    ("lookup_table/memcached/replies.py", ""),
    ("lookup_table/memcached/commands.py", ""),
    ("asyncio/selector_events.py", ""),
    ("asyncio/streams.py", ""),
    ("socket.py", ""),
    ("aiohttp/http_parser.py", ""),
    ("aiohttp/http_writer.py", ""),
    ("aiohttp/streams.py", ""),
    ("aiohttp/payload.py", ""),
)


def _matches(file: str, func: str, rules: tuple[tuple[str, str], ...]) -> bool:
    return any(part in file and (not want or func == want) for part, want in rules)


def category(leaf: str) -> str:
    """ "math", "bytes" or "else" for a sample whose innermost Python frame is `leaf`
    ("function (file:line)", py-spy's raw format)."""
    m = _FRAME_RE.match(leaf)
    if m is None:
        return "else"
    file, func = m["file"], m["func"]
    if _matches(file, func, _MATH):
        return "math"
    if _matches(file, func, _BYTES) and not _matches(file, func, _WAKEUPS):
        return "bytes"
    return "else"


def task_cpu_s(pid: int) -> dict[str, list[float]]:
    """{tid: [user s, system s]} of a process's live threads ({} if it is gone)."""
    return {tid: [user, system] for tid, (_, user, system) in task_stats(pid).items()}


def snapshot(pids: Mapping[str, int]) -> dict[str, dict[str, list[float]]]:
    return {name: task_cpu_s(pid) for name, pid in pids.items()}


def _thread_deltas(
    start: Mapping[str, list[float]], end: Mapping[str, list[float]]
) -> dict[str, list[float]]:
    """Per thread [user, system] seconds over the window (threads born in it from 0)."""
    return {
        tid: [after[i] - start.get(tid, [0.0, 0.0])[i] for i in (0, 1)]
        for tid, after in end.items()
    }


def samples_by_thread(path: Path) -> dict[str, collections.Counter[str]]:
    """{tid: Counter of innermost frames} of a py-spy raw file recorded with `--threads`."""
    out: dict[str, collections.Counter[str]] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = _HEAD_RE.match(frames[0])
        if head is None:
            continue
        leaf = frames[-1] if len(frames) > 1 else "(no python frame)"
        out.setdefault(head["tid"], collections.Counter())[leaf] += int(count)
    return out


def python_process(
    samples: Mapping[str, collections.Counter[str]],
    start: Mapping[str, list[float]],
    end: Mapping[str, list[float]],
    *,
    steps: int,
    native_category: str,
    top: int = 8,
) -> dict[str, Any]:
    """A Python process's CPU ms per step by category, and its heaviest innermost
    frames in each (ms per step)."""
    ms = dict.fromkeys(CATEGORIES, 0.0)
    leaves: dict[str, dict[str, float]] = {c: collections.defaultdict(float) for c in CATEGORIES}
    unsampled = 0.0
    total = 0.0
    for tid, (user, system) in _thread_deltas(start, end).items():
        cpu_ms = (user + system) * 1e3 / steps
        total += cpu_ms
        counts = samples.get(tid)
        if not counts:
            ms[native_category] += cpu_ms
            unsampled += cpu_ms
            continue
        n = sum(counts.values())
        for leaf, k in counts.items():
            share = cpu_ms * k / n
            c = category(leaf)
            ms[c] += share
            leaves[c][leaf] += share
    return {
        "cpu_ms_per_step": total,
        **{f"{c}_ms_per_step": ms[c] for c in CATEGORIES},
        "unsampled_threads_ms_per_step": unsampled,
        "unsampled_threads_counted_as": native_category,
        "samples": sum(sum(c.values()) for c in samples.values()),
        "top_frames_ms_per_step": {
            c: {
                leaf: round(v, 2)
                for leaf, v in sorted(leaves[c].items(), key=lambda kv: -kv[1])[:top]
            }
            for c in CATEGORIES
        },
    }


def memcached_process(
    start: Mapping[str, list[float]], end: Mapping[str, list[float]], *, steps: int
) -> dict[str, Any]:
    """memcached's CPU ms per step: kernel time as bytes moved, user time as the rest."""
    user = sum(d[0] for d in _thread_deltas(start, end).values()) * 1e3 / steps
    system = sum(d[1] for d in _thread_deltas(start, end).values()) * 1e3 / steps
    return {
        "cpu_ms_per_step": user + system,
        "math_ms_per_step": 0.0,
        "bytes_ms_per_step": system,
        "else_ms_per_step": user,
    }


def render(costs: Mapping[str, Mapping[str, Any]]) -> str:
    """The cost table: a row per process, CPU ms per step and its split."""
    lines = [
        f"{'process':<13} {'CPU ms/step':>11} {'math':>7} {'bytes':>7} {'else':>7}  "
        "(math: forward, backward, Adam; bytes: sockets, serialization; else: Python "
        "calls, conversions, copies, wake-ups)"
    ]
    for name, c in costs.items():
        lines.append(
            f"{name:<13} {c['cpu_ms_per_step']:>11.1f} {c['math_ms_per_step']:>7.1f} "
            f"{c['bytes_ms_per_step']:>7.1f} {c['else_ms_per_step']:>7.1f}"
        )
    keys = ("cpu_ms_per_step", *(f"{c}_ms_per_step" for c in CATEGORIES))
    total = {k: sum(c[k] for c in costs.values()) for k in keys}
    lines.append(
        f"{'all':<13} {total['cpu_ms_per_step']:>11.1f} {total['math_ms_per_step']:>7.1f} "
        f"{total['bytes_ms_per_step']:>7.1f} {total['else_ms_per_step']:>7.1f}"
    )
    return "\n".join(lines)
