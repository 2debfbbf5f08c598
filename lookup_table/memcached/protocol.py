"""memcached's meta protocol for pipelined batches (pure: builds bytes, parses bytes).

No async client pipelines a whole batch, so this is the one place where we speak
the protocol ourselves (memcached >= 1.6, `doc/protocol.txt`, "Meta Commands").
A batch to one node is one request (sent in writes of about a megabyte, `node`)::

    mg <sentinel key> v\\r\\n          (optional: the node's data-loss sentinel)
    mg <key> v q O<i>\\r\\n x n        (read of fixed-size rows; several tables and
    [mn\\r\\n mg <key> v q O<i>\\r\\n x m]  kinds: one group per value size)   or
    mg <key> v\\r\\n   x n             (read of blobs)   or
    ms <key> <len> [ME] [T<t>] q [O<i>]\\r\\n<data>\\r\\n x n   (write)
    ma <key> N<t> J1 T<t> v\\r\\n x n  (count sightings: admission counters)
    mn\\r\\n                           (end marker: memcached answers MN\\r\\n)

Rows (`build_mg_quiet` / `parse_mg_quiet`) are read in quiet mode with an opaque
token: the key's position i in the batch, zero-padded to the digits of n - 1. A
miss sends nothing, so the hits of fixed-size rows are one fixed-stride block
`VA <4*dim> O<i>\\r\\n<row>\\r\\n` x hits that numpy checks and slices, and whose
tokens it decodes into positions, without a Python loop, whatever the mix of
hits and misses. Memcached answers a connection's commands in order, so the
tokens must rise strictly: a repeated, out-of-order or out-of-range token is a
stale or foreign reply (ProtocolError). Error lines carry no token; they fall back
to a per-reply scan (as do values of another size), which knows only the lowest
position an error line can belong to.

A batch of several tables and kinds (the store's `get_many`) reads the keys of
each value size (dim-16 Adam rows with their 33 slot floats, ...) as one group,
numbered across its tables (`build_mg_quiet(..., first=, total=)`), and closes
each group but the last with `mn`: a group's hits then stay one fixed-stride
block, and its `MN` says where its replies end (`parse_mg_quiet` parses up to
the first `MN` at a reply boundary, wherever it is in the buffer).

The sentinel and blobs are read without the quiet flag: every command then has
exactly one reply (`EN\\r\\n` on a miss), in order, so replies map to keys by
position, and a missing sentinel is an explicit `EN`. Writes are sent quiet (`q`),
so a batch that stored everything answers only its `MN`: a quarter less work for
memcached per write, and no reply lines to wake up for. An overwrite answers only
failures (`parse_ms_quiet`); an add carries its position as the opaque token and also
answers `NS O<i>` when its key exists (`parse_ms_quiet_add`). Deletes answer one line
per key (`parse_ms`), checked as one uint32 comparison when all are `HD`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.jit import compiled
from lookup_table.errors import ProtocolError

__all__ = [
    "END",
    "END_REPLY",
    "Keys",
    "MaReply",
    "MgReply",
    "MsReply",
    "STATUS_ERROR",
    "STATUS_EXISTS",
    "STATUS_NOT_FOUND",
    "STATUS_NOT_STORED",
    "STATUS_STORED",
    "Wire",
    "build_ma_count",
    "build_md",
    "build_mg",
    "build_mg_quiet",
    "build_ms",
    "build_ms_parts",
    "build_ms_rows",
    "gather_values",
    "parse_mg",
    "parse_ma",
    "parse_mg_quiet",
    "parse_ms",
    "parse_ms_quiet",
    "parse_ms_quiet_add",
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
_CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)
_HD_U32 = np.frombuffer(b"HD\r\n", dtype="<u4")[0]
_EN_U32 = np.frombuffer(b"EN\r\n", dtype="<u4")[0]
_ZERO = ord("0")
_ERROR_PREFIXES = (b"SERVER_ERROR", b"CLIENT_ERROR", b"ERROR")

STATUS_STORED = 0
STATUS_NOT_STORED = 1
STATUS_EXISTS = 2
STATUS_NOT_FOUND = 3
STATUS_ERROR = 9
_MS_STATUS = {
    b"HD": STATUS_STORED,
    b"NS": STATUS_NOT_STORED,
    b"EX": STATUS_EXISTS,
    b"NF": STATUS_NOT_FOUND,
}


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
    tail[:, -2:] = _CRLF
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
        out[:, col + nbytes :] = _CRLF
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
    it is, into the request (a flush of rows written behind is megabytes, which the
    gather, the layout and the join each copied before).

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


@dataclass(slots=True)
class MgReply:
    """Positions of the values in a reply buffer, one entry per `mg`.

    `starts[i]` is the offset of value i in the buffer, or -1 on a miss;
    `sizes[i]` its length. `stride` is set when every hit has the same size and
    the hits follow each other back to back (`starts` of the hits rise by
    `stride`), so the values are a strided view. `errors` maps positions whose
    reply was an error line to that line; in a `quiet` reply the position is the
    lowest the line can belong to (error lines carry no token).
    """

    starts: NDArray[np.int64]
    sizes: NDArray[np.int64]
    end: int
    stride: int = 0
    errors: dict[int, bytes] = field(default_factory=dict)
    quiet: bool = False

    @property
    def found(self) -> NDArray[np.bool_]:
        return self.starts >= 0


@dataclass(slots=True)
class MsReply:
    """Status per `ms` (STATUS_*), and the error lines by position."""

    status: NDArray[np.uint8]
    end: int
    errors: dict[int, bytes] = field(default_factory=dict)


def _fixed_hits(buf: bytes | bytearray, pos: int, n: int, nbytes: int) -> MgReply | None:
    header = b"VA %d\r\n" % nbytes
    stride = len(header) + nbytes + 2
    end = pos + n * stride
    if len(buf) < end or n == 0:
        return None
    block = np.frombuffer(buf, dtype=np.uint8, count=n * stride, offset=pos).reshape(n, stride)
    head = np.frombuffer(header, dtype=np.uint8)
    if not ((block[:, : len(header)] == head).all() and (block[:, -2:] == _CRLF).all()):
        return None
    starts = pos + len(header) + np.arange(n, dtype=np.int64) * stride
    return MgReply(starts=starts, sizes=np.full(n, nbytes, dtype=np.int64), end=end, stride=stride)


def _value_end(buf: bytes | bytearray, nl: int, size: int, what: str) -> int | None:
    """Where the value of `size` bytes after the header line ending at `nl` ends (past its
    CRLF); None if the buffer does not hold it all yet.

    Raises:
        ProtocolError: the value is not followed by CRLF.
    """
    start = nl + 2
    if len(buf) < start + size + 2:
        return None
    if buf[start + size : start + size + 2] != b"\r\n":
        raise ProtocolError(f"value of {what} is not followed by CRLF")
    return start + size + 2


def parse_mg(
    buf: bytes | bytearray, pos: int, n: int, *, nbytes: int | None = None
) -> MgReply | None:
    """Parse the replies of n `mg` commands starting at `pos`; None if incomplete.

    With `nbytes` (the expected value size) the all-hits case is recognised as a
    fixed-stride block without a Python loop; otherwise, and when it does not
    apply, each reply is scanned.

    Raises:
        ProtocolError: a line that is not a meta-get reply.
    """
    if nbytes is not None:
        fast = _fixed_hits(buf, pos, n, nbytes)
        if fast is not None:
            return fast
    if n and len(buf) >= pos + 4 * n:
        # All misses (a batch of new rows): n x "EN\r\n", checked as one uint32 compare.
        # No reply but EN starts with "EN", so n of them in a row are the n replies.
        codes = np.frombuffer(buf, dtype="<u4", count=n, offset=pos)
        if (codes == _EN_U32).all():
            return MgReply(
                starts=np.full(n, -1, dtype=np.int64),
                sizes=np.zeros(n, dtype=np.int64),
                end=pos + 4 * n,
            )
    starts = np.full(n, -1, dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    errors: dict[int, bytes] = {}
    for i in range(n):
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        if buf.startswith(b"VA ", pos):
            header = buf[pos + 3 : nl].split(b" ", 1)
            if not header[0].isdigit():  # int() would also take b"-2", b" 8", b"1_0"
                raise ProtocolError(f"bad meta-get header {bytes(buf[pos:nl])!r}")
            size = int(header[0])
            end = _value_end(buf, nl, size, f"reply {i}")
            if end is None:
                return None
            starts[i], sizes[i] = nl + 2, size
            pos = end
        elif nl == pos + 2 and buf.startswith(b"EN", pos):
            pos = nl + 2
        elif buf.startswith(_ERROR_PREFIXES, pos):
            errors[i] = bytes(buf[pos:nl])
            pos = nl + 2
        else:
            raise ProtocolError(f"unexpected meta-get reply {bytes(buf[pos:nl])[:80]!r}")
    return MgReply(starts=starts, sizes=sizes, end=pos, errors=errors)


def _fixed_quiet_prefix(
    buf: bytes | bytearray, pos: int, n: int, nbytes: int, width: int
) -> tuple[NDArray[np.int64], int] | None:
    """The hits of `nbytes` that follow each other from `pos`, decoded without a loop.

    Returns (their read positions, their stride) for the longest run of blocks
    `VA <nbytes> O<token>\\r\\n<value>\\r\\n` at a fixed stride from `pos` (at most
    n, only whole blocks in the buffer); None if a token of the run is out of
    order or range (the scan then names it). Sound without a scan: the block at
    `pos` starts a reply; when its whole header reads `VA <nbytes> O<digits>` and
    its value ends in CRLF, it is one hit of nbytes and the next block starts the
    next reply, and so on. Whatever follows the run (a miss sends nothing: the
    `MN`, an error line, a value of another size, more of a reply still to come)
    is left to the scan.
    """
    head = b"VA %d O" % nbytes
    header_len = len(head) + width + 2
    stride = header_len + nbytes + 2
    blocks = min(n, max(0, len(buf) - pos) // stride)
    if blocks == 0:
        return np.empty(0, dtype=np.int64), stride
    block = np.frombuffer(buf, dtype=np.uint8, count=blocks * stride, offset=pos).reshape(
        blocks, stride
    )
    digits = block[:, len(head) : len(head) + width] - np.uint8(_ZERO)  # wraps below "0"
    ok = (
        (block[:, : len(head)] == np.frombuffer(head, dtype=np.uint8)).all(axis=1)
        & (digits <= 9).all(axis=1)
        & (block[:, header_len - 2 : header_len] == _CRLF).all(axis=1)
        & (block[:, -2:] == _CRLF).all(axis=1)
    )
    run = blocks if ok.all() else int(np.argmin(ok))
    index = digits[:run].astype(np.int64) @ (10 ** np.arange(width - 1, -1, -1, dtype=np.int64))
    if run and (index[-1] >= n or (index[1:] <= index[:-1]).any()):
        return None
    return index, stride


def _token_index(
    token: bytes, line: bytes, width: int, low: int, n: int, *, command: str, item: str
) -> int:
    """The position the opaque token of a quiet `command` reply `line` names (`item`:
    what the batch's positions are, "read" or "add").

    Raises:
        ProtocolError: the token is not `width` digits, or names a position below `low`
            or past the batch's n (replies come in order: a repeated, out-of-order or
            foreign reply).
    """
    if not (token.isdigit() and len(token) == width):
        what = "header" if line.startswith(b"VA ") else "reply"
        raise ProtocolError(f"bad quiet {command} {what} {line[:80]!r}")
    i = int(token)
    if not low <= i < n:
        raise ProtocolError(
            f"quiet {command} reply for {item} {i} after replies up to {item} "
            f"{low - 1} of {n}: a repeated, out-of-order or foreign reply"
        )
    return i


def _scan_quiet(
    buf: bytes | bytearray,
    pos: int,
    n: int,
    width: int,
    low: int,
    starts: NDArray[np.int64],
    sizes: NDArray[np.int64],
    errors: dict[int, bytes],
) -> tuple[int, bool] | None:
    """Scan quiet replies from `pos` (the next can belong to read `low` or later) up to
    the `MN`, filling `starts`, `sizes` and `errors`; returns (the MN's offset,
    whether a hit was found), or None while incomplete."""
    hit = False
    while not buf.startswith(END_REPLY, pos):
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        if buf.startswith(b"VA ", pos):
            header = bytes(buf[pos:nl])
            fields = header[3:].split(b" ")
            token = fields[1][1:] if len(fields) == 2 and fields[1][:1] == b"O" else b""
            if not fields[0].isdigit():
                raise ProtocolError(f"bad quiet meta-get header {header[:80]!r}")
            i = _token_index(token, header, width, low, n, command="meta-get", item="read")
            size = int(fields[0])
            end = _value_end(buf, nl, size, f"read {i}")
            if end is None:
                return None
            starts[i], sizes[i] = nl + 2, size
            hit = True
            low = i + 1
            pos = end
        elif buf.startswith(_ERROR_PREFIXES, pos):
            if low >= n:
                raise ProtocolError(f"more meta-get replies than the {n} reads")
            errors[low] = bytes(buf[pos:nl])  # each error line answers one read
            low += 1
            pos = nl + 2
        else:
            raise ProtocolError(f"unexpected quiet meta-get reply {bytes(buf[pos:nl])[:80]!r}")
    return pos, hit


def parse_mg_quiet(
    buf: bytes | bytearray, pos: int, n: int, *, nbytes: int | None = None
) -> MgReply | None:
    """Parse the replies of n quiet reads (`build_mg_quiet`) from `pos` up to the `MN`.

    Returns None while incomplete; `end` is the offset of the first `MN\\r\\n` at a
    reply boundary: the one that ends these reads, which need not end the buffer
    (a batch may pipeline several groups of quiet reads, each closed by `mn`).
    With `nbytes` (the expected value size) the hits of that size that follow each
    other are decoded as one fixed-stride block, whatever the misses; only what
    follows them (the `MN`, error lines, values of another size) is scanned.

    Raises:
        ProtocolError: a line that is not a quiet meta-get reply, a token that is
            repeated, out of order or out of range (a stale or foreign reply), or
            more replies than reads.
    """
    width = token_width(n)
    starts = np.full(n, -1, dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    errors: dict[int, bytes] = {}
    run = _fixed_quiet_prefix(buf, pos, n, nbytes, width) if nbytes is not None else None
    if nbytes is not None and run is not None and run[0].size:
        index, stride = run
        header_len = stride - nbytes - 2
        starts[index] = pos + header_len + np.arange(index.size, dtype=np.int64) * stride
        sizes[index] = nbytes
        after = pos + index.size * stride
        scanned = _scan_quiet(buf, after, n, width, int(index[-1]) + 1, starts, sizes, errors)
        if scanned is None:
            return None
        end, more_hits = scanned
        return _quiet_reply(starts, sizes, end, 0 if more_hits else stride, errors)
    scanned = _scan_quiet(buf, pos, n, width, 0, starts, sizes, errors)
    return None if scanned is None else _quiet_reply(starts, sizes, scanned[0], 0, errors)


def _quiet_reply(
    starts: NDArray[np.int64],
    sizes: NDArray[np.int64],
    end: int,
    stride: int,
    errors: dict[int, bytes],
) -> MgReply:
    return MgReply(starts=starts, sizes=sizes, end=end, stride=stride, errors=errors, quiet=True)


def parse_ms(buf: bytes | bytearray, pos: int, n: int) -> MsReply | None:
    """Parse the replies of n `ms` commands starting at `pos`; None if incomplete.

    Raises:
        ProtocolError: a line that is not a meta-set reply.
    """
    end = pos + 4 * n
    if len(buf) >= end:
        codes = np.frombuffer(buf, dtype="<u4", count=n, offset=pos)
        if (codes == _HD_U32).all():
            return MsReply(status=np.zeros(n, dtype=np.uint8), end=end)
    status = np.full(n, STATUS_ERROR, dtype=np.uint8)
    errors: dict[int, bytes] = {}
    for i in range(n):
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        line = bytes(buf[pos:nl])
        code = _MS_STATUS.get(line[:2]) if len(line) == 2 or line[2:3] == b" " else None
        if code is not None:
            status[i] = code
        elif line.startswith(_ERROR_PREFIXES):
            errors[i] = line
        else:
            raise ProtocolError(f"unexpected meta-set reply {line[:80]!r}")
        pos = nl + 2
    return MsReply(status=status, end=pos, errors=errors)


def parse_ms_quiet(buf: bytes | bytearray, pos: int, n: int) -> MsReply | None:
    """Parse the replies of n quiet `ms` (overwrites, `build_ms(quiet=True)`) from `pos`
    up to the batch's `MN`; None while incomplete.

    A stored value answers nothing, so what comes before the `MN` are failures, each an
    error line (`SERVER_ERROR out of memory ...`) without a key or token: they are
    `errors` at position 0 (the batch failed; which of its keys is unknown), and
    `status` says STORED for all only when there are none.

    Raises:
        ProtocolError: a line that is neither an error nor the `MN` (an overwrite
            never answers NS, EX or NF).
    """
    errors: dict[int, bytes] = {}
    while not buf.startswith(END_REPLY, pos):
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        line = bytes(buf[pos:nl])
        if not line.startswith(_ERROR_PREFIXES):
            raise ProtocolError(f"unexpected quiet meta-set reply {line[:80]!r}")
        errors.setdefault(0, line)
        pos = nl + 2
    status = np.full(n, STATUS_ERROR if errors else STATUS_STORED, dtype=np.uint8)
    return MsReply(status=status, end=pos, errors=errors)


def parse_ms_quiet_add(buf: bytes | bytearray, pos: int, n: int) -> MsReply | None:
    """Parse the replies of n quiet adds (`build_ms(add=True, quiet=True)`) from `pos` up
    to the `MN` that closes them; None while incomplete.

    A stored value answers nothing; a key that exists answers `NS O<i>` with the
    token of its add (`status[i]` NOT_STORED); a failure answers an error line
    without a token, recorded in `errors` at the lowest position it can belong to.

    Raises:
        ProtocolError: a line that is neither `NS O<i>`, an error nor the `MN`; a token
            that is malformed, repeated, out of order or out of range.
    """
    width = token_width(n)
    status = np.full(n, STATUS_STORED, dtype=np.uint8)
    errors: dict[int, bytes] = {}
    low = 0
    while not buf.startswith(END_REPLY, pos):
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        line = bytes(buf[pos:nl])
        if line.startswith(b"NS O"):
            i = _token_index(line[4:], line, width, low, n, command="meta-set", item="add")
            status[i] = STATUS_NOT_STORED
            low = i + 1
        elif line.startswith(_ERROR_PREFIXES):
            if low >= n:
                raise ProtocolError(f"more meta-set replies than the {n} adds")
            errors.setdefault(low, line)
            status[low] = STATUS_ERROR
            low += 1
        else:
            raise ProtocolError(f"unexpected quiet meta-set reply {line[:80]!r}")
        pos = nl + 2
    return MsReply(status=status, end=pos, errors=errors)


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


@dataclass(slots=True)
class MaReply:
    """The value after each `ma ... v` (uint64; 0 where `errors` has the reply's line)."""

    values: NDArray[np.uint64]
    end: int
    errors: dict[int, bytes] = field(default_factory=dict)


def parse_ma(buf: bytes | bytearray, pos: int, n: int) -> MaReply | None:
    """Parse the replies of n `ma ... v` commands from `pos`; None if incomplete.

    The numbers have any length, so the replies are split at their CRLFs (bytes.split,
    in C) and converted by numpy; error lines fall back to a scan.

    Raises:
        ProtocolError: a line that is not a meta-arithmetic reply.
    """
    lines = bytes(buf[pos:]).split(b"\r\n", 2 * n)
    if len(lines) > 2 * n:
        heads = lines[0 : 2 * n : 2]
        numbers = lines[1 : 2 * n : 2]
        if all(h.startswith(b"VA ") for h in heads) and all(x.isdigit() for x in numbers):
            values = np.array(numbers).astype(np.uint64) if n else np.zeros(0, np.uint64)
            end = pos + sum(map(len, lines[: 2 * n])) + 4 * n
            return MaReply(values=values, end=end)
    values = np.zeros(n, dtype=np.uint64)
    errors: dict[int, bytes] = {}
    for i in range(n):
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        if buf.startswith(b"VA ", pos):
            end = buf.find(b"\r\n", nl + 2)
            if end < 0:
                return None
            number = bytes(buf[nl + 2 : end])
            if not number.isdigit():
                raise ProtocolError(f"bad meta-arithmetic value {number[:80]!r}")
            values[i] = int(number)
            pos = end + 2
        elif buf.startswith(_ERROR_PREFIXES, pos):
            errors[i] = bytes(buf[pos:nl])
            pos = nl + 2
        else:
            raise ProtocolError(f"unexpected meta-arithmetic reply {bytes(buf[pos:nl])[:80]!r}")
    return MaReply(values=values, end=pos, errors=errors)


def build_md(keys: Keys) -> bytes:
    """`md <key>\\r\\n` for every key (answers `HD` deleted / `NF` absent, like `ms`)."""
    key_list = [bytes(k) for k in keys] if isinstance(keys, np.ndarray) else keys
    if not key_list:
        return b""
    return b"md " + b"\r\nmd ".join(key_list) + b"\r\n"


def gather_values(
    buf: bytes | bytearray, reply: MgReply, nbytes: int, *, take: int | None = None
) -> NDArray[np.uint8]:
    """The hit values of an mg reply as a uint8 matrix (n, take); misses are zeros.

    `take` (default `nbytes`): only the first `take` bytes of each value (a row without
    the slots stored behind it). The caller has checked that every hit has exactly
    `nbytes` bytes.
    """
    width = nbytes if take is None else take
    if not 0 <= width <= nbytes:
        raise ValueError(f"take={take} is not within a value of {nbytes} bytes")
    n = reply.starts.shape[0]
    data = np.frombuffer(buf, dtype=np.uint8)
    hits = np.flatnonzero(reply.found)
    if reply.stride and hits.size:
        block = np.lib.stride_tricks.as_strided(
            data[reply.starts[hits[0]] :],
            shape=(hits.size, width),
            strides=(reply.stride, 1),
            writeable=False,
        )
        if hits.size == n:
            return block.copy()
        out = np.zeros((n, width), dtype=np.uint8)
        out[hits] = block
        return out
    out = np.zeros((n, width), dtype=np.uint8)
    if hits.size:
        index = reply.starts[hits][:, None] + np.arange(width, dtype=np.int64)[None, :]
        out[hits] = data[index]
    return out
