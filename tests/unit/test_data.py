"""The data readers: schemas, dtypes, determinism, splits, sharding, parsing, streaming."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import tracemalloc
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from tests.unit._fresh import fresh_json
from trainer.data import (
    Batch,
    CriteoSource,
    CsvSource,
    DataError,
    DataSource,
    ParquetSource,
    Ragged,
    Schema,
    SyntheticSource,
    parse_data_spec,
    write_synthetic_criteo,
)

pytestmark = pytest.mark.unit

CRITEO_COLUMNS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]

MOVIES_CSV = """\
id,user,movie,genres,age,rating,note
1,u1,10,Action|Comedy,31,1,plain
2,u2,11,,45.5,0,"quoted, with a comma"
3,u1,12,Drama,,1,"two
lines"
4,,10,Comedy||Drama|,22,0,x
5,u3,13,Action,19,1,y
"""


def _auc(score: NDArray[np.floating], labels: NDArray[np.floating]) -> float:
    """Rank AUC with ties averaged."""
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    order_ranks = np.cumsum(counts) - (counts - 1) / 2  # mean rank of each distinct score
    ranks = order_ranks[inverse]
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _column(batches: Iterable[Batch], name: str) -> NDArray[np.generic]:
    return np.concatenate([np.asarray(b.features[name]) for b in batches])


def _synthetic_rows(batches: Iterable[Batch]) -> list[bytes]:
    """One fingerprint per example: its 26 ids (unique in practice: some vocabularies are ~10M)."""
    batches = list(batches)
    ids = np.stack([_column(batches, f"C{i}") for i in range(1, 27)], axis=1)
    return [row.tobytes() for row in ids]


def _digest(batches: Iterable[Batch]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        h.update(batch.labels.tobytes())
        for name, col in batch.features.items():
            h.update(name.encode())
            h.update(np.ascontiguousarray(col).tobytes())
    return h.hexdigest()


def _same_batches(a: list[Batch], b: list[Batch]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if not np.array_equal(x.labels, y.labels) or x.features.keys() != y.features.keys():
            return False
        for name, col in x.features.items():
            other = y.features[name]
            if isinstance(col, Ragged):
                assert isinstance(other, Ragged)
                if not (
                    np.array_equal(col.values, other.values)
                    and np.array_equal(col.row_splits, other.row_splits)
                ):
                    return False
            elif not np.array_equal(col, other):
                return False
    return True


@pytest.fixture
def movies_csv(tmp_path: Path) -> Path:
    path = tmp_path / "movies.csv"
    path.write_text(MOVIES_CSV)
    return path


def _movies(path: Path) -> CsvSource:
    return CsvSource(
        path,
        label="rating",
        categorical={"user": None, "movie": "int64"},
        numeric=["age", "id"],
        multivalued={"genres": "|"},
    )


def _write_parquet(path: Path) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "user": pa.array(["u1", None, "u3", "u1"]),
            "item": pa.array([7, -3, 2**40, 7], type=pa.int64()),
            "tags": pa.array([["a", "b"], [], None, ["c", None]], type=pa.list_(pa.string())),
            "cats": pa.array(["x|y", "", None, "z"]),
            "price": pa.array([1.5, None, float("nan"), 3]),
            "clicked": pa.array([1, 0, 1, 0], type=pa.int8()),
            "slot": pa.array([1, None, 2, 3], type=pa.int32()),
        }
    )
    pq.write_table(table, path, row_group_size=3)
    return path


# ------------------------------------------------------------------ every source


def _sources(tmp_path: Path) -> dict[str, Callable[[], DataSource]]:
    def criteo(suffix: str) -> Callable[[], DataSource]:
        return lambda: CriteoSource(write_synthetic_criteo(tmp_path / f"c.tsv{suffix}", 700))

    def csv() -> DataSource:
        path = tmp_path / "m.csv"
        path.write_text(MOVIES_CSV)
        return _movies(path)

    def parquet() -> DataSource:
        path = _write_parquet(tmp_path / "p.parquet")
        return ParquetSource(
            path,
            label="clicked",
            categorical=["user", "item"],
            numeric=["price"],
            multivalued={"tags": "|", "cats": "|"},
        )

    return {
        "synthetic": lambda: SyntheticSource(700, seed=5),
        "criteo": criteo(""),
        "criteo-gz": criteo(".gz"),
        "csv": csv,
        "parquet": parquet,
    }


@pytest.mark.parametrize("kind", ["synthetic", "criteo", "criteo-gz", "csv", "parquet"])
def test_batches_match_the_schema(tmp_path: Path, kind: str) -> None:
    source = _sources(tmp_path)[kind]()
    schema = source.schema
    batch_size = 256 if kind.startswith(("synthetic", "criteo")) else 2
    batches = list(source.batches(batch_size, split="all"))
    assert batches
    assert [len(b) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
    assert 0 < len(batches[-1]) <= batch_size
    if source.num_examples is not None:
        assert sum(map(len, batches)) == source.num_examples
    for batch in batches:
        n = len(batch)
        assert batch.labels.dtype == np.float32 and batch.labels.shape == (n,)
        assert list(batch.features) == list(schema.feature_names)
        for name, dtype in schema.categorical.items():
            col = batch.features[name]
            assert isinstance(col, np.ndarray) and col.shape == (n,)
            if dtype == "int64":
                assert col.dtype == np.int64
            else:
                assert col.dtype == object and all(type(v) is str for v in col)
        for name in schema.numeric:
            col = batch.features[name]
            assert isinstance(col, np.ndarray) and col.dtype == np.float32 and col.shape == (n,)
            assert np.isfinite(col).all()
        for name, dtype in schema.multivalued.items():
            col = batch.features[name]
            assert isinstance(col, Ragged) and len(col) == n
            assert col.row_splits.dtype == np.int64 and col.row_splits.shape == (n + 1,)
            if dtype == "int64":
                assert col.values.dtype == np.int64
            else:
                assert col.values.dtype == object and all(type(v) is str for v in col.values)


# ------------------------------------------------------------------ synthetic


def test_synthetic_schema_is_criteo_like() -> None:
    schema = SyntheticSource(10).schema
    assert schema.numeric == tuple(f"I{i}" for i in range(1, 14))
    assert schema.categorical == {f"C{i}": "int64" for i in range(1, 27)}
    assert schema.multivalued == {} and schema.label == "label"


def test_synthetic_is_deterministic_and_seeded() -> None:
    def run(seed: int) -> list[Batch]:
        return list(SyntheticSource(3000, seed=seed).batches(512, split="all"))

    assert _same_batches(run(1), run(1))
    assert not _same_batches(run(1), run(2))


def test_synthetic_examples_do_not_depend_on_batch_size_or_split_path() -> None:
    source = SyntheticSource(2500, seed=3)
    for split in ("all", "train", "eval"):
        a = list(source.batches(100, split=split))
        b = list(source.batches(333, split=split))
        assert _synthetic_rows(a) == _synthetic_rows(b)
        assert np.array_equal(_column(a, "I5"), _column(b, "I5"))
    # The generic chunk path (what `select` and file sources use) agrees with the fast path.
    fast = list(source.batches(256))
    generic = list(DataSource._epoch(source, _plan(256)))
    assert _same_batches(fast, generic)


def _plan(batch_size: int, **kw: object) -> object:
    from trainer.data.plan import BatchPlan

    args = {"split": "train", "eval_fraction": 0.2, "worker_index": 0, "num_workers": 1} | kw
    return BatchPlan(batch_size=batch_size, **args)  # type: ignore[arg-type]


FRESH_SYNTHETIC = """
import hashlib, json, sys
import numpy as np
from trainer.data import SyntheticSource
h = hashlib.sha256()
for b in SyntheticSource(4000, seed=7).batches(300, worker_index=1, num_workers=2):
    h.update(b.labels.tobytes())
    for name, col in b.features.items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(col).tobytes())
