"""Compiled loops (numba) for what numpy can only do in many passes: one place for how
the core compiles them.

`compiled(signatures)` compiles at import for exact signatures, `nogil`, numpy's error
model, cached on disk; `prefetch_row` hints a row's cache lines ahead of a loop. What
compiled code must keep (the same bits as numpy on every CPU), the `C`/`RC`/`A` layouts
and why: docs/architecture.md#compiled-loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "A1",
    "A2",
    "C1",
    "C2",
    "PREFETCH_AHEAD",
    "RC1",
    "RC2",
    "compiled",
    "prefetch_head",
    "prefetch_row",
]

PREFETCH_AHEAD = 8  # rows: far enough to hide a memory access, near enough to stay cached
_LINE = 64  # bytes of a cache line on x86-64 (and most others)


# float32 arrays: C-contiguous, writable or read-only (vectorized loops), and any
# (docs/architecture.md#compiled-loops)
C1 = types.Array(types.float32, 1, "C")
C2 = types.Array(types.float32, 2, "C")
RC1 = types.Array(types.float32, 1, "C", readonly=True)
RC2 = types.Array(types.float32, 2, "C", readonly=True)
A1 = types.Array(types.float32, 1, "A", readonly=True)
A2 = types.Array(types.float32, 2, "A", readonly=True)


def compiled(signatures: Any) -> Callable[[Callable[..., Any]], Any]:
    """`njit(signatures, nogil=True, error_model="numpy")`, cached on disk where
    possible (docs/architecture.md#compiled-loops)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        options: dict[str, Any] = {"nogil": True, "error_model": "numpy"}
        try:
            return njit(signatures, cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(signatures, **options)(fn)

    return wrap


@intrinsic
def _prefetch(typingctx: Any, arr: Any, row: Any, offset: Any) -> Any:  # pragma: no cover
    """llvm.prefetch (read, keep in every cache level) of byte `offset` of row `row`."""
    sig = types.void(arr, row, offset)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array = context.make_array(signature.args[0])(context, builder, args[0])
        stride = builder.extract_value(array.strides, 0)
        base = builder.ptrtoint(array.data, ir.IntType(64))
        at = builder.add(base, builder.add(builder.mul(args[1], stride), args[2]))
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=fnty)
        builder.call(
            fn,
            [
                builder.inttoptr(at, byte_ptr),
                ir.Constant(i32, 0),
                ir.Constant(i32, 3),
                ir.Constant(i32, 1),
            ],
        )
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def prefetch_row(arr, row):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Ask for every cache line of row `row` of an array (an element of a 1-D one; a hint:
    docs/architecture.md#compiled-loops)."""
    size = arr.strides[0]
    for offset in range(0, size, _LINE):
        _prefetch(arr, row, offset)  # type: ignore[call-arg]  # typed by numba
    _prefetch(arr, row, size - 1)  # type: ignore[call-arg]  # the last line, if not aligned


@njit(inline="always")
def prefetch_head(arr, row, nbytes):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`prefetch_row` of the first `nbytes` bytes of the row only (a caller that reads
    part of each row)."""
    for offset in range(0, nbytes, _LINE):
        _prefetch(arr, row, offset)  # type: ignore[call-arg]  # typed by numba
    _prefetch(arr, row, nbytes - 1)  # type: ignore[call-arg]  # the last line, if not aligned
