"""`ParquetSource`: a parquet file read a record batch at a time (needs pyarrow)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.keys import IdArray
from trainer.data.batch import ID_DTYPES, Batch, Feature, IdDtype, Ragged, Schema
from trainer.data.errors import DataError
from trainer.data.files import as_mapping, check_file, columns_error, resolve_columns
from trainer.data.source import DataSource


def _pyarrow() -> Any:
    """Import pyarrow (an optional dependency) or say how to install it."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as exc:
        raise DataError(
            "reading parquet needs pyarrow, which is not installed: pip install pyarrow"
        ) from exc
    return pyarrow


class ParquetSource(DataSource):
    """A parquet file, read a record batch at a time (needs pyarrow).

    `columns` is the file's column names. Types come from the file: an integer
    column gives int64 ids, a string (or
    dictionary-encoded string) column string ids; `{"col": "string"}` or
    `"int64"` casts instead. A null string id is "" (missing); a null int64 id
    is an error. Numeric columns (int, float, bool) become float32; null/NaN is
    missing (filled as for CSV). A null or NaN label is an error. A multivalued
    column is a list of ints or strings (nulls dropped), or a string column split
    on its separator (empty items dropped).

    Raises:
        DataError: pyarrow is missing, the file is missing or not parquet, or a
            column is missing, unknown or of a type that cannot serve its role;
            the message lists the file's columns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        label: str | None,
        categorical: Mapping[str, IdDtype | None] | Sequence[str] = (),
        numeric: Sequence[str] = (),
        multivalued: Mapping[str, str] | Sequence[str] = (),
        read_rows: int = 65_536,
    ) -> None:
        p = check_file(path, "parquet")
        pa = _pyarrow()
        try:
            with pa.parquet.ParquetFile(p) as pf:
                arrow_schema = pf.schema_arrow
                self._num_examples = int(pf.metadata.num_rows)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{p}: not a readable parquet file: {exc}") from exc
        available = list(arrow_schema.names)
        cat = as_mapping(categorical, None)
        multi = as_mapping(multivalued, "|")
        label = resolve_columns(
            p, available, label=label, categorical=cat, numeric=numeric, multivalued=multi
        )
        types = {name: arrow_schema.field(name).type for name in available}
        kinds = {
            "label": _is_number,
            "numeric": _is_number,
            "categorical": lambda t: _is_number(t) or _is_text(t),
        }

        def check(name: str, role: str, ok: Callable[[Any], bool]) -> None:
            if not ok(types[name]):
                raise columns_error(
                    p, f"column {name!r} has type {types[name]}, which cannot be {role}", available
                )

        check(label, "a label", kinds["label"])
        for name in numeric:
            check(name, "numeric", kinds["numeric"])
        id_dtypes: dict[str, IdDtype] = {}
        for name, dtype in cat.items():
            check(name, "categorical ids (integer or string)", kinds["categorical"])
            if dtype not in (None, *ID_DTYPES):
                raise DataError(f"column {name!r}: id dtype must be int64 or string, got {dtype!r}")
            id_dtypes[name] = dtype or ("string" if _is_text(types[name]) else "int64")
        multi_dtypes: dict[str, IdDtype] = {}
        for name in multi:
            t = types[name]
            if _is_list(t):
                check(name, "multivalued ids", lambda t: _is_list(t) and _is_id(t.value_type))
                multi_dtypes[name] = "string" if _is_text(t.value_type) else "int64"
            else:
                check(name, "multivalued (a list, or a string to split)", _is_text)
                multi_dtypes[name] = "string"
        self._path = p
        self._read_rows = read_rows
        self._multi_sep = multi
        self._schema = Schema(
            categorical=id_dtypes, numeric=tuple(numeric), multivalued=multi_dtypes, label=label
        )
        self.columns = tuple(available)

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def num_examples(self) -> int:
        return self._num_examples

    def chunks(self) -> Iterator[Batch]:
        pa = _pyarrow()
        wanted = [self._schema.label, *self._schema.feature_names]
        first_row = 0
        try:
            with pa.parquet.ParquetFile(self._path) as pf:
                for record_batch in pf.iter_batches(batch_size=self._read_rows, columns=wanted):
                    yield self._convert(pa, record_batch, first_row)
                    first_row += record_batch.num_rows
        except pa.ArrowException as exc:
            raise DataError(f"{self._path}: cannot read after row {first_row}: {exc}") from exc

    def _convert(self, pa: Any, record_batch: Any, first_row: int) -> Batch:
        schema = self._schema
        rows = f"{self._path}: rows {first_row + 1}-{first_row + record_batch.num_rows}"
        col = record_batch.column
        features: dict[str, Feature] = {}
        for name, dtype in schema.categorical.items():
            features[name] = _arrow_ids(pa, col(name), dtype, f"{rows}, column {name!r}")
        for name in schema.numeric:
            features[name] = _arrow_numbers(pa, col(name), f"{rows}, column {name!r}")
        for name, dtype in schema.multivalued.items():
            where = f"{rows}, column {name!r}"
            features[name] = _arrow_ragged(pa, col(name), dtype, self._multi_sep[name], where)
        labels = _arrow_numbers(pa, col(schema.label), f"{rows}, label {schema.label!r}")
        missing = np.isnan(labels)
        if missing.any():
            raise DataError(
                f"{rows}: the label column {schema.label!r} has {int(missing.sum())} "
                "null or NaN labels; every example needs a label"
            )
        return Batch(features, labels)


def _is_number(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_integer(t) or pt.is_floating(t) or pt.is_boolean(t) or pt.is_decimal(t))


def _is_text(t: Any) -> bool:
    import pyarrow.types as pt

    if pt.is_dictionary(t):
        t = t.value_type
    return bool(pt.is_string(t) or pt.is_large_string(t))


def _is_id(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_integer(t) or _is_text(t))


def _is_list(t: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t))


def _arrow_numbers(pa: Any, arr: Any, where: str) -> NDArray[np.float32]:
    """Numbers as float32; null and NaN -> NaN (missing); infinity is an error."""
    x = pa.compute.fill_null(pa.compute.cast(arr, pa.float64()), float("nan"))
    out = np.array(x.to_numpy(zero_copy_only=False), dtype=np.float64)
    if np.isinf(out).any():
        raise DataError(f"{where}: infinite value")
    return out.astype(np.float32)


def _arrow_ids(pa: Any, arr: Any, dtype: IdDtype, where: str) -> IdArray:
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if dtype == "string":
        if not _is_text(arr.type):
            arr = pa.compute.cast(arr, pa.string())
        arr = pa.compute.fill_null(arr, "")
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=object)
    try:
        arr = pa.compute.cast(arr, pa.int64())
    except pa.ArrowException as exc:
        raise DataError(f"{where}: not an int64 id: {exc}") from exc
    if arr.null_count:
        raise DataError(
            f"{where}: {arr.null_count} null int64 ids; declare the column as string ids "
            'to keep missing ids as ""'
        )
    return np.array(arr.to_numpy(), dtype=np.int64)


def _arrow_ragged(pa: Any, arr: Any, dtype: IdDtype, sep: str, where: str) -> Ragged:
    """A list column (null items dropped) or a string column split on `sep` (empty items
    dropped too) as a Ragged of ids."""
    pc = pa.compute
    split = not _is_list(arr.type)
    if split:
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        arr = pc.split_pattern(arr, sep)
    values = pc.list_flatten(arr)
    parents = pc.list_parent_indices(arr)
    keep = pc.is_valid(values)
    if split:
        keep = pc.and_(keep, pc.fill_null(pc.not_equal(values, ""), False))
    values, parents = values.filter(keep), parents.filter(keep)
    lengths = np.bincount(np.asarray(parents.to_numpy(), dtype=np.int64), minlength=len(arr))
    splits = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=splits[1:])
    return Ragged(_arrow_ids(pa, values, dtype, where), splits)
