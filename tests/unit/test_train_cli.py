"""`lookup-table-train`'s stopping rules: --epochs, --steps and --max-seconds (no cluster)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from trainer.cli import _parser, _train_batches, _until
from trainer.data import SyntheticSource

pytestmark = pytest.mark.unit


def _args(*extra: str) -> object:
    return _parser().parse_args(["--config", "c.toml", "--data", "synthetic:1000", *extra])


class _Clock:
    """A clock the test moves: each batch "takes" `step_s` seconds."""

    def __init__(self, step_s: float) -> None:
        self.now = 100.0
        self.step_s = step_s

    def __call__(self) -> float:
        return self.now


def _consume(batches: Iterator[int], clock: _Clock) -> list[int]:
    """Take batches the way Trainer.fit does: one read ahead of the step that runs."""
    taken = []
    for batch in batches:
        taken.append(batch)
        clock.now += clock.step_s
    return taken


def test_until_stops_once_the_time_is_up() -> None:
    clock = _Clock(step_s=1.0)
    taken = _consume(_until(itertools.count(), 5.0, clock=clock), clock)
    # batches taken at t = 0, 1, 2, 3, 4 s after the first; the one at 5 s is refused
    assert taken == [0, 1, 2, 3, 4]


def test_until_ends_with_the_data_when_it_runs_out_first() -> None:
    clock = _Clock(step_s=1.0)
    assert _consume(_until(range(3), 3600.0, clock=clock), clock) == [0, 1, 2]


def test_until_counts_from_the_first_batch_not_from_creation() -> None:
    clock = _Clock(step_s=0.5)
    batches = _until(itertools.count(), 2.0, clock=clock)
    clock.now += 1000.0  # e.g. TensorFlow still importing: not training time
    assert _consume(batches, clock) == [0, 1, 2, 3]


def test_max_seconds_alone_repeats_the_data() -> None:
    source = SyntheticSource(1000)
    one_epoch = sum(1 for _ in _train_batches(source, _args("--batch-size", "100")))
    assert 0 < one_epoch < 20
    forever = _train_batches(source, _args("--batch-size", "100", "--max-seconds", "3600"))
    assert len(list(itertools.islice(forever, 3 * one_epoch))) == 3 * one_epoch


def test_max_seconds_with_epochs_stops_at_whichever_comes_first() -> None:
    source = SyntheticSource(1000)
    one_epoch = sum(1 for _ in _train_batches(source, _args("--batch-size", "100")))
    args = _args("--batch-size", "100", "--epochs", "2", "--max-seconds", "3600")
    assert sum(1 for _ in _train_batches(source, args)) == 2 * one_epoch


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf", "nan"])
def test_max_seconds_must_be_a_positive_number(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _args("--max-seconds", value)
    assert "--max-seconds" in capsys.readouterr().err


def test_max_seconds_is_documented_in_the_help() -> None:
    text = _parser().format_help()
    assert "--max-seconds T" in text
    assert "seconds of training" in text
