"""The service's malloc policy: large blocks reused from the heap, its free pages trimmed.

Each case that tunes glibc runs in a fresh interpreter (the thresholds are process-wide)
and watches glibc's own accounting (mallinfo2: `hblks`, the blocks mmapped on their own)
and the process's resident memory (/proc/self/statm).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from optimizer_service import malloc
from tests.unit._fresh import fresh_json


def _glibc_with_mallinfo2() -> bool:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return False
    major, _, minor = version.removeprefix("glibc ").partition(".")
    return version.startswith("glibc ") and (int(major), int(minor)) >= (2, 33)


glibc = pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
pytestmark = pytest.mark.unit

_PROBE = """
import ctypes, json, os
from optimizer_service.malloc import tune_malloc, trim

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def mmapped(size):
    before = libc.mallinfo2().hblks
    block = bytearray(size)
    return libc.mallinfo2().hblks - before, block
"""


@glibc
def test_blocks_up_to_32_mib_come_from_the_heap_and_stay_mapped_when_freed() -> None:
    result = fresh_json(
        _PROBE
        + """
tuned = tune_malloc()
out = {"tuned": tuned}
for name, size in (("read", 256 << 10), ("array", 3 << 20), ("body", 16 << 20)):
    n, block = mmapped(size)
    del block
    again, block = mmapped(size)  # the freed pages are reused, not faulted in again
    out[name] = [n, again]
out["huge"], _ = mmapped(64 << 20)
print(json.dumps(out))
"""
    )
    assert result == {
        "tuned": True,
        "read": [0, 0],
        "array": [0, 0],
        "body": [0, 0],
        "huge": 1,  # above the threshold: its own mapping, given back when freed
    }


@glibc
def test_a_push_sized_working_set_is_reused_without_page_faults() -> None:
    """~100 MB of blocks below the mmap threshold, freed and taken again (one push after
    another): free() must not give the heap's top back (a 64 MiB trim threshold did, and
    each dim-64 push of 16,384 Adam rows then faulted ~11,500 pages in again)."""
    result = fresh_json(
        _PROBE
        + """
import resource
assert tune_malloc()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [bytearray(10 << 20) for _ in range(10)]
del blocks
before = faults()
blocks = [bytearray(10 << 20) for _ in range(10)]  # bytearray zeroes: every page touched
print(json.dumps({"faults": faults() - before}))
"""
    )
    assert result["faults"] < 256, result  # not the 25,600 pages of 100 MB


@glibc
def test_glibcs_initial_threshold_mmaps_each_block_anew() -> None:
    """The control: untuned, a fresh process mmaps a 3 MiB array, and again after it
    was freed (glibc only raises its threshold once such a block is freed: then the
    next one comes from the heap, whose holes the tuned service trims)."""
    result = fresh_json(
        _PROBE
        + """
first, block = mmapped(3 << 20)
del block
second, block = mmapped(3 << 20)
print(json.dumps([first, second]))
"""
    )
    assert result == [1, 0]


@glibc
def test_trim_gives_back_the_free_pages_inside_the_heap() -> None:
    """Holes between blocks still in use: the heap's top cannot shrink over them, and
    the 1 GiB trim threshold keeps them mapped; `trim` gives their pages back."""
    result = fresh_json(
        _PROBE
        + """
assert tune_malloc()
blocks = [bytearray(1 << 20) for _ in range(64)]  # bytearray zeroes: every page touched
for i in range(0, 64, 2):
    blocks[i] = None  # 32 holes of 1 MiB between live blocks
held = rss()
trimmed = trim()
print(json.dumps({"trimmed": trimmed, "given_back": held - rss()}))
"""
    )
    assert result["trimmed"] is True
    assert result["given_back"] >= 28 << 20, result  # of the 32 MiB of holes


def test_thresholds_the_user_chose_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (
        ("MALLOC_MMAP_THRESHOLD_", "1048576"),
        ("MALLOC_TRIM_THRESHOLD_", "1048576"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=65536"),
    ):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert malloc.tune_malloc() is False, name


async def test_the_trimming_context_trims_while_the_app_runs_and_stops_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[float] = []
    monkeypatch.setattr(malloc, "TRIM_INTERVAL_S", 0.01)
    monkeypatch.setattr(malloc, "trim", lambda: calls.append(asyncio.get_running_loop().time()))
    context = malloc.trimming(object())
    await anext(context)
    await asyncio.sleep(0.2)
    running = len(calls)
    with pytest.raises(StopAsyncIteration):
        await anext(context)
    await asyncio.sleep(0.05)
    assert running >= 5
    assert len(calls) == running  # no trim after the app stopped
