"""`CsvSource`: a CSV file with a header row, columns chosen by name."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from trainer.data.batch import ID_DTYPES, IdDtype, Schema
from trainer.data.errors import DataError
from trainer.data.files import as_mapping, check_file, columns_error, resolve_columns
from trainer.data.text import READ_ERRORS, Column, TextSource, open_text, read_header


class CsvSource(TextSource):
    """A CSV file with a header row; plain or gzip. Only the chosen columns are read.

    * categorical: string ids as written (an empty field is the id ""), unless
      declared "int64" (`{"user": "int64"}`, CLI `--categorical user:int64`):
      then every value must be an integer. Ids are never guessed from the data,
      so a late non-integer value cannot change a column's type mid-training.
    * numeric: floats; empty or NaN is missing (NaN in `raw_batches`; `batches`
      fills it with 0.0, or with the training mean under `trainer.numeric`).
    * multivalued: name -> separator (CLI `--multivalued genres:|`, default "|"):
      each field splits into string ids; an empty field or item gives no id.
    * label: a float per row; empty is an error.

    Quoted fields (RFC 4180, also with newlines inside) are supported; a UTF-8
    BOM and CRLF line ends are fine. `columns` is the file's header.

    Raises:
        DataError: a missing file, or a missing/unknown/repeated column; the
            message lists the file's columns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        label: str | None,
        categorical: Mapping[str, IdDtype | None] | Sequence[str] = (),
        numeric: Sequence[str] = (),
        multivalued: Mapping[str, str] | Sequence[str] = (),
        delimiter: str = ",",
    ) -> None:
        p = check_file(path, "csv")
        cat = as_mapping(categorical, None)
        multi = as_mapping(multivalued, "|")
        try:
            with open_text(p) as f:
                available = read_header(f, delimiter, p)
        except READ_ERRORS as exc:
            raise DataError(f"{p}: not a readable CSV file (UTF-8, plain or gzip): {exc}") from exc
        duplicates = sorted({n for n in available if available.count(n) > 1})
        if duplicates:
            raise columns_error(p, f"repeated column names {duplicates}", available)
        label = resolve_columns(
            p, available, label=label, categorical=cat, numeric=numeric, multivalued=multi
        )
        for name, dtype in cat.items():
            if dtype not in (None, *ID_DTYPES):
                raise DataError(f"column {name!r}: id dtype must be int64 or string, got {dtype!r}")
        index = {name: i for i, name in enumerate(available)}
        columns = [Column(label, index[label], "label")]
        columns += [
            Column(n, index[n], "int64" if t == "int64" else "string") for n, t in cat.items()
        ]
        columns += [Column(n, index[n], "numeric") for n in numeric]
        columns += [Column(n, index[n], "multivalued", sep) for n, sep in multi.items()]
        schema = Schema(
            categorical={n: "int64" if t == "int64" else "string" for n, t in cat.items()},
            numeric=tuple(numeric),
            multivalued=dict.fromkeys(multi, "string"),
            label=label,
        )
        super().__init__(
            p,
            delimiter=delimiter,
            ncols=len(available),
            quoted=True,
            header=True,
            columns=columns,
            schema=schema,
        )
        self.columns = tuple(available)
