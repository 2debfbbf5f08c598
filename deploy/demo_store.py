"""The storage + optimizer demo: rows created on first sight, read back, updated through
the optimizer service, dense parameters, a refused push, and the service's metrics.

Run by deploy/demo.sh against the cluster it started (deploy/demo.toml).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request

import numpy as np

from lookup_table import (
    DataLossError,
    EmbeddingStore,
    OptimizerClient,
    PushRejectedError,
    load_config,
)
from lookup_table.client import RowReader
from lookup_table.ops.stats import node_stats


async def run(config_path: str) -> None:
    config = load_config(config_path)
    rng = np.random.default_rng(0)
    async with EmbeddingStore(config) as store:
        # A Criteo-like batch: Zipf ids over a huge int64 space, many repeats.
        ids = (rng.zipf(1.2, size=65_536) * 2_654_435_761) % (2**62)
        uniq = np.unique(ids).shape[0]
        t0 = time.perf_counter()
        rows = await store.lookup("user", ids)
        t1 = time.perf_counter()
        print(
            f"lookup 'user': {ids.shape[0]:,} ids ({uniq:,} unique) -> rows {rows.shape} "
            f"{rows.dtype}, created on first sight in {1e3 * (t1 - t0):.1f} ms"
        )
        again = await store.lookup("user", ids)
        t2 = time.perf_counter()
        print(
            f"lookup again: identical rows: {bool((again == rows).all())}, "
            f"{1e3 * (t2 - t1):.1f} ms ({uniq / (t2 - t1):,.0f} unique rows/s)"
        )

        words = ["banana", "a b", "x/y", "banana", "naïve 🍌"]
        q = await store.lookup("query", words)
        first = [round(float(x), 4) for x in q[:, 0]]
        print(f"lookup 'query' (string ids {words!r}): first floats {first}")

        upd = np.unique(ids)[:1000]
        new = np.full((upd.shape[0], 16), 0.5, dtype=np.float32)
        await store.set("user", upd, new)
        back = await store.lookup("user", upd)
        print(f"set 1,000 rows to 0.5 and read them back: {bool((back == 0.5).all())}")

        ev = await store.lookup("item", [10**15 + 1, 10**15 + 2], create=False)
        print(
            f"evaluation lookup of unseen 'item' ids (create=False) writes nothing: "
            f"{ev.shape} rows, found {int((await store.get('item', [10**15 + 1]))[1].sum())}"
        )

    # The optimizer service: push gradients, the service reads rows + slots, applies
    # the table's optimizer and keeps them, writing them to memcached behind, every
    # service.row_flush_pushes pushes (exactly once per push_id). Trainers read such rows
    # through the replica that owns them (RowReader), which has them first.
    async with OptimizerClient(config, worker=0) as client, EmbeddingStore(config) as store:
        reader = RowReader(store, client)
        hot = np.unique(ids)[:2000]
        before = await reader.lookup("user", hot)
        grads = rng.standard_normal((hot.shape[0], 16)).astype(np.float32)
        t0 = time.perf_counter()
        result = await client.push({"user": (hot, grads)})
        t1 = time.perf_counter()
        again = await client.push({"user": (hot, grads)}, push_id=result["push_id"])
        after = await reader.lookup("user", hot)
        print(
            f"push 'user' (adam): {result['rows']:,} rows updated in {1e3 * (t1 - t0):.1f} ms; "
            f"mean |change| {float(np.abs(after - before).mean()):.2e}; the same push_id "
            f"again is a duplicate: {again['duplicate']}"
        )
        try:
            await client.push({"user": (hot[:2], np.full((2, 16), np.nan, np.float32))})
        except PushRejectedError as exc:
            print(f"a NaN gradient is refused ({exc.status}): {str(exc)[:150]}...")

    url = config.optimizers[0] + "/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: ASYNC210 - demo, once
        text = resp.read().decode()
    print(f"a few lines of {url}:")
    for line in text.splitlines():
        if line.startswith(
            (
                "lookup_table_pushes_total",
                "lookup_table_rows_updated_total",
                "lookup_table_rejected_pushes_total",
                "lookup_table_node_fill_ratio",
                "lookup_table_push_latency_seconds_count",
                "lookup_table_version",
            )
        ):
            print("   ", line)

    for node, s in (await node_stats(config)).items():
        print(
            f"node {node}: {s['curr_items']:,} items, {int(s['bytes']) / 2**20:.1f} MiB "
            f"({float(s['fill_ratio']):.2%} full), evictions {s['evictions']}, "
            f"sentinel {'ok' if s['sentinel'] else 'MISSING'}"
        )
    try:
        async with EmbeddingStore(config) as store:
            await store.lookup("user", [1])
    except DataLossError as exc:  # pragma: no cover - only if a node was restarted
        print(f"DataLossError: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    asyncio.run(run(parser.parse_args().config))


if __name__ == "__main__":
    main()