heavy = sorted(m for m in ("tensorflow", "pyarrow", "keras") if m in sys.modules)
print(json.dumps({"digest": h.hexdigest(), "heavy_imports": heavy}))
"""


def test_synthetic_is_the_same_in_a_fresh_interpreter() -> None:
    """Another process (another PYTHONHASHSEED) makes the same batches, without importing TF."""
    here = _digest(SyntheticSource(4000, seed=7).batches(300, worker_index=1, num_workers=2))
    assert fresh_json(FRESH_SYNTHETIC) == {"digest": here, "heavy_imports": []}


def test_synthetic_golden_values() -> None:
    """Pinned: every trainer must generate these; changing them changes the data set."""
    batch = next(SyntheticSource(1000, seed=0).batches(12, split="all"))
    assert batch.features["C1"][:4].tolist() == [
        2556082582132457860,
        -3729337430394483279,
        2556082582132457860,
        -4616672480392596126,
    ]
    assert batch.features["I2"][:4].tolist() == pytest.approx(
        [3.6109, 5.6733, 5.7071, 5.9026], abs=1e-4
    )
    assert np.flatnonzero(batch.labels).tolist() == [5]


def test_a_text_label_says_to_write_it_as_numbers(tmp_path: Path) -> None:
    """Raw files often spell the class (">50K"): the error says what a label must be."""
    path = tmp_path / "adult.csv"
    path.write_text("age,income\n30,<=50K\n40,>50K\n")
    source = CsvSource(path, label="income", numeric=["age"])
    with pytest.raises(
        DataError,
        match=r"row 1, column 'income': cannot parse '<=50K': labels "
        r"are numbers .* write the label column as 0/1 first",
    ):
        list(source.batches(2, split="all"))


def test_eval_split_golden_positions(tmp_path: Path) -> None:
    """Pinned: which examples are held out (by position, for every source)."""
    path = tmp_path / "rows.csv"
    path.write_text("id,label\n" + "".join(f"{i},0\n" for i in range(40)))
    source = CsvSource(path, label="label", numeric=["id"])
    evals = _column(source.batches(8, split="eval"), "id").astype(int).tolist()
    assert evals == [6, 7, 8, 18, 21, 23, 29, 31, 34, 36]


def test_synthetic_ids_are_zipf_like_and_span_int64() -> None:
    batches = list(SyntheticSource(20_000, seed=0).batches(4096, split="all"))
    big = _column(batches, "C3")  # vocabulary ~10M
    assert big.min() < -(2**62) and big.max() > 2**62
    _, counts = np.unique(big, return_counts=True)
    assert 0.05 < counts.max() / big.size < 0.3  # a heavy head ...
    assert (counts == 1).sum() > 1000  # ... and a long tail of ids seen once
    small = _column(batches, "C9")  # vocabulary 3
    assert len(np.unique(small)) == 3
    assert (_column(batches, "I12") == 0).mean() > 0.7  # Criteo-like missing counts


def test_synthetic_labels_are_learnable() -> None:
    source = SyntheticSource(30_000, seed=0)
    batches = list(source.batches(4096, split="all"))
    labels = np.concatenate([b.labels for b in batches])
    assert 0.2 < labels.mean() < 0.3
    hidden = np.concatenate([source.logits(b) for b in batches])
    assert _auc(hidden, labels) >= 0.75
    # A model can learn it from data: smoothed per-id log-odds on the train split,
    # summed over columns, ranks held-out examples well.
    train = list(source.batches(4096, split="train"))
    evals = list(source.batches(4096, split="eval"))
    y_train = np.concatenate([b.labels for b in train])
    y_eval = np.concatenate([b.labels for b in evals])
    prior = y_train.mean()
    score = np.zeros(len(y_eval))
    for name in [f"C{i}" for i in range(1, 27)]:
        ids, inverse = np.unique(_column(train, name), return_inverse=True)
        rate = (np.bincount(inverse, weights=y_train) + 20 * prior) / (np.bincount(inverse) + 20)
        eval_ids = _column(evals, name)
        where = np.clip(np.searchsorted(ids, eval_ids), 0, len(ids) - 1)
        seen = ids[where] == eval_ids
        p = np.where(seen, rate[where], prior)
        score += np.log(p / (1 - p)) - np.log(prior / (1 - prior))
    assert _auc(score, y_eval) > 0.7


def test_synthetic_generates_fast() -> None:
    import time

    source = SyntheticSource(50_000, seed=1)
    start = time.process_time()
    n = sum(len(b) for b in source.batches(1024, split="all"))
    rate = n / (time.process_time() - start)
    assert rate > 100_000, f"{rate:.0f} examples/s"


# ------------------------------------------------------------------ splits and sharding


def test_eval_and_train_are_disjoint_stable_and_cover_everything() -> None:
    source = SyntheticSource(6000, seed=2)
    train = _synthetic_rows(source.batches(500, split="train"))
    evals = _synthetic_rows(source.batches(500, split="eval"))
    everything = _synthetic_rows(source.batches(500, split="all"))
    assert set(train).isdisjoint(evals)
    assert sorted(train + evals) == sorted(everything)
    assert 0.17 < len(evals) / len(everything) < 0.23
    # Stable across batch sizes, workers and epochs.
    assert _synthetic_rows(source.batches(77, split="eval")) == evals
    two_epochs = _synthetic_rows(source.batches(500, split="eval", epochs=2))
    assert two_epochs == evals + evals
    other = _synthetic_rows(source.batches(500, split="eval", eval_fraction=0.5))
    assert set(evals) <= set(other)  # a larger fraction only adds examples
    assert list(source.batches(500, split="eval", eval_fraction=0.0)) == []
    assert len(_synthetic_rows(source.batches(500, split="train", eval_fraction=0.0))) == 6000


def test_csv_eval_split_is_by_example(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("id,label,x\n" + "".join(f"{i},{i % 2},{i}\n" for i in range(3000)))
    source = CsvSource(path, label="label", numeric=["id"], categorical=["x"])
    train = _column(source.batches(64, split="train"), "id")
    evals = _column(source.batches(1000, split="eval"), "id")
    assert set(train.tolist()).isdisjoint(evals.tolist())
    assert sorted([*train.tolist(), *evals.tolist()]) == list(range(3000))
    # The same examples as the synthetic source's split: it depends on positions only.
    synthetic_eval = _synthetic_rows(SyntheticSource(3000, seed=9).batches(3000, split="eval"))
    assert len(evals) == len(synthetic_eval)


@pytest.mark.parametrize("num_workers", [2, 3])
@pytest.mark.parametrize("kind", ["synthetic", "csv"])
def test_workers_split_the_train_batches(tmp_path: Path, kind: str, num_workers: int) -> None:
    if kind == "synthetic":
        source: DataSource = SyntheticSource(5000, seed=4)
    else:
        path = tmp_path / "rows.csv"
        path.write_text("id,label,x\n" + "".join(f"{i},1,{i}\n" for i in range(5000)))
        source = CsvSource(path, label="label", numeric=["id"], categorical=["x"])
    single = list(source.batches(128, split="train"))
    per_worker = [
        list(source.batches(128, split="train", worker_index=w, num_workers=num_workers))
        for w in range(num_workers)
    ]
    for w, batches in enumerate(per_worker):
        assert _same_batches(batches, single[w::num_workers])
    counts = [len(b) for b in per_worker]
    assert max(counts) - min(counts) <= 1
    # Disjoint examples, and together every train example exactly once.
    key = "C1" if kind == "synthetic" else "id"
    if kind == "csv":
        ids = [_column(b, key).tolist() for b in per_worker]
        flat = sorted(itertools.chain.from_iterable(ids))
        assert flat == sorted(_column(single, key).tolist())
        assert len(set(flat)) == len(flat)
    else:
        rows = [_synthetic_rows(b) for b in per_worker]
        flat_rows = list(itertools.chain.from_iterable(rows))
        assert sorted(flat_rows) == sorted(_synthetic_rows(single))
        assert len(set(flat_rows)) == len(flat_rows)


def test_batches_checks_its_arguments_at_once() -> None:
    source = SyntheticSource(10)
    for kwargs in (
        {"worker_index": 2, "num_workers": 2},
        {"num_workers": 0},
        {"split": "test"},
        {"eval_fraction": 1.5},
        {"epochs": -1},
    ):
        with pytest.raises(ValueError):
            source.batches(4, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        source.batches(0)


def test_epochs_none_repeats_forever() -> None:
    source = SyntheticSource(300, seed=1)
    batches = list(itertools.islice(source.batches(100, split="all", epochs=None), 7))
    assert len(batches) == 7
    assert _same_batches(batches[3:6], batches[0:3])


def test_select_keeps_some_features() -> None:
    source = SyntheticSource(500).select(["C2", "I1"])
    assert source.schema.feature_names == ("C2", "I1")
    assert source.num_examples == 500
    batch = next(source.batches(100))
    assert list(batch.features) == ["C2", "I1"]
    with pytest.raises(DataError, match="C1, C2"):
        SyntheticSource(5).select(["nope"])


# ------------------------------------------------------------------ criteo


CRITEO_LINES = [
    "1\t5\t-3\t\t0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t" + "\t".join(f"{i:08x}" for i in range(26)),
    "0\t\t\t\t\t\t\t\t\t\t\t\t\t\t" + "\t".join([""] * 25 + ["ff"]),
]


def _criteo_file(path: Path, lines: list[str]) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", ["day.tsv", "day.tsv.gz", "day_gz_without_suffix"])
def test_criteo_parses_values_and_empty_fields(tmp_path: Path, name: str) -> None:
    path = _criteo_file(tmp_path / name, CRITEO_LINES)
    if name.endswith("suffix"):  # gzip is detected from the content, not the name
        path.write_bytes(gzip.compress(path.read_bytes()))
    source = CriteoSource(path)
    assert source.schema.categorical == {f"C{i}": "string" for i in range(1, 27)}
    (batch,) = source.batches(10, split="all")
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.features["I1"].tolist() == pytest.approx([np.log1p(5), 0.0])
    assert batch.features["I2"].tolist() == [0.0, 0.0]  # log1p(max(-3, 0)); empty -> 0
    assert batch.features["I13"].tolist() == pytest.approx([np.log1p(9), 0.0])
    assert batch.features["C1"].tolist() == ["00000000", ""]  # empty is the id ""
    assert batch.features["C26"].tolist() == ["00000019", "ff"]


def test_criteo_reads_back_the_synthetic_data(tmp_path: Path) -> None:
    path = write_synthetic_criteo(tmp_path / "syn.tsv.gz", 1500, seed=3)
    read = list(CriteoSource(path).batches(500, split="all"))
    made = list(SyntheticSource(1500, seed=3).batches(500, split="all"))
    for got, want in zip(read, made, strict=True):
        assert np.array_equal(got.labels, want.labels)
        for name in (f"I{i}" for i in range(1, 14)):
            assert np.array_equal(got.features[name], want.features[name]), name
        ids = np.asarray(want.features["C7"]).astype(np.uint64)
        assert got.features["C7"].tolist() == [f"{int(i):016x}" for i in ids]


def test_criteo_last_line_without_newline_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "day.tsv"
    path.write_text(CRITEO_LINES[0] + "\n\n" + CRITEO_LINES[1])
    assert [len(b) for b in CriteoSource(path).batches(10, split="all")] == [2]


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([CRITEO_LINES[0], "1\t2\t3"], "row 2 has 3 fields, expected 40"),
        ([CRITEO_LINES[0], "1\t2\t3", CRITEO_LINES[0] + "\tx" * 37], "row 2 has 3 fields"),
        ([CRITEO_LINES[0], "x" + CRITEO_LINES[0][1:]], "row 2, column 'label'"),
        ([CRITEO_LINES[0], "2" + CRITEO_LINES[0][1:]], "row 2: a Criteo label is 0 or 1"),
        ([CRITEO_LINES[0].replace("\t5\t", "\tfive\t")], "row 1, column 'I1': cannot parse 'five'"),
    ],
)
def test_criteo_bad_rows_name_the_row(tmp_path: Path, lines: list[str], match: str) -> None:
    source = CriteoSource(_criteo_file(tmp_path / "bad.tsv", lines))
    with pytest.raises(DataError, match=match):
        list(source.batches(10, split="all"))


def test_criteo_rejects_files_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        CriteoSource(tmp_path / "missing.tsv")
    with pytest.raises(DataError, match="40 tab-separated fields"):
        CriteoSource(_criteo_file(tmp_path / "csv.tsv", ["1,2,3"]))
    with pytest.raises(DataError, match="no header"):
        CriteoSource(_criteo_file(tmp_path / "header.tsv", ["\t".join(CRITEO_COLUMNS)]))
    latin1 = tmp_path / "latin1.tsv"
    latin1.write_bytes(CRITEO_LINES[0].replace("00000001", "caf\xe9").encode("latin-1") + b"\n")
    with pytest.raises(DataError, match="UTF-8"):
        CriteoSource(latin1)


# ------------------------------------------------------------------ csv


def test_csv_columns_and_multivalued(movies_csv: Path) -> None:
    source = _movies(movies_csv)
    assert source.schema == Schema(
        categorical={"user": "string", "movie": "int64"},
        numeric=("age", "id"),
        multivalued={"genres": "string"},
        label="rating",
    )
    (batch,) = source.batches(10, split="all")
    assert batch.labels.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert batch.features["user"].tolist() == ["u1", "u2", "u1", "", "u3"]
    assert batch.features["movie"].tolist() == [10, 11, 12, 10, 13]
    assert batch.features["age"].tolist() == [31.0, 45.5, 0.0, 22.0, 19.0]
    genres = batch.features["genres"]
    assert isinstance(genres, Ragged)
    assert genres.values.tolist() == ["Action", "Comedy", "Drama", "Comedy", "Drama", "Action"]
    assert genres.row_splits.tolist() == [0, 2, 2, 3, 5, 6]
    assert genres.row_lengths().tolist() == [2, 0, 1, 2, 1]


def test_csv_quoted_fields_and_small_chunks(
    movies_csv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quoted fields with newlines survive any chunk boundary; batches straddle chunks."""
    import trainer.data.text

    whole = list(_movies(movies_csv).batches(2, split="all"))
    for chunk_chars in (1, 7, 40):
        monkeypatch.setattr(trainer.data.text, "_CHUNK_CHARS", chunk_chars)
        assert _same_batches(list(_movies(movies_csv).batches(2, split="all")), whole)
    source = CsvSource(movies_csv, label="rating", categorical=["note"])
    notes = _column(source.batches(3, split="all"), "note").tolist()
    assert notes == ["plain", "quoted, with a comma", "two\nlines", "x", "y"]


