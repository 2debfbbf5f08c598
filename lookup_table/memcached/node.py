"""One memcached node: pipelined round trips over a small pool of connections.

The store's hot path (and the commands in `commands.py`) go through here: a
connection is opened with `open_connection` (deadline `store.connect_timeout_s`,
errors mapped to `NodeUnavailableError` / `StoreTimeoutError` naming the node),
and a connection that saw a timeout, a cancellation or any error mid-reply is
closed, never reused, so a stale reply can never be read as someone else's miss
(the hazard of aiomcache#489).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, cast

from lookup_table.config import NodeSpec, StoreConfig
from lookup_table.errors import NodeUnavailableError, StoreError, StoreTimeoutError
from lookup_table.memcached import protocol

__all__ = ["READ_CHUNK", "Node", "open_connection"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
READ_CHUNK = 1 << 20  # bytes per socket read (`commands`' streams)
_STREAM_LIMIT = 1 << 22
_RECV_MIN = 1 << 18  # free bytes offered to each socket read of a reply
_KEEP_BUFFER = 1 << 24  # a connection keeps its reply buffer up to this size (no regrowth)
_WRITE_SLICE = 1 << 20  # bytes per write of a request


async def open_connection(
    spec: NodeSpec, cfg: StoreConfig
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A new stream connection to `spec` within `cfg.connect_timeout_s` (`commands`).

    Raises:
        StoreTimeoutError: the node did not accept in time.
        NodeUnavailableError: refused, unreachable (naming the node).
    """
    with _connect_errors(spec, cfg):
        async with asyncio.timeout(cfg.connect_timeout_s):
            return await asyncio.open_connection(spec.host, spec.port, limit=_STREAM_LIMIT)


async def _open_conn(spec: NodeSpec, cfg: StoreConfig) -> _Conn:
    """A new pooled connection (`_Conn`) to `spec`; errors as `open_connection`'s."""
    loop = asyncio.get_running_loop()
    with _connect_errors(spec, cfg):
        async with asyncio.timeout(cfg.connect_timeout_s):
            _, conn = await loop.create_connection(_Conn, spec.host, spec.port)
    return conn


@contextlib.contextmanager
def _connect_errors(spec: NodeSpec, cfg: StoreConfig) -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise StoreTimeoutError(
            f"memcached node {spec.address} did not accept a connection within "
            f"{cfg.connect_timeout_s:g} s (store.connect_timeout_s)",
            node=spec.address,
        ) from exc
    except OSError as exc:
        raise NodeUnavailableError(
            f"memcached node {spec.address} is unreachable: {exc.strerror or exc}; "
            f"is it running? (deploy/cluster.sh status)",
            node=spec.address,
        ) from exc


class _StaleConnectionError(Exception):
    """The connection was dead before any reply byte arrived (internal, retried once)."""


