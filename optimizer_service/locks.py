"""Per-row mutual exclusion for a push's read-modify-write (in-process, by row hash)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager

__all__ = ["DENSE_KEY", "RowLocks"]

DENSE_KEY = -1
"""The lock key of the dense parameters (and of the replica's version), held like one
more row: a push that updates them holds it from its read to its write, and a failed
write hands it to its replay. Row keys are uint64 hashes, never negative."""


class RowLocks:
    """Per-row mutual exclusion for read-modify-write, by row hash.

    A push waits until none of its rows is held by another push, then takes all
    of them at once (no lock ordering, so no deadlock). Waiters are woken in
    arrival order. Two different rows with the same 64-bit hash would only
    serialize needlessly. Rows held by a failed write that is being retried
    (`fail`) are not waited for: `acquire` raises that write's error instead.
    """

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._failed: dict[int, Callable[[], BaseException]] = {}
        self._changed = asyncio.Condition()

    @property
    def held(self) -> int:
        return len(self._held)

    def _blocker(self, keys: set[int]) -> Callable[[], BaseException] | None:
        if not self._failed:
            return None
        return next((self._failed[k] for k in keys if k in self._failed), None)

    async def acquire(self, keys: set[int]) -> None:
        """Take `keys`; raises the error of a failed write that holds any of them."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._held.isdisjoint(keys) or self._blocker(keys) is not None
            )
            blocker = self._blocker(keys)
            if blocker is not None:
                raise blocker()
            self._held |= keys

    async def fail(self, keys: set[int], error: Callable[[], BaseException]) -> None:
        """Mark held `keys` as held by a failed write: whoever waits for them, now or
        later, raises `error()` until they are released."""
        async with self._changed:
            self._failed.update(dict.fromkeys(keys, error))
            self._changed.notify_all()

    async def release(self, keys: set[int]) -> None:
        async with self._changed:
            self._held -= keys
            if self._failed:
                for k in keys:
                    self._failed.pop(k, None)
            self._changed.notify_all()

    @asynccontextmanager
    async def hold(self, keys: Iterable[int]) -> AsyncIterator[None]:
        wanted = set(keys)
        await self.acquire(wanted)
        try:
            yield
        finally:
            await self.release(wanted)
