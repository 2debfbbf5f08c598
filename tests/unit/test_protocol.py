"""memcached meta protocol (lookup_table.memcached protocol and replies): build, parse batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lookup_table.core.keys import int_key_matrix, key_prefix
from lookup_table.errors import ProtocolError, StoreError
from lookup_table.memcached.batch import ReadGroup, Segment, _one_value
from lookup_table.memcached.protocol import (
    END,
    END_REPLY,
    build_ma_count,
    build_mg,
    build_mg_quiet,
    build_ms,
    build_ms_parts,
    build_ms_rows,
    token_width,
)
from lookup_table.memcached.replies import (
    STATUS_ERROR,
    STATUS_EXISTS,
    STATUS_NOT_FOUND,
    STATUS_NOT_STORED,
    STATUS_STORED,
    MgReply,
    gather_values,
    parse_ma,
    parse_mg,
    parse_mg_quiet,
    parse_ms,
    parse_ms_quiet,
    parse_ms_quiet_add,
)
from tests.strategies import int_id_arrays

pytestmark = pytest.mark.unit

ERROR_LINES = [
    b"SERVER_ERROR out of memory storing object",
    b"SERVER_ERROR object too large for cache",
    b"CLIENT_ERROR bad command line format",
    b"ERROR",
]


@dataclass(frozen=True)
class Err:
    line: bytes


Reply = bytes | None | Err  # a hit's value, a miss, or an error line


def mg_reply(replies: list[Reply]) -> bytes:
    """What memcached answers to one `mg <key> v` per entry, in order."""
    out = []
    for r in replies:
        if r is None:
            out.append(b"EN\r\n")
        elif isinstance(r, Err):
            out.append(r.line + b"\r\n")
        else:
            out.append(b"VA %d\r\n%s\r\n" % (len(r), r))
    return b"".join(out)


def quiet_reply(replies: list[Reply]) -> bytes:
    """What memcached answers to `mg <key> v q O<i>` per entry: hits (with their token)
    and error lines (without one); a miss sends nothing."""
    width = token_width(len(replies))
    out = []
    for i, r in enumerate(replies):
        if isinstance(r, Err):
            out.append(r.line + b"\r\n")
        elif r is not None:
            out.append(b"VA %d O%0*d\r\n%s\r\n" % (len(r), width, i, r))
    return b"".join(out)


def naive_values(replies: list[Reply], nbytes: int) -> np.ndarray:
    out = np.zeros((len(replies), nbytes), dtype=np.uint8)
    for i, r in enumerate(replies):
        if isinstance(r, bytes):
            out[i] = np.frombuffer(r, dtype=np.uint8)
    return out


def key_matrix(ids: np.ndarray) -> np.ndarray:
    return int_key_matrix(key_prefix("demo", "user", "w"), ids)


replies_st = st.lists(
    st.one_of(
        st.binary(max_size=24),
        st.none(),
        st.sampled_from(ERROR_LINES).map(Err),
        # values that look like protocol lines must not confuse the scanner
        st.sampled_from([b"EN\r\n", b"\r\n", b"VA 3\r\nabc\r\n", b"MN\r\n", b"HD\r\n"]),
    ),
    max_size=12,
)


# ------------------------------------------------------------------ building


def test_golden_requests() -> None:
    assert build_mg([b"a/b/w/s1", b"a/b/w/s2"]) == b"mg a/b/w/s1 v\r\nmg a/b/w/s2 v\r\n"
    assert build_ms([b"k1"], [b"\x00\r\n"]) == b"ms k1 3\r\n\x00\r\n\r\n"
    assert build_ms([b"k1"], [b"xy"], add=True) == b"ms k1 2 ME\r\nxy\r\n"
    assert build_ms([b"k1"], [b"xy"], ttl_s=60) == b"ms k1 2 T60\r\nxy\r\n"
    assert build_ms([b"k1"], [b"xy"], ttl_s=60, quiet=True) == b"ms k1 2 T60 q\r\nxy\r\n"
    assert END == b"mn\r\n"
    assert END_REPLY == b"MN\r\n"
    assert build_mg([]) == b""
    assert build_ms([], []) == b""


@given(int_id_arrays(max_size=40))
def test_build_mg_matrix_equals_list_path(ids: np.ndarray) -> None:
    matrix = key_matrix(ids)
    as_list = [bytes(row) for row in matrix]
    assert build_mg(matrix) == build_mg(as_list)
    assert build_mg(matrix).count(b"\r\n") == ids.shape[0]


@given(
    data=st.data(),
    ids=int_id_arrays(max_size=20),
    nbytes=st.integers(0, 40),
    add=st.booleans(),
    ttl_s=st.sampled_from([0, 60, 86_400]),
    quiet=st.booleans(),
    first=st.integers(0, 200),
)
def test_build_ms_matrix_equals_list_path(
    data: st.DataObject,
    ids: np.ndarray,
    nbytes: int,
    add: bool,
    ttl_s: int,
    quiet: bool,
    first: int,
) -> None:
    n = ids.shape[0]
    values = data.draw(arrays(np.uint8, (n, nbytes)))
    matrix = key_matrix(ids)
    keys = [bytes(row) for row in matrix]
    value_list = [bytes(row) for row in values]
    how: dict[str, Any] = {"add": add, "ttl_s": ttl_s, "quiet": quiet, "first": first}
    how["total"] = first + n + 7
    expected = build_ms(keys, value_list, **how)
    assert build_ms(matrix, values, **how) == expected
    assert build_ms(matrix, value_list, **how) == expected  # mixed: Python join
    assert build_ms(keys, values, **how) == expected
    # the flags of each command line (values are skipped by their size: any bytes, " q" too)
    flags = [line.split(b" ")[3:] for line in _ms_command_lines(expected)]
    assert len(flags) == n
    assert all((b"ME" in f) == add for f in flags)
    assert all((b"T%d" % ttl_s in f) == bool(ttl_s) for f in flags)
    assert all((b"q" in f) == quiet for f in flags)
    if quiet and add:  # each add carries its position, padded for the whole batch
        width = token_width(first + n + 7)
        tokens = [f[-1] for f in flags]
        assert tokens == [b"O%0*d" % (width, first + i) for i in range(n)]


def _ms_command_lines(request: bytes) -> list[bytes]:
    """The `ms <key> <size> <flags>` lines of a request, each value skipped by its size."""
    lines: list[bytes] = []
    at = 0
    while at < len(request):
        end = request.index(b"\r\n", at)
        lines.append(request[at:end])
        at = end + 2 + int(request[at:end].split(b" ")[2]) + 2
    return lines


def test_build_ms_golden_quiet_adds_and_overwrites() -> None:
    assert build_ms([b"a", b"bb"], [b"x", b"yy"], add=True, quiet=True, first=9, total=12) == (
        b"ms a 1 ME q O09\r\nx\r\nms bb 2 ME q O10\r\nyy\r\n"
    )
    assert build_ms([b"a"], [b"x"], quiet=True, ttl_s=5) == b"ms a 1 T5 q\r\nx\r\n"
    assert build_ms([b"a"], [b"x"], add=True) == b"ms a 1 ME\r\nx\r\n"
    with pytest.raises(ValueError, match="not in a batch of 2"):
        build_ms([b"a", b"b"], [b"x", b"y"], add=True, quiet=True, first=1, total=2)


def test_build_ms_parts_send_each_value_from_where_it_is() -> None:
    """A journal's or dense log's chunk (a view of the buffer it was encoded into) is a
    part of the request itself, not copied into a joined one; joined, the parts are
    `build_ms`'s request."""
    body = bytes(range(256)) * 4096  # 1 MiB
    chunks = [memoryview(body)[:600_000], memoryview(body)[600_000:]]
    keys = [b"j/0", b"j/1"]
    parts = build_ms_parts(keys, chunks, quiet=True)
    assert any(part is chunks[0] for part in parts)
    assert any(part is chunks[1] for part in parts)
    assert (
        b"".join(parts)
        == build_ms(keys, chunks, quiet=True)
        == (
            b"ms j/0 600000 q\r\n"
            + body[:600_000]
            + b"\r\nms j/1 448576 q\r\n"
            + body[600_000:]
            + b"\r\n"
        )
    )
    matrix = np.frombuffer(body[:64], dtype=np.uint8).reshape(4, 16)
    (one,) = build_ms_parts(key_matrix(np.arange(4, dtype=np.int64)), matrix)
    assert bytes(one) == build_ms(key_matrix(np.arange(4, dtype=np.int64)), matrix)


