"""Rounds on a shared machine: timing one call, methods interleaved round by round,
ABBA order, waiting for a quiet machine and running a disturbed round again, the
paired-round ratio and a window's step timing."""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from benchmarks.harness.cpu import machine_busy_s

QUIET_SHARE = 0.25  # of all cores: `wait_for_quiet` waits until the machine is below it
DISTURBED_SHARE = 0.15  # other processes' share of the machine that makes a timed window disturbed

T = TypeVar("T")
R = TypeVar("R", bound=Mapping[str, Any])


# ---------------------------------------------------------------- timing one call


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    gc.collect()
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


def timed_sync(call: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


@dataclass(slots=True)
class Timings:
    """Seconds per round for each method."""

    rounds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, method: str, seconds: float) -> None:
        self.rounds.setdefault(method, []).append(seconds)

    def median(self, method: str) -> float:
        return statistics.median(self.rounds[method])


# ---------------------------------------------------------------- the order of rounds


def progress(total: int, desc: str) -> Iterator[int]:
    """tqdm on a terminal, one plain line per step otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(range(total), desc=desc, file=sys.stderr, leave=False)
        return
    for i in range(total):
        print(f"  {desc}: round {i + 1}/{total}", file=sys.stderr, flush=True)
        yield i


def interleaved(
    methods: Sequence[str], rounds: int, desc: str | None = None
) -> Iterator[tuple[int, str]]:
    """(round, method): every method once a round, the order rotated each round, so a
    drift of the machine's load hits every method (with `desc`, a progress line a round)."""
    for r in range(rounds) if desc is None else progress(rounds, desc):
        shift = r % len(methods)
        for method in [*methods[shift:], *methods[:shift]]:
            yield r, method


def rotated_within(plan: Sequence[tuple[int, str]], group: Sequence[str]) -> list[tuple[int, str]]:
    """`plan` (as `interleaved` gives it) with the methods of `group` put into their places
    in `group`'s order rotated by the round number: over len(group) rounds each takes
    each place once. `interleaved` moves them as one block, in one order, every round."""
    rounds: dict[int, list[str]] = {}
    for r, method in plan:
        rounds.setdefault(r, []).append(method)
    out: list[tuple[int, str]] = []
    for r, methods in rounds.items():
        places = [i for i, m in enumerate(methods) if m in group]
        if places:
            members = [m for m in group if m in methods]  # group's order, not the round's
            shift = r % len(members)
            for i, m in zip(places, members[shift:] + members[:shift], strict=True):
                methods[i] = m
        out.extend((r, m) for m in methods)
    return out


def abba(pair: Sequence[T], rounds: int) -> list[T]:
    """`rounds` of each of the two, in the order A B B A A B ..."""
    return [pair[(k + (k // 2)) % 2] for k in range(2 * rounds)]


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over rounds of the rate ratio num/den of one round (den seconds / num seconds)."""
    return statistics.median(d / n for n, d in zip(num, den, strict=True))


# ---------------------------------------------------------------- a shared machine


def wait_for_quiet(max_wait_s: float, quiet_share: float = QUIET_SHARE) -> dict[str, Any]:
    """Wait (up to `max_wait_s`) until the machine was less than `quiet_share` busy for 2 s.

    The machine is shared: another job's burst would land in one method's window.
    Returns the busy share last seen and how long we waited. With `max_wait_s` <= 0
    (`--quick`) nothing waits: the share is sampled over 0.2 s, only to be reported.
    """
    cpus = os.cpu_count() or 1
    start = time.monotonic()
    share = float("nan")
    sample_s = 2.0 if max_wait_s > 0 else 0.2
    while True:
        before, t0 = machine_busy_s(), time.monotonic()
        time.sleep(sample_s)
        share = (machine_busy_s() - before) / ((time.monotonic() - t0) * cpus)
        waited = time.monotonic() - start
        if share < quiet_share or waited >= max_wait_s:
            return {"busy_share": share, "waited_s": waited, "quiet": share < quiet_share}


def with_retries(
    order: Sequence[T],
    run: Callable[[int, T, int], dict[str, Any]],
    *,
    retries: int,
    quiet_wait_s: float,
    share: Callable[[dict[str, Any]], float],
    line: Callable[[dict[str, Any]], str],
    title: Callable[[T], str],
    unit: str = "round",
) -> list[dict[str, Any]]:
    """Every item of `order` run as `run(k, item, attempt)` after waiting for a quiet
    machine, and run again (up to `retries` times) while other processes used more than
    DISTURBED_SHARE of it (`share` of a result) in its window. Each result gets `unit`
    (its index in `order`), `attempt`, `machine_before` and `disturbed`; every attempt is
    returned, in order, and printed (`title` of the item, then `line` of the result)."""
    results: list[dict[str, Any]] = []
    for k, item in enumerate(order):
        for attempt in range(retries + 1):
            again = f" (again: the last try was disturbed, {attempt}/{retries})"
            print(
                f"{unit} {k + 1}/{len(order)}: {title(item)}{again if attempt else ''} ...",
                flush=True,
            )
            quiet = wait_for_quiet(quiet_wait_s)
            r = run(k, item, attempt)
            r[unit], r["attempt"], r["machine_before"] = k, attempt, quiet
            r["disturbed"] = share(r) > DISTURBED_SHARE
            results.append(r)
            print(f"  {line(r)}", flush=True)
            if not r["disturbed"]:
                break
    return results


def undisturbed(tried: Sequence[R]) -> list[R]:
    """The undisturbed results, or all of them if every one was disturbed."""
    return [r for r in tried if not r["disturbed"]] or list(tried)


# ---------------------------------------------------------------- a window of steps


def step_window(
    ends: Sequence[float], window_end: float, warmup: int, batch_size: int
) -> dict[str, Any]:
    """examples/s over steps warmup+1..N: from the end of step `warmup` to `window_end`."""
    timed = len(ends) - warmup
    seconds = window_end - ends[warmup - 1]
    step_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(ends[warmup - 1 :])]
    return {
        "timed_steps": timed,
        "seconds": seconds,
        "examples_per_s": timed * batch_size / seconds,
        "step_ms_median": statistics.median(step_ms),
    }
