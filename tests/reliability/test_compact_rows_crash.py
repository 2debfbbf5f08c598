"""A replica process kill -9'ed mid-push, per compact option (16-bit rows, row-wise
optimizers): after its restart (journal replay before serving) and the client's retries
with the same push_id, every row and slot is bit-exact what the pushes give, stepped in
process with `lookup_table.core` (the optimizer, then `precision.round_to` keyed as the
replica keys it), each push applied exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from lookup_table import EmbeddingStore
from lookup_table.client import OptimizerClient
from lookup_table.config import ClusterConfig, load_config
from lookup_table.core.optimizers import make_optimizer
from lookup_table.ops.localcluster import MemcachedProcess, free_port
from tests.integration.test_row_dtypes import PRECISE, as_stored
from tests.reliability.harness import ServiceProcess, cluster_file, wait_healthy

logger = logging.getLogger(__name__)

DIM = 8
POOL = 24  # ids of the table
PER_PUSH = 10  # distinct ids a push names (distinct: no summing order to reproduce)
PUSHES = 12
KILL_AT = (5,)  # kill -9 as soon as this push is sent (a push takes a few ms)


def _workload() -> list[tuple[NDArray[np.int64], NDArray[np.float32]]]:
    rng = np.random.default_rng(5_3)
    ids = np.array([0, -1, 2**63 - 1, *rng.integers(-(2**62), 2**62, POOL - 3)], dtype=np.int64)
    return [
        (
            ids[rng.choice(POOL, size=PER_PUSH, replace=False)],
            rng.standard_normal((PER_PUSH, DIM)).astype(np.float32),
        )
        for _ in range(PUSHES)
    ]


def _expected(
    config: ClusterConfig,
    start: NDArray[np.float32],
    ids: NDArray[np.int64],
    work: list[tuple[NDArray[np.int64], NDArray[np.float32]]],
) -> NDArray[np.float32]:
    """The items (row, then slots) after every push of `work` applied once, in order."""
    spec = config.table("t")
    opt = make_optimizer(spec.optimizer)
    items = start.copy()
    where = {v: k for k, v in enumerate(ids.tolist())}
    for push_ids, grads in work:
        at = np.array([where[v] for v in push_ids.tolist()], dtype=np.intp)
        rows, slots = items[at, :DIM], items[at, DIM:]
        new_rows, new_slots = opt.update(rows, grads, slots)
        items[at, :DIM] = as_stored(spec, push_ids, slots, new_rows, new_slots)
        items[at, DIM:] = new_slots
    return items


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option", sorted(PRECISE))
async def test_a_replica_killed_mid_push_leaves_compact_rows_bit_exact(
    own_nodes: list[MemcachedProcess], tmp_path: Path, option: str
) -> None:
    dtype, optimizer = PRECISE[option]
    port = free_port()
    table = {"name": "t", "dim": DIM, "seed": 9, "dtype": dtype, "optimizer": optimizer}
    path = cluster_file(tmp_path, [n.address for n in own_nodes], port, tables=[table])
    config = load_config(path)
    work = _workload()
    ids = np.unique(np.concatenate([i for i, _ in work]))
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await store.lookup("t", ids)
        start, found = await store.get("t", ids, slots=True)
    assert found.all()
    want = _expected(config, start, ids, work)

    replica = ServiceProcess(path, port, tmp_path, name="replica")
    sent = asyncio.Event()
    spans: list[tuple[float, float]] = []  # (kill, healthy again)
    pushed: list[dict[str, Any]] = []

    async def pusher(client: OptimizerClient) -> None:
        for i, (push_ids, grads) in enumerate(work):
            began = time.time()
            if i in KILL_AT:
                sent.set()  # the killer runs once this push waits on the replica
            summary = await client.push({"t": (push_ids, grads)}, push_id=f"p{i}")
            pushed.append({"i": i, "start": began, "end": time.time(), **summary})

    async def killer() -> None:
        for _ in KILL_AT:
            await sent.wait()
            sent.clear()
            killed_at = time.time()
            replica.kill()
            replica.start()
            await wait_healthy(replica, timeout_s=30)
            spans.append((killed_at, time.time()))

    try:
        replica.start()
        await wait_healthy(replica)
        async with OptimizerClient(config, max_retries=200, backoff_s=0.02) as client:
            async with asyncio.TaskGroup() as group:
                group.create_task(pusher(client))
                group.create_task(killer())
            await client.pause(timeout_s=30)  # everything written behind is in memcached
            async with EmbeddingStore(config) as store:
                got, found = await store.get("t", ids, slots=True)
            await client.resume()
        replica.terminate()
    finally:
        replica.kill()
    log = replica.log()
    logger.info(
        "%s: kills at pushes %s, outages %s s, journal replays %d, duplicates %d",
        option,
        KILL_AT,
        [round(h - k, 2) for k, h in spans],
        log.count("replaying journaled push"),
        sum(p["duplicate"] for p in pushed),
    )
    assert len(spans) == len(KILL_AT)
    for n, (killed_at, _) in enumerate(spans):
        (p,) = (p for p in pushed if p["i"] == KILL_AT[n])
        assert p["start"] <= killed_at and p["end"] > killed_at, (
            f"kill {n}: push {p['i']} ran {p['start']:.3f}..{p['end']:.3f}, the kill came at "
            f"{killed_at:.3f}: it was not in flight"
        )
    assert "Traceback" not in log, log[-3000:]
    assert found.all()
    bad = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)).any(axis=1))
    assert not bad.size, (
        f"{option}: {bad.size} of {ids.size} items differ from every push applied once; "
        f"id {ids[bad[0]]}: got {got[bad[0]].tolist()}, want {want[bad[0]].tolist()}"
    )
    # the pushes moved the rows (a test that would pass with nothing applied proves nothing)
    assert (got[:, :DIM] != start[:, :DIM]).any(axis=1).sum() >= POOL // 2
