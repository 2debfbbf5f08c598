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
reader never sees half an update; the old generation is deleted afterwards. A
generation's chunks are never changed once written, so one value of `current`
(generation and version) always names the same parameters. An update that changes
only the version (a sync round without dense gradients) points a new `current` at
the same generation. The first `init` wins (`add` on `current`); a loser's chunks are
deleted and it gets the winner's parameters. Only replica 0 writes dense parameters,
one update at a time (the service serializes them).

In memory: a `DenseParams` keeps the last consistent state it read or wrote (the
`current` it was at, the parameters and their slots). `read` gets `current` (one small
get) and answers from memory while `current` is the one it holds; when `current`
changed behind it (a checkpoint restore, `lookup-table-admin reinit`, another process)
it reads the whole generation again. The copy changes only after a switch of `current`
succeeded (`switch`) or on such a read. Its arrays are read-only and an update makes
new ones, so parameters handed out never change under their holder.
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
from lookup_table.errors import DenseParamError
from lookup_table.store import EmbeddingStore

__all__ = ["DenseGeneration", "DenseParams", "DenseState", "same_current"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 512 * 1024
_CHUNK_FLOATS = CHUNK_BYTES // 4
_READ_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class DenseState:
    """One consistent generation of the dense parameters (and, if read, their slots).

    `meta` is the `current` pointer this state is the content of ({} when unknown).
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


def _frozen(value: NDArray[np.float32]) -> NDArray[np.float32]:
    """A read-only view: the in-memory copy is shared, nobody may write into it."""
    view = value.view()
    view.flags.writeable = False
    return view


class DenseParams:
    """Read, initialize and update the dense parameters of a namespace.

    Keeps the last consistent state in memory (see the module docstring). Writes
    through one instance are expected one at a time (the service's updater
    serializes them); reads may run concurrently with them.
    """

    def __init__(self, store: EmbeddingStore, optimizer: Optimizer) -> None:
        self.store = store
        self.optimizer = optimizer
        self._state: DenseState | None = None
        self._epoch = 0  # bumped by every change of `_state` but a read's own

    # ------------------------------------------------------------ the in-memory copy

    def _install(self, state: DenseState) -> DenseState:
        """Make `state` the in-memory copy (read-only views of its arrays); returns it."""
        self._epoch += 1
        self._state = DenseState(
            version=state.version,
            generation=state.generation,
            params={n: _frozen(v) for n, v in state.params.items()},
            slots={n: _frozen(v) for n, v in state.slots.items()},
            meta=state.meta,
        )
        return self._state

    def forget(self) -> None:
        """Drop the in-memory copy: the next read reads the whole generation again."""
        self._epoch += 1
        self._state = None

    @property
    def cached(self) -> DenseState | None:
        """The in-memory copy (None before the first read or write, or after `forget`)."""
        return self._state

    # ------------------------------------------------------------ reading

    async def meta(self) -> dict[str, Any] | None:
        """The `current` pointer (one small get), or None before `init`."""
        (raw,) = await self.store.get_blobs(DENSE_TABLE, [DENSE_CURRENT_ID], kind=Kind.META)
        return None if raw is None else dict(unpack(raw))

    async def read(
        self, *, with_slots: bool = False, current: Mapping[str, Any] | None = None
    ) -> DenseState | None:
        """The current parameters, or None before `init`.

        Reads `current` (unless the caller passes the pointer it just read) and answers
        from memory when it names the state held there; otherwise reads the whole
        generation, slots included (the updater needs them; `with_slots` is kept for
        callers that say what they use). Retries if a concurrent update deleted the
        generation it was reading.
        """
        del with_slots  # a generation is always read whole, slots included
        for attempt in range(_READ_ATTEMPTS):
            meta = dict(current) if current is not None and attempt == 0 else await self.meta()
            if meta is None:
                return None
            held = self._state
            if held is not None and same_current(held.meta, meta):
                return held
            epoch = self._epoch
            state = await self._read_generation(meta)
            if state is None:
                continue  # switched and deleted under us: read the new generation
            if self._epoch == epoch:  # nothing newer was installed while we read
                return self._install(state)
            return state
        raise RuntimeError("dense parameters changed during every read attempt")

    async def _read_generation(self, meta: Mapping[str, Any]) -> DenseState | None:
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

    async def switch(
        self,
        current: Mapping[str, Any],
        previous: Mapping[str, Any] | None,
        *,
        values: tuple[Mapping[str, NDArray[np.float32]], Mapping[str, NDArray[np.float32]]]
        | None = None,
        check: bool = False,
    ) -> bool:
        """Point `current` at a generation whose chunks are written, then delete the
        generation of `previous` (the pointer it replaces), unless it is the same one.

        `values` (params, slots) are the content of `current`, when the caller has them:
        they become the in-memory copy once the switch succeeded (do not change them
        afterwards); without them the copy is dropped. `check` (a replay) first reads
        `current` and switches only if it still is `previous` (or already `current`):
        a replay must not undo what changed the parameters since (a restore). Returns
        whether `current` now names `current`.
        """
        if check:
            now = await self.meta()
            if not (same_current(now, current) or same_current(now, previous)):
                logger.warning(
                    "dense parameters are at version %s (generation %s), not at the one a "
                    "journaled update replaces (%s): that update is not switched in",
                    None if now is None else now["version"],
                    None if now is None else now["generation"],
                    None if previous is None else previous["generation"],
                )
                return False
        await self.store.set_blobs(
            DENSE_TABLE, [DENSE_CURRENT_ID], [pack(dict(current))], kind=Kind.META
        )
        if values is not None:
            self._install(
                DenseState(
                    version=int(current["version"]),
                    generation=current["generation"],
                    params=dict(values[0]),
                    slots=dict(values[1]),
                    meta=dict(current),
                )
            )
        elif self._state is not None and not same_current(self._state.meta, current):
            self.forget()
        if previous is not None and previous["generation"] != current["generation"]:
            await self._delete_generation(previous)
        return True

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
        slots = self.initial_slots(params)
        generation = self.prepare(0, params, slots)
        await self.write_chunks(generation)
        (created,) = await self.store.set_blobs(
            DENSE_TABLE, [DENSE_CURRENT_ID], [pack(generation.meta)], kind=Kind.META, add=True
        )
        if created:
            return True, self._install(
                DenseState(
                    version=0,
                    generation=generation.meta["generation"],
                    params=dict(params),
                    slots=slots,
                    meta=generation.meta,
                )
            )
        await self.discard(generation)
        state = await self.read()
        if state is None:
            raise RuntimeError("dense parameters vanished right after init")
        return False, state

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
        """New values and slots of every parameter (those without a gradient unchanged).

        New arrays for every updated parameter: `state`'s arrays are never written.
        """
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
        """Write a new generation and switch `current` to it (then drop the old one).

        For a checkpoint restore and an older service's journal (which carries the
        values): the service's pushes use `prepare`, `write_chunks` and `switch`.
        The arrays become the in-memory copy: do not change them afterwards.
        """
        generation = self.prepare(version, params, slots)
        previous, _ = await asyncio.gather(self.meta(), self.write_chunks(generation))
        await self.switch(generation.meta, previous, values=(params, slots))


async def _none() -> list[Any]:
    return []
