"""A batch lookup's rows (lookup_table.keras.rows.lookup_batch) against real memcached
and a real replica (int64 tables are read through their owner, string ones from
memcached): one array per dim, each entry's rows in its place, skipped rows zero, known rows put in;
the graph step's tables are those arrays when its layers are the entries."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from lookup_table import EmbeddingStore
from lookup_table.client import OptimizerClient, RowReader
from lookup_table.keras.layer import DistributedEmbedding
from lookup_table.keras.rows import BatchRows, FedIds, FedLayer, PartialRows, lookup_batch
from lookup_table.keras.steps import FedBatch
from tests.conftest import serve_replicas

pytestmark = pytest.mark.integration

USERS_A = np.array([3, 9, 40, 77], np.int64)
USERS_B = np.array([9, 11, 77], np.int64)
ITEMS = np.array([1, 2, 5, 8, 13], np.int64)
WORDS = np.array(["ant", "bee"], dtype=object)


@pytest.fixture
async def reader(memcached_nodes: list[str], aiohttp_server: Any) -> AsyncIterator[RowReader]:
    config, _ = await serve_replicas(memcached_nodes, aiohttp_server, count=1)
    async with EmbeddingStore(config) as store, OptimizerClient(config) as client:
        yield RowReader(store, client)


async def _read(reader: RowReader, table: str, ids: np.ndarray) -> np.ndarray:
    return await reader.lookup(table, ids, create=False)


async def test_rows_land_in_one_array_per_dim(reader: RowReader) -> None:
    skip = np.array([False, True, False, False, True])  # left to a push's answer
    known_at = np.array([False, True, False])  # USERS_B[1] came with an earlier answer
    known_rows = np.full((1, 8), 7.5, np.float32)
    empty = np.zeros(0, np.int64)
    got = await lookup_batch(
        reader,
        [
            ("user", USERS_A, None),
            ("ads", ITEMS, skip),
            ("user", USERS_B, None),
            ("word", WORDS, None),
            ("user", empty, None),
        ],
        [None, None, (known_at, known_rows), None, None],
    )
    assert isinstance(got, BatchRows) and len(got) == 5
    assert sorted(got.tables) == [4, 8, 16]
    assert got.tables[8].shape == (4 + 3 + 1, 8)  # two entries, then the zero row
    assert got.starts == [0, 0, 4, 0, 7] and got.counts == [4, 5, 3, 2, 0]
    for table in got.tables.values():
        assert table.dtype == np.float32 and not table[-1].any()
    users_a, users_b = await _read(reader, "user", USERS_A), await _read(reader, "user", USERS_B)
    assert np.array_equal(got[0], users_a) and np.array_equal(got.tables[8][:4], users_a)
    want_b = users_b.copy()
    want_b[1] = 7.5
    assert np.array_equal(got[2], want_b) and np.array_equal(got.tables[8][4:7], want_b)
    assert np.array_equal(got[3], await _read(reader, "word", WORDS))
    assert got[4].shape == (0, 8)
    items = got[1]
    assert isinstance(items, PartialRows) and np.array_equal(items.skipped, skip)
    assert not items.rows[skip].any()
    kept = await _read(reader, "ads", ITEMS[~skip])
    assert np.array_equal(items.rows[~skip], kept)


async def test_each_table_once_lands_as_when_tables_repeat(reader: RowReader) -> None:
    """Entries of distinct tables (each table's rows read are one entry's, placed per dim
    at once) land as entry by entry: read rows, known rows, skipped rows zero, and an
    entry whose every id is known or skipped reads nothing."""
    skip = np.array([False, True, False, False, True])
    known_items = (np.array([True, False, False, False, False]), np.full((1, 16), 2.5, np.float32))
    all_known = (np.ones(4, bool), np.arange(32, dtype=np.float32).reshape(4, 8))
    cases = [
        ([("user", USERS_A, None), ("word", WORDS, None)], [None, None]),
        ([("user", USERS_A, None), ("ads", ITEMS, skip)], [all_known, known_items]),
        (
            [("ads", ITEMS, skip), ("user", USERS_B, None)],
            [None, (np.array([0, 1, 0], bool), all_known[1][:1])],
        ),
    ]
    for wanted, known in cases:
        got = await lookup_batch(reader, wanted, known)
        for k, ((table, ids, skipped), know) in enumerate(zip(wanted, known, strict=True)):
            want = await _read(reader, table, ids)
            if know is not None:
                want[know[0]] = know[1]
            if skipped is not None:
                want[skipped] = 0.0
            entry = got[k]
            rows = entry.rows if isinstance(entry, PartialRows) else entry
            assert rows.tobytes() == want.astype(np.float32).tobytes(), (table, k)
        for table in got.tables.values():
            assert not table[-1].any()


async def test_the_graph_step_takes_the_lookups_arrays(reader: RowReader) -> None:
    """`FedBatch` of the batch's own layers puts the push answers into the lookup's
    arrays and feeds them as they are; the same rows given per layer give the same
    arguments."""
    layers = [
        DistributedEmbedding("user", dim=8, name="a"),
        DistributedEmbedding("ads", dim=16, name="b"),
        DistributedEmbedding("user", dim=8, name="c"),
    ]
    fed = [FedLayer(layer=layer, key=f"k{i}") for i, layer in enumerate(layers)]
    uniq = [USERS_A, ITEMS, USERS_B]
    ids = [FedIds(uniq=u, index=np.arange(u.shape[0], dtype=np.int64)) for u in uniq]
    got = await lookup_batch(
        reader, [(layer.table, u, None) for layer, u in zip(layers, uniq, strict=True)]
    )
    answer = {"user": (np.array([9], np.int64), np.full((1, 8), -2.0, np.float32))}
    per_layer = FedBatch(fed, ids, [np.array(got[k]) for k in range(3)], patches=[answer])
    whole = FedBatch(fed, ids, got, patches=[answer])
    assert got.tables[8][1].tolist() == [-2.0] * 8  # patched in place: no copy made
    assert got.tables[8][4].tolist() == [-2.0] * 8
    for a, b in zip(whole.args[0], per_layer.args[0], strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
    for a, b in zip(whole.args[1:], per_layer.args[1:], strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
    assert whole.offsets == per_layer.offsets == [0, 0, 4]
    with pytest.raises(RuntimeError, match="not the fed layers"):  # entries of other layers
        FedBatch(fed[::-1], ids[::-1], got)
