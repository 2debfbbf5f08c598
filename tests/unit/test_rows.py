"""The row codec (lookup_table.core.rows): exactly `width` little-endian float32."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookup_table.core.rows import ROW_DTYPE, decode_row, encode_rows, row_bytes, value_hashes
from lookup_table.errors import CorruptValueError, StoreError
from tests.strategies import float32_rows

pytestmark = pytest.mark.unit

KEY = b"demo/user/w/i0000000000000007"


def test_golden_row_bytes() -> None:
    """Row format version 1: no header, no padding, little-endian float32."""
    rows = np.array([[1.0, -2.0, 0.5]], dtype=np.float32)
    encoded = encode_rows(rows, 3)
    assert encoded.dtype == np.uint8
    assert encoded.shape == (1, 12)
    assert encoded.tobytes() == bytes.fromhex("0000803f000000c00000003f")
    assert row_bytes(3) == 12
    assert ROW_DTYPE == np.dtype("<f4")


@given(float32_rows())
def test_round_trip_preserves_every_bit(rows: np.ndarray) -> None:
    n, width = rows.shape
    encoded = encode_rows(rows, width)
    assert encoded.shape == (n, row_bytes(width))
    for i in range(n):
        value = encoded[i].tobytes()
        assert len(value) == 4 * width
        row = decode_row(value, width, key=KEY)
        assert row.dtype == np.float32
        assert row.shape == (width,)
        # bit for bit: NaN payloads, signalling NaNs, -0.0 and inf survive
        assert row.view(np.uint32).tolist() == rows[i].view(np.uint32).tolist()


def test_special_values_survive() -> None:
    bits = np.array(
        [[0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001]],
        dtype=np.uint32,
    )
    rows = bits.view(np.float32)
    value = encode_rows(rows, 7)[0].tobytes()
    assert decode_row(value, 7, key=KEY).view(np.uint32).tolist() == bits[0].tolist()


def test_decoded_row_is_a_writable_copy() -> None:
    value = bytearray(encode_rows(np.ones((1, 4), dtype=np.float32), 4)[0].tobytes())
    row = decode_row(value, 4, key=KEY)
    assert row.flags.writeable
    row += 1  # frombuffer alone would be read-only (bytes) or alias the buffer (bytearray)
    assert decode_row(value, 4, key=KEY).tolist() == [1.0] * 4


def test_decode_accepts_memoryview_and_bytearray() -> None:
    value = encode_rows(np.arange(8, dtype=np.float32).reshape(2, 4), 4)
    flat = value.tobytes()
    assert decode_row(memoryview(flat)[16:], 4, key=KEY).tolist() == [4.0, 5.0, 6.0, 7.0]
    assert decode_row(bytearray(flat[:16]), 4, key=KEY).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_encode_casts_and_lays_out_contiguously() -> None:
    rows64 = np.array([[1.5, 2.5], [3.5, 4.5]], dtype=np.float64)
    assert encode_rows(rows64, 2).tobytes() == rows64.astype("<f4").tobytes()
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert encode_rows(fortran, 3).tobytes() == np.arange(6, dtype="<f4").tobytes()
    assert encode_rows(np.empty((0, 5), dtype=np.float32), 5).shape == (0, 20)


@pytest.mark.parametrize("length", [0, 1, 15, 17, 32, 4 * 1000])
def test_wrong_length_is_corruption_naming_the_key(length: int) -> None:
    with pytest.raises(CorruptValueError) as info:
        decode_row(b"\x00" * length, 4, key=KEY, node="10.0.0.1:11211")
    message = str(info.value)
    assert KEY.decode() in message
    assert f"has {length} bytes" in message
    assert "expected 16" in message
    assert "10.0.0.1:11211" in message
    assert "dim" in message  # says what to do
    assert info.value.node == "10.0.0.1:11211"
    assert isinstance(info.value, StoreError)


def test_corruption_message_without_node() -> None:
    with pytest.raises(CorruptValueError, match="demo/user/w/i0000000000000007") as info:
        decode_row(b"\x00" * 8, 4, key=KEY)
    assert info.value.node is None
    assert "on node" not in str(info.value)


@pytest.mark.parametrize(
    "shape", [(4,), (2, 3), (2, 5), (1, 1, 4), (0, 3), ()], ids=lambda s: f"shape{s}"
)
def test_wrong_shape_raises_value_error(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"\(n, 4\)"):
        encode_rows(np.zeros(shape, dtype=np.float32), 4)


def test_golden_value_hashes() -> None:
    """Journals hold these hashes: they must not change between versions of the service."""
    values = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    assert [hex(int(h)) for h in value_hashes(values)] == [
        "0x9f7ac6c8c3a09965",
        "0x43a45cc7f0e42277",
        "0x3ff0c8a95b0a4dbe",
    ]


@given(float32_rows(), st.data())
def test_value_hashes_of_blocks_are_those_of_their_concatenation(
    rows: np.ndarray, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, rows.shape[1]))
    left, right = rows[:, :cut], rows[:, cut:]  # strided views, one may be empty
    want = value_hashes(np.ascontiguousarray(rows))
    np.testing.assert_array_equal(value_hashes(left, right), want)
    np.testing.assert_array_equal(value_hashes(rows.astype(">f4")), want)  # the bytes stored


def test_value_hashes_tell_every_changed_word_and_the_width() -> None:
    item = np.zeros((1, 9), dtype=np.float32)
    seen = {int(value_hashes(item)[0])}
    for j in range(9):
        for value in (-0.0, 1e-45, 1.0):
            changed = item.copy()
            changed[0, j] = value
            seen.add(int(value_hashes(changed)[0]))
    seen.add(int(value_hashes(np.zeros((1, 8), dtype=np.float32))[0]))  # a shorter item
    assert len(seen) == 1 + 9 * 3 + 1


def test_value_hashes_refuse_blocks_of_other_lengths() -> None:
    with pytest.raises(ValueError, match="n alike"):
        value_hashes(np.zeros((3, 2), np.float32), np.zeros((2, 2), np.float32))


def test_value_hashes_are_per_row_however_many_rows_are_hashed_at_once() -> None:
    """Big inputs are hashed a slice of rows at a time: each row's hash is its own."""
    rng = np.random.default_rng(5)
    items = rng.standard_normal((5000, 300), dtype=np.float32)
    whole = value_hashes(items[:, :100], items[:, 100:])
    one_by_one = np.concatenate([value_hashes(items[i : i + 1]) for i in range(0, 5000, 997)])
    np.testing.assert_array_equal(whole[::997], one_by_one)
    pieces = np.concatenate([value_hashes(items[i : i + 333]) for i in range(0, 5000, 333)])
    np.testing.assert_array_equal(whole, pieces)
