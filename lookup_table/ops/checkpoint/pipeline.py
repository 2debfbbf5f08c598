"""What a save and a restore share: batch sizes, a bounded pipeline, the progress bar,
and running their coroutine to the end from code that is not async."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, ParamSpec, TypeVar

from tqdm import tqdm

from lookup_table.errors import LookupTableError

__all__ = [
    "DEFAULT_BATCH_IDS",
    "DEFAULT_PAUSE_TIMEOUT_S",
    "WINDOW",
    "blocking_twin",
    "progress_bar",
    "run_blocking",
    "run_bounded",
]

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_BATCH_IDS = 32_768
DEFAULT_PAUSE_TIMEOUT_S = 3600.0
WINDOW = 4  # batches in flight at once (each is split by node and max_batch_keys)


def progress_bar(total: int, desc: str, enabled: bool | None) -> Any:
    """A tqdm bar of rows on stderr; `enabled=None` shows it only on a terminal."""
    return tqdm(
        total=total,
        desc=desc,
        unit="rows",
        unit_scale=True,
        file=sys.stderr,
        leave=False,
        disable=None if enabled is None else not enabled,
        dynamic_ncols=True,
    )


async def run_bounded(jobs: Iterable[Callable[[], Awaitable[None]]], window: int) -> None:
    """Run jobs with at most `window` in flight; the first failure cancels the rest."""
    gate = asyncio.Semaphore(window)

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    try:
        async with asyncio.TaskGroup() as group:
            for job in jobs:
                group.create_task(run(job))
    except BaseExceptionGroup as failed:
        errors = failed.exceptions
        first = next((e for e in errors if isinstance(e, LookupTableError)), errors[0])
        raise first from None


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to the end and return its result, from code that is not async.

    Without an event loop in this thread it runs on a new one (`asyncio.run`). Where one
    is running (Jupyter, an async caller) it runs on a new loop in a private thread while
    this thread waits: the running loop is blocked meanwhile, so async code should await
    the coroutine itself instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lookup-table-run") as pool:
        return pool.submit(asyncio.run, coro).result()


def blocking_twin(
    coro_fn: Callable[P, Coroutine[Any, Any, T]], *, name: str, doc: str
) -> Callable[P, T]:
    """The blocking function `name` of the coroutine function `coro_fn`: the same parameters
    (mypy and `inspect.signature` see `coro_fn`'s), run to the end with `run_blocking`."""

    @functools.wraps(coro_fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_blocking(coro_fn(*args, **kwargs))

    run.__name__ = run.__qualname__ = name
    run.__doc__ = doc
    return run
