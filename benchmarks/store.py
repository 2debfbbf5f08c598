"""Benchmark `EmbeddingStore.lookup` against the raw pipelined ceiling and pymemcache.

Also a step's many-table lookups, the lifecycle knobs (`ttl_s`, `admit_after`) and key
encoding; docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.store                # 15 rounds, 65,536 ids per batch
    python -m benchmarks.store --quick        # smoke run: 3 rounds, 8,192 ids
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from benchmarks.harness.data import SEED, unique_id_blocks
from benchmarks.harness.options import Options
from benchmarks.harness.plot import plot_rates
from benchmarks.harness.report import (
    fmt_rate,
    lookup_table_fingerprint,
    machine_info,
    met,
    report_head,
    save,
)
from benchmarks.harness.rounds import Timings, interleaved, paired_ratio, timed, timed_sync
from lookup_table.config import ClusterConfig, NodeSpec, parse_config
from lookup_table.core.initializers import initial_rows
from lookup_table.core.keys import encode_keys, int_key_matrix, key_prefix
from lookup_table.core.optimizers import slot_width
from lookup_table.core.sharding import node_of
from lookup_table.ops.localcluster import memcached_cluster
from lookup_table.store import EmbeddingStore

DIMS = (16, 64)
NODES = 2
MEMORY_MB = 1024
LABELS = {
    "ceiling": "raw pipelined mg (ceiling)",
    "lookup": "store.lookup, existing rows",
    "create": "store.lookup, fresh rows (created)",
    "mixed": "store.lookup, 90 % existing + 10 % new",
    "mixed_eval": "the same, create=False",
    "pymemcache": "pymemcache get_many per node",
}
METHODS = tuple(LABELS)
RATIOS = (  # name, numerator, denominator (rows/s)
    ("lookup/ceiling", "lookup", "ceiling"),
    ("lookup/pymemcache", "lookup", "pymemcache"),
    ("create/ceiling", "create", "ceiling"),
    ("mixed/lookup", "mixed", "lookup"),
    ("mixed_eval/lookup", "mixed_eval", "lookup"),
)
KEY_METHODS = ("encode_keys", "int_key_matrix", "naive_loop")
MANY_TABLES = 26
MANY_IDS = 400  # unique ids per table
MANY_DIM = 16
MANY_LABELS = {
    "many": "lookup_many, existing rows",
    "concurrent": "26 concurrent lookups, existing rows",
    "many_mixed": "lookup_many, 10 % new rows",
    "concurrent_mixed": "26 concurrent lookups, 10 % new rows",
}
MANY_METHODS = tuple(MANY_LABELS)
ACCEPT_LOOKUP_VS_CEILING = 0.7
ACCEPT_LOOKUP_VS_PYMEMCACHE = 2.0
ACCEPT_MIXED_VS_LOOKUP = 0.9
NEW_FRACTION = 0.1  # of the ids of a mixed batch
LIFE_DIM = 16
LIFE_TTL_S = 3600
LIFE_ADMIT_AFTER = 2
LIFE_TABLES = {  # name -> its [[tables]] lifecycle keys (Adam, the default: slots too)
    "life_plain": {},
    "life_ttl": {"ttl_s": LIFE_TTL_S},
    "life_admit": {"admit_after": LIFE_ADMIT_AFTER},
}
LIFE_LABELS = {
    "hit": "existing rows, no TTL",
    "hit_ttl": "existing rows, ttl_s (T on the reads)",
    "mixed": "10 % new rows (added), no TTL",
    "mixed_ttl": "10 % new rows (added), ttl_s",
    "mixed_admit_count": "10 % new, 1st sighting (ma only)",
    "mixed_admit_add": "10 % new, K-th sighting (ma + add)",
}
LIFE_METHODS = tuple(LIFE_LABELS)
LIFE_RATIOS = (
    ("hit_ttl/hit", "hit_ttl", "hit"),
    ("mixed_ttl/mixed", "mixed_ttl", "mixed"),
    ("mixed_admit_count/mixed", "mixed_admit_count", "mixed"),
    ("mixed_admit_add/mixed", "mixed_admit_add", "mixed"),
)

_MG = np.frombuffer(b"mg ", dtype=np.uint8)
_V_CRLF = np.frombuffer(b" v\r\n", dtype=np.uint8)
_CRLF = np.frombuffer(b"\r\n", dtype=np.uint8)
_END = b"mn\r\n"
_END_REPLY = b"MN\r\n"
_READ_CHUNK = 1 << 20
_STREAM_LIMIT = 1 << 22


# ---------------------------------------------------------------- the ceiling


@dataclass(frozen=True, slots=True)
class RowShape:
    """A stored row item: the row's `dim` float32, then its optimizer's `slots` float32."""

    dim: int
    slots: int

    @property
    def nbytes(self) -> int:
        return 4 * (self.dim + self.slots)


class RawCeiling:
    """The fastest honest reader: one pipelined write and one numpy parse per node.

    Assumes every key hits with a value of the item's size (it raises otherwise),
    which is what lets it skip any per-reply scan; it keeps each row's `dim` floats,
    as a lookup does.
    """

    def __init__(self, nodes: tuple[NodeSpec, ...]) -> None:
        self._specs = nodes
        self.addresses = tuple(n.address for n in nodes)
        self._conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self) -> None:
        for spec in self._specs:
            async with asyncio.timeout(5.0):
                self._conns.append(
                    await asyncio.open_connection(spec.host, spec.port, limit=_STREAM_LIMIT)
                )

    async def close(self) -> None:
        conns, self._conns = self._conns, []
        for _, writer in conns:
            writer.close()
            await writer.wait_closed()

    async def get(
        self, namespace: str, table: str, ids: NDArray[np.int64], shape: RowShape
    ) -> NDArray[np.float32]:
        """Rows of unique `ids` in order, float32 (n, dim)."""
        dim = shape.dim
        n = ids.shape[0]
        keys = int_key_matrix(key_prefix(namespace, table, "w"), ids)
        placement = node_of(table, ids, self.addresses)
        order = np.argsort(placement, kind="stable")
        bounds = np.searchsorted(placement[order], np.arange(len(self._conns) + 1))
        out = np.empty((n, dim), dtype=np.float32)
        nbytes = shape.nbytes
        header = np.frombuffer(b"VA %d\r\n" % nbytes, dtype=np.uint8)
        stride = header.shape[0] + nbytes + 2

        async def one(j: int) -> None:
            index = order[bounds[j] : bounds[j + 1]]
            m = index.shape[0]
            if m == 0:
                return
            width = keys.shape[1] + 7
            request = np.empty(m * width + len(_END), dtype=np.uint8)
            lines = request[: m * width].reshape(m, width)
            lines[:, :3] = _MG
            lines[:, 3:-4] = keys[index]
            lines[:, -4:] = _V_CRLF
            request[m * width :] = np.frombuffer(_END, dtype=np.uint8)
            reader, writer = self._conns[j]
            writer.write(request.data)  # no copy of the request
            expected = m * stride + len(_END_REPLY)
            chunks: list[bytes] = []
            got = 0
            async with asyncio.timeout(30.0):
                while got < expected:
                    chunk = await reader.read(_READ_CHUNK)
                    if not chunk:
                        raise ConnectionError(f"node {self.addresses[j]} closed mid-reply")
                    chunks.append(chunk)
                    got += len(chunk)
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if got != expected or data[-4:] != _END_REPLY:
                raise RuntimeError(
                    f"ceiling: node {self.addresses[j]} sent {got} bytes, expected {expected} "
                    f"(a miss or an error reply: the ceiling needs every key to hit)"
                )
            block = np.frombuffer(data, dtype=np.uint8, count=m * stride).reshape(m, stride)
            if not (
                (block[:, : header.shape[0]] == header).all() and (block[:, -2:] == _CRLF).all()
            ):
                raise RuntimeError(f"ceiling: bad reply framing from node {self.addresses[j]}")
            out[index] = block[:, header.shape[0] : header.shape[0] + 4 * dim].view("<f4")

        await asyncio.gather(*(one(j) for j in range(len(self._conns))))
        return out


# ---------------------------------------------------------------- pymemcache


class PymemcacheReader:
    """One `pymemcache.Client` per node, split by the store's `node_of`."""

    def __init__(self, nodes: tuple[NodeSpec, ...]) -> None:
        from pymemcache.client.base import Client

        self.addresses = tuple(n.address for n in nodes)
        self._clients = [
            Client((n.host, n.port), connect_timeout=5.0, timeout=30.0, no_delay=True)
            for n in nodes
        ]

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def get(
        self, namespace: str, table: str, ids: NDArray[np.int64], shape: RowShape
    ) -> NDArray[np.float32]:
        """Rows of unique `ids` in order, float32 (n, dim); KeyError on a miss."""
        keys = encode_keys(namespace, table, "w", ids)
        placement = node_of(table, ids, self.addresses)
        out = np.empty((ids.shape[0], shape.dim), dtype=np.float32)
        for j, client in enumerate(self._clients):
            index = np.flatnonzero(placement == j)
            node_keys = [keys[i] for i in index.tolist()]
            found = client.get_many(node_keys)
            joined = b"".join([found[k] for k in node_keys])
            items = np.frombuffer(joined, dtype="<f4").reshape(-1, shape.dim + shape.slots)
            out[index] = items[:, : shape.dim]
        return out


