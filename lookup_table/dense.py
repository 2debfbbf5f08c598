"""Dense parameters (the MLP on top) in memcached: chunked, versioned, switched atomically.

Layout (table `_dense`), version 1: `m/current`, a msgpack `{version, generation,
params: {name: {shape, chunks}}, slots: {name: chunks}}`, the one pointer readers follow;
`d/<generation>/<name>/<i>` and `ds/<generation>/<name>/<i>`, the chunks (<= 512 KiB) of
a parameter's float32 values and of its optimizer slots, little-endian, C order. A write
puts a whole new generation first, then switches `current` to it, then deletes the old
one: a reader never sees half an update (docs/storage.md). The optimizer service's
write-behind of updates (the `dl/` logs) is its own.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keyspace import DENSE_CURRENT_ID, DENSE_TABLE, Kind, dense_chunk_id
from lookup_table.core.optimizers import Optimizer
from lookup_table.core.wire import pack, unpack
from lookup_table.store import EmbeddingStore

__all__ = ["CHUNK_BYTES", "DenseGeneration", "DenseParams", "DenseState", "same_current"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 512 * 1024
_CHUNK_FLOATS = CHUNK_BYTES // 4
READ_ATTEMPTS = 5
"""How often a read starts over when a concurrent update deleted the generation it read."""


@dataclass(frozen=True, slots=True)
class DenseState:
    """One consistent generation of the dense parameters (and, if read, their slots).

    `meta` is the `current` pointer this state is the content of ({} for a state not
    stored yet: ahead of memcached).
    """

    version: int
    generation: str
    params: Mapping[str, NDArray[np.float32]]
    slots: Mapping[str, NDArray[np.float32]] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DenseGeneration:
    """A new generation ready to be written: the `current` pointer that will name it,
    and its chunks (`param_ids` / `params` of kind `d`, `slot_ids` / `slots` of `ds`).

    The chunks are empty when the generation is an existing one (a version-only update).
    """

    meta: dict[str, Any]
    param_ids: list[str] = field(default_factory=list)
    params: list[bytes] = field(default_factory=list)
    slot_ids: list[str] = field(default_factory=list)
    slots: list[bytes] = field(default_factory=list)


def same_current(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two `current` pointers name the same state (generation and version)."""
    if a is None or b is None:
        return a is b
    return bool(a["generation"] == b["generation"] and int(a["version"]) == int(b["version"]))


def _chunks(value: NDArray[np.float32]) -> list[bytes]:
    """The float32 little-endian bytes of `value` in C order, cut at CHUNK_BYTES."""
    flat = np.ascontiguousarray(value, dtype="<f4").reshape(-1)
    starts = range(0, flat.size, _CHUNK_FLOATS)
    return [flat[i : i + _CHUNK_FLOATS].tobytes() for i in starts] or [b""]


