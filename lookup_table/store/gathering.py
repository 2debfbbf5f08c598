"""Running the per-node jobs of a batch concurrently, and the one error a failed fan-out
raises (data loss first)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from lookup_table.errors import DataLossError, LookupTableError

__all__ = ["gather", "raise_first"]

T = TypeVar("T")


def raise_first(errors: Sequence[BaseException]) -> None:
    """Raise the most useful single error of a fan-out (data loss first)."""
    lost = [e for e in errors if isinstance(e, DataLossError)]
    if lost:
        nodes = tuple(sorted({n for e in lost for n in e.nodes}))
        if len(lost) == 1:
            raise lost[0]
        raise DataLossError(
            f"memcached nodes {', '.join(nodes)} have lost their data: their sentinels are "
            f"gone (restart or flush). Nothing is read from them until you restore a checkpoint "
            f"(lookup-table-checkpoint restore) or accept the loss (lookup-table-admin reinit "
            f"--yes)",
            nodes=nodes,
        ) from lost[0]
    for exc in errors:
        if isinstance(exc, LookupTableError):
            raise exc
    raise errors[0]


async def gather(jobs: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run jobs concurrently; on failure cancel the rest and raise one clear error."""
    if len(jobs) == 1:
        return [await jobs[0]]
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]
    except BaseExceptionGroup as group_error:
        raise_first(group_error.exceptions)
    return [t.result() for t in tasks]
