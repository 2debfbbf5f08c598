"""memcached's meta protocol, the replies: where each value of a pipelined batch is, the
status of each write, the number after each `ma` (pure: bytes in, numpy out).

Hits of one value size that follow each other are decoded as one fixed-stride block
without a Python loop; what is left (misses, error lines, values of another size) is
scanned. A quiet reply's tokens must rise strictly, or it is a stale or foreign reply
(`ProtocolError`). The requests are `protocol`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from lookup_table.errors import ProtocolError
from lookup_table.memcached.protocol import CRLF, END_REPLY, token_width

__all__ = [
    "STATUS_ERROR",
    "STATUS_EXISTS",
    "STATUS_NOT_FOUND",
    "STATUS_NOT_STORED",
    "STATUS_STORED",
    "MaReply",
    "MgReply",
    "MsReply",
    "gather_values",
    "parse_ma",
    "parse_mg",
    "parse_mg_quiet",
    "parse_ms",
    "parse_ms_quiet",
    "parse_ms_quiet_add",
]


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
    if not ((block[:, : len(header)] == head).all() and (block[:, -2:] == CRLF).all()):
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
        & (block[:, header_len - 2 : header_len] == CRLF).all(axis=1)
        & (block[:, -2:] == CRLF).all(axis=1)
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
