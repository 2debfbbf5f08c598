"""glibc's malloc for the service: large blocks reused from the heap, its free pages trimmed.

`tune_malloc` fixes the mmap threshold at 32 MiB and the trim threshold at 1 GiB, so a
push's blocks stay mapped for the next push instead of being page-faulted in again; the
service calls `trim` (`malloc_trim(0)`) every `TRIM_INTERVAL_S` seconds to give back the
holes those blocks leave in the heap. Why these values: docs/guarantees.md.
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
