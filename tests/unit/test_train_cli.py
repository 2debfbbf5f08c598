"""`lookup-table-train` without a cluster: stopping rules, --print-tables, the evaluation
cadence, --save-model's target check and the ctrl-C handler."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.cli import _parser, _train_batches, _until, main
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


def _write_people(path: Path) -> Path:
    path.write_text(
        "age,workclass,fnlwgt,genres,user id,income\n"
        "39,State-gov,77516,a|b,1,0\n50,Private,83311,,2,1\n38,,215646,c,3,0\n"
    )
    return path


def _people_args(data: Path) -> list[str]:
    argv = ["--data", f"csv:{data}", "--label", "income", "--categorical", "workclass"]
    return [*argv, "--numeric", "age,fnlwgt", "--multivalued", "genres", "--print-tables"]


def test_print_tables_writes_a_complete_cluster_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue: the tables alone, appended to a missing file, gave "namespace: expected a
    string, missing" at `deploy/cluster.sh up`: the output is now a whole cluster file."""
    import tomllib

    from lookup_table.config import load_config

    data = _write_people(tmp_path / "people.csv")
    assert main([*_people_args(data), "--dim", "8"]) == 0  # no --config needed
    text = capsys.readouterr().out
    cluster = tmp_path / "my-cluster.toml"
    cluster.write_text(text)  # `> my-cluster.toml`
    config = load_config(cluster)
    assert config.namespace == "people"  # the data file's name
    # what deploy/cluster.sh starts for the demo: its local nodes and replica
    demo = load_config(Path(__file__).resolve().parents[2] / "deploy" / "demo.toml")
    assert config.memcached == demo.memcached and config.optimizers == demo.optimizers
    assert config.mode == "async" and config.optimizer.name == "adam"
    assert [(t.name, t.dim, t.id_type) for t in config.tables] == [
        ("workclass", 8, "string"),
        ("genres", 8, "string"),
    ]
    # `>>` onto a file that does not exist yet gives the same file
    appended = tmp_path / "appended.toml"
    with appended.open("a") as fh:
        fh.write(text)
    assert load_config(appended).tables == config.tables
    assert tomllib.loads(text)["tables"][0] == {"name": "workclass", "dim": 8, "id_type": "string"}


def test_print_tables_tables_only_appends_to_a_cluster_file_of_yours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lookup_table.config import load_config

    data = _write_people(tmp_path / "people.csv")
    assert main([*_people_args(data), "--tables-only"]) == 0
    toml = capsys.readouterr().out
    assert "namespace" not in toml and "[optimizer]" not in toml
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('namespace = "t"\nmemcached = ["127.0.0.1:1"]\n' + toml)
    assert [t.id_type for t in load_config(cluster).tables] == ["string", "string"]


@pytest.mark.parametrize(
    ("spec", "namespace"),
    [
        ("csv:data/train.csv", "train"),
        ("parquet:/x/my adult data.v2.parquet", "my-adult-data.v2"),
        ("csv:_hidden.csv", "hidden"),
        ("synthetic:1000", "synthetic"),
        ("criteo:day_0.gz", "day_0"),
        ("csv:___.csv", "data"),
    ],
)
def test_the_printed_namespace_is_named_after_the_data_file(spec: str, namespace: str) -> None:
    from lookup_table.core.keys import validate_name
    from trainer.cli import namespace_for

    assert validate_name(namespace_for(spec), "namespace") == namespace


