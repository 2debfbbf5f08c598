"""One node's request of a store batch: the mg/ms/md framing and its reply errors.

A batch is one pipelined round trip (`node.Node.roundtrip`): the node's data-loss
sentinel read in front (`Sentinel`, the store's), the commands, then `mn`. Here the
replies are parsed (`replies`), checked (sentinel, completeness, error lines) and
turned into results or the errors of `lookup_table.errors`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.rows import ROW_DTYPE
from lookup_table.errors import (
    CorruptValueError,
    DataLossError,
    ProtocolError,
    StoreError,
    StoreFullError,
)
from lookup_table.memcached import protocol
from lookup_table.memcached.node import Node
from lookup_table.memcached.protocol import Keys, Wire
from lookup_table.memcached.replies import (
    STATUS_STORED,
    MaReply,
    MgReply,
    MsReply,
    gather_values,
    parse_ma,
    parse_mg,
    parse_mg_quiet,
    parse_ms,
    parse_ms_quiet,
    parse_ms_quiet_add,
)

__all__ = [
    "ReadGroup",
    "ReadPart",
    "Segment",
    "Sentinel",
    "Values",
    "batch",
    "key_text",
    "md",
    "mg_blobs",
    "mg_rows",
    "ms",
    "num_keys",
]


class _Reply(Protocol):
    @property
    def end(self) -> int: ...


T = TypeVar("T")
R = TypeVar("R", bound=_Reply)

Values: TypeAlias = "tuple[NDArray[np.uint8], NDArray[np.intp]] | Sequence[Wire]"
"""A write segment's values: rows `index` of a value matrix (matrix, index), or blobs."""


class Sentinel(Protocol):
    """The data-loss sentinel a batch reads in front of its commands (the store's)."""

    @property
    def key(self) -> bytes: ...

    def verified(self, address: str) -> bool:
        """Whether the node's sentinel (and so its storage format) was checked."""
        ...

    def accept(self, address: str, value: bytes) -> None:
        """Check the storage format a node's sentinel records; the node is then verified."""
        ...

    def lost(self, node: Node, *, writes: bool) -> DataLossError:
        """What a batch raises that found `node`'s sentinel gone."""
        ...


class ReadPart(Protocol):
    """What a group of fixed-width reads needs of a part: its value size, bytes kept."""

    @property
    def nbytes(self) -> int: ...

    @property
    def kept(self) -> int: ...


@dataclass(slots=True, eq=False)
class Segment:
    """The ids of one part that go to one node in one round trip, and their keys."""

    part: int
    index: NDArray[np.intp]  # positions in the part's ids
    keys: Keys
    exptime: int = 0


@dataclass(slots=True, eq=False)
class _Replies:
    """The quiet-read replies of the segments of one round trip; `end` is the final MN."""

    replies: list[MgReply]
    end: int


@dataclass(slots=True, eq=False)
class _WriteReplies:
    """The replies of a write round trip: its `ms`, then its `ma`; `end` is the final MN."""

    sets: MsReply
    counts: MaReply
    end: int


@dataclass(slots=True, eq=False)
class ReadGroup:
    """The segments of one round trip whose values have one size: one group of quiet reads.

    Its reads are numbered across the segments (`starts[k]` is segment k's first).
    """

    nbytes: int
    segments: list[Segment]
    starts: list[int]
    n: int
    take: int = 0  # the leading bytes of each value its parts keep, at most

    @classmethod
    def of(cls, parts: Sequence[ReadPart], segments: Sequence[Segment]) -> list[ReadGroup]:
        by_size: dict[int, ReadGroup] = {}
        for s in segments:
            part = parts[s.part]
            group = by_size.get(part.nbytes)
            if group is None:
                group = by_size[part.nbytes] = cls(part.nbytes, [], [], 0)
            group.segments.append(s)
            group.starts.append(group.n)
            group.n += s.index.shape[0]
            group.take = max(group.take, part.kept)
        return list(by_size.values())

    def request(self) -> list[bytes]:
        """The group's quiet reads, numbered across its segments. Segments one after
        another whose keys are a matrix of one width (and one TTL) are built as one: a
        read of 26 tables costs a few calls per node, not one per table and node."""
        out: list[bytes] = []
        run: list[Segment] = []
        first = 0

        def flush() -> None:
            if run:
                keys = run[0].keys if len(run) == 1 else np.concatenate([s.keys for s in run])
                exptime = run[0].exptime
                out.append(
                    protocol.build_mg_quiet(keys, first=first, total=self.n, exptime=exptime)
                )
                run.clear()

        for s, start in zip(self.segments, self.starts, strict=True):
            if not (
                run
                and isinstance(s.keys, np.ndarray)
                and isinstance(run[0].keys, np.ndarray)
                and s.keys.shape[1] == run[0].keys.shape[1]
                and s.exptime == run[0].exptime
            ):
                flush()
                first = start
            run.append(s)
        flush()
        return out

    def segment_at(self, i: int) -> tuple[Segment, int]:
        """The segment of read i of the group, and i's position in it."""
        k = bisect.bisect_right(self.starts, i) - 1
        return self.segments[k], i - self.starts[k]

    def key_text(self, i: int) -> str:
        segment, local = self.segment_at(i)
        return key_text(segment.keys, local)


