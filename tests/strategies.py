"""Hypothesis strategies shared by the unit tests (conftest registers the profiles)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lookup_table.core.keys import MAX_KEY_BYTES

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_NAME_REGEX = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"

# The characters most likely to break a key: separators, the escape char itself, the
# memcached line end, control chars, NUL (numpy strips trailing NULs), non-ASCII.
NASTY_CHARS = [
    " ",
    "/",
    "%",
    "\r",
    "\n",
    "\r\n",
    "\t",
    "\x00",
    "\x01",
    "\x7f",
    "\x85",
    "\u2028",
    "é",
    "€",
    "😀",
    "🏳️‍🌈",
    "~",
    "_",
    ".",
    "-",
    "+",
    "?",
    "#",
    "&",
]

#: Any int64, with the extremes and small values drawn often.
int_ids = st.one_of(
    st.integers(INT64_MIN, INT64_MAX),
    st.sampled_from([0, 1, -1, 7, INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1]),
    st.integers(-1000, 1000),
)

#: Characters a valid str id may hold: all of Unicode but lone surrogates (not UTF-8).
id_chars = st.characters(exclude_categories=("Cs",))


def str_ids(*, max_key_bytes: int = 228) -> st.SearchStrategy[str]:
    """Any valid Unicode str id whose encoded form (`s` excluded) fits in max_key_bytes.

    An encoded UTF-8 byte costs at most 3 key bytes (`%XX`); 228 leaves room for
    a prefix of 21 bytes such as `demo/user/w/`.
    """
    piece = st.one_of(id_chars, st.sampled_from(NASTY_CHARS))
    return (
        st.lists(piece, max_size=max_key_bytes // 12)
        .map("".join)
        .filter(lambda s: 3 * len(s.encode("utf-8")) <= max_key_bytes)
    )


#: Lone surrogates: valid Python str, not valid Unicode text, never an id.
lone_surrogates = st.characters(categories=("Cs",))

table_names = st.from_regex(_NAME_REGEX, fullmatch=True)
namespaces = st.from_regex(_NAME_REGEX, fullmatch=True)
kinds = st.from_regex(r"[a-z]{1,4}", fullmatch=True)


@st.composite
def keyed_ids(draw: st.DrawFn) -> tuple[str, str, str, int | str]:
    """(namespace, table, kind, id) whose key fits in MAX_KEY_BYTES."""
    namespace, table, kind = draw(namespaces), draw(table_names), draw(kinds)
    prefix_len = len(namespace) + len(table) + len(kind) + 3
    id_ = draw(st.one_of(int_ids, str_ids(max_key_bytes=MAX_KEY_BYTES - prefix_len - 1)))
    return namespace, table, kind, id_


def int_id_arrays(*, max_size: int = 64) -> st.SearchStrategy[np.ndarray]:
    """int64 (n,) arrays of ids, duplicates allowed."""
    return arrays(np.int64, st.integers(0, max_size), elements=int_ids)


def str_id_lists(*, max_size: int = 32) -> st.SearchStrategy[list[str]]:
    return st.lists(str_ids(), max_size=max_size)


#: Row shapes (n, dim).
row_shapes = st.tuples(st.integers(0, 16), st.integers(1, 64))


@st.composite
def float32_rows(draw: st.DrawFn, *, any_bits: bool = True) -> np.ndarray:
    """float32 (n, dim) rows; with any_bits, every bit pattern (NaN payloads, -0, inf)."""
    shape = draw(row_shapes)
    if any_bits and draw(st.booleans()):
        bits = draw(arrays(np.uint32, shape, elements=st.integers(0, 2**32 - 1)))
        return bits.view(np.float32)
    return draw(arrays(np.float32, shape, elements=st.floats(width=32)))