def test_ragged_rows_survive_splits_and_rebatching(tmp_path: Path) -> None:
    path = tmp_path / "tags.csv"
    rows = [(i, "|".join(f"t{i}_{k}" for k in range(i % 4))) for i in range(400)]
    path.write_text("id,label,tags\n" + "".join(f"{i},1,{t}\n" for i, t in rows))
    source = CsvSource(path, label="label", numeric=["id"], multivalued=["tags"])
    for split in ("train", "eval"):
        for batch in source.batches(7, split=split):
            tags = batch.features["tags"]
            assert isinstance(tags, Ragged)
            for row, i in enumerate(batch.features["id"].astype(int)):
                got = tags.values[tags.row_splits[row] : tags.row_splits[row + 1]].tolist()
                assert got == [f"t{i}_{k}" for k in range(i % 4)]


def test_csv_column_errors_list_the_file_columns(movies_csv: Path) -> None:
    listing = "the file has columns: id, user, movie, genres, age, rating, note"
    with pytest.raises(DataError, match=f"unknown columns \\['nope'\\]; {listing}"):
        CsvSource(movies_csv, label="rating", categorical=["nope"])
    with pytest.raises(DataError, match=f"no label column.*; {listing}"):
        CsvSource(movies_csv, label=None, categorical=["user"])
    with pytest.raises(DataError, match=f"unknown columns \\['stars'\\]; {listing}"):
        CsvSource(movies_csv, label="stars", categorical=["user"])
    with pytest.raises(DataError, match=f"no feature columns.*; {listing}"):
        CsvSource(movies_csv, label="rating")
    with pytest.raises(DataError, match=f"more than one role: \\['user'\\]; {listing}"):
        CsvSource(movies_csv, label="rating", categorical=["user"], multivalued=["user"])
    with pytest.raises(DataError, match="not found"):
        CsvSource(movies_csv.with_name("missing.csv"), label="rating", categorical=["user"])
    with pytest.raises(DataError, match="row 1, column 'user': cannot parse 'u1'"):
        list(CsvSource(movies_csv, label="rating", categorical={"user": "int64"}).batches(9))