def num_keys(keys: Keys) -> int:
    return keys.shape[0] if isinstance(keys, np.ndarray) else len(keys)


def key_text(keys: Keys, i: int) -> str:
    key = keys[i].tobytes() if isinstance(keys, np.ndarray) else keys[i]
    return key.decode("ascii", "replace")


async def batch(
    node: Node,
    commands: Sequence[protocol.Wire],
    parse_reply: Callable[[bytes, int], R | None],
    finish: Callable[[bytes, R], T],
    *,
    sentinel: Sentinel | None,
    writes: bool = False,
) -> T:
    """One pipelined round trip: [sentinel read] + `commands` (in parts) + `mn`.

    `parse_reply(data, pos)` parses the commands' replies from `pos` (None while
    incomplete); the sentinel and completeness are checked here once for every
    kind of batch, then `finish(data, reply)` checks the replies' error lines and
    builds the result. `sentinel`: the sentinel read in front (None: none).
    """
    if sentinel is not None and writes and not sentinel.verified(node.address):
        await _verify_format(node, sentinel)
    request = [protocol.build_mg([sentinel.key]), *commands] if sentinel else list(commands)

    def parse(data: bytes) -> T | None:
        pos = _check_sentinel(node, data, sentinel, writes=writes) if sentinel else 0
        if pos is None:
            return None
        reply = parse_reply(data, pos)
        if reply is None or data[reply.end :] != protocol.END_REPLY:
            _incomplete(node, data, reply)  # raises on replies beyond the commands
            return None
        return finish(data, reply)

    return await node.roundtrip(request, parse)


def _check_sentinel(
    node: Node, data: bytes, sentinel: Sentinel, *, writes: bool = False
) -> int | None:
    """Parse the sentinel reply at the start of `data`; return the offset after it.

    The commands pipelined behind the sentinel read ran whatever it found: the writes
    of a batch (`writes`) may have reached a node that has lost its data.
    """
    found = _one_value(data)
    if found is None:  # not the common reply (or not all here): the full parser decides
        reply = parse_mg(data, 0, 1)
        if reply is None:
            return None
        if reply.errors:
            raise StoreError(
                f"memcached node {node.address} answered {reply.errors[0]!r}", node=node.address
            )
        if not reply.found[0]:
            raise sentinel.lost(node, writes=writes)
        start, size = int(reply.starts[0]), int(reply.sizes[0])
        found = (data[start : start + size], reply.end)
    value, end = found
    sentinel.accept(node.address, value)
    return end


def _one_value(data: bytes) -> tuple[bytes, int] | None:
    """The value and end of a `VA <size>` reply at the start of `data`, complete; None
    for anything else. Every batch reads a sentinel in front: a few string operations
    here, where `parse_mg`'s arrays are built for many replies."""
    if not data.startswith(b"VA "):
        return None
    nl = data.find(b"\r\n", 3)
    digits = data[3:nl].split(b" ", 1)[0] if nl > 0 else b""
    if not digits.isdigit():
        return None
    start = nl + 2
    end = start + int(digits)
    if data[end : end + 2] != b"\r\n":
        return None
    return data[start:end], end + 2


async def _verify_format(node: Node, sentinel: Sentinel) -> None:
    """Before the first write batch sent to `node` (unless a read checked it before):
    read its sentinel alone and check its storage format, so that no write of this
    version lands on another format's data. A read batch checks the sentinel it
    reads in front (`_check_sentinel`) before it parses anything. (A missing
    sentinel is left to the batch's own sentinel read.)"""
    (value,) = await mg_blobs(node, [sentinel.key], sentinel=None)
    if value is not None:
        sentinel.accept(node.address, value)


