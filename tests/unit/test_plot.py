"""`trainer.plot`: every worker's training and eval curves in one PNG (no cluster)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.plot import main, plot_training

pytestmark = pytest.mark.unit


def _summary(worker: int, *, steps: int = 200, interrupted: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(worker)
    losses = [[s, float(0.7 - 0.1 * s / steps + rng.normal(0, 0.02))] for s in range(1, steps + 1)]
    evals: list[dict[str, float]] = [
        {"step": s, "auc": 0.6 + s / 2000, "logloss": 0.65 - s / 4000, "examples": 512.0}
        for s in range(20, steps + 1, 20)
    ]
    if evals and not interrupted:
        evals.append({**evals[-1], "final": 1.0, "examples": 5000.0})
    return {
        "worker": worker,
        "data": "csv:train.csv",
        "steps": steps,
        "interrupted": interrupted,
        "history": {"losses": losses, "evals": evals, "versions": list(range(steps))},
    }


def _pixels(path: Path) -> Any:
    import matplotlib.image

    return matplotlib.image.imread(path)


def test_every_worker_and_every_evaluation_is_drawn(tmp_path: Path) -> None:
    one = plot_training([_summary(0)], tmp_path / "one.png")
    both = plot_training([_summary(0), _summary(1, interrupted=True)], tmp_path / "both.png")
    a, b = _pixels(one), _pixels(both)
    assert a.shape == b.shape and a.shape[0] > 300
    assert not np.array_equal(a, b)  # the second worker is in the picture


def test_a_run_with_one_evaluation_and_one_step_still_plots(tmp_path: Path) -> None:
    summary = _summary(0, steps=1)
    summary["history"]["evals"] = [{"step": 1, "auc": 0.5, "logloss": 0.69, "final": 1.0}]
    assert plot_training([summary], tmp_path / "x" / "tiny.png").stat().st_size > 5_000


def test_the_command_combines_the_workers_summaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for w in range(3):
        paths.append(tmp_path / f"summary-{w}.json")
        paths[-1].write_text(json.dumps(_summary(w)))
    out = tmp_path / "loss.png"
    assert main([*map(str, paths), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.stat().st_size > 10_000


def test_the_command_names_a_file_that_is_not_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "stats.json"
    other.write_text('{"format": "lookup-table/numeric-stats/1"}')
    with pytest.raises(SystemExit) as exc:
        main([str(other), "--out", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{other}: not a lookup-table-train summary" in err and "--output" in err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x.png")])
    assert "missing.json: cannot read a summary" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_help_says_how_to_combine_the_workers() -> None:
    from trainer.cli import _parser

    assert "python -m trainer.plot" in " ".join(_parser().format_help().split())


def test_a_short_runs_steps_are_whole_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    save = Figure.savefig

    def keep(fig: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(fig)
        save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_training([_summary(0, steps=20)], tmp_path / "short.png")
    (fig,) = saved
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