def test_csv_bom_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "windows.csv"
    path.write_bytes('\ufeffuser,label\r\nu1,1\r\n"u\r\n2",0\r\n'.encode())
    (batch,) = CsvSource(path, label="label", categorical=["user"]).batches(5, split="all")
    assert batch.features["user"].tolist() == ["u1", "u\n2"]
    assert batch.labels.tolist() == [1.0, 0.0]


def test_csv_value_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("label,x,y\n1,2,a\n,3,b\n")
    with pytest.raises(DataError, match="row 2, column 'label': empty value"):
        list(CsvSource(path, label="label", numeric=["x"]).batches(9, split="all"))
    path.write_text("label,x,y\n1,inf,a\n")
    with pytest.raises(DataError, match="row 1, column 'x': infinite"):
        list(CsvSource(path, label="label", numeric=["x"]).batches(9, split="all"))
    path.write_text("label,x,y\n1,nan,a\n0,2,b,extra\n")
    with pytest.raises(DataError, match="row 2 has 4 fields, expected 3"):
        list(CsvSource(path, label="label", numeric=["x"]).batches(9, split="all"))
    path.write_text('label,x,y\n1,2,"never closed\n')
    with pytest.raises(DataError, match="bad CSV"):
        list(CsvSource(path, label="label", numeric=["x"]).batches(9, split="all"))


