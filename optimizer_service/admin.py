"""The admin endpoints of a replica: pause and resume, for a checkpoint, a restore, a reset.

`POST /v1/admin/pause?timeout_s=S&drop_unfinished=0|1` holds new pushes and waits for
those in flight (`drop_unfinished=1`: and drops what is not written yet, for a restore
or `lookup-table-admin reset`); `POST /v1/admin/resume?reload=0|1` lets them go, after
forgetting the rows and dense parameters held and re-reading the version when a
restore or reset replaced them (`reload=1`).
"""

from __future__ import annotations

from aiohttp import web

from lookup_table.core.wire import describe
from optimizer_service.appkeys import UPDATER
from optimizer_service.errors import BadRequestError
from optimizer_service.handlers import float_query
from optimizer_service.responses import msgpack_response

__all__ = ["post_pause", "post_resume"]


def _flag(request: web.Request, name: str) -> bool:
    """A `0`/`1` query parameter (default 0)."""
    raw = request.query.get(name, "0")
    if raw not in ("0", "1"):
        raise BadRequestError(f"query parameter {name}: expected 0 or 1, got {describe(raw)}")
    return raw == "1"


async def post_pause(request: web.Request) -> web.Response:
    """Finish in-flight pushes and hold new ones (for a consistent checkpoint)."""
    timeout_s = float_query(request, "timeout_s", 600.0)
    drop = _flag(request, "drop_unfinished")
    unfinished = await request.app[UPDATER].pause(timeout_s=timeout_s, drop_unfinished=drop)
    return msgpack_response(
        {"paused": True, "auto_resume_s": timeout_s, "unfinished_pushes": unfinished}
    )


async def post_resume(request: web.Request) -> web.Response:
    """Let held pushes go; `?reload=1` first re-reads the version (after a restore)."""
    updater = request.app[UPDATER]
    if _flag(request, "reload"):
        if not updater.paused:
            raise BadRequestError(
                "reload=1 needs a paused replica (POST /v1/admin/pause first): pushes in "
                "flight would mix the old rows with the restored ones"
            )
        await updater.reload()
    updater.resume()
    return msgpack_response({"paused": False, "version": updater.version})
