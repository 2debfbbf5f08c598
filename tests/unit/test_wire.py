"""`pack_view`: the same msgpack bytes as `pack`, handed out without a copy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_table.core.wire import encode_array, pack, pack_view, unpack

_leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
_docs = st.recursive(
    _leaves | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(_docs)
def test_pack_view_gives_the_bytes_of_pack(doc: object) -> None:
    view = pack_view(doc)
    assert isinstance(view, memoryview) and view.readonly
    assert bytes(view) == pack(doc)
    assert unpack(view) == unpack(pack(doc))


def test_a_megabyte_answer_packs_alike_and_its_view_cannot_be_written() -> None:
    rng = np.random.default_rng(5)
    rows = rng.random((6_500, 16), dtype=np.float32)
    doc = {"rows": encode_array(rows), "ids": encode_array(np.arange(6_500, dtype=np.int64))}
    view = pack_view(doc)
    assert bytes(view) == pack(doc)
    back = np.frombuffer(unpack(view)["rows"]["data"], dtype="<f4").reshape(rows.shape)
    np.testing.assert_array_equal(back, rows)
    with pytest.raises(TypeError):
        view[0] = 0