# ------------------------------------------------------------------ parquet


def test_parquet_types_nulls_and_lists(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "p.parquet")
    source = ParquetSource(
        path,
        label="clicked",
        categorical=["user", "item"],
        numeric=["price"],
        multivalued={"tags": "|", "cats": "|"},
    )
    assert source.schema.categorical == {"user": "string", "item": "int64"}
    assert source.schema.multivalued == {"tags": "string", "cats": "string"}
    assert source.num_examples == 4
    (batch,) = source.batches(10, split="all")  # two row groups, one batch
    assert batch.features["user"].tolist() == ["u1", "", "u3", "u1"]
    assert batch.features["item"].tolist() == [7, -3, 2**40, 7]
    assert batch.features["price"].tolist() == [1.5, 0.0, 0.0, 3.0]
    assert batch.labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    tags, cats = batch.features["tags"], batch.features["cats"]
    assert isinstance(tags, Ragged) and isinstance(cats, Ragged)
    assert tags.values.tolist() == ["a", "b", "c"] and tags.row_splits.tolist() == [0, 2, 2, 2, 3]
    assert cats.values.tolist() == ["x", "y", "z"] and cats.row_splits.tolist() == [0, 2, 2, 2, 3]
    cast = ParquetSource(path, label="clicked", categorical={"item": "string"})
    assert next(cast.batches(10, split="all")).features["item"].tolist()[:2] == ["7", "-3"]


