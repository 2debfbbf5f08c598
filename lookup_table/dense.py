"""Dense parameters (the MLP on top) in memcached: chunked, versioned, switched atomically.

Layout (table `_dense`), version 1:

* `m/current`: msgpack `{version, generation, params: {name: {shape, chunks}},
  slots: {name: chunks}}`: the one pointer readers follow.
* `d/<generation>/<name>/<i>`: the i-th chunk (<= 512 KiB) of a parameter's
  float32 values, little-endian, C order.
* `ds/<generation>/<name>/<i>`: the same for its optimizer slots (the parameter
  is one "row" of `size` floats for the optimizer, so Adam keeps one step count
  per parameter, which equals Keras' iterations when every step updates it).

A write puts a whole new generation first and then switches `current` to it, so a
reader never sees half an update; the old generation is deleted afterwards. The
first `init` wins (`add` on `current`); a loser's chunks are deleted and it gets
the winner's parameters. Only replica 0 writes dense parameters, one update at a
time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keyspace import DENSE_CURRENT_ID, DENSE_TABLE, Kind, dense_chunk_id
from lookup_table.core.optimizers import Optimizer
from lookup_table.core.wire import pack, unpack
from lookup_table.errors import DenseParamError
from lookup_table.store import EmbeddingStore

__all__ = ["DenseParams", "DenseState"]

CHUNK_BYTES = 512 * 1024
_READ_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class DenseState:
    """One consistent generation of the dense parameters (and, if read, their slots)."""

    version: int
    generation: str
    params: Mapping[str, NDArray[np.float32]]
    slots: Mapping[str, NDArray[np.float32]] = field(default_factory=dict)


def _chunks(data: bytes) -> list[bytes]:
    return [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]


class DenseParams:
    """Read, initialize and update the dense parameters of a namespace."""

    def __init__(self, store: EmbeddingStore, optimizer: Optimizer) -> None:
        self.store = store
        self.optimizer = optimizer
        self.lock = asyncio.Lock()

    async def _meta(self) -> dict[str, Any] | None:
        (raw,) = await self.store.get_blobs(DENSE_TABLE, [DENSE_CURRENT_ID], kind=Kind.META)
        return None if raw is None else dict(unpack(raw))

    async def read(self, *, with_slots: bool = False) -> DenseState | None:
        """The current generation, or None before `init`. Retries if a concurrent
        update deleted the generation it was reading."""
        for _ in range(_READ_ATTEMPTS):
            meta = await self._meta()
            if meta is None:
                return None
            gen = meta["generation"]
            names = list(meta["params"])
            ids: list[str] = []
            for name in names:
                ids += [dense_chunk_id(gen, name, i) for i in range(meta["params"][name]["chunks"])]
            values = await self.store.get_blobs(DENSE_TABLE, ids, kind=Kind.DENSE) if ids else []
            slot_ids: list[str] = []
            if with_slots:
                for name in names:
                    slot_ids += [dense_chunk_id(gen, name, i) for i in range(meta["slots"][name])]
            slot_values = (
                await self.store.get_blobs(DENSE_TABLE, slot_ids, kind=Kind.DENSE_SLOTS)
                if slot_ids
                else []
            )
            if any(v is None for v in values) or any(v is None for v in slot_values):
                continue  # switched and deleted under us: read the new generation
            params: dict[str, NDArray[np.float32]] = {}
            slots: dict[str, NDArray[np.float32]] = {}
            pos = spos = 0
            for name in names:
                info = meta["params"][name]
                k = info["chunks"]
                blob = b"".join(v for v in values[pos : pos + k] if v is not None)
                pos += k
                params[name] = np.frombuffer(blob, dtype="<f4").reshape(info["shape"]).copy()
                if with_slots:
                    ks = meta["slots"][name]
                    sblob = b"".join(v for v in slot_values[spos : spos + ks] if v is not None)
                    spos += ks
                    slots[name] = np.frombuffer(sblob, dtype="<f4").reshape(1, -1).copy()
            return DenseState(
                version=int(meta["version"]), generation=gen, params=params, slots=slots
            )
        raise RuntimeError("dense parameters changed during every read attempt")

    async def _write_generation(
        self, params: Mapping[str, NDArray[np.float32]], slots: Mapping[str, NDArray[np.float32]]
    ) -> tuple[str, dict[str, Any], dict[str, int]]:
        gen = uuid.uuid4().hex[:16]
        info: dict[str, Any] = {}
        slot_chunks: dict[str, int] = {}
        ids: list[str] = []
        blobs: list[bytes] = []
        sids: list[str] = []
        sblobs: list[bytes] = []
        for name, value in params.items():
            parts = _chunks(np.ascontiguousarray(value, dtype="<f4").tobytes())
            info[name] = {"shape": list(value.shape), "chunks": len(parts)}
            ids += [dense_chunk_id(gen, name, i) for i in range(len(parts))]
            blobs += parts
            sparts = _chunks(np.ascontiguousarray(slots[name], dtype="<f4").tobytes())
            slot_chunks[name] = len(sparts)
            sids += [dense_chunk_id(gen, name, i) for i in range(len(sparts))]
            sblobs += sparts
        await asyncio.gather(
            self.store.set_blobs(DENSE_TABLE, ids, blobs, kind=Kind.DENSE),
            self.store.set_blobs(DENSE_TABLE, sids, sblobs, kind=Kind.DENSE_SLOTS),
        )
        return gen, info, slot_chunks

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

    async def init(self, params: Mapping[str, NDArray[np.float32]]) -> tuple[bool, DenseState]:
        """First writer wins: returns (created, the parameters every trainer starts from)."""
        for name, value in params.items():
            if not np.isfinite(value).all():
                raise DenseParamError(f"params.{name}: initial values must be finite", reason="nan")
        gen, info, slot_chunks = await self._write_generation(params, self.initial_slots(params))
        meta = {"version": 0, "generation": gen, "params": info, "slots": slot_chunks}
        (created,) = await self.store.set_blobs(
            DENSE_TABLE, [DENSE_CURRENT_ID], [pack(meta)], kind=Kind.META, add=True
        )
        if not created:
            await self._delete_generation(meta)
        state = await self.read()
        if state is None:
            raise RuntimeError("dense parameters vanished right after init")
        return bool(created), state

    def check_grads(self, state: DenseState, grads: Mapping[str, NDArray[np.float32]]) -> None:
        """Refuse gradients for unknown parameters or of the wrong shape (DenseParamError)."""
        for name, grad in grads.items():
            if name not in state.params:
                known = ", ".join(sorted(state.params)) or "none"
                raise DenseParamError(
                    f"dense.{name}: unknown dense parameter; known: {known}", reason="unknown_dense"
                )
            want = state.params[name].shape
            if tuple(grad.shape) != tuple(want):
                raise DenseParamError(
                    f"dense.{name}: expected shape {tuple(want)}, got {tuple(grad.shape)}",
                    reason="shape",
                )

    def update(
        self, state: DenseState, grads: Mapping[str, NDArray[np.float32]]
    ) -> tuple[dict[str, NDArray[np.float32]], dict[str, NDArray[np.float32]]]:
        """New values and slots of every parameter (those without a gradient unchanged)."""
        params = dict(state.params)
        slots = dict(state.slots)
        for name, grad in grads.items():
            value = state.params[name]
            row = value.reshape(1, -1)
            new_row, new_slots = self.optimizer.update(
                row, np.asarray(grad, dtype=np.float32).reshape(1, -1), state.slots[name]
            )
            params[name] = new_row.reshape(value.shape)
            slots[name] = new_slots
        return params, slots

    async def write(
        self,
        version: int,
        params: Mapping[str, NDArray[np.float32]],
        slots: Mapping[str, NDArray[np.float32]],
    ) -> None:
        """Write a new generation and switch `current` to it (then drop the old one)."""
        old = await self._meta()
        gen, info, slot_chunks = await self._write_generation(params, slots)
        meta = {"version": version, "generation": gen, "params": info, "slots": slot_chunks}
        await self.store.set_blobs(DENSE_TABLE, [DENSE_CURRENT_ID], [pack(meta)], kind=Kind.META)
        if old is not None and old["generation"] != gen:
            await self._delete_generation(old)