@given(
    data=st.data(),
    widths=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), min_size=1, max_size=4),
    ttl_s=st.sampled_from([0, 60, 86_400]),
)
def test_build_ms_rows_equals_building_each_segment(
    data: st.DataObject, widths: list[tuple[int, int]], ttl_s: int
) -> None:
    """A flush's request laid out from the value matrices (rows picked by index, in any
    order, repeated or not, key widths and value sizes of each segment its own) is the
    quiet overwrites `build_ms_parts` builds from the gathered values, joined."""
    segments = []
    expected = b""
    for extra, nbytes in widths:
        n = data.draw(st.integers(0, 12))
        keys = data.draw(arrays(np.uint8, (n, 17 + extra)))
        values = data.draw(arrays(np.uint8, (data.draw(st.integers(max(n, 1), 20)), nbytes)))
        index = np.asarray(
            data.draw(st.lists(st.integers(0, values.shape[0] - 1), min_size=n, max_size=n)),
            dtype=np.intp,
        )
        segments.append((keys, values, index))
        expected += b"".join(
            bytes(p) for p in build_ms_parts(keys, values[index], quiet=True, ttl_s=ttl_s)
        )
    got = build_ms_rows(segments, ttls=[ttl_s] * len(segments))
    assert bytes(got) == expected
    strided = [(k, v[:, ::-1], i) for k, v, i in segments]  # not contiguous: copied first
    assert bytes(build_ms_rows(strided, ttls=[ttl_s] * len(segments))) == b"".join(
        bytes(p)
        for k, v, i in strided
        for p in build_ms_parts(k, np.ascontiguousarray(v[i]), quiet=True, ttl_s=ttl_s)
    )


def test_build_ms_rows_refuses_what_would_read_past_its_arrays() -> None:
    keys = key_matrix(np.arange(3, dtype=np.int64))
    values = np.zeros((3, 8), dtype=np.uint8)
    assert bytes(build_ms_rows([(keys, values, np.array([2, 0, 1]))], ttls=[0])).count(b"ms ") == 3
    with pytest.raises(ValueError, match="value rows 0..3 of 3"):
        build_ms_rows([(keys, values, np.array([0, 1, 3]))])
    with pytest.raises(ValueError, match="value rows -1..1 of 3"):
        build_ms_rows([(keys, values, np.array([-1, 0, 1]))])
    with pytest.raises(ValueError, match="3 keys but 2 value rows"):
        build_ms_rows([(keys, values, np.array([0, 1]))])
    with pytest.raises(ValueError, match="1 segments but 2 ttls"):
        build_ms_rows([(keys, values, np.array([0, 1, 2]))], ttls=[0, 0])


def test_build_ms_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        build_ms([b"a", b"b"], [b"x"])


# ------------------------------------------------------------------ parse_mg


def test_all_hits_take_the_fixed_stride_fast_path() -> None:
    values = [bytes([i]) * 8 for i in range(5)]
    buf = mg_reply(values) + END_REPLY
    reply = parse_mg(buf, 0, 5, nbytes=8)
    assert reply is not None
    assert reply.stride == len(b"VA 8\r\n") + 8 + 2
    assert reply.errors == {}
    assert reply.found.all()
    assert reply.sizes.tolist() == [8] * 5
    assert [buf[s : s + 8] for s in reply.starts.tolist()] == values
    assert reply.end == len(buf) - len(END_REPLY)
    assert buf[reply.end :] == END_REPLY
    assert gather_values(buf, reply, 8).tobytes() == b"".join(values)


def test_fast_path_after_a_sentinel_reply() -> None:
    sentinel = mg_reply([b'{"created": 1}'])
    rows = [b"\x01\x02\x03\x04", b"\r\n\r\n"]
    buf = sentinel + mg_reply(rows)
    head = parse_mg(buf, 0, 1)
    assert head is not None
    reply = parse_mg(buf, head.end, 2, nbytes=4)
    assert reply is not None
    assert reply.stride == len(b"VA 4\r\n") + 4 + 2
    assert gather_values(buf, reply, 4).tobytes() == b"".join(rows)
    assert reply.end == len(buf)