def test_parquet_column_errors(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "p.parquet")
    listing = "the file has columns: user, item, tags, cats, price, clicked, slot"
    with pytest.raises(DataError, match=f"unknown columns \\['nope'\\]; {listing}"):
        ParquetSource(path, label="clicked", numeric=["nope"])
    with pytest.raises(DataError, match=f"'tags' has type list<.*cannot be numeric; {listing}"):
        ParquetSource(path, label="clicked", numeric=["tags"])
    with pytest.raises(DataError, match="rows 1-4, column 'slot': 1 null int64 ids"):
        list(ParquetSource(path, label="clicked", categorical=["slot"]).batches(9))
    with pytest.raises(DataError, match="column 'user': not an int64 id"):
        list(ParquetSource(path, label="clicked", categorical={"user": "int64"}).batches(9))
    slots = ParquetSource(path, label="clicked", categorical={"slot": "string"}).batches(9)
    assert next(slots).features["slot"].tolist() == ["1", "", "2", "3"]
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(DataError, match="not a readable parquet file"):
        ParquetSource(not_parquet, label="a", numeric=["b"])


def test_parquet_without_pyarrow_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DataError, match="needs pyarrow.*pip install pyarrow"):
        ParquetSource(path, label="y", numeric=["x"])


# ------------------------------------------------------------------ specs


