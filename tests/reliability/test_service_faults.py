"""Adversarial tests of the optimizer service: fuzzed bodies, kill -9 under load, token hygiene.

Everything is real: memcached processes, the aiohttp app (in-process for the fuzzer, a
`python -m optimizer_service.app` subprocess for the kill and log tests) and
OptimizerClient. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import io
import itertools
import json
import math
import random
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import msgpack
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from lookup_table import EmbeddingStore, initial_rows
from lookup_table.client import OptimizerClient
from lookup_table.config import load_config
from lookup_table.core.wire import CONTENT_TYPE, encode_array, encode_ids, pack
from lookup_table.ops.localcluster import MemcachedProcess, free_port
from optimizer_service.app import make_app
from tests.conftest import SERVICE_TABLES, make_config, written
from tests.reliability.harness import (
    ServiceProcess,
    cluster_file,
    fingerprint,
    item_counts,
    memcache_client,
    metadump_keys,
    wait_healthy,
)

pytestmark = pytest.mark.integration

DIMS = {"user": 8, "word": 4, "ads": 16}
MAX_BODY = 1 << 20

# Short string ids that are valid but hostile to a text protocol: they must be
# percent-encoded into the key, never sent to memcached raw.
WEIRD_IDS = [
    "a b",
    "x\r\nset y 0 0 1",
    "\x00",
    "\x01\x1f\x7f",
    "tab\there",
    " ",
    "\r\n",
    "ünïcødé",
    "a/b",
    "get x",
    "%41",
    "",
]
# ids that can never be a memcached key (the encoded key is > 250 bytes).
TOO_LONG_IDS = ["x" * 300, "é" * 60, "\r\n" * 80, "%" * 100, "a" * 251, "a b" * 90]


# ------------------------------------------------------------------ the fuzz corpus

_MARK = b"\xfe@@splice-here@@\xfe"


def _splice(obj: Any, raw: bytes) -> bytes:
    """pack(obj) with the one value `_MARK` replaced by the raw msgpack bytes `raw`
    (for nesting deeper than msgpack's own packer allows)."""
    body = pack(obj)
    marker = pack(_MARK)
    assert body.count(marker) == 1
    return body.replace(marker, raw)


def _deep_list(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


def _deep_map(depth: int) -> bytes:
    return b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ... nil}}