async def mg_rows(
    node: Node,
    parts: Sequence[ReadPart],
    segments: list[Segment],
    results: list[tuple[NDArray[Any], NDArray[np.bool_]]],
    *,
    sentinel: Sentinel | None,
    describe: Callable[[int, int], tuple[str, str]],
) -> None:
    """Quiet fixed-width reads of `segments` in one round trip: one group per value size.

    The segments whose values have one size (rows of every table of one dim, say)
    are one group of quiet reads, numbered across the segments, closed by `mn`, so
    their hits parse as one fixed-stride block (replies.parse_mg_quiet) whatever
    the tables and the misses (which send nothing); the `mn` marks where the
    group's replies end. The sentinel read in front is not quiet, so its miss is
    an explicit EN. Only the leading bytes of each value that a part keeps are
    copied out (rows without their slots). `describe(part, position)`: the table of
    an id of a part and what its values should hold, for a CorruptValueError.
    """
    groups = ReadGroup.of(parts, segments)

    def parse_reply(data: bytes, pos: int) -> _Replies | None:
        replies: list[MgReply] = []
        for k, group in enumerate(groups):
            if k:
                pos += len(protocol.END_REPLY)  # the MN that closed the group before
            reply = parse_mg_quiet(data, pos, group.n, nbytes=group.nbytes)
            if reply is None:
                return None
            replies.append(reply)
            pos = reply.end
        return _Replies(replies, end=pos)

    def finish(data: bytes, got: _Replies) -> _Replies:  # not None: None means "incomplete"
        for group, reply in zip(groups, got.replies, strict=True):
            if reply.errors:
                i, line = next(iter(reply.errors.items()))
                # A quiet read's error line carries no token: it answers this key or a
                # later one.
                key = f"{group.key_text(i)!r} or a later key of the batch"
                _raise_reply_error(node, key, line)
        for group, reply in zip(groups, got.replies, strict=True):
            bad = np.flatnonzero(reply.found & (reply.sizes != group.nbytes))
            if bad.size:
                i = int(bad[0])
                segment, local = group.segment_at(i)
                table, expected = describe(segment.part, int(segment.index[local]))
                raise CorruptValueError(
                    f"value of key {group.key_text(i)!r} of table {table!r} "
                    f"on memcached node {node.address} has {int(reply.sizes[i])} bytes, "
                    f"expected {expected}: the table's dim or optimizer "
                    f"changed or the value is corrupt; restore the table's dim and "
                    f"optimizer or use a new table name",
                    node=node.address,
                )
        for group, reply in zip(groups, got.replies, strict=True):
            raw = gather_values(data, reply, group.nbytes, take=group.take)
            found = reply.found
            for s, start in zip(group.segments, group.starts, strict=True):
                end = start + s.index.shape[0]
                values_out, found_out = results[s.part]
                # a uint8 result keeps the stored bytes (rows of 2-byte floats: decoded after)
                words = raw if values_out.dtype == np.uint8 else raw.view(ROW_DTYPE)
                values_out[s.index] = words[start:end, : values_out.shape[1]]
                found_out[s.index] = found[start:end]
        return got

    commands: list[bytes] = []
    for k, group in enumerate(groups):
        if k:
            commands.append(protocol.END)  # closes the group before
        commands.extend(group.request())
    await batch(node, commands, parse_reply, finish, sentinel=sentinel)


async def mg_blobs(node: Node, keys: Keys, *, sentinel: Sentinel | None) -> list[bytes | None]:
    n = num_keys(keys)

    def finish(data: bytes, reply: MgReply) -> list[bytes | None]:
        _raise_reply_errors(node, keys, reply.errors)
        return [
            data[s : s + z] if s >= 0 else None
            for s, z in zip(reply.starts.tolist(), reply.sizes.tolist(), strict=True)
        ]

    return await batch(
        node,
        [protocol.build_mg(keys)],
        lambda data, pos: parse_mg(data, pos, n),
        finish,
        sentinel=sentinel,
    )