# ---------------------------------------------------------------- key encoding


def naive_keys(namespace: str, table: str, ids: NDArray[np.int64]) -> list[bytes]:
    """The same bytes as `encode_keys`, one id at a time (base64url of the id's 64 bits
    as 9 bytes, without the first digit: always "A")."""
    return [
        f"{namespace}/{table}/w/i".encode("ascii")
        + base64.urlsafe_b64encode((i & 0xFFFFFFFFFFFFFFFF).to_bytes(9, "big"))[1:]
        for i in ids.tolist()
    ]


# ---------------------------------------------------------------- driver


def mixed_batch(
    existing: NDArray[np.int64], new: NDArray[np.int64], rng: np.random.Generator
) -> NDArray[np.int64]:
    """The first len(existing) - len(new) existing ids and the new ones, shuffled."""
    ids = np.concatenate([existing[: existing.shape[0] - new.shape[0]], new])
    rng.shuffle(ids)
    return ids


async def bench_dim(
    store: EmbeddingStore,
    ceiling: RawCeiling,
    pymc: PymemcacheReader,
    *,
    table: str,
    dim: int,
    existing: NDArray[np.int64],
    fresh_blocks: list[NDArray[np.int64]],
    new_blocks: list[NDArray[np.int64]],
    rounds: int,
) -> Timings:
    """Time every method; `new_blocks[0]` is the evaluation's new ids (never created),
    `new_blocks[1]` the warm-up's, `new_blocks[r + 2]` round r's."""
    ns = store.namespace
    shape = RowShape(dim, slot_width(store.config.table(table)))
    rng = np.random.default_rng(SEED + dim)
    mixed = [mixed_batch(existing, new, rng) for new in new_blocks]
    await store.lookup(table, existing)  # populate (creates every row)

    # Warm-up round (untimed): connections, caches, and a correctness check.
    rows = await store.lookup(table, existing)
    raw = await ceiling.get(ns, table, existing, shape)
    user = pymc.get(ns, table, existing, shape)
    if not (np.array_equal(rows, raw) and np.array_equal(rows, user)):
        raise RuntimeError(f"dim {dim}: store, ceiling and pymemcache read different rows")
    created = await store.lookup(table, fresh_blocks[0])
    if not np.array_equal(created, await ceiling.get(ns, table, fresh_blocks[0], shape)):
        raise RuntimeError(f"dim {dim}: created rows do not read back through the ceiling")
    evaluated = await store.lookup(table, mixed[0], create=False)
    spec = store.config.table(table)
    is_new = np.isin(mixed[0], new_blocks[0])
    expected = np.empty_like(evaluated)
    expected[~is_new] = await ceiling.get(ns, table, mixed[0][~is_new], shape)
    expected[is_new] = initial_rows(spec.initializer, seed=spec.seed, ids=mixed[0][is_new], dim=dim)
    if not np.array_equal(evaluated, expected):
        raise RuntimeError(f"dim {dim}: create=False did not return stored and initial rows")
    if not np.array_equal(
        await store.lookup(table, mixed[1]), await ceiling.get(ns, table, mixed[1], shape)
    ):
        raise RuntimeError(f"dim {dim}: a mixed batch does not read back through the ceiling")

    timings = Timings()
    for r, method in interleaved(METHODS, rounds, f"dim {dim}"):
        ids = {
            "create": fresh_blocks[r + 1],
            "mixed": mixed[r + 2],
            "mixed_eval": mixed[0],
        }.get(method, existing)
        if method == "ceiling":
            seconds = await timed(partial(ceiling.get, ns, table, ids, shape))
        elif method == "pymemcache":
            seconds = timed_sync(partial(pymc.get, ns, table, ids, shape))
        else:  # lookup, create and the mixed batches: the same call on other ids
            create = method != "mixed_eval"
            seconds = await timed(partial(store.lookup, table, ids, create=create))
        timings.add(method, seconds)
    return timings


