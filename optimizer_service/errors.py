"""Errors of the optimizer service, each with the HTTP status it is answered with.

`OptimizerServiceError` and its subclasses (400, 401, 409, 503); the library's errors
are mapped to statuses by the error middleware. The table of both: docs/service.md#endpoints.
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
