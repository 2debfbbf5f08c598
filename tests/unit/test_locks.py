"""The replica's row locks (optimizer_service/engine/locks.py): overlap against Python sets,
and what waiting, failing and releasing do, on a real event loop (no servers)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer_service.engine.locks import LockSet, RowLocks

pytestmark = pytest.mark.unit

U64 = st.integers(0, 2**64 - 1)
# small values collide often; the extremes test the binary search's ends
HASHES = st.lists(st.integers(0, 40) | U64 | st.sampled_from([0, 2**64 - 1]), max_size=60)


def _locks(values: list[int], *, dense: bool = False) -> LockSet:
    return LockSet(np.array(values, dtype=np.uint64), dense=dense)


@settings(max_examples=300, deadline=None)
@given(a=HASHES, b=HASHES, dense_a=st.booleans(), dense_b=st.booleans())
def test_overlap_is_what_python_sets_say(
    a: list[int], b: list[int], dense_a: bool, dense_b: bool
) -> None:
    x, y = _locks(a, dense=dense_a), _locks(b, dense=dense_b)
    expected = bool(set(a) & set(b)) or (dense_a and dense_b)
    assert x.overlaps(y) is expected
    assert y.overlaps(x) is expected
    assert len(x) == len(a) + dense_a


async def test_disjoint_pushes_hold_at_once_and_an_overlapping_one_waits() -> None:
    locks = RowLocks()
    first, second = _locks([1, 2, 3]), _locks([4, 5], dense=True)
    await locks.acquire(first)
    await asyncio.wait_for(locks.acquire(second), timeout=1)  # disjoint: no wait
    assert locks.held == 3 + 2 + 1

    waiter = asyncio.ensure_future(locks.acquire(_locks([9, 3])))  # shares row 3
    dense_waiter = asyncio.ensure_future(locks.acquire(_locks([], dense=True)))
    await asyncio.sleep(0.05)
    assert not waiter.done() and not dense_waiter.done()

    await locks.release(first)
    await asyncio.wait_for(waiter, timeout=1)
    assert not dense_waiter.done()  # the dense parameters are still held by `second`
    await locks.release(second)
    await asyncio.wait_for(dense_waiter, timeout=1)
    assert locks.held == 2 + 1


async def test_a_failed_write_makes_waiters_raise_its_error_until_released() -> None:
    locks = RowLocks()
    held = _locks([7, 8])
    await locks.acquire(held)
    waiter = asyncio.ensure_future(locks.acquire(_locks([8])))
    await asyncio.sleep(0.05)
    assert not waiter.done()

    await locks.fail(held, lambda: RuntimeError("node a is full"))
    with pytest.raises(RuntimeError, match="node a is full"):
        await asyncio.wait_for(waiter, timeout=1)
    with pytest.raises(RuntimeError, match="node a is full"):  # later ones too, at once
        await asyncio.wait_for(locks.acquire(_locks([7, 100])), timeout=1)
    await asyncio.wait_for(locks.acquire(_locks([100])), timeout=1)  # not its rows: fine

    await locks.release(held)  # the replay finished: its rows are free, no error left
    await asyncio.wait_for(locks.acquire(_locks([7, 8])), timeout=1)
    assert locks.held == 1 + 2
