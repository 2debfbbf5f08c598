"""`CriteoSource`: Criteo's display-advertising TSV, and its column layout."""

from __future__ import annotations

import os

import numpy as np

from trainer.data.batch import Batch, Schema
from trainer.data.errors import DataError
from trainer.data.files import check_file
from trainer.data.text import READ_ERRORS, Column, Fields, TextSource, open_text

# The columns of a Criteo line, after the label (`SyntheticSource` uses them too).
NUM_NUMERIC = 13
NUM_CATEGORICAL = 26
NUMERIC_NAMES = tuple(f"I{j}" for j in range(1, NUM_NUMERIC + 1))
CATEGORICAL_NAMES = tuple(f"C{j}" for j in range(1, NUM_CATEGORICAL + 1))


class CriteoSource(TextSource):
    """Criteo's display-advertising TSV: label, I1-I13, C1-C26, no header; plain or gzip.

    * Numeric `I1..I13`: integer counts, `log1p(max(x, 0))`, float32; empty is missing
      (see `CsvSource`).
    * Categorical `C1..C26`: string ids as written (hex); an empty field is the
      string id "" (a real "missing" value that gets its own row).
    * Label "label": 0 or 1.

    Raises:
        DataError: the file is missing, its first line is not 40 tab-separated
            fields, or (while reading) a row is malformed.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = check_file(path, "criteo")
        columns = [Column("label", 0, "label")]
        columns += [Column(n, 1 + j, "log1p") for j, n in enumerate(NUMERIC_NAMES)]
        columns += [Column(n, 14 + j, "string") for j, n in enumerate(CATEGORICAL_NAMES)]
        schema = Schema(
            categorical=dict.fromkeys(CATEGORICAL_NAMES, "string"),
            numeric=NUMERIC_NAMES,
            label="label",
        )
        ncols = 1 + NUM_NUMERIC + NUM_CATEGORICAL
        super().__init__(
            p,
            delimiter="\t",
            ncols=ncols,
            quoted=False,
            header=False,
            columns=columns,
            schema=schema,
        )
        try:
            with open_text(p) as f:
                first = f.readline().rstrip("\n")
        except READ_ERRORS as exc:
            raise DataError(
                f"{p}: not a readable Criteo TSV (UTF-8, plain or gzip): {exc}"
            ) from exc
        if first and first.count("\t") != ncols - 1:
            raise DataError(
                f"{p}: a Criteo line has {ncols} tab-separated fields "
                f"(label, I1-I13, C1-C26), the first line has {first.count(chr(9)) + 1}: "
                f"{first[:80]!r}"
            )
        if first.startswith("label\t"):
            raise DataError(f"{p}: Criteo files have no header; remove the first line")

    def _convert(self, fields: Fields, first_row: int) -> Batch:
        batch = super()._convert(fields, first_row)
        bad = np.flatnonzero((batch.labels != 0) & (batch.labels != 1))
        if bad.size:
            row, value = first_row + int(bad[0]) + 1, batch.labels[bad[0]]
            raise DataError(f"{self.path}: row {row}: a Criteo label is 0 or 1, got {value}")
        return batch
