"""memcached's meta protocol, the requests: pipelined batches of mg, ms, ma and md laid out
as bytes (pure; memcached >= 1.6, `doc/protocol.txt`, "Meta Commands").

Reads of rows are quiet (`q`) and carry their position in the batch as an opaque token
(`O<i>`, zero-padded to `token_width`), so the hits of one value size come back as one
fixed-stride block; `replies` parses what memcached answers. docs/storage.md tells why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.jit import compiled

__all__ = [
    "CRLF",
    "END",
    "END_REPLY",
    "Keys",
    "Wire",
    "build_ma_count",
    "build_md",
    "build_mg",
    "build_mg_quiet",
    "build_ms",
    "build_ms_parts",
    "build_ms_rows",
    "token_width",
]


Keys: TypeAlias = "NDArray[np.uint8] | list[bytes]"
"""Keys of a batch: a uint8 matrix (n, key_len) of fixed-width keys, or a list of bytes."""
Wire: TypeAlias = "bytes | memoryview"
"""Bytes of a request: `build_ms` hands out a view of the buffer it laid its commands
out in (a batch of rows is megabytes: copying it into a bytes object cost as
much as laying it out). A view is sent as it is and is never modified afterwards."""

END = b"mn\r\n"
END_REPLY = b"MN\r\n"
CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)


_ZERO = ord("0")


def build_mg(keys: Keys) -> bytes:
    """`mg <key> v\\r\\n` for every key, as one buffer."""
    if isinstance(keys, np.ndarray):
        n, width = keys.shape
        out = np.empty((n, width + 7), dtype=np.uint8)
        out[:, :3] = np.frombuffer(b"mg ", dtype=np.uint8)
        out[:, 3 : 3 + width] = keys
        out[:, 3 + width :] = np.frombuffer(b" v\r\n", dtype=np.uint8)
        return out.tobytes()
    if not keys:
        return b""
    return b"mg " + b" v\r\nmg ".join(keys) + b" v\r\n"


def _num_keys(keys: Keys) -> int:
    return keys.shape[0] if isinstance(keys, np.ndarray) else len(keys)


def token_width(n: int) -> int:
    """Digits of the opaque tokens of a quiet batch of n reads: those of n - 1."""
    return len(str(n - 1)) if n > 1 else 1


_TAIL_ROWS = 1 << 17  # tails cached per token width: up to this many rows (1.8 MB)
_tails: dict[int, NDArray[np.uint8]] = {}


def _quiet_tail(n: int) -> NDArray[np.uint8]:
    """`" v q O<i>\\r\\n"` for i in 0 .. n-1 as a read-only uint8 matrix (n, width + 8).

    Cached per token width (all of its 10**width rows, up to `_TAIL_ROWS`) and
    sliced: the batches of a store have every size (one per node and table and
    kind), and building the digits costs as much as the rest of the request.
    """
    width = token_width(n)
    cached = _tails.get(width)
    if cached is not None and cached.shape[0] >= n:
        return cached[:n]
    rows = max(n, min(10**width, _TAIL_ROWS))
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    tail = np.empty((rows, width + 8), dtype=np.uint8)
    tail[:, :6] = np.frombuffer(b" v q O", dtype=np.uint8)
    tail[:, 6:-2] = (np.arange(rows, dtype=np.int64)[:, None] // powers) % 10 + _ZERO
    tail[:, -2:] = CRLF
    tail.setflags(write=False)
    _tails[width] = tail
    return tail[:n]


def build_mg_quiet(
    keys: Keys, *, first: int = 0, total: int | None = None, exptime: int = 0
) -> bytes:
    """`mg <key> [T<exptime>] v q O<i>\\r\\n` for the key at every position i, as one buffer.

    i is zero-padded to `token_width(n)` digits, so every hit of one value size
    has the same reply length (`parse_mg_quiet`). A group of `total` reads may be
    built in pieces: the keys of one piece get the tokens `first` ..
    `first + len(keys) - 1`, padded to the digits of the whole group. `exptime` > 0
    (`core.expiry.exptime`) also resets the TTL of every item hit; `T` returns
    nothing, so the replies are the same.
    """
    n = _num_keys(keys)
    if n == 0:
        return b""
    if total is None:
        total = n
    if not 0 <= first <= total - n:
        raise ValueError(f"reads {first} .. {first + n - 1} are not in a group of {total}")
    tail = _quiet_tail(total)[first : first + n]
    flag = np.frombuffer(b" T%d" % exptime if exptime > 0 else b"", dtype=np.uint8)
    if isinstance(keys, np.ndarray):
        key_width = keys.shape[1]
        out = np.empty((n, 3 + key_width + flag.size + tail.shape[1]), dtype=np.uint8)
        out[:, :3] = np.frombuffer(b"mg ", dtype=np.uint8)
        out[:, 3 : 3 + key_width] = keys
        out[:, 3 + key_width : 3 + key_width + flag.size] = flag
        out[:, 3 + key_width + flag.size :] = tail
        return out.tobytes()
    # Variable-width keys: each key, then its tail "[ T<t>] v q O<i>\r\nmg " (a numpy S
    # array, whose tolist() gives bytes; digits are never NUL, so nothing is stripped).
    tails = np.empty((n, flag.size + tail.shape[1] + 3), dtype=np.uint8)
    tails[:, : flag.size] = flag
    tails[:, flag.size : -3] = tail
    tails[:, -3:] = np.frombuffer(b"mg ", dtype=np.uint8)
    parts: list[bytes] = [b""] * (2 * n)
    parts[0::2] = keys
    parts[1::2] = tails.view(f"S{tails.shape[1]}").ravel().tolist()
    return b"mg " + b"".join(parts)[:-3]


def build_ms(keys: Keys, values: NDArray[np.uint8] | Sequence[Wire], **how: Any) -> Wire:
    """`build_ms_parts(keys, values, **how)` as one buffer."""
    parts = build_ms_parts(keys, values, **how)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def build_ms_parts(
    keys: Keys,
    values: NDArray[np.uint8] | Sequence[Wire],
    *,
    add: bool = False,
    ttl_s: int = 0,
    quiet: bool = False,
    first: int = 0,
    total: int | None = None,
) -> list[Wire]:
    """`ms <key> <len> [ME] [T<ttl>] [q [O<i>]]\\r\\n<value>\\r\\n` for every key.

    `add` (mode E) stores only if the key is absent; `ttl_s` > 0 makes the item
    expire after that many seconds; `quiet` (q): memcached answers only failures. A
    quiet overwrite's failure is an error line (`parse_ms_quiet`); a quiet add also
    answers `NS O<i>` when the key exists, so each add carries the opaque token of its
    position i, zero-padded to `token_width(total)` digits as quiet reads do (the keys
    of one piece of a batch of `total` get `first` .. `first + len(keys) - 1`;
    `parse_ms_quiet_add`). Fixed-width keys with a fixed-width value matrix (n,
    nbytes) are laid out with numpy and handed out as a view of that buffer (one part).
    Anything else is each key's command line, its value and the value's end: parts of
    the request that the connection joins into writes (`node._slices`), but for big
    values, sent from where they are (a journal's or dense log's chunks: not copied).
    """
    n = _num_keys(keys)
    tokens = quiet and add
    mode = (
        (b" ME" if add else b"")
        + (b" T%d" % ttl_s if ttl_s > 0 else b"")
        + (b" q" if quiet and not add else b"")
    )
    tail: NDArray[np.uint8] | None = None  # each line's end: " q O<i>\r\n" for quiet adds
    if tokens and n:
        total = n if total is None else total
        if not 0 <= first <= total - n:
            raise ValueError(f"adds {first} .. {first + n - 1} are not in a batch of {total}")
        tail = _quiet_tail(total)[first : first + n, 2:]  # " v q O<i>\r\n" without " v"
    if tail is None:
        mode += b"\r\n"
    if isinstance(keys, np.ndarray) and isinstance(values, np.ndarray):
        width = keys.shape[1]
        nbytes = values.shape[1]
        head = b" %d%s" % (nbytes, mode)
        ends = 0 if tail is None else tail.shape[1]
        stride = 3 + width + len(head) + ends + nbytes + 2
        out = np.empty((n, stride), dtype=np.uint8)
        out[:, :3] = np.frombuffer(b"ms ", dtype=np.uint8)
        out[:, 3 : 3 + width] = keys
        col = 3 + width
        out[:, col : col + len(head)] = np.frombuffer(head, dtype=np.uint8)
        col += len(head)
        if tail is not None:
            out[:, col : col + ends] = tail
            col += ends
        out[:, col : col + nbytes] = values
        out[:, col + nbytes :] = CRLF
        return [out.reshape(-1).data]
    key_list = [bytes(k) for k in keys] if isinstance(keys, np.ndarray) else keys
    value_list = [v.tobytes() for v in values] if isinstance(values, np.ndarray) else values
    if len(key_list) != len(value_list):
        raise ValueError(f"{len(key_list)} keys but {len(value_list)} values")
    ends = [b""] * len(key_list) if tail is None else [bytes(row) for row in tail]
    parts: list[Wire] = []
    for key, value, end in zip(key_list, value_list, ends, strict=True):
        parts.append(b"ms %s %d%s%s" % (key, len(value), mode, end))
        parts.append(value)
        parts.append(b"\r\n")
    return parts


_BYTES_C = types.Array(types.uint8, 2, "C", readonly=True)
_INDEX_C = types.Array(types.intp, 1, "C", readonly=True)


@compiled(
    types.void(
        types.Array(types.uint8, 2, "C"),
        _BYTES_C,
        types.Array(types.uint8, 1, "C", readonly=True),
        _BYTES_C,
        _INDEX_C,
    )
)
def _lay_ms(out, keys, head, values, index):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Row i of `out`: `ms ` + keys[i] + head + values[index[i]] + CRLF (bytes copied)."""
    key_width = keys.shape[1]
    head_width = head.shape[0]
    nbytes = values.shape[1]
    for i in range(index.shape[0]):
        line = out[i]
        key = keys[i]
        value = values[index[i]]
        line[0] = 109  # m
        line[1] = 115  # s
        line[2] = 32
        for j in range(key_width):
            line[3 + j] = key[j]
        at = 3 + key_width
        for j in range(head_width):
            line[at + j] = head[j]
        at += head_width
        for j in range(nbytes):
            line[at + j] = value[j]
        line[at + nbytes] = 13  # CR
        line[at + nbytes + 1] = 10  # LF


