"""The trainer <-> optimizer service wire format (pure: msgpack + numpy).

Bodies are msgpack maps (`application/msgpack`). A numeric array is the map
`{"dtype": "<f4" | "<i8", "shape": [..], "data": <bin: raw little-endian bytes>}`
(numpy's `dtype.str`; never a list of floats); string ids are a plain list of str.
Errors are JSON `{"error": "what is wrong"}` with a 4xx/5xx status.

Rows a replica answers with travel in their table's stored width (`encode_rows`): a
16-bit table's as its `<u2` words with `row_dtype` beside them, which `decode_rows` turns
back into float32, exactly.

Decoding validates everything a client can get wrong and raises `WireError`
(a ValueError) whose message names the field path, e.g.
`tables.user.grads: expected shape (3, 16), got (3, 8)`.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
from numpy.typing import NDArray

from lookup_table.core.precision import RowDtype, stored_words, widened
from lookup_table.errors import WireError

__all__ = [
    "CONTENT_TYPE",
    "WireError",
    "decode_array",
    "describe",
    "decode_ids",
    "decode_rows",
    "encode_array",
    "encode_ids",
    "encode_rows",
    "pack",
    "pack_view",
    "unpack",
]

CONTENT_TYPE = "application/msgpack"
_MAX_DIM = 2**31  # no real array has a longer axis; bigger ones are hostile
_REPR = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 6, 6
_ALLOWED_DTYPES: dict[str, np.dtype[Any]] = {"<f4": np.dtype("<f4"), "<i8": np.dtype("<i8")}
# 16-bit rows' words: taken only where a caller asks for them (`decode_rows`)
_WORD_DTYPES: dict[str, np.dtype[Any]] = {"<u2": np.dtype("<u2")}
_ROW_DTYPES = ("float16", "bfloat16")  # the `row_dtype`s that travel as words
_MAX_DIMS = 8


def describe(value: Any) -> str:
    """A short, bounded repr for error messages (safe on deeply nested or huge values)."""
    return _REPR.repr(value)


def pack(obj: Any) -> bytes:
    """msgpack with bin for bytes and str for str."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)  # msgpack is untyped (Any)
    return packed


def pack_view(obj: Any) -> memoryview:
    """`pack` without its last copy: a read-only view of the packer's own buffer, for the
    megabyte bodies (a push's answer, journal and dense log) that are sent or cut into
    chunks, not kept. `packb` packs into that buffer too, then copies it into a bytes
    object: one more copy of every body, into fresh pages."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    packer.pack(obj)
    view: memoryview = packer.getbuffer().toreadonly()
    return view


def unpack(body: bytes | memoryview) -> Any:
    """Decode a msgpack body; WireError if it is not exactly one valid msgpack object."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except msgpack.ExtraData as exc:
        raise WireError("body has trailing bytes after the msgpack object") from exc
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
        raise WireError(f"body is not valid msgpack: {exc}") from exc


def encode_array(array: NDArray[Any]) -> dict[str, Any]:
    """An int64 or float32 array as its wire map (little-endian, C order).

    `data` is a memoryview of the array's bytes, not a copy (msgpack packs it as bin,
    the same bytes as `tobytes()`): pack the map before changing the array. The answers,
    journals and logs of a push are megabytes, and their one copy is the packing's.
    """
    arr = np.asarray(array)
    if arr.dtype.kind == "f":
        arr = np.ascontiguousarray(arr, dtype="<f4")
    elif arr.dtype.kind in "iu":
        arr = np.ascontiguousarray(arr, dtype="<i8")
    else:
        raise TypeError(f"cannot send an array of dtype {arr.dtype} (only float32 / int64)")
    data = arr.reshape(-1).data.cast("B") if arr.size else b""
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": data}


