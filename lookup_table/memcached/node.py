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
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from lookup_table.config import NodeSpec, StoreConfig
from lookup_table.errors import NodeUnavailableError, StoreError, StoreTimeoutError
from lookup_table.memcached import protocol

__all__ = ["READ_CHUNK", "Node", "open_connection"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
READ_CHUNK = 1 << 20  # bytes per socket read
_STREAM_LIMIT = 1 << 22


async def open_connection(
    spec: NodeSpec, cfg: StoreConfig
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A new connection to `spec` within `cfg.connect_timeout_s`.

    Raises:
        StoreTimeoutError: the node did not accept in time.
        NodeUnavailableError: refused, unreachable (naming the node).
    """
    try:
        async with asyncio.timeout(cfg.connect_timeout_s):
            return await asyncio.open_connection(spec.host, spec.port, limit=_STREAM_LIMIT)
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


@dataclass(slots=True)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()


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
        return _Conn(*await open_connection(self.spec, self._cfg))

    async def roundtrip(
        self, request: bytes | Sequence[bytes], parse: Callable[[bytes], T | None]
    ) -> T:
        """Send one pipelined request ending in `mn` and parse the whole reply.

        `request` may come in parts (sentinel read, commands): they are joined with
        the `mn` once, as one write. A batch of many tables is megabytes: one copy,
        not one per part.

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
        payload = b"".join([*parts, protocol.END])
        # The wait for a free connection has its own deadline: behind `pool_size` calls
        # stuck on a stopped node, a call fails after at most 2 x timeout_s, not after
        # one timeout per call queued in front of it.
        try:
            async with asyncio.timeout(self._cfg.timeout_s):
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

    async def _exchange(self, conn: _Conn, payload: bytes, parse: Callable[[bytes], T | None]) -> T:
        """One request/reply on `conn` (`payload` ends in `mn`); the connection goes back to
        the pool only if clean."""
        reusable = False
        received = 0
        try:
            conn.writer.write(payload)
            chunks: list[bytes] = []
            tail = b""
            while True:
                chunk = await conn.reader.read(READ_CHUNK)
                if not chunk:
                    if received == 0:
                        raise _StaleConnectionError
                    raise NodeUnavailableError(
                        f"memcached node {self.address} closed the connection mid-reply "
                        f"(did it restart?)",
                        node=self.address,
                    )
                received += len(chunk)
                chunks.append(chunk)
                tail = (tail + chunk[-4:])[-4:]  # not tail + chunk: a copy of the chunk
                if tail != protocol.END_REPLY:
                    continue
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks = [data]
                result = parse(data)
                if result is not None:
                    reusable = True
                    return result
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, StoreError):
                raise
            if received == 0 and isinstance(exc, ConnectionError):
                raise _StaleConnectionError from exc
            raise NodeUnavailableError(
                f"memcached node {self.address} failed mid-request: {exc}", node=self.address
            ) from exc
        finally:
            if reusable and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            try:
                await conn.writer.wait_closed()
            except (ConnectionError, OSError):  # closing a dead socket is fine
                pass
