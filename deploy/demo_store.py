"""The storage-layer demo: rows created on first sight, read back, updated, and a lost node.

Run by deploy/demo.sh against the cluster it started (deploy/demo.toml).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from lookup_table import DataLossError, EmbeddingStore, load_config
from lookup_table.admin import node_stats


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
