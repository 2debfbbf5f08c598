"""The route handlers of a replica (thin: parse, call the updater, answer).

Errors are raised, not caught: the error middleware of `optimizer_service.app` turns
them into JSON with their status. The admin endpoints are in `optimizer_service.admin`.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from lookup_table.core.wire import WireError, decode_array, describe, encode_array, unpack
from lookup_table.errors import LookupTableError
from optimizer_service.appkeys import CONFIG, METRICS, REPLICA, STORE, UPDATER
from optimizer_service.errors import BadRequestError, NotOwnerError
from optimizer_service.push import parse_push
from optimizer_service.responses import json_error, msgpack_response
from optimizer_service.updater import PLAN

__all__ = [
    "float_query",
    "get_dense",
    "get_healthz",
    "get_tables",
    "get_version",
    "metrics_handler",
    "post_dense_init",
    "post_gradients",
]

logger = logging.getLogger(__name__)


async def post_gradients(request: web.Request) -> web.Response:
    app = request.app
    body = await request.read()
    try:
        obj = unpack(body)
    except WireError as exc:
        raise BadRequestError(str(exc), reason="malformed") from None
    push = parse_push(obj, config=app[CONFIG], replica=app[REPLICA])
    metrics = app[METRICS]
    updater = app[UPDATER]
    with metrics.push_latency.time():
        result = await updater.apply(push)
    if result["duplicate"]:
        metrics.duplicates.inc()
        metrics.pushes.labels(status="duplicate").inc()
    else:
        metrics.pushes.labels(status="applied").inc()
    answer = {k: v for k, v in result.items() if k != PLAN}
    if push.answer:
        answer.update(await updater.answer(push, result))
    return msgpack_response(answer)


def _replica0(request: web.Request, what: str) -> None:
    if request.app[REPLICA] != 0:
        raise NotOwnerError(
            f"{what}: dense parameters live on replica 0; this is replica {request.app[REPLICA]}"
        )


async def post_dense_init(request: web.Request) -> web.Response:
    """First writer wins: every trainer starts from the same dense weights."""
    _replica0(request, "POST /v1/dense/init")
    try:
        obj = unpack(await request.read())
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
    config = request.app[CONFIG]
    tables = config.to_dict()["tables"]
    return msgpack_response(
        {
            "namespace": config.namespace,
            "replica": request.app[REPLICA],
            "replicas": max(len(config.optimizers), 1),
            "mode": config.mode,
            "tables": tables,
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
