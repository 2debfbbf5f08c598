"""The key codec: ids <-> memcached keys (lookup_table.core.keys)."""

from __future__ import annotations

import base64
import re
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookup_table.core.keys import (
    INT_ID_BYTES,
    MAX_KEY_BYTES,
    DecodedKey,
    as_ids,
    decode_key,
    encode_key,
    encode_keys,
    id_bodies,
    int_key_matrix,
    key_prefix,
    prefixed_keys,
    validate_name,
)
from lookup_table.errors import KeyEncodingError
from tests.strategies import (
    INT64_MAX,
    INT64_MIN,
    int_id_arrays,
    int_ids,
    keyed_ids,
    lone_surrogates,
    str_id_lists,
    str_ids,
)

pytestmark = pytest.mark.unit

# A key memcached accepts: printable ASCII without space (0x21-0x7e), <= 250 bytes.
_MEMCACHED_SAFE = re.compile(rb"[\x21-\x7e]{1,250}\Z")


def _assert_memcached_safe(key: bytes) -> None:
    assert isinstance(key, bytes)
    assert len(key) <= MAX_KEY_BYTES
    assert _MEMCACHED_SAFE.match(key), key


# ------------------------------------------------------------------ golden keys
# Key format version 1: stored data depends on these bytes. Changing one is a
# data migration (and a docs/wire-format.md change).


@pytest.mark.parametrize(
    ("id_", "key"),
    [
        (7, b"demo/user/w/iAAAAAAAAAAH"),
        (0, b"demo/user/w/iAAAAAAAAAAA"),
        (-1, b"demo/user/w/iP__________"),
        (INT64_MAX, b"demo/user/w/iH__________"),
        (INT64_MIN, b"demo/user/w/iIAAAAAAAAAA"),
        (0x0123456789ABCDEF, b"demo/user/w/iAEjRWeJq83v"),
        ("7", b"demo/user/w/s7"),
        ("banana", b"demo/user/w/sbanana"),
        ("a b/c", b"demo/user/w/sa%20b%2Fc"),
        ("", b"demo/user/w/s"),
        ("A-z_0.9~", b"demo/user/w/sA-z_0.9~"),
        ("100%\r\n", b"demo/user/w/s100%25%0D%0A"),
        ("é😀", b"demo/user/w/s%C3%A9%F0%9F%98%80"),
        ("a\x00", b"demo/user/w/sa%00"),
    ],
    ids=repr,
)
def test_golden_keys(id_: int | str, key: bytes) -> None:
    assert encode_key("demo", "user", "w", id_) == key
    assert decode_key(key) == DecodedKey(namespace="demo", table="user", kind="w", id=id_)


def test_golden_batch_and_other_kinds() -> None:
    assert encode_keys("ns", "t", "s", as_ids([1, -2])) == [
        b"ns/t/s/iAAAAAAAAAAB",
        b"ns/t/s/iP_________-",
    ]
    assert encode_key("ns", "_meta", "m", "sentinel") == b"ns/_meta/m/ssentinel"


# ------------------------------------------------------------------ round trips


@given(keyed_ids())
def test_encode_key_round_trip(case: tuple[str, str, str, int | str]) -> None:
    namespace, table, kind, id_ = case
    key = encode_key(namespace, table, kind, id_)
    _assert_memcached_safe(key)
    decoded = decode_key(key)
    assert decoded == DecodedKey(namespace=namespace, table=table, kind=kind, id=id_)
    assert type(decoded.id) is type(id_)
    assert decode_key(key.decode("ascii")) == decoded  # str keys (from metadump) too


@given(int_id_arrays())
def test_encode_keys_int_round_trip(ids: np.ndarray) -> None:
    keys = encode_keys("demo", "user", "w", ids)
    assert len(keys) == ids.shape[0]
    for key, id_ in zip(keys, ids.tolist(), strict=True):
        _assert_memcached_safe(key)
        assert len(key) == len(b"demo/user/w/") + INT_ID_BYTES
        assert decode_key(key).id == id_
        assert key == encode_key("demo", "user", "w", id_)


@given(str_id_lists())
def test_encode_keys_str_round_trip(values: list[str]) -> None:
    ids = as_ids(values)
    assert ids.dtype == object or not values
    keys = encode_keys("demo", "word", "w", ids)
    assert [decode_key(k).id for k in keys] == values
    for key in keys:
        _assert_memcached_safe(key)
    # distinct ids give distinct keys (the encoding is injective)
    assert len(set(keys)) == len(set(values))


