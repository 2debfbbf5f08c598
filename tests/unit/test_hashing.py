"""Stable hashing (lookup_table.core.hashing): golden values, process independence, no warnings."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis.extra.numpy import arrays

from lookup_table.core.hashing import combine, id_hashes, mix64, stable_hash
from tests.strategies import INT64_MAX, INT64_MIN, int_id_arrays, int_ids, str_id_lists
from tests.unit._fresh import fresh_json

pytestmark = pytest.mark.unit

# Golden values: every row's node, owner and initial value derives from these.
# Changing one is a data migration, never a refactor.
GOLDEN_INT_IDS = [0, 1, 7, -1, INT64_MAX, INT64_MIN]
GOLDEN_INT_HASHES = [
    4005344944564626363,
    432138558032670928,
    5694825656095257671,
    6552589034229262652,
    12156899534086910229,
    3306519111306888640,
]
GOLDEN_STR_IDS = ["", "7", "banana", "a b/c", "😀"]
GOLDEN_STR_HASHES = [
    15766752046519552297,
    8129113359836690904,
    18391718931799524749,
    10674794463679091585,
    13947057090115555514,
]
GOLDEN_STABLE_HASHES = {
    "x": 5717441744405258058,
    "": 13020603013274838756,
    "node:127.0.0.1:11211": 1928218711417040596,
}
GOLDEN_MIX64 = {0: 0, 1: 6238072747940578789, 2**64 - 1: 13029008266876403067}


def test_golden_int_id_hashes() -> None:
    hashes = id_hashes(np.array(GOLDEN_INT_IDS, dtype=np.int64))
    assert hashes.dtype == np.uint64
    assert hashes.tolist() == GOLDEN_INT_HASHES


def test_golden_str_id_hashes() -> None:
    hashes = id_hashes(np.array(GOLDEN_STR_IDS, dtype=object))
    assert hashes.dtype == np.uint64
    assert hashes.tolist() == GOLDEN_STR_HASHES
    assert id_hashes(GOLDEN_STR_IDS).tolist() == GOLDEN_STR_HASHES  # a plain list of str


def test_golden_stable_hash() -> None:
    assert {text: stable_hash(text) for text in GOLDEN_STABLE_HASHES} == GOLDEN_STABLE_HASHES


def test_golden_mix64() -> None:
    x = np.array(list(GOLDEN_MIX64), dtype=np.uint64)
    assert mix64(x).tolist() == list(GOLDEN_MIX64.values())


def test_same_values_in_a_fresh_interpreter() -> None:
    """Python salts hash() per process; ours must not depend on the process at all."""
    got = fresh_json(
        f"""
        import json
        import numpy as np
        from lookup_table.core.hashing import id_hashes, stable_hash
        print(json.dumps({{
            "int": id_hashes(np.array({GOLDEN_INT_IDS!r}, dtype=np.int64)).tolist(),
            "str": id_hashes(np.array({GOLDEN_STR_IDS!r}, dtype=object)).tolist(),
            "stable": {{t: stable_hash(t) for t in {list(GOLDEN_STABLE_HASHES)!r}}},
        }}))
        """
    )
    assert got == {
        "int": GOLDEN_INT_HASHES,
        "str": GOLDEN_STR_HASHES,
        "stable": GOLDEN_STABLE_HASHES,
    }


def test_int_and_str_of_the_same_digits_hash_differently() -> None:
    as_int = id_hashes(np.array([7, 0, 123], dtype=np.int64))
    as_str = id_hashes(np.array(["7", "0", "123"], dtype=object))
    assert (as_int != as_str).all()


@given(int_ids)
def test_int_vs_str_never_collide_on_the_same_digits(value: int) -> None:
    a = id_hashes(np.array([value], dtype=np.int64))
    b = id_hashes(np.array([str(value)], dtype=object))
    assert a[0] != b[0]


@given(int_id_arrays())
def test_int_hashes_are_elementwise_and_injective(ids: np.ndarray) -> None:
    hashes = id_hashes(ids)
    assert hashes.shape == ids.shape
    # a batch hashes like its elements one by one (no dependence on the batch)
    assert hashes.tolist() == [int(id_hashes(ids[i : i + 1])[0]) for i in range(ids.shape[0])]
    # mix64 is a bijection, so distinct int ids never share a hash
    assert np.unique(hashes).shape == np.unique(ids).shape


@given(str_id_lists(max_size=8))
def test_str_hashes_are_elementwise(values: list[str]) -> None:
    hashes = id_hashes(np.array(values, dtype=object) if values else np.empty(0, object))
    assert hashes.shape == (len(values),)
    assert hashes.tolist() == [int(id_hashes([v])[0]) for v in values]


@given(arrays(np.uint64, 32))
def test_mix64_is_a_bijection_on_samples(x: np.ndarray) -> None:
    assert np.unique(mix64(x)).shape == np.unique(x).shape


def test_combine_salts_give_independent_families() -> None:
    h = id_hashes(np.arange(1000, dtype=np.int64))
    a, b = combine(h, 1), combine(h, 2)
    assert (a != b).all()
    assert combine(h, -1).tolist() == combine(h, 2**64 - 1).tolist()  # salt taken mod 2**64
    assert combine(h, 0).tolist() == mix64(h).tolist()


def test_no_overflow_warning_even_where_filterwarnings_is_error() -> None:
    ids = np.array([INT64_MAX, INT64_MIN, -1, 0], dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        id_hashes(ids)
        id_hashes(np.array(["x"], dtype=object))
        mix64(np.array([2**64 - 1], dtype=np.uint64))
        combine(np.array([2**64 - 1], dtype=np.uint64), 2**64 - 1)
        # numpy warns on *scalar* uint64 overflow; a 0-d input must not leak one
        assert int(mix64(np.array(1, dtype=np.uint64))) == GOLDEN_MIX64[1]
        assert int(mix64(np.uint64(2**64 - 1))) == GOLDEN_MIX64[2**64 - 1]


def test_empty_batches() -> None:
    assert id_hashes(np.empty(0, dtype=np.int64)).shape == (0,)
    assert id_hashes(np.empty(0, dtype=object)).shape == (0,)


def test_trailing_nul_changes_the_hash_for_lists_and_arrays() -> None:
    # numpy's fixed-width str dtype would strip the NUL and alias "a\x00" with "a"
    plain = id_hashes(np.array(["a"], dtype=object))
    assert id_hashes(["a\x00"]).tolist() != plain.tolist()
    assert id_hashes(np.array(["a\x00"], dtype=object)).tolist() == id_hashes(["a\x00"]).tolist()
