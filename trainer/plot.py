"""Training curves as one PNG (matplotlib, Agg backend), for one worker or all of them.

    python -m trainer.plot summary-0.json summary-1.json --out loss.png

Each summary is what `lookup-table-train --output` wrote. The left panel has each
worker's training loss (per step, faint, and smoothed) and its evaluation log loss
(markers): eval loss rising while training loss falls is overfitting. The right
panel has the evaluation AUC. A star marks the final evaluation (the whole
`--eval-data` file, or the held-out batches), which may differ from the periodic
ones (the first `--eval-batches` only).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "plot_training"]

_SMOOTH_POINTS = 20  # the training loss is a moving average of len / this steps


def _smooth(values: Sequence[float], window: int) -> Any:
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape[0] < window or window <= 1:
        return arr
    kernel = np.ones(window) / window
    head = np.cumsum(arr[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(arr, kernel, mode="valid")])


def _plot_evals(
    ax: Any, evals: Sequence[Mapping[str, Any]], key: str, color: Any, label: str
) -> None:
    """Periodic evaluations as markers joined by a dashed line, the final one as a star."""
    periodic = [e for e in evals if not e.get("final")]
    final = [e for e in evals if e.get("final")]
    styles: list[tuple[list[Mapping[str, Any]], dict[str, Any]]] = [
        (periodic, {"linestyle": "--", "marker": "o", "markersize": 4, "label": label}),
        (
            final,
            {
                "linestyle": "none",
                "marker": "*",
                "markersize": 13,
                "markeredgecolor": "black",
                "label": None if periodic else label,
            },
        ),
    ]
    for points, style in styles:
        if points:
            ax.plot([e["step"] for e in points], [e[key] for e in points], color=color, **style)


def plot_training(summaries: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Plot the training loss, eval log loss and eval AUC of workers' summaries into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    interrupted = []
    for n, summary in enumerate(sorted(summaries, key=lambda s: int(s.get("worker", 0)))):
        worker = summary.get("worker", 0)
        color = colors[n % len(colors)]
        history = summary.get("history", {})
        losses = history.get("losses", [])
        if losses:
            steps = [s for s, _ in losses]
            values = [v for _, v in losses]
            window = max(1, len(losses) // _SMOOTH_POINTS)
            label = f"worker {worker} train"
            if window > 1:
                ax_loss.plot(steps, values, color=color, alpha=0.2, linewidth=0.8)
                label += f" (mean of {window} steps)"
            ax_loss.plot(steps, _smooth(values, window), color=color, label=label)
        evals = [e for e in history.get("evals", []) if "step" in e]
        _plot_evals(ax_loss, evals, "logloss", color, f"worker {worker} eval")
        _plot_evals(ax_auc, evals, "auc", color, f"worker {worker}")
        if summary.get("interrupted"):
            interrupted.append(f"worker {worker} at step {summary.get('steps')}")
    any_final = any(
        e.get("final") for s in summaries for e in s.get("history", {}).get("evals", [])
    )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("log loss")
    ax_loss.set_title("training and eval loss")
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    ax_auc.set_title("eval AUC")
    for ax in (ax_loss, ax_auc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5 in a short run
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            star = Line2D([], [], linestyle="none", marker="*", markersize=11, color="grey")
            if any_final:
                handles, labels = [*handles, star], [*labels, "final eval"]
            ax.legend(handles, labels, fontsize="small")
    workers = len(summaries)
    title = f"{workers} worker{'s' if workers != 1 else ''}"
    data = {str(s.get("data")) for s in summaries if s.get("data")}
    if len(data) == 1:
        title += f" on {data.pop()}"
    if interrupted:
        title += " (interrupted: " + ", ".join(interrupted) + ")"
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.plot",
        description="Plot lookup-table-train summaries (one per worker, from --output) into "
        "one PNG: training and eval loss, eval AUC, a colour per worker.",
        epilog="e.g. python -m trainer.plot run/summary-*.json --out run/loss.png",
    )
    parser.add_argument(
        "summaries",
        nargs="+",
        metavar="SUMMARY",
        help="summary JSON files (--output of each worker)",
    )
    parser.add_argument("--out", required=True, metavar="PNG", help="the PNG to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trainer.plot summary-0.json summary-1.json --out loss.png`."""
    parser = _parser()
    args = parser.parse_args(argv)
    summaries = []
    for name in args.summaries:
        try:
            summary = json.loads(Path(name).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"{name}: cannot read a summary: {exc}")
        if not isinstance(summary, dict) or "history" not in summary:
            parser.error(
                f"{name}: not a lookup-table-train summary (no 'history'); give the files "
                "--output wrote"
            )
        summaries.append(summary)
    print(plot_training(summaries, args.out))  # noqa: T201 - the command's result
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