@given(int_ids)
def test_int_and_str_of_the_same_digits_differ(value: int) -> None:
    int_key = encode_key("demo", "t", "w", value)
    str_key = encode_key("demo", "t", "w", str(value))
    assert int_key != str_key
    assert decode_key(int_key).id == value
    assert decode_key(str_key).id == str(value)


def test_seven_and_string_seven_differ() -> None:
    assert encode_key("demo", "t", "w", 7) != encode_key("demo", "t", "w", "7")
    assert decode_key(encode_key("demo", "t", "w", "7")).id == "7"
    assert decode_key(encode_key("demo", "t", "w", 7)).id == 7


def _b64_id(value: int) -> bytes:
    """The 11 digits of an int id by the standard library: base64url of its 64 bits as
    9 big-endian bytes, whose first digit is always "A"."""
    return base64.urlsafe_b64encode((value & 0xFFFFFFFFFFFFFFFF).to_bytes(9, "big"))[1:]


@given(int_id_arrays(max_size=32))
def test_int_key_matrix_equals_per_id_encoding(ids: np.ndarray) -> None:
    prefix = key_prefix("ns", "table.v2", "w")
    matrix = int_key_matrix(prefix, ids)
    assert matrix.dtype == np.uint8
    assert matrix.shape == (ids.shape[0], len(prefix) + INT_ID_BYTES)
    expected = [prefix + b"i" + _b64_id(v) for v in ids.tolist()]
    assert [row.tobytes() for row in matrix] == expected


_B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


@given(st.text(alphabet=_B64URL, min_size=11, max_size=11))
def test_every_int_body_of_64_bits_decodes_to_the_one_id_that_encodes_it(digits: str) -> None:
    """11 base64url digits carry 66 bits: those whose first digit is above "P" (more than
    64 bits) are refused, every other decodes to the id whose key it is (one key per id)."""
    key = b"demo/user/w/i" + digits.encode()
    if _B64URL.index(digits[0]) >= 16:
        with pytest.raises(KeyEncodingError, match="bad int id encoding"):
            decode_key(key)
        return
    id_ = decode_key(key).id
    assert isinstance(id_, int) and INT64_MIN <= id_ <= INT64_MAX
    assert encode_key("demo", "user", "w", id_) == key


def test_int_key_matrix_accepts_non_contiguous_ids() -> None:
    ids = np.arange(-10, 10, dtype=np.int64)[::3]
    matrix = int_key_matrix(b"a/b/w/", ids)
    assert [bytes(row) for row in matrix] == encode_keys("a", "b", "w", ids.copy())


def test_encode_keys_empty() -> None:
    assert encode_keys("demo", "user", "w", as_ids([])) == []
    assert encode_keys("demo", "user", "w", np.empty(0, dtype=object)) == []


# ------------------------------------------------------------------ as_ids


@pytest.mark.parametrize(
    "dtype",
    [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64],
)
def test_as_ids_accepts_every_int_dtype(dtype: type) -> None:
    raw = np.array([0, 1, 2, 100], dtype=dtype)
    ids = as_ids(raw)
    assert ids.dtype == np.int64
    assert ids.tolist() == [0, 1, 2, 100]


def test_as_ids_accepts_lists_tuples_and_scalars() -> None:
    assert as_ids([1, -2, INT64_MAX, INT64_MIN]).tolist() == [1, -2, INT64_MAX, INT64_MIN]
    assert as_ids((3, 4)).dtype == np.int64
    assert as_ids([np.int32(5), np.int64(6)]).tolist() == [5, 6]
    assert as_ids(7).tolist() == [7]
    assert as_ids(np.int16(7)).tolist() == [7]
    assert as_ids([]).shape == (0,)
    assert as_ids([]).dtype == np.int64


def test_as_ids_uint64_that_fits() -> None:
    ids = as_ids(np.array([0, INT64_MAX], dtype=np.uint64))
    assert ids.dtype == np.int64
    assert ids.tolist() == [0, INT64_MAX]


def test_as_ids_str_inputs() -> None:
    for raw in (["a", "b c"], ("a", "b c"), np.array(["a", "b c"]), np.array(["a", "b c"], object)):
        ids = as_ids(raw)
        assert ids.dtype == object
        assert ids.tolist() == ["a", "b c"]
        assert all(type(v) is str for v in ids.tolist())
    assert as_ids("banana").tolist() == ["banana"]


