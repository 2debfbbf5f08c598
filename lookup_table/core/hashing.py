"""Stable, vectorized 64-bit hashing of ids (pure numpy + hashlib, no I/O).

Everything shared between processes (which node holds a row, which replica owns
it, the initial value of a row) is derived from these hashes, so they must be
the same in every process and on every machine: never Python's salted `hash()`.
Changing any constant here moves every row: it is a data migration, and the
golden values in `tests/unit/test_hashing.py` pin them.

* An int id hashes as `mix64(uint64(id) ^ INT_TAG)`.
* A str id hashes as the first 8 bytes (little-endian) of
  `blake2b(b"s" + utf8(id), digest_size=8)`, then `mix64`. The tag bytes keep
  the int 7 and the str "7" apart.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
from numba import njit
from numpy.typing import NDArray

__all__ = [
    "INT_TAG",
    "MIX64_M1",
    "MIX64_M2",
    "combine",
    "id_hashes",
    "id_words",
    "mix64",
    "mix64_one",
    "stable_hash",
]

# splitmix64's finalizer constants
MIX64_M1 = np.uint64(0xBF58476D1CE4E5B9)
MIX64_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
INT_TAG = np.uint64(0x6C6F6F6B75702D69)  # "lookup-i": an int id's tag (the str "7" is not 7)


def mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finalizer on an array: a bijective, well-avalanching uint64 mix.

    Only ever call it on arrays: numpy warns on *scalar* uint64 overflow, and
    wraps arrays silently, which is what the multiplication relies on.
    """
    z = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):  # a 0-d input turns into numpy scalars, which warn
        z = (z ^ (z >> _S30)) * MIX64_M1
        z = (z ^ (z >> _S27)) * MIX64_M2
    return z ^ (z >> _S31)


@njit(inline="always")
def mix64_one(z):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`mix64` of one uint64, for compiled loops (inlined where it is called; wraps as
    numpy's arrays do): the placement, the row cache's probes and the initializers'
    draws use the same finalizer."""
    z = (z ^ (z >> _S30)) * MIX64_M1
    z = (z ^ (z >> _S27)) * MIX64_M2
    return z ^ (z >> _S31)


@functools.lru_cache(maxsize=4096)
def stable_hash(text: str) -> int:
    """A process-independent 64-bit hash of a str (node names, table names, seeds)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def combine(hashes: NDArray[np.uint64], salt: int) -> NDArray[np.uint64]:
    """`mix64(hashes ^ salt)`: derive an independent hash family from a salt."""
    return mix64(np.asarray(hashes, dtype=np.uint64) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))


def id_hashes(ids: NDArray[np.int64] | NDArray[np.object_] | Sequence[str]) -> NDArray[np.uint64]:
    """Hash a batch of ids, shape (n,) -> uint64 (n,): `mix64(id_words(ids))`.

    Int ids are hashed fully vectorized; str ids need one blake2b call each
    (a str has no fixed-width representation to vectorize over).
    """
    return mix64(id_words(ids))


def id_words(ids: NDArray[np.int64] | NDArray[np.object_] | Sequence[str]) -> NDArray[np.uint64]:
    """What `id_hashes` mixes: an int id's bits ^ INT_TAG, a str id's blake2b word."""
    arr = np.asarray(ids)
    if arr.dtype == np.int64:
        words: NDArray[np.uint64] = arr.view(np.uint64) ^ INT_TAG
        return words
    # Not arr.tolist() for a list: numpy's str dtype strips trailing NULs ("a\x00" -> "a").
    values = arr.tolist() if isinstance(ids, np.ndarray) else list(ids)
    return np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(b"s" + s.encode("utf-8"), digest_size=8).digest(), "little"
            )
            for s in values
        ),
        dtype=np.uint64,
        count=len(values),
    )