async def ms(
    node: Node,
    segments: Sequence[tuple[Keys, Values]],
    *,
    add: bool,
    sentinel: Sentinel | None,
    exptimes: Sequence[int] | None = None,
    counts: Sequence[tuple[Keys, int]] = (),
) -> tuple[list[NDArray[np.bool_]], list[NDArray[np.uint64]]]:
    """`ms` of every (keys, values) segment, then `ma` (count one sighting) of every
    (keys, exptime) of `counts`, in one round trip.

    Returns the stored flags per segment and the counts per `counts` entry. The
    `ms` are quiet: memcached answers only failures, and an add whose key exists
    (`NS` with its position's token: `parse_ms_quiet_add`), so a batch of stored
    values costs no reply lines (each line is a wake-up of this loop as they
    trickle in); an `mn` closes them, then the `ma` replies follow. A failure
    line names no key: any fails the batch. `exptimes[k]` > 0 gives segment k's
    items that TTL (memcached's T flag, `core.expiry.exptime`).
    """
    sizes = [num_keys(keys) for keys, _ in segments]
    bounds = list(itertools.accumulate(sizes, initial=0))
    count_sizes = [num_keys(keys) for keys, _ in counts]
    count_bounds = list(itertools.accumulate(count_sizes, initial=0))

    def set_key(i: int) -> str:
        k = int(np.searchsorted(bounds, i, side="right")) - 1
        return key_text(segments[k][0], i - bounds[k])

    def parse_reply(data: bytes, pos: int) -> _WriteReplies | None:
        parse = parse_ms_quiet_add if add else parse_ms_quiet
        sets = parse(data, pos, bounds[-1])
        if sets is None:
            return None
        after = sets.end + (len(protocol.END_REPLY) if counts else 0)  # the sets' mn
        mas = parse_ma(data, after, count_bounds[-1])
        return None if mas is None else _WriteReplies(sets, mas, mas.end)

    def finish(
        data: bytes, got: _WriteReplies
    ) -> tuple[list[NDArray[np.bool_]], list[NDArray[np.uint64]]]:
        reply = got.sets
        if got.counts.errors:
            i, line = next(iter(got.counts.errors.items()))
            k = int(np.searchsorted(count_bounds, i, side="right")) - 1
            _raise_reply_error(node, repr(key_text(counts[k][0], i - count_bounds[k])), line)
        if reply.errors:
            i, line = next(iter(reply.errors.items()))
            # a quiet failure names no key: one of the batch's failed (an add's: this
            # one or a later one)
            key = f"one of {bounds[-1] - i} keys (the first {set_key(i)!r})"
            _raise_reply_error(node, key, line)
        # without error lines a quiet reply holds only STORED, and an add's NOT_STORED
        ok: NDArray[np.bool_] = np.equal(reply.status, STATUS_STORED)
        values = got.counts.values
        return (
            [ok[bounds[k] : bounds[k + 1]] for k in range(len(segments))],
            [values[count_bounds[k] : count_bounds[k + 1]] for k in range(len(counts))],
        )

    ttls = [0] * len(segments) if exptimes is None else exptimes
    commands: list[protocol.Wire] = []
    rows = [(k, *v) for k, v in segments if isinstance(k, np.ndarray) and isinstance(v, tuple)]
    if rows and len(rows) == len(segments) and not add:
        # fixed-width keys and rows of value matrices: laid out from where the values
        # are, in one buffer (protocol.build_ms_rows)
        commands.append(protocol.build_ms_rows(rows, ttls=ttls))
    else:
        for (k, v), t, b in zip(segments, ttls, bounds, strict=False):
            values = v[0][v[1]] if isinstance(v, tuple) else v
            commands += protocol.build_ms_parts(
                k, values, add=add, ttl_s=t, quiet=True, first=b, total=bounds[-1]
            )
    if counts:  # the quiet sets end at this mn; the counts' replies follow it
        commands.append(protocol.END)
        commands += [protocol.build_ma_count(k, t) for k, t in counts]
    return await batch(node, commands, parse_reply, finish, sentinel=sentinel, writes=True)


async def md(node: Node, keys: Keys, *, sentinel: Sentinel | None) -> NDArray[np.bool_]:
    n = num_keys(keys)

    def finish(data: bytes, reply: MsReply) -> NDArray[np.bool_]:
        _raise_reply_errors(node, keys, reply.errors)
        existed: NDArray[np.bool_] = np.equal(reply.status, STATUS_STORED)
        return existed

    return await batch(
        node,
        [protocol.build_md(keys)],
        lambda data, pos: parse_ms(data, pos, n),
        finish,
        sentinel=sentinel,
    )


def _incomplete(node: Node, data: bytes, reply: object) -> None:
    if reply is not None and len(data) > getattr(reply, "end", 0) + len(protocol.END_REPLY):
        raise ProtocolError(
            f"memcached node {node.address} sent more replies than commands",
            node=node.address,
        )


def _raise_reply_errors(node: Node, keys: Keys, errors: dict[int, bytes]) -> None:
    """Raise for the first error line of a reply that has one line per key."""
    if errors:
        i, line = next(iter(errors.items()))
        _raise_reply_error(node, repr(key_text(keys, i)), line)


def _raise_reply_error(node: Node, key: str, line: bytes) -> None:
    if b"out of memory" in line:
        raise StoreFullError(
            f"memcached node {node.address} is out of memory (started with -M) and refused "
            f"key {key}: {line.decode('ascii', 'replace')}. Add memory (-m) or nodes; "
            f"rows already stored stay readable",
            node=node.address,
        )
    raise StoreError(
        f"memcached node {node.address} refused key {key}: {line.decode('ascii', 'replace')}",
        node=node.address,
    )
