"""`summarize_metadump`: the per-table key and byte counts of `lookup-table-admin stats`.

Pure: metadump replies written by hand, in memcached 1.6's line format.
"""

from __future__ import annotations

import numpy as np
import pytest

from lookup_table.errors import StoreError
from lookup_table.ops import stats
from lookup_table.ops.stats import UNPARSED, summarize_metadump

pytestmark = pytest.mark.unit


def _line(key: str, size: int, *, tail: str = "") -> bytes:
    return f"key={key} exp=-1 la=1795398671 cas=7 fetch=no cls=3 size={size}{tail}\n".encode()


def test_counts_keys_and_sizes_by_table_and_kind_of_the_namespace_only() -> None:
    data = b"".join(
        [
            _line("ns%2Fuser%2Fw%2FiAAAAAAAAAAH", 152),
            _line("ns%2Fuser%2Fw%2FiP__________", 152),
            _line("ns%2Fuser%2Fs%2FiAAAAAAAAAAH", 220),
            _line("ns%2Fword%2Fw%2Fsa%2520b", 101),  # the string id "a b"
            _line("ns%2F_meta%2Fm%2Fssentinel", 209),
            _line("ns%2F_dense%2Fds%2Fs0", 1234567),
            _line("ns%2Fold.t-1%2Fw%2FiAAAAAAAAAAB", 150),  # not in the cluster file
            _line("ns2%2Fuser%2Fw%2FiAAAAAAAAAAH", 999),  # another namespace
            _line("other%2Fns%2Fw%2FiAAAAAAAAAAH", 999),
            _line("ns%2Fnot-ours", 77),  # a key of the namespace the codec did not write
            _line("ns%2Fuser%2FWW%2Fi0", 78),  # kind must be lowercase
            b"END\r\n",
        ]
    )
    got = summarize_metadump(data, "ns", tables=["user", "word"])
    assert got == {
        ("user", "w"): (2, 304),
        ("user", "s"): (1, 220),
        ("word", "w"): (1, 101),
        ("_meta", "m"): (1, 209),
        ("_dense", "ds"): (1, 1234567),
        ("old.t-1", "w"): (1, 150),
        UNPARSED: (2, 155),
    }


def test_an_empty_node_and_a_node_without_the_namespace() -> None:
    assert summarize_metadump(b"END\r\n", "ns") == {}
    assert summarize_metadump(_line("x%2Fa%2Fw%2Fi0", 5) + b"END\r\n", "ns") == {}


def test_a_size_field_that_is_not_last_is_still_found() -> None:
    data = _line("ns%2Fuser%2Fw%2FiAAAAAAAAAAH", 152, tail=" flags=0") + b"END\r\n"
    assert summarize_metadump(data, "ns", tables=["user"]) == {("user", "w"): (1, 152)}


def test_a_line_without_size_is_an_error_naming_the_node() -> None:
    data = b"key=ns%2Fuser%2Fw%2FiAAAAAAAAAAH exp=-1 la=1 cas=1 fetch=no cls=1\nEND\r\n"
    with pytest.raises(StoreError, match="node n1 .* without a `size=` field"):
        summarize_metadump(data, "ns", tables=["user"], node="n1")


def test_many_keys_in_several_blocks_match_a_plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Vectorized per block of lines; the totals equal a per-key count."""
    rng = np.random.default_rng(3)
    n = 70_000
    tables = rng.choice(["user", "item", "t", "_meta", "zz"], size=n)
    kinds = rng.choice(["w", "s", "p", "ds"], size=n)
    sizes = rng.integers(1, 10**9, size=n)
    lines = [
        _line(f"ns%2F{t}%2F{k}%2Fi{i:016x}", int(s))
        for i, (t, k, s) in enumerate(zip(tables, kinds, sizes, strict=True))
    ]
    expected: dict[tuple[str, str], tuple[int, int]] = {}
    for t, k, s in zip(tables.tolist(), kinds.tolist(), sizes.tolist(), strict=True):
        keys, total = expected.get((t, k), (0, 0))
        expected[(t, k)] = (keys + 1, total + s)
    data = b"".join(lines) + b"END\r\n"
    monkeypatch.setattr(stats, "_BLOCK_LINES", 4096)  # many blocks, tables found per block
    assert summarize_metadump(data, "ns", tables=["user", "item"]) == expected


def test_count_expiring_reads_exp_after_the_key() -> None:
    """Keys of a TTL table that expire before the table's limit, by kind; `exp=-1` never
    expires; other tables and namespaces are not counted."""

    def line(key: str, exp: int) -> bytes:
        return f"key={key} exp={exp} la=1 cas=1 fetch=no cls=1 size=80\n".encode()

    data = b"".join(
        [
            line("ns%2Fhot%2Fw%2Fi01", 1000),  # expires before 1500: counted
            line("ns%2Fhot%2Fw%2Fi02", 1499),  # counted
            line("ns%2Fhot%2Fw%2Fi03", 1500),  # not before the limit
            line("ns%2Fhot%2Fw%2Fi04", 123456789012),  # 12 digits
            line("ns%2Fhot%2Fs%2Fi01", 900),  # slots: counted as slots
            line("ns%2Fhot%2Fc%2Fi09", -1),  # never expires
            line("ns%2Fcold%2Fw%2Fi01", 5),  # a table not asked about
            line("other%2Fhot%2Fw%2Fi01", 5),  # another namespace
            b"END\r\n",
        ]
    )
    got = stats.count_expiring(data, "ns", {"hot": 1500})
    assert got == {("hot", "w"): 2, ("hot", "s"): 1}
    assert stats.count_expiring(data, "ns", {"hot": 10**13}) == {
        ("hot", "w"): 4,
        ("hot", "s"): 1,
    }
    bad = b"key=ns%2Fhot%2Fw%2Fi01 la=1 cas=1 size=80\nEND\r\n"
    with pytest.raises(StoreError, match="without an `exp=` field"):
        stats.count_expiring(bad, "ns", {"hot": 1}, node="n:1")
