"""The row codec (lookup_table.core.rows): exactly `width` little-endian float32."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookup_table.core.rows import (
    NOT_UPDATED,
    ROW_DTYPE,
    UNCHANGED,
    change_witnesses,
    decode_row,
    encode_rows,
    row_bytes,
    still_old,
    value_hashes,
)
from lookup_table.errors import CorruptValueError, StoreError
from tests.strategies import float32_rows

pytestmark = pytest.mark.unit

KEY = b"demo/user/w/iAAAAAAAAAAH"


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
    with pytest.raises(CorruptValueError, match="demo/user/w/iAAAAAAAAAAH") as info:
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


@given(float32_rows(), st.data())
def test_a_witness_tells_the_old_item_from_the_new_one_exactly(
    old: np.ndarray, data: st.DataObject
) -> None:
    """Whatever the update changed (any words, any bits: -0.0, NaN payloads) or left as
    it was, `still_old` is True for the old item and for an unchanged one, False for a
    changed item's new value: exact, no hash."""
    n, width = old.shape
    flips = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, max(n - 1, 0)), st.integers(0, max(width - 1, 0)), st.integers(0, 31)
            ),
            max_size=3 * n,
        )
    )
    bits = old.view(np.uint32).copy()
    for i, j, b in flips:
        if n and width:
            bits[i, j] ^= np.uint32(1 << b)
    new = bits.view(np.float32)
    cut = data.draw(st.integers(0, width))  # a row and its slots: two blocks, either empty
    witness = change_witnesses((old[:, :cut], old[:, cut:]), (new[:, :cut], new[:, cut:]))
    unchanged = (old.view(np.uint32) == new.view(np.uint32)).all(axis=1)
    assert (witness == UNCHANGED).tolist() == unchanged.tolist()
    assert still_old(witness, old[:, :cut], old[:, cut:]).all()
    assert still_old(witness, new[:, :cut], new[:, cut:]).tolist() == unchanged.tolist()
    assert still_old(witness, old).tolist() == [True] * n  # the blocks are one item


def test_a_witness_is_the_first_changed_word_and_its_old_bits() -> None:
    old_rows = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [0.0, 0.0]], np.float32)
    old_slots = np.array([[5.0], [5.0], [5.0], [7.0]], np.float32)
    new_rows = np.array([[9.0, 9.0], [1.0, -2.0], [1.0, 2.0], [-0.0, 0.0]], np.float32)
    new_slots = np.array([[6.0], [6.0], [5.0], [7.0]], np.float32)
    witness = change_witnesses((old_rows, old_slots), (new_rows, new_slots))
    assert (witness >> 32).tolist() == [0, 1, -1, 0]  # row 2 unchanged; -0.0 is a change
    low = (witness & 0xFFFFFFFF).astype(np.uint32)
    assert low[:2].view(np.float32).tolist() == [1.0, 2.0]
    assert low[3] == 0  # +0.0's bits
    rows_later = np.array([[1.0, 9.0], [1.0, 2.0], [1.0, 2.0], [0.0, 0.0]], np.float32)
    slots_later = np.array([[5.0], [6.0], [5.0], [7.0]], np.float32)
    # only the witness word is looked at: each item's still has its old bits
    assert still_old(witness, rows_later, slots_later).tolist() == [True, True, True, True]


def test_an_id_the_push_does_not_update_is_never_still_old() -> None:
    rows = np.zeros((2, 3), np.float32)
    witness = np.array([NOT_UPDATED, UNCHANGED], dtype=np.int64)
    assert still_old(witness, rows).tolist() == [False, True]


def test_witnesses_refuse_blocks_that_do_not_match() -> None:
    with pytest.raises(ValueError, match="equal shapes"):
        change_witnesses((np.zeros((2, 3), np.float32),), (np.zeros((2, 4), np.float32),))
    with pytest.raises(ValueError, match="n alike"):
        change_witnesses(
            (np.zeros((2, 3), np.float32), np.zeros((3, 1), np.float32)),
            (np.zeros((2, 3), np.float32), np.zeros((3, 1), np.float32)),
        )
    witness = np.array([(5 << 32) | 1], dtype=np.int64)
    with pytest.raises(ValueError, match="word 5 of items of 4 words"):
        still_old(witness, np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="1 stored items"):
        still_old(witness, np.zeros((2, 4), np.float32))


def test_witnesses_of_big_batches_match_those_of_each_item() -> None:
    rng = np.random.default_rng(8)
    old = rng.standard_normal((5000, 40), dtype=np.float32)
    new = old.copy()
    new[::2, 0] += 1  # first word
    new[1::4, 17] += 1  # a later word of the row block
    new[3::8, 33] += 1  # only in the slots
    whole = change_witnesses((old[:, :20], old[:, 20:]), (new[:, :20], new[:, 20:]))
    one = [change_witnesses((old[i : i + 1],), (new[i : i + 1],))[0] for i in range(0, 5000, 7)]
    assert whole[::7].tolist() == [int(w) for w in one]
    assert set((whole >> 32).tolist()) == {0, 17, 33, -1}
