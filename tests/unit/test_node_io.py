"""The pooled connection of `lookup_table.memcached.node`: how a request is cut into
writes and how a reply is received, against a scripted peer on loopback (the bytes and
their cutting into TCP segments are the test's to choose, which a real memcached's are
not; tests/integration run the same code against real nodes)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_table.config import NodeSpec, StoreConfig
from lookup_table.errors import NodeUnavailableError
from lookup_table.memcached.node import _WRITE_SLICE, Node, _Conn, _slices
from lookup_table.memcached.protocol import END, END_REPLY

pytestmark = pytest.mark.unit

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * _WRITE_SLICE) | st.integers(0, 300), max_size=12))
def test_slices_send_the_parts_exactly_in_writes_of_about_a_slice(sizes: list[int]) -> None:
    parts = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    pieces = list(_slices(parts))
    assert b"".join(bytes(p) for p in pieces) == b"".join(parts)
    assert all(len(p) > 0 for p in pieces)
    # a write is at most a slice, or a run of small parts closed as it passed a slice
    assert all(len(p) < _WRITE_SLICE + _WRITE_SLICE // 4 for p in pieces)
    big = [p for p in parts if len(p) >= _WRITE_SLICE // 4]
    views = [p for p in pieces if isinstance(p, memoryview)]
    assert sum(len(v) for v in views) == sum(len(p) for p in big)  # big parts: not copied


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """Everything up to and including the request's closing `mn`."""
    return await reader.readuntil(END)


@pytest.fixture
async def peer() -> AsyncIterator[Callable[[Script], Awaitable[Node]]]:
    """`await peer(script)`: a Node whose connections are served by `script(reader,
    writer, n)` (n: the how-manieth connection, from 0)."""
    servers: list[asyncio.Server] = []
    nodes: list[Node] = []

    async def start(script: Script) -> Node:
        count = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal count
            n, count = count, count + 1
            try:
                await script(reader, writer, n)
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 24)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        node = Node(NodeSpec(host="127.0.0.1", port=port), StoreConfig(timeout_s=5.0, pool_size=2))
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        await node.close()
    for server in servers:
        server.close()
        await server.wait_closed()


def _until_end(data: bytes) -> bytes | None:
    """A parse that wants the whole reply: the last line is `MN` after a `VA` value."""
    return data if data.endswith(b"\r\n" + END_REPLY) or data == END_REPLY else None


async def test_a_reply_ending_in_mn_inside_a_value_is_read_on(peer) -> None:
    value = b"x" * 1000 + END_REPLY  # a value that ends in "MN\r\n"
    reply = b"VA %d\r\n" % len(value) + value + b"\r\n" + END_REPLY
    cut = reply.index(END_REPLY) + len(END_REPLY)  # a segment ends right after it
    seen: list[bytes] = []

    async def script(reader, writer, n) -> None:
        await _read_request(reader)
        writer.write(reply[:cut])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(reply[cut:])
        await writer.drain()
        await reader.read()

    node = await peer(script)

    def parse(data: bytes) -> bytes | None:
        seen.append(data)
        return data if data == reply else None

    assert await node.roundtrip([b"mg k v\r\n"], parse) == reply
    assert seen == [reply[:cut], reply]  # asked again only once more bytes came