class DenseParams:
    """Read and write the dense parameters of a namespace as stored: generations and the
    `current` pointer. Holds nothing in memory; writes are expected one at a time."""

    def __init__(self, store: EmbeddingStore, optimizer: Optimizer) -> None:
        self.store = store
        self.optimizer = optimizer

    # ------------------------------------------------------------ reading

    CURRENT_READ: tuple[str, list[str], str] = (DENSE_TABLE, [DENSE_CURRENT_ID], Kind.META)
    """The `current` pointer's read, for `EmbeddingStore.peek` (then `pointer`)."""

    @staticmethod
    def pointer(raw: bytes | None) -> dict[str, Any] | None:
        """The `current` pointer from its stored value (None: not written yet)."""
        return None if raw is None else dict(unpack(raw))

    async def meta(self) -> dict[str, Any] | None:
        """The `current` pointer (one small get), or None before `init`."""
        (raw,) = await self.store.get_blobs(DENSE_TABLE, [DENSE_CURRENT_ID], kind=Kind.META)
        return self.pointer(raw)

    async def read(self, *, with_slots: bool = False) -> DenseState | None:
        """The current parameters and their slots, or None before `init`. Retries if a
        concurrent update deleted the generation it was reading. (`with_slots` is kept
        for callers that say what they use: a generation is always read whole.)"""
        del with_slots
        for _ in range(READ_ATTEMPTS):
            meta = await self.meta()
            if meta is None:
                return None
            state = await self.read_generation(meta)
            if state is not None:
                return state
        raise RuntimeError("dense parameters changed during every read attempt")

    async def read_generation(self, meta: Mapping[str, Any]) -> DenseState | None:
        """The parameters and slots of generation `meta`, or None if any chunk is gone."""
        gen = meta["generation"]
        names = list(meta["params"])
        ids = [dense_chunk_id(gen, n, i) for n in names for i in range(meta["params"][n]["chunks"])]
        slot_ids = [dense_chunk_id(gen, n, i) for n in names for i in range(meta["slots"][n])]
        values, slot_values = await asyncio.gather(
            self.store.get_blobs(DENSE_TABLE, ids, kind=Kind.DENSE) if ids else _none(),
            self.store.get_blobs(DENSE_TABLE, slot_ids, kind=Kind.DENSE_SLOTS)
            if slot_ids
            else _none(),
        )
        if any(v is None for v in values) or any(v is None for v in slot_values):
            return None
        params: dict[str, NDArray[np.float32]] = {}
        slots: dict[str, NDArray[np.float32]] = {}
        pos = spos = 0
        for name in names:
            info = meta["params"][name]
            k = info["chunks"]
            blob = b"".join(v for v in values[pos : pos + k] if v is not None)
            pos += k
            params[name] = np.frombuffer(blob, dtype="<f4").reshape(info["shape"])
            ks = meta["slots"][name]
            sblob = b"".join(v for v in slot_values[spos : spos + ks] if v is not None)
            spos += ks
            slots[name] = np.frombuffer(sblob, dtype="<f4").reshape(1, -1)
        return DenseState(
            version=int(meta["version"]), generation=gen, params=params, slots=slots, meta=meta
        )

    # ------------------------------------------------------------ writing

    def prepare(
        self,
        version: int,
        params: Mapping[str, NDArray[np.float32]],
        slots: Mapping[str, NDArray[np.float32]],
    ) -> DenseGeneration:
        """A new generation of `params` and `slots` at `version`, cut into chunks (pure)."""
        gen = uuid.uuid4().hex[:16]
        out = DenseGeneration(meta={"version": int(version), "generation": gen})
        info: dict[str, Any] = {}
        slot_chunks: dict[str, int] = {}
        for name, value in params.items():
            parts = _chunks(value)
            info[name] = {"shape": [int(d) for d in value.shape], "chunks": len(parts)}
            out.param_ids.extend(dense_chunk_id(gen, name, i) for i in range(len(parts)))
            out.params.extend(parts)
            sparts = _chunks(slots[name])
            slot_chunks[name] = len(sparts)
            out.slot_ids.extend(dense_chunk_id(gen, name, i) for i in range(len(sparts)))
            out.slots.extend(sparts)
        out.meta["params"] = info
        out.meta["slots"] = slot_chunks
        return out

    async def write_chunks(self, generation: DenseGeneration) -> None:
        """Write the chunks of `generation` (not yet named by `current`)."""
        await asyncio.gather(
            self.store.set_blobs(
                DENSE_TABLE, generation.param_ids, generation.params, kind=Kind.DENSE
            )
            if generation.param_ids
            else _none(),
            self.store.set_blobs(
                DENSE_TABLE, generation.slot_ids, generation.slots, kind=Kind.DENSE_SLOTS
            )
            if generation.slot_ids
            else _none(),
        )

    async def discard(self, generation: DenseGeneration) -> None:
        """Delete the chunks of a generation that `current` never named (best effort:
        after a write that failed before anything pointed at them)."""
        try:
            await asyncio.gather(
                self.store.delete_blobs(DENSE_TABLE, generation.param_ids, kind=Kind.DENSE)
                if generation.param_ids
                else _none(),
                self.store.delete_blobs(DENSE_TABLE, generation.slot_ids, kind=Kind.DENSE_SLOTS)
                if generation.slot_ids
                else _none(),
            )
        except Exception:
            logger.debug(
                "could not delete the unused dense generation %s",
                generation.meta["generation"],
                exc_info=True,
            )

    async def set_current(self, meta: Mapping[str, Any], *, add: bool = False) -> bool:
        """Point `current` at the generation `meta` names (its chunks written). `add`:
        only if `current` is not written yet (the first `init` wins). Returns whether it
        was stored."""
        (stored,) = await self.store.set_blobs(
            DENSE_TABLE, [DENSE_CURRENT_ID], [pack(dict(meta))], kind=Kind.META, add=add
        )
        return bool(stored)

    async def delete_replaced(
        self, previous: Mapping[str, Any] | None, current: Mapping[str, Any]
    ) -> None:
        """Delete the generation of `previous`, the pointer `current` replaced, unless
        it is the same one (a version-only update)."""
        if previous is not None and previous["generation"] != current["generation"]:
            await self._delete_generation(previous)

    async def _delete_generation(self, meta: Mapping[str, Any]) -> None:
        gen = meta["generation"]
        ids = [
            dense_chunk_id(gen, n, i) for n, p in meta["params"].items() for i in range(p["chunks"])
        ]
        sids = [dense_chunk_id(gen, n, i) for n, k in meta["slots"].items() for i in range(k)]
        await asyncio.gather(
            self.store.delete_blobs(DENSE_TABLE, ids, kind=Kind.DENSE),
            self.store.delete_blobs(DENSE_TABLE, sids, kind=Kind.DENSE_SLOTS),
        )

    def initial_slots(self, params: Mapping[str, NDArray[np.float32]]) -> dict[str, Any]:
        return {n: self.optimizer.initial_slots(1, int(v.size)) for n, v in params.items()}

    async def write(
        self,
        version: int,
        params: Mapping[str, NDArray[np.float32]],
        slots: Mapping[str, NDArray[np.float32]],
    ) -> dict[str, Any]:
        """Write a new generation and switch `current` to it (then drop the old one), as a
        checkpoint restore does; returns the new `current` pointer."""
        generation = self.prepare(version, params, slots)
        previous, _ = await asyncio.gather(self.meta(), self.write_chunks(generation))
        await self.set_current(generation.meta)
        await self.delete_replaced(previous, generation.meta)
        return generation.meta


async def _none() -> list[Any]:
    return []
