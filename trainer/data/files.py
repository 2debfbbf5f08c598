"""What the file sources share: the file must exist, the chosen columns must be in it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.data.batch import IdDtype
from trainer.data.errors import DataError


def check_file(path: str | os.PathLike[str], kind: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{kind} file not found: {str(p)!r} (cwd {os.getcwd()!r})")
    return p


def columns_error(path: Path, problem: str, available: Sequence[str]) -> DataError:
    return DataError(f"{path}: {problem}; the file has columns: {', '.join(available)}")


def resolve_columns(
    path: Path,
    available: Sequence[str],
    *,
    label: str | None,
    categorical: Mapping[str, IdDtype | None],
    numeric: Sequence[str],
    multivalued: Mapping[str, str],
) -> str:
    """Check that the chosen columns exist, are distinct, and include a label and a feature.

    Returns the label column.
    """
    if not label:
        raise columns_error(path, "no label column given (--label COL)", available)
    chosen = [label, *categorical, *numeric, *multivalued]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise columns_error(path, f"unknown columns {unknown}", available)
    if len(chosen) == 1:
        raise columns_error(
            path, "no feature columns given (--categorical, --numeric, --multivalued)", available
        )
    repeated = sorted({n for n in chosen if chosen.count(n) > 1})
    if repeated:
        raise columns_error(path, f"columns given more than one role: {repeated}", available)
    return label


def as_mapping(value: Mapping[str, Any] | Sequence[str], default: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        raise TypeError(f"expected a sequence of column names, got the str {value!r}")
    return dict.fromkeys(value, default)
