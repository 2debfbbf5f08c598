"""How the service answers: a msgpack map on success, JSON `{"error": ...}` on failure.

Errors are JSON so they read well in curl and logs (docs/service.md).
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from lookup_table.core.wire import CONTENT_TYPE, pack
from lookup_table.errors import (
    ClusterMismatchError,
    ConfigError,
    DataLossError,
    DenseParamError,
    KeyEncodingError,
    LookupTableError,
    StoreError,
    StoreFullError,
)
from optimizer_service.appkeys import METRICS
from optimizer_service.errors import OptimizerServiceError

__all__ = [
    "CLIENT_CLOSED",
    "COUNTED",
    "PUSHED_BY",
    "client_gone",
    "count_answer",
    "count_went_away",
    "error_answer",
    "json_error",
    "msgpack_response",
]

logger = logging.getLogger(__name__)

COUNTED: Any = (
    web.ResponseKey("lookup_table.counted", bool)
    if hasattr(web, "ResponseKey")
    else "lookup_table.counted"
)
"""Set on a response (aiohttp responses are mappings) that counted its own answer. A
typed key where aiohttp has them: a str key makes it warn (NotAppKeyWarning) at the
first answered push of a process, which `filterwarnings = error` turns into a 500."""

PUSHED_BY: Any = (
    web.RequestKey("lookup_table.pushed_by", tuple)
    if hasattr(web, "RequestKey")
    else "lookup_table.pushed_by"
)
"""Set on a push's request once its body is parsed: (worker, push_id), for the log line
of a client that goes away."""

CLIENT_CLOSED = 499
"""The status a request is counted under when its client went away before its answer
(nginx's "client closed request"): nobody reads it, it is no error of the service."""


def json_error(status: int, message: str, kind: str | None = None, **extra: Any) -> web.Response:
    """`{"error": message}`, plus `type` (e.g. DataLossError) and the fields the error
    carries (`node`, `nodes`) so clients can re-raise it as it was raised here."""
    body: dict[str, Any] = {"error": message}
    if kind is not None:
        body["type"] = kind
    body.update(extra)
    return web.json_response(body, status=status)


def msgpack_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=pack(obj), status=status, content_type=CONTENT_TYPE)


def _endpoint(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource
    return resource.canonical if resource is not None else "unmatched"


def error_answer(exc: BaseException) -> tuple[int, dict[str, Any], str]:
    """The status, JSON document and metrics reason an error is answered with.

    Raises `exc` again for what is not an error answer (an HTTP redirect, cancellation).
    """
    if isinstance(exc, OptimizerServiceError):
        return exc.status, {"error": str(exc)}, exc.reason
    if isinstance(exc, web.RequestPayloadError):
        return 400, {"error": f"cannot read the request body: {exc}"}, "malformed"
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        reason = "too_large" if exc.status == 413 else f"http_{exc.status}"
        return exc.status, {"error": exc.text or exc.reason}, reason
    if isinstance(exc, DenseParamError):
        return 400, {"error": str(exc)}, exc.reason
    if isinstance(exc, ClusterMismatchError):  # a ConfigError: before them
        return 409, {"error": str(exc), "type": "ClusterMismatchError"}, "cluster_mismatch"
    if isinstance(exc, KeyEncodingError | ConfigError):
        return 400, {"error": str(exc)}, "bad_request"
    if isinstance(exc, DataLossError):
        doc: dict[str, Any] = {"error": str(exc), "type": "DataLossError", "nodes": list(exc.nodes)}
        return 503, doc, "data_loss"
    if isinstance(exc, StoreFullError):
        return 507, {"error": str(exc), "type": "StoreFullError", "node": exc.node}, "store_full"
    if isinstance(exc, StoreError):  # a node timed out, refused, sent corrupt values: name it
        doc = {"error": str(exc), "type": type(exc).__name__, "node": exc.node}
        return 503, doc, "store_unavailable"
    if isinstance(exc, LookupTableError):
        return 503, {"error": str(exc)}, "store_unavailable"
    if isinstance(exc, Exception):  # the boundary: log once, answer 500
        logger.exception("unexpected error", exc_info=exc)
        return 500, {"error": f"internal error: {type(exc).__name__}"}, "internal"
    raise exc


def count_answer(request: web.Request, status: int, reason: str | None) -> None:
    """Count one answer of `request` (and a refused push by its reason)."""
    metrics = request.app[METRICS]
    endpoint = _endpoint(request)
    metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
    if reason is not None and 400 <= status < 500 and endpoint == "/v1/gradients":
        metrics.rejected.labels(reason=reason).inc()


def client_gone(request: web.Request) -> bool:
    """Whether the client closed its connection (aiohttp dropped the transport)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def count_went_away(request: web.Request) -> None:
    """Log (INFO: a trainer's ctrl-C is no error) and count a request whose client went
    away before its answer. A push goes on without it (exactly once: a retry of its
    push_id is answered as a duplicate), or was not read, so not applied."""
    pushed_by = request.get(PUSHED_BY)
    if pushed_by is None:
        what = " (before its body was read)" if request.can_read_body else ""
    else:
        what = f" (worker {pushed_by[0]}, push_id {pushed_by[1]})"
    logger.info("client went away during %s %s%s", request.method, request.path, what)
    request.app[METRICS].requests.labels(
        endpoint=_endpoint(request), status=str(CLIENT_CLOSED)
    ).inc()
