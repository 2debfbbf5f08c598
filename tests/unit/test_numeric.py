"""Numeric statistics of the training rows (trainer.numeric), checked against numpy and Keras."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.data import Batch, CsvSource, DataError, ParquetSource
from trainer.numeric import NumericStats, fit_numeric_stats

pytestmark = pytest.mark.unit


def _write_csv(path: Path, rows: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    """An Adult-like file: unscaled numbers (1e5 and heavy tails), empties and NaN."""
    rng = np.random.default_rng(seed)
    cols = {
        "fnlwgt": rng.normal(1.9e5, 1.0e5, rows).round(),
        "gain": np.where(rng.random(rows) < 0.9, 0.0, rng.pareto(1.2, rows) * 5000).round(),
        "age": rng.integers(17, 90, rows).astype(np.float64),
    }
    labels = (rng.random(rows) < 0.25).astype(int)
    text = ["label,fnlwgt,gain,age,job"]
    for i in range(rows):
        fields = [str(labels[i])]
        for name in ("fnlwgt", "gain", "age"):
            v = cols[name][i]
            if name == "age" and i % 17 == 3:
                fields.append("")  # missing
                cols[name][i] = np.nan
            elif name == "gain" and i % 23 == 5:
                fields.append("NaN")
                cols[name][i] = np.nan
            else:
                fields.append(repr(float(v)))
        fields.append(f"job{i % 5}")
        text.append(",".join(fields))
    path.write_text("\n".join(text) + "\n")
    return cols


def _source(path: Path) -> CsvSource:
    return CsvSource(path, label="label", categorical=["job"], numeric=["fnlwgt", "gain", "age"])


def _train_values(source: CsvSource, eval_fraction: float) -> dict[str, np.ndarray]:
    batches = list(source.raw_batches(100_000, split="train", eval_fraction=eval_fraction))
    return {
        name: np.concatenate([np.asarray(b.features[name], np.float64) for b in batches])
        for name in source.schema.numeric
    }


def test_statistics_are_the_training_rows_mean_and_population_variance(tmp_path: Path) -> None:
    _write_csv(tmp_path / "d.csv", 3000)
    source = _source(tmp_path / "d.csv")
    stats = fit_numeric_stats(source, "standardize", eval_fraction=0.2)
    train = _train_values(source, 0.2)  # float32 as read, missing as NaN
    assert stats.rows == len(train["age"]) and 2200 < stats.rows < 2600
    for j, name in enumerate(stats.columns):
        x = train[name]
        assert stats.count[j] == int((~np.isnan(x)).sum())
        assert stats.mean[j] == pytest.approx(np.nanmean(x), rel=1e-12)
        assert stats.variance[j] == pytest.approx(np.nanvar(x), rel=1e-10)
    assert stats.count[2] < stats.rows  # age has missing values, they do not count


def test_statistics_do_not_depend_on_how_the_pass_is_cut(tmp_path: Path) -> None:
    _write_csv(tmp_path / "d.csv", 2000)
    source = _source(tmp_path / "d.csv")
    whole = fit_numeric_stats(source, "standardize", eval_fraction=0.0, split="all")
    head = fit_numeric_stats(source, "standardize", split="all", max_rows=700)
    assert head.rows == 700
    first = list(source.raw_batches(700, split="all"))[0]
    assert head.mean[0] == pytest.approx(np.nanmean(first.features["fnlwgt"].astype(float)))
    assert whole.rows == 2000


def test_standardize_equals_keras_normalization_adapted_on_the_training_rows(
    tmp_path: Path,
) -> None:
    import keras

    rng = np.random.default_rng(1)
    path = tmp_path / "d.csv"
    x = np.stack([rng.normal(1.9e5, 1e5, 4000), rng.pareto(1.5, 4000) * 1e4], axis=1)
    lines = ["label,a,b"] + [f"{i % 2},{a!r},{b!r}" for i, (a, b) in enumerate(x.tolist())]
    path.write_text("\n".join(lines) + "\n")
    source = CsvSource(path, label="label", numeric=["a", "b"])
    stats = fit_numeric_stats(source, "standardize", eval_fraction=0.25)
    train = _train_values(source, 0.25)
    norm = keras.layers.Normalization(axis=-1)
    norm.adapt(np.stack([train["a"], train["b"]], axis=1).astype(np.float32))
    evals = next(source.batches(10_000, split="eval", eval_fraction=0.25))
    want = np.asarray(
        norm(np.stack([evals.features["a"], evals.features["b"]], axis=1).astype(np.float32))
    )
    got = stats.apply(evals)
    got_ab = np.stack([got.features["a"], got.features["b"]], axis=1)
    assert got_ab.dtype == np.float32
    np.testing.assert_allclose(got_ab, want, rtol=1e-4, atol=1e-4)
    assert abs(float(got_ab[:, 0].mean())) < 0.2  # the eval rows land near 0, not at 1e5


def test_missing_values_become_the_training_mean(tmp_path: Path) -> None:
    _write_csv(tmp_path / "d.csv", 500)
    source = _source(tmp_path / "d.csv")
    stats = fit_numeric_stats(source, "standardize", split="all")
    raw = next(source.raw_batches(1000, split="all"))
    out = stats.apply(raw)
    age = out.features["age"]
    missing = np.isnan(raw.features["age"])
    assert missing.any() and (age[missing] == 0).all()  # the mean standardizes to 0
    assert not np.isnan(age).any()
    # and via the source, every batch of training and eval gets the same transform
    batch = next(source.with_numeric(stats).batches(1000, split="all"))
    np.testing.assert_array_equal(batch.features["age"], age)


def test_none_fills_missing_with_zero_and_keeps_values(tmp_path: Path) -> None:
    _write_csv(tmp_path / "d.csv", 300)
    source = _source(tmp_path / "d.csv")
    stats = fit_numeric_stats(source, "none")
    assert stats.rows == 0  # no pass needed
    raw = next(source.raw_batches(1000, split="all"))
    out = stats.apply(raw).features["fnlwgt"]
    np.testing.assert_array_equal(out, np.nan_to_num(raw.features["fnlwgt"]))


def test_log1p_is_signed_then_standardized() -> None:
    values = np.array([0.0, 9.0, 99.0, -9.0, np.nan], dtype=np.float32)
    logged = np.sign(values[:4].astype(float)) * np.log1p(np.abs(values[:4].astype(float)))
    stats = NumericStats(
        transform="log1p",
        columns=("x",),
        mean=(float(logged.mean()),),
        variance=(float(logged.var()),),
        count=(4,),
        rows=5,
    )
    out = stats.apply(Batch({"x": values}, np.zeros(5, np.float32))).features["x"]
    want = (logged - logged.mean()) / logged.std()
    np.testing.assert_allclose(out[:4], want, rtol=1e-6)
    assert out[4] == 0.0


def test_a_constant_column_enters_as_zero_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.csv"
    path.write_text("label,k,x\n" + "".join(f"{i % 2},7,{i}\n" for i in range(50)))
    source = CsvSource(path, label="label", numeric=["k", "x"])
    with caplog.at_level(logging.WARNING):
        stats = fit_numeric_stats(source, "standardize", split="all")
    assert stats.variance[0] == 0.0 and "'k' is constant" in caplog.text
    eval_batch = Batch(
        {"k": np.array([7, 8, 1e6], np.float32), "x": np.zeros(3, np.float32)},
        np.zeros(3, np.float32),
    )
    assert stats.apply(eval_batch).features["k"].tolist() == [0.0, 0.0, 0.0]


def test_an_all_missing_column_enters_as_zero(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_text("label,k,x\n" + "".join(f"{i % 2},,{i}\n" for i in range(20)))
    stats = fit_numeric_stats(CsvSource(path, label="label", numeric=["k", "x"]), split="all")
    assert stats.count[0] == 0 and stats.mean[0] == 0.0
    out = next(CsvSource(path, label="label", numeric=["k", "x"]).with_numeric(stats).batches(50))
    assert (out.features["k"] == 0).all()


def test_no_training_rows_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.csv"
    path.write_text("label,x\n")
    with pytest.raises(DataError, match="no training rows"):
        fit_numeric_stats(CsvSource(path, label="label", numeric=["x"]), split="all")


def test_a_text_value_in_a_numeric_column_names_row_and_column(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("label,x\n1,3.5\n0,abc\n")
    with pytest.raises(DataError, match=r"row 2, column 'x': cannot parse 'abc'"):
        fit_numeric_stats(CsvSource(path, label="label", numeric=["x"]), split="all")


def test_json_round_trip_and_bad_files(tmp_path: Path) -> None:
    _write_csv(tmp_path / "d.csv", 400)
    stats = fit_numeric_stats(_source(tmp_path / "d.csv"), "log1p", split="all")
    path = stats.save(tmp_path / "run" / "stats.json")
    assert NumericStats.load(path) == stats
    assert json.loads(path.read_text())["columns"]["fnlwgt"]["count"] == stats.count[0]
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(DataError, match=r"bad\.json: cannot read numeric statistics"):
        NumericStats.load(tmp_path / "bad.json")
    with pytest.raises(DataError, match="nope.json"):
        NumericStats.load(tmp_path / "nope.json")
    with pytest.raises(DataError, match=r"the data has \['age'\]"):
        stats.check_columns(("age",), "x")


def test_apply_names_a_missing_column() -> None:
    stats = NumericStats(
        transform="standardize", columns=("a",), mean=(0.0,), variance=(1.0,), count=(1,), rows=1
    )
    with pytest.raises(DataError, match=r"lacks \['a'\]"):
        stats.apply(Batch({}, np.zeros(1, np.float32)))


@pytest.mark.parametrize(
    "bad",
    [
        {"transform": "zscore"},
        {"mean": (float("nan"),)},
        {"variance": (-1.0,)},
        {"count": (1, 2)},
    ],
    ids=["transform", "nan-mean", "negative-variance", "lengths"],
)
def test_bad_stats_are_refused(bad: dict[str, Any]) -> None:
    fields: dict[str, Any] = {
        "transform": "standardize",
        "columns": ("a",),
        "mean": (0.0,),
        "variance": (1.0,),
        "count": (1,),
        "rows": 1,
    }
    with pytest.raises(ValueError):
        NumericStats(**{**fields, **bad})


def test_parquet_nulls_and_nan_are_missing(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    table = pa.table({"label": [1, 0, 1, 0], "x": pa.array([1.0, None, float("nan"), 5.0])})
    pq.write_table(table, path)
    source = ParquetSource(path, label="label", numeric=["x"])
    stats = fit_numeric_stats(source, split="all")
    assert stats.count == (2,) and stats.mean == (3.0,) and stats.variance == (4.0,)
    out = next(source.with_numeric(stats).batches(10, split="all")).features["x"]
    assert out.tolist() == [-1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("transform", ["standardize", "log1p", "none"])
def test_the_models_own_transform_equals_apply(transform: str) -> None:
    """`keras_transform` (inside a saved model of the raw columns) computes what `apply`
    fed the model in training: missing values, a constant column and big numbers."""
    import keras

    stats = NumericStats(
        transform=transform,  # type: ignore[arg-type]
        columns=("fnlwgt", "flat", "gain"),
        mean=(189_778.36, 3.0, 4.2),
        variance=(1.113e10, 0.0, 17.5),
        count=(10, 10, 10),
        rows=10,
    )
    raw = {
        "fnlwgt": np.array([77_516.0, np.nan, 1_484_705.0, -3.0, 0.0], np.float32),
        "flat": np.array([3.0, 7.0, np.nan, -1e6, 3.0], np.float32),
        "gain": np.array([0.0, 99_999.0, np.nan, -20.0, 1e-3], np.float32),
    }
    want = stats.apply(Batch(dict(raw), np.zeros(5, np.float32))).features
    for column, values in raw.items():
        x = keras.Input(shape=(), dtype="float32", name=column)
        model = keras.Model(x, stats.keras_transform(x, column))
        got = np.asarray(model(values))
        assert got.dtype == np.float32 and not np.isnan(got).any()
        np.testing.assert_allclose(got, want[column], rtol=1e-6, atol=1e-6)
    with pytest.raises(DataError, match="no numeric statistics for column 'age'"):
        stats.keras_transform(keras.Input(shape=(), name="age"), "age")