def test_all_hits_without_nbytes_are_scanned() -> None:
    values = [b"abcd", b"efgh"]
    reply = parse_mg(mg_reply(values), 0, 2)
    assert reply is not None
    assert reply.stride == 0
    assert reply.starts.tolist() == [6, 18]


def test_mixed_hits_and_misses() -> None:
    replies: list[Reply] = [b"aaaa", None, b"bbbb", None, None, b"cccc"]
    buf = mg_reply(replies)
    reply = parse_mg(buf, 0, 6, nbytes=4)
    assert reply is not None
    assert reply.stride == 0
    assert reply.found.tolist() == [True, False, True, False, False, True]
    assert reply.starts[~reply.found].tolist() == [-1, -1, -1]
    assert reply.sizes.tolist() == [4, 0, 4, 0, 0, 4]
    assert reply.end == len(buf)
    assert gather_values(buf, reply, 4).tobytes() == naive_values(replies, 4).tobytes()


def test_all_misses() -> None:
    reply = parse_mg(b"EN\r\n" * 3, 0, 3, nbytes=4)
    assert reply is not None
    assert not reply.found.any()
    assert gather_values(b"EN\r\n" * 3, reply, 4).tolist() == [[0] * 4] * 3


def test_hits_of_another_size_are_reported_not_reshaped() -> None:
    # A value of the wrong length must reach the caller (CorruptValueError), not
    # be sliced at the expected size.
    buf = mg_reply([b"aaaa", b"bbbbbbbb", b"cccc"])
    reply = parse_mg(buf, 0, 3, nbytes=4)
    assert reply is not None
    assert reply.stride == 0
    assert reply.sizes.tolist() == [4, 8, 4]
    assert buf[reply.starts[1] : reply.starts[1] + 8] == b"bbbbbbbb"


def test_error_lines_are_recorded_by_position() -> None:
    replies: list[Reply] = [b"aaaa", Err(ERROR_LINES[0]), None, Err(b"ERROR"), b"bbbb"]
    buf = mg_reply(replies)
    reply = parse_mg(buf, 0, 5, nbytes=4)
    assert reply is not None
    assert reply.errors == {1: ERROR_LINES[0], 3: b"ERROR"}
    assert reply.found.tolist() == [True, False, False, False, True]
    assert reply.end == len(buf)


def test_zero_replies() -> None:
    reply = parse_mg(b"MN\r\n", 0, 0, nbytes=4)
    assert reply is not None
    assert reply.end == 0
    assert reply.starts.shape == (0,)
    assert gather_values(b"MN\r\n", reply, 4).shape == (0, 4)


@given(replies_st, st.integers(0, 3), st.booleans())
def test_parse_mg_matches_the_replies(replies: list[Reply], lead: int, with_nbytes: bool) -> None:
    prefix = b"x" * lead  # earlier replies in the same buffer
    buf = prefix + mg_reply(replies) + END_REPLY
    reply = parse_mg(buf, lead, len(replies), nbytes=4 if with_nbytes else None)
    assert reply is not None
    assert buf[reply.end :] == END_REPLY
    for i, r in enumerate(replies):
        if isinstance(r, bytes):
            start, size = int(reply.starts[i]), int(reply.sizes[i])
            assert buf[start : start + size] == r
        else:
            assert reply.starts[i] == -1
        assert reply.errors.get(i) == (r.line if isinstance(r, Err) else None)


@given(replies_st, st.data())
def test_any_prefix_of_a_reply_is_incomplete_never_an_error(
    replies: list[Reply], data: st.DataObject
) -> None:
    buf = mg_reply(replies)
    nbytes = data.draw(st.sampled_from([None, 0, 4, 8]))
    for cut in range(len(buf)):
        assert parse_mg(buf[:cut], 0, len(replies), nbytes=nbytes) is None, cut
    assert parse_mg(buf, 0, len(replies), nbytes=nbytes) is not None


