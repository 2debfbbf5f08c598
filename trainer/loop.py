"""`Trainer`: N trainer processes train one Keras model whose embeddings live in memcached.

Per step: the unique ids of each `DistributedEmbedding` are looked up (rows of
the next batch are prefetched while the current one computes, for layers that
name their `feature`), the forward and backward pass run in TensorFlow, and the
gradients w.r.t. the fetched rows and the dense weights are pushed to the
optimizer service. The cluster side (rows, pushes, answers, dense weights, the
modes) is `lookup_table.keras.session.TrainingSession`, which Keras' `model.fit` with
`lookup_table.keras.RemoteOptimizer` shares; see its docstring.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.keras import distributed_layers
from lookup_table.keras.rows import FedLayer
from lookup_table.keras.session import TrainingSession
from lookup_table.keras.steps import GraphStep, fed_train_step
from lookup_table.keras.tensors import aligned_empty, as_tensor, copied_tensor
from trainer.metrics import auc, logloss

__all__ = ["Trainer", "TrainResult"]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What `fit` did: per-step losses, periodic evaluations and a summary."""

    steps: int = 0
    examples: int = 0
    seconds: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the model version each step used
    interrupted: bool = False  # `should_stop` ended training before the data or `steps`

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.seconds if self.seconds else 0.0


def _split(batch: Any) -> tuple[Mapping[str, Any], NDArray[np.float32]]:
    if hasattr(batch, "features") and hasattr(batch, "labels"):
        return batch.features, np.asarray(batch.labels, np.float32)
    features, labels = batch
    return features, np.asarray(labels, np.float32)


def _stacked(columns: list[NDArray[Any]]) -> Any:
    """1-D columns of one dtype and length as the rows of one tensor (shared with
    TensorFlow, not copied again: `as_tensor`)."""
    out = aligned_empty((len(columns), columns[0].shape[0]), columns[0].dtype)
    np.stack(columns, out=out)
    return as_tensor(out)


def _as_tensor(value: Any) -> Any:
    """A batch column as what a Keras Input expects (strings and ragged included)."""
    if hasattr(value, "row_splits") and hasattr(value, "values"):
        values = value.values
        vals = (
            tf.constant(values.tolist(), dtype=tf.string)
            if values.dtype == object
            else tf.constant(values)
        )
        return tf.RaggedTensor.from_row_splits(vals, tf.constant(value.row_splits, tf.int64))
    arr = np.asarray(value)
    if arr.dtype == object:
        return tf.constant(arr.tolist(), dtype=tf.string)
    return tf.constant(arr)


