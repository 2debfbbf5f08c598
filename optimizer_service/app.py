"""The aiohttp optimizer service: `make_app(config, replica=K)` and `lookup-table-optimizer`.

This module builds the app (the factory, the error and auth middleware) and runs it
(`main`); on startup a replica finishes its journal before it serves. The route handlers
are in `handlers` and `admin`, the push path in `engine`; the endpoints are in
docs/service.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry

from lookup_table.config import ClusterConfig, load_config
from lookup_table.errors import (
    ConfigError,
    LookupTableError,
)
from lookup_table.store import EmbeddingStore
from optimizer_service.admin import post_pause, post_resume
from optimizer_service.appkeys import CONFIG, METRICS, REPLICA, STORE, UPDATER
from optimizer_service.engine.updater import Updater
from optimizer_service.errors import UnauthorizedError
from optimizer_service.handlers import (
    get_dense,
    get_healthz,
    get_tables,
    get_version,
    metrics_handler,
    post_dense_init,
    post_gradients,
    post_rows,
)
from optimizer_service.malloc import MMAP_THRESHOLD_BYTES, trimming, tune_malloc
from optimizer_service.metrics import ServiceMetrics
from optimizer_service.responses import (
    CLIENT_CLOSED,
    COUNTED,
    client_gone,
    count_answer,
    count_went_away,
    error_answer,
)

__all__ = ["CONFIG", "METRICS", "REPLICA", "STORE", "UPDATER", "main", "make_app"]

logger = logging.getLogger(__name__)

_PUBLIC_PATHS = frozenset({"/healthz", "/metrics"})


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every error into JSON with the right status, and count it. A client that went
    away (a trainer's ctrl-C) is no error: logged at INFO, counted as `CLIENT_CLOSED`."""
    reason = None
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        if client_gone(request):
            count_went_away(request)
        raise
    except Exception as exc:
        if isinstance(exc, ConnectionError) and client_gone(request):
            count_went_away(request)
            return web.Response(status=CLIENT_CLOSED)  # for the access log: nobody reads it
        status, doc, reason = error_answer(exc)
        response = web.json_response(doc, status=status)
    if COUNTED in response:  # a streamed answer counts itself (its end may be an error)
        return response
    if client_gone(request):  # the answer is ready, and nobody is there to read it
        count_went_away(request)
    else:
        count_answer(request, response.status, reason)
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
    app[METRICS] = ServiceMetrics(
        registry,
        namespace=config.namespace,
        replica=replica,
        replicas=replicas,
        mode=config.mode,
        workers=config.workers,
    )

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        store = EmbeddingStore(config)
        metrics = app[METRICS]

        updater = Updater(
            config,
            store,
            replica=replica,
            push_record_ttl_s=config.service.push_record_ttl_s,
            on_rows=metrics.count_rows_updated,
            on_dropped=metrics.count_gradients_dropped,
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
    app.router.add_post("/v1/rows", post_rows)
    app.router.add_get("/v1/tables", get_tables)
    app.router.add_post("/v1/dense/init", post_dense_init)
    app.router.add_get("/v1/dense", get_dense)
    app.router.add_get("/v1/version", get_version)
    app.router.add_post("/v1/admin/pause", post_pause)
    app.router.add_post("/v1/admin/resume", post_resume)
    app.router.add_get("/healthz", get_healthz)
    app.router.add_get("/metrics", metrics_handler(registry))
    return app


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lookup-table-optimizer", description="run one optimizer service replica"
    )
    parser.add_argument("--config", required=True, help="the cluster file (TOML)")
    parser.add_argument("--replica", type=int, default=0, help="partition number (default 0)")
    parser.add_argument("--host", help="listen address (default: from the replica's URL)")
    parser.add_argument("--port", type=int, help="listen port (default: from the replica's URL)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="log every request (aiohttp's access log, at INFO): a line per push and per "
        "read, so off by default; /metrics counts requests by path and status",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tuned = tune_malloc()
    if tuned:
        logger.debug("glibc mmap threshold fixed at %d bytes", MMAP_THRESHOLD_BYTES)
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
        if tuned:
            app.cleanup_ctx.append(trimming)
    except LookupTableError as exc:
        logger.error("lookup-table-optimizer: %s", exc)
        return 1
    logger.info(
        "replica %d of namespace %r listening on %s:%d", args.replica, config.namespace, host, port
    )
    web.run_app(
        app,
        host=host,
        port=port,
        print=None,
        handle_signals=True,
        access_log=logging.getLogger("aiohttp.access") if args.access_log else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
