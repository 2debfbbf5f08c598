"""How the service answers: a msgpack map on success, JSON `{"error": ...}` on failure.

DESIGN.md "Wire protocol": errors are JSON so they read well in curl and logs.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lookup_table.core.wire import CONTENT_TYPE, pack

__all__ = ["json_error", "msgpack_response"]


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
