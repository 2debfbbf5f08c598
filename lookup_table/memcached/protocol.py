"""memcached's meta protocol for pipelined batches (pure: builds bytes, parses bytes).

No async client pipelines a whole batch, so this is the one place where we speak
the protocol ourselves (memcached >= 1.6, `doc/protocol.txt`, "Meta Commands").
A batch to one node is one write::

    mg <sentinel key> v\\r\\n          (optional: the node's data-loss sentinel)
    mg <key> v\\r\\n   x n             (read)   or   ms <key> <len> [ME]\\r\\n<data>\\r\\n x n
    mn\\r\\n                           (end marker: memcached answers MN\\r\\n)

We do not use the quiet flag: every command then has exactly one reply, in
order, so replies map to keys by position (no `k`/`O` echo to parse) and a batch
of fixed-size rows where every key hits is one fixed-stride block
`VA <4*dim>\\r\\n<row>\\r\\n` x n that numpy checks and slices without a Python
loop. Misses (`EN\\r\\n`) or errors fall back to a per-reply scan. Writes answer
`HD\\r\\n` (stored) / `NS\\r\\n` (add lost the race) per key, checked as one
uint32 comparison when all are `HD`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
from numpy.typing import NDArray

from lookup_table.errors import ProtocolError

__all__ = [
    "END",
    "END_REPLY",
    "Keys",
    "MgReply",
    "MsReply",
    "STATUS_ERROR",
    "STATUS_EXISTS",
    "STATUS_NOT_FOUND",
    "STATUS_NOT_STORED",
    "STATUS_STORED",
    "build_md",
    "build_mg",
    "build_ms",
    "gather_values",
    "parse_mg",
    "parse_ms",
]

Keys: TypeAlias = "NDArray[np.uint8] | list[bytes]"
"""Keys of a batch: a uint8 matrix (n, key_len) of fixed-width keys, or a list of bytes."""

END = b"mn\r\n"
END_REPLY = b"MN\r\n"
_CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)
_HD_U32 = np.frombuffer(b"HD\r\n", dtype="<u4")[0]
_EN_U32 = np.frombuffer(b"EN\r\n", dtype="<u4")[0]

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


def build_ms(
    keys: Keys, values: NDArray[np.uint8] | list[bytes], *, add: bool = False, ttl_s: int = 0
) -> bytes:
    """`ms <key> <len> [ME] [T<ttl>]\\r\\n<value>\\r\\n` for every key.

    `add` (mode E) stores only if the key is absent; `ttl_s` > 0 makes the item
    expire after that many seconds. Fixed-width keys with a fixed-width value
    matrix (n, nbytes) are laid out with numpy; anything else is joined in Python.
    """
    mode = (b" ME" if add else b"") + (b" T%d" % ttl_s if ttl_s > 0 else b"")
    if isinstance(keys, np.ndarray) and isinstance(values, np.ndarray):
        n, width = keys.shape
        nbytes = values.shape[1]
        head = b" %d%s\r\n" % (nbytes, mode)
        stride = 3 + width + len(head) + nbytes + 2
        out = np.empty((n, stride), dtype=np.uint8)
        out[:, :3] = np.frombuffer(b"ms ", dtype=np.uint8)
        out[:, 3 : 3 + width] = keys
        col = 3 + width
        out[:, col : col + len(head)] = np.frombuffer(head, dtype=np.uint8)
        col += len(head)
        out[:, col : col + nbytes] = values
        out[:, col + nbytes :] = _CRLF
        return out.tobytes()
    key_list = [bytes(k) for k in keys] if isinstance(keys, np.ndarray) else keys
    value_list = [v.tobytes() for v in values] if isinstance(values, np.ndarray) else values
    if len(key_list) != len(value_list):
        raise ValueError(f"{len(key_list)} keys but {len(value_list)} values")
    parts: list[bytes] = []
    for key, value in zip(key_list, value_list, strict=True):
        parts.append(b"ms %s %d%s\r\n" % (key, len(value), mode))
        parts.append(value)
        parts.append(b"\r\n")
    return b"".join(parts)


@dataclass(slots=True)
class MgReply:
    """Positions of the values in a reply buffer, one entry per `mg`.

    `starts[i]` is the offset of value i in the buffer, or -1 on a miss;
    `sizes[i]` its length. `stride` is set when every key hit with the same
    size, so the values are a strided view. `errors` maps positions whose reply
    was an error line to that line.
    """

    starts: NDArray[np.int64]
    sizes: NDArray[np.int64]
    end: int
    stride: int = 0
    errors: dict[int, bytes] = field(default_factory=dict)

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
    total = len(buf)
    for i in range(n):
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return None
        if buf.startswith(b"VA ", pos):
            header = buf[pos + 3 : nl].split(b" ", 1)
            if not header[0].isdigit():  # int() would also take b"-2", b" 8", b"1_0"
                raise ProtocolError(f"bad meta-get header {bytes(buf[pos:nl])!r}")
            size = int(header[0])
            start = nl + 2
            if total < start + size + 2:
                return None
            if buf[start + size : start + size + 2] != b"\r\n":
                raise ProtocolError(f"value of reply {i} is not followed by CRLF")
            starts[i], sizes[i] = start, size
            pos = start + size + 2
        elif nl == pos + 2 and buf.startswith(b"EN", pos):
            pos = nl + 2
        elif buf.startswith((b"SERVER_ERROR", b"CLIENT_ERROR", b"ERROR"), pos):
            errors[i] = bytes(buf[pos:nl])
            pos = nl + 2
        else:
            raise ProtocolError(f"unexpected meta-get reply {bytes(buf[pos:nl])[:80]!r}")
    return MgReply(starts=starts, sizes=sizes, end=pos, errors=errors)


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
        elif line.startswith((b"SERVER_ERROR", b"CLIENT_ERROR", b"ERROR")):
            errors[i] = line
        else:
            raise ProtocolError(f"unexpected meta-set reply {line[:80]!r}")
        pos = nl + 2
    return MsReply(status=status, end=pos, errors=errors)


def build_md(keys: Keys) -> bytes:
    """`md <key>\\r\\n` for every key (answers `HD` deleted / `NF` absent, like `ms`)."""
    key_list = [bytes(k) for k in keys] if isinstance(keys, np.ndarray) else keys
    if not key_list:
        return b""
    return b"md " + b"\r\nmd ".join(key_list) + b"\r\n"


def gather_values(buf: bytes | bytearray, reply: MgReply, nbytes: int) -> NDArray[np.uint8]:
    """The hit values of an mg reply as a uint8 matrix (n, nbytes); misses are zeros.

    The caller has checked that every hit has exactly `nbytes` bytes.
    """
    n = reply.starts.shape[0]
    data = np.frombuffer(buf, dtype=np.uint8)
    if reply.stride:
        block = np.lib.stride_tricks.as_strided(
            data[reply.starts[0] :],
            shape=(n, nbytes),
            strides=(reply.stride, 1),
            writeable=False,
        )
        return block.copy()
    out = np.zeros((n, nbytes), dtype=np.uint8)
    hits = np.flatnonzero(reply.found)
    if hits.size:
        index = reply.starts[hits][:, None] + np.arange(nbytes, dtype=np.int64)[None, :]
        out[hits] = data[index]
    return out
