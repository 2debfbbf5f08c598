"""Replica 0's dense parameters: held in memory, updated by pushes, written behind.

An update is applied to the in-memory state (`advance`) and written as its gradients'
log (`write_log`, `dl/v<V>` of table `_dense`), not as a generation; `flush` writes the
state as a generation now and then and deletes the logs it covers; `replay_logs` rebuilds
a restarted replica's state from the stored generation and the logs after it. The
storage itself (generations, `current`) is `lookup_table.dense` (docs/write-behind.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.keyspace import DENSE_TABLE, Kind, dense_log_id
from lookup_table.core.optimizers import Optimizer
from lookup_table.core.wire import decode_array, encode_array, pack, pack_view, unpack
from lookup_table.dense import CHUNK_BYTES, READ_ATTEMPTS, DenseParams, DenseState, same_current
from lookup_table.errors import DenseParamError, WireError
from lookup_table.memcached.protocol import Wire
from lookup_table.store import EmbeddingStore

__all__ = ["INLINE_LOG_BYTES", "DenseLogError", "DenseReplica"]

logger = logging.getLogger(__name__)

# A log body up to this size goes inside its index: one item (memcached's default item
# limit, -I, is 1 MiB with the key and item header), stored whole or not at all, so it
# needs no checksum. Larger ones are cut into CHUNK_BYTES chunks with a CRC-32.
INLINE_LOG_BYTES = 1024 * 1024 - 8 * 1024
_OWN_POINTERS = 8  # the last `current` pointers an instance wrote or read (`_own`)


class DenseLogError(RuntimeError):
    """A log of a committed dense update is missing or does not check out."""


def _pointer_key(meta: Mapping[str, Any]) -> tuple[str, int]:
    """What makes a `current` pointer the one it is: its generation and version."""
    return str(meta["generation"]), int(meta["version"])


def _frozen(value: NDArray[np.float32]) -> NDArray[np.float32]:
    """A read-only view: the in-memory copy is shared, nobody may write into it."""
    view = value.view()
    view.flags.writeable = False
    return view


class DenseReplica:
    """Read, initialize and update the dense parameters of a namespace, keeping the last
    consistent state in memory.

    `read` gets `current` (one small get) and answers from memory while `current` is a
    pointer this instance wrote or read (its own); when `current` changed behind it (a
    checkpoint restore, `lookup-table-admin reinit`, another process) it reads the whole
    generation again and drops what it held: the new state wins. Its arrays are
    read-only and an update makes new ones, so parameters handed out never change under
    their holder. Writes through one instance are expected one at a time (the updater
    serializes them); reads may run concurrently with them.
    """

    def __init__(self, store: EmbeddingStore, optimizer: Optimizer) -> None:
        self.storage = DenseParams(store, optimizer)
        self.store = store
        self.optimizer = optimizer
        self._state: DenseState | None = None
        self._epoch = 0  # bumped by every change of `_state` but a read's own
        # the `current` pointers this instance wrote or read, newest last (generation,
        # version): while memcached's is one of them, the in-memory state is at or ahead
        # of it. The newest is the generation the logs apply to.
        self._own: deque[tuple[str, int]] = deque(maxlen=_OWN_POINTERS)
        self._stored: dict[str, Any] | None = None  # the newest own pointer
        self._flush_lock = asyncio.Lock()
        self._log_chunks: dict[int, int] = {}  # version -> chunks of the logs written here

    # ------------------------------------------------------------ the in-memory copy

    def _own_pointer(self, meta: Mapping[str, Any]) -> None:
        """`meta` is now memcached's `current` as this instance knows it."""
        self._stored = dict(meta)
        if not self._is_own(meta):
            self._own.append(_pointer_key(meta))

    def _is_own(self, meta: Mapping[str, Any] | None) -> bool:
        return meta is not None and _pointer_key(meta) in self._own

    def _install(self, state: DenseState) -> DenseState:
        """Make `state` the in-memory copy (read-only views of its arrays); returns it.

        A state with a `meta` is a stored generation: its pointer becomes an own one."""
        if state.meta:
            self._own_pointer(state.meta)
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
        self._own.clear()
        self._stored = None
        self._log_chunks.clear()

    @property
    def cached(self) -> DenseState | None:
        """The in-memory copy (None before the first read or write, or after `forget`)."""
        return self._state

    @property
    def unflushed(self) -> int:
        """How many versions the in-memory state is ahead of the generation it stored."""
        held, stored = self._state, self._stored
        if held is None or stored is None:
            return 0
        return max(0, held.version - int(stored["version"]))

    def advance(
        self,
        version: int,
        params: Mapping[str, NDArray[np.float32]],
        slots: Mapping[str, NDArray[np.float32]],
    ) -> None:
        """Make `params` and `slots` at `version` the in-memory state, ahead of memcached
        (write-behind: the update's log is written, its generation is not yet). Do not
        change the arrays afterwards."""
        self._install(
            DenseState(version=int(version), generation="", params=dict(params), slots=dict(slots))
        )

    # ------------------------------------------------------------ reading

    async def meta(self) -> dict[str, Any] | None:
        """The `current` pointer (one small get), or None before `init`."""
        return await self.storage.meta()

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
        for attempt in range(READ_ATTEMPTS):
            meta = dict(current) if current is not None and attempt == 0 else await self.meta()
            if meta is None:
                return None
            held = self._state
            if held is not None and self._is_own(meta):
                return held  # at or ahead of memcached's
            epoch = self._epoch
            state = await self.storage.read_generation(meta)
            if state is None:
                continue  # switched and deleted under us: read the new generation
            if self._epoch != epoch:  # a newer state was installed while we read
                return self._state if self._state is not None else state
            if held is not None and held.version != state.version:
                logger.warning(
                    "dense parameters changed behind this process (a restore, a reinit): "
                    "now version %d, generation %s; the state held here (version %d) is "
                    "dropped",
                    state.version,
                    state.generation,
                    held.version,
                )
            self.forget()  # what was held, and what it knew of memcached
            return self._install(state)
        raise RuntimeError("dense parameters changed during every read attempt")

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
        await self.storage.set_current(current)
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
        await self.storage.delete_replaced(previous, current)
        return True

    async def init(self, params: Mapping[str, NDArray[np.float32]]) -> tuple[bool, DenseState]:
        """First writer wins: returns (created, the parameters every trainer starts from)."""
        for name, value in params.items():
            if not np.isfinite(value).all():
                raise DenseParamError(f"params.{name}: initial values must be finite", reason="nan")
        slots = self.storage.initial_slots(params)
        generation = self.storage.prepare(0, params, slots)
        await self.storage.write_chunks(generation)
        created = await self.storage.set_current(generation.meta, add=True)
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
        await self.storage.discard(generation)
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

        For a journal of an older service, which carries the values. The arrays become
        the in-memory copy: do not change them afterwards.
        """
        generation = self.storage.prepare(version, params, slots)
        previous, _ = await asyncio.gather(self.meta(), self.storage.write_chunks(generation))
        await self.switch(generation.meta, previous, values=(params, slots))

    # ------------------------------------------------------------ write-behind

    async def write_log(self, version: int, grads: Mapping[str, NDArray[np.float32]]) -> None:
        """Write the log of the update to `version` (its gradients; none for an update of
        the version only), over any earlier log of that version (one whose push was not
        journaled). One request per node."""
        body = pack_view(
            {
                "version": int(version),
                "grads": {n: encode_array(np.asarray(g, dtype="<f4")) for n, g in grads.items()},
            }
        )
        if len(body) <= INLINE_LOG_BYTES:
            parts: list[memoryview] = []
            index: Wire = pack_view(
                {"version": int(version), "chunks": 0, "size": len(body), "crc32": None,
                 "body": body}
            )  # fmt: skip
        else:
            parts = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)]
            index = pack(
                {
                    "version": int(version),
                    "chunks": len(parts),
                    "size": len(body),
                    "crc32": zlib.crc32(body),
                }
            )
        ids = [dense_log_id(version), *(dense_log_id(version, i) for i in range(len(parts)))]
        await self.store.set_blobs(DENSE_TABLE, ids, [index, *parts], kind=Kind.DENSE_LOG)
        self._log_chunks[int(version)] = len(parts)

    async def read_logs(self, versions: Sequence[int]) -> list[dict[str, NDArray[np.float32]]]:
        """The gradients of the logged updates to `versions`, in that order.

        Raises:
            DenseLogError: a log is missing or does not check out (size, CRC-32, version).
        """
        if not versions:
            return []
        indexes = await self.store.get_blobs(
            DENSE_TABLE, [dense_log_id(v) for v in versions], kind=Kind.DENSE_LOG
        )
        docs: list[dict[str, Any]] = []
        for v, raw in zip(versions, indexes, strict=True):
            if raw is None:
                raise DenseLogError(f"the log of the dense update to version {v} is missing")
            docs.append(dict(unpack(raw)))
        ids = [
            dense_log_id(v, i)
            for v, d in zip(versions, docs, strict=True)
            for i in range(int(d["chunks"]))
        ]
        chunks = iter(await self.store.get_blobs(DENSE_TABLE, ids, kind=Kind.DENSE_LOG))
        out: list[dict[str, NDArray[np.float32]]] = []
        for v, d in zip(versions, docs, strict=True):
            parts = [next(chunks) for _ in range(int(d["chunks"]))]
            if any(p is None for p in parts):
                raise DenseLogError(
                    f"a chunk of the log of the dense update to version {v} is missing"
                )
            # a body inside its index is one item, which memcached stores whole: no CRC-32
            # needed (logs of older services carry one, still checked); chunks joined
            # always carry one
            body = d["body"] if "body" in d else b"".join(p for p in parts if p is not None)
            crc = d["crc32"]
            if (crc is None and "body" not in d) or (
                len(body) != int(d["size"]) or (crc is not None and zlib.crc32(body) != int(crc))
            ):
                raise DenseLogError(
                    f"the log of the dense update to version {v} does not check out "
                    f"({len(body)} bytes, expected {d['size']}; or its CRC-32 differs)"
                )
            doc = unpack(body)
            if int(doc["version"]) != v:
                raise DenseLogError(f"the log under version {v} is of version {doc['version']}")
            try:
                out.append(
                    {
                        n: decode_array(a, field=f"dense log v{v}.{n}", dtype="<f4")
                        for n, a in doc["grads"].items()
                    }
                )
            except WireError as exc:
                raise DenseLogError(f"the log of the dense update to version {v}: {exc}") from None
            self._log_chunks[v] = int(d["chunks"])
        return out

    async def _delete_logs(self, versions: Sequence[int]) -> None:
        """Delete the logs of `versions` whose chunk counts this instance knows."""
        ids = []
        for v in versions:
            n = self._log_chunks.pop(v, None)
            if n is not None:
                ids += [dense_log_id(v), *(dense_log_id(v, i) for i in range(n))]
        if ids:
            await self.store.delete_blobs(DENSE_TABLE, ids, kind=Kind.DENSE_LOG)

    async def replay_logs(self, through: int) -> int:
        """Rebuild the state at version `through` from the stored generation and the logs
        of the updates after it (a restarted replica: the logs of every journaled push
        are there); then flush it. Returns how many logs were applied.

        Raises:
            DenseLogError: a log of a version up to `through` is missing or corrupt.
        """
        state = await self.read()
        if state is None or state.version >= through:
            return 0
        versions = list(range(state.version + 1, through + 1))
        logs = await self.read_logs(versions)
        params, slots = dict(state.params), dict(state.slots)
        for version, grads in zip(versions, logs, strict=True):
            if grads:
                self.check_grads(state, grads)
                params, slots = self.update(
                    DenseState(version=version, generation="", params=params, slots=slots), grads
                )
        self.advance(through, params, slots)
        await self.flush()
        return len(versions)

    async def flush(self) -> bool:
        """Write the in-memory state as a generation, switch `current` to it, delete the
        previous generation and the logs it covers. One flush at a time; the state may
        move on meanwhile (a flush writes what it held when it started).

        Returns whether a generation was written: not when the state is stored already,
        nor when `current` changed behind this process (a restore: that state wins, the
        next `read` takes it).
        """
        async with self._flush_lock:
            held, base = self._state, self._stored
            if held is None or base is None or held.meta:
                return False
            generation = self.storage.prepare(held.version, held.params, held.slots)
            try:
                await self.storage.write_chunks(generation)
            except BaseException:
                await self.storage.discard(generation)
                raise
            now = await self.meta()
            if not self._is_own(now):
                logger.warning(
                    "dense parameters changed behind this process (a restore?): the state "
                    "at version %d is not flushed over version %s",
                    held.version,
                    None if now is None else now["version"],
                )
                await self.storage.discard(generation)
                return False
            meta = generation.meta
            # own before it is set: a set that fails may have landed all the same
            self._own.append(_pointer_key(meta))
            await self.storage.set_current(meta)
            self._own_pointer(meta)
            if self._state is held:  # nothing newer: the state is the stored generation
                self._state = dataclasses.replace(held, generation=meta["generation"], meta=meta)
            covered = [v for v in self._log_chunks if v <= held.version]
            await asyncio.gather(
                self.storage.delete_replaced(base, meta), self._delete_logs(covered)
            )
            return True