def test_as_ids_decodes_bytes_as_utf8() -> None:
    for raw in ([b"banana", "caf\xe9".encode()], np.array([b"banana", "caf\xe9".encode()], object)):
        assert as_ids(raw).tolist() == ["banana", "caf\xe9"]
    assert as_ids(np.array([b"banana"])).tolist() == ["banana"]  # dtype S
    assert as_ids(b"banana").tolist() == ["banana"]
    assert as_ids([b"x", "y"]).tolist() == ["x", "y"]
    # a tf.string tensor's b"banana" is the same id (and key) as "banana"
    assert encode_key("d", "t", "w", b"banana") == encode_key("d", "t", "w", "banana")  # type: ignore[arg-type]


@given(str_ids())
def test_as_ids_keeps_every_character(value: str) -> None:
    # numpy's fixed-width str dtype strips trailing NULs: "a\x00" must stay "a\x00"
    assert as_ids([value]).tolist() == [value]
    assert as_ids([value.encode("utf-8")]).tolist() == [value]
    assert decode_key(encode_key("d", "t", "w", value)).id == value


def test_trailing_nul_is_a_different_id() -> None:
    assert encode_key("d", "t", "w", "a\x00") != encode_key("d", "t", "w", "a")
    assert as_ids(["a", "a\x00", b"a\x00\x00"]).tolist() == ["a", "a\x00", "a\x00\x00"]


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ([1.5, 2.0], "float64"),
        (np.array([1.0], dtype=np.float32), "float32"),
        ([True, False], "True"),
        (np.array([True]), "bool"),
        ([1, True], "True"),
        ([True, 2], "True"),
        ([np.True_, 1], "True"),
        ([1, "a"], "'a'"),
        (["a", 1], "1"),
        (["a", 1.5], "1.5"),
        ([b"a", 2], "2"),
        (np.array([1, "a"], dtype=object), "'a'"),
        (np.array(["a", None], dtype=object), "None"),
        ([1, None], "None"),
    ],
    ids=repr,
)
def test_as_ids_refuses_floats_bools_and_mixtures(raw: object, shown: str) -> None:
    with pytest.raises(KeyEncodingError, match=re.escape(shown)):
        as_ids(raw, table="ads")


def test_as_ids_message_names_table_and_position() -> None:
    with pytest.raises(KeyEncodingError) as info:
        as_ids([1, 2, "x"], table="ads")
    message = str(info.value)
    assert "'ads'" in message
    assert "'x'" in message
    assert "position 2" in message


def test_as_ids_refuses_non_utf8_bytes() -> None:
    with pytest.raises(KeyEncodingError, match=r"position 1.*not UTF-8"):
        as_ids([b"ok", b"\xff\xfe"], table="t")


