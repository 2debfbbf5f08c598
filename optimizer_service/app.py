"""The aiohttp optimizer service: `make_app(config, replica=K)` and `lookup-table-optimizer`.

Endpoints (DESIGN.md "Wire protocol"): `POST /v1/gradients`, `POST /v1/dense/init`,
`GET /v1/dense`, `GET /v1/version?after=V`, `GET /v1/tables`, `POST /v1/admin/pause`,
`POST /v1/admin/resume`, `GET /healthz` (JSON), `GET /metrics` (Prometheus text). Every endpoint but
`/healthz` and `/metrics` requires `Authorization: Bearer <token>` when the
cluster has a token. Errors are JSON `{"error": ...}` with a 4xx/5xx status.

On startup the replica connects to memcached and finishes its journal (pushes
that were journaled but not completed when it last stopped) *before* it serves.
"""

from __future__ import annotations

import argparse
import ctypes
import hmac
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.wire import (
    CONTENT_TYPE,
    WireError,
    decode_array,
    describe,
    encode_array,
    pack,
    unpack,
)
from lookup_table.errors import (
    ConfigError,
    DataLossError,
    DenseParamError,
    KeyEncodingError,
    LookupTableError,
    StoreError,
    StoreFullError,
)
from lookup_table.store import EmbeddingStore
from optimizer_service.errors import (
    BadRequestError,
    NotOwnerError,
    OptimizerServiceError,
    UnauthorizedError,
)
from optimizer_service.metrics import ServiceMetrics
from optimizer_service.push import parse_push
from optimizer_service.updater import Updater

__all__ = ["CONFIG", "METRICS", "REPLICA", "STORE", "UPDATER", "main", "make_app"]

logger = logging.getLogger(__name__)

CONFIG = web.AppKey("config", ClusterConfig)
REPLICA = web.AppKey("replica", int)
METRICS = web.AppKey("metrics", ServiceMetrics)
STORE = web.AppKey("store", EmbeddingStore)
UPDATER = web.AppKey("updater", Updater)

