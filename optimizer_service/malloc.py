"""glibc's malloc for the service: large blocks reused from the heap, its free pages trimmed.

Two costs pull against each other:

* Speed. A block that glibc mmaps (a numpy array, a request body, a socket read) goes
  back to the OS when freed, and the next one is page-faulted in again, every page
  zeroed by the kernel. With glibc's initial mmap threshold of 128 KiB kept fixed, a
  push of 16,384 Adam rows spent about 30 ms of its 85 ms in page faults
  (`benchmarks/optimizer.py`), and the demo's replica 8-10 ms of system time in every
  42 ms step of CPU.
* Memory. glibc's own policy raises the threshold to the size of each large block freed
  (up to 32 MiB), so those blocks then come from the heap. Blocks of ever different sizes
  leave holes there that later ones do not fit: the service's RSS grew ~600 bytes per
  push without bound in the soak (`tests/reliability/test_soak.py`).

`tune_malloc` fixes the mmap threshold at 32 MiB and the trim threshold at 1 GiB, so
the blocks of a push come from the heap and stay mapped for the next push; the service
then calls `trim` (`malloc_trim(0)`) every `TRIM_INTERVAL_S` seconds, which gives back
every free page of every arena, holes included. The RSS so stays at what is in use plus
what the last half minute left free, and a push pays no page faults but for the pages a
trim gave back. (With the trim threshold at 64 MiB, what glibc pairs with a 32 MiB mmap
threshold, a push of 16,384 dim-64 Adam rows, ~60 MB of blocks, left more than that
free at the heap's top: free() gave it back and the next push faulted it in again,
~11,500 minor faults and 86 -> 108 ms a push.)

Each trim gives back the pushes' working set too (their temporaries, freed between
pushes), and the pushes after it fault it in again: at the demo's shape 106-179 minor
faults (~0.4-0.7 MB of pages zeroed again, 0.5-0.9 ms of system time) after each trim.
A trim every 2 s would pay that every few pushes; every 30 s it is one burst per ~900
pushes. The holes that trims are for grow ~600 bytes a push (docs/guarantees.md):
~0.5 MB in 30 s; the 2-minute soak's RSS grew 0.2 % after warm-up.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "TRIM_INTERVAL_S",
    "TRIM_THRESHOLD_BYTES",
    "trim",
    "trimming",
    "tune_malloc",
]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt(3) parameter numbers in glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's own upper bound for its dynamic threshold
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # free() never trims: `trim` does, every 30 s
TRIM_INTERVAL_S = 30.0

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = ("mmap_threshold", "trim_threshold")


@functools.cache
def _glibc() -> Any | None:
    """The C library this process runs on, when it is glibc (looked up once)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, OSError, ValueError):  # not glibc (musl, macOS, Windows)
        return None


def tune_malloc() -> bool:
    """Fix glibc's mmap threshold at 32 MiB and its trim threshold at 1 GiB, for the
    whole life of the process (setting them turns glibc's raising of both off).

    Returns whether they were set: not on another libc, nor when the user chose either
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES); `trim` is then
    the user's business too.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(os.environ.get(name) for name in _USER_SETTINGS) or any(
        name in tunables for name in _USER_TUNABLES
    ):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def trim() -> bool:
    """Give every free page of every arena back to the OS (`malloc_trim(0)`); returns
    whether any was given back (False on another libc)."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


async def trimming(_app: object) -> AsyncIterator[None]:
    """An aiohttp cleanup context: `trim` every `TRIM_INTERVAL_S` seconds while the app
    runs (a trim takes about a millisecond)."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(TRIM_INTERVAL_S)
            trim()

    task = asyncio.get_running_loop().create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