async def bench_many_tables(store: EmbeddingStore, *, rounds: int) -> Timings:
    """lookup_many of 26 tables against 26 concurrent lookups (docs/benchmarks.md#store)."""
    rng = np.random.default_rng(SEED + 1)
    tables = [f"many{k}" for k in range(MANY_TABLES)]
    n_new = MANY_IDS // 10
    # per table: the existing ids, then a block of new ids per round and method (+ warm-up)
    blocks = unique_id_blocks(rng, 1 + 2 * (rounds + 1), MANY_IDS * MANY_TABLES)
    existing = {t: blocks[0][k * MANY_IDS : (k + 1) * MANY_IDS] for k, t in enumerate(tables)}

    def mixed(block: NDArray[np.int64]) -> dict[str, NDArray[np.int64]]:
        return {
            t: mixed_batch(existing[t], block[k * n_new : (k + 1) * n_new], rng)
            for k, t in enumerate(tables)
        }

    batches = [mixed(block) for block in blocks[1:]]

    async def concurrent(ids: dict[str, NDArray[np.int64]]) -> dict[str, NDArray[np.float32]]:
        rows = await asyncio.gather(*(store.lookup(t, v) for t, v in ids.items()))
        return dict(zip(ids, rows, strict=True))

    await store.lookup_many(existing)  # populate
    # Warm-up (untimed): both ways return the same rows, whichever creates the new ones.
    pairs = [
        (await store.lookup_many(existing), await concurrent(existing)),
        (await store.lookup_many(batches[0]), await concurrent(batches[0])),
        (await concurrent(batches[1]), await store.lookup_many(batches[1])),
    ]
    for a, b in pairs:
        if a.keys() != b.keys() or not all(np.array_equal(a[t], b[t]) for t in tables):
            raise RuntimeError("lookup_many and the concurrent lookups read different rows")

    timings = Timings()
    for r, method in interleaved(MANY_METHODS, rounds, "26 tables"):
        if method == "many":
            seconds = await timed(partial(store.lookup_many, existing))
        elif method == "concurrent":
            seconds = await timed(partial(concurrent, existing))
        elif method == "many_mixed":
            seconds = await timed(partial(store.lookup_many, batches[2 + 2 * r]))
        else:
            seconds = await timed(partial(concurrent, batches[3 + 2 * r]))
        timings.add(method, seconds)
    return timings


