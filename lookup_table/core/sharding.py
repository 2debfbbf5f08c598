"""Rendezvous (highest-random-weight) placement of rows on nodes and replicas (pure).

A row's node is `argmax_j mix64(h ^ salt_j)` where `h` is the row's id hash salted
with its table (`hashing.id_hashes`, so `7` and `"7"` differ) and `salt_j` is
`stable_hash("node:" + address_j)`. Scores for the (n ids x k nodes) pairs are
computed as one uint64 array and reduced with `argmax(axis=1)`: no Python loop
per id. Because a node's salt depends only on its own address, adding a node
moves only the rows it now wins (about 1/(k+1) of them) and removing one moves
only its own rows; no row moves between two nodes that stayed.

Rows and slots of one id land on the same node (the hash ignores the kind), so
the optimizer reads both in one pipelined round trip per node.

The optimizer replica that owns a row is chosen the same way over the replica
partition numbers, with a different seed, so replica ownership and node placement
are independent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.hashing import combine, id_hashes, mix64, stable_hash
from lookup_table.core.keys import IdArray

__all__ = ["assign", "node_of", "node_of_many", "owner_of", "row_hashes", "row_hashes_many"]

_NODE_SEED = stable_hash("lookup-table/node")
_REPLICA_SEED = stable_hash("lookup-table/replica")


def _table_salt(table: str) -> int:
    return stable_hash("table:" + table)


def row_hashes(table: str, ids: IdArray) -> NDArray[np.uint64]:
    """Placement hash of each row of `table`, uint64 (n,)."""
    return combine(id_hashes(ids), _table_salt(table))


def row_hashes_many(tables: Sequence[str], ids: Sequence[IdArray]) -> NDArray[np.uint64]:
    """`row_hashes` of several tables' ids, concatenated.

    The int64 ids of every table in one pass of numpy operations (each id salted with its
    own table), where one `row_hashes` per table costs the same dozen operations per
    table; str ids table by table.
    """
    if not ids:
        return np.empty(0, dtype=np.uint64)
    if all(a.dtype == np.int64 for a in ids):
        sizes = [a.shape[0] for a in ids]
        salts = np.array([_table_salt(t) for t in tables], dtype=np.uint64)
        # combine's mix64(h ^ salt), one salt per id
        every = cast("NDArray[np.int64]", np.concatenate(ids))
        return mix64(id_hashes(every) ^ np.repeat(salts, sizes))
    return np.concatenate([row_hashes(t, a) for t, a in zip(tables, ids, strict=True)])


def assign(hashes: NDArray[np.uint64], members: Sequence[str], *, seed: int) -> NDArray[np.intp]:
    """Index into `members` of the winner for each hash, intp (n,).

    Raises:
        ValueError: no members, or the same member twice.
    """
    if not members:
        raise ValueError("cannot place rows on an empty list")
    if len(set(members)) != len(members):
        raise ValueError(f"the same member appears twice in {list(members)}")
    n = hashes.shape[0]
    if len(members) == 1:
        return np.zeros(n, dtype=np.intp)
    salts = np.array(
        [(stable_hash(m) ^ seed) & 0xFFFFFFFFFFFFFFFF for m in members], dtype=np.uint64
    )
    scores = mix64(np.asarray(hashes, dtype=np.uint64)[:, None] ^ salts[None, :])
    winners: NDArray[np.intp] = scores.argmax(axis=1)  # numpy types argmax(axis=...) as Any
    return winners


def _node_members(nodes: Sequence[str]) -> list[str]:
    return [f"node:{a}" for a in nodes]


def node_of(table: str, ids: IdArray, nodes: Sequence[str]) -> NDArray[np.intp]:
    """Index of the memcached node holding each row of `table`, intp (n,)."""
    return assign(row_hashes(table, ids), _node_members(nodes), seed=_NODE_SEED)


def node_of_many(
    tables: Sequence[str], ids: Sequence[NDArray[np.int64]], nodes: Sequence[str]
) -> NDArray[np.intp]:
    """`node_of` of several tables' int64 ids at once: the placements, concatenated.

    One pass of numpy operations for all of them (each id salted with its own table),
    where one `node_of` per table costs the same dozen operations per table.
    """
    return assign(row_hashes_many(tables, ids), _node_members(nodes), seed=_NODE_SEED)


def owner_of(table: str, ids: IdArray, num_replicas: int) -> NDArray[np.intp]:
    """Index (partition number) of the optimizer replica owning each row, intp (n,).

    Replicas are named by their position in `optimizers`, not their URL, so a
    replica can move to another host without moving its partition.
    """
    members = [f"replica:{k}" for k in range(num_replicas)]
    return assign(row_hashes(table, ids), members, seed=_REPLICA_SEED)