class _Corpus:
    """Bodies that are each invalid by construction (so a correct service writes nothing)."""

    def __init__(self, seed: int, sender: dict[str, Any]) -> None:
        self.rng = random.Random(seed)
        self.sender = sender  # the replica's namespace, fingerprint and index: valid
        self.np_rng = np.random.default_rng(seed)
        self.cases: list[tuple[str, bytes, dict[str, str]]] = []

    # -- valid building blocks (each body below breaks at least one rule)

    def ids(self, table: str, n: int) -> Any:
        if table == "word":
            return [f"w{self.rng.randrange(10**9)}" for _ in range(n)]
        return np.array([self.rng.randrange(-(2**63), 2**63) for _ in range(n)], dtype=np.int64)

    def grads(self, n: int, dim: int) -> np.ndarray:
        return self.np_rng.standard_normal((n, dim)).astype(np.float32)

    def entry(self, table: str, n: int | None = None) -> dict[str, Any]:
        n = self.rng.randint(1, 6) if n is None else n
        return {
            "ids": encode_ids(self.ids(table, n)),
            "grads": encode_array(self.grads(n, DIMS[table])),
        }

    def push(self, **fields: Any) -> dict[str, Any]:
        tables = self.rng.sample(sorted(DIMS), self.rng.randint(1, 3))
        body: dict[str, Any] = {
            "push_id": f"fz-{self.rng.randrange(10**12)}",
            "worker": self.rng.randrange(4),
            "version": 0,
            "tables": {t: self.entry(t) for t in tables},
            **self.sender,
        }
        body.update(fields)
        return body

    def add(self, label: str, body: bytes | Any, headers: dict[str, str] | None = None) -> None:
        raw = body if isinstance(body, bytes) else pack(body)
        self.cases.append((label, raw, headers or {}))

    def junk(self, depth: int = 0) -> Any:
        """A value that is never valid in any slot of a push (no str, no bytes, no int >= 0,
        no empty or array-shaped map, and lists start with nil)."""
        kind = self.rng.choice(["nil", "bool", "float", "neg", "ext", "list", "map"])
        if depth >= 5 and kind in ("list", "map"):
            kind = "nil"
        if kind == "nil":
            return None
        if kind == "bool":
            return self.rng.random() < 0.5
        if kind == "float":
            return self.rng.choice([0.0, -1.5, 1e300, math.inf, -math.inf, math.nan])
        if kind == "neg":
            return -self.rng.randrange(1, 2**63)
        if kind == "ext":
            return msgpack.ExtType(
                self.rng.randrange(0, 128), self.rng.randbytes(self.rng.randrange(9))
            )
        inner = [
            self.rng.choice(["s", b"b", 7, None, self.junk(depth + 1)])
            for _ in range(self.rng.randrange(4))
        ]
        if kind == "list":
            return [None, *inner]
        keys = ["k", "zz", 0, b"bin", -3]
        return {self.rng.choice(keys): v for v in inner or [None]}

    # -- the corpus

    def build(self, n_random: int) -> list[tuple[str, bytes, dict[str, str]]]:
        self.fixed()
        makers = [
            self.random_bytes,
            self.truncated,
            self.trailing,
            self.random_array_mutation,
            self.random_junk_slot,
            self.random_deep_slot,
            self.random_nan,
            self.random_bad_string_ids,
            self.random_count_mismatch,
            self.random_bad_group,
        ]
        for _ in range(n_random):
            self.rng.choice(makers)()
        for _ in range(n_random // 5):  # tables sent as groups: more of them
            self.random_bad_group()
        return self.cases

    def fixed(self) -> None:
        base = self.push()
        self.add("empty body", b"")
        for label, raw in [
            ("array32 declaring 2**32-1 items", b"\xdd\xff\xff\xff\xff\xc0"),
            ("map32 declaring 2**32-1 pairs", b"\xdf\xff\xff\xff\xff\xa1k\xc0"),
            ("bin32 declaring 4 GiB", b"\xc6\xff\xff\xff\xff\x00\x01"),
            ("str32 declaring 4 GiB", b"\xdb\xff\xff\xff\xffabc"),
            ("ext32 declaring 4 GiB", b"\xc9\xff\xff\xff\xff\x01\x00"),
            ("never-used byte 0xc1", b"\xc1"),
            ("str with invalid utf-8", b"\xa2\xff\xfe"),
            ("map with a list key", b"\x81\x91\x01\x01"),
            ("map with a map key", b"\x81\x81\x01\x01\x01"),
            (
                "push_id then tables as an unfinished array32",
                b"\x82"
                + pack("push_id")
                + pack("p-hdr")
                + pack("tables")
                + b"\xdd\xff\xff\xff\xff",
            ),
            ("two msgpack objects", pack(base) + pack(base)),
        ]:
            self.add(label, raw)
        for label, value in [
            ("list", [1, 2]),
            ("int", 7),
            ("negative int", -1),
            ("str", "push"),
            ("bin", b"\x00push"),
            ("nil", None),
            ("true", True),
            ("float", 1.5),
            ("nan", math.nan),
            ("ext", msgpack.ExtType(5, b"xyz")),
            ("timestamp", msgpack.Timestamp(1, 2)),
            ("list of a push", [base]),
        ]:
            self.add(f"top-level {label}", value)
        for depth in (2, 100, 900, 1000, 1024, 1025, 5000, 100_000):
            self.add(f"top-level list nested {depth} deep", _deep_list(depth))
            self.add(f"top-level map nested {depth} deep", _deep_map(depth))

        for value in [
            None,
            0,
            1.5,
            True,
            b"bin-id",
            "",
            " ",
            "a b",
            "x" * 129,
            "é",
            "abc\n",
            "a\r\nb",
            "a\nset x 0 0 1",
            "a/b",
            "a\x00",
            "../../etc",
            ["p"],
            {"p": 1},
            msgpack.ExtType(1, b"p"),
        ]:
            self.add(f"push_id={value!r:.40}", {**base, "push_id": value})
        self.add("push_id missing", {k: v for k, v in base.items() if k != "push_id"})
        for field in ("worker", "version"):
            for value in [-1, -(2**63), "1", 1.5, True, False, None, [], {}, b"1"]:
                self.add(f"{field}={value!r}", {**base, field: value})
        for field in self.sender:  # missing, of another type, another cluster file's
            self.add(f"{field} missing", {k: v for k, v in base.items() if k != field})
            for value in [-1, 1, "other", "", 1.5, True, None, [], {}, b"x"]:
                if value != self.sender[field]:
                    self.add(f"{field}={value!r}", {**base, field: value})
        for value in [[], [1], "user", 3, b"x", True, 1.5, None]:
            self.add(f"tables={value!r}", {**base, "tables": value})
            self.add(f"dense={value!r}", {**base, "dense": value})

        for table in DIMS:
            good = self.entry(table, 3)
            for label, entry in [
                ("a list", [good["ids"], good["grads"]]),
                ("a str", "ids"),
                ("nil", None),
                ("an int", 1),
                ("empty", {}),
                ("ids only", {"ids": good["ids"]}),
                ("grads only", {"grads": good["grads"]}),
                ("an extra key", {**good, "weights": good["grads"]}),
                ("bin keys", {b"ids": good["ids"], b"grads": good["grads"]}),
            ]:
                self.add(f"tables.{table} is {label}", {**base, "tables": {table: entry}})
            self.array_mutations(table)
            n = 3
            ids = self.ids(table, n)
            for label, grads in [
                ("n+1 rows", self.grads(n + 1, DIMS[table])),
                ("n-1 rows", self.grads(n - 1, DIMS[table])),
                ("dim+1", self.grads(n, DIMS[table] + 1)),
                ("dim-1", self.grads(n, DIMS[table] - 1)),
                ("1-D", self.grads(n, DIMS[table]).reshape(-1)),
                ("3-D", self.grads(n, DIMS[table]).reshape(n, DIMS[table], 1)),
                ("0 rows", self.grads(0, DIMS[table])),
            ]:
                entry = {"ids": encode_ids(ids), "grads": encode_array(grads)}
                self.add(f"tables.{table}.grads has {label}", {**base, "tables": {table: entry}})
            for bad in (math.nan, math.inf, -math.inf):
                grads = self.grads(n, DIMS[table])
                grads[self.rng.randrange(n), self.rng.randrange(DIMS[table])] = bad
                entry = {"ids": encode_ids(ids), "grads": encode_array(grads)}
                self.add(f"tables.{table}.grads holds {bad}", {**base, "tables": {table: entry}})
            # finite grads whose sum over a duplicated id overflows to inf
            dup = ids[:1] * 2 if isinstance(ids, list) else np.repeat(ids[:1], 2)
            big = np.full((2, DIMS[table]), 3e38, dtype=np.float32)
            entry = {"ids": encode_ids(dup), "grads": encode_array(big)}
            self.add(f"tables.{table} duplicate ids sum to inf", {**base, "tables": {table: entry}})

        good_user = self.entry("user", 2)
        for name in [
            "nope",
            "",
            "_meta",
            "_dense",
            "USER",
            "user ",
            " user",
            "user\x00",
            "user/x",
            "../user",
            "x" * 300,
            "ユーザー",
            7,
            -1,
            b"user",
            1.5,
            True,
            None,
        ]:
            self.add(f"unknown table {name!r:.30}", {**base, "tables": {name: good_user}})

        # id types that do not match the table
        for table, ids, n in [
            ("user", ["1", "2"], 2),
            ("ads", ["a"], 1),
            ("word", np.array([1, 2], dtype=np.int64), 2),
        ]:
            entry = {"ids": encode_ids(ids), "grads": encode_array(self.grads(n, DIMS[table]))}
            self.add(f"tables.{table} ids of the wrong type", {**base, "tables": {table: entry}})
        for table in ("user", "word"):
            for label, ids in [
                ("str and int", ["a", 1]),
                ("str and nil", ["a", None]),
                ("str and bin", ["a", b"b"]),
                ("floats", [1.5, 2.5]),
                ("ints", [1, 2]),
                ("lists", [["a"], ["b"]]),
                ("maps", [{"a": 1}, {"b": 2}]),
                ("bools", [True, False]),
            ]:
                entry = {"ids": ids, "grads": encode_array(self.grads(2, DIMS[table]))}
                self.add(f"tables.{table}.ids are {label}", {**base, "tables": {table: entry}})
            for label, ids in [("a str", "abc"), ("bin", b"abcdefgh"), ("an int", 1)]:
                entry = {"ids": ids, "grads": encode_array(self.grads(1, DIMS[table]))}
                self.add(f"tables.{table}.ids is {label}", {**base, "tables": {table: entry}})

        # hostile string ids: valid alone, so always with a defect in the same push
        for long_id in TOO_LONG_IDS:
            ids = [*WEIRD_IDS, long_id]
            entry = {"ids": ids, "grads": encode_array(self.grads(len(ids), 4))}
            self.add(
                f"weird ids + too long id {long_id[:6]!r}...",
                {"push_id": "p-long", "tables": {"word": entry}},
            )
        bad_dim = {"ids": WEIRD_IDS, "grads": encode_array(self.grads(len(WEIRD_IDS), 5))}
        self.add("weird ids with dim 5 grads", {**base, "tables": {"word": bad_dim}})
        nan = self.grads(len(WEIRD_IDS), 4)
        nan[-1, 0] = math.nan
        self.add(
            "weird ids with a NaN",
            {**base, "tables": {"word": {"ids": WEIRD_IDS, "grads": encode_array(nan)}}},
        )

        # half-valid pushes: every table but one is fine -> nothing at all may be written
        ok = {t: self.entry(t) for t in DIMS}
        self.add(
            "valid user + word with dim 3",
            {
                **base,
                "tables": {**ok, "word": {"ids": ["a"], "grads": encode_array(self.grads(1, 3))}},
            },
        )
        nan_ads = self.grads(2, 16)
        nan_ads[1, 1] = math.nan
        self.add(
            "valid user + word, NaN ads",
            {
                **base,
                "tables": {
                    **ok,
                    "ads": {"ids": encode_ids(self.ids("ads", 2)), "grads": encode_array(nan_ads)},
                },
            },
        )
        self.add(
            "valid tables + dense never initialized",
            {**base, "tables": ok, "dense": {"w": encode_array(self.grads(2, 3))}},
        )
        nan_dense = self.grads(2, 3)
        nan_dense[0, 0] = math.inf
        self.add(
            "valid tables + inf dense",
            {**base, "tables": ok, "dense": {"w": encode_array(nan_dense)}},
        )
        for name in ("", 7, None, b"w"):
            self.add(
                f"dense name {name!r}",
                {**base, "dense": {name: encode_array(self.grads(1, 2))}},
            )
        self.add(
            "dense of [0, 2**62] with no data",
            {**base, "dense": {"w": {"dtype": "<f4", "shape": [0, 2**62], "data": b""}}},
        )

        # extra keys
        for key in ["extra", "Push_id", "", 1, b"tables", None, "tables "]:
            self.add(f"extra top-level key {key!r}", {**base, key: 1})

        # deeply nested values in every slot (the service must not recurse on them)
        for slot in self.SLOTS:
            for depth in (900, 990, 1000, 1024, 1025, 100_000):
                self.add(
                    f"{slot} nested {depth} deep", self.at_slot(slot, _MARK, raw=_deep_list(depth))
                )
            self.add(
                f"{slot} is a map nested 1000 deep", self.at_slot(slot, _MARK, raw=_deep_map(1000))
            )

        # HTTP-level: oversized bodies and broken content encodings
        big_n = MAX_BODY // (4 * 8) + 10
        big = {
            "push_id": "p-big",
            "tables": {
                "user": {
                    "ids": encode_ids(np.arange(big_n, dtype=np.int64)),
                    "grads": encode_array(np.zeros((big_n, 8), np.float32)),
                }
            },
        }
        self.add("a valid push over max_body_bytes", big)
        self.add("zeros over max_body_bytes", b"\0" * (MAX_BODY + 1))
        self.add(
            "gzip bomb over max_body_bytes",
            gzip.compress(b"\0" * (4 * MAX_BODY)),
            {"Content-Encoding": "gzip"},
        )
        for encoding in ("gzip", "deflate"):
            self.add(
                f"{encoding} header, raw msgpack body",
                pack(self.push(tables=[])),
                {"Content-Encoding": encoding},
            )
            self.add(
                f"{encoding} header, random bytes",
                self.rng.randbytes(64),
                {"Content-Encoding": encoding},
            )
        self.add(
            "gzip of a NaN push",
            gzip.compress(
                pack(
                    {
                        **base,
                        "tables": {
                            "user": {
                                "ids": encode_ids(np.array([1], np.int64)),
                                "grads": encode_array(np.full((1, 8), np.nan, np.float32)),
                            }
                        },
                    }
                )
            ),
            {"Content-Encoding": "gzip"},
        )
        self.add(
            "gzip of a truncated push", gzip.compress(pack(base)[:-3]), {"Content-Encoding": "gzip"}
        )
        self.add(
            "deflate of a deep list",
            zlib.compress(_deep_list(100_000)),
            {"Content-Encoding": "deflate"},
        )

    # -- array-map mutations

    def array_mutations(self, table: str) -> None:
        """Every way to break the ids / grads array maps of `table`."""
        n, dim = 3, DIMS[table]
        targets = ["grads"] if table == "word" else ["ids", "grads"]
        for target in targets:
            good = self.entry(table, n)
            arr = good[target]
            itemsize, want_dtype = (8, "<i8") if target == "ids" else (4, "<f4")
            want_shape = [n] if target == "ids" else [n, dim]

            def emit(label: str, value: Any, target: str = target, good: Any = good) -> None:
                self.add(
                    f"tables.{table}.{target} {label}",
                    {**self.push(), "tables": {table: {**good, target: value}}},
                )

            for key in ("dtype", "shape", "data"):
                emit(f"without {key}", {k: v for k, v in arr.items() if k != key})
            emit("with an extra key", {**arr, "order": "C"})
            emit("with bin keys", {k.encode(): v for k, v in arr.items()})
            for dtype in [
                "<f8",
                ">f4",
                "<f2",
                "float32",
                "f4",
                "<i4",
                "<u8",
                ">i8",
                "|b1",
                "<c8",
                "",
                "<f4\x00",
                "O",
                "<U1",
                b"<f4",
                4,
                None,
                ["<f4"],
            ]:
                if dtype == want_dtype:
                    continue
                emit(f"dtype={dtype!r}", {**arr, "dtype": dtype})
            other = "<f4" if target == "ids" else "<i8"
            emit(f"dtype={other} (the other allowed one)", {**arr, "dtype": other})
            for label, shape, nbytes in self.bad_shapes(want_shape, itemsize):
                emit(
                    f"shape {label}",
                    {"dtype": want_dtype, "shape": shape, "data": self.rng.randbytes(nbytes)},
                )
            full = len(arr["data"])
            for label, data in [
                ("data as str", "x" * full),
                ("data as list of floats", [0.5] * (full // itemsize)),
                ("data as int", 12),
                ("data as nil", None),
                ("data as ext", msgpack.ExtType(3, b"\0" * full)),
                ("data empty", b""),
                ("data one byte short", bytes(arr["data"])[:-1]),
                ("data one byte long", bytes(arr["data"]) + b"\0"),
                ("data one item long", bytes(arr["data"]) + b"\0" * itemsize),
            ]:
                emit(label, {**arr, "data": data})

    def bad_shapes(self, want: list[int], itemsize: int) -> Iterator[tuple[str, Any, int]]:
        n = want[0]
        dim = want[1] if len(want) == 2 else None
        full = math.prod(want) * itemsize
        yield "negative", [-n, *want[1:]], full
        yield "negative, data for |n|", [*want[:-1], -want[-1]], full
        yield "float dims", [float(d) for d in want], full
        yield "str dims", [str(d) for d in want], full
        yield "bool dims", [True] * len(want), itemsize
        yield "nil", None, full
        yield "a str", ",".join(map(str, want)), full
        yield "a map", {"n": n}, full
        yield "nested lists", [[d] for d in want], full
        yield "9 dims of 1", [1] * 9, itemsize
        yield "scalar", [], itemsize
        yield "huge, tiny data", [2**31, *want[1:]], full
        yield "2**40 x 2**40, tiny data", [2**40, 2**40], 16
        yield "uint64 max", [2**64 - 1], 8
        yield "zero times 2**62, no data", [0, 2**62], 0
        yield "zero times 2**63, no data", [0, 2**63], 0
        yield "zero times uint64 max, no data", [0, 2**64 - 1], 0
        yield "2**62 times zero, no data", [2**62, 0], 0
        yield "zero times 2**40 times 2**40, no data", [0, 2**40, 2**40], 0
        yield (
            "2-D with matching data" if dim is None else "1-D with matching data",
            ([n, 1] if dim is None else [n * dim]),
            full,
        )
        if dim is not None:
            yield "transposed (dim, n)", [dim, n], full
            yield "3-D with matching data", [n, dim, 1], full

    # -- slots for junk and deep nesting

    SLOTS = (
        "push_id",
        "worker",
        "version",
        "tables",
        "dense",
        "tables.user",
        "tables.user.ids",
        "tables.user.grads",
        "tables.user.grads.dtype",
        "tables.user.grads.shape",
        "tables.user.grads.shape[1]",
        "tables.user.grads.data",
        "tables.word.ids[1]",
        "dense.w",
        "dense.w.shape",
    )

    def at_slot(self, slot: str, value: Any, *, raw: bytes | None = None) -> Any:
        """A push with `value` in `slot` (spliced in as raw msgpack when `raw` is given)."""
        body = self.push(tables={"user": self.entry("user", 2), "word": self.entry("word", 2)})
        dense_w = encode_array(self.grads(2, 3))
        if slot in ("push_id", "worker", "version", "tables", "dense"):
            body[slot] = value
        elif slot == "tables.user":
            body["tables"]["user"] = value
        elif slot in ("tables.user.ids", "tables.user.grads"):
            body["tables"]["user"][slot.rsplit(".", 1)[1]] = value
        elif slot.startswith("tables.user.grads."):
            key = slot.rsplit(".", 1)[1]
            grads = body["tables"]["user"]["grads"]
            if key == "shape[1]":
                grads["shape"] = [2, value]
            else:
                grads[key] = value
        elif slot == "tables.word.ids[1]":
            body["tables"]["word"]["ids"] = ["a", value]
        elif slot == "dense.w":
            body["dense"] = {"w": value}
        elif slot == "dense.w.shape":
            body["dense"] = {"w": {**dense_w, "shape": value}}
        else:  # pragma: no cover - a typo in SLOTS
            raise AssertionError(slot)
        return _splice(body, raw) if raw is not None else body

    # -- random makers

    def random_bytes(self) -> None:
        raw = self.rng.randbytes(self.rng.randrange(1, 300))
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:
            obj = None
        if isinstance(obj, dict) and "push_id" in obj:  # astronomically unlikely, but never valid
            return
        self.add(f"random bytes ({len(raw)})", raw)

    def truncated(self) -> None:
        raw = pack(self.push())
        cut = self.rng.randrange(0, len(raw))
        self.add(f"valid push truncated at {cut}/{len(raw)}", raw[:cut])  # a prefix never parses

    def trailing(self) -> None:
        extra = self.rng.randbytes(self.rng.randrange(1, 9))
        self.add(f"valid push + {len(extra)} trailing bytes", pack(self.push()) + extra)

    def random_array_mutation(self) -> None:
        table = self.rng.choice(sorted(DIMS))
        target = "grads" if table == "word" else self.rng.choice(["ids", "grads"])
        n = self.rng.randint(1, 5)
        good = self.entry(table, n)
        arr = dict(good[target])
        want_shape = [n] if target == "ids" else [n, DIMS[table]]
        what = self.rng.choice(["dtype", "shape", "data", "keys"])
        if what == "dtype":
            allowed = "<i8" if target == "ids" else "<f4"
            arr["dtype"] = self.rng.choice(
                [
                    d
                    for d in ["<f8", ">f4", "<i4", ">i8", "<u8", "<f4", "<i8", "|u1"]
                    if d != allowed
                ]
            )
        elif what == "shape":
            shape = list(want_shape)
            i = self.rng.randrange(len(shape))
            # never the right shape: one dim off by one, negative, huge or zero (n, dim >= 1)
            shape[i] = self.rng.choice([shape[i] + 1, shape[i] - 1, -shape[i] - 1, 2**33, 0])
            arr["shape"] = shape
            count = math.prod(shape)
            itemsize = 8 if target == "ids" else 4
            arr["data"] = self.rng.randbytes(count * itemsize if 0 <= count <= 10**6 else itemsize)
        elif what == "data":
            cut = self.rng.choice([-3, -1, 1, 5])
            data = bytes(arr["data"])
            arr["data"] = data[:cut] if cut < 0 else data + self.rng.randbytes(cut)
        else:
            arr[self.rng.choice(["Dtype", "size", "strides", "order"])] = 1
        self.add(
            f"random {what} mutation of tables.{table}.{target}",
            {**self.push(), "tables": {table: {**good, target: arr}}},
        )

    def random_junk_slot(self) -> None:
        slot = self.rng.choice(self.SLOTS)
        value = self.junk()
        self.add(f"junk {value!r:.40} in {slot}", self.at_slot(slot, value))

    def random_deep_slot(self) -> None:
        slot = self.rng.choice(self.SLOTS)
        depth = self.rng.choice([50, 500, 950, 995, 1000, 1010, 1024, 1025, 4096])
        raw = _deep_list(depth) if self.rng.random() < 0.7 else _deep_map(depth)
        self.add(f"{slot} nested {depth} deep (random)", self.at_slot(slot, _MARK, raw=raw))

    def random_nan(self) -> None:
        table = self.rng.choice(sorted(DIMS))
        n = self.rng.randint(1, 8)
        grads = self.grads(n, DIMS[table])
        for _ in range(self.rng.randint(1, 3)):
            grads[self.rng.randrange(n), self.rng.randrange(DIMS[table])] = self.rng.choice(
                [math.nan, math.inf, -math.inf]
            )
        tables = {t: self.entry(t) for t in DIMS if self.rng.random() < 0.5}
        tables[table] = {"ids": encode_ids(self.ids(table, n)), "grads": encode_array(grads)}
        self.add(f"random non-finite grads in {table}", {**self.push(), "tables": tables})

    def random_bad_string_ids(self) -> None:
        ids = self.rng.sample(WEIRD_IDS, self.rng.randint(0, len(WEIRD_IDS)))
        ids.insert(self.rng.randrange(len(ids) + 1), self.rng.choice(TOO_LONG_IDS))
        entry = {"ids": ids, "grads": encode_array(self.grads(len(ids), 4))}
        self.add(
            f"{len(ids)} hostile string ids incl. one too long",
            {**self.push(), "tables": {"word": entry}},
        )

    def random_count_mismatch(self) -> None:
        table = self.rng.choice(sorted(DIMS))
        n = self.rng.randint(1, 6)
        m = self.rng.choice([k for k in range(0, 8) if k != n])
        entry = {
            "ids": encode_ids(self.ids(table, n)),
            "grads": encode_array(self.grads(m, DIMS[table])),
        }
        self.add(
            f"{n} ids but {m} grads rows in {table}", {**self.push(), "tables": {table: entry}}
        )

    def group(self, table: str, n: int) -> dict[str, Any]:
        """A valid group (`groups: [...]`, as OptimizerClient sends int64 tables of one
        dim) of one table's n ids."""
        return {
            "tables": [table],
            "counts": [n],
            "ids": encode_array(self.ids(table, n)),
            "grads": encode_array(self.grads(n, DIMS[table])),
        }

    def random_bad_group(self) -> None:
        """A push whose tables come as a group, each group broken in one way."""
        table = self.rng.choice(["user", "ads"])  # the int64 tables (each its own dim)
        n = self.rng.randint(1, 6)
        group = self.group(table, n)
        dim = DIMS[table]
        what = self.rng.choice(
            ["junk", "element", "keys", "tables", "counts", "ids", "grads", "twice"]
        )
        singles: dict[str, Any] = {}
        groups: Any = [group]
        if what == "junk":
            groups = self.junk()
            groups = [None] if groups == [] else groups  # an empty list is valid
        elif what == "element":
            groups = [group, self.rng.choice([None, 7, "g", [group], b"g", self.junk()])]
        elif what == "keys":
            if self.rng.random() < 0.5:
                del group[self.rng.choice(sorted(group))]  # a read's group lacks grads
            else:
                group[self.rng.choice(["table", "Grads", "rows", "n"])] = 1
        elif what == "tables":
            group["tables"] = self.rng.choice(
                [[], [table, table], ["nope"], ["word"], ["user", "ads"], "user", None, [7]]
            )
            if group["tables"] == ["user", "ads"]:  # two dims (and counts to match)
                group["counts"] = [n, 0]
        elif what == "counts":
            group["counts"] = self.rng.choice(
                [[n + 1], [n - 1], [-1], [True], [n, 0], [], [float(n)], None, str(n)]
            )
        elif what == "ids":
            ids = dict(group["ids"])
            mutation = self.rng.choice(["dtype", "2-D", "data"])
            if mutation == "dtype":
                ids["dtype"] = self.rng.choice(["<f8", "<i4", ">i8", "<u8"])
            elif mutation == "2-D":
                ids["shape"] = [n, 1]
            else:
                ids["data"] = bytes(ids["data"])[:-1]
            group["ids"] = ids
        elif what == "grads":
            shape = self.rng.choice([(n, dim + 1), (n + 1, dim), (n, dim - 1), (n * dim,)])
            grads = self.grads(math.prod(shape), 1).reshape(shape)
            if self.rng.random() < 0.3:  # the right shape, one value not finite
                grads = self.grads(n, dim)
                grads[self.rng.randrange(n), self.rng.randrange(dim)] = self.rng.choice(
                    [math.nan, math.inf, -math.inf]
                )
            group["grads"] = encode_array(grads)
        else:  # the table also sent alone
            singles = {table: self.entry(table)}
        self.add(
            f"a group broken in its {what}", {**self.push(), "tables": singles, "groups": groups}
        )


def _payload(body: bytes) -> bytes | io.BytesIO:
    """Large bodies as a stream (aiohttp's client warns about raw bytes over 1 MiB)."""
    return io.BytesIO(body) if len(body) > 1 << 19 else body


def _minimal_repro(body: bytes) -> str:
    return body[:96].hex() + ("..." if len(body) > 96 else "") + f" ({len(body)} bytes)"


# ------------------------------------------------------------------ 1. fuzzed bodies


# In the real process numpy only *warns* when duplicate ids' grads overflow while being
# summed (the push is then refused as non-finite, 400); pytest's filterwarnings=error would
# turn that warning into a 500 of the in-process app.
@pytest.mark.filterwarnings("ignore:overflow encountered in add:RuntimeWarning")
async def test_fuzzed_bodies_never_5xx_and_leave_the_store_unchanged(
    own_nodes: list[MemcachedProcess], aiohttp_server: Any
) -> None:
    """About 1,200 invalid bodies (seeded): each a 4xx JSON error, the service stays healthy, and
    not one byte changes in memcached (rows, slots, and the item counters)."""
    nodes = [s.address for s in own_nodes]
    config = make_config(
        nodes,
        tables=SERVICE_TABLES,
        optimizers=["http://127.0.0.1:1"],
        service={"max_body_bytes": MAX_BODY},
    )
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        created: dict[str, Any] = {
            "user": np.array([*range(-5, 35), 2**63 - 1, -(2**63)], dtype=np.int64),
            "word": [*WEIRD_IDS, "banana", "w1", "7"],
            "ads": np.arange(10, dtype=np.int64),
        }
        await store.lookup("user", created["user"])
        await store.lookup("word", created["word"])
    server: TestServer = await aiohttp_server(make_app(config, registry=CollectorRegistry()))
    url = str(server.make_url("")).rstrip("/")
    # one valid push creates the rows *and* the Adam slots of `ads`
    async with OptimizerClient(dataclasses.replace(config, optimizers=(url,))) as client:
        result = await client.push({"ads": (created["ads"], np.ones((10, 16), np.float32))})
        assert result["applied"]
    await written(dataclasses.replace(config, optimizers=(url,)))  # rows written behind

    before = await fingerprint(config, created)
    assert all(found for _, found in before.values()), before
    assert set(before) == {"user", "word", "ads"}  # each row with its slots
    counts_before = item_counts(nodes)

    cases = _Corpus(seed=20241122, sender=config.sender(0)).build(n_random=500)
    assert len(cases) >= 1000
    problems: list[str] = []
    content_types = [CONTENT_TYPE, CONTENT_TYPE, "application/json", "text/plain", None]
    pick = random.Random(7)
    connector = aiohttp.TCPConnector(force_close=True)  # a broken connection hides no answer
    async with aiohttp.ClientSession(connector=connector) as http:
        for i, (label, body, headers) in enumerate(cases):
            ctype = pick.choice(content_types)
            hdrs = {**headers, **({"Content-Type": ctype} if ctype else {})}
            try:
                async with (
                    asyncio.timeout(10),
                    http.post(url + "/v1/gradients", data=_payload(body), headers=hdrs) as resp,
                ):
                    status, text = resp.status, await resp.text(errors="replace")
            except (aiohttp.ClientError, TimeoutError) as exc:
                problems.append(
                    f"{label}: no answer ({type(exc).__name__}: {exc}); body {_minimal_repro(body)}"
                )
                continue
            try:
                doc = json.loads(text)
            except ValueError:
                doc = None
            if not (400 <= status < 500):
                problems.append(
                    f"{label}: HTTP {status} {text[:160]!r}; body {_minimal_repro(body)}"
                )
            elif not (isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"]):
                problems.append(
                    f'{label}: HTTP {status} but not JSON {{"error": ...}}: {text[:160]!r}'
                )
            if i % 50 == 49:
                async with http.get(url + "/healthz") as health:
                    if health.status != 200:
                        problems.append(f"after {label}: /healthz answered {health.status}")
        async with http.get(url + "/healthz") as health:
            healthz = health.status
    after = await fingerprint(config, created)
    counts_after = item_counts(nodes)
    failures = []
    if healthz != 200:
        failures.append(f"/healthz answered {healthz} after the fuzzing")
    if after != before:
        failures.append(f"an invalid push changed stored rows or slots: {before} -> {after}")
    if counts_after != counts_before:
        failures.append(
            f"memcached (curr_items, total_items) changed: {counts_before} -> {counts_after}; "
            f"an invalid push wrote something"
        )
    if problems:
        failures.append(
            f"{len(problems)} of {len(cases)} invalid bodies were not answered with a 4xx "
            f"JSON error:\n" + "\n".join(problems[:80])
        )
    assert not failures, "\n".join(failures)


async def test_hostile_string_ids_are_percent_encoded_never_raw(
    own_nodes: list[MemcachedProcess], aiohttp_server: Any
) -> None:
    """A valid push of ids with spaces, CR LF, control chars and '%': each row is stored
    under its percent-encoded key, no raw command ever reaches memcached (no key `x` from
    "a b\\r\\nset x 0 0 1"), and lookalike ids ("%41" vs "A", "a%20b" vs "a b") stay apart."""
    nodes = [s.address for s in own_nodes]
    config = make_config(nodes, tables=SERVICE_TABLES, optimizers=["http://127.0.0.1:1"])
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    server: TestServer = await aiohttp_server(make_app(config, registry=CollectorRegistry()))
    url = str(server.make_url("")).rstrip("/")
    config = dataclasses.replace(config, optimizers=(url,))
    ids = [
        "a b\r\nset x 0 0 1",
        "a b",
        "a%20b",
        "%41",
        "A",
        "\x00\x01\x1f\x7f",
        "tab\there",
        "\r\n",
        "ünï/..",
        "get x",
        "mg x v\r\nmn",
        "",
    ]
    grads = (np.arange(len(ids) * 4, dtype=np.float32).reshape(len(ids), 4) + 1) / 8
    async with OptimizerClient(config) as client:
        result = await client.push({"word": (ids, grads)})
    assert result["applied"] and result["rows"] == len(ids)

    spec = config.table("word")
    init = initial_rows(spec.initializer, seed=spec.seed, ids=np.array(ids, dtype=object), dim=4)
    async with EmbeddingStore(config) as store:
        rows, found = await store.get("word", ids)
    assert found.all()
    np.testing.assert_allclose(rows, init - np.float32(0.25) * grads, rtol=1e-6)

    # memcached's own view: every key printable ASCII, no raw id, no injected key
    keys = [k for address in nodes for k in await metadump_keys(address)]
    for key in keys:
        assert len(key) <= 250 and all(0x21 <= b <= 0x7E for b in key), key
    prefix = f"{config.namespace}/word/w/".encode()
    want = {prefix + b"s" + quote(i, safe="").encode("ascii") for i in ids}
    assert {k for k in keys if k.startswith(prefix)} == want
    stored = 0
    for address in nodes:
        client = memcache_client(address)
        try:
            for raw in (b"x", b"y", b"v", b"set", b"a"):
                assert client.get(raw) is None, (address, raw)
            stored += sum(client.get(k) is not None for k in want)
        finally:
            client.close()
    assert stored == len(ids)  # each row on exactly one node


# ------------------------------------------------------------------ 2. kill -9 under load


@pytest.mark.timeout(120)
@pytest.mark.parametrize("answer", [(), ("rows",)], ids=["plain", "answered"])
async def test_killed_service_applies_every_retried_push_exactly_once(
    memcached_nodes: list[str], tmp_path: Path, answer: tuple[str, ...]
) -> None:
    """Pushes through OptimizerClient (same push_id on every retry) while the service is
    kill -9'ed 3 times and restarted: rows == init - 0.5 * sum(grads), so no push was lost
    and none was applied twice (journal replay + done records). `answered` pushes get
    their rows back before the service writes them (a streamed two-part reply): a kill
    between the two parts is retried like any cut answer."""
    port = free_port()
    path = cluster_file(tmp_path, memcached_nodes, port)
    config = load_config(path)
    rng = np.random.default_rng(31337)
    hot = np.unique(
        np.concatenate(
            [
                np.array([0, -1, 2**63 - 1, -(2**63), 1], dtype=np.int64),
                rng.integers(-(2**62), 2**62, size=80, dtype=np.int64),
            ]
        )
    )[:64]
    assert hot.shape == (64,)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
        init = await store.lookup("user", hot)

    service = ServiceProcess(path, port, tmp_path, log_level="INFO")
    total = np.zeros((64, 8), dtype=np.float64)
    min_pushes, max_pushes, window = 150, 2000, 4
    killer_done = asyncio.Event()
    trainer_done = asyncio.Event()
    progress = asyncio.Event()  # set by every completed push
    pushes_done = 0
    kills_at: list[int] = []
    results: list[dict[str, Any]] = []
    run = uuid.uuid4().hex[:8]

    async def trainer() -> None:
        nonlocal pushes_done
        slots = asyncio.Semaphore(window)

        async def one(client: OptimizerClient, i: int, ids: np.ndarray, g: np.ndarray) -> None:
            nonlocal pushes_done
            try:
                results.append(
                    await client.push({"user": (ids, g)}, push_id=f"kill-{run}-{i}", answer=answer)
                )
                pushes_done += 1
                progress.set()
            finally:
                slots.release()

        async with (
            OptimizerClient(config, worker=0, max_retries=60, backoff_s=0.05) as client,
            asyncio.TaskGroup() as group,
        ):
            i = 0
            while i < max_pushes and (i < min_pushes or not killer_done.is_set()):
                await slots.acquire()
                idx = rng.integers(0, 64, size=32)
                grads = rng.standard_normal((32, 8)).astype(np.float32)
                np.add.at(total, idx, grads.astype(np.float64))
                group.create_task(one(client, i, hot[idx], grads))
                i += 1
        trainer_done.set()
        progress.set()

    async def killer() -> None:
        kill_rng = random.Random(4242)
        try:
            for _ in range(3):
                # kill a service that is busy: wait until a push went through it (the client
                # may still be in its retry backoff after a restart), then a random moment
                progress.clear()
                await progress.wait()
                await asyncio.sleep(kill_rng.uniform(0.05, 0.4))
                if trainer_done.is_set():
                    break
                kills_at.append(pushes_done)
                service.kill()
                service.start()
                await wait_healthy(service)
        finally:
            killer_done.set()

    try:
        service.start()
        await wait_healthy(service)
        started = time.monotonic()
        await asyncio.gather(trainer(), killer())
        elapsed = time.monotonic() - started
        log = service.log()
    finally:
        service.kill()

    assert len(kills_at) == 3, f"only {len(kills_at)} kills landed while pushes ran"
    assert all(a < b for a, b in itertools.pairwise([0, *kills_at])), kills_at
    assert pushes_done == len(results) >= min_pushes
    assert pushes_done > kills_at[-1], "no push after the last restart"
    if config.service.row_flush_pushes > 1:
        # rows written behind: the last kill left their newest values in journals only; a
        # start replays them, and a pause writes them to memcached
        service.start()
        try:
            await wait_healthy(service)
            await written(config)
        finally:
            service.kill()
    async with EmbeddingStore(config) as store:
        rows, found = await store.get("user", hot)
    assert found.all()
    expected = init.astype(np.float64) - 0.5 * total
    np.testing.assert_allclose(
        rows,
        expected,
        atol=1e-4,
        rtol=1e-5,
        err_msg=f"{pushes_done} pushes, kills after {kills_at} completed pushes: a push was "
        f"lost or applied twice",
    )
    assert "unexpected error" not in log, log[-3000:]
    assert elapsed < 60, f"the kill loop took {elapsed:.1f} s"


# ------------------------------------------------------------------ 3. the token stays secret


async def _raw_get(port: int, path: str, header_lines: bytes) -> int:
    """GET with raw header bytes (for values aiohttp's client refuses to send)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode()
            + header_lines
            + b"\r\n"
        )
        await writer.drain()
        async with asyncio.timeout(10):
            head = await reader.readline()
            await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    return int(head.split()[1])


@pytest.mark.timeout(60)
async def test_requests_are_not_logged_without_access_log(
    memcached_nodes: list[str], tmp_path: Path
) -> None:
    """Without `--access-log` a request writes no log line (a trainer makes one or two a
    step), and /metrics still counts it; with it, each request has its line."""
    port = free_port()
    path = cluster_file(tmp_path, memcached_nodes, port)
    config = load_config(path)
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()
    logs = {}
    for access_log in (False, True):
        service = ServiceProcess(
            path, port, tmp_path, access_log=access_log, name=f"service-{access_log}"
        )
        try:
            service.start()
            await wait_healthy(service)
            async with OptimizerClient(config) as client:
                for _ in range(3):
                    ids = np.array([1, 2])
                    assert (await client.push({"user": (ids, np.ones((2, 8), np.float32))}))[
                        "applied"
                    ]
            async with aiohttp.ClientSession() as http:
                async with http.get(service.url + "/metrics") as resp:
                    metrics = await resp.text()
        finally:
            service.terminate()
            service.kill()
        logs[access_log] = service.log()
        pushed = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith("lookup_table_http_requests_total") and "/v1/gradients" in ln
        ]
        assert pushed and pushed[0].endswith(" 3.0"), pushed
    assert "listening on" in logs[False], logs[False][-2000:]
    assert "/v1/gradients" not in logs[False] and "aiohttp.access" not in logs[False]
    assert logs[True].count('"POST /v1/gradients HTTP/1.1" 200') == 3, logs[True][-2000:]


async def test_auth_token_never_logged(memcached_nodes: list[str], tmp_path: Path) -> None:
    """Wrong tokens (near misses, other schemes, non-UTF-8 bytes) get 401, the right one
    works, and the token appears nowhere in the service's stdout/stderr, even at DEBUG."""
    token = "tok" + uuid.uuid4().hex + uuid.uuid4().hex
    port = free_port()
    path = cluster_file(tmp_path, memcached_nodes, port, token=token)
    config = load_config(path)
    assert config.token == token
    async with EmbeddingStore(config) as store:
        await store.write_sentinels()

    wrong = {
        "no header": None,
        "another token": "Bearer wrong",
        "token + x": f"Bearer {token}x",
        "token - last char": f"Bearer {token[:-1]}",
        "lowercase scheme": f"bearer {token}",
        "Basic scheme": f"Basic {token}",
        "bare token": token,
        "two spaces": f"Bearer  {token}",
        "token twice": f"Bearer {token} {token}",
    }
    statuses: dict[str, int] = {}
    service = ServiceProcess(path, port, tmp_path, log_level="DEBUG")
    try:
        service.start()
        await wait_healthy(service)
        async with aiohttp.ClientSession() as http:
            for label, value in wrong.items():
                headers = {} if value is None else {"Authorization": value}
                async with http.get(service.url + "/v1/tables", headers=headers) as resp:
                    statuses[f"GET /v1/tables, {label}"] = resp.status
                async with http.post(
                    service.url + "/v1/gradients",
                    data=pack({"push_id": "p-auth", "tables": {}}),
                    headers=headers,
                ) as resp:
                    statuses[f"POST /v1/gradients, {label}"] = resp.status
            right = {"Authorization": f"Bearer {token}"}
            async with http.get(service.url + "/v1/tables", headers=right) as resp:
                assert resp.status == 200
            async with http.post(
                service.url + "/v1/gradients", data=b"\xc1 not msgpack", headers=right
            ) as resp:
                assert resp.status == 400
            async with http.post(
                service.url + "/v1/gradients",
                data=_splice({"push_id": _MARK}, _deep_list(1000)),  # an error path that logs
                headers=right,
            ) as resp:
                await resp.read()
        for label, raw in {
            "non-UTF-8 token": b"Bearer \xff\xfe",
            "token + non-UTF-8 byte": b"Bearer " + token.encode() + b"\xff",
            "Latin-1 token": b"Bearer caf\xe9",
        }.items():
            statuses[f"GET /v1/tables, {label}"] = await _raw_get(
                port, "/v1/tables", b"Authorization: " + raw + b"\r\n"
            )
        async with OptimizerClient(config) as client:
            pushed = await client.push({"user": (np.array([1, 2]), np.ones((2, 8), np.float32))})
            assert pushed["applied"]
        assert await _raw_get(port, "/healthz", b"") == 200
    finally:
        service.terminate()
        service.kill()

    log = service.log()
    assert "listening on" in log and "/v1/tables" in log, log[-2000:]  # the log is captured
    assert token not in log, "the bearer token appears in the service log"
    assert token[: len(token) // 2] not in log, "half of the bearer token appears in the log"
    not_401 = {label: s for label, s in statuses.items() if s != 401}
    assert not not_401, f"wrong tokens not answered 401: {not_401}"