def test_as_ids_refuses_out_of_range_ints() -> None:
    with pytest.raises(KeyEncodingError, match=str(2**63)):
        as_ids(np.array([1, 2**63], dtype=np.uint64))
    with pytest.raises(KeyEncodingError, match=str(2**64 - 1)):
        as_ids(np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(KeyEncodingError, match=str(2**64)):
        as_ids([2**64])
    with pytest.raises(KeyEncodingError, match="int64"):
        as_ids([-1, 2**63])


def test_as_ids_refuses_2d_input() -> None:
    with pytest.raises(KeyEncodingError, match=r"1-D.*\(2, 2\)"):
        as_ids([[1, 2], [3, 4]])
    with pytest.raises(KeyEncodingError, match="1-D"):
        as_ids(np.array([["a"], ["b"]]))


@given(st.text(max_size=3), lone_surrogates, st.text(max_size=3))
def test_lone_surrogates_are_refused_with_the_id(head: str, bad: str, tail: str) -> None:
    value = head + bad + tail
    with pytest.raises(KeyEncodingError, match="not valid Unicode") as info:
        encode_keys("d", "word", "w", as_ids(["ok", value], table="word"))
    assert repr(value)[:40] in str(info.value)
    assert "'word'" in str(info.value)


@pytest.mark.parametrize("id_", ["x" * 300, "é" * 100, "/" * 80])
def test_too_long_id_is_refused_with_advice(id_: str) -> None:
    with pytest.raises(KeyEncodingError) as info:
        encode_key("demo", "user", "w", id_)
    message = str(info.value)
    assert repr(id_)[:20] in message  # names the id (shortened)
    assert "250" in message
    assert "hash long ids" in message  # says what to do


def test_longest_str_id_that_fits() -> None:
    prefix = b"demo/user/w/s"
    fits = "x" * (MAX_KEY_BYTES - len(prefix))
    key = encode_key("demo", "user", "w", fits)
    assert len(key) == MAX_KEY_BYTES
    assert decode_key(key).id == fits
    with pytest.raises(KeyEncodingError):
        encode_key("demo", "user", "w", fits + "x")


# ------------------------------------------------------------------ encoded once, every kind


def _as_list(keys: np.ndarray | list[bytes]) -> list[bytes]:
    return [bytes(k) for k in keys] if isinstance(keys, np.ndarray) else keys


@given(st.one_of(int_id_arrays(max_size=30), str_id_lists(max_size=30)), st.data())
def test_id_bodies_with_any_prefix_are_encode_keys(ids: object, data: st.DataObject) -> None:
    """The bodies are encoded once; joined with each kind's prefix they are its keys."""
    id_array = as_ids(ids, table="user")
    bodies = id_bodies("user", id_array)
    for kind in ("w", "s", "ds"):
        prefix = key_prefix("demo", "user", kind)
        bodies.check_prefix(prefix)
        assert _as_list(prefixed_keys(prefix, bodies.bodies)) == encode_keys(
            "demo", "user", kind, id_array
        )
        index = np.array(
            data.draw(st.lists(st.integers(0, max(0, id_array.shape[0] - 1)), max_size=10))
            if id_array.shape[0]
            else [],
            dtype=np.intp,
        )
        picked = _as_list(prefixed_keys(prefix, bodies.bodies, index))
        everything = encode_keys("demo", "user", kind, id_array)
        assert picked == [everything[i] for i in index.tolist()]


@given(st.lists(int_id_arrays(max_size=12), min_size=1, max_size=4), st.data())
def test_each_bodys_own_prefix_gives_each_tables_keys(
    arrays: list[np.ndarray], data: st.DataObject
) -> None:
    """Several tables' int ids one after another, each with its table's prefix (a
    matrix, one row per body): the keys `encode_keys` gives each table."""
    tables = [f"t{k}" for k in range(len(arrays))]  # names of one length: one key width
    ids = np.concatenate(arrays).astype(np.int64)
    bodies = id_bodies(tables[0], ids).bodies
    prefixes = np.repeat(
        np.stack([np.frombuffer(key_prefix("demo", t, "w"), dtype=np.uint8) for t in tables]),
        [a.shape[0] for a in arrays],
        axis=0,
    )
    everything = [
        k for t, a in zip(tables, arrays, strict=True) for k in encode_keys("demo", t, "w", a)
    ]
    assert _as_list(prefixed_keys(prefixes, bodies)) == everything
    index = np.array(
        data.draw(st.lists(st.integers(0, max(0, ids.shape[0] - 1)), max_size=10))
        if ids.shape[0]
        else [],
        dtype=np.intp,
    )
    assert _as_list(prefixed_keys(prefixes, bodies, index)) == [everything[i] for i in index]
    with pytest.raises(ValueError, match="int bodies only"):
        prefixed_keys(prefixes, [b"sx"])


def test_id_bodies_refuse_too_long_ids_per_prefix() -> None:
    """A body that fits one kind's prefix may not fit a longer one: checked per prefix."""
    short = key_prefix("demo", "user", "w")
    fits = "x" * (MAX_KEY_BYTES - len(short) - 1)  # + the `s` tag
    bodies = id_bodies("user", as_ids(["a", fits], table="user"))
    bodies.check_prefix(short)
    with pytest.raises(KeyEncodingError, match="too long.*251 bytes.*hash long ids") as info:
        bodies.check_prefix(key_prefix("demo", "user", "ds"))
    assert "'user'" in str(info.value)
    with pytest.raises(KeyEncodingError, match="not valid Unicode"):
        id_bodies("word", as_ids(["ok", "\ud800"], table="word"))


# ------------------------------------------------------------------ names and kinds


@pytest.mark.parametrize(
    "name", ["", "_meta", "-a", ".a", "a/b", "a b", "a%b", "é", "a" * 65, "a\n", None, 7]
)
def test_bad_table_names_are_refused(name: object) -> None:
    with pytest.raises(KeyEncodingError, match="table name"):
        validate_name(name, "table name")


def test_reserved_names_only_where_allowed() -> None:
    assert validate_name("_meta", "table name", reserved_ok=True) == "_meta"
    assert key_prefix("demo", "_meta", "m") == b"demo/_meta/m/"
    with pytest.raises(KeyEncodingError, match="namespace"):
        key_prefix("_demo", "user", "w")


@pytest.mark.parametrize("kind", ["", "W", "abcde", "w/", "1", "w "])
def test_bad_kinds_are_refused(kind: str) -> None:
    with pytest.raises(KeyEncodingError, match="kind"):
        encode_key("demo", "user", kind, 1)


def test_bad_namespace_is_refused() -> None:
    with pytest.raises(KeyEncodingError, match="namespace.*'a b'"):
        encode_key("a b", "user", "w", 1)


# ------------------------------------------------------------------ decode_key


@pytest.mark.parametrize(
    "key",
    [
        b"",
        b"demo/user/w",  # 3 parts
        b"demo/user/w/",  # no id tag
        b"demo/user/w/x1",  # unknown tag
        b"demo/user/w/i7",  # short int
        b"demo/user/w/iAAAAAAAAAAAH",  # long int
        b"demo/user/w/iAAAAAAAAAA=",  # not a base64url digit
        b"demo/user/w/iAAAAAAAAAA+",  # base64's "+", not base64url's "-"
        b"demo/user/w/iQAAAAAAAAAA",  # more than 64 bits
        b"demo/user/w/i0000000000000007",  # 16 hex digits (storage format 2)
        b"demo/user/w/sa b",  # raw space
        b"demo/user/w/sa/b",  # raw slash
        b"demo/user/w/s%2f",  # lowercase escape (the codec writes %2F)
        b"demo/user/w/s%61",  # needless escape of "a"
        b"demo/user/w/s%",  # truncated escape
        b"demo/user/w/s%FF",  # not UTF-8
        b"demo/user/w/s%ED%A0%80",  # an encoded surrogate
        b"de mo/user/w/s1",  # bad namespace
        b"demo/us er/w/s1",
        b"demo/user/W/s1",  # bad kind
        b"demo/user/w/s\xc3\xa9",  # raw non-ASCII
        "demo/user/w/s\xe9",  # non-ASCII str key
    ],
    ids=repr,
)
def test_decode_key_refuses_malformed_keys(key: bytes | str) -> None:
    with pytest.raises(KeyEncodingError, match="not a lookup-table key"):
        decode_key(key)


def test_decode_key_accepts_memoryview_and_bytearray() -> None:
    key = encode_key("demo", "user", "w", -5)
    assert decode_key(bytearray(key)).id == -5
    assert decode_key(memoryview(key)).id == -5


# ------------------------------------------------------------------ speed guard


def test_vectorized_int_keys_are_not_slower_than_a_python_loop() -> None:
    """A guard against losing the uint8-matrix path, not a benchmark."""
    ids = np.random.default_rng(0).integers(INT64_MIN, INT64_MAX, size=65_536, dtype=np.int64)
    prefix = "demo/user/w/"

    def naive() -> list[bytes]:
        return [f"{prefix}i".encode() + _b64_id(v) for v in ids.tolist()]

    def vectorized() -> list[bytes]:
        return encode_keys("demo", "user", "w", ids)

    assert vectorized() == naive()
    best: dict[str, float] = {}
    for name, fn in (("naive", naive), ("vectorized", vectorized)):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    assert best["naive"] / best["vectorized"] >= 1.0, best


@given(int_id_arrays())
def test_int_bodies_are_the_base64url_digits_of_the_ids_bits(ids: np.ndarray) -> None:
    """The compiled key bodies of int ids: `i` and the 11 digits numpy's expression of
    them gives, from a contiguous array, a read-only one and into a strided view."""
    from lookup_table.core.keys import _B64_DIGITS, _SHIFTS

    bits = ids.view(np.uint64)
    want = np.empty((ids.shape[0], 12), dtype=np.uint8)
    want[:, 0] = ord("i")
    want[:, 1:] = _B64_DIGITS[(bits[:, None] >> _SHIFTS) & np.uint64(63)]
    frozen = ids.copy()
    frozen.setflags(write=False)
    for given_ids in (ids, frozen):
        assert np.array_equal(id_bodies("t", given_ids).bodies, want)
    assert np.array_equal(int_key_matrix(b"ns/t/w/", ids)[:, 7:], want)
