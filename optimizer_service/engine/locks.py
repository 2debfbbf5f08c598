"""Per-row mutual exclusion for a push's read-modify-write (in-process, by row hash)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

__all__ = ["LockSet", "RowLocks"]


class LockSet:
    """What one push locks: its rows, by placement hash (uint64 (n,), any order), and
    with `dense` the dense parameters (and the replica's version), held like one more
    row: a push that updates them holds it from its read to its write, and a failed
    write hands it to its replay.

    Numpy arrays, not Python sets: locking a push's rows is a few vectorized calls,
    not `tolist` and set arithmetic per row. Two lock sets are compared only while both are
    held or waited for, by binary search in the held one's sorted hashes (sorted once).
    """

    __slots__ = ("_sorted", "dense", "hashes")

    def __init__(self, hashes: NDArray[np.uint64], *, dense: bool = False) -> None:
        self.hashes = np.asarray(hashes, dtype=np.uint64).reshape(-1)
        self.dense = dense
        self._sorted: NDArray[np.uint64] | None = None

    def __len__(self) -> int:
        return int(self.hashes.size) + int(self.dense)

    def __repr__(self) -> str:
        return f"LockSet({self.hashes.size} rows{', dense' if self.dense else ''})"

    def sorted_hashes(self) -> NDArray[np.uint64]:
        if self._sorted is None:
            self._sorted = np.sort(self.hashes)
        return self._sorted

    def overlaps(self, other: LockSet) -> bool:
        """Whether the two share a row (or both hold the dense parameters)."""
        if self.dense and other.dense:
            return True
        small, big = (self, other) if self.hashes.size <= other.hashes.size else (other, self)
        if not small.hashes.size:
            return False
        table = big.sorted_hashes()
        at = np.searchsorted(table, small.hashes)
        at[at == table.size] = 0  # past the end: compared with the first, never equal there
        return bool((table[at] == small.hashes).any())


class RowLocks:
    """Per-row mutual exclusion for read-modify-write, by row hash.

    A push waits until none of its rows is held by another push, then takes all
    of them at once (no lock ordering, so no deadlock). Waiters are woken in
    arrival order. Two different rows with the same 64-bit hash would only
    serialize needlessly. Rows held by a failed write that is being retried
    (`fail`) are not waited for: `acquire` raises that write's error instead.
    """

    def __init__(self) -> None:
        self._held: list[LockSet] = []
        self._failed: list[tuple[LockSet, Callable[[], BaseException]]] = []
        self._changed = asyncio.Condition()

    @property
    def held(self) -> int:
        """How many rows (the dense parameters count as one) are held."""
        return sum(len(keys) for keys in self._held)

    def _blocker(self, keys: LockSet) -> Callable[[], BaseException] | None:
        return next((error for failed, error in self._failed if failed.overlaps(keys)), None)

    def _free(self, keys: LockSet) -> bool:
        return not any(held.overlaps(keys) for held in self._held)

    async def acquire(self, keys: LockSet) -> None:
        """Take `keys`; raises the error of a failed write that holds any of them."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._free(keys) or self._blocker(keys) is not None
            )
            blocker = self._blocker(keys)
            if blocker is not None:
                raise blocker()
            self._held.append(keys)

    async def fail(self, keys: LockSet, error: Callable[[], BaseException]) -> None:
        """Mark held `keys` as held by a failed write: whoever waits for them, now or
        later, raises `error()` until they are released."""
        async with self._changed:
            self._failed.append((keys, error))
            self._changed.notify_all()

    async def release(self, keys: LockSet) -> None:
        """Give back `keys` (the object `acquire` took)."""
        async with self._changed:
            self._held = [held for held in self._held if held is not keys]
            self._failed = [(f, e) for f, e in self._failed if f is not keys]
            self._changed.notify_all()