_PUBLIC_PATHS = frozenset({"/healthz", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_error(status: int, message: str, kind: str | None = None, **extra: Any) -> web.Response:
    """`{"error": message}`, plus `type` (e.g. DataLossError) and the fields the error
    carries (`node`, `nodes`) so clients can re-raise it as it was raised here."""
    body: dict[str, Any] = {"error": message}
    if kind is not None:
        body["type"] = kind
    body.update(extra)
    return web.json_response(body, status=status)


def _msgpack(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=pack(obj), status=status, content_type=CONTENT_TYPE)


def _endpoint(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every error into JSON with the right status, and count it."""
    metrics = request.app[METRICS]
    endpoint = _endpoint(request)
    reason = None
    try:
        response = await handler(request)
    except OptimizerServiceError as exc:
        response, reason = _json_error(exc.status, str(exc)), exc.reason
    except web.RequestPayloadError as exc:
        response, reason = _json_error(400, f"cannot read the request body: {exc}"), "malformed"
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = "too_large" if exc.status == 413 else f"http_{exc.status}"
        response = _json_error(exc.status, exc.text or exc.reason)
    except DenseParamError as exc:
        response, reason = _json_error(400, str(exc)), exc.reason
    except (KeyEncodingError, ConfigError) as exc:
        response, reason = _json_error(400, str(exc)), "bad_request"
    except DataLossError as exc:
        response = _json_error(503, str(exc), "DataLossError", nodes=list(exc.nodes))
        reason = "data_loss"
    except StoreFullError as exc:
        response = _json_error(507, str(exc), "StoreFullError", node=exc.node)
        reason = "store_full"
    except StoreError as exc:  # a node timed out, refused, sent corrupt values: name it
        response = _json_error(503, str(exc), type(exc).__name__, node=exc.node)
        reason = "store_unavailable"
    except LookupTableError as exc:
        response, reason = _json_error(503, str(exc)), "store_unavailable"
    except Exception as exc:  # the boundary: log once, answer 500
        logger.exception("unexpected error in %s %s", request.method, request.path)
        response, reason = _json_error(500, f"internal error: {type(exc).__name__}"), "internal"
    metrics.requests.labels(endpoint=endpoint, status=str(response.status)).inc()
    if reason is not None and 400 <= response.status < 500 and endpoint == "/v1/gradients":
        metrics.rejected.labels(reason=reason).inc()
    return response


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[CONFIG].token
    if token and request.path not in _PUBLIC_PATHS:
        got = request.headers.get("Authorization", "")
        # aiohttp decodes header bytes with surrogateescape: encode them back the same way
        if not hmac.compare_digest(
            got.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode()
        ):
            raise UnauthorizedError(
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the "
                "cluster's token (config `token` or $LOOKUP_TABLE_TOKEN)"
            )
    return await handler(request)


async def post_gradients(request: web.Request) -> web.Response:
    app = request.app
    body = await request.read()
    try:
        obj = unpack(body)
    except WireError as exc:
        raise BadRequestError(str(exc), reason="malformed") from None
    push = parse_push(obj, config=app[CONFIG], replica=app[REPLICA])
    metrics = app[METRICS]
    with metrics.push_latency.time():
        result = await app[UPDATER].apply(push)
    if result["duplicate"]:
        metrics.duplicates.inc()
        metrics.pushes.labels(status="duplicate").inc()
    else:
        metrics.pushes.labels(status="applied").inc()
    return _msgpack(result)


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
    return _msgpack(
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
        return _json_error(
            404,
            "dense parameters are not initialized: POST /v1/dense/init "
            "first (trainer.Trainer does it)",
        )
    return _msgpack(
        {"version": state.version, "params": {n: encode_array(v) for n, v in state.params.items()}}
    )


def _float_query(request: web.Request, name: str, default: float) -> float:
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
        return _msgpack({"version": updater.version})
    if not raw.lstrip("-").isdigit():
        raise BadRequestError(f"query parameter after: expected an integer, got {describe(raw)}")
    timeout_s = min(
        _float_query(request, "timeout_s", config.service.long_poll_timeout_s),
        config.service.long_poll_timeout_s,
    )
    version = await updater.wait_version(int(raw), timeout_s=timeout_s)
    return _msgpack({"version": version})


async def post_pause(request: web.Request) -> web.Response:
    """Finish in-flight pushes and hold new ones (for a consistent checkpoint)."""
    timeout_s = _float_query(request, "timeout_s", 600.0)
    drop = request.query.get("drop_unfinished", "0")
    if drop not in ("0", "1"):
        raise BadRequestError(
            f"query parameter drop_unfinished: expected 0 or 1, got {describe(drop)}"
        )
    unfinished = await request.app[UPDATER].pause(timeout_s=timeout_s, drop_unfinished=drop == "1")
    return _msgpack({"paused": True, "auto_resume_s": timeout_s, "unfinished_pushes": unfinished})


async def post_resume(request: web.Request) -> web.Response:
    """Let held pushes go; `?reload=1` first re-reads the version (after a restore)."""
    updater = request.app[UPDATER]
    reload = request.query.get("reload", "0")
    if reload not in ("0", "1"):
        raise BadRequestError(f"query parameter reload: expected 0 or 1, got {describe(reload)}")
    if reload == "1":
        if not updater.paused:
            raise BadRequestError(
                "reload=1 needs a paused replica (POST /v1/admin/pause first): pushes in "
                "flight would mix the old rows with the restored ones"
            )
        await updater.reload()
    updater.resume()
    return _msgpack({"paused": False, "version": updater.version})


async def get_tables(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    tables = config.to_dict()["tables"]
    return _msgpack(
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


def _metrics_handler(registry: CollectorRegistry) -> Handler:
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


def make_app(
    config: ClusterConfig, *, replica: int = 0, registry: CollectorRegistry | None = None
) -> web.Application:
    """Build the service of replica `replica` (its partition of the rows)."""
    replicas = max(len(config.optimizers), 1)
    if not 0 <= replica < replicas:
        raise ConfigError(
            f"replica {replica} does not exist: the config lists {replicas} "
            f"optimizer replica(s) (0-{replicas - 1})"
        )
    registry = registry if registry is not None else CollectorRegistry()
    app = web.Application(
        client_max_size=config.service.max_body_bytes, middlewares=[_errors, _auth]
    )
    app[CONFIG] = config
    app[REPLICA] = replica
    app[METRICS] = ServiceMetrics(registry)

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        store = EmbeddingStore(config)
        metrics = app[METRICS]

        def count_rows(table: str, n: int) -> None:
            metrics.rows_updated.labels(table=table).inc(n)

        updater = Updater(
            config,
            store,
            replica=replica,
            push_record_ttl_s=config.service.push_record_ttl_s,
            on_rows=count_rows,
        )
        try:
            finished = await updater.recover()
            if finished:
                logger.warning("replica %d finished %d journaled pushes", replica, finished)
        except BaseException:
            await store.close()
            raise
        app[STORE] = store
        app[UPDATER] = updater
        yield
        await updater.close()
        await store.close()

    app.cleanup_ctx.append(store_ctx)
    app.router.add_post("/v1/gradients", post_gradients)
    app.router.add_get("/v1/tables", get_tables)
    app.router.add_post("/v1/dense/init", post_dense_init)
    app.router.add_get("/v1/dense", get_dense)
    app.router.add_get("/v1/version", get_version)
    app.router.add_post("/v1/admin/pause", post_pause)
    app.router.add_post("/v1/admin/resume", post_resume)
    app.router.add_get("/healthz", get_healthz)
    app.router.add_get("/metrics", _metrics_handler(registry))
    return app


_M_MMAP_THRESHOLD = -3  # mallopt(3) parameter number in glibc's malloc.h
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own initial threshold, kept from then on


def _pin_malloc_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at 128 KiB for the whole life of the process.

    glibc raises its mmap threshold (up to 32 MiB) each time a large mmapped block is
    freed. From then on every block below it, such as request bodies, asyncio's 256 KiB
    socket reads and numpy arrays, comes from the heap. Buffers of ever different sizes
    leave holes there that later ones do not fit, so the heap grew while the memory in
    use stayed flat: the service's RSS grew by ~600 bytes per push without bound (from
    54 to 67 MB over 20,000 pushes of the soak's trainers; tests/reliability/test_soak.py).
    With a fixed threshold, such blocks are mmapped and go back to the OS when freed.
    Setting the threshold turns the raising off (mallopt(3)).

    Returns whether it was set: not on another libc, nor when the user chose a threshold
    (MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES).
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or "mmap_threshold" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (AttributeError, OSError, ValueError):  # not glibc (musl, macOS, Windows)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lookup-table-optimizer", description="run one optimizer service replica"
    )
    parser.add_argument("--config", required=True, help="the cluster file (TOML)")
    parser.add_argument("--replica", type=int, default=0, help="partition number (default 0)")
    parser.add_argument("--host", help="listen address (default: from the replica's URL)")
    parser.add_argument("--port", type=int, help="listen port (default: from the replica's URL)")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if _pin_malloc_mmap_threshold():
        logger.debug("glibc mmap threshold pinned at %d bytes", _MMAP_THRESHOLD_BYTES)
    try:
        config = load_config(args.config)
        url = (
            urlsplit(config.optimizers[args.replica])
            if args.replica < len(config.optimizers)
            else None
        )
        host = args.host or (url.hostname if url else "127.0.0.1")
        port = args.port or (url.port if url and url.port else 8470)
        app = make_app(config, replica=args.replica)
    except LookupTableError as exc:
        logger.error("lookup-table-optimizer: %s", exc)
        return 1
    logger.info(
        "replica %d of namespace %r listening on %s:%d", args.replica, config.namespace, host, port
    )
    web.run_app(app, host=host, port=port, print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