@pytest.mark.parametrize("nbytes", [4, 8])
def test_every_truncation_point_of_an_all_hit_batch(nbytes: int) -> None:
    buf = mg_reply([b"\r\n" * (nbytes // 2)] * 3)
    for cut in range(len(buf)):
        assert parse_mg(bytearray(buf[:cut]), 0, 3, nbytes=nbytes) is None, cut


@pytest.mark.parametrize(
    "buf",
    [
        b"XX\r\n",
        b"HD\r\n",  # a meta-set reply
        b"VA\r\n",
        b"VA x\r\n",
        b"VA -2\r\n",  # int() would accept it
        b"VA +2\r\nab\r\n",
        b"VA 1_0\r\n0123456789\r\n",
        b"VA  2\r\nab\r\n",
        b"VA 3\r\nabcXY",  # no CRLF after the value
        b"VA 3\r\nabcd\r\n",  # value longer than announced
        b"ENX\r\n",
        b"EN \r\n",
        b"END\r\n",  # the text protocol's end marker
        b"\r\n",
    ],
    ids=repr,
)
def test_garbage_raises_protocol_error(buf: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_mg(buf, 0, 1)
    assert isinstance(info.value, StoreError)


@pytest.mark.parametrize("nbytes", [None, 4])
def test_value_not_followed_by_crlf_raises_even_when_aligned(nbytes: int | None) -> None:
    # Every header sits where the fixed-stride layout expects it, but the first
    # value ends in "XX": the fast path must not slice it as a row.
    buf = b"VA 4\r\nabcdXXVA 4\r\nefgh\r\n"
    with pytest.raises(ProtocolError, match="reply 0 is not followed by CRLF"):
        parse_mg(buf, 0, 2, nbytes=nbytes)


def test_garbage_after_good_replies_raises() -> None:
    with pytest.raises(ProtocolError, match="unexpected meta-get reply b'OOPS'"):
        parse_mg(mg_reply([b"abcd", None]) + b"OOPS\r\n", 0, 3, nbytes=4)


# ------------------------------------------------------------------ parse_ms


def test_all_stored_takes_the_fast_path() -> None:
    buf = b"HD\r\n" * 1000 + END_REPLY
    reply = parse_ms(buf, 0, 1000)
    assert reply is not None
    assert (reply.status == STATUS_STORED).all()
    assert reply.status.dtype == np.uint8
    assert reply.end == 4000
    assert reply.errors == {}


def test_ms_statuses_by_position() -> None:
    buf = b"HD\r\nNS\r\nEX\r\nNF\r\nHD\r\n"
    reply = parse_ms(b"..." + buf, 3, 5)
    assert reply is not None
    assert reply.status.tolist() == [
        STATUS_STORED,
        STATUS_NOT_STORED,
        STATUS_EXISTS,
        STATUS_NOT_FOUND,
        STATUS_STORED,
    ]
    assert reply.end == 3 + len(buf)


def test_ms_server_error_out_of_memory_is_recorded() -> None:
    oom = b"SERVER_ERROR out of memory storing object"
    buf = b"HD\r\n" + oom + b"\r\nNS\r\nCLIENT_ERROR bad data chunk\r\n"
    reply = parse_ms(buf, 0, 4)
    assert reply is not None
    assert reply.status.tolist() == [STATUS_STORED, STATUS_ERROR, STATUS_NOT_STORED, STATUS_ERROR]
    assert reply.errors == {1: oom, 3: b"CLIENT_ERROR bad data chunk"}
    assert reply.end == len(buf)


def test_ms_status_with_flags_is_read() -> None:
    reply = parse_ms(b"HD k1\r\nNS k2\r\n", 0, 2)
    assert reply is not None
    assert reply.status.tolist() == [STATUS_STORED, STATUS_NOT_STORED]


ms_lines = st.lists(st.sampled_from([b"HD", b"NS", b"EX", b"NF", *ERROR_LINES]), max_size=12)


@given(ms_lines)
def test_parse_ms_matches_the_replies_and_every_prefix_is_incomplete(lines: list[bytes]) -> None:
    codes = {
        b"HD": STATUS_STORED,
        b"NS": STATUS_NOT_STORED,
        b"EX": STATUS_EXISTS,
        b"NF": STATUS_NOT_FOUND,
    }
    buf = b"".join(line + b"\r\n" for line in lines)
    reply = parse_ms(buf + END_REPLY, 0, len(lines))
    assert reply is not None
    assert reply.status.tolist() == [codes.get(line, STATUS_ERROR) for line in lines]
    assert reply.errors == {i: line for i, line in enumerate(lines) if line not in codes}
    assert reply.end == len(buf)
    for cut in range(len(buf)):
        assert parse_ms(buf[:cut], 0, len(lines)) is None, cut


@pytest.mark.parametrize(
    "buf", [b"VA 4\r\nabcd\r\n", b"EN\r\n", b"HDX\r\n", b"STORED\r\n", b"H\r\n", b"\r\n"], ids=repr
)
def test_ms_garbage_raises_protocol_error(buf: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_ms(buf, 0, 1)


# ------------------------------------------------------------------ parse_ms_quiet


def test_quiet_ms_that_stored_everything_answers_only_mn() -> None:
    reply = parse_ms_quiet(b"..." + END_REPLY, 3, 1000)
    assert reply is not None
    assert (reply.status == STATUS_STORED).all() and reply.status.shape == (1000,)
    assert reply.end == 3 and reply.errors == {}
    assert parse_ms_quiet(b"...MN\r", 3, 5) is None  # the MN not complete yet


@given(st.lists(st.sampled_from(ERROR_LINES), min_size=1, max_size=6))
def test_quiet_ms_failures_fail_the_batch_and_every_prefix_is_incomplete(
    lines: list[bytes],
) -> None:
    buf = b"".join(line + b"\r\n" for line in lines)
    reply = parse_ms_quiet(buf + END_REPLY, 0, 3)
    assert reply is not None
    assert reply.errors == {0: lines[0]}  # no key or token: the batch failed
    assert (reply.status == STATUS_ERROR).all()
    assert reply.end == len(buf)
    for cut in range(len(buf) + len(END_REPLY)):
        assert parse_ms_quiet((buf + END_REPLY)[:cut], 0, 3) is None, cut


@pytest.mark.parametrize("buf", [b"HD\r\nMN\r\n", b"NS\r\nMN\r\n", b"VA 1\r\nx\r\n"], ids=repr)
def test_quiet_ms_garbage_raises_protocol_error(buf: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_ms_quiet(buf, 0, 1)


# ------------------------------------------------------------------ parse_ms_quiet_add


@given(
    n=st.integers(1, 150),
    data=st.data(),
)
def test_quiet_adds_answer_only_the_keys_that_exist_and_every_prefix_is_incomplete(
    n: int, data: st.DataObject
) -> None:
    lost = sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    width = token_width(n)
    buf = b"".join(b"NS O%0*d\r\n" % (width, i) for i in lost) + END_REPLY
    reply = parse_ms_quiet_add(b"xy" + buf, 2, n)
    assert reply is not None and reply.errors == {}
    assert np.flatnonzero(reply.status == STATUS_NOT_STORED).tolist() == lost
    assert (np.delete(reply.status, lost) == STATUS_STORED).all()
    assert reply.end == 2 + len(buf) - len(END_REPLY)
    for cut in range(len(buf)):
        assert parse_ms_quiet_add(buf[:cut], 0, n) is None, cut


def test_quiet_add_failures_are_errors_at_the_lowest_position_they_can_be() -> None:
    buf = b"NS O03\r\nSERVER_ERROR out of memory storing object\r\nMN\r\n"
    reply = parse_ms_quiet_add(buf, 0, 12)
    assert reply is not None
    assert reply.errors == {4: b"SERVER_ERROR out of memory storing object"}
    assert reply.status[3] == STATUS_NOT_STORED and reply.status[4] == STATUS_ERROR


@pytest.mark.parametrize(
    "buf",
    [
        b"HD\r\nMN\r\n",  # a stored add answers nothing
        b"NS\r\nMN\r\n",  # no token
        b"NS O1\r\nMN\r\n",  # a token of the wrong width (12 adds: 2 digits)
        b"NS O12\r\nMN\r\n",  # out of range
        b"NS O05\r\nNS O05\r\nMN\r\n",  # repeated
        b"NS O05\r\nNS O02\r\nMN\r\n",  # out of order
        b"NS Oab\r\nMN\r\n",
        b"VA 1\r\nx\r\n",
    ],
    ids=repr,
)
def test_quiet_add_garbage_raises_protocol_error(buf: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_ms_quiet_add(buf, 0, 12)


# ------------------------------------------------------------------ gather_values


@given(
    st.lists(st.one_of(st.binary(min_size=6, max_size=6), st.none()), max_size=20),
    st.integers(0, 5),
)
def test_gather_values_matches_a_naive_slice(replies: list[Reply], lead: int) -> None:
    buf = b"z" * lead + mg_reply(replies)
    reply = parse_mg(buf, lead, len(replies), nbytes=6)
    assert reply is not None
    if replies and all(r is not None for r in replies):
        assert reply.stride  # the fast path was taken
    got = gather_values(buf, reply, 6)
    assert got.dtype == np.uint8
    assert got.shape == (len(replies), 6)
    assert got.tobytes() == naive_values(replies, 6).tobytes()


@given(
    st.lists(st.one_of(st.binary(min_size=6, max_size=6), st.none()), max_size=20),
    st.integers(0, 6),
)
def test_gather_values_can_take_the_leading_bytes_of_each_value(
    replies: list[Reply], take: int
) -> None:
    """A row read from an item that also holds its slots: only the row's bytes."""
    buf = mg_reply(replies)
    reply = parse_mg(buf, 0, len(replies), nbytes=6)
    assert reply is not None
    got = gather_values(buf, reply, 6, take=take)
    assert got.shape == (len(replies), take)
    assert got.tobytes() == naive_values(replies, 6)[:, :take].tobytes()


def test_gather_values_refuses_to_take_more_than_a_value() -> None:
    reply = parse_mg(mg_reply([b"abcd"]), 0, 1, nbytes=4)
    assert reply is not None
    with pytest.raises(ValueError, match="take=5"):
        gather_values(mg_reply([b"abcd"]), reply, 4, take=5)


def test_gather_values_returns_an_owned_copy() -> None:
    buf = bytearray(mg_reply([b"abcd", b"efgh"]))
    reply = parse_mg(buf, 0, 2, nbytes=4)
    assert isinstance(reply, MgReply)
    got = gather_values(buf, reply, 4)
    buf[:] = b"\x00" * len(buf)  # the receive buffer gets reused
    assert got.tobytes() == b"abcdefgh"
    assert got.flags.writeable


def test_all_misses_take_the_vectorized_path_and_match_the_scan() -> None:
    n = 1000
    buf = b"EN\r\n" * n + END_REPLY
    reply = parse_mg(buf, 0, n, nbytes=64)
    assert reply is not None and not reply.found.any() and reply.end == 4 * n
    # one hit at the end: the fast path must not claim it
    mixed = b"EN\r\n" * (n - 1) + b"VA 2\r\nab\r\n" + END_REPLY
    reply = parse_mg(mixed, 0, n, nbytes=2)
    assert reply is not None and reply.found.tolist() == [False] * (n - 1) + [True]
    assert parse_mg(b"EN\r\n" * (n - 1), 0, n) is None  # incomplete


# ------------------------------------------------------------------ quiet reads


def test_golden_quiet_requests() -> None:
    assert build_mg_quiet([b"a/b/w/s1", b"a/b/w/s2"]) == (
        b"mg a/b/w/s1 v q O0\r\nmg a/b/w/s2 v q O1\r\n"
    )
    keys = [b"k%d" % i for i in range(11)]
    request = build_mg_quiet(keys)
    assert request.startswith(b"mg k0 v q O00\r\nmg k1 v q O01\r\n")
    assert request.endswith(b"mg k10 v q O10\r\n")
    assert build_mg_quiet([]) == b""
    assert [token_width(n) for n in (0, 1, 2, 10, 11, 100, 101, 16_384, 100_001)] == [
        1, 1, 1, 1, 2, 2, 3, 5, 6,
    ]  # fmt: skip


def test_golden_quiet_request_of_int_keys() -> None:
    matrix = key_matrix(np.array([7, -1], dtype=np.int64))
    assert build_mg_quiet(matrix) == (
        b"mg " + matrix[0].tobytes() + b" v q O0\r\nmg " + matrix[1].tobytes() + b" v q O1\r\n"
    )


@given(int_id_arrays(max_size=120))
def test_build_mg_quiet_matrix_equals_list_path(ids: np.ndarray) -> None:
    matrix = key_matrix(ids)
    as_list = [bytes(row) for row in matrix]
    request = build_mg_quiet(matrix)
    assert request == build_mg_quiet(as_list)
    width = token_width(ids.shape[0])
    expected = b"".join(b"mg %s v q O%0*d\r\n" % (k, width, i) for i, k in enumerate(as_list))
    assert request == expected


quiet_values = st.one_of(
    st.binary(min_size=4, max_size=4),
    # rows that look like protocol lines must not confuse the parsers
    st.sampled_from([b"MN\r\n", b"EN\r\n", b"\r\n\r\n", b"VA 4", b"O1\r\n"]),
)
quiet_replies_st = st.lists(
    st.one_of(
        quiet_values,
        st.none(),
        st.sampled_from(ERROR_LINES).map(Err),
        st.binary(max_size=9),  # a value of another size (corrupt) or blob
    ),
    max_size=40,
)
hit_miss_st = st.lists(st.one_of(quiet_values, st.none()), max_size=40)


@given(quiet_replies_st, st.integers(0, 3), st.sampled_from([None, 4]))
def test_parse_mg_quiet_agrees_with_the_loop_parser(
    replies: list[Reply], lead: int, nbytes: int | None
) -> None:
    """The quiet parse finds what the (non-quiet) per-reply loop finds, reply by reply."""
    n = len(replies)
    loud_buf = mg_reply(replies) + END_REPLY
    loud = parse_mg(loud_buf, 0, n)
    buf = b"x" * lead + quiet_reply(replies) + END_REPLY
    quiet = parse_mg_quiet(buf, lead, n, nbytes=nbytes)
    assert loud is not None and quiet is not None
    assert quiet.quiet and buf[quiet.end :] == END_REPLY
    assert quiet.found.tolist() == loud.found.tolist()
    assert quiet.sizes.tolist() == loud.sizes.tolist()
    for i in np.flatnonzero(quiet.found).tolist():
        start, size = int(quiet.starts[i]), int(quiet.sizes[i])
        assert buf[start : start + size] == replies[i]
    # Error lines carry no token: the same lines in the same order, each at the lowest
    # position it can have (after the last hit, one read per error line since), which is
    # never after its own.
    assert list(quiet.errors.values()) == list(loud.errors.values())
    for got, true in zip(quiet.errors, loud.errors, strict=True):
        hit_before = max((h for h in np.flatnonzero(loud.found).tolist() if h < true), default=-1)
        assert got == hit_before + 1 + sum(1 for e in loud.errors if hit_before < e < true)
        assert got <= true
    if nbytes is not None and all(len(r) == nbytes for r in replies if isinstance(r, bytes)):
        assert (
            gather_values(buf, quiet, nbytes).tobytes() == naive_values(replies, nbytes).tobytes()
        )


@given(hit_miss_st, st.integers(0, 3))
def test_hits_of_one_size_take_the_vectorized_path_whatever_the_misses(
    replies: list[Reply], lead: int
) -> None:
    n = len(replies)
    buf = b"z" * lead + quiet_reply(replies) + END_REPLY
    reply = parse_mg_quiet(buf, lead, n, nbytes=4)
    assert reply is not None
    hits = [i for i, r in enumerate(replies) if r is not None]
    if hits:
        assert reply.stride == len(b"VA 4 O\r\n") + token_width(n) + 4 + 2  # no scan
    assert np.flatnonzero(reply.found).tolist() == hits
    assert reply.errors == {} and reply.quiet
    assert reply.end == len(buf) - len(END_REPLY)
    got = gather_values(buf, reply, 4)
    assert got.shape == (n, 4) and got.flags.writeable
    assert got.tobytes() == naive_values(replies, 4).tobytes()


@given(quiet_replies_st, st.sampled_from([None, 4]))
def test_any_prefix_of_a_quiet_reply_is_incomplete_never_an_error(
    replies: list[Reply], nbytes: int | None
) -> None:
    buf = quiet_reply(replies) + END_REPLY
    for cut in range(len(buf)):
        assert parse_mg_quiet(buf[:cut], 0, len(replies), nbytes=nbytes) is None, cut
    assert parse_mg_quiet(buf, 0, len(replies), nbytes=nbytes) is not None


def test_quiet_all_misses_and_no_reads() -> None:
    reply = parse_mg_quiet(END_REPLY, 0, 3, nbytes=4)
    assert reply is not None and not reply.found.any() and reply.end == 0
    assert gather_values(END_REPLY, reply, 4).tolist() == [[0] * 4] * 3
    reply = parse_mg_quiet(b"..." + END_REPLY, 3, 0, nbytes=4)
    assert reply is not None and reply.starts.shape == (0,) and reply.end == 3


def test_quiet_large_mixed_batch_is_one_block() -> None:
    n = 16_384
    rng = np.random.default_rng(0)
    hit = rng.random(n) < 0.9
    rows = rng.integers(0, 256, size=(n, 64), dtype=np.uint8)
    replies: list[Reply] = [rows[i].tobytes() if hit[i] else None for i in range(n)]
    buf = quiet_reply(replies) + END_REPLY
    reply = parse_mg_quiet(buf, 0, n, nbytes=64)
    assert reply is not None and reply.stride == len(b"VA 64 O00000\r\n") + 64 + 2
    assert (reply.found == hit).all()
    expected = np.where(hit[:, None], rows, 0)
    assert (gather_values(buf, reply, 64) == expected).all()


def test_quiet_wrong_size_is_reported_not_sliced() -> None:
    # A value of another length must reach the caller (CorruptValueError), never a miss.
    buf = quiet_reply([b"aaaa", None, b"bbbbbbbb", b"cccc"]) + END_REPLY
    reply = parse_mg_quiet(buf, 0, 4, nbytes=4)
    assert reply is not None
    assert reply.stride == 0
    assert reply.sizes.tolist() == [4, 0, 8, 4]
    assert buf[reply.starts[2] : reply.starts[2] + 8] == b"bbbbbbbb"


def test_quiet_error_lines_are_recorded_at_their_lowest_position() -> None:
    oom = b"SERVER_ERROR out of memory writing get response"
    buf = quiet_reply([b"aaaa", None, Err(oom), None, Err(b"ERROR"), b"bbbb"]) + END_REPLY
    reply = parse_mg_quiet(buf, 0, 6, nbytes=4)
    assert reply is not None and reply.quiet
    assert reply.errors == {1: oom, 2: b"ERROR"}
    assert reply.found.tolist() == [True, False, False, False, False, True]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"VA 4 O1\r\nabcd\r\nVA 4 O1\r\nabcd\r\n", "read 1 after replies up to read 1"),
        (b"VA 4 O2\r\nabcd\r\nVA 4 O1\r\nabcd\r\n", "read 1 after replies up to read 2"),
        (b"VA 4 O3\r\nabcd\r\n", "read 3 after"),  # out of range: only 3 reads
        (b"ERROR\r\nVA 4 O0\r\nabcd\r\n", "read 0 after replies up to read 0"),
        (b"ERROR\r\nERROR\r\nERROR\r\nERROR\r\n", "more meta-get replies than the 3"),
        (b"EN\r\n", "unexpected quiet meta-get reply b'EN'"),  # a non-quiet miss
        (b"HD O1\r\n", "unexpected quiet meta-get reply"),
        (b"VA 4\r\nabcd\r\n", "bad quiet meta-get header"),  # no token
        (b"VA 4 O01\r\nabcd\r\n", "bad quiet meta-get header"),  # token of another width
        (b"VA 4 Ox\r\nabcd\r\n", "bad quiet meta-get header"),
        (b"VA 4 k1\r\nabcd\r\n", "bad quiet meta-get header"),
        (b"VA 4 O1 k\r\nabcd\r\n", "bad quiet meta-get header"),
        (b"VA -4 O1\r\nabcd\r\n", "bad quiet meta-get header"),
        (b"VA 4 O1\r\nabcdXX", "value of read 1 is not followed by CRLF"),
        (b"VA 4 O1\r\nabcd\r\n\r\n", "unexpected quiet meta-get reply b''"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("nbytes", [None, 4])
def test_quiet_garbage_or_stale_replies_raise(body: bytes, match: str, nbytes: int | None) -> None:
    with pytest.raises(ProtocolError, match=match) as info:
        parse_mg_quiet(body + END_REPLY, 0, 3, nbytes=nbytes)
    assert isinstance(info.value, StoreError)


def test_quiet_duplicate_hits_in_one_block_are_not_taken_by_the_fast_path() -> None:
    # Every header sits where the stride expects it, but a token repeats: a stale or
    # doubled reply must not be decoded as two rows.
    buf = b"VA 4 O0\r\nabcd\r\nVA 4 O0\r\nefgh\r\n" + END_REPLY
    with pytest.raises(ProtocolError, match="read 0 after replies up to read 0"):
        parse_mg_quiet(buf, 0, 2, nbytes=4)


def test_quiet_reply_after_the_end_marker_is_left_to_the_caller() -> None:
    # parse stops at the first MN at a reply boundary; the store raises on what follows.
    buf = quiet_reply([b"abcd", None]) + END_REPLY + b"VA 4 O1\r\nefgh\r\n" + END_REPLY
    reply = parse_mg_quiet(buf, 0, 2, nbytes=4)
    assert reply is not None
    assert buf[reply.end :] != END_REPLY
    assert reply.found.tolist() == [True, False]


# ------------------------------------------------------------------ groups of quiet reads
# A multi-table batch pipelines one group of quiet reads per (table, kind), each closed
# by `mn`: every group parses on its own up to its MN, wherever it sits in the buffer.


def grouped_reply(groups: list[list[Reply]]) -> bytes:
    return b"".join(quiet_reply(g) + END_REPLY for g in groups)


def parse_groups(buf: bytes, pos: int, groups: list[tuple[int, int | None]]) -> list[MgReply]:
    """Parse (n, nbytes) groups one after the other, as the store does; [] if incomplete."""
    out = []
    for k, (n, nbytes) in enumerate(groups):
        if k:
            pos += len(END_REPLY)
        reply = parse_mg_quiet(buf, pos, n, nbytes=nbytes)
        if reply is None:
            return []
        out.append(reply)
        pos = reply.end
    return out


group_st = st.integers(1, 12).flatmap(
    lambda nbytes: st.tuples(
        st.just(nbytes),
        st.lists(
            st.one_of(
                st.binary(min_size=nbytes, max_size=nbytes),
                st.none(),
                # values that look like protocol lines must not confuse the parsers
                st.sampled_from([b"MN\r\n" * 3, b"VA 4 O0\r\n" * 2, b"\r\n" * 6]).map(
                    lambda v: v[:nbytes]
                ),
            ),
            max_size=30,
        ),
    )
)


@given(st.lists(group_st, min_size=1, max_size=5), st.integers(0, 3))
def test_groups_of_quiet_reads_parse_each_as_alone(
    groups: list[tuple[int, list[Reply]]], lead: int
) -> None:
    buf = b"x" * lead + grouped_reply([g for _, g in groups])
    replies = parse_groups(buf, lead, [(len(g), nbytes) for nbytes, g in groups])
    assert len(replies) == len(groups)
    assert buf[replies[-1].end :] == END_REPLY
    for (nbytes, group), reply in zip(groups, replies, strict=True):
        alone_buf = quiet_reply(group) + END_REPLY
        alone = parse_mg_quiet(alone_buf, 0, len(group), nbytes=nbytes)
        assert alone is not None
        assert reply.found.tolist() == alone.found.tolist()
        assert reply.sizes.tolist() == alone.sizes.tolist()
        assert reply.errors == alone.errors == {}
        if any(r is not None for r in group):
            assert reply.stride == alone.stride != 0  # hits of one size: no scan
        got = gather_values(buf, reply, nbytes)
        assert got.tobytes() == naive_values(group, nbytes).tobytes()


@given(st.lists(group_st, min_size=1, max_size=4))
def test_any_prefix_of_grouped_replies_is_incomplete_never_an_error(
    groups: list[tuple[int, list[Reply]]],
) -> None:
    """Also a prefix that ends with a group's MN: the next groups are still to come."""
    buf = grouped_reply([g for _, g in groups])
    shape = [(len(g), nbytes) for nbytes, g in groups]
    for cut in range(len(buf)):
        replies = parse_groups(buf[:cut], 0, shape)
        assert replies == [] or buf[:cut][replies[-1].end :] != END_REPLY, cut
    assert len(parse_groups(buf, 0, shape)) == len(groups)


def test_a_group_with_a_wrong_size_or_an_error_line_scans_only_after_its_run() -> None:
    oom = b"SERVER_ERROR out of memory writing get response"
    groups: list[list[Reply]] = [
        [b"aaaa", b"bbbb", b"cc", None, b"dddd"],  # a value of another size in the middle
        [b"eeeeeeee", Err(oom), None],
        [None, b"ffffffff"],
    ]
    buf = grouped_reply(groups)
    first, second, third = parse_groups(buf, 0, [(5, 4), (3, 8), (2, 8)])
    assert first.sizes.tolist() == [4, 4, 2, 0, 4] and first.stride == 0
    assert buf[first.starts[2] : first.starts[2] + 2] == b"cc"
    assert second.found.tolist() == [True, False, False] and second.errors == {1: oom}
    assert third.found.tolist() == [False, True] and third.stride != 0
    assert buf[third.end :] == END_REPLY


def test_quiet_tails_are_cached_per_token_width_and_exact_for_every_size() -> None:
    for n in (1, 2, 9, 10, 11, 99, 100, 101, 999, 1000, 1001, 16_384, 16_385, 3):
        keys = [b"k"] * n
        request = build_mg_quiet(keys)
        width = token_width(n)
        assert request.startswith(b"mg k v q O%s\r\n" % (b"0" * width))
        assert request.endswith(b"mg k v q O%0*d\r\n" % (width, n - 1))
        assert len(request) == n * (len(b"mg k v q O\r\n") + width)


@given(st.lists(st.integers(0, 30), max_size=6), st.booleans())
def test_a_group_built_in_pieces_is_the_group_built_at_once(sizes: list[int], matrix: bool) -> None:
    """The reads of several tables with one value size are one group, numbered across them."""
    total = sum(sizes)
    ids = np.arange(total, dtype=np.int64)
    keys = key_matrix(ids)
    whole = build_mg_quiet(keys if matrix else [bytes(k) for k in keys])
    pieces, first = [], 0
    for n in sizes:
        piece = keys[first : first + n]
        pieces.append(
            build_mg_quiet(piece if matrix else [bytes(k) for k in piece], first=first, total=total)
        )
        first += n
    assert b"".join(pieces) == whole


def test_a_piece_must_fit_in_its_group() -> None:
    with pytest.raises(ValueError, match="reads 1 .. 2 are not in a group of 2"):
        build_mg_quiet([b"a", b"b"], first=1, total=2)


# ------------------------------------------------------------------ lifecycle: TTL, counters


def test_build_mg_quiet_with_a_ttl_sends_the_t_flag_before_the_token() -> None:
    assert build_mg_quiet([b"k1", b"k22"], exptime=3) == (
        b"mg k1 T3 v q O0\r\nmg k22 T3 v q O1\r\n"
    )
    matrix = np.frombuffer(b"k1k2", dtype=np.uint8).reshape(2, 2)
    assert build_mg_quiet(matrix, first=1, total=12, exptime=90) == (
        b"mg k1 T90 v q O01\r\nmg k2 T90 v q O02\r\n"
    )
    assert build_mg_quiet([b"k1"], exptime=0) == b"mg k1 v q O0\r\n"  # no TTL: no T flag


def test_build_ma_count() -> None:
    keys = np.frombuffer(b"c1c2", dtype=np.uint8).reshape(2, 2)
    assert build_ma_count(keys, 60) == b"ma c1 N60 J1 T60 v\r\nma c2 N60 J1 T60 v\r\n"
    assert build_ma_count([], 60) == b""


def test_parse_ma_counts_and_errors() -> None:
    buf = b"xxVA 1\r\n1\r\nVA 2\r\n17\r\nVA 20\r\n18446744073709551615\r\nMN\r\n"
    reply = parse_ma(buf, 2, 3)
    assert reply is not None
    assert reply.values.dtype == np.uint64
    assert reply.values.tolist() == [1, 17, 2**64 - 1]
    assert buf[reply.end :] == b"MN\r\n"
    assert parse_ma(buf[:-12], 2, 3) is None  # incomplete
    empty = parse_ma(b"MN\r\n", 0, 0)
    assert empty is not None and (empty.values.shape, empty.end) == ((0,), 0)
    mixed = b"VA 1\r\n3\r\nSERVER_ERROR out of memory\r\nVA 1\r\n2\r\nMN\r\n"
    got = parse_ma(mixed, 0, 3)
    assert got is not None
    assert got.values.tolist() == [3, 0, 2]
    assert got.errors == {1: b"SERVER_ERROR out of memory"}
    assert mixed[got.end :] == b"MN\r\n"
    with pytest.raises(ProtocolError, match="unexpected meta-arithmetic reply"):
        parse_ma(b"HD\r\nMN\r\n", 0, 1)
    with pytest.raises(ProtocolError, match="bad meta-arithmetic value"):
        parse_ma(b"VA 2\r\n-1\r\nMN\r\n", 0, 1)


def test_a_read_groups_segments_of_one_key_width_are_built_as_one_request() -> None:
    """`ReadGroup.request` (the store's quiet reads of many tables on one node) joins
    segments one after another whose keys have one width and TTL: the bytes are exactly
    those of one `build_mg_quiet` per segment, numbered across the group."""

    def keys(width: int, n: int, fill: int) -> np.ndarray:
        return np.full((n, width), ord("a") + fill, dtype=np.uint8)

    segments = [
        Segment(0, np.arange(3), keys(10, 3, 0)),
        Segment(1, np.arange(2), keys(10, 2, 1)),
        Segment(2, np.arange(4), keys(11, 4, 2)),
        Segment(3, np.arange(2), [b"var-1", b"variable-2"]),
        Segment(4, np.arange(1), keys(11, 1, 3), exptime=5),
        Segment(5, np.arange(2), keys(11, 2, 4), exptime=5),
        Segment(6, np.arange(1), keys(11, 1, 5)),
    ]
    starts = np.cumsum([0, *(s.index.shape[0] for s in segments)]).tolist()
    group = ReadGroup(64, segments, starts[:-1], starts[-1])
    expected = [
        build_mg_quiet(s.keys, first=start, total=group.n, exptime=s.exptime)
        for s, start in zip(segments, starts, strict=False)
    ]
    request = group.request()
    assert b"".join(request) == b"".join(expected)
    assert len(request) == 5  # widths 10 | 11 | str | 11 with a TTL | 11


@pytest.mark.parametrize(
    "reply",
    [
        b'VA 14\r\n{"created": 1}\r\n',
        b"VA 3 f0\r\nabc\r\nMN\r\n",
        b"VA 0\r\n\r\n",
        b"VA 3\r\nab",  # incomplete
        b"VA 3\r\nabcd\r\n",  # not followed by CRLF
        b"VA -2\r\nab\r\n",
        b"VA\r\n",
        b"EN\r\n",
        b"SERVER_ERROR out of memory\r\n",
    ],
)
def test_a_sentinel_reply_reads_as_the_full_parser_reads_it(reply: bytes) -> None:
    """`_one_value` (the sentinel read every batch starts with) gives what
    `parse_mg` gives for a complete `VA` reply, and leaves everything else to it."""
    fast = _one_value(reply)
    try:
        full = parse_mg(reply, 0, 1)
    except ProtocolError:
        full = None
    if full is None or full.errors or not full.found[0]:
        assert fast is None
        return
    start, size = int(full.starts[0]), int(full.sizes[0])
    assert fast == (reply[start : start + size], full.end)
