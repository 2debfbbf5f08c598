"""Rendezvous placement (lookup_table.core.sharding): balance, minimal movement, stability."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookup_table.core.hashing import combine, id_hashes, mix64, stable_hash
from lookup_table.core.sharding import (
    assign,
    node_of,
    node_of_many,
    owner_of,
    row_hashes,
    row_hashes_many,
)
from tests.strategies import INT64_MAX, INT64_MIN, int_id_arrays, table_names
from tests.unit._fresh import fresh_json

pytestmark = pytest.mark.unit

N_IDS = 100_000


def _nodes(n: int) -> list[str]:
    return [f"10.0.0.{i}:11211" for i in range(1, n + 1)]


@pytest.fixture(scope="module")
def random_ids() -> np.ndarray:
    return np.random.default_rng(4).integers(INT64_MIN, INT64_MAX, size=N_IDS, dtype=np.int64)


@pytest.fixture(scope="module", params=["sequential", "random", "str"])
def many_ids(request: pytest.FixtureRequest, random_ids: np.ndarray) -> np.ndarray:
    if request.param == "sequential":
        return np.arange(N_IDS, dtype=np.int64)
    if request.param == "random":
        return random_ids
    out = np.empty(N_IDS, dtype=object)
    out[:] = [f"query {i}" for i in range(N_IDS)]
    return out


# ------------------------------------------------------------------ golden pins
# Which node holds a row is shared by every process and stored implicitly in the
# data's location: changing one of these is a data migration.

GOLDEN_NODES = ["10.0.0.1:11211", "10.0.0.2:11211", "10.0.0.3:11211", "10.0.0.4:11211"]
GOLDEN_INT_IDS = [0, 1, 7, 42, -1, INT64_MAX, INT64_MIN, 123456789]
GOLDEN_INT_NODE = [1, 3, 2, 0, 2, 3, 3, 3]
GOLDEN_STR_IDS = ["banana", "7", "", "a b/c"]
GOLDEN_STR_NODE = [1, 3, 3, 2]
GOLDEN_OWNER_OF_3 = [2, 2, 2, 2, 2, 1, 0, 1]


def test_golden_node_of_int_ids() -> None:
    ids = np.array(GOLDEN_INT_IDS, dtype=np.int64)
    placement = node_of("user", ids, GOLDEN_NODES)
    assert placement.dtype == np.intp
    assert placement.tolist() == GOLDEN_INT_NODE


def test_golden_node_of_str_ids() -> None:
    ids = np.array(GOLDEN_STR_IDS, dtype=object)
    assert node_of("word", ids, GOLDEN_NODES).tolist() == GOLDEN_STR_NODE


def test_golden_owner_of() -> None:
    ids = np.array(GOLDEN_INT_IDS, dtype=np.int64)
    assert owner_of("user", ids, 3).tolist() == GOLDEN_OWNER_OF_3


def test_assignment_identical_in_a_fresh_interpreter(random_ids: np.ndarray) -> None:
    got = fresh_json(
        f"""
        import json
        import numpy as np
        from lookup_table.core.sharding import node_of, owner_of
        ids = np.random.default_rng(4).integers(
            -2**63, 2**63 - 1, size={N_IDS}, dtype=np.int64)
        nodes = {GOLDEN_NODES!r}
        print(json.dumps({{
            "golden": node_of("user", np.array({GOLDEN_INT_IDS!r}, dtype=np.int64), nodes).tolist(),
            "words": node_of("word", np.array({GOLDEN_STR_IDS!r}, dtype=object), nodes).tolist(),
            "counts": np.bincount(node_of("user", ids, nodes), minlength=4).tolist(),
            "first": node_of("user", ids[:1000], nodes).tolist(),
            "owners": owner_of("user", ids[:1000], 3).tolist(),
        }}))
        """
    )
    assert got["golden"] == GOLDEN_INT_NODE
    assert got["words"] == GOLDEN_STR_NODE
    here = node_of("user", random_ids, GOLDEN_NODES)
    assert got["counts"] == np.bincount(here, minlength=4).tolist()
    assert got["first"] == here[:1000].tolist()
    assert got["owners"] == owner_of("user", random_ids[:1000], 3).tolist()


# ------------------------------------------------------------------ balance


@pytest.mark.parametrize("n_nodes", [2, 3, 5, 8, 16])
def test_balanced_within_5_percent(many_ids: np.ndarray, n_nodes: int) -> None:
    counts = np.bincount(node_of("user", many_ids, _nodes(n_nodes)), minlength=n_nodes)
    share = counts / (N_IDS / n_nodes)
    assert counts.sum() == N_IDS
    assert (np.abs(share - 1.0) <= 0.05).all(), share.round(3).tolist()


@pytest.mark.parametrize("n_replicas", [2, 3, 7])
def test_owners_balanced_within_5_percent(random_ids: np.ndarray, n_replicas: int) -> None:
    counts = np.bincount(owner_of("ads", random_ids, n_replicas), minlength=n_replicas)
    share = counts / (N_IDS / n_replicas)
    assert (np.abs(share - 1.0) <= 0.05).all(), share.round(3).tolist()


# ------------------------------------------------------------------ movement


@pytest.mark.parametrize("n_nodes", [1, 2, 3, 4, 7])
def test_adding_a_node_moves_about_one_over_n_plus_one(many_ids: np.ndarray, n_nodes: int) -> None:
    old_nodes = _nodes(n_nodes)
    new_nodes = [*old_nodes, "10.0.1.99:11211"]
    before = node_of("user", many_ids, old_nodes)
    after = node_of("user", many_ids, new_nodes)
    moved = before != after
    # only to the new node, never between two old nodes
    assert (after[moved] == n_nodes).all()
    assert moved.mean() == pytest.approx(1 / (n_nodes + 1), abs=0.02)


@pytest.mark.parametrize("position", [0, 2, 4])
def test_inserting_a_node_anywhere_in_the_list_moves_the_same_rows(
    random_ids: np.ndarray, position: int
) -> None:
    old_nodes = _nodes(4)
    new_nodes = [*old_nodes]
    new_nodes.insert(position, "10.0.1.99:11211")
    before = np.array(old_nodes)[node_of("user", random_ids, old_nodes)]
    after = np.array(new_nodes)[node_of("user", random_ids, new_nodes)]
    moved = before != after
    assert (after[moved] == "10.0.1.99:11211").all()
    assert moved.mean() == pytest.approx(1 / 5, abs=0.02)


@pytest.mark.parametrize("removed", [0, 2, 4])
def test_removing_a_node_moves_only_its_rows(many_ids: np.ndarray, removed: int) -> None:
    old_nodes = _nodes(5)
    new_nodes = [a for i, a in enumerate(old_nodes) if i != removed]
    before = np.array(old_nodes)[node_of("user", many_ids, old_nodes)]
    after = np.array(new_nodes)[node_of("user", many_ids, new_nodes)]
    moved = before != after
    assert (before[moved] == old_nodes[removed]).all()
    assert moved.sum() == (before == old_nodes[removed]).sum()  # all of its rows moved
    assert moved.mean() == pytest.approx(1 / 5, abs=0.02)


def test_node_order_does_not_matter(random_ids: np.ndarray) -> None:
    nodes = _nodes(6)
    shuffled = [nodes[i] for i in (3, 0, 5, 1, 4, 2)]
    a = np.array(nodes)[node_of("user", random_ids, nodes)]
    b = np.array(shuffled)[node_of("user", random_ids, shuffled)]
    assert (a == b).all()


# ------------------------------------------------------------------ independence


def test_owner_of_is_independent_of_node_placement(random_ids: np.ndarray) -> None:
    nodes = node_of("user", random_ids, _nodes(3))
    owners = owner_of("user", random_ids, 3)
    # independent families: each (node, owner) pair gets ~1/9 of the rows
    joint = np.bincount(nodes * 3 + owners, minlength=9) / N_IDS
    assert np.abs(joint - 1 / 9).max() < 0.01, joint.round(3).tolist()
    assert (nodes == owners).mean() == pytest.approx(1 / 3, abs=0.01)


def test_owner_of_ignores_node_addresses(random_ids: np.ndarray) -> None:
    ids = random_ids[:5000]
    owners = owner_of("user", ids, 4)
    node_of("user", ids, ["other:1", "other:2"])  # no hidden state between the two
    assert (owner_of("user", ids, 4) == owners).all()


def test_tables_are_placed_independently(random_ids: np.ndarray) -> None:
    nodes = _nodes(4)
    a = node_of("user", random_ids, nodes)
    b = node_of("item", random_ids, nodes)
    assert (a == b).mean() == pytest.approx(1 / 4, abs=0.01)


def test_int_and_str_ids_placed_independently() -> None:
    ints = np.arange(20_000, dtype=np.int64)
    strs = np.empty(20_000, dtype=object)
    strs[:] = [str(i) for i in range(20_000)]
    assert (row_hashes("t", ints) != row_hashes("t", strs)).all()
    nodes = _nodes(4)
    same = node_of("t", ints, nodes) == node_of("t", strs, nodes)
    assert same.mean() == pytest.approx(1 / 4, abs=0.02)


@given(int_id_arrays(), table_names, st.integers(1, 9))
def test_placement_is_per_id_whatever_the_batch(ids: np.ndarray, table: str, n: int) -> None:
    nodes = _nodes(n)
    placement = node_of(table, ids, nodes)
    assert placement.shape == ids.shape
    assert ((placement >= 0) & (placement < n)).all()
    reversed_batch = node_of(table, ids[::-1].copy(), nodes)[::-1]
    assert (placement == reversed_batch).all()
    if ids.size:
        assert node_of(table, ids[:1], nodes)[0] == placement[0]


def test_single_node_and_empty_batches() -> None:
    assert node_of("t", np.array([1, 2, 3], dtype=np.int64), ["a:1"]).tolist() == [0, 0, 0]
    assert owner_of("t", np.array([1, 2], dtype=np.int64), 1).tolist() == [0, 0]
    empty = node_of("t", np.empty(0, dtype=np.int64), _nodes(3))
    assert empty.shape == (0,)


# ------------------------------------------------------------------ assign


def test_assign_rejects_empty_members() -> None:
    with pytest.raises(ValueError, match="empty"):
        assign(id_hashes(np.array([1], dtype=np.int64)), [], seed=0)
    with pytest.raises(ValueError, match="empty"):
        node_of("t", np.array([1], dtype=np.int64), [])
    with pytest.raises(ValueError, match="empty"):
        owner_of("t", np.array([1], dtype=np.int64), 0)


def test_assign_rejects_duplicate_members() -> None:
    with pytest.raises(ValueError, match="twice.*'a'"):
        assign(id_hashes(np.array([1], dtype=np.int64)), ["a", "b", "a"], seed=0)
    with pytest.raises(ValueError, match="twice"):
        node_of("t", np.array([1], dtype=np.int64), ["h:1", "h:1"])


def test_assign_seed_changes_the_family() -> None:
    h = id_hashes(np.arange(10_000, dtype=np.int64))
    members = ["a", "b", "c", "d"]
    same = assign(h, members, seed=1) == assign(h, members, seed=2)
    assert same.mean() == pytest.approx(1 / 4, abs=0.03)


@given(
    st.lists(st.tuples(table_names, int_id_arrays(max_size=30)), max_size=6),
    st.integers(min_value=1, max_value=5),
)
def test_node_of_many_is_node_of_per_table(parts: list[tuple[str, np.ndarray]], n: int) -> None:
    nodes = [f"10.0.0.{i}:11211" for i in range(n)]
    tables = [t for t, _ in parts]
    arrays = [ids for _, ids in parts]
    expected = [node_of(t, ids, nodes) for t, ids in parts]
    got = node_of_many(tables, arrays, nodes) if parts else np.zeros(0, dtype=np.intp)
    np.testing.assert_array_equal(
        got, np.concatenate(expected) if expected else np.zeros(0, dtype=np.intp)
    )


@given(
    st.lists(
        st.tuples(
            table_names,
            st.one_of(
                int_id_arrays(max_size=30),
                st.lists(st.text(max_size=8), max_size=5).map(
                    lambda xs: np.array(xs, dtype=object)
                ),
            ),
        ),
        max_size=6,
    )
)
def test_row_hashes_many_is_row_hashes_per_table(parts: list[tuple[str, np.ndarray]]) -> None:
    """Int tables in one pass, or any mix with str tables: the same hashes, concatenated."""
    got = row_hashes_many([t for t, _ in parts], [ids for _, ids in parts])
    expected = [row_hashes(t, ids) for t, ids in parts]
    assert got.dtype == np.uint64
    np.testing.assert_array_equal(
        got, np.concatenate(expected) if expected else np.zeros(0, dtype=np.uint64)
    )


def _placement_in_numpy(table: str, ids: object, members: list[str], seed: int) -> np.ndarray:
    """The placement as it was written in numpy before it was compiled (the definition:
    `argmax_j mix64(combine(id_hashes(ids), table salt) ^ salt_j)`, first j of a tie)."""
    hashes = combine(id_hashes(ids), stable_hash("table:" + table))
    salts = np.array(
        [(stable_hash(m) ^ seed) & 0xFFFFFFFFFFFFFFFF for m in members], dtype=np.uint64
    )
    return mix64(hashes[:, None] ^ salts[None, :]).argmax(axis=1)


@given(
    table=table_names,
    ints=int_id_arrays(max_size=40),
    strs=st.lists(st.text(max_size=12), max_size=20),
    k=st.integers(1, 9),
    seed=st.integers(0, 2**64 - 1),
)
def test_compiled_placement_is_the_numpy_definition_bit_for_bit(
    table: str, ints: np.ndarray, strs: list[str], k: int, seed: int
) -> None:
    members = [f"node:10.0.0.{i}:11211" for i in range(k)]
    for ids in (ints, strs, ints[::-2]):  # a strided view too
        salt = stable_hash("table:" + table)
        expected = combine(id_hashes(ids), salt)
        np.testing.assert_array_equal(row_hashes(table, ids), expected)
        np.testing.assert_array_equal(
            assign(expected, members, seed=seed), _placement_in_numpy(table, ids, members, seed)
        )
    if ints.size:
        many = row_hashes_many([table, table + "x"], [ints, ints[::-1].copy()])
        np.testing.assert_array_equal(
            many,
            np.concatenate(
                [combine(id_hashes(ints), salt), row_hashes(table + "x", ints[::-1].copy())]
            ),
        )


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_small_batches_of_str_ids_are_placed_as_big_ones(nodes: int) -> None:
    """`Placement` remembers the bodies and nodes of str ids placed a few at a time (the
    bookkeeping keys every push writes): placed again, remembered or not, forgotten
    once the memo is full, they get the bodies and nodes of the vectorized path, and each
    node's positions ascending."""
    from lookup_table.core.keys import as_ids, id_bodies
    from lookup_table.core.keyspace import META_TABLE
    from lookup_table.store import placement as placement_module
    from lookup_table.store.placement import Placement
    from tests.conftest import make_config

    config = make_config(_nodes(nodes))
    placement = Placement(config)
    words = [f"p/r0:w1-{i}" for i in range(3 * placement_module._MEMO_IDS)]
    batches = [words[i : i + 1 + i % 8] for i in range(0, len(words), 5)]
    # each batch twice in a row (the second time from the memo), the first ones again
    # after the memo was forgotten
    twice = [batch for batch in batches for _ in range(2)]
    for batch in [*twice, *batches[:50], ["é", "a b"], ["é", "a b"], []]:
        ids = as_ids(batch, table=META_TABLE)
        (placed,) = placement.place_many([(META_TABLE, ids)])
        assert list(placed.bodies.bodies) == list(id_bodies(META_TABLE, ids).bodies)
        where = node_of(META_TABLE, ids, config.node_addresses)
        for j, positions in enumerate(placed.by_node):
            assert positions.tolist() == np.flatnonzero(where == j).tolist()
    assert len(placement._memo) <= placement_module._MEMO_IDS + 8
