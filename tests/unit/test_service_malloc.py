"""The service pins glibc's mmap threshold, so its heap does not fragment over a long run.

Each case runs in a fresh interpreter (the threshold is process-wide) and watches glibc's
own accounting (mallinfo2): after a large block was freed, do 256 KiB blocks (asyncio's
socket reads) still get their own mmap (which goes back to the OS when freed), or does
the heap grow for them (arena, the bytes the heap took from the OS)?
"""

from __future__ import annotations

import os

import pytest

from tests.unit._fresh import fresh_json


def _glibc_with_mallinfo2() -> bool:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return False
    major, _, minor = version.removeprefix("glibc ").partition(".")
    return version.startswith("glibc ") and (int(major), int(minor)) >= (2, 33)


pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)"),
]

_PROBE = """
import ctypes, json
from optimizer_service.malloc import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
pinned = pin_mmap_threshold() if PIN else None
big = bytearray(8 << 20)   # mmapped; freeing it makes glibc raise its threshold to 8 MiB
del big
before = libc.mallinfo2().arena
reads = [bytearray(256 << 10) for _ in range(8)]
print(json.dumps({"pinned": pinned, "heap_growth": libc.mallinfo2().arena - before}))
"""


def test_large_blocks_stay_mmapped_after_a_big_free() -> None:
    result = fresh_json("PIN = True\n" + _PROBE)
    assert result["pinned"] is True
    assert result["heap_growth"] == 0, result  # they were mmapped (or fit in free heap)


def test_without_the_pin_glibc_moves_them_to_the_heap() -> None:
    """The control: what the service did before (the blocks land in the heap)."""
    result = fresh_json("PIN = False\n" + _PROBE)
    assert result["heap_growth"] >= 4 * (256 << 10), result


def test_a_threshold_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer_service.malloc import pin_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert pin_mmap_threshold() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert pin_mmap_threshold() is False
