"""The route handlers of a replica (thin: parse, call the updater, answer).

Errors are raised, not caught: the error middleware of `optimizer_service.app` turns
them into JSON with their status. The admin endpoints are in `optimizer_service.admin`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.typedefs import Handler
from numpy.typing import NDArray
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from lookup_table.core.wire import (
    CONTENT_TYPE,
    WireError,
    decode_array,
    describe,
    encode_array,
    encode_rows,
    pack,
    pack_view,
    unpack,
)
from lookup_table.errors import LookupTableError
from optimizer_service.appkeys import CONFIG, METRICS, REPLICA, STORE, UPDATER
from optimizer_service.engine.answers import group_dtype
from optimizer_service.engine.plan import Applied, WritePlan
from optimizer_service.errors import BadRequestError, NotOwnerError
from optimizer_service.push import (
    Push,
    RowsRequest,
    check_sender,
    parse_push,
    parse_rows_request,
)
from optimizer_service.responses import (
    COUNTED,
    PUSHED_BY,
    count_answer,
    error_answer,
    json_error,
    msgpack_response,
)

__all__ = [
    "float_query",
    "get_dense",
    "get_healthz",
    "get_tables",
    "get_version",
    "metrics_handler",
    "post_dense_init",
    "post_gradients",
    "post_rows",
]

logger = logging.getLogger(__name__)


async def _body(request: web.Request) -> bytes:
    """The request's body, as `request.read()` gives it, with one copy fewer: the chunks
    joined once (`read()` extends a bytearray with them, then copies that into a bytes
    object; a push is a megabyte). Past `service.max_body_bytes` the request is refused
    as `read()` refuses it (413)."""
    limit = request.app[CONFIG].service.max_body_bytes
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def post_gradients(request: web.Request) -> web.StreamResponse:
    """One push. Asked for an `answer`, the reply is streamed as two msgpack maps: the
    answer as soon as the new values are computed, then the outcome once they are written
    (`{applied, duplicate, rows, version}`, or `{error, status, type, ...}` if the write
    failed); see docs/service.md. Errors before the first map are plain JSON errors."""
    app = request.app
    body = await _body(request)
    try:
        obj = unpack(body)
    except WireError as exc:
        raise BadRequestError(str(exc), reason="malformed") from None
    check_sender(obj, config=app[CONFIG], replica=app[REPLICA])
    push = parse_push(obj, config=app[CONFIG], replica=app[REPLICA])
    request[PUSHED_BY] = (push.worker, push.push_id)
    if push.answer or push.reads is not None:
        return await _answered(request, push)
    # a client that goes away (aiohttp may cancel the handler then) does not stop the
    # push half-way: it completes alone (a retry of its push_id is a duplicate)
    applying = asyncio.ensure_future(_apply(request, push))
    applying.add_done_callback(_retrieve)
    result = await asyncio.shield(applying)
    return msgpack_response(result.to_wire())


async def post_rows(request: web.Request) -> web.Response:
    """Rows read through their owner (trainers, while rows are written behind):
    `{tables: {name: {ids}}, groups: [{tables, counts, ids}]}` -> `{rows: {name: rows in
    the order of the unique sorted ids}, new: {name: how many had no row}, groups:
    [{rows, new: [per table]}]}`; nothing is created (docs/service.md)."""
    app = request.app
    try:
        obj = unpack(await _body(request))
    except WireError as exc:
        raise BadRequestError(str(exc), reason="malformed") from None
    check_sender(obj, config=app[CONFIG], replica=app[REPLICA])
    parsed = parse_rows_request(obj, config=app[CONFIG], replica=app[REPLICA])
    return msgpack_response(await _read(app, parsed))


async def _read(
    app: web.Application, parsed: RowsRequest, plan: WritePlan | None = None
) -> dict[str, Any]:
    """The rows of a read (`POST /v1/rows`, a push's `read`: with its `plan`) as the answer
    sends them, each table's in its stored width (`encode_rows`: a 16-bit table's in half
    the bytes), grouped tables' as one array in the group's order."""
    got = await app[UPDATER].read_rows(parsed.reads, after=plan)
    metrics = app[METRICS]
    values_of: dict[str, NDArray[np.float32]] = {}
    new: dict[str, int] = {}
    for (table, ids), (values, found) in zip(parsed.reads, got, strict=True):
        values_of[table] = values
        new[table] = int(ids.shape[0] - np.count_nonzero(found))
        metrics.count_rows_read(table, ids.shape[0] - new[table], new[table])
    dtypes = {table: app[CONFIG].table(table).dtype for table, _ in parsed.reads}
    doc: dict[str, Any] = {}
    if parsed.groups:
        doc["groups"] = [
            {
                **encode_rows(
                    np.concatenate([values_of.pop(t) for t in group]), group_dtype(dtypes, group)
                ),
                "new": [new.pop(t) for t in group],
            }
            for group in parsed.groups
        ]
    sent = {table: encode_rows(values, dtypes[table]) for table, values in values_of.items()}
    doc["rows"] = {table: wire["rows"] for table, wire in sent.items()}
    row_dtypes = {table: wire["row_dtype"] for table, wire in sent.items() if "row_dtype" in wire}
    if row_dtypes:  # the 16-bit tables sent alone: their rows are words
        doc["row_dtypes"] = row_dtypes
    doc["new"] = new
    return doc


async def _apply(
    request: web.Request, push: Push, on_plan: Callable[[WritePlan], None] | None = None
) -> Applied:
    metrics = request.app[METRICS]
    with metrics.push_latency.time():
        result = await request.app[UPDATER].apply(push, on_plan=on_plan)
    if result.duplicate:
        metrics.duplicates.inc()
        metrics.pushes.labels(status="duplicate").inc()
    else:
        metrics.pushes.labels(status="applied").inc()
        metrics.count_push(push.worker, push.examples, push.loss)
    return result


async def _answered(request: web.Request, push: Push) -> web.StreamResponse:
    """Answer first (from the write plan, before anything is written), outcome second."""
    updater = request.app[UPDATER]
    # the plan, or None once the push ended without one; awaited directly, the plan
    # wakes this task ahead of the writes the push starts next (asyncio.wait would add
    # a turn of the loop, after them)
    ready: asyncio.Future[WritePlan | None] = asyncio.get_running_loop().create_future()

    def on_plan(plan: WritePlan | None) -> None:
        if not ready.done():
            ready.set_result(plan)

    applying = asyncio.ensure_future(_apply(request, push, on_plan))
    # if the answer cannot be built or sent (the client went away), the push still
    # completes (or fails) alone, its error not left unretrieved
    applying.add_done_callback(_retrieve)
    applying.add_done_callback(lambda _: on_plan(None))
    plan = await ready
    if plan is None:  # a duplicate, a sync round, or an error: nothing was sent yet
        plan = applying.result().plan
    first = await updater.answer(push, plan)
    response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
    response[COUNTED] = True
    await response.prepare(request)
    await response.write(pack_view(first.to_wire()))
    if push.reads is not None:  # after the answer, which the trainer waits for first
        read: dict[str, Any]
        try:
            read = {"read": await _read(request.app, push.reads, plan)}
        except Exception as exc:  # the outcome still follows; the client retries or raises
            status, read, _ = error_answer(exc)
            read["status"] = status
        await response.write(pack_view(read))
    try:
        result = await asyncio.shield(applying)
        outcome = result.to_wire()
        status, reason = 200, None
    except Exception as exc:
        status, outcome, reason = error_answer(exc)
        outcome["status"] = status
    # written before it is counted: a client gone by now is counted as such instead;
    # with the end of the stream, in one write
    await response.write_eof(pack(outcome))
    count_answer(request, status, reason)
    return response


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _replica0(request: web.Request, what: str) -> None:
    if request.app[REPLICA] != 0:
        raise NotOwnerError(
            f"{what}: dense parameters live on replica 0; this is replica {request.app[REPLICA]}"
        )


async def post_dense_init(request: web.Request) -> web.Response:
    """First writer wins: every trainer starts from the same dense weights."""
    _replica0(request, "POST /v1/dense/init")
    try:
        obj = unpack(await _body(request))
        if (
            not isinstance(obj, dict)
            or set(obj) != {"params"}
            or not isinstance(obj["params"], dict)
        ):
            raise WireError("body: expected {params: {name: array}}")
        params = {}
        for name, arr in obj["params"].items():
            if not isinstance(name, str) or not name:
                raise WireError(f"params: names must be non-empty str, got {describe(name)}")
            params[name] = decode_array(arr, field=f"params.{name}", dtype="<f4").copy()
    except WireError as exc:
        raise BadRequestError(str(exc), reason="malformed") from None
    created, state = await request.app[UPDATER].dense.init(params)
    return msgpack_response(
        {
            "created": created,
            "version": state.version,
            "params": {n: encode_array(v) for n, v in state.params.items()},
        }
    )


async def get_dense(request: web.Request) -> web.Response:
    _replica0(request, "GET /v1/dense")
    state = await request.app[UPDATER].dense.read()
    if state is None:
        return json_error(
            404,
            "dense parameters are not initialized: POST /v1/dense/init "
            "first (trainer.Trainer does it)",
        )
    return msgpack_response(
        {"version": state.version, "params": {n: encode_array(v) for n, v in state.params.items()}}
    )


def float_query(request: web.Request, name: str, default: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequestError(
            f"query parameter {name}: expected a number, got {describe(raw)}"
        ) from None
    if not value >= 0:
        raise BadRequestError(
            f"query parameter {name}: expected a number >= 0, got {describe(raw)}"
        )
    return value


async def get_version(request: web.Request) -> web.Response:
    """`?after=V`: long-poll until the version is > V (or `service.long_poll_timeout_s`)."""
    config = request.app[CONFIG]
    raw = request.query.get("after")
    updater = request.app[UPDATER]
    if raw is None:
        return msgpack_response({"version": updater.version})
    if not raw.lstrip("-").isdigit():
        raise BadRequestError(f"query parameter after: expected an integer, got {describe(raw)}")
    timeout_s = min(
        float_query(request, "timeout_s", config.service.long_poll_timeout_s),
        config.service.long_poll_timeout_s,
    )
    version = await updater.wait_version(int(raw), timeout_s=timeout_s)
    return msgpack_response({"version": version})


async def get_tables(request: web.Request) -> web.Response:
    """The cluster file this replica runs: its namespace, index, mode and tables, and
    `agreement` and its `fingerprint` (`ClusterConfig.agreement`), which a client compares
    with its own file's before its first push."""
    config = request.app[CONFIG]
    tables = config.to_dict()["tables"]
    return msgpack_response(
        {
            "namespace": config.namespace,
            "replica": request.app[REPLICA],
            "replicas": max(len(config.optimizers), 1),
            "mode": config.mode,
            "tables": tables,
            "agreement": config.agreement(),
            "fingerprint": config.fingerprint,
        }
    )


