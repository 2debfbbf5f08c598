"""The PNGs beside the reports: matplotlib with its Agg backend (no display), and the
bar chart of rows/s per method and dim that the store and optimizer benchmarks draw."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


@contextlib.contextmanager
def figure(path: Path, *, dpi: int = 110, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """`plt.subplots(**subplots)` as (figure, axes); laid out, saved to `path` and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def plot_rates(
    summary: Mapping[str, Any],
    path: Path,
    *,
    methods: Sequence[str],
    labels: Mapping[str, str],
    dims: Sequence[int],
    xticks: Sequence[str],
    ylabel: str,
    title: str,
) -> None:
    """Bars of thousand rows/s (`summary["dim<d>"]["rows_per_s"]`), one group per dim."""
    with figure(path, dpi=120, figsize=(8, 4.5)) as (_, ax):
        width = 0.8 / len(methods)
        x = np.arange(len(dims))
        for i, m in enumerate(methods):
            rates = [summary[f"dim{d}"]["rows_per_s"][m] / 1e3 for d in dims]
            bars = ax.bar(x + (i - (len(methods) - 1) / 2) * width, rates, width, label=labels[m])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(x, list(xticks))
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
