"""How many row writes a replica would save by writing rows behind (no servers).

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.write_coalescing           # 400 batches of the demo's data
    python -m benchmarks.write_coalescing --quick   # smoke run: 60 batches
"""

from __future__ import annotations

import sys
import time

import numpy as np

from benchmarks.harness.data import first_batches
from benchmarks.harness.options import Options
from benchmarks.harness.report import machine_info, report_head, save
from lookup_table.core.hashing import mix64
from trainer.data.criteo import CATEGORICAL_NAMES

INTERVALS = (1, 2, 5, 10, 20, 50, 100)


def step_keys(batch_features: dict[str, object]) -> np.ndarray:
    """The unique keys of one batch's rows: (table number, id) mixed into one uint64
    (`mix64`: a collision among a few million keys is vanishingly rare)."""
    parts = []
    for number, name in enumerate(CATEGORICAL_NAMES):
        ids = np.asarray(batch_features[name]).astype(np.int64).view(np.uint64)
        parts.append(mix64(ids ^ np.uint64(number * 0x9E3779B97F4A7C15 % 2**64)))
    return np.unique(np.concatenate(parts))


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="60 batches")
    options.count("--batches", full=400, quick=60, help="batches of the demo's data")
    options.count("--batch-size", full=1024, help="examples a batch")
    args = options.parse(argv)
    batches = args.batches
    started = time.time()
    steps = [step_keys(batch.features) for batch in first_batches(batches, args.batch_size)]
    if len(steps) < batches:
        raise SystemExit(f"the source gave {len(steps)} batches, {batches} asked")
    half = batches // 2
    per_push = float(np.mean([s.shape[0] for s in steps[half:]]))
    in_previous, in_any = [], []
    seen: np.ndarray = np.empty(0, dtype=np.uint64)
    for i, keys in enumerate(steps):
        if i >= half:
            in_previous.append(int(np.isin(keys, steps[i - 1]).sum()))
            in_any.append(int(np.isin(keys, seen).sum()))
        seen = np.union1d(seen, keys)
    rows = []
    print(
        f"demo data, batch {args.batch_size}, 26 tables: {per_push:,.0f} unique ids a push "
        f"(batches {half}-{batches}); of them {np.mean(in_previous):,.0f} in the previous "
        f"push, {np.mean(in_any):,.0f} in any earlier one"
    )
    print("  write rows every   items written per push   of write-through")
    for k in INTERVALS:
        if k > batches - half:
            continue
        windows = [
            np.unique(np.concatenate(steps[i : i + k])).shape[0]
            for i in range(half, batches - k + 1, k)
        ]
        written = float(np.mean(windows)) / k
        rows.append({"every_pushes": k, "items_per_push": written, "ratio": written / per_push})
        print(f"  {k:4d} pushes        {written:12,.0f}             {written / per_push:6.2f}")
    report = {
        **report_head("write_coalescing", started, machine_info(memcached=False)),
        "parameters": {"batches": batches, "batch_size": args.batch_size, "tables": 26},
        "unique_ids_per_push": per_push,
        "in_previous_push": float(np.mean(in_previous)),
        "in_any_earlier_push": float(np.mean(in_any)),
        "intervals": rows,
    }
    save(report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
