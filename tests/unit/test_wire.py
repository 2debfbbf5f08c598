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


def _stored_values(dtype: str, n: int, seed: int) -> np.ndarray:
    """float32 rows holding only values of `dtype`, as a replica's rows do: any finite
    value (a row never holds an inf or a NaN: storing one is refused), the edge cases
    among them: ±0, subnormals and each dtype's largest value."""
    from lookup_table.core.precision import decode

    rng = np.random.default_rng(seed)
    if dtype == "float32":
        return rng.standard_normal((n, 8), dtype=np.float32)
    exponent = np.uint16(0x7F80 if dtype == "bfloat16" else 0x7C00)
    words = rng.integers(0, 2**16, size=(n, 8), dtype=np.uint16)
    words[(words & exponent) == exponent] &= ~np.uint16(0x4000)  # finite ones only
    words[0, :5] = [0x0000, 0x8000, 0x0001, 0x8001, exponent - np.uint16(1)]
    return decode(words, dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rows_travel_in_their_stored_width_and_come_back_bit_for_bit(dtype: str) -> None:
    from lookup_table.core.wire import decode_rows, encode_rows

    rows = _stored_values(dtype, 300, seed=len(dtype))
    sent = unpack(pack(encode_rows(rows, dtype)))  # type: ignore[arg-type]
    back = decode_rows(sent, field="updated.t")
    assert back.dtype == np.float32 and back.shape == rows.shape
    np.testing.assert_array_equal(back.view(np.uint32), rows.view(np.uint32))
    wide = len(pack(encode_rows(rows, "float32")))
    if dtype == "float32":
        assert "row_dtype" not in sent and sent["rows"]["dtype"] == "<f4"
    else:  # half the bytes of float32
        assert sent["row_dtype"] == dtype and sent["rows"]["dtype"] == "<u2"
        assert len(pack(sent)) < 0.52 * wide


def test_row_words_are_taken_only_where_asked_and_an_unknown_row_dtype_is_named() -> None:
    from lookup_table.core.wire import WireError, decode_array, decode_rows, encode_rows

    words = unpack(pack(encode_rows(np.zeros((2, 4), np.float32), "float16")))
    with pytest.raises(
        WireError, match=r"rows\.dtype: expected one of \['<f4', '<i8'\], got '<u2'"
    ):
        decode_array(words["rows"], field="rows")  # a journal or a push takes no words
    with pytest.raises(
        WireError, match=r"updated\.t\.rows\.dtype: expected one of \['<f4', '<i8'\]"
    ):
        decode_rows({"rows": words["rows"]}, field="updated.t")  # words without their dtype
    with pytest.raises(WireError, match=r"updated\.t\.row_dtype: expected one of .*'int8'"):
        decode_rows({**words, "row_dtype": "int8"}, field="updated.t")
    f32 = unpack(pack(encode_rows(np.zeros((2, 4), np.float32), "float32")))
    with pytest.raises(WireError, match=r"g\.rows\.dtype: expected one of \['<u2'\], got '<f4'"):
        decode_rows({**f32, "row_dtype": "bfloat16"}, field="g")
