"""Compiled loops (numba) for what numpy can only do in many passes: one place for how
the core compiles them.

`compiled(signatures)` compiles a function at import for exactly these signatures (a
caller never waits for a compiler on a hot path, nor gets another specialization
silently), with `nogil` (a caller may run it in a thread) and numpy's error model
(a float division by zero gives inf or nan as in numpy, and the checks Python's model
adds to every division would keep LLVM from vectorizing the loop), caching the machine
code on disk where numba finds a writable place: the package's `__pycache__`, else the user's
cache directory (`NUMBA_CACHE_DIR` overrides both). A process then loads it in tens of
milliseconds instead of compiling for about half a second. Without such a place (a
read-only image and home), it compiles in memory.

What compiled code must keep (tests/unit check both): integer work only, or float32
arithmetic op for op as the numpy it replaces (no `fastmath`: LLVM then neither
reorders nor fuses a multiply and an add; its SIMD `+ - * / sqrt` round as the scalar
ones do), so the results are the same bits on every x86-64 CPU, AVX-512 or not.

Layouts: LLVM vectorizes a loop over an array only if it knows the stride is 1, i.e.
for a C-contiguous argument. A kernel that needs the speed is compiled three times
(`C`, `RC` and `A` below): C-contiguous arrays take a vectorized one, writable (`C`) or
read-only (`RC`: a frozen array, a buffer read from a socket), anything else (a
strided view) the general one. numba matches an exact type first, so a writable
C-contiguous array takes `C`, a read-only one `RC`, and a mix of the two `RC`; only a
non-contiguous argument falls to `A` (10 times slower for Adam's loops). Inner loops
vectorize fully when they index 1-D views of a row (`w = weights[i]`, then `w[j]`), not
the 2-D array (`weights[i, j]`): see `optimizers.adam`.

Compiled code does not check bounds: its Python callers check the shapes first (a wrong
one is a ValueError there, never a read past an array).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import njit, types

__all__ = ["A1", "A2", "C1", "C2", "RC1", "RC2", "compiled"]


# float32 arrays: C-contiguous, writable or read-only (vectorized loops), and any (module doc)
C1 = types.Array(types.float32, 1, "C")
C2 = types.Array(types.float32, 2, "C")
RC1 = types.Array(types.float32, 1, "C", readonly=True)
RC2 = types.Array(types.float32, 2, "C", readonly=True)
A1 = types.Array(types.float32, 1, "A", readonly=True)
A2 = types.Array(types.float32, 2, "A", readonly=True)


def compiled(signatures: Any) -> Callable[[Callable[..., Any]], Any]:
    """`njit(signatures, nogil=True, error_model="numpy")`, cached on disk where
    possible (module doc)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        options: dict[str, Any] = {"nogil": True, "error_model": "numpy"}
        try:
            return njit(signatures, cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(signatures, **options)(fn)

    return wrap