async def get_healthz(request: web.Request) -> web.Response:
    """200 when every node answers and has its sentinel; 503 with the reasons otherwise."""
    store = request.app[STORE]
    try:
        sentinels = await store.sentinels()
    except LookupTableError as exc:
        return web.json_response({"status": "unhealthy", "error": str(exc)}, status=503)
    lost = sorted(node for node, value in sentinels.items() if value is None)
    body: dict[str, Any] = {
        "status": "ok" if not lost else "unhealthy",
        "replica": request.app[REPLICA],
        "nodes": {
            node: ("ok" if value is not None else "sentinel missing")
            for node, value in sentinels.items()
        },
    }
    if lost:
        body["error"] = (
            f"memcached nodes {', '.join(lost)} have no sentinel: data lost or "
            f"cluster not initialized (lookup-table-admin init)"
        )
    return web.json_response(body, status=200 if not lost else 503)


def metrics_handler(registry: CollectorRegistry) -> Handler:
    render = make_aiohttp_handler(registry)

    async def get_metrics(request: web.Request) -> web.StreamResponse:
        metrics = request.app[METRICS]
        store = request.app[STORE]
        metrics.version.set(request.app[UPDATER].version)
        metrics.rows_locked.set(request.app[UPDATER].locks.held)
        metrics.row_cache_bytes.set(request.app[UPDATER].cache.nbytes())
        metrics.unwritten_rows.set(request.app[UPDATER].unwritten_rows)
        metrics.unflushed_pushes.set(request.app[UPDATER].unflushed_pushes)
        try:
            stats = await store.stats()
        except LookupTableError as exc:
            logger.warning("metrics: memcached stats failed: %s", exc)
            stats = {}
        for node in store.nodes:
            s = stats.get(node)
            metrics.node_up.labels(node=node).set(1 if s else 0)
            if not s:
                continue
            used, limit = int(s.get("bytes", 0)), int(s.get("limit_maxbytes", 0))
            metrics.node_items.labels(node=node).set(int(s.get("curr_items", 0)))
            metrics.node_bytes.labels(node=node).set(used)
            metrics.node_limit.labels(node=node).set(limit)
            metrics.node_fill.labels(node=node).set(used / limit if limit else 0.0)
            metrics.node_evictions.labels(node=node).set(int(s.get("evictions", 0)))
        return await render(request)

    return get_metrics