async def bench_lifecycle(store: EmbeddingStore, *, n_ids: int, rounds: int) -> Timings:
    """`lookup_many` of one dim-16 table with and without `ttl_s`, with and without
    `admit_after` (docs/benchmarks.md#store); every table's existing rows have slots."""
    rng = np.random.default_rng(SEED + 2)
    n_new = max(1, round(n_ids * NEW_FRACTION))
    blocks = unique_id_blocks(rng, 1 + 4 * (rounds + 1), n_ids)
    existing = blocks[0]
    new = iter(block[:n_new] for block in blocks[1:])
    width = 1 + 2 * LIFE_DIM  # Adam: m, v and the row's step
    for table in LIFE_TABLES:
        for _ in range(LIFE_ADMIT_AFTER):  # the admission table's rows need K sightings
            await store.lookup_many({table: existing})
        rows = await store.lookup(table, existing, create=False)
        await store.set(table, existing, rows, slots=np.zeros((n_ids, width), np.float32))

    async def mixed(table: str, ids: NDArray[np.int64], *, seen: int = 0) -> float:
        for _ in range(seen):  # sightings before the timed one (untimed)
            await store.lookup_many({table: ids[-n_new:]})
        return await timed(partial(store.lookup_many, {table: ids}))

    def batch() -> NDArray[np.int64]:
        fresh = next(new)
        ids = np.concatenate([existing[: n_ids - n_new], fresh])  # new ids last, for `seen`
        return ids

    # warm-up (untimed): every case returns the same rows as the plain table would
    await mixed("life_admit", batch(), seen=LIFE_ADMIT_AFTER - 1)
    await mixed("life_ttl", batch())
    timings = Timings()
    for _, method in interleaved(LIFE_METHODS, rounds, "lifecycle"):
        if method == "hit":
            seconds = await timed(partial(store.lookup_many, {"life_plain": existing}))
        elif method == "hit_ttl":
            seconds = await timed(partial(store.lookup_many, {"life_ttl": existing}))
        elif method == "mixed":
            seconds = await mixed("life_plain", batch())
        elif method == "mixed_ttl":
            seconds = await mixed("life_ttl", batch())
        elif method == "mixed_admit_count":
            seconds = await mixed("life_admit", batch())
        else:
            seconds = await mixed("life_admit", batch(), seen=LIFE_ADMIT_AFTER - 1)
        timings.add(method, seconds)
    created = store.created.get("life_admit", 0)
    expected = n_ids + (rounds + 1) * n_new  # existing + the K-th sightings' rows
    if created != expected:
        raise RuntimeError(f"the admission table created {created} rows, expected {expected}")
    return timings