def build_ms_rows(
    segments: Sequence[tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.intp]]],
    *,
    ttls: Sequence[int] | None = None,
) -> memoryview:
    """Quiet overwrites of fixed-width keys and values as one buffer: for each segment
    (keys (m, key width), values (N, nbytes), index (m,)), `ms <key> <nbytes> [T<ttl>]
    q\r\n<value>\r\n` of key i with row `index[i]` of values.

    The same bytes as `build_ms_parts(keys, values[index], quiet=True, ttl_s=ttl)` of
    every segment, joined, in one compiled pass: each value is copied once, from where
    it is, into the request (a flush of rows written behind is megabytes, which a
    gather, a layout and a join would each copy).

    Raises:
        ValueError: index and keys of different lengths, or an index out of range.
    """
    ttl_of = [0] * len(segments) if ttls is None else list(ttls)
    if len(ttl_of) != len(segments):
        raise ValueError(f"{len(segments)} segments but {len(ttl_of)} ttls")
    laid: list[tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.uint8], NDArray[np.intp]]]
    laid = []
    sizes: list[int] = []
    for (keys, values, index), ttl_s in zip(segments, ttl_of, strict=True):
        if keys.shape[0] != index.shape[0]:
            raise ValueError(f"{keys.shape[0]} keys but {index.shape[0]} value rows")
        if index.shape[0] and not 0 <= int(index.min()) <= int(index.max()) < values.shape[0]:
            raise ValueError(f"value rows {index.min()}..{index.max()} of {values.shape[0]}")
        mode = (b" T%d" % ttl_s if ttl_s > 0 else b"") + b" q\r\n"
        head = np.frombuffer(b" %d%s" % (values.shape[1], mode), dtype=np.uint8)
        laid.append(
            (
                np.ascontiguousarray(keys, dtype=np.uint8),
                head,
                np.ascontiguousarray(values, dtype=np.uint8),
                np.ascontiguousarray(index, dtype=np.intp),
            )
        )
        sizes.append(index.shape[0] * (3 + keys.shape[1] + head.shape[0] + values.shape[1] + 2))
    out = np.empty(sum(sizes), dtype=np.uint8)
    start = 0
    for (keys, head, values, index), size in zip(laid, sizes, strict=True):
        if size:
            _lay_ms(
                out[start : start + size].reshape(index.shape[0], -1), keys, head, values, index
            )
        start += size
    return out.data


def build_ma_count(keys: Keys, exptime: int) -> bytes:
    """`ma <key> N<exptime> J1 T<exptime> v\\r\\n` for every key: count one sighting.

    A missing counter is created at 1 with that TTL (`N`, `J1`: memcached does not
    add the delta to a new counter); an existing one goes up by 1 and gets the TTL
    again (`T`). Every reply is `VA <len>\\r\\n<count>\\r\\n` (`parse_ma`).
    """
    key_list = [bytes(k) for k in keys] if isinstance(keys, np.ndarray) else keys
    if not key_list:
        return b""
    tail = b" N%d J1 T%d v\r\n" % (exptime, exptime)
    return b"ma " + (tail + b"ma ").join(key_list) + tail


def build_md(keys: Keys) -> bytes:
    """`md <key>\\r\\n` for every key (answers `HD` deleted / `NF` absent, like `ms`)."""
    key_list = [bytes(k) for k in keys] if isinstance(keys, np.ndarray) else keys
    if not key_list:
        return b""
    return b"md " + b"\r\nmd ".join(key_list) + b"\r\n"
