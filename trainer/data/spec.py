"""`parse_data_spec`: the CLI's `--data SPEC` and column options to a `DataSource`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from trainer.data.batch import ID_DTYPES, IdDtype
from trainer.data.criteo import CriteoSource
from trainer.data.csvfile import CsvSource
from trainer.data.errors import DataError
from trainer.data.parquet import ParquetSource
from trainer.data.source import DataSource
from trainer.data.synthetic import SyntheticSource

_SPEC_KINDS = "synthetic[:N], criteo:PATH, csv:PATH or parquet:PATH"


def _name_list(value: str | Iterable[str] | None) -> list[str]:
    """Column names from "A,B" or ["A", "B"]; blanks dropped."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return [item.strip() for item in items if item and item.strip()]


def _typed_names(value: str | Iterable[str] | None) -> dict[str, IdDtype | None]:
    """Categorical columns "A,B:int64" -> {"A": None, "B": "int64"}."""
    out: dict[str, IdDtype | None] = {}
    for item in _name_list(value):
        name, colon, dtype = item.rpartition(":")
        if colon and dtype in ID_DTYPES:
            out[name] = "int64" if dtype == "int64" else "string"
        else:
            out[item] = None
    return out


def _multi_names(value: str | Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """Multivalued columns "COL[:SEP]" (SEP default "|") -> {COL: SEP}."""
    if isinstance(value, Mapping):
        return {str(k).strip(): (v or "|") for k, v in value.items()}
    out: dict[str, str] = {}
    for item in _name_list(value):
        name, _, sep = item.partition(":")
        out[name] = sep or "|"
    return out


def _fixed_schema(
    source: DataSource,
    spec: str,
    *,
    label: str | None,
    categorical: str | Iterable[str] | None,
    numeric: str | Iterable[str] | None,
    multivalued: object,
) -> DataSource:
    """Apply column options to a source with a fixed schema: a subset of its features."""
    schema = source.schema
    if label not in (None, schema.label):
        raise DataError(f"{spec}: the label is {schema.label!r}, --label {label!r} does not apply")
    if multivalued:
        raise DataError(f"{spec}: has no multivalued columns; --multivalued applies to csv/parquet")
    if categorical is None and numeric is None:
        return source
    chosen_cat = _name_list(categorical) if categorical is not None else list(schema.categorical)
    chosen_num = _name_list(numeric) if numeric is not None else list(schema.numeric)
    bad = [n for n in chosen_cat if n not in schema.categorical]
    bad += [n for n in chosen_num if n not in schema.numeric]
    if bad:
        raise DataError(
            f"{spec}: unknown columns {bad}; categorical: {', '.join(schema.categorical)}; "
            f"numeric: {', '.join(schema.numeric)}"
        )
    return source.select([*chosen_cat, *chosen_num])


def parse_data_spec(
    spec: str,
    *,
    label: str | None = None,
    categorical: str | Iterable[str] | None = None,
    numeric: str | Iterable[str] | None = None,
    multivalued: str | Iterable[str] | Mapping[str, str] | None = None,
) -> DataSource:
    """Build the source the CLI's `--data SPEC` and column options describe.

    Specs: `synthetic` or `synthetic:N` (N examples, default 100_000), `criteo:PATH`,
    `csv:PATH` (tab-separated if PATH ends in .tsv or .tsv.gz) and `parquet:PATH`.
    Column options take "A,B" or a list: `categorical` items may end in ":int64"
    or ":string"; `multivalued` items are "COL[:SEP]" (SEP default "|") or a
    {COL: SEP} mapping. For csv and parquet, `label` and at least one feature are
    required. For synthetic and criteo the schema is fixed; `categorical` or
    `numeric` choose a subset of its columns (a group left as None keeps all).

    Raises:
        DataError: an unknown kind, a missing file, or a missing/unknown column
            (the message lists the columns the file has).
    """
    kind, colon, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "synthetic":
        try:
            n = int(arg) if colon else 100_000
        except ValueError:
            raise DataError(f"synthetic:N needs a whole number N, got {arg!r}") from None
        if n < 0:
            raise DataError(f"synthetic:N needs N >= 0, got {n}")
        return _fixed_schema(
            SyntheticSource(n),
            spec,
            label=label,
            categorical=categorical,
            numeric=numeric,
            multivalued=multivalued,
        )
    if kind in ("criteo", "csv", "parquet") and not arg:
        raise DataError(f"{kind}:PATH needs a path, got {spec!r}")
    if kind == "criteo":
        return _fixed_schema(
            CriteoSource(arg),
            spec,
            label=label,
            categorical=categorical,
            numeric=numeric,
            multivalued=multivalued,
        )
    columns: dict[str, Any] = {
        "label": label,
        "categorical": _typed_names(categorical),
        "numeric": _name_list(numeric),
        "multivalued": _multi_names(multivalued),
    }
    if kind == "csv":
        tsv = arg.endswith((".tsv", ".tsv.gz"))
        return CsvSource(arg, delimiter="\t" if tsv else ",", **columns)
    if kind == "parquet":
        return ParquetSource(arg, **columns)
    raise DataError(f"unknown data spec {spec!r}; use {_SPEC_KINDS}")
