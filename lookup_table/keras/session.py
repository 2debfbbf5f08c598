"""`TrainingSession`: the cluster side of training a model with `DistributedEmbedding` layers.

`trainer.Trainer` and Keras' `model.fit` (`RemoteOptimizer`) compose its public step API:
an I/O thread with the store and the optimizer client, each step's rows (fed, fetched
ahead, patched from push answers), exactly-once pushes and their settling, the dense
weights. The modes and what each guarantees: docs/training.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import tensorflow as tf
from numpy.typing import NDArray

from lookup_table.client import OptimizerClient, PushReads, RowReader
from lookup_table.client.answers import UpdatedRows
from lookup_table.config import ClusterConfig
from lookup_table.core.keys import IdArray
from lookup_table.core.rowcache import RowCache
from lookup_table.errors import ConfigError
from lookup_table.keras.layer import DistributedEmbedding, RecordedLookup
from lookup_table.keras.rows import (
    BatchPart,
    BatchRows,
    FedIds,
    FedLayer,
    Known,
    PartialRows,
    Prefetched,
    RowPatch,
    column_of,
    fed_ids,
    fed_ids_many,
    lookup_batch,
    members,
    patched,
    whole_batch,
)
from lookup_table.store import EmbeddingStore

__all__ = ["TrainingSession", "check_layer"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TrainingSession:
    """The cluster side of training `layers` and `dense_vars` (see the module docstring).

    Args:
        config: the cluster file (memcached nodes, optimizer replicas, tables).
        layers: the model's `DistributedEmbedding` layers; each must name a table of
            `config` with the same dim. They are bound to this session (`rows`).
        dense_vars: the dense parameters by name (a variable's path): trained by the
            optimizer service, assigned from its answers.
        columns: per layer, the key of the batch column it is called on (a model
            input; `WHOLE` for a model's only input), or None: its rows are then looked
            up inside the graph.
        worker_index: this trainer's index (0..workers-1); sent with each push.
        dense_refresh_steps, max_pushes_in_flight, read_your_writes: see
            `trainer.Trainer`.
    """

    def __init__(
        self,
        config: ClusterConfig,
        layers: Sequence[DistributedEmbedding],
        dense_vars: Mapping[str, Any],
        *,
        columns: Sequence[Any] | None = None,
        worker_index: int = 0,
        dense_refresh_steps: int = 1,
        max_pushes_in_flight: int = 0,
        read_your_writes: bool = True,
    ) -> None:
        if dense_refresh_steps < 1:
            raise ConfigError(f"dense_refresh_steps must be >= 1, got {dense_refresh_steps}")
        if max_pushes_in_flight < 0:
            raise ConfigError(f"max_pushes_in_flight must be >= 0, got {max_pushes_in_flight}")
        self.config = config
        self.worker_index = worker_index
        self.dense_refresh_steps = dense_refresh_steps
        self.max_pushes_in_flight = max_pushes_in_flight
        self.read_your_writes = read_your_writes
        self.layers = list(layers)
        for layer in self.layers:
            check_layer(config, layer)
        for layer in self.layers:
            layer.bind(self)
        self.columns: list[Any] = list(columns) if columns is not None else [None] * len(layers)
        self._fed_layers: list[DistributedEmbedding] | None = None  # decided at the first trace
        self._position = {id(layer): i for i, layer in enumerate(self.layers)}
        self.dense_vars = dict(dense_vars)
        self.version = 0
        self.steps = 0  # training steps since `begin_training`
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lookup-table-io", daemon=True
        )
        self._thread.start()
        self._store = EmbeddingStore(config)
        self._client = OptimizerClient(config, worker=worker_index)
        self._reader = RowReader(self._store, self._client)
        self._pushes_created: collections.Counter[str] = collections.Counter()
        self._prefetched = Prefetched()
        self._pushes: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        self._dense_ready = False
        self._dense_future: concurrent.futures.Future[Any] | None = None
        self._assign_all: Callable[[list[NDArray[np.float32]]], None] | None = None
        self._closed = False
        self._lookup_error: Exception | None = None
        # read your writes: the rows of the last push's answer, and whether the dense
        # weights came with it (then no pull is needed before the next step); a push
        # answers before its writes land: `_unsettled` until it is confirmed
        self._updated: RowPatch = {}
        self._dense_fresh = False
        self._unsettled: concurrent.futures.Future[Any] | None = None
        # the next batch's reads through their owners, which this step's push takes along
        self._along: PushReads | None = None
        # answered rows: every answer's rows, taken for later batches while the replicas'
        # stamps show that no other push changed their rows (`_take_answer`)
        self._answered = RowCache(
            {
                t.name: (t.dim, 0)
                for t in config.tables
                # not rows read through their owner: those ride on the next push, from
                # the replica's own cache, so keeping them here would cost the trainer
                # more than the read it saves
                if t.plain_rows and not config.reads_through_owner(t.name)
            },
            config.store.trainer_cache_mb * 2**20 if self._read_your_writes else 0,
        )
        self._stamps: dict[int, tuple[str, int]] = {}
        self._answers_current = False
        self.rows_answered = 0  # rows a batch took from `_answered`, not from memcached

    # ------------------------------------------------------------ plumbing

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._submit(coro).result()

    def close(self) -> None:
        """Wait for outstanding pushes, close connections, stop the I/O thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._drain_pushes()
        finally:
            for layer in self.layers:
                if layer.source is self:
                    layer.bind(None)
            self._run(_cancel_pending())
            self._run(self._store.close())
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def _pipelined(self) -> bool:
        """Whether steps overlap pushes, prefetches and dense pulls (async mode, K >= 1)."""
        return self.config.mode == "async" and self.max_pushes_in_flight > 0

    @property
    def _read_your_writes(self) -> bool:
        """Whether pushes answer with the rows and dense weights they produced (async mode,
        K = 0): the next batch's rows are prefetched during a step, and the push's answer
        replaces those of its own ids and brings the dense weights, so one worker trains
        exactly as with fresh reads, without waiting for a read after its push."""
        return (
            self.read_your_writes and self.config.mode == "async" and self.max_pushes_in_flight == 0
        )

    @property
    def prefetches(self) -> bool:
        """Whether a step's next batch has its rows fetched while the step computes."""
        return self._pipelined or self._read_your_writes

    @property
    def _unsettled_rows(self) -> list[RowPatch]:
        """The answer of the push whose writes may not have landed yet, if any."""
        return [self._updated] if self._unsettled is not None else []

    @property
    def fed_layers(self) -> list[DistributedEmbedding]:
        """The layers whose rows the graph step gets as arguments (looked up outside it,
        prefetched): those called on exactly a model input they name. Known after the
        first graph step; the others look up inside the graph."""
        return list(self._fed_layers or [])

    @fed_layers.setter
    def fed_layers(self, layers: Sequence[DistributedEmbedding]) -> None:
        """(The graph step, at its first trace.) Which layers it feeds."""
        self._fed_layers = list(layers)

    @property
    def rows_created(self) -> dict[str, int]:
        out = dict(self._store.created)  # rows this trainer's lookups created with `add`
        # and its pushes (read as new): a copy, as the I/O thread counts finished pushes
        for table, n in dict(self._pushes_created).items():
            out[table] = out.get(table, 0) + n
        return out

    # ------------------------------------------------------------ RowSource

    def rows(self, table: str, ids: IdArray, *, training: bool) -> NDArray[np.float32]:
        """Rows for a layer's lookup: prefetched when possible, else fetched now."""
        try:
            if training:
                return self._training_rows(table, ids, self._prefetched.find(table, ids))
            return self._run(self._reader.lookup(table, ids, create=False))
        except Exception as exc:
            if self._lookup_error is None:  # the first failure is the one TF reports
                self._lookup_error = exc
            raise

    @contextlib.contextmanager
    def lookups(self) -> Iterator[None]:
        """Run the model so that a failed lookup raises its own error (DataLossError,
        StoreFullError, StoreTimeoutError, ...): inside a tf.function TF turns it into an
        UnknownError, and Keras (eager) into a copy without its `node`/`nodes`."""
        self._lookup_error = None
        try:
            yield
        except Exception as exc:
            error, self._lookup_error = self._lookup_error, None
            if error is None or error is exc:
                raise
            # as it was raised in the I/O thread, with its own cause (TF's copy adds nothing)
            raise error from error.__cause__
        self._lookup_error = None

    # ------------------------------------------------------------ rows of a step

    def _columns(self, features: Any) -> Iterator[tuple[int, Any]]:
        """(layer position, column value) of every layer whose column the batch has."""
        for i, key in enumerate(self.columns):
            if key is None:
                continue
            value = column_of(features, key)
            if value is not None:
                yield i, value

    def _prefetch(
        self,
        features: Any,
        *,
        answered: Mapping[str, IdArray] | None = None,
        create: bool = True,
        earlier: bool = False,
        along: PushReads | None = None,
    ) -> Prefetched:
        """Fetch the rows of a batch ahead. Ids in `answered` (table -> sorted unique ids
        that a push in flight will answer with) are not read: that answer, which
        `newer` gets, brings their rows. With `earlier`, neither are the ids whose rows
        earlier answers brought, while those are current (`_known_rows`). `along`: rows
        read through their owners go with the next push."""
        pre = Prefetched()
        columns = list(self._columns(features))
        if not columns:
            return pre
        feds = fed_ids_many([self.layers[i] for i, _ in columns], [v for _, v in columns])
        skips = members(
            [fed.uniq for fed in feds],
            [(answered or {}).get(self.layers[i].table) for i, _ in columns],
        )
        wanted: list[tuple[str, IdArray, NDArray[np.bool_] | None]] = []
        layers: list[tuple[int, FedIds, bool]] = []
        for (i, _), fed, skip in zip(columns, feds, skips, strict=True):
            wanted.append((self.layers[i].table, fed.uniq, skip))
            layers.append((i, fed, skip is None))
        known = self._known_rows(wanted) if earlier else None
        pre.from_answers = sum(int(k[1].shape[0]) for k in known or () if k is not None)
        batch = self._submit(lookup_batch(self._reader, wanted, known, create=create, along=along))
        for k, (i, fed, whole) in enumerate(layers):
            part = BatchPart(batch, k)
            if whole:
                pre.entries.setdefault(self.layers[i].table, []).append((fed.uniq, part))
            pre.fed[i] = (fed, part)
        return pre

    def _known_rows(
        self, wanted: Sequence[tuple[str, IdArray, NDArray[np.bool_] | None]]
    ) -> list[Known | None] | None:
        """Per (table, unique ids, skipped) of a batch, the ids not skipped whose rows
        earlier answers brought, and those rows; None when they may not be current."""
        if not self._answers_current:
            return None
        return self._answered.known_many(
            [(table, ids) for table, ids, _ in wanted],
            [None if skip is None else ~skip for _, _, skip in wanted],
        )

    def _take_answer(self, doc: Mapping[str, Any]) -> None:
        """Keep a push's answered rows. Earlier answers stay current while every replica
        stamped this answer as its next change after the last one it stamped for us:
        no other push (of another trainer, or a restore, a node's data lost: a new epoch)
        changed its rows in between. Otherwise they are dropped, and this answer's rows
        start again; they count as current from the next stamps that follow on."""
        stamps: Mapping[int, tuple[str, int]] = doc.get("stamps", {})
        self._answers_current = all(
            k in stamps
            and k in self._stamps
            and stamps[k] == (self._stamps[k][0], self._stamps[k][1] + 1)
            for k in range(len(self.config.optimizers))
        )
        self._stamps = dict(stamps)
        if not self._answers_current:
            self._answered.forget()
        updated = doc["updated"]
        put: set[str] = set()
        for block in updated.groups if isinstance(updated, UpdatedRows) else ():
            # as it came: no copy of each table's rows into one array again
            if self._answered.put_block(block.tables, block.bounds, block.ids, block.rows):
                put.update(block.tables)
        self._answered.put_many(
            [
                (table, ids, rows, rows[:, :0])
                for table, (ids, rows) in updated.items()
                if table not in put and self._answered.caches(table)
            ]
        )

    def _pushed_ids(self, features: Any) -> dict[str, IdArray]:
        """Per table, the ids this step's push will surely answer with: those of the fed
        layers (called on exactly their column, so these are the ids they look up)."""
        parts: dict[str, list[IdArray]] = {}
        for layer in self._fed_layers or []:
            i = self._position[id(layer)]
            ahead = self._prefetched.fed.get(i)
            uniq = (
                ahead[0].uniq
                if ahead
                else fed_ids(layer, column_of(features, self.columns[i])).uniq
            )
            parts.setdefault(layer.table, []).append(uniq)
        return {
            table: got[0] if len(got) == 1 else cast(IdArray, np.unique(np.concatenate(got)))
            for table, got in parts.items()
        }

    def _training_rows(
        self, table: str, ids: IdArray, ahead: BatchPart | None
    ) -> NDArray[np.float32]:
        """Rows of unique `ids` for a training step: fetched ahead (`ahead`), with the
        answers that came after the fetch was sent put in, or read now, with the answer
        of a push not written yet put in (it may be newer than the store)."""
        if ahead is not None:
            got = ahead.result()
            if isinstance(got, PartialRows):
                return got.complete(table, ids, self._prefetched.newer)
            return patched(table, ids, np.asarray(got, np.float32), self._prefetched.newer)
        rows = self._run(self._reader.lookup(table, ids, create=True))
        return patched(table, ids, rows, self._unsettled_rows)

    def fed_rows(self, fed: FedLayer, features: Any) -> tuple[FedIds, NDArray[np.float32]]:
        """A fed layer's ids and rows for this training batch (outside the graph: an
        error is raised as it is)."""
        ahead = self._prefetched.fed.get(self._position[id(fed.layer)])
        if ahead is not None:
            ids, part = ahead
            return ids, self._training_rows(fed.layer.table, ids.uniq, part)
        ids = fed_ids(fed.layer, column_of(features, fed.key))
        return ids, self._training_rows(fed.layer.table, ids.uniq, None)

    def fed_parts(
        self, fed: Sequence[FedLayer], features: Any
    ) -> tuple[
        list[FedIds],
        list[NDArray[np.float32]] | BatchRows,
        list[NDArray[np.bool_] | None],
        list[RowPatch],
    ]:
        """The fed layers' ids, rows (the batch lookup as it came, when its entries are
        these layers) and rows skipped (left to a push's answer) for this training
        batch, and the answers to put into the rows (`FedBatch` does, for every layer at
        once): those that came after the rows were fetched ahead; rows read now come
        with them put in."""
        ahead = [self._prefetched.fed.get(self._position[id(f.layer)]) for f in fed]
        known = [a for a in ahead if a is not None]
        if len(known) < len(fed):
            got = [self.fed_rows(f, features) for f in fed]
            return [i for i, _ in got], [r for _, r in got], [None] * len(fed), []
        ids = [i for i, _ in known]
        patches = list(self._prefetched.newer)
        block = whole_batch([part for _, part in known])
        if block is not None:
            return ids, block, list(block.skipped), patches
        values = [part.result() for _, part in known]
        return (
            ids,
            [v.rows if isinstance(v, PartialRows) else v for v in values],
            [v.skipped if isinstance(v, PartialRows) else None for v in values],
            patches,
        )

    def evaluation_rows(
        self, fed: Sequence[FedLayer], features: Any
    ) -> tuple[list[FedIds], BatchRows]:
        """The fed layers' ids and rows of an evaluation batch: one `lookup_many` with
        `create=False` (writes nothing; unseen ids get their would-be initial rows)."""
        ids = fed_ids_many([f.layer for f in fed], [column_of(features, f.key) for f in fed])
        rows = self._run(
            lookup_batch(
                self._reader,
                [(f.layer.table, i.uniq, None) for f, i in zip(fed, ids, strict=True)],
                create=False,
            )
        )
        return ids, rows

    # ------------------------------------------------------------ a training step

    def begin_training(self) -> None:
        """Before a run of steps: the dense weights from the service (initialized by the
        first trainer), nothing fetched ahead yet."""
        self.ensure_dense()
        self._prefetched = Prefetched()
        self.steps = 0

    def end_training(self) -> None:
        """After a run of steps: every push written; rows fetched ahead dropped."""
        try:
            self._drain_pushes()
        finally:
            self.forget_prefetched()

    def forget_prefetched(self) -> None:
        """Drop the rows fetched ahead (they were for this run of steps only)."""
        self._prefetched = Prefetched()

    def prefetch_first(self, features: Any) -> None:
        """Fetch the first batch's rows ahead (when steps may overlap with I/O)."""
        if self.prefetches:
            self._prefetched = self._prefetch(features)

    def step(self, features: Any, upcoming: Any | None, compute: Callable[[], T]) -> T:
        """One training step's I/O around `compute` (which runs the graph step on the
        batch of `features` and pushes): the dense refresh it needs first, the rows of
        the `upcoming` batch (None: no more) fetched while it computes, skipping the ids
        its push answers with, and those fetched rows handed to the next step."""
        if self.steps % self.dense_refresh_steps == 0 and self.steps > 0:
            if not self._dense_fresh:
                self.refresh_dense()
        self._dense_fresh = False
        ahead = None
        if self._read_your_writes and upcoming is not None:
            # the answer of the last push (if not written yet) and of this step's push
            # patch it; rows of earlier answers are not read while they are current;
            # those read through their owners come with this step's push's answer,
            # the rest (from memcached) are read while it computes
            pushed = self._pushed_ids(features)
            self._along = PushReads()
            ahead = self._prefetch(upcoming, answered=pushed, earlier=True, along=self._along)
            ahead.newer = list(self._unsettled_rows)
        try:
            out = compute()
        finally:
            if self._along is not None:  # no push took them: they are read alone
                self._loop.call_soon_threadsafe(self._along.close)
                self._along = None
        if ahead is not None:
            if ahead.from_answers and not self._answers_current:
                # this step's push showed another push since our last one: the rows taken
                # from earlier answers may be older than the store's; read them after all
                ahead = self._prefetch(upcoming, answered=pushed)
            self.rows_answered += ahead.from_answers
            ahead.newer.append(self._updated)
            self._prefetched = ahead
        elif self._pipelined and upcoming is not None:
            self._prefetched = self._prefetch(upcoming)
        else:  # nothing fetched ahead: a later step must not find this step's rows
            self._prefetched = Prefetched()
        self.steps += 1
        return out

    # ------------------------------------------------------------ dense weights

    @property
    def dense_ready(self) -> bool:
        """Whether the dense weights came from the service (`ensure_dense`) yet."""
        return self._dense_ready

    def ensure_dense(self) -> None:
        """The dense weights from the service, once per session: `/v1/dense/init` with
        this model's weights (the first trainer's win), then assigned to `dense_vars`."""
        if not self._dense_ready:
            self._init_dense()

    def _init_dense(self) -> None:
        params = {path: np.asarray(v.numpy(), np.float32) for path, v in self.dense_vars.items()}
        version, winner = self._run(self._client.dense_init(params))
        if version > 0:  # other workers of this run may have pushed already: info for them
            logger.log(
                logging.WARNING if self.worker_index == 0 else logging.INFO,
                "continuing namespace %s at version %d (its model was trained before; "
                "`lookup-table-admin reset --config FILE --yes` starts it over)",
                self.config.namespace,
                version,
            )
        self._assign_dense(version, winner)
        self._dense_ready = True

    def _assign_dense(self, version: int, params: Mapping[str, NDArray[np.float32]]) -> None:
        missing = sorted(set(self.dense_vars) - set(params))
        start_over = (
            "if it is another model, use another namespace, or start this one over with "
            "`lookup-table-admin reset --config FILE --yes`"
        )
        if missing:
            unexpected = sorted(set(params) - set(self.dense_vars))
            theirs = (
                f", and its {unexpected[:5]} ({len(unexpected)}) are not this model's"
                if unexpected
                else ""
            )
            raise ConfigError(
                f"the dense parameters of namespace {self.config.namespace!r} were "
                f"initialized by a model with other layer names: this model's {missing[:5]} "
                f"({len(missing)} in all) are not among them{theirs}. Keras numbers layers "
                f"per process (dense, dense_1, dense_2, ...): a model built again in one "
                f"process (a notebook) gets new names; call keras.backend.clear_session() before "
                f"building it, or name its layers (name=...); {start_over}"
            )
        for path, var in self.dense_vars.items():
            value = params[path]
            if tuple(value.shape) != tuple(var.shape):
                raise ConfigError(
                    f"dense parameter {path}: namespace {self.config.namespace!r} holds shape "
                    f"{tuple(value.shape)}, this model {tuple(var.shape)}: its dense "
                    f"parameters were initialized by a model of other layer shapes (other "
                    f"units, inputs, or a table's dim); {start_over}"
                )
        if self._assign_all is None:
            self._assign_all = _assigner(list(self.dense_vars.values()))
        self._assign_all([params[path] for path in self.dense_vars])
        self.version = version

    def refresh_dense(self, *, fresh: bool = False) -> None:
        """Pull the dense weights. Pipelined, the fetch overlaps a step: it assigns the
        weights fetched during the previous step and starts the next fetch (one step of
        extra staleness); otherwise, and with `fresh`, it waits for them."""
        self.settle_answered()  # an answered push's weights may not be written yet
        if fresh or not self._pipelined:
            self._dense_future = None
            version, params = self._run(self._client.dense())
            self._assign_dense(version, params)
            return
        if self._dense_future is not None:
            version, params = self._dense_future.result()
            self._assign_dense(version, params)
        self._dense_future = self._submit(self._client.dense())

    # ------------------------------------------------------------ pushes

    def settle_pushes(self) -> None:
        """Wait until every push of this session is written (raising the first failure):
        what a snapshot of the model it trains (an export, a checkpoint) must include."""
        if not self._closed:
            self._drain_pushes()

    def _drain_pushes(self) -> None:
        self.settle_answered()
        while self._pushes:
            self._pushes.popleft().result()

    def settle_quietly(self, error: BaseException) -> None:
        """After `error` ended training: wait for the answered push's writes, logging (not
        raising) their failure, often of the same fault, so that `error` is what the
        caller sees and a later `close()` has nothing left to raise."""
        try:
            self.settle_answered()
        except Exception:
            logger.warning("the last push failed as well after %r", error, exc_info=True)

    def settle_answered(self) -> None:
        """Wait until the answered push is written (raising its error if it failed)."""
        if self._unsettled is not None:
            pending, self._unsettled = self._unsettled, None
            try:
                pending.result()
            except BaseException:
                # its answer came before its writes, which failed: keep none of what the
                # answers brought, and let no later stamp follow on from its stamp
                self._answered.forget()
                self._stamps = {}
                self._answers_current = False
                raise

    def push(
        self,
        records: list[Any],
        grads: list[Any],
        dense: dict[str, Any],
        *,
        examples: int | None = None,
        loss: float | None = None,
    ) -> None:
        """Push the row gradients of `records` (one per record) and the `dense` gradients
        by path (those of `dense_vars` a step computed), as `push_step` does."""
        tables: dict[str, tuple[list[IdArray], list[NDArray[np.float32]]]] = {}
        for rec, grad in zip(records, grads, strict=True):
            g = (
                grad
                if isinstance(grad, np.ndarray)
                else np.asarray(tf.convert_to_tensor(grad), np.float32)  # IndexedSlices too
            )
            ids_list, grads_list = tables.setdefault(rec.table, ([], []))
            ids_list.append(rec.ids)
            grads_list.append(g)
        payload = {
            name: (
                np.concatenate(i) if len(i) > 1 else i[0],
                np.concatenate(g) if len(g) > 1 else g[0],
            )
            for name, (i, g) in tables.items()
        }
        while self._pushes and len(self._pushes) >= self.max_pushes_in_flight:
            self._pushes.popleft().result()
        stats: dict[str, Any] = {"examples": examples, "loss": loss}
        if self._read_your_writes:
            self._push_answered(payload, dense, stats)
            return
        fut = self._submit(self._client.push(payload, dense=dense, version=self.version, **stats))
        fut.add_done_callback(self._count_created)
        self._pushes.append(fut)
        if not self._pipelined:
            self._drain_pushes()

    def _push_answered(
        self, payload: Mapping[str, Any], dense: Mapping[str, Any], stats: Mapping[str, Any]
    ) -> None:
        """Push and take the rows and dense weights from the answer, which the replicas
        send before writing; the writes finish while the next step computes (`settle_answered`
        waits for them before the next push, at an evaluation and at the end)."""
        self._answers_current = False  # until this push's answer says otherwise
        self.settle_answered()
        answer = ("rows", "dense") if self.dense_refresh_steps == 1 else ("rows",)
        answered: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        along, self._along = self._along, None
        version = self.version

        def on_answer(doc: dict[str, Any]) -> None:
            if not answered.done():
                answered.set_result(doc)

        async def push() -> dict[str, Any]:
            reads = along.take() if along is not None else None
            try:
                return await self._client.push(
                    payload,
                    dense=dense,
                    version=version,
                    answer=answer,
                    reads=reads,
                    on_answer=on_answer,
                    on_read=along.answered if along is not None else None,
                    **stats,
                )
            except Exception as exc:
                if along is not None:  # the next batch's rows fail with it
                    along.failed(exc)
                raise

        pushing = self._submit(push())
        pushing.add_done_callback(self._count_created)
        concurrent.futures.wait([answered, pushing], return_when=concurrent.futures.FIRST_COMPLETED)
        doc = answered.result() if answered.done() else pushing.result()
        self._unsettled = pushing
        self._updated = doc["updated"]
        self._take_answer(doc)
        if "params" in doc:
            self._assign_dense(doc["dense_version"], doc["params"])
            self._dense_fresh = True

    def _count_created(self, pushed: concurrent.futures.Future[dict[str, Any]]) -> None:
        """A push's rows created by its replicas (ids read as new through their owner)."""
        if not pushed.cancelled() and pushed.exception() is None:
            self._pushes_created.update(pushed.result().get("created", {}))

    def push_step(
        self,
        records: list[RecordedLookup],
        row_grads: list[NDArray[np.float32]],
        dense_grads: Sequence[Any],
        *,
        examples: int | None = None,
        loss: float | None = None,
    ) -> None:
        """Push one step's gradients: rows per record, dense per `dense_vars` (in order).

        `examples` (the batch size) and `loss` (a Python or numpy number: converting a
        tensor would wait for the device) go to the service's /metrics."""
        dense = {
            path: np.asarray(g, np.float32)
            for path, g in zip(self.dense_vars, dense_grads, strict=True)
        }
        self.push(records, row_grads, dense, examples=examples, loss=loss)


def check_layer(config: ClusterConfig, layer: DistributedEmbedding) -> None:
    """Raise ConfigError unless the cluster file has the layer's table with its dim."""
    try:
        spec = config.table(layer.table)
    except ConfigError as exc:
        raise ConfigError(
            f"layer {layer.name!r} embeds table {layer.table!r}, which the cluster file "
            f"(namespace {config.namespace!r}) does not define: {exc}; add a [[tables]] "
            f'entry name = "{layer.table}", dim = {layer.dim} or fix the layer\'s table'
        ) from None
    if spec.dim != layer.dim:
        raise ConfigError(
            f"layer {layer.name!r} expects dim={layer.dim} but table {layer.table!r} has "
            f"dim={spec.dim} in the cluster file"
        )


def _assigner(variables: Sequence[Any]) -> Callable[[list[NDArray[np.float32]]], None]:
    """Assign a list of float32 arrays to `variables` (in order): one raw assign op per
    variable on its handle (Keras' `assign` converts and checks each value in Python; a
    tf.function casts its inputs to its signature in Python too)."""
    if not all(tf.as_dtype(v.dtype) == tf.float32 for v in variables):

        def assign_each(values: list[NDArray[np.float32]]) -> None:
            for var, value in zip(variables, values, strict=True):
                var.assign(value)  # converted to the variable's dtype

        return assign_each
    handles = [v.handle for v in variables]

    def assign_all(values: list[NDArray[np.float32]]) -> None:
        for handle, value in zip(handles, values, strict=True):
            tf.raw_ops.AssignVariableOp(resource=handle, value=value)

    return assign_all


async def _cancel_pending() -> None:
    """Cancel and wait for every other task of the I/O loop (a push's retry still
    connecting after the failure that closes the session): a task left pending when the
    loop stops would leak its socket."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