class Trainer(TrainingSession):
    """Train a Keras model that uses `DistributedEmbedding` layers on a cluster.

    Args:
        config: the cluster file (memcached nodes, optimizer replicas, tables).
        model: a Keras model; every `DistributedEmbedding` in it must name a table
            of `config` with the same dim. Its other weights are the dense
            parameters, trained by the optimizer service.
        worker_index: this trainer's index (0..workers-1); sent with each push.
        loss: a Keras loss (default binary cross-entropy on a sigmoid output).
        dense_refresh_steps: pull the dense weights every K steps (default 1).
        max_pushes_in_flight: async mode: 0 (default) waits for each push before the
            next step reads; K >= 1 pipelines K pushes, the row prefetch and the dense
            pull (more examples/s, more staleness).
        read_your_writes: async mode with K = 0: each push answers with the rows and
            dense weights it produced, and the next batch's rows are fetched while the
            step computes (the answer replaces those of the push's own ids). One worker
            trains exactly as with a fresh read after every push, without waiting for
            it; with N workers a row may miss what other workers pushed during the step
            (as ElasticDL/Paddle async). False reads everything after each push.
        progress: show a tqdm progress bar.
        graph: run each step as one tf.function (the lookups run inside it as
            py_functions); False runs eagerly, for debugging.
    """

    def __init__(
        self,
        config: ClusterConfig,
        model: keras.Model,
        *,
        worker_index: int = 0,
        loss: keras.losses.Loss | None = None,
        dense_refresh_steps: int = 1,
        max_pushes_in_flight: int = 0,
        read_your_writes: bool = True,
        progress: bool = True,
        graph: bool = True,
    ) -> None:
        layers = distributed_layers(model)
        self.input_names = [t.name for t in model.inputs]
        super().__init__(
            config,
            layers,
            {v.path: v for v in model.trainable_variables},
            columns=[
                layer.feature if layer.feature in self.input_names else None for layer in layers
            ],
            worker_index=worker_index,
            dense_refresh_steps=dense_refresh_steps,
            max_pushes_in_flight=max_pushes_in_flight,
            read_your_writes=read_your_writes,
        )
        self.model = model
        self.loss_fn = loss or keras.losses.BinaryCrossentropy()
        self.progress = progress
        self.graph = graph
        self._graph_step: GraphStep | None = None
        self._graph_predict: Any = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            # a push still in flight failed too (often of the same fault): the error that
            # ended the block is the one the caller must see, not this one
            logger.warning("closing the trainer after %r failed as well", exc, exc_info=True)

    # ------------------------------------------------------------ training

    def _inputs(self, features: Mapping[str, Any]) -> dict[str, Any]:
        missing = [n for n in self.input_names if n not in features]
        if missing:
            raise ValueError(f"the batch lacks model inputs {missing}; it has {sorted(features)}")
        return {n: _as_tensor(features[n]) for n in self.input_names}

    def _packed(self, features: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """The model inputs as few tensors (each costs TF's conversion and call path):
        (columns one tensor each, ((names, their 1-D numeric columns of one dtype and
        length stacked), ...)); `_unpacked` makes them the inputs again in the graph."""
        missing = [n for n in self.input_names if n not in features]
        if missing:
            raise ValueError(f"the batch lacks model inputs {missing}; it has {sorted(features)}")
        singles: dict[str, Any] = {}
        stacks: dict[tuple[str, int], list[str]] = {}
        for name in self.input_names:
            value = features[name]
            if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iuf":
                stacks.setdefault((value.dtype.str, value.shape[0]), []).append(name)
            else:
                singles[name] = _as_tensor(value)
        packs = tuple(
            (tuple(names), _stacked([features[n] for n in names])) for names in stacks.values()
        )
        return singles, packs

    def _unpacked(self, data: Any) -> Any:
        """(In the graph.) The step's data with `_packed` inputs as the model's inputs."""
        (singles, packs), labels = data
        inputs = dict(singles)
        for names, stacked in packs:
            inputs.update(zip(names, tf.unstack(stacked, num=len(names)), strict=True))
        return {n: inputs[n] for n in self.input_names}, labels

    def _make_graph_step(self, fed: list[FedLayer]) -> Any:
        """The train step as one tf.function (`fed_train_step`): (inputs, labels) in,
        the loss out."""

        def forward(data: Any) -> tuple[Any, None]:
            inputs, labels = data
            preds = self.model(inputs, training=True)
            loss = self.loss_fn(tf.reshape(labels, (-1, 1)), tf.reshape(preds, (-1, 1)))
            return loss, None

        return fed_train_step(
            self.layers,
            fed,
            list(self.dense_vars.values()),
            inputs_of=lambda data: data[0],
            forward=forward,
            after=lambda data, loss, state: loss,
            unpack=self._unpacked,
        )

    def _make_graph_predict(self) -> Any:
        @tf.function(reduce_retracing=True)
        def predict(inputs: Any) -> Any:
            return self.model(inputs, training=False)

        return predict

    def train_step(self, features: Mapping[str, Any], labels: NDArray[np.float32]) -> float:
        """One step on one batch; returns its loss."""
        self.ensure_dense()
        if self.graph:
            if self._graph_step is None:
                candidates = [
                    FedLayer(layer=layer, key=key)
                    for layer, key in zip(self.layers, self.columns, strict=True)
                    if key is not None
                ]
                self._graph_step = GraphStep(self, candidates, self._make_graph_step)
            loss_t, records, row_grads, dense_grads = self._graph_step(
                (self._packed(features), copied_tensor(labels)), features
            )
            # the push waits for the step's gradients anyway: the loss costs no extra wait
            loss_value = float(loss_t)
            self.push_step(records, row_grads, dense_grads, examples=len(labels), loss=loss_value)
            return loss_value
        inputs = self._inputs(features)
        with tf.GradientTape() as tape:
            for layer in self.layers:
                layer.begin_step(tape)
            with self.lookups():
                preds = self.model(inputs, training=True)
            loss = self.loss_fn(
                tf.reshape(tf.constant(labels), (-1, 1)), tf.reshape(preds, (-1, 1))
            )
        records = [r for layer in self.layers for r in layer.records]
        dense_list = list(self.dense_vars.values())
        grads = tape.gradient(loss, [r.rows for r in records] + dense_list)
        grads = [
            tf.zeros_like(r.rows) if g is None else g
            for r, g in zip(records, grads[: len(records)], strict=True)
        ] + list(grads[len(records) :])
        for layer in self.layers:
            layer.begin_step(None)
        dense = {
            path: np.asarray(g, np.float32)
            for path, g in zip(self.dense_vars, grads[len(records) :], strict=True)
            if g is not None
        }
        loss_value = float(loss)
        self.push(records, grads[: len(records)], dense, examples=len(labels), loss=loss_value)
        return loss_value

    def fit(
        self,
        batches: Iterable[Any],
        *,
        steps: int | None = None,
        eval_batches: Iterable[Any] | None = None,
        eval_every: int | None = None,
        eval_max_batches: int = 20,
        final_eval: Iterable[Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> TrainResult:
        """Train on `batches` (Batch objects or (features, labels) pairs).

        Args:
            steps: stop after this many steps (default: when batches run out).
            eval_batches: evaluated every `eval_every` steps (first `eval_max_batches`)
                and at the end.
            final_eval: evaluated once at the end instead of `eval_batches`, streamed
                (not held in memory): a whole evaluation file. The final evaluation
                is marked `"final": 1.0` in `TrainResult.evals`.
            should_stop: asked before each step (e.g. a SIGINT handler's flag): when it
                returns True, training ends after the step under way, its pushes
                settle, `TrainResult.interrupted` is set and the final evaluation is
                skipped.
        """
        from tqdm import tqdm

        result = TrainResult()
        eval_list = list(eval_batches) if eval_batches is not None else None
        iterator: Iterator[Any] = iter(batches)
        current = next(iterator, None)
        if current is None:
            return result
        self.begin_training()
        self.prefetch_first(_split(current)[0])
        interactive = sys.stderr.isatty()
        bar = tqdm(
            total=steps,
            disable=not self.progress,
            unit="step",
            dynamic_ncols=interactive,
            mininterval=0.1 if interactive else 10.0,  # a log file gets a line every 10 s
        )
        start = time.perf_counter()
        try:
            while current is not None and (steps is None or result.steps < steps):
                if should_stop is not None and should_stop():
                    result.interrupted = True
                    break
                features, labels = _split(current)
                nxt = next(iterator, None) if steps is None or result.steps + 1 < steps else None
                computed_on = self.version  # an answered push brings the next one
                loss = self.step(
                    features,
                    None if nxt is None else _split(nxt)[0],
                    lambda: self.train_step(features, labels),  # noqa: B023 (called at once)
                )
                result.steps += 1
                result.examples += labels.shape[0]
                result.losses.append((result.steps, loss))
                result.versions.append(computed_on)
                elapsed = time.perf_counter() - start
                bar.update(1)
                bar.set_postfix(
                    loss=f"{loss:.4f}", ex_s=f"{result.examples / elapsed:,.0f}", v=self.version
                )
                if eval_list and eval_every and result.steps % eval_every == 0:
                    self.settle_pushes()
                    self.refresh_dense(fresh=True)
                    ev = self.evaluate(eval_list[:eval_max_batches])
                    ev["step"] = result.steps
                    result.evals.append(ev)
                    bar.write(
                        f"step {result.steps}: eval auc {ev['auc']:.4f} logloss {ev['logloss']:.4f}"
                    )
                current = nxt
            self.end_training()
            result.seconds = time.perf_counter() - start
        except BaseException as exc:
            self.settle_quietly(exc)
            raise
        finally:
            bar.close()
            self.forget_prefetched()  # rows fetched for this run only
        last = final_eval if final_eval is not None else eval_list
        if last and not result.interrupted:
            self.refresh_dense(fresh=True)
            ev = self.evaluate(last)
            ev["step"] = result.steps
            ev["final"] = 1.0
            result.evals.append(ev)
        return result

    def evaluate(self, batches: Iterable[Any]) -> dict[str, float]:
        """AUC and log loss on `batches`; reads rows with create=False (writes nothing)."""
        labels_all: list[NDArray[np.float32]] = []

        def features_of(batches: Iterable[Any]) -> Iterator[Mapping[str, Any]]:
            for batch in batches:
                features, labels = _split(batch)
                labels_all.append(labels)
                yield features

        p = self.predict(features_of(batches))
        if not labels_all:
            return {"auc": float("nan"), "logloss": float("nan"), "examples": 0.0}
        y = np.concatenate(labels_all)
        return {"auc": auc(y, p), "logloss": logloss(y, p), "examples": float(y.shape[0])}

    def predict(self, batches: Iterable[Mapping[str, Any]]) -> NDArray[np.float32]:
        """The model's outputs (float32 (examples,)) on batches of features, with the
        cluster's rows (create=False: writes nothing) and the dense weights it holds
        (pulled from the service on first use and before each evaluation of `fit`)."""
        self.settle_answered()
        self.ensure_dense()
        preds_all: list[NDArray[np.float32]] = []
        for features in batches:
            inputs = self._inputs(features)
            if self.graph:
                if self._graph_predict is None:
                    self._graph_predict = self._make_graph_predict()
                with self.lookups():
                    preds = self._graph_predict(inputs)
            else:
                with self.lookups():
                    preds = self.model(inputs, training=False)
            preds_all.append(np.asarray(preds, np.float32).reshape(-1))
        if not preds_all:
            return np.zeros(0, np.float32)
        return np.concatenate(preds_all)
