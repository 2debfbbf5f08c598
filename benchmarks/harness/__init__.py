"""What the benchmarks share: their options, rounds and quiet-wait, local clusters, CPU
accounting, data, the report and its plots. Not a benchmark.

Importing it makes sure the code measured is this checkout's (see `ROOT`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _measure_this_checkout() -> None:
    """Measure this checkout's code, in this process and in every process it starts (a
    cluster, a trainer role), never the checkout the environment has installed (an
    editable install of another worktree is found first otherwise, and silently)."""
    for name in ("lookup_table", "optimizer_service", "trainer"):
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None)
        if where is None and module is None:
            spec = importlib.util.find_spec(name)
            where = None if spec is None else spec.origin
        if where is not None and not Path(where).resolve().is_relative_to(ROOT):
            raise SystemExit(
                f"{name} was imported from {Path(where).parent}, not from this checkout "
                f"({ROOT}): run with PYTHONPATH={ROOT}"
            )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    )


_measure_this_checkout()
