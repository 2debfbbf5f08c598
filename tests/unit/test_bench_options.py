"""`benchmarks.harness.options`: the defaults `--quick` lowers, and the counts it refuses."""

from __future__ import annotations

import pytest

from benchmarks.harness.options import Options

pytestmark = pytest.mark.unit


def _options() -> Options:
    options = Options("A benchmark.\n\nMore.", quick="3 rounds")
    options.training(steps=(150, 12), warmup=(10, 2), rounds=(2, 1), wait_s=60.0)
    options.count("--rows", full=500, quick=10, minimum=2, help="rows")
    options.row_flush_pushes(default=None, help="flush interval")
    return options


def test_quick_lowers_the_defaults_a_value_given_wins() -> None:
    full = _options().parse([])
    assert (full.steps, full.warmup, full.rounds, full.rows) == (150, 10, 2, 500)
    assert (full.quiet_wait_s, full.retries, full.batch_size) == (60.0, 2, 1024)
    quick = _options().parse(["--quick", "--rows", "7"])
    assert (quick.steps, quick.warmup, quick.rounds, quick.rows) == (12, 2, 1, 7)
    assert (quick.quiet_wait_s, quick.retries) == (0.0, 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--rows", "1"], "--rows must be at least 2, got 1"),
        (["--steps", "5", "--warmup", "4"], "--warmup must be in 1..steps-2, got 4 for 5 steps"),
        (["--row-flush-pushes", "0"], "--row-flush-pushes must be in 1..56, got 0"),
    ],
)
def test_a_count_out_of_range_is_refused_with_its_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _options().parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