async def test_a_big_request_arrives_whole_and_the_connection_is_reused(peer) -> None:
    # build_ms hands out views of its numpy buffer: big and small ones are sent as bytes are
    laid_out = np.resize(np.frombuffer(b"0123456789xyz", np.uint8), (_WRITE_SLICE // 4 + 5, 8))
    parts = [
        b"a" * 10,
        b"b" * (3 * _WRITE_SLICE + 17),
        b"c" * 5,
        laid_out.reshape(-1).data,
        b"d" * (_WRITE_SLICE // 3),
        laid_out[:3].reshape(-1).data,
    ]
    got: list[bytes] = []
    node = await peer(_recording(got, b"HD\r\n" * 3 + END_REPLY))
    for _ in range(2):
        assert await node.roundtrip(parts, _until_end_or_hd) == b"HD\r\n" * 3 + END_REPLY
    assert got == [b"".join(parts) + END] * 2


@pytest.mark.parametrize("size", [1, _WRITE_SLICE - len(END) - 12, _WRITE_SLICE - len(END) + 1])
async def test_a_request_up_to_a_slice_is_written_at_once_beyond_it_from_a_task(
    peer, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of at most one slice (memcached's `mn` included) is written at once,
    without a task; one byte more goes out from a task, slice by slice. Both arrive whole,
    in order, byte for byte (a view among the parts too), and the connection is reused."""
    view = np.frombuffer(b"0123456789ab", np.uint8).data
    parts = [b"x" * size, view] if size > 1 else [b"x", view, b"y" * 7]
    got: list[bytes] = []
    tasks = 0
    send = _Conn.send

    def counted(conn: _Conn, request: Any) -> Any:
        nonlocal tasks
        tasks += 1
        return send(conn, request)

    monkeypatch.setattr(_Conn, "send", counted)
    node = await peer(_recording(got, b"HD\r\n" + END_REPLY))
    for _ in range(3):
        assert await node.roundtrip(parts, _until_end_or_hd) == b"HD\r\n" + END_REPLY
    assert got == [b"".join(bytes(p) for p in parts) + END] * 3
    assert tasks == (3 if sum(len(p) for p in parts) + len(END) > _WRITE_SLICE else 0)


def _recording(got: list[bytes], reply: bytes) -> Script:
    """A peer that appends each whole request (through its `mn`) to `got` and answers
    `reply`, until the client closes the connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            try:
                got.append(await _read_request(reader))
            except asyncio.IncompleteReadError:
                return
            writer.write(reply)
            await writer.drain()

    return script


def _until_end_or_hd(data: bytes) -> bytes | None:
    return data if data.endswith(END_REPLY) else None


async def test_a_peer_closing_mid_reply_is_node_unavailable(peer) -> None:
    async def script(reader, writer, n) -> None:
        await _read_request(reader)
        writer.write(b"VA 100\r\n" + b"y" * 40)
        await writer.drain()

    node = await peer(script)
    with pytest.raises(NodeUnavailableError, match="closed the connection mid-reply"):
        await node.roundtrip([b"mg k v\r\n"], _until_end)


async def test_a_connection_reset_mid_reply_names_the_socket_error(peer) -> None:
    """A reset (not a clean close) mid-reply: the socket's error is in the message."""

    async def script(reader, writer, n) -> None:
        await _read_request(reader)
        writer.write(b"VA 100\r\n" + b"y" * 40)
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # close with linger 0: the peer sees a reset

    node = await peer(script)
    with pytest.raises(NodeUnavailableError, match="failed mid-request: .*reset"):
        await node.roundtrip([b"mg k v\r\n"], _until_end)


async def test_a_pooled_connection_closed_by_the_node_is_replaced(peer) -> None:
    """The node restarts while a connection sits in the pool: the next call opens a
    fresh one (the store's sentinel read then tells a restarted node)."""

    async def script(reader, writer, n) -> None:
        await _read_request(reader)
        writer.write(END_REPLY)
        await writer.drain()
        if n == 0:
            return  # closes the first connection once it answered
        await reader.read()

    node = await peer(script)
    assert await node.roundtrip([b"mg k v\r\n"], _until_end_or_hd) == END_REPLY
    await asyncio.sleep(0.05)  # the close arrives while the connection is idle
    assert await node.roundtrip([b"mg k v\r\n"], _until_end_or_hd) == END_REPLY


async def test_a_pooled_connection_dead_before_any_reply_byte_is_retried_once(peer) -> None:
    """The node takes the request on a pooled connection and closes it without a byte
    (it was going down): the call is sent again on a fresh connection, once."""
    requests: list[int] = []

    async def script(reader, writer, n) -> None:
        await _read_request(reader)
        requests.append(n)
        writer.write(END_REPLY)
        await writer.drain()
        await _read_request(reader)
        requests.append(n)
        if n == 0:
            return  # the second request on the first connection: closed unanswered
        writer.write(END_REPLY)
        await writer.drain()
        await reader.read()

    node = await peer(script)
    assert await node.roundtrip([b"mg k v\r\n"], _until_end_or_hd) == END_REPLY
    assert await node.roundtrip([b"mg k v\r\n"], _until_end_or_hd) == END_REPLY
    assert requests == [0, 0, 1]


async def test_a_fresh_connection_closed_before_answering_is_node_unavailable(peer) -> None:
    async def script(reader, writer, n) -> None:
        await _read_request(reader)  # and close

    node = await peer(script)
    with pytest.raises(NodeUnavailableError, match="closed a new connection before answering"):
        await node.roundtrip([b"mg k v\r\n"], _until_end_or_hd)