def test_parse_data_spec_kinds(tmp_path: Path, movies_csv: Path) -> None:
    source = parse_data_spec("synthetic")
    assert isinstance(source, SyntheticSource) and source.num_examples == 100_000
    assert parse_data_spec("synthetic:2500").num_examples == 2500
    criteo = write_synthetic_criteo(tmp_path / "c.tsv", 10)
    assert isinstance(parse_data_spec(f"criteo:{criteo}"), CriteoSource)
    csv_source = parse_data_spec(
        f"csv:{movies_csv}",
        label="rating",
        categorical="user,movie:int64",
        numeric=["age"],
        multivalued=["genres:|"],
    )
    assert csv_source.schema.categorical == {"user": "string", "movie": "int64"}
    assert csv_source.schema.multivalued == {"genres": "string"}
    tsv = tmp_path / "m.tsv"
    tsv.write_text("label\tuser\n1\ta\n")
    assert parse_data_spec(f"csv:{tsv}", label="label", categorical="user").schema.categorical
    pytest.importorskip("pyarrow")
    parquet = _write_parquet(tmp_path / "p.parquet")
    parsed = parse_data_spec(f"parquet:{parquet}", label="clicked", multivalued={"cats": ""})
    assert parsed.schema.multivalued == {"cats": "string"}


def test_parse_data_spec_cli_shapes(movies_csv: Path) -> None:
    """The CLI passes lists and a {COL: SEP} mapping; strings work too."""
    a = parse_data_spec(
        f"csv:{movies_csv}", label="rating", categorical=["user"], multivalued={"genres": "|"}
    )
    b = parse_data_spec(
        f"csv:{movies_csv}", label="rating", categorical="user", multivalued="genres"
    )
    assert _same_batches(list(a.batches(2, split="all")), list(b.batches(2, split="all")))


def test_parse_data_spec_subsets_fixed_schemas() -> None:
    source = parse_data_spec("synthetic:100", categorical="C1,C2")
    assert source.schema.feature_names == ("C1", "C2", *(f"I{i}" for i in range(1, 14)))
    source = parse_data_spec("synthetic:100", categorical="C1", numeric="")
    assert source.schema.feature_names == ("C1",)
    with pytest.raises(DataError, match="unknown columns \\['I1'\\]; categorical: C1, C2"):
        parse_data_spec("synthetic:100", categorical="I1")
    with pytest.raises(DataError, match="--multivalued"):
        parse_data_spec("synthetic:100", multivalued="genres")
    with pytest.raises(DataError, match="--label"):
        parse_data_spec("synthetic:100", label="clicked")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("imagenet:/x", "unknown data spec 'imagenet:/x'; use synthetic"),
        ("data.csv", "unknown data spec"),
        ("synthetic:many", "whole number"),
        ("criteo:", "needs a path"),
        ("criteo:/no/such/file.tsv", "criteo file not found: '/no/such/file.tsv'"),
        ("csv:/no/such/file.csv", "csv file not found"),
    ],
)
def test_parse_data_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(DataError, match=match):
        parse_data_spec(spec, label="y", categorical="a")
    assert issubclass(DataError, ValueError)


# ------------------------------------------------------------------ containers


def test_ragged_and_batch_check_their_shapes() -> None:
    values = np.array(["a", "b", "c"], dtype=object)
    assert len(Ragged(values, np.array([0, 1, 3], dtype=np.int64))) == 2
    for splits in ([0, 3, 1], [1, 3], [0, 2], []):
        with pytest.raises(ValueError, match="row_splits"):
            Ragged(values, np.array(splits, dtype=np.int64))
    with pytest.raises(ValueError, match="row_splits"):
        Ragged(values, np.array([0, 3], dtype=np.int32))  # type: ignore[arg-type]
    labels = np.zeros(2, dtype=np.float32)
    with pytest.raises(ValueError, match="2 rows"):
        Batch({"x": np.zeros(3, dtype=np.float32)}, labels)
    with pytest.raises(ValueError, match="float32"):
        Batch({}, np.zeros(2))
    with pytest.raises(ValueError, match="one role"):
        Schema(categorical={"a": "string"}, numeric=("a",))
    with pytest.raises(ValueError, match="label"):
        Schema(numeric=("y",), label="y")


# ------------------------------------------------------------------ streaming


