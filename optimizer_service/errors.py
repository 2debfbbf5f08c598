"""Errors of the optimizer service, each with the HTTP status it is answered with.

::

    OptimizerServiceError
    ├── BadRequestError        400  malformed body, unknown table, wrong dim/dtype, NaN
    ├── UnauthorizedError      401  missing or wrong bearer token
    ├── NotOwnerError          409  rows owned by another replica (the client splits pushes)
    ├── StaleVersionError      409  sync mode: a push for an old version
    └── UnavailableError       503  the service is pausing or recovering

A request from a process whose cluster file differs (lookup_table.errors
ClusterMismatchError) is answered 409 with `type` ClusterMismatchError. Store errors
(lookup_table.errors) are mapped by the error middleware:
StoreFullError 507, every other store error (DataLossError, NodeUnavailableError,
StoreTimeoutError, CorruptValueError, ...) 503; the JSON body carries the error's
`type` and its `node` (`nodes` for DataLossError), and OptimizerClient re-raises it
as that error without retrying.
"""

from __future__ import annotations

__all__ = [
    "BadRequestError",
    "NotOwnerError",
    "OptimizerServiceError",
    "StaleVersionError",
    "UnauthorizedError",
    "UnavailableError",
]


class OptimizerServiceError(Exception):
    """Base: `status` is the HTTP status, `reason` a short label for metrics."""

    status = 500
    reason = "internal"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class BadRequestError(OptimizerServiceError):
    status = 400
    reason = "bad_request"


class UnauthorizedError(OptimizerServiceError):
    status = 401
    reason = "unauthorized"


class NotOwnerError(OptimizerServiceError):
    status = 409
    reason = "not_owner"


class StaleVersionError(OptimizerServiceError):
    status = 409
    reason = "stale_version"


class UnavailableError(OptimizerServiceError):
    status = 503
    reason = "unavailable"
