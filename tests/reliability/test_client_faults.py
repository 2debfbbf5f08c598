"""OptimizerClient against a replica that dies mid-answer: it retries, it never leaks
aiohttp's own errors to the trainer."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig
from lookup_table.core.wire import pack
from lookup_table.errors import ReplicaUnavailableError
from tests.conftest import make_config


async def _cut_then_answer(cuts: int, config: ClusterConfig) -> tuple[asyncio.Server, list[int]]:
    """An HTTP server whose first `cuts` answers announce 100 bytes, send 10 and close
    (what a kill -9 mid-answer looks like to the client); later answers are whole.
    `GET /v1/tables` (the client's check of the cluster file) is answered whole for
    `config`, and not counted."""
    served: list[int] = []
    body = pack({"version": 5})
    tables = pack(
        {"replica": 0, "agreement": config.agreement(), "fingerprint": config.fingerprint}
    )

    def whole(doc: bytes) -> bytes:
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"
            + f"Content-Length: {len(doc)}\r\nConnection: close\r\n\r\n".encode()
            + doc
        )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /v1/tables "):
            writer.write(whole(tables))
        else:
            served.append(len(served))
            if len(served) <= cuts:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"
                    b"Content-Length: 100\r\n\r\n" + body[:10]
                )
            else:
                writer.write(whole(body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, served


@pytest.mark.parametrize("cuts", [1, 3])
async def test_an_answer_cut_mid_body_is_retried(cuts: int) -> None:
    config = make_config(["127.0.0.1:1"], optimizers=["http://127.0.0.1:1"])
    server, served = await _cut_then_answer(cuts, config)
    port = server.sockets[0].getsockname()[1]
    config = dataclasses.replace(config, optimizers=(f"http://127.0.0.1:{port}",))
    async with server:
        async with OptimizerClient(config, max_retries=5, backoff_s=0.01) as client:
            assert await client.version() == 5
        assert len(served) == cuts + 1
        async with OptimizerClient(config, max_retries=1, backoff_s=0.01) as client:
            served.clear()
            if cuts > 1:  # more cuts than attempts: a clear error, not aiohttp's
                with pytest.raises(ReplicaUnavailableError, match="ClientPayloadError"):
                    await client.version()
