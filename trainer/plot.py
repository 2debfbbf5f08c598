"""Loss and AUC curves as PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["plot_training"]


def _smooth(values: Sequence[float], window: int) -> Any:
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape[0] < window or window <= 1:
        return arr
    kernel = np.ones(window) / window
    head = np.cumsum(arr[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(arr, kernel, mode="valid")])


def plot_training(summaries: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Plot the training loss (smoothed) and eval AUC of one or more workers' summaries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(11, 4))
    for summary in summaries:
        label = f"worker {summary.get('worker', 0)}"
        losses = summary.get("history", {}).get("losses", [])
        if losses:
            steps = [s for s, _ in losses]
            window = max(1, len(losses) // 50)
            ax_loss.plot(steps, _smooth([v for _, v in losses], window), label=label)
        evals = summary.get("history", {}).get("evals", [])
        if evals:
            ax_auc.plot(
                [e["step"] for e in evals], [e["auc"] for e in evals], marker="o", label=label
            )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (smoothed)")
    ax_loss.set_title("loss")
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("eval AUC")
    ax_auc.set_title("evaluation")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trainer.plot summary-0.json summary-1.json --out loss.png`."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="plot lookup-table-train summaries")
    parser.add_argument("summaries", nargs="+", help="summary JSON files (--output of train)")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args(argv)
    summaries = [json.loads(Path(p).read_text()) for p in args.summaries]
    plot_training(summaries, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