def encode_ids(ids: NDArray[Any] | list[str]) -> dict[str, Any] | list[str]:
    """int ids as an `<i8` array map; str ids as a list of str."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        return encode_array(ids)
    return [str(x) for x in (ids.tolist() if isinstance(ids, np.ndarray) else ids)]


def decode_array(
    obj: Any, *, field: str, dtype: str | None = None, ndim: int | None = None
) -> NDArray[Any]:
    """Validate a wire array map and return a read-only numpy view of its data.

    Raises:
        WireError: not a map with dtype/shape/data, an unknown dtype, a shape that
            does not match the data length, or not the expected dtype/ndim.
    """
    if not isinstance(obj, Mapping):
        raise WireError(
            f"{field}: expected an array map {{dtype, shape, data}}, got {type(obj).__name__}"
        )
    keys = set(obj)
    if keys != {"dtype", "shape", "data"}:
        raise WireError(
            f"{field}: an array map has exactly the keys dtype, shape, data; got "
            f"{sorted(map(str, keys))}"
        )
    dt, shape, data = obj["dtype"], obj["shape"], obj["data"]
    allowed = _WORD_DTYPES if dtype in _WORD_DTYPES else _ALLOWED_DTYPES
    if not isinstance(dt, str) or dt not in allowed:
        raise WireError(f"{field}.dtype: expected one of {sorted(allowed)}, got {describe(dt)}")
    if dtype is not None and dt != dtype:
        raise WireError(f"{field}.dtype: expected {dtype!r}, got {describe(dt)}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_DIM for d in shape
        )
    ):
        raise WireError(
            f"{field}.shape: expected a list of ints in 0..2**31, got {describe(shape)}"
        )
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{field}.shape: expected {ndim} dimensions, got {describe(shape)}")
    # bytes off the wire; a memoryview (`encode_array`'s) where a map is decoded unpacked
    if isinstance(data, memoryview):
        size = data.nbytes
    elif isinstance(data, bytes):
        size = len(data)
    else:
        raise WireError(f"{field}.data: expected binary data, got {type(data).__name__}")
    np_dtype = allowed[dt]
    count = math.prod(shape)
    if count * np_dtype.itemsize != size:
        raise WireError(
            f"{field}: shape {shape} of {dt} needs {count * np_dtype.itemsize} bytes, "
            f"data has {size}"
        )
    try:
        return np.frombuffer(data, dtype=np_dtype).reshape(shape)
    except ValueError as exc:  # e.g. [0, 2**31, 2**31, ...]: numpy refuses the shape itself
        raise WireError(
            f"{field}.shape: {describe(shape)} is not a valid array shape: {exc}"
        ) from None


def encode_rows(rows: NDArray[np.float32], dtype: RowDtype) -> dict[str, Any]:
    """Rows (n, dim) of a table of `dtype`, as an answer carries them: `{"rows": array}`,
    the float32 array for float32; for float16 and bfloat16 their `<u2` words (half the
    bytes) and `"row_dtype"`. The rows must hold values of `dtype` already (stored or
    rounded to it): these are exact, others would be rounded to nearest."""
    if dtype not in _ROW_DTYPES:
        return {"rows": encode_array(rows)}
    words = np.ascontiguousarray(stored_words(rows, dtype), dtype="<u2")
    data = words.reshape(-1).data.cast("B") if words.size else b""
    return {"rows": {"dtype": "<u2", "shape": list(words.shape), "data": data}, "row_dtype": dtype}


def decode_rows(obj: Mapping[str, Any], *, field: str) -> NDArray[np.float32]:
    """The float32 rows (n, dim) of a map `encode_rows` made (`obj["rows"]` and, for a
    16-bit table, `obj["row_dtype"]`): a read-only view for float32, a new array else.

    Raises:
        WireError: an unknown `row_dtype`, or rows of another dtype or not 2-D.
    """
    row_dtype = obj.get("row_dtype")
    if row_dtype is None:
        return decode_array(obj["rows"], field=f"{field}.rows", dtype="<f4", ndim=2)
    if row_dtype not in _ROW_DTYPES:
        raise WireError(
            f"{field}.row_dtype: expected one of {list(_ROW_DTYPES)}, got {describe(row_dtype)}"
        )
    words = decode_array(obj["rows"], field=f"{field}.rows", dtype="<u2", ndim=2)
    return widened(words.view(np.uint16), row_dtype)


def decode_ids(obj: Any, *, field: str) -> NDArray[Any]:
    """Ids: an `<i8` array map (1-D) -> int64, or a list of str -> object array."""
    if isinstance(obj, list):
        if not all(isinstance(x, str) for x in obj):
            bad = next(x for x in obj if not isinstance(x, str))
            raise WireError(
                f"{field}: string ids must all be str, got {type(bad).__name__} {describe(bad)}"
            )
        out = np.empty(len(obj), dtype=object)
        out[:] = obj
        return out
    return decode_array(obj, field=field, dtype="<i8", ndim=1).astype(np.int64)
