"""Delimited text files (plain or gzip): chunked reading, splitting into fields, parsing.

`TextSource` is the base of `CriteoSource` and `CsvSource`.
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from numpy.typing import NDArray

from trainer.data.batch import Batch, Feature, Ragged, Schema
from trainer.data.errors import DataError
from trainer.data.source import DataSource

_CHUNK_CHARS = 1 << 18  # text read per chunk: ~1k Criteo rows, ~3 MB of parsed fields
# What reading a text file can raise on bad bytes: not UTF-8, corrupt or truncated gzip.
READ_ERRORS = (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error)


def open_text(path: Path) -> IO[str]:
    """Open a UTF-8 text file, gunzipping it if it starts with the gzip magic bytes."""
    with path.open("rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    if gzipped:
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return path.open(encoding="utf-8-sig")


def _text_chunks(f: IO[str], *, quoted: bool) -> Iterator[str]:
    """~_CHUNK_CHARS of whole lines at a time, ending in a newline.

    With `quoted`, a chunk never ends inside a quoted field (CSV doubles quotes
    inside quoted fields, so an odd count of quote characters means we are in one).
    """
    while True:
        text = f.read(_CHUNK_CHARS)
        if not text:
            return
        if not text.endswith("\n"):
            text += f.readline()
        odd = quoted and text.count('"') % 2 == 1
        while odd:
            more = f.readline()
            if not more:
                break  # an unterminated quote: the csv parser reports it
            text += more
            odd ^= more.count('"') % 2 == 1
        if not text.endswith("\n"):
            text += "\n"
        yield text


class Fields:
    """The fields of one text chunk, by column: a (nrows, ncols) table of str."""

    def __init__(self, columns: Callable[[int], Sequence[str]], nrows: int) -> None:
        self.column = columns
        self.nrows = nrows


def _split_text(
    text: str, *, delimiter: str, ncols: int, quoted: bool, path: Path, first_row: int
) -> Fields:
    """Split a chunk of whole lines into fields; blank lines are skipped.

    Fast path: one `split` over the whole chunk, with a marker field at each line
    end so a line with a wrong field count can never shift fields into its
    neighbour unnoticed. Otherwise (quotes, blank or bad lines) line by line.
    """
    if not (quoted and '"' in text):
        nrows = text.count("\n")
        parts = text.replace("\n", f"{delimiter}\n{delimiter}").split(delimiter)
        parts.pop()  # the empty field after the last line's marker
        stride = ncols + 1
        if len(parts) == nrows * stride and parts[ncols::stride].count("\n") == nrows:
            return Fields(lambda j: parts[j::stride], nrows)
    if quoted:
        reader: Iterable[list[str]] = csv.reader(
            io.StringIO(text), delimiter=delimiter, strict=True
        )
    else:
        reader = (line.split(delimiter) for line in text.split("\n"))
    rows: list[list[str]] = []
    try:
        for row in reader:
            if not row or row == [""]:
                continue
            if len(row) != ncols:
                shown = delimiter.join(row)
                raise DataError(
                    f"{path}: row {first_row + len(rows) + 1} has {len(row)} fields, "
                    f"expected {ncols}: {shown[:80]!r}"
                )
            rows.append(row)
    except csv.Error as exc:
        raise DataError(f"{path}: bad CSV after row {first_row + len(rows)}: {exc}") from exc
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in range(ncols)]
    return Fields(lambda j: columns[j], len(rows))


def _bad_value(
    values: Sequence[str], parse: Callable[[str], object], path: Path, column: str, first_row: int
) -> DataError:
    for i, value in enumerate(values):
        try:
            parse(value)
        except (ValueError, OverflowError):
            what = f"cannot parse {value[:40]!r}" if value else "empty value"
            return DataError(f"{path}: row {first_row + i + 1}, column {column!r}: {what}")
    return DataError(f"{path}: column {column!r} near row {first_row + 1}: cannot parse")


def _parse_numbers(
    values: Sequence[str], *, path: Path, column: str, first_row: int, ints_first: bool
) -> NDArray[np.float64]:
    """Numbers as float64; empty and NaN -> NaN (missing); infinity is an error.

    `ints_first` tries int64 parsing first, which is faster when every value is an int.
    """
    has_empty = "" in values
    filled = [v or "0" for v in values] if has_empty else values
    out: NDArray[np.float64] | None = None
    if ints_first:
        try:
            out = np.array(filled, dtype=np.int64).astype(np.float64)
        except (ValueError, OverflowError):
            pass
    if out is None:
        try:
            out = np.array(filled, dtype=np.float64)
        except ValueError:
            raise _bad_value(filled, float, path, column, first_row) from None
    if has_empty:
        out[np.array(values, dtype=object) == ""] = np.nan
    if np.isinf(out).any():
        row = first_row + int(np.flatnonzero(np.isinf(out))[0]) + 1
        raise DataError(f"{path}: row {row}, column {column!r}: infinite value")
    return out


def _parse_labels(
    values: Sequence[str], *, path: Path, column: str, first_row: int
) -> NDArray[np.float32]:
    """Labels as float32; an empty, NaN or infinite label is an error."""
    try:
        out = np.array(values, dtype=np.int64).astype(np.float32)
    except (ValueError, OverflowError):
        try:
            out = np.array(values, dtype=np.float64).astype(np.float32)
        except ValueError:
            bad = _bad_value(values, float, path, column, first_row)
            raise DataError(
                f"{bad}: labels are numbers (0 and 1 for a click or a class); write the "
                f"label column as 0/1 first (e.g. 1 where {column} is the positive class)"
            ) from None
    if not np.isfinite(out).all():
        row = first_row + int(np.flatnonzero(~np.isfinite(out))[0]) + 1
        raise DataError(f"{path}: row {row}, label column {column!r}: not a finite number")
    return out


def _string_ids(values: Sequence[str]) -> NDArray[np.object_]:
    return np.fromiter(values, dtype=object, count=len(values))


def _int_ids(
    values: Sequence[str], *, path: Path, column: str, first_row: int
) -> NDArray[np.int64]:
    try:
        return np.array(values, dtype=np.int64).reshape(len(values))
    except (ValueError, OverflowError):
        raise _bad_value(values, int, path, column, first_row) from None


def _split_ids(values: Sequence[str], sep: str) -> Ragged:
    """Split each value on `sep` into string ids; an empty value or item gives no id."""
    lists = [[p for p in v.split(sep) if p] if v else [] for v in values]
    splits = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, lists), dtype=np.int64, count=len(lists)), out=splits[1:])
    flat = list(itertools.chain.from_iterable(lists))
    return Ragged(_string_ids(flat), splits)


@dataclass(frozen=True, slots=True)
class Column:
    """How to turn one text column into a feature (or the labels)."""

    name: str
    index: int  # position in the file's fields
    kind: Literal["label", "numeric", "log1p", "int64", "string", "multivalued"]
    sep: str = ""


class TextSource(DataSource):
    """A delimited text file (plain or gzip) read in chunks of whole lines."""

    def __init__(
        self,
        path: Path,
        *,
        delimiter: str,
        ncols: int,
        quoted: bool,
        header: bool,
        columns: Sequence[Column],
        schema: Schema,
    ) -> None:
        self._path = path
        self._delimiter = delimiter
        self._ncols = ncols
        self._quoted = quoted
        self._header = header
        self._columns = tuple(columns)
        self._schema = schema

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def path(self) -> Path:
        return self._path

    def chunks(self) -> Iterator[Batch]:
        first_row = 0
        try:
            with open_text(self._path) as f:
                if self._header:
                    read_header(f, self._delimiter, self._path)
                for text in _text_chunks(f, quoted=self._quoted):
                    fields = _split_text(
                        text,
                        delimiter=self._delimiter,
                        ncols=self._ncols,
                        quoted=self._quoted,
                        path=self._path,
                        first_row=first_row,
                    )
                    if fields.nrows:
                        yield self._convert(fields, first_row)
                    first_row += fields.nrows
        except READ_ERRORS as exc:
            raise DataError(
                f"{self._path}: cannot read after row {first_row}: {exc} "
                "(expected UTF-8 text, plain or gzip)"
            ) from exc

    def _convert(self, fields: Fields, first_row: int) -> Batch:
        where: dict[str, Any] = {"path": self._path, "first_row": first_row}
        features: dict[str, Feature] = {}
        labels = np.empty(0, dtype=np.float32)
        for col in self._columns:
            values = fields.column(col.index)
            if col.kind == "label":
                labels = _parse_labels(values, column=col.name, **where)
            elif col.kind in ("numeric", "log1p"):
                x = _parse_numbers(values, column=col.name, ints_first=col.kind == "log1p", **where)
                if col.kind == "log1p":
                    x = np.log1p(np.maximum(x, 0.0))  # NaN (missing) stays NaN
                features[col.name] = x.astype(np.float32)
            elif col.kind == "int64":
                features[col.name] = _int_ids(values, column=col.name, **where)
            elif col.kind == "string":
                features[col.name] = _string_ids(values)
            else:
                features[col.name] = _split_ids(values, col.sep)
        return Batch({n: features[n] for n in self._schema.feature_names}, labels)


def read_header(f: IO[str], delimiter: str, path: Path) -> list[str]:
    line = f.readline()
    while line.count('"') % 2 == 1:  # a quoted header name with a newline in it
        more = f.readline()
        if not more:
            break
        line += more
    try:
        names = next(csv.reader([line], delimiter=delimiter, strict=True), [])
    except csv.Error as exc:
        raise DataError(f"{path}: bad CSV header: {exc}") from exc
    if not names or names == [""]:
        raise DataError(f"{path}: empty file; a CSV file needs a header row of column names")
    return names