def bench_keys(namespace: str, table: str, ids: NDArray[np.int64], rounds: int) -> Timings:
    prefix = key_prefix(namespace, table, "w")
    if encode_keys(namespace, table, "w", ids) != naive_keys(namespace, table, ids):
        raise RuntimeError("naive key loop and encode_keys disagree")
    calls: dict[str, Callable[[], object]] = {
        "encode_keys": lambda: encode_keys(namespace, table, "w", ids),
        "int_key_matrix": lambda: int_key_matrix(prefix, ids),
        "naive_loop": lambda: naive_keys(namespace, table, ids),
    }
    timings = Timings()
    for _, method in interleaved(KEY_METHODS, rounds, "key encoding"):
        timings.add(method, timed_sync(calls[method]))
    return timings


def make_config(addresses: list[str]) -> ClusterConfig:
    raw: dict[str, Any] = {
        "namespace": "bench" + uuid.uuid4().hex[:8],
        "memcached": addresses,
        "tables": [{"name": f"emb{d}", "dim": d, "seed": d} for d in DIMS]
        + [{"name": f"many{k}", "dim": MANY_DIM, "seed": 100 + k} for k in range(MANY_TABLES)]
        + [
            {"name": name, "dim": LIFE_DIM, "seed": 200 + k, **keys}
            for k, (name, keys) in enumerate(LIFE_TABLES.items())
        ],
    }
    return parse_config(raw, env={})


