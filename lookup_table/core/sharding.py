"""Rendezvous (highest-random-weight) placement of rows on nodes and replicas (pure).

A row's node is the argmax over nodes of a mix of its id hash with the node's salt,
computed for a whole batch as one uint64 array; replicas own rows the same way with
another seed. Why this moves the fewest rows: docs/wire-format.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.hashing import id_words, mix64_one, stable_hash
from lookup_table.core.jit import compiled
from lookup_table.core.keys import IdArray

__all__ = ["assign", "node_of", "node_of_many", "owner_of", "row_hashes", "row_hashes_many"]

_NODE_SEED = stable_hash("lookup-table/node")
_REPLICA_SEED = stable_hash("lookup-table/replica")


def _table_salt(table: str) -> int:
    return stable_hash("table:" + table)


def row_hashes(table: str, ids: IdArray) -> NDArray[np.uint64]:
    """Placement hash of each row of `table`, uint64 (n,)."""
    salt = np.full(1, _table_salt(table) & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
    hashes: NDArray[np.uint64] = _salted(np.ascontiguousarray(id_words(ids)).reshape(-1), salt)
    return hashes


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
        hashes: NDArray[np.uint64] = _salted(id_words(every), np.repeat(salts, sizes))
        return hashes
    return np.concatenate([row_hashes(t, a) for t, a in zip(tables, ids, strict=True)])


_U64 = types.Array(types.uint64, 1, "C")
_RU64 = types.Array(types.uint64, 1, "C", readonly=True)
_WINNERS = types.Array(types.intp, 1, "C")


@compiled([_U64(_U64, _U64), _U64(_RU64, _U64)])
def _salted(words, salts):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`combine(id_hashes(ids), salt)` in one pass: `mix64(mix64(words[i]) ^ salt)` of
    each id's `hashing.id_words`, with salts[i] for id i (or salts[0] for all)."""
    n = words.shape[0]
    out = np.empty(n, dtype=np.uint64)
    one = salts.shape[0] == 1
    for i in range(n):
        salt = salts[0] if one else salts[i]
        out[i] = mix64_one(mix64_one(words[i]) ^ salt)
    return out


@compiled([_WINNERS(_U64, _RU64), _WINNERS(_RU64, _RU64)])
def _rendezvous(hashes, salts):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`argmax_j mix64(hashes[i] ^ salts[j])` for every i (the first j of the highest
    score, as numpy's argmax): one pass, no (n, k) array of scores."""
    n = hashes.shape[0]
    out = np.empty(n, dtype=np.intp)
    for i in range(n):
        h = hashes[i]
        best = 0
        top = mix64_one(h ^ salts[0])
        for j in range(1, salts.shape[0]):
            score = mix64_one(h ^ salts[j])
            if score > top:
                top = score
                best = j
        out[i] = best
    return out


def assign(hashes: NDArray[np.uint64], members: Sequence[str], *, seed: int) -> NDArray[np.intp]:
    """Index into `members` of the winner for each hash, intp (n,).

    Raises:
        ValueError: no members, or the same member twice.
    """
    salts = _salts(tuple(members), seed)
    if salts.shape[0] == 1:
        return np.zeros(hashes.shape[0], dtype=np.intp)
    winners: NDArray[np.intp] = _rendezvous(np.ascontiguousarray(hashes, dtype=np.uint64), salts)
    return winners


@functools.lru_cache(maxsize=256)
def _salts(members: tuple[str, ...], seed: int) -> NDArray[np.uint64]:
    """Each member's salt (read-only; a member list is checked once)."""
    if not members:
        raise ValueError("cannot place rows on an empty list")
    if len(set(members)) != len(members):
        raise ValueError(f"the same member appears twice in {list(members)}")
    salts = np.array(
        [(stable_hash(m) ^ seed) & 0xFFFFFFFFFFFFFFFF for m in members], dtype=np.uint64
    )
    salts.setflags(write=False)
    return salts


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
