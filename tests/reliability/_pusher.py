"""A trainer-like client process for the reliability suite: deterministic pushes, no TF.

    python -m tests.reliability._pusher --config C --proc P --pushes N --run R \
        --ready FILE --start FILE --out FILE [--max-retries K --backoff-s S]

It touches `--ready`, waits for `--start` (a barrier), sends pushes 0..N-1 with push_ids
`push_id(run, proc, i)` and gradients `make_push(proc, i)`, a pure function of (proc, i)
that the test recomputes, and writes a JSON report of every push's times and the
client's summary, or the error that stopped it (exit 1), to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
import zlib
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.client import OptimizerClient
from lookup_table.config import load_config

# The tables of the load test. `sgd`: continuous gradients, checked to 1e-5. `words`:
# string ids, zero rows and dyadic gradients (k * 2**-8), so every sum is exact in
# float32 and the check is equality. `adam`: its per-row step count (in the slots)
# counts the pushes that touched the row, so a push applied twice shows.
TABLES: list[dict[str, Any]] = [
    {"name": "sgd", "dim": 8, "seed": 11, "optimizer": {"name": "sgd", "learning_rate": 0.5}},
    {
        "name": "adam",
        "dim": 8,
        "seed": 12,
        "optimizer": {"name": "adam", "learning_rate": 0.01},
    },
    {
        "name": "words",
        "dim": 4,
        "seed": 13,
        "id_type": "string",
        "initializer": {"name": "zeros"},
        "optimizer": {"name": "sgd", "learning_rate": 0.25},
    },
]
DIMS = {t["name"]: int(t["dim"]) for t in TABLES}
LEARNING_RATES = {
    t["name"]: float(t["optimizer"]["learning_rate"])
    for t in TABLES
    if t["optimizer"]["name"] == "sgd"
}
POOL_SIZE = 96  # ids per table that pushes draw from
ROWS_PER_PUSH = {"sgd": 12, "adam": 12, "words": 6}  # draws per push (with repeats)
ZIPF_S = 1.1  # P(rank r) ~ 1 / (r + 1)**s: rank 0 is in almost every push
WORKLOAD_SEED = 8_2024


@lru_cache
def pool(table: str) -> NDArray[Any]:
    """The ids pushes draw from, hottest first: int64 over the whole range, or str.

    Cached: never modify the result.
    """
    rng = np.random.default_rng([WORKLOAD_SEED, zlib.crc32(table.encode())])
    if table == "words":
        return np.array([f"w{r}-{rng.integers(10**6)}" for r in range(POOL_SIZE)], dtype=object)
    extremes = np.array([0, -1, 2**63 - 1, -(2**63), 1], dtype=np.int64)
    drawn = rng.integers(-(2**63), 2**63 - 1, size=4 * POOL_SIZE, dtype=np.int64)
    ids = np.unique(np.concatenate([extremes, drawn]))  # distinct
    rng.shuffle(ids)
    return ids[:POOL_SIZE]


def cold_ids(table: str) -> NDArray[Any]:
    """Ids no push ever draws (for "untouched" checks)."""
    if table == "words":
        return np.array([f"cold-{k}" for k in range(8)], dtype=object)
    hot = set(pool(table).tolist())
    return np.array([k for k in range(1000, 1020) if k not in hot][:8], dtype=np.int64)


_WEIGHTS = 1.0 / np.arange(1, POOL_SIZE + 1, dtype=np.float64) ** ZIPF_S
_WEIGHTS /= _WEIGHTS.sum()


def make_push(proc: int, i: int) -> dict[str, tuple[NDArray[Any], NDArray[np.float32]]]:
    """The gradients of push `i` of process `proc`: `{table: (ids (n,), grads (n, dim))}`.

    Ids are Zipf-hot draws from `pool(table)`, with repeats (the service sums them);
    the first id is always drawn twice. Deterministic in (proc, i).
    """
    rng = np.random.default_rng([WORKLOAD_SEED, proc, i])
    out: dict[str, tuple[NDArray[Any], NDArray[np.float32]]] = {}
    for table in ("sgd", "adam", "words"):
        ranks = rng.choice(POOL_SIZE, size=ROWS_PER_PUSH[table], p=_WEIGHTS)
        ranks = np.append(ranks, ranks[0])  # at least one id twice in every push
        ids = pool(table)[ranks]
        shape = (ranks.size, DIMS[table])
        if table == "words":  # small multiples of 2**-8: exact sums in float32
            k = rng.integers(1, 9, size=shape) * rng.choice([-1, 1], size=shape)
            grads = (k * 2.0**-8).astype(np.float32)
        elif table == "sgd":  # |g| in [0.5, 1] * 2**-10: a lost or extra push moves > 1e-4
            grads = (
                rng.uniform(0.5, 1.0, size=shape) * rng.choice([-1, 1], size=shape) * 2.0**-10
            ).astype(np.float32)
        else:
            grads = rng.standard_normal(shape).astype(np.float32)
        out[table] = (ids, grads)
    return out


def push_id(run: str, proc: int, i: int) -> str:
    return f"{run}-p{proc}-{i}"


def _barrier(ready: Path, start: Path, *, timeout_s: float = 60.0) -> None:
    """Say ready, then wait until the test opens the barrier (creates `start`)."""
    ready.touch()
    deadline = time.monotonic() + timeout_s
    while not start.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{start} did not appear within {timeout_s} s")
        time.sleep(0.01)


async def _run(
    args: argparse.Namespace, work: list[dict[str, tuple[NDArray[Any], NDArray[np.float32]]]]
) -> dict[str, Any]:
    config = load_config(args.config)
    report: dict[str, Any] = {"proc": args.proc, "pushes": [], "error": None}
    async with OptimizerClient(
        config, worker=args.proc, max_retries=args.max_retries, backoff_s=args.backoff_s
    ) as client:
        try:
            for i, tables in enumerate(work):
                began = time.time()
                summary = await client.push(tables, push_id=push_id(args.run, args.proc, i))
                report["pushes"].append(
                    {
                        "i": i,
                        "start": began,
                        "end": time.time(),
                        "applied": summary["applied"],
                        "duplicate": summary["duplicate"],
                        "replicas": summary["replicas"],
                    }
                )
        except Exception as exc:
            report["error"] = f"push {len(report['pushes'])}: {type(exc).__name__}: {exc}"
            report["traceback"] = traceback.format_exc()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--proc", type=int, required=True)
    parser.add_argument("--pushes", type=int, required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--start", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-retries", type=int, default=6)
    parser.add_argument("--backoff-s", type=float, default=0.1)
    args = parser.parse_args(argv)
    # the workload is computed before the barrier, so the pushes start together
    work = [make_push(args.proc, i) for i in range(args.pushes)]
    _barrier(Path(args.ready), Path(args.start))
    report = asyncio.run(_run(args, work))
    Path(args.out).write_text(json.dumps(report))
    return 0 if report["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