class _Conn(asyncio.BufferedProtocol):
    """One connection of the pool: a request goes out in slices with flow control, its
    reply comes in straight into one growing buffer.

    Not asyncio's streams: a `StreamReader` copies every received byte three times more
    (into its buffer, out as a slice, into bytes) before the reply is joined, and a
    `StreamWriter` given a 13 MB batch keeps what the socket did not take in one bytearray
    that it shifts down after every send. Here a reply is copied once from the socket and
    once into the bytes that `parse` gets, and the transport never holds more than one
    slice of a request.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(_RECV_MIN)
        self._len = 0  # bytes of the current reply in _buf
        self._given = 0  # _len when `reply` last returned (its caller found it incomplete)
        self._ended = asyncio.Event()  # the reply may be complete, or the connection ended
        self._writable = asyncio.Event()
        self._writable.set()
        self.closed = False  # EOF or connection lost: no more bytes will come
        self._error: BaseException | None = None  # the socket's error, if it ended in one

    # ------------------------------------------------------------ asyncio's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP connection's
        # the next slice goes out while the socket still has most of one to send
        self.transport.set_write_buffer_limits(high=_WRITE_SLICE, low=_WRITE_SLICE // 2)

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buf) - self._len < _RECV_MIN:  # grow by doubling: one copy amortized
            bigger = bytearray(max(2 * len(self._buf), self._len + _RECV_MIN))
            bigger[: self._len] = memoryview(self._buf)[: self._len]
            self._buf = bigger
        return memoryview(self._buf)[self._len :]

    def buffer_updated(self, nbytes: int) -> None:
        self._len += nbytes
        end = self._len
        if end >= len(protocol.END_REPLY) and self._buf.endswith(protocol.END_REPLY, 0, end):
            self._ended.set()

    def eof_received(self) -> bool:
        self._end(None)
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _end(self, exc: BaseException | None) -> None:
        self.closed = True
        self._error = self._error or exc
        self._ended.set()
        self._writable.set()

    # ------------------------------------------------------------ one exchange

    def send_now(self, parts: Sequence[protocol.Wire]) -> bool:
        """Write a request of at most one slice at once, if the transport takes writes:
        True then (the transport sends what the socket does not take yet by itself, so
        nothing waits for it); False for a bigger request (`send` it, beside the reads of
        the reply). Most round trips are small: they need no task of their own."""
        transport = self.transport
        if self.closed or transport is None or not self._writable.is_set():
            return False
        if sum(len(part) for part in parts) > _WRITE_SLICE:
            return False
        for piece in _slices(parts):
            transport.write(piece)
        return True

    async def send(self, parts: Sequence[protocol.Wire]) -> None:
        """Write a request: small parts joined, big ones in slices (no copy), each slice
        once the transport took the one before (no more than one slice buffered)."""
        transport = self.transport
        for piece in _slices(parts):
            await self._writable.wait()
            if self.closed or transport is None:
                raise self._error or ConnectionResetError("the connection closed while sending")
            transport.write(piece)

    async def reply(self) -> bytes | None:
        """The bytes of the reply so far, once more came and they end in `MN\\r\\n`
        (possibly by chance inside a value: the caller parses and, finding the reply
        incomplete, asks again); None when the node closed the connection (see
        `received`). A connection that ended in a socket error raises it (an OSError,
        as a stream's read did)."""
        while not self._complete():
            if self.closed:
                if self._error is not None:
                    raise self._error
                return None
            self._ended.clear()
            await self._ended.wait()
        self._given = self._len
        return bytes(memoryview(self._buf)[: self._len])

    def _complete(self) -> bool:
        return self._len > self._given and self._buf.endswith(protocol.END_REPLY, 0, self._len)

    @property
    def received(self) -> int:
        return self._len

    def reset(self) -> None:
        """Before the next request on this connection: a fresh buffer (the bytes handed
        to `parse` were copied out, nothing refers to the old one)."""
        if len(self._buf) > _KEEP_BUFFER:
            self._buf = bytearray(_RECV_MIN)
        self._len = self._given = 0

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


def _slices(parts: Sequence[protocol.Wire]) -> Iterator[protocol.Wire]:
    """A request's parts as writes of about `_WRITE_SLICE` bytes: runs of small parts
    joined (one send each, not one per part), big parts cut into views."""
    run: list[protocol.Wire] = []
    size = 0
    for part in parts:
        if not part:
            continue
        if len(part) >= _WRITE_SLICE // 4:
            if run:
                yield b"".join(run)
                run, size = [], 0
            view = memoryview(part)
            for start in range(0, len(part), _WRITE_SLICE):
                yield view[start : start + _WRITE_SLICE]
            continue
        run.append(part)
        size += len(part)
        if size >= _WRITE_SLICE:
            yield b"".join(run)
            run, size = [], 0
    if run:
        yield b"".join(run)


class Node:
    """Pipelined round trips to one memcached node over a small pool of connections."""

    def __init__(self, spec: NodeSpec, cfg: StoreConfig) -> None:
        self.spec = spec
        self.address = spec.address
        self._cfg = cfg
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(cfg.pool_size)
        self._closed = False

    async def _connect(self) -> _Conn:
        return await _open_conn(self.spec, self._cfg)

    async def roundtrip(
        self, request: bytes | Sequence[protocol.Wire], parse: Callable[[bytes], T | None]
    ) -> T:
        """Send one pipelined request ending in `mn` and parse the whole reply.

        `request` may come in parts (sentinel read, commands): small parts are joined
        into writes of about a megabyte, big ones written as they are (`_slices`). A
        batch of many tables is megabytes: it is not copied into one.

        `parse(data)` returns None while the reply is incomplete. The reply is
        complete only after `MN\\r\\n`; data ending in those bytes by chance
        is simply parsed again after the next read. A pooled connection that
        turns out dead before any reply byte (the node restarted while it sat
        idle) is retried once on a fresh connection: every batch starts with the
        sentinel read, so a restarted node is then reported as data loss.
        """
        if self._closed:
            raise NodeUnavailableError(f"store is closed (node {self.address})", node=self.address)
        parts = [request] if isinstance(request, bytes) else list(request)
        payload = [*parts, protocol.END]
        # The wait for a free connection has its own deadline: behind `pool_size` calls
        # stuck on a stopped node, a call fails after at most 2 x timeout_s, not after
        # one timeout per call queued in front of it.
        try:
            if self._slots.locked():  # else it returns at once: no deadline to set
                async with asyncio.timeout(self._cfg.timeout_s):
                    await self._slots.acquire()
            else:
                await self._slots.acquire()
        except TimeoutError as exc:
            raise StoreTimeoutError(
                f"memcached node {self.address}: all {self._cfg.pool_size} connections "
                f"(store.pool_size) stayed busy for {self._cfg.timeout_s:g} s "
                f"(store.timeout_s); is it overloaded or stopped?",
                node=self.address,
            ) from exc
        try:
            try:
                async with asyncio.timeout(self._cfg.timeout_s):
                    while self._idle:
                        conn = self._idle.pop()
                        try:
                            return await self._exchange(conn, payload, parse)
                        except _StaleConnectionError:
                            logger.debug(
                                "node %s: pooled connection was dead, retrying", self.address
                            )
                    return await self._exchange(await self._connect(), payload, parse)
            except TimeoutError as exc:
                raise StoreTimeoutError(
                    f"memcached node {self.address} did not answer within "
                    f"{self._cfg.timeout_s:g} s (store.timeout_s); is it overloaded or stopped?",
                    node=self.address,
                ) from exc
            except _StaleConnectionError as exc:
                raise NodeUnavailableError(
                    f"memcached node {self.address} closed a new connection before answering "
                    f"(is it restarting or at its connection limit?)",
                    node=self.address,
                ) from exc
        finally:
            self._slots.release()

    async def _exchange(
        self, conn: _Conn, payload: Sequence[protocol.Wire], parse: Callable[[bytes], T | None]
    ) -> T:
        """One request/reply on `conn` (`payload` ends in `mn`); the connection goes back to
        the pool only if clean."""
        reusable = False
        try:
            if conn.closed:  # the node closed it while it sat in the pool
                raise _StaleConnectionError
            conn.reset()
            sending = None if conn.send_now(payload) else asyncio.ensure_future(conn.send(payload))
            try:
                while True:
                    data = await conn.reply()
                    if data is None:
                        if conn.received == 0:
                            raise _StaleConnectionError
                        raise NodeUnavailableError(
                            f"memcached node {self.address} closed the connection mid-reply "
                            f"(did it restart?)",
                            node=self.address,
                        )
                    result = parse(data)
                    if result is not None:
                        break
                if sending is not None:
                    await sending  # done: the node answered the last command (`mn`)
                reusable = True
                return result
            finally:
                # on an error (the connection is then closed) the send may still run: it is
                # cancelled, not awaited (a cancellation of this call must not be lost),
                # and its own error is retrieved: the reply's is what is raised
                if sending is not None:
                    sending.cancel()
                    sending.add_done_callback(_retrieve)
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, StoreError):
                raise
            if conn.received == 0 and isinstance(exc, ConnectionError):
                raise _StaleConnectionError from exc
            raise NodeUnavailableError(
                f"memcached node {self.address} failed mid-request: {exc}", node=self.address
            ) from exc
        finally:
            if reusable and not self._closed and not conn.closed:
                self._idle.append(conn)
            else:
                conn.close()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        if idle:
            await asyncio.sleep(0)  # let the transports call connection_lost
