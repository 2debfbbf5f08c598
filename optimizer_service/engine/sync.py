"""Sync mode: collect the pushes of one version from every worker, apply their mean once.

Each worker pushes once per version. When the last of the `workers` pushes of the
current version arrives, their mean (`mean_push`) is applied as one push whose
`push_id` is `sync-v<version>`, the version goes up by one, and every worker of the
round gets the same answer. A retried push of a recent round gets that answer again,
marked as a duplicate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.optimizers import segment_sum
from optimizer_service.engine.plan import Applied
from optimizer_service.errors import BadRequestError, StaleVersionError
from optimizer_service.push import Push, TableGrads

__all__ = ["SyncRounds", "mean_push"]

ApplyMerged = Callable[[Push, int], Awaitable[Applied]]
"""Applies a round's merged push, making the given version the replica's new one."""


@dataclass(slots=True)
class _Round:
    """The pushes of one version, until every worker has pushed."""

    pushes: dict[int, Push] = field(default_factory=dict)
    done: asyncio.Future[Applied] | None = None


class SyncRounds:
    """The open sync rounds of one replica, and the answers of the recent ones."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._rounds: dict[int, _Round] = {}
        self._recent: dict[str, Applied] = {}

    def clear(self) -> None:
        """Forget every round (after a restore: the version may go back)."""
        self._rounds.clear()
        self._recent.clear()

    async def join(self, push: Push, *, version: int, apply: ApplyMerged) -> Applied:
        """Add `push` to the round of `version` (the replica's current one) and wait for
        the round's result; the last worker's push applies the mean with `apply`."""
        recent = self._recent.get(push.push_id)
        if recent is not None:
            return replace(_shared(recent), applied=False, duplicate=True)
        workers = self.workers
        if push.worker >= workers:
            raise BadRequestError(
                f"worker: {push.worker} is not a worker of this job (workers = {workers})"
            )
        if push.version != version:
            raise StaleVersionError(
                f"version: the push is for version {push.version} but the model is at version "
                f"{version}; fetch the current dense parameters and rows "
                f"(GET /v1/dense, GET /v1/version) and recompute the step"
            )
        round_ = self._rounds.setdefault(push.version, _Round())
        if round_.done is None:
            round_.done = asyncio.get_running_loop().create_future()
        done = round_.done
        if push.worker in round_.pushes:
            raise StaleVersionError(
                f"worker {push.worker} already pushed for version {push.version} (push_id "
                f"{round_.pushes[push.worker].push_id}); one push per worker and version"
            )
        round_.pushes[push.worker] = push
        if len(round_.pushes) == workers:
            del self._rounds[push.version]
            merged = mean_push(f"sync-v{push.version}", list(round_.pushes.values()), workers)
            try:
                result = await apply(merged, push.version + 1)
            except BaseException as exc:
                done.set_exception(exc)
                done.exception()
                raise
            done.set_result(result)
            for p in round_.pushes.values():
                self._recent[p.push_id] = result
            while len(self._recent) > 64 * workers:
                self._recent.pop(next(iter(self._recent)))
            return result  # the rows the round created: told to this worker only
        return _shared(await asyncio.shield(done))


def _shared(result: Applied) -> Applied:
    """A round's result as the workers that did not apply it get it: without `created`,
    so that each row the round created is counted once, by the worker that applied it."""
    return replace(result, created={})


def mean_push(push_id: str, pushes: list[Push], workers: int) -> Push:
    """One push whose gradients are the mean over `workers` pushes (sum / workers)."""
    by_table: dict[str, list[TableGrads]] = {}
    for p in pushes:
        for t in p.tables:
            by_table.setdefault(t.table, []).append(t)
    tables = []
    scale = np.float32(1.0 / workers)
    for name, parts in by_table.items():
        ids = np.concatenate([t.ids for t in parts])
        grads = np.concatenate([t.grads for t in parts])
        uniq, summed = segment_sum(ids, grads)
        tables.append(TableGrads(table=name, ids=uniq, grads=summed * scale))
    dense: dict[str, NDArray[np.float32]] = {}
    for p in pushes:
        for name, g in p.dense.items():
            dense[name] = dense[name] + g if name in dense else np.array(g, dtype=np.float32)
    return Push(
        push_id=push_id,
        worker=0,
        version=pushes[0].version,
        tables=tuple(tables),
        dense={n: (g * scale).astype(np.float32) for n, g in dense.items()},
    )
