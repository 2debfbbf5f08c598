"""Journal formats: every header names its format; one without a number is told by shape."""

from __future__ import annotations

from typing import Any

import pytest

from lookup_table.errors import StorageFormatError
from optimizer_service.engine.journal_format import (
    BEHIND,
    FORMATS,
    ONE_BODY,
    START_END,
    journal_format,
)

pytestmark = pytest.mark.unit

HEADER = {"push_id": "p", "bytes": 10, "crc32": None, "chunks": 0, "time": 0.0}


@pytest.mark.parametrize(
    ("header", "want"),
    [
        (HEADER | {"body": b"x"}, ONE_BODY),  # older services: no number, no seq, no split
        (HEADER | {"split": 4, "tail": b"x"}, START_END),
        (HEADER | {"seq": 3, "body": b"x"}, BEHIND),
        (HEADER | {"seq": None, "body": b"x"}, ONE_BODY),
        (HEADER | {"format": START_END, "split": 4}, START_END),
        (HEADER | {"format": BEHIND, "seq": 3}, BEHIND),
        (HEADER | {"format": ONE_BODY}, ONE_BODY),
    ],
)
def test_a_header_names_its_format_or_its_shape_does(header: dict[str, Any], want: int) -> None:
    assert journal_format(header) == want


def test_every_format_has_a_name() -> None:
    assert sorted(FORMATS) == [ONE_BODY, START_END, BEHIND] == [1, 2, 3]


@pytest.mark.parametrize("number", [0, 4, 99, -1, "2", True, 2.5])
def test_an_unknown_format_is_refused_naming_it_and_the_known_ones(number: object) -> None:
    with pytest.raises(StorageFormatError) as info:
        journal_format(HEADER | {"format": number}, where="journal slot 5 of replica 1")
    message = str(info.value)
    assert f"journal slot 5 of replica 1 is in journal format {number!r}" in message
    assert "it reads formats 1 (one body, of older services), 2 (a start and an end), 3" in message
    assert "restore a checkpoint" in message
