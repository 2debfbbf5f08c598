"""Benchmark the segment sum of a push: duplicate ids' gradients summed per unique id.

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.segment_sum            # 15 rounds, 65,536 x 64 float32 grads
    python -m benchmarks.segment_sum --quick    # smoke run: 3 rounds, 8,192 x 64
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from benchmarks.harness.data import SEED
from benchmarks.harness.options import Options
from benchmarks.harness.report import machine_info, report_head, save
from benchmarks.harness.rounds import interleaved, timed_sync
from lookup_table.core.optimizers import segment_sum

DIM = 64
ZIPF_A = 1.2

Ids = NDArray[Any]
Grads = NDArray[np.float32]
Method = Callable[[Ids, Grads], tuple[Ids, Grads]]


def add_at_2d(ids: Ids, grads: Grads) -> tuple[Ids, Grads]:
    uniq, inv = np.unique(ids, return_inverse=True)
    out = np.zeros((uniq.shape[0], grads.shape[1]), dtype=np.float32)
    np.add.at(out, inv, grads)
    return uniq, out


def add_at_flat(ids: Ids, grads: Grads) -> tuple[Ids, Grads]:
    uniq, inv = np.unique(ids, return_inverse=True)
    dim = grads.shape[1]
    out = np.zeros(uniq.shape[0] * dim, dtype=np.float32)
    flat = (inv[:, None] * dim + np.arange(dim)).ravel()
    np.add.at(out, flat, grads.ravel())
    return uniq, out.reshape(-1, dim)


def unique_reduceat(ids: Ids, grads: Grads) -> tuple[Ids, Grads]:
    uniq, inv = np.unique(ids, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    counts = np.bincount(inv, minlength=uniq.shape[0])
    starts = np.zeros(uniq.shape[0], dtype=np.intp)
    np.cumsum(counts[:-1], out=starts[1:])
    return uniq, np.add.reduceat(grads[order], starts, axis=0)


def argsort_reduceat(ids: Ids, grads: Grads) -> tuple[Ids, Grads]:
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    first = np.empty(sorted_ids.shape[0], dtype=bool)
    first[:1] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return sorted_ids[starts], np.add.reduceat(grads[order], starts, axis=0)


def python_loop(ids: Ids, grads: Grads) -> tuple[Ids, Grads]:
    acc: dict[Any, NDArray[np.float32]] = {}
    for i, key in enumerate(ids.tolist()):
        row = acc.get(key)
        if row is None:
            acc[key] = grads[i].copy()
        else:
            row += grads[i]
    keys = sorted(acc)
    out_ids = np.empty(len(keys), dtype=ids.dtype)
    out_ids[:] = keys
    return out_ids, np.stack([acc[k] for k in keys])


METHODS: dict[str, Method] = {
    "add_at_2d": add_at_2d,
    "add_at_flat": add_at_flat,
    "unique_reduceat": unique_reduceat,
    "argsort_reduceat": argsort_reduceat,
    "segment_sum": segment_sum,
    "python_loop": python_loop,
}
STRING_METHODS = ("add_at_flat", "argsort_reduceat", "segment_sum", "python_loop")
SEQUENTIAL = ("add_at_2d", "add_at_flat", "segment_sum", "python_loop")


def make_batch(n: int, *, strings: bool) -> tuple[Ids, Grads]:
    rng = np.random.default_rng(SEED)
    ids = rng.zipf(ZIPF_A, size=n).astype(np.int64)
    grads = rng.standard_normal((n, DIM), dtype=np.float32)
    if strings:
        obj = np.empty(n, dtype=object)
        obj[:] = [f"item-{i}" for i in ids.tolist()]
        return obj, grads
    return ids, grads


def check_agree(ids: Ids, grads: Grads, names: tuple[str, ...]) -> dict[str, bool]:
    """Which methods equal python_loop bit for bit; exit if any is off by more than rounding."""
    want_ids, want = python_loop(ids, grads)
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    abs_sums = np.zeros(want.shape, dtype=np.float64)
    np.add.at(abs_sums, inverse, np.abs(grads.astype(np.float64)))
    # Two float32 summations of k terms in any order differ by at most
    # 2 * (k - 1) * 2**-24 * sum|g| (each rounding error is <= 2**-24 of a partial sum).
    bound = 2.0 * (counts[:, None] - 1) * 2.0**-24 * abs_sums
    bitwise: dict[str, bool] = {}
    for name in names:
        got_ids, got = METHODS[name](ids, grads)
        if not np.array_equal(got_ids, want_ids) or got.shape != want.shape:
            raise SystemExit(f"{name}: different unique ids or shape than python_loop")
        err = np.abs(got.astype(np.float64) - want)
        if (err > bound).any():
            raise SystemExit(f"{name}: off by {err.max()} from python_loop, beyond rounding")
        bitwise[name] = bool(np.array_equal(got, want))
        if name in SEQUENTIAL and not bitwise[name]:
            raise SystemExit(f"{name}: should add in push order but differs from python_loop")
    return bitwise


def bench(
    ids: Ids, grads: Grads, names: tuple[str, ...], rounds: int, bitwise: dict[str, bool]
) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _, name in interleaved(names, rounds):
        seconds[name].append(timed_sync(partial(METHODS[name], ids, grads)))
    medians = {name: statistics.median(ts) for name, ts in seconds.items()}
    base = medians["python_loop"]
    return {
        "rows": int(ids.shape[0]),
        "unique_ids": int(np.unique(ids).shape[0]),
        "seconds_per_round": seconds,
        "median_ms": {name: 1e3 * t for name, t in medians.items()},
        "speedup_vs_python_loop": {name: base / t for name, t in medians.items()},
        "bitwise_equal_to_python_loop": bitwise,
    }


def render(title: str, result: dict[str, Any]) -> str:
    lines = [
        f"{title}: {result['rows']:,} x {DIM} float32, {result['unique_ids']:,} unique ids",
        f"  {'method':<18}{'median ms':>10}{'vs loop':>10}  sums",
    ]
    for name, ms in result["median_ms"].items():
        ratio = result["speedup_vs_python_loop"][name]
        order = "= loop" if result["bitwise_equal_to_python_loop"][name] else "~ loop (rounding)"
        lines.append(f"  {name:<18}{ms:>10.2f}{ratio:>9.1f}x  {order}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="3 rounds of 8,192 rows")
    options.count("--rounds", full=15, quick=3, help="timed rounds")
    options.count("--rows", full=65_536, quick=8192, help="gradient rows")
    args = options.parse(argv)
    started = time.time()
    machine = machine_info(memcached=False, nproc_usable=False)
    int_names = tuple(METHODS)
    ids, grads = make_batch(args.rows, strings=False)
    bitwise = check_agree(ids, grads, int_names)
    int_result = bench(ids, grads, int_names, args.rounds, bitwise)
    print(render("int64 ids", int_result))

    sids, sgrads = make_batch(args.rows, strings=True)
    bitwise = check_agree(sids, sgrads, STRING_METHODS)
    str_result = bench(sids, sgrads, STRING_METHODS, args.rounds, bitwise)
    print(render("\nstring ids", str_result))

    report = {
        **report_head("segment_sum", started, machine),
        "parameters": {
            "rounds": args.rounds,
            "rows": args.rows,
            "dim": DIM,
            "quick": args.quick,
            "ids": f"numpy default_rng({SEED}).zipf({ZIPF_A}); strings 'item-<id>'",
            "notes": [
                "checked first: add_at_* and segment_sum equal python_loop bit for bit; "
                "the reduceat methods within the float32 rounding bound",
                "methods interleaved round by round, order rotated; gc.collect() before each",
                "speedup = python_loop median / method median",
            ],
        },
        "int64_ids": int_result,
        "string_ids": str_result,
    }
    save(report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