def test_print_tables_takes_a_namespace_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import tomllib

    data = _write_people(tmp_path / "people.csv")
    assert main([*_people_args(data), "--namespace", "income-v2"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["namespace"] == "income-v2"
    assert main([*_people_args(data), "--namespace", "my job"]) == 1
    assert capsys.readouterr().out == ""  # nothing half-written into the cluster file
    assert "--namespace must be 1-64 characters" in caplog.text and "'my job'" in caplog.text


def test_print_tables_flags_a_column_that_cannot_name_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _write_people(tmp_path / "people.csv")
    argv = ["--data", f"csv:{data}", "--label", "income", "--categorical", "user id:int64"]
    assert main([*argv, "--print-tables"]) == 0
    out = capsys.readouterr().out
    assert "column 'user id' cannot name a table" in out and "[[tables]]" not in out


def test_eval_fraction_and_eval_data_exclude_each_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = _write_people(tmp_path / "people.csv")
    argv = ["--config", "c.toml", "--data", f"csv:{data}", "--eval-data", f"csv:{data}"]
    assert main([*argv, "--eval-fraction", "0.1", "--label", "income"]) == 1
    assert "--eval-fraction holds out part of --data" in caplog.text


def test_config_is_required_to_train(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert main(["--data", "synthetic:100"]) == 1
    assert "--config is required" in caplog.text


def test_shuffle_is_on_by_default_only_when_the_data_is_read_again() -> None:
    source = SyntheticSource(2000)

    def first_ids(*extra: str) -> list[int]:
        batch = next(iter(_train_batches(source, _args("--batch-size", "50", *extra))))
        return [int(v) for v in batch.features["C1"]]

    in_order = [int(v) for v in next(source.batches(50)).features["C1"]]
    assert first_ids() == in_order  # one epoch: file order
    assert first_ids("--epochs", "2") != in_order  # read again: shuffled
    assert first_ids("--epochs", "2", "--shuffle-buffer", "0") == in_order
    assert first_ids("--steps", "5") != in_order
    assert first_ids("--epochs", "2", "--seed", "1") != first_ids("--epochs", "2")


def test_eval_data_trains_on_the_whole_file() -> None:
    source = SyntheticSource(2000)
    args = _args("--batch-size", "100", "--eval-data", "synthetic:10")
    assert sum(len(b) for b in _train_batches(source, args)) == 2000
    held_out = sum(len(b) for b in _train_batches(source, _args("--batch-size", "100")))
    assert 1500 < held_out < 1700


def test_a_column_only_in_the_eval_file_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train = tmp_path / "train.csv"
    train.write_text("age,job,label\n30,a,0\n")
    evals = tmp_path / "eval.csv"
    evals.write_text("age,job,extra,label\n30,a,5,0\n")
    config = tmp_path / "c.toml"
    config.write_text('namespace = "t"\nmemcached = ["127.0.0.1:1"]\n')
    argv = ["--config", str(config), "--data", f"csv:{train}", "--eval-data", f"csv:{evals}"]
    assert main([*argv, "--label", "label", "--numeric", "age,extra", "--no-progress"]) == 1
    assert "unknown columns ['extra']" in caplog.text
    assert "the --eval-data file has them" in caplog.text


@pytest.mark.parametrize(
    ("extra", "every"),
    [
        ((), 8),  # 100,000 examples, 80 % train, batch 1000: 80 steps, 10 evaluations
        (("--epochs", "3"), 24),
        (("--num-workers", "2", "--worker-index", "1"), 4),
        (("--steps", "45"), 5),
        (("--steps", "3"), 1),
        (("--max-seconds", "60"), 100),  # the run's length is not known: every 100 steps
        (("--eval-every", "7"), 7),
        (("--eval-every", "0"), 0),  # only at the end
    ],
)
def test_evaluations_come_about_ten_times_a_run_by_default(
    extra: tuple[str, ...], every: int
) -> None:
    """Issue: with the defaults the evaluation panel had one dot (only the final one)."""
    from trainer.cli import _eval_every
    from trainer.numeric import fit_numeric_stats

    source = SyntheticSource(100_000)
    args = _parser().parse_args(
        ["--config", "c.toml", "--data", "synthetic:100000", "--batch-size", "1000", *extra]
    )
    assert _eval_every(args, source, fit_numeric_stats(source, "none")) == every


def test_eval_every_counts_the_rows_of_a_csv_from_the_statistics_pass(tmp_path: Path) -> None:
    from trainer.cli import _eval_every, _source
    from trainer.numeric import fit_numeric_stats

    data = tmp_path / "people.csv"
    data.write_text("age,income\n" + "".join(f"{i},{i % 2}\n" for i in range(1000)))
    args = _parser().parse_args(
        ["--config", "c.toml", "--data", f"csv:{data}", "--label", "income", "--numeric", "age"]
    )
    args.batch_size = 20
    source = _source(args.data, args)
    stats = fit_numeric_stats(source, split="train")
    assert stats.rows == 801  # the 80 % held in training: 41 steps of 20
    assert _eval_every(args, source, stats) == 5


def test_save_model_refuses_a_target_that_exists_before_training(tmp_path: Path) -> None:
    from trainer.cli import _check_save_target

    _check_save_target(str(tmp_path / "new" / "1"))
    (tmp_path / "empty").mkdir()
    _check_save_target(str(tmp_path / "empty"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "saved_model.pb").write_bytes(b"x")
    with pytest.raises(ValueError, match="it exists and is not an empty directory"):
        _check_save_target(str(tmp_path / "full"))
    (tmp_path / "2.keras").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"2\.keras \(the Keras model written beside it\)"):
        _check_save_target(str(tmp_path / "2"))


def test_the_first_ctrl_c_asks_to_stop_and_the_second_quits() -> None:
    import os
    import signal

    from trainer.cli import _StopOnSigint

    before = signal.getsignal(signal.SIGINT)
    with _StopOnSigint() as stop:
        assert not stop()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop()  # the handler ran: training ends after the step under way
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
