"""The memcached commands beyond the row path: stats, metadump, pipelined deletes.

Each runs on a fresh connection of its own (`exchange`), so a long `lru_crawler
metadump` never holds one of the store's pooled connections, and one node that is
down fails only its own call. Connections are opened and their errors mapped by
`node.open_connection`, as on the store's hot path (which then speaks through its own
buffered protocol, `node._Conn`, instead of asyncio's streams).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence

import numpy as np

from lookup_table.config import NodeSpec, StoreConfig
from lookup_table.errors import NodeUnavailableError, StoreError, StoreTimeoutError
from lookup_table.memcached import protocol, replies
from lookup_table.memcached.node import READ_CHUNK, open_connection

__all__ = ["curr_items", "delete_keys", "exchange", "metadump", "stats"]

logger = logging.getLogger(__name__)

_METADUMP_HASH = b"lru_crawler metadump hash\r\n"
_METADUMP_ALL = b"lru_crawler metadump all\r\n"
_METADUMP_END = b"END\r\n"
_VERIFY_ATTEMPTS = 5
_BUSY_ATTEMPTS = 100
_BUSY_DELAY_S = 0.1


async def exchange(
    spec: NodeSpec,
    cfg: StoreConfig,
    request: bytes,
    done: Callable[[bytes, bytes], bool],
    *,
    what: str,
) -> bytes:
    """Send `request` on a fresh connection; read until `done(head, tail)`, return the reply.

    `head` is the reply's first 64 bytes and `tail` its last 8, so a long reply is
    joined once, at the end. Each read has `cfg.timeout_s` (the deadline is per
    read: a long dump may take longer in total, a stopped node is still noticed).
    """
    address = spec.address
    reader, writer = await open_connection(spec, cfg)
    try:
        writer.write(request)
        chunks: list[bytes] = []
        head = tail = b""
        while True:
            try:
                async with asyncio.timeout(cfg.timeout_s):
                    chunk = await reader.read(READ_CHUNK)
            except TimeoutError as exc:
                raise StoreTimeoutError(
                    f"memcached node {address} stopped answering `{what}` for "
                    f"{cfg.timeout_s:g} s (store.timeout_s)",
                    node=address,
                ) from exc
            if not chunk:
                raise NodeUnavailableError(
                    f"memcached node {address} closed the connection during `{what}`",
                    node=address,
                )
            chunks.append(chunk)
            if len(head) < 64:
                head = (head + chunk)[:64]
            tail = (tail + chunk)[-8:]
            if done(head, tail):
                return b"".join(chunks)
    except (ConnectionError, OSError) as exc:
        if isinstance(exc, StoreError):
            raise
        raise NodeUnavailableError(
            f"memcached node {address} failed during `{what}`: {exc}", node=address
        ) from exc
    finally:
        writer.close()


def _metadump_done(head: bytes, tail: bytes) -> bool:
    if tail.endswith(_METADUMP_END):
        return True
    # an error or BUSY reply is one line ending in CRLF that does not start with "key="
    # (key lines end in a bare LF; only the final END has a CRLF)
    return not head.startswith(b"key=") and tail.endswith(b"\r\n")


def _md_done(head: bytes, tail: bytes) -> bool:
    return tail.endswith(protocol.END_REPLY)  # md replies are HD/NF lines, then MN


async def _crawler_dump(spec: NodeSpec, cfg: StoreConfig, request: bytes) -> bytes | str:
    """One metadump reply (retried while the crawler is BUSY), or the refusal line."""
    for _ in range(_BUSY_ATTEMPTS):
        data = await exchange(spec, cfg, request, _metadump_done, what="metadump")
        if data.startswith(b"BUSY"):
            await asyncio.sleep(_BUSY_DELAY_S)
            continue
        if data.endswith(_METADUMP_END) and (data.startswith(b"key=") or data == _METADUMP_END):
            return data
        return data.split(b"\r\n", 1)[0].decode("ascii", "replace")[:200]
    raise StoreError(
        f"memcached node {spec.address} stayed busy with another LRU crawler request for "
        f"{_BUSY_ATTEMPTS * _BUSY_DELAY_S:g} s (another checkpoint running?); retry later",
        node=spec.address,
    )


async def stats(spec: NodeSpec, cfg: StoreConfig, group: str = "") -> dict[str, str]:
    """One node's `stats` (or `stats <group>`, e.g. "slabs") as name -> value text.

    On its own connection, so one node that is down fails only its own call.

    Raises:
        NodeUnavailableError, StoreTimeoutError: as the store.
        StoreError: a reply that is not a `STAT` listing.
    """
    request = f"stats {group}\r\n" if group else "stats\r\n"
    data = await exchange(
        spec,
        cfg,
        request.encode("ascii"),
        lambda _h, t: t.endswith(b"END\r\n") or t.endswith(b"ERROR\r\n"),
        what=request.strip(),
    )
    lines = data.decode("ascii", "replace").split("\r\n")
    if lines[-2:] != ["END", ""] or not all(ln.startswith("STAT ") for ln in lines[:-2]):
        raise StoreError(
            f"memcached node {spec.address} answered `{request.strip()}` with {data[:120]!r}",
            node=spec.address,
        )
    pairs = (ln[5:].partition(" ") for ln in lines[:-2])
    return {name: value for name, _, value in pairs}


async def curr_items(spec: NodeSpec, cfg: StoreConfig) -> int:
    data = await exchange(
        spec, cfg, b"stats\r\n", lambda _h, t: t.endswith(b"END\r\n"), what="stats"
    )
    match = re.search(rb"STAT curr_items (\d+)\r\n", data)
    if match is None:
        raise StoreError(
            f"memcached node {spec.address}: no curr_items in `stats`", node=spec.address
        )
    return int(match.group(1))


async def metadump(spec: NodeSpec, cfg: StoreConfig) -> bytes:
    """Every item of one node, as memcached's `lru_crawler metadump` lists them.

    Lines `key=<URL-encoded key> exp=... la=... cas=... fetch=... cls=... size=...`
    ending with `END`, for every namespace on the node.

    It walks the hash table (`metadump hash`): an item that exists during the
    whole dump is listed exactly once. The LRU walk (`metadump all`) is not
    reliable: the LRU maintainer moves items between queues while it walks, and
    here it missed keys in 10 of 30 dumps (up to 9,000 of 400,000) taken right
    after writes or reads. It is the fallback only for a memcached without `hash`,
    repeated until it lists exactly the `curr_items` that `stats` counts before
    and after it.

    Raises:
        StoreError: the node refused (crawler disabled), stayed busy, or (fallback)
            never gave a complete listing.
        NodeUnavailableError, StoreTimeoutError: as the store.
    """
    data = await _crawler_dump(spec, cfg, _METADUMP_HASH)
    if isinstance(data, bytes):
        return data
    logger.warning(
        "memcached node %s refused `lru_crawler metadump hash` (%s); using the LRU walk, "
        "checked against `stats curr_items`",
        spec.address,
        data,
    )
    listed = expected = 0
    for attempt in range(_VERIFY_ATTEMPTS):
        if attempt:
            await asyncio.sleep(0.2 * attempt)
        before = await curr_items(spec, cfg)
        dumped = await _crawler_dump(spec, cfg, _METADUMP_ALL)
        if isinstance(dumped, str):
            raise StoreError(
                f"memcached node {spec.address} refused `lru_crawler metadump`: {dumped!r}; "
                f"checkpoints need the LRU crawler (enabled by default)",
                node=spec.address,
            )
        after = await curr_items(spec, cfg)
        lines = dumped.split(b"\n")[:-1]
        listed, expected = len({line.split(b" ", 1)[0] for line in lines}), after
        if before == after == listed == len(lines):
            return dumped
    raise StoreError(
        f"memcached node {spec.address} has no `lru_crawler metadump hash`, and its LRU walk "
        f"listed {listed} of {expected} items in each of {_VERIFY_ATTEMPTS} tries (is something "
        f"writing?); use a memcached with `metadump hash`, or stop the writers",
        node=spec.address,
    )


async def delete_keys(spec: NodeSpec, cfg: StoreConfig, keys: Sequence[bytes]) -> int:
    """Pipelined `md` of `keys` on one node; returns how many existed."""
    deleted = 0
    for start in range(0, len(keys), cfg.max_batch_keys):
        part = list(keys[start : start + cfg.max_batch_keys])
        n = len(part)

        data = await exchange(
            spec, cfg, protocol.build_md(part) + protocol.END, _md_done, what="md"
        )
        reply = replies.parse_ms(data, 0, n)
        if reply is None or reply.errors or data[reply.end :] != protocol.END_REPLY:
            raise StoreError(
                f"memcached node {spec.address} refused a delete: "
                f"{next(iter(reply.errors.values()), b'') if reply else b''!r}",
                node=spec.address,
            )
        deleted += int(np.count_nonzero(reply.status == replies.STATUS_STORED))
    return deleted
