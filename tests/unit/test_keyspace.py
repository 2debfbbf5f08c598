"""The keyspace: every kind and bookkeeping key, pinned (changing one is a data migration)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lookup_table.core.keys import decode_key, encode_key, encode_keys
from lookup_table.core.keyspace import (
    DENSE_CURRENT_ID,
    DENSE_TABLE,
    META_TABLE,
    ROW_KINDS,
    STORAGE_FORMAT,
    Kind,
    dense_chunk_id,
    dense_log_id,
    is_journal_header,
    journal_id,
    push_record_id,
    sentinel_format,
    sentinel_key,
    version_id,
    version_replica,
)

pytestmark = pytest.mark.unit


def test_kind_tags_are_pinned() -> None:
    assert {k.name: str(k) for k in Kind} == {
        "ROW": "w",
        "COUNTER": "c",
        "META": "m",
        "PUSH_RECORD": "p",
        "JOURNAL": "j",
        "DENSE": "d",
        "DENSE_SLOTS": "ds",
        "DENSE_LOG": "dl",
    }
    assert ROW_KINDS == ("w",)  # a row and its slots are one item (storage format 2)
    assert len({k.label for k in Kind}) == len(Kind)


def test_golden_keys() -> None:
    ns = "demo"
    assert encode_keys(ns, "user", Kind.ROW, np.array([7], np.int64)) == [
        b"demo/user/w/iAAAAAAAAAAH"
    ]
    assert encode_key(ns, "user", Kind.ROW, "a b") == b"demo/user/w/sa%20b"
    assert sentinel_key(ns) == b"demo/_meta/m/ssentinel"
    assert encode_key(ns, META_TABLE, Kind.META, version_id(3)) == b"demo/_meta/m/sversion-r3"
    assert (
        encode_key(ns, META_TABLE, Kind.PUSH_RECORD, push_record_id(0, "w1-42"))
        == b"demo/_meta/p/sr0%3Aw1-42"
    )
    assert encode_key(ns, META_TABLE, Kind.JOURNAL, journal_id(1, 2)) == b"demo/_meta/j/sr1-j2"
    assert (
        encode_key(ns, META_TABLE, Kind.JOURNAL, journal_id(1, 2, 5)) == b"demo/_meta/j/sr1-j2-c5"
    )
    assert encode_key(ns, DENSE_TABLE, Kind.META, DENSE_CURRENT_ID) == b"demo/_dense/m/scurrent"
    assert (
        encode_key(ns, DENSE_TABLE, Kind.DENSE_SLOTS, dense_chunk_id("ab12", "dense/kernel", 0))
        == b"demo/_dense/ds/sab12%2Fdense%2Fkernel%2F0"
    )
    assert encode_key(ns, DENSE_TABLE, Kind.DENSE_LOG, dense_log_id(41)) == b"demo/_dense/dl/sv41"
    assert (
        encode_key(ns, DENSE_TABLE, Kind.DENSE_LOG, dense_log_id(41, 2))
        == b"demo/_dense/dl/sv41-c2"
    )


def test_parsers_invert_the_builders() -> None:
    assert version_replica(version_id(12)) == 12
    assert version_replica("sentinel") is None and version_replica("version-r") is None
    assert is_journal_header(journal_id(0, 3))
    assert not is_journal_header(journal_id(0, 3, 1))
    assert not is_journal_header(push_record_id(0, "x"))
    decoded = decode_key(encode_key("n", META_TABLE, Kind.JOURNAL, journal_id(4, 1)))
    assert (decoded.table, decoded.kind, decoded.id) == ("_meta", "j", "r4-j1")


def test_sentinel_format_reads_the_format_field_and_format_1_had_none() -> None:
    assert STORAGE_FORMAT == 3
    assert sentinel_format(json.dumps({"format": 2, "namespace": "demo"}).encode()) == 2
    assert sentinel_format(json.dumps({"namespace": "demo", "node": "a:1"}).encode()) == 1
    for bad in (b"", b"\xff", b"[1]", b"not json", b'{"format": "2"}', b'{"format": true}'):
        with pytest.raises(ValueError, match="sentinel"):
            sentinel_format(bad)