async def run_cluster(config: ClusterConfig, *, n_ids: int, rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    n_new = max(1, round(n_ids * NEW_FRACTION))
    per_dim = 2 * (rounds + 1) + 1  # fresh blocks, then new-id blocks of the mixed batches
    blocks = unique_id_blocks(rng, 1 + len(DIMS) * per_dim, n_ids)
    existing = blocks[0]
    results: dict[str, Any] = {}
    ceiling = RawCeiling(config.memcached)
    pymc = PymemcacheReader(config.memcached)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        await ceiling.open()
        try:
            for k, dim in enumerate(DIMS):
                own = blocks[1 + k * per_dim : 1 + (k + 1) * per_dim]
                results[f"dim{dim}"] = await bench_dim(
                    store,
                    ceiling,
                    pymc,
                    table=f"emb{dim}",
                    dim=dim,
                    existing=existing,
                    fresh_blocks=own[: rounds + 1],
                    new_blocks=[block[:n_new] for block in own[rounds + 1 :]],
                    rounds=rounds,
                )
            results["many_tables"] = await bench_many_tables(store, rounds=rounds)
            results["lifecycle"] = await bench_lifecycle(store, n_ids=n_ids, rounds=rounds)
        finally:
            await ceiling.close()
            pymc.close()
    results["keys"] = bench_keys(config.namespace, f"emb{DIMS[0]}", existing, rounds)
    return results


# ---------------------------------------------------------------- reporting


def summarize(results: dict[str, Any], n_ids: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for dim in DIMS:
        t: Timings = results[f"dim{dim}"]
        med = {m: t.median(m) for m in METHODS}
        rate = {m: n_ids / med[m] for m in METHODS}
        summary[f"dim{dim}"] = {
            "seconds_per_round": t.rounds,
            "median_seconds": med,
            "rows_per_s": rate,
            "ratios": {name: rate[num] / rate[den] for name, num, den in RATIOS},
            "ratios_median_of_paired_rounds": {
                name: paired_ratio(t.rounds[num], t.rounds[den]) for name, num, den in RATIOS
            },
            "acceptance": {
                "lookup/ceiling >= 0.7": rate["lookup"] / rate["ceiling"]
                >= ACCEPT_LOOKUP_VS_CEILING,
                "lookup/pymemcache >= 2": rate["lookup"] / rate["pymemcache"]
                >= ACCEPT_LOOKUP_VS_PYMEMCACHE,
                "mixed/lookup >= 0.9": rate["mixed"] / rate["lookup"] >= ACCEPT_MIXED_VS_LOOKUP,
                "mixed_eval/lookup >= 0.9": rate["mixed_eval"] / rate["lookup"]
                >= ACCEPT_MIXED_VS_LOOKUP,
            },
        }
    m: Timings = results["many_tables"]
    mmed = {x: m.median(x) for x in MANY_METHODS}
    rows_per_batch = MANY_TABLES * MANY_IDS
    summary["many_tables"] = {
        "tables": MANY_TABLES,
        "unique_ids_per_table": MANY_IDS,
        "dim": MANY_DIM,
        "seconds_per_round": m.rounds,
        "median_seconds": mmed,
        "rows_per_s": {x: rows_per_batch / mmed[x] for x in MANY_METHODS},
        "speedup_median_of_paired_rounds": {
            "concurrent/many": paired_ratio(m.rounds["many"], m.rounds["concurrent"]),
            "concurrent_mixed/many_mixed": paired_ratio(
                m.rounds["many_mixed"], m.rounds["concurrent_mixed"]
            ),
        },
        "speedup_of_medians": {
            "concurrent/many": mmed["concurrent"] / mmed["many"],
            "concurrent_mixed/many_mixed": mmed["concurrent_mixed"] / mmed["many_mixed"],
        },
    }
    life: Timings = results["lifecycle"]
    lmed = {x: life.median(x) for x in LIFE_METHODS}
    summary["lifecycle"] = {
        "dim": LIFE_DIM,
        "ids_per_batch": n_ids,
        "ttl_s": LIFE_TTL_S,
        "admit_after": LIFE_ADMIT_AFTER,
        "seconds_per_round": life.rounds,
        "median_seconds": lmed,
        "rows_per_s": {x: n_ids / lmed[x] for x in LIFE_METHODS},
        "ratios": {name: lmed[den] / lmed[num] for name, num, den in LIFE_RATIOS},
        "ratios_median_of_paired_rounds": {
            name: paired_ratio(life.rounds[num], life.rounds[den]) for name, num, den in LIFE_RATIOS
        },
    }
    k: Timings = results["keys"]
    kmed = {m: k.median(m) for m in KEY_METHODS}
    summary["key_encoding"] = {
        "seconds_per_round": k.rounds,
        "median_seconds": kmed,
        "ids_per_s": {m: n_ids / kmed[m] for m in KEY_METHODS},
        "ratios": {
            "naive_loop/encode_keys": kmed["naive_loop"] / kmed["encode_keys"],
            "naive_loop/int_key_matrix": kmed["naive_loop"] / kmed["int_key_matrix"],
        },
    }
    return summary


def render_table(summary: dict[str, Any], n_ids: int, rounds: int) -> str:
    lines = [f"{n_ids:,} unique int64 ids per batch, 2 nodes, median of {rounds} rounds"]
    for dim in DIMS:
        s = summary[f"dim{dim}"]
        lines.append("")
        lines.append(f"dim {dim}")
        lines.append(f"  {'method':<40} {'median ms':>10} {'rows/s':>9} {'vs ceiling':>10}")
        for m in METHODS:
            rate = s["rows_per_s"][m]
            lines.append(
                f"  {LABELS[m]:<40} {s['median_seconds'][m] * 1e3:>10.1f} {fmt_rate(rate):>9} "
                f"{rate / s['rows_per_s']['ceiling']:>10.2f}"
            )
        r, p = s["ratios"], s["ratios_median_of_paired_rounds"]
        ok = s["acceptance"]
        lines.append(
            f"  lookup/ceiling    {r['lookup/ceiling']:5.2f}  (paired {p['lookup/ceiling']:.2f})"
            f"  target >= 0.7: {met(ok['lookup/ceiling >= 0.7'])}"
        )
        lines.append(
            f"  lookup/pymemcache {r['lookup/pymemcache']:5.2f}  "
            f"(paired {p['lookup/pymemcache']:.2f})"
            f"  target >= 2:   {met(ok['lookup/pymemcache >= 2'])}"
        )
        lines.append(
            f"  create/ceiling    {r['create/ceiling']:5.2f}  (paired {p['create/ceiling']:.2f})"
        )
        lines.extend(
            f"  {name:<17} {r[name]:5.2f}  (paired {p[name]:.2f})"
            f"  target >= 0.9: {met(ok[name + ' >= 0.9'])}"
            for name in ("mixed/lookup", "mixed_eval/lookup")
        )
    mt = summary["many_tables"]
    lines += _rate_lines(
        f"{mt['tables']} tables x {mt['unique_ids_per_table']} unique ids, dim {mt['dim']} "
        f"(a training step's lookups)",
        mt,
        MANY_METHODS,
        MANY_LABELS,
    )
    sp, sm = mt["speedup_median_of_paired_rounds"], mt["speedup_of_medians"]
    lines.extend(
        f"  {name:<28} {sm[name]:5.2f}x faster with lookup_many  (paired {sp[name]:.2f}x)"
        for name in ("concurrent/many", "concurrent_mixed/many_mixed")
    )
    lc = summary["lifecycle"]
    title = (
        f"lifecycle: lookup_many of {n_ids:,} ids of one dim-{lc['dim']} Adam table "
        f"(ttl_s = {lc['ttl_s']}, admit_after = {lc['admit_after']})"
    )
    lines += _rate_lines(title, lc, LIFE_METHODS, LIFE_LABELS)
    lines.extend(
        f"  {name:<28} {lc['ratios'][name]:5.2f}  "
        f"(paired {lc['ratios_median_of_paired_rounds'][name]:.2f})"
        for name, _, _ in LIFE_RATIOS
    )
    k = summary["key_encoding"]
    lines.append("")
    lines.append(f"key encoding of {n_ids:,} int ids")
    lines.extend(
        f"  {m:<40} {k['median_seconds'][m] * 1e3:>10.2f} ms {fmt_rate(k['ids_per_s'][m]):>9} ids/s"
        for m in KEY_METHODS
    )
    lines.append(
        f"  naive loop / encode_keys: {k['ratios']['naive_loop/encode_keys']:.1f}x slower; "
        f"naive loop / int_key_matrix: {k['ratios']['naive_loop/int_key_matrix']:.1f}x slower"
    )
    return "\n".join(lines)


def _rate_lines(
    title: str, section: dict[str, Any], methods: tuple[str, ...], labels: dict[str, str]
) -> list[str]:
    """A section's head and table: median ms and rows/s per method."""
    return [
        "",
        title,
        f"  {'method':<40} {'median ms':>10} {'rows/s':>9}",
        *(
            f"  {labels[x]:<40} {section['median_seconds'][x] * 1e3:>10.1f} "
            f"{fmt_rate(section['rows_per_s'][x]):>9}"
            for x in methods
        ),
    ]


def plot(summary: dict[str, Any], path: Path, *, n_ids: int, rounds: int) -> None:
    plot_rates(
        summary,
        path,
        methods=METHODS,
        labels=LABELS,
        dims=DIMS,
        xticks=[f"dim {d}" for d in DIMS],
        ylabel="thousand rows/s (median)",
        title=f"Reading {n_ids:,} rows from 2 memcached nodes, median of {rounds} rounds",
    )


def main(argv: list[str] | None = None) -> int:
    options = Options(__doc__, quick="3 rounds of 8,192 ids (unless given)")
    options.count("--rounds", full=15, quick=3, help="timed rounds")
    options.count("--ids", full=65536, quick=8192, help="ids per batch")
    args = options.parse(argv)
    import pymemcache

    machine = machine_info({"pymemcache": pymemcache.__version__})
    code = lookup_table_fingerprint()
    started = time.time()
    with memcached_cluster(NODES, memory_mb=MEMORY_MB) as servers:
        config = make_config([s.address for s in servers])
        results = asyncio.run(run_cluster(config, n_ids=args.ids, rounds=args.rounds))
    summary = summarize(results, args.ids)
    table = render_table(summary, args.ids, args.rounds)
    print(table)

    report = {
        **report_head("store", started, machine, code),
        "parameters": {
            "rounds": args.rounds,
            "ids_per_batch": args.ids,
            "new_fraction_of_mixed_batches": NEW_FRACTION,
            "quick": args.quick,
            "dims": list(DIMS),
            "nodes": NODES,
            "memcached_memory_mb": MEMORY_MB,
            "id_seed": SEED,
            "store": {
                "pool_size": config.store.pool_size,
                "max_batch_keys": config.store.max_batch_keys,
                "timeout_s": config.store.timeout_s,
            },
            "event_loop": "asyncio default",
            "notes": [
                "ceiling, lookup and pymemcache time key building, node split and request "
                "building; nothing is precomputed except the id arrays",
                "pymemcache queries the nodes one after the other (synchronous client)",
                "methods interleaved round by round, order rotated; gc.collect() before each",
                "one untimed warm-up round checks that all readers return identical rows",
            ],
        },
        "acceptance_targets": {
            "lookup/ceiling": ACCEPT_LOOKUP_VS_CEILING,
            "lookup/pymemcache": ACCEPT_LOOKUP_VS_PYMEMCACHE,
            "mixed/lookup": ACCEPT_MIXED_VS_LOOKUP,
            "mixed_eval/lookup": ACCEPT_MIXED_VS_LOOKUP,
        },
        **summary,
    }
    save(
        report,
        args.out_dir,
        code_at_end=lookup_table_fingerprint(),
        plot=partial(plot, summary, n_ids=args.ids, rounds=args.rounds),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