def test_reading_streams_in_bounded_memory(tmp_path: Path) -> None:
    """Peak memory while reading does not grow with the file (10x the lines).

    Holding 200k rows as Python objects would take ~50 MB; streaming needs a few.
    """
    block = "".join(f"{i},{i % 2},g{i % 7}|g{i % 5},u{i % 1000}\n" for i in range(20_000))

    def peak_bytes(copies: int) -> tuple[int, int]:
        path = tmp_path / f"big{copies}.csv"
        with path.open("w") as f:
            f.write("id,label,genres,user\n")
            for _ in range(copies):
                f.write(block)
        source = CsvSource(
            path, label="label", numeric=["id"], categorical=["user"], multivalued=["genres"]
        )
        tracemalloc.start()
        try:
            rows = sum(len(b) for b in source.batches(1024, split="train"))
            return tracemalloc.get_traced_memory()[1], rows
        finally:
            tracemalloc.stop()

    small, _ = peak_bytes(1)
    large, rows = peak_bytes(10)
    assert rows > 150_000
    assert large < 1.5 * small + (1 << 20), (small, large)
    assert large < 16 << 20


# --------------------------------------------------------------------------- shuffling


def _sorted_csv(path: Path, rows: int) -> Path:
    """A file sorted by user, as real logs often are; column `pos` is the row's position."""
    lines = ["pos,user,x,label"] + [f"{i},u{i // 100},{i * 0.5},{i % 2}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _positions(batches: Iterable[Batch]) -> list[int]:
    return [int(v) for v in _column(batches, "pos")]


def _pos_source(path: Path) -> CsvSource:
    return CsvSource(path, label="label", categorical={"pos": "int64", "user": None})


@pytest.mark.parametrize("kind", ["csv", "synthetic"])
def test_shuffle_is_a_permutation_reseeded_each_epoch_and_deterministic(
    tmp_path: Path, kind: str
) -> None:
    if kind == "csv":
        source: DataSource = _pos_source(_sorted_csv(tmp_path / "s.csv", 5000))
        key: Callable[[list[Batch]], list[object]] = lambda bs: list(_positions(bs))  # noqa: E731
    else:
        source = SyntheticSource(5000, seed=2)
        key = lambda bs: list(_synthetic_rows(bs))  # noqa: E731
    plain = key(list(source.batches(64, split="all")))
    one = list(source.batches(64, split="all", epochs=2, shuffle_buffer=500, seed=7))
    half = len(one) // 2
    e0, e1 = key(one[:half]), key(one[half:])
    assert sorted(e0) == sorted(plain) == sorted(e1)  # each epoch: every example once
    assert e0 != plain and e1 != plain and e0 != e1  # shuffled, and another order each epoch
    again = key(list(source.batches(64, split="all", epochs=2, shuffle_buffer=500, seed=7)))
    assert again == e0 + e1  # deterministic for a seed
    other = key(list(source.batches(64, split="all", shuffle_buffer=500, seed=8)))
    assert other != e0
    assert all(len(b) == 64 for b in one[: half - 1])  # batches stay full


def test_shuffle_buffer_is_bounded_and_mixes(tmp_path: Path) -> None:
    source = _pos_source(_sorted_csv(tmp_path / "s.csv", 20_000))
    out = _positions(source.batches(100, split="all", shuffle_buffer=1000, seed=1))
    where = np.empty(len(out), dtype=np.int64)
    where[np.array(out)] = np.arange(len(out))
    displacement = where - np.arange(len(out))
    # an example cannot leave before it is read: at most 1.5 buffers early
    assert displacement.min() >= -1500
    assert np.abs(displacement).mean() > 250  # and it really moves
    # users sorted into blocks of 100 rows: a batch of 100 now mixes many of them
    users = _column(source.batches(100, split="all", shuffle_buffer=1000, seed=1), "user")
    assert len(set(users[:100].tolist())) > 5


def test_shuffled_workers_are_disjoint_and_cover_the_single_worker_stream(tmp_path: Path) -> None:
    source = _pos_source(_sorted_csv(tmp_path / "s.csv", 3000))
    args = {"split": "train", "shuffle_buffer": 400, "seed": 3, "epochs": 2}
    single = list(source.batches(50, **args))  # type: ignore[arg-type]
    workers = [
        list(source.batches(50, worker_index=w, num_workers=3, **args))  # type: ignore[arg-type]
        for w in range(3)
    ]
    parts = [_positions(w) for w in workers]
    assert sorted(sum(parts, [])) == sorted(_positions(single))
    # batch i of the shuffled single stream is worker (i mod 3)'s
    per_epoch = len(single) // 2
    assert _positions(workers[1][:1]) == _positions(single[1:2])
    assert per_epoch > 3


@pytest.mark.parametrize("bad", [-1, 1.5, "10"])
def test_shuffle_buffer_must_be_a_non_negative_int(bad: object) -> None:
    with pytest.raises(ValueError, match="shuffle_buffer"):
        SyntheticSource(10).batches(5, shuffle_buffer=bad)  # type: ignore[arg-type]
