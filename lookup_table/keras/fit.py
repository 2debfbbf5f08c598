"""`RemoteOptimizer`: Keras' own `model.fit`, `evaluate` and `predict` on a cluster.

Compile a model with `DistributedEmbedding` layers with it and use Keras' loops as usual;
the facade's hooks make `make_{train,test,predict}_function` return this module's
functions, which run each step on a `TrainingSession` (docs/training.md, "How a step runs").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from lookup_table.config import ClusterConfig, parse_config
from lookup_table.errors import (
    ConfigError,
    NodeUnavailableError,
    PushRejectedError,
    ReplicaUnavailableError,
)
from lookup_table.keras.layer import DistributedEmbedding, distributed_layers
from lookup_table.keras.rows import WHOLE, FedLayer
from lookup_table.keras.session import TrainingSession
from lookup_table.keras.steps import GraphStep, fed_train_step, feed_layers

__all__ = ["RemoteOptimizer", "model_function"]

logger = logging.getLogger(__name__)

# Keras' Optimizer arguments that would transform gradients locally: the service applies
# the optimizer, so they are refused rather than silently ignored.
_LOCAL_ONLY = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


@keras.saving.register_keras_serializable(package="lookup_table")
class RemoteOptimizer(keras.optimizers.Optimizer):
    """The optimizer of a Keras model whose `DistributedEmbedding` rows live in a cluster.

    It applies nothing itself: the cluster's optimizer service applies the optimizer
    of the cluster file (`[optimizer]` and each table's) to the rows and the dense
    weights. Compiling with it makes `model.fit`, `evaluate` and `predict` run
    against the cluster (see the module docstring).

    Args:
        config: the cluster file (`lookup_table.load_config`).
        worker_index: this worker's index (0..num_workers-1), sent with each push.
            Each worker fits its own share of the data (`dataset.shard(num_workers,
            worker_index)` or `x[worker_index::num_workers]`).
        num_workers: how many workers train the model; in sync mode it must equal the
            cluster file's `workers` (the service waits for that many pushes a step).
        dense_refresh_steps, max_pushes_in_flight, read_your_writes: as
            `trainer.Trainer`'s (defaults: the push answers with its rows and dense
            weights; one worker trains exactly as with fresh reads).

    Raises:
        ConfigError: a bad argument, or a local-only Keras optimizer argument.
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        worker_index: int = 0,
        num_workers: int | None = None,
        dense_refresh_steps: int = 1,
        max_pushes_in_flight: int = 0,
        read_your_writes: bool = True,
        name: str = "remote_optimizer",
        **kwargs: Any,
    ) -> None:
        if not isinstance(config, ClusterConfig):
            raise ConfigError(
                f"RemoteOptimizer needs the cluster file's ClusterConfig "
                f"(lookup_table.load_config(path)). Received: {config!r}"
            )
        local = sorted(k for k in _LOCAL_ONLY if kwargs.get(k) not in (None, False))
        if local:
            raise ConfigError(
                f"RemoteOptimizer got {', '.join(local)}: the optimizer service applies the "
                f"optimizer, so gradients are not transformed here; set the optimizer in the "
                f"cluster file ([optimizer] or a table's) instead"
            )
        workers = num_workers if num_workers is not None else config.workers
        if num_workers is not None and num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1. Received: num_workers={num_workers}")
        if not 0 <= worker_index < max(workers, 1):
            raise ConfigError(
                f"worker_index must be in 0..{workers - 1} (num_workers={workers}). "
                f"Received: worker_index={worker_index}"
            )
        if config.mode == "sync" and num_workers is not None and num_workers != config.workers:
            raise ConfigError(
                f"num_workers={num_workers} but the cluster file says workers = {config.workers} "
                f"in sync mode, where the service waits for that many pushes per step; make "
                f"them equal"
            )
        if dense_refresh_steps < 1:
            raise ConfigError(f"dense_refresh_steps must be >= 1, got {dense_refresh_steps}")
        if max_pushes_in_flight < 0:
            raise ConfigError(f"max_pushes_in_flight must be >= 0, got {max_pushes_in_flight}")
        kwargs.setdefault("learning_rate", float(getattr(config.optimizer, "learning_rate", 0.0)))
        for key in _LOCAL_ONLY + ("ema_momentum", "ema_overwrite_frequency"):
            kwargs.pop(key, None)
        super().__init__(name=name, **kwargs)
        self.config = config
        self.worker_index = worker_index
        self.num_workers = workers
        self.dense_refresh_steps = dense_refresh_steps
        self.max_pushes_in_flight = max_pushes_in_flight
        self.read_your_writes = read_your_writes
        self._runner: _ModelRunner | None = None

    # ------------------------------------------------------------ Keras' Optimizer

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        raise RuntimeError(
            "RemoteOptimizer applies nothing itself: the optimizer service does. Train with "
            "model.fit / train_on_batch (a custom train_step cannot use it)"
        )

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        self.update_step(None, None, None)

    def finalize_variable_values(self, var_list: Any) -> None:
        """The end of `model.fit`: every push written, rows fetched ahead dropped."""
        if self._runner is not None:
            self._runner.end_fit()

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        for key in _LOCAL_ONLY + ("ema_momentum", "ema_overwrite_frequency"):
            config.pop(key, None)
        cluster = self.config.to_dict()
        cluster.pop("token")  # never in a saved model: LOOKUP_TABLE_TOKEN gives it back
        config.update(
            config=cluster,
            worker_index=self.worker_index,
            num_workers=self.num_workers,
            dense_refresh_steps=self.dense_refresh_steps,
            max_pushes_in_flight=self.max_pushes_in_flight,
            read_your_writes=self.read_your_writes,
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> RemoteOptimizer:
        config = dict(config)
        cluster = config.pop("config")
        return cls(parse_config(cluster) if isinstance(cluster, dict) else cluster, **config)

    # ------------------------------------------------------------ the cluster

    @property
    def session(self) -> TrainingSession | None:
        """The cluster side of training (after the first fit, evaluate or predict)."""
        return None if self._runner is None else self._runner.session

    def close(self) -> None:
        """Wait for pushes in flight, close the connections, stop the I/O thread."""
        if self._runner is not None:
            self._runner.session.close()

    def _attach(self, model: keras.Model) -> _ModelRunner:
        runner = self._runner
        if runner is not None and not runner.session.closed:
            if runner.model is not model:
                raise ConfigError(
                    f"this RemoteOptimizer already trains model {runner.model.name!r}; compile "
                    f"{model.name!r} with a RemoteOptimizer of its own"
                )
            return runner
        self._runner = _ModelRunner(self, model)
        return self._runner


def _train_loss(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """The loss of Keras' own train step: `compute_loss` (without `training` for an
    override written before Keras 3.3 added it), counted in the model's `loss` metric."""
    if "training" in inspect.signature(model.compute_loss).parameters:
        loss = model.compute_loss(x, y, y_pred, sample_weight, training=True)
    else:
        loss = model.compute_loss(x, y, y_pred, sample_weight)
    first = next(i for i in tf.nest.flatten(x, expand_composites=True) if i is not None)
    # Keras' private loss tracker: the `loss` metric reads it, and no public API feeds it
    model._loss_tracker.update_state(loss, sample_weight=tf.shape(first)[0])
    return loss


def _columns(model: keras.Model, layers: Sequence[DistributedEmbedding]) -> list[Any]:
    """Per layer, the model input it is called on directly (the key of the model's
    input dict, or `WHOLE` for its only input), or None (then it looks up inside the
    graph)."""
    # Keras' private structure of the inputs and a layer's calls: no public API tells
    # the key of a dict input, or whether a layer was called once and on what
    struct = getattr(model, "_inputs_struct", None)
    inputs = list(getattr(model, "inputs", None) or [])
    if isinstance(struct, dict):
        named: dict[int, Any] = {id(t): k for k, t in struct.items()}
    elif len(inputs) == 1:
        named = {id(inputs[0]): WHOLE}
    else:
        named = {}
    out: list[Any] = []
    for layer in layers:
        if isinstance(struct, dict) and layer.feature in struct:
            out.append(layer.feature)
            continue
        nodes = list(getattr(layer, "_inbound_nodes", []))
        tensors = list(nodes[0].input_tensors) if len(nodes) == 1 else []
        out.append(named.get(id(tensors[0])) if len(tensors) == 1 else None)
    return out


def _pull(iterator: Any) -> Any | None:
    """The next element of a Keras data iterator, None at its end."""
    try:
        return next(iterator)
    except (StopIteration, tf.errors.OutOfRangeError):
        return None


def _inputs(data: Any) -> Any:
    return keras.utils.unpack_x_y_sample_weight(data)[0]


def _batch_size(data: Any) -> int | None:
    """A batch's examples (its first input's first dimension), None if not known."""
    leaves = tf.nest.flatten(_inputs(data))
    shape: Any = getattr(leaves[0], "shape", ()) if leaves else ()
    size = shape[0] if len(shape) else None
    return size if isinstance(size, int) else None


class _ModelRunner:
    """One model on one cluster: the train, test and predict functions Keras calls."""

    def __init__(self, optimizer: RemoteOptimizer, model: keras.Model) -> None:
        self.optimizer = optimizer
        self.model = model
        layers = distributed_layers(model)
        columns = _columns(model, layers)
        self.session = TrainingSession(
            optimizer.config,
            layers,
            {v.path: v for v in model.trainable_variables},
            columns=columns,
            worker_index=optimizer.worker_index,
            dense_refresh_steps=optimizer.dense_refresh_steps,
            max_pushes_in_flight=optimizer.max_pushes_in_flight,
            read_your_writes=optimizer.read_your_writes,
        )
        # connections and the I/O thread end with the optimizer, or at exit
        weakref.finalize(optimizer, self.session.close)
        self.candidates = [
            FedLayer(layer=layer, key=key)
            for layer, key in zip(layers, columns, strict=True)
            if key is not None
        ]
        self._train: GraphStep | None = None
        self._test: GraphStep | None = None
        self._predict: GraphStep | None = None
        self._pending: tuple[Any, Any] | None = None  # (iterator, its next element)

    # ------------------------------------------------------------ per call

    def begin(self, kind: str) -> Callable[[Any], Any]:
        """Start a fit, evaluate or predict call; returns the function Keras calls."""
        model, session = self.model, self.session
        if kind == "train":
            if model.train_function is None:  # compiled again: new loss and metrics
                self._train = None
            fresh = session.dense_ready
            with _reaching(session, "model.fit"):
                session.begin_training()
                if fresh:  # other workers may have trained since our last fit
                    session.refresh_dense(fresh=True)
            self._pending = None
            model.train_function = self.train_function
            return self.train_function
        session.settle_pushes()
        what = "model.evaluate" if kind == "test" else "model.predict"
        with _reaching(session, what):
            try:
                session.refresh_dense(fresh=True)
            except PushRejectedError as exc:
                if exc.status != 404:
                    raise
                raise PushRejectedError(
                    f"{what} before any training: the optimizer service has no dense "
                    f"parameters in namespace {session.config.namespace!r} yet (model.fit "
                    f"initializes them with POST /v1/dense/init); train the model first, or "
                    f"restore a checkpoint ({exc})",
                    status=404,
                ) from None
        if kind == "test":
            if model.test_function is None:
                self._test = None
            model.test_function = self.test_function
            return self.test_function
        if model.predict_function is None:
            self._predict = None
        model.predict_function = self.predict_function
        return self.predict_function

    def end_fit(self) -> None:
        """Every push written, then the service's dense weights (the model holds the
        trained weights after fit, for `save` and `get_weights`; in sync mode and with
        pushes in flight the last answers did not bring them)."""
        self._pending = None
        self.session.end_training()
        self.session.refresh_dense(fresh=True)

    # ------------------------------------------------------------ training

    def _make_train(self, fed: list[FedLayer]) -> Any:
        model, optimizer = self.model, self.optimizer

        def forward(data: Any) -> tuple[Any, Any]:
            # Keras' TensorFlowTrainer.train_step, but differentiated by `fed_train_step`
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            y_pred = model(x, training=True)
            loss = _train_loss(model, x, y, y_pred, sample_weight)
            return loss, (x, y, y_pred, sample_weight)

        def after(data: Any, loss: Any, state: Any) -> Any:
            x, y, y_pred, sample_weight = state
            optimizer.iterations.assign_add(1)  # Keras' step count (TensorBoard, schedules)
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

        return fed_train_step(
            self.session.layers,
            fed,
            list(self.session.dense_vars.values()),
            inputs_of=_inputs,
            forward=forward,
            after=after,
        )

    def train_function(self, iterator: Any) -> Any:
        """Keras' `train_function`: `steps_per_execution` steps from `iterator`."""
        logs = None
        for _ in range(max(int(self.model.steps_per_execution), 1)):
            data = self._next(iterator)
            if data is None:
                if logs is None:
                    raise StopIteration
                break
            logs = self._train_on(data, iterator)
        return logs

    def _next(self, iterator: Any) -> Any | None:
        """The element after the last step's: taken ahead with its rows, or pulled now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending[0] is iterator:
                return pending[1]
            # a new epoch's iterator: the rows fetched for that element are not this one's
            self.session.forget_prefetched()
        return _pull(iterator)

    def _train_on(self, data: Any, iterator: Any) -> Any:
        session = self.session
        upcoming = _pull(iterator) if session.prefetches else None
        if upcoming is not None:
            self._pending = (iterator, upcoming)
        if self._train is None:
            self._train = GraphStep(session, self.candidates, self._make_train)
        train = self._train

        def compute() -> Any:
            logs, records, row_grads, dense_grads = train(data, _inputs(data))
            # the loss stays a tensor: reading it would wait for the device every step
            session.push_step(records, row_grads, dense_grads, examples=_batch_size(data))
            return logs

        try:
            return session.step(
                _inputs(data), None if upcoming is None else _inputs(upcoming), compute
            )
        except BaseException as exc:
            self._pending = None
            session.forget_prefetched()
            session.settle_quietly(exc)
            raise

    # ------------------------------------------------------------ evaluation

    def _make_eval(self, step: Callable[[Any], Any]) -> Callable[[list[FedLayer]], Any]:
        layers = self.session.layers

        def make(fed: list[FedLayer]) -> Any:
            @tf.function(reduce_retracing=True)
            def run(data: Any, tables: Any, index: Any, bounds: Any) -> Any:
                feed_layers(fed, _inputs(data), tables, index, bounds)
                out = step(data)
                for layer in layers:
                    layer.end_step()
                return out

            return run

        return make

    def _evaluate_on(self, which: str, data: Any) -> Any:
        if which == "test":
            if self._test is None:
                self._test = GraphStep(
                    self.session,
                    self.candidates,
                    self._make_eval(self.model.test_step),
                    training=False,
                )
            step = self._test
        else:
            if self._predict is None:
                self._predict = GraphStep(
                    self.session,
                    self.candidates,
                    self._make_eval(self.model.predict_step),
                    training=False,
                )
            step = self._predict
        return step.run(data, _inputs(data))[0]

    def test_function(self, iterator: Any) -> Any:
        """Keras' `test_function`: `steps_per_execution` batches from `iterator`."""
        logs = None
        for _ in range(max(int(self.model.steps_per_execution), 1)):
            data = _pull(iterator)
            if data is None:
                if logs is None:
                    raise StopIteration
                break
            logs = self._evaluate_on("test", data)
        return logs

    def predict_function(self, batches: Sequence[Any]) -> Any:
        """Keras' `predict_function`: the outputs of a list of batches, concatenated."""
        outs = [self._evaluate_on("predict", data) for data in batches]
        if len(outs) == 1:
            return outs[0]
        return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *outs)


@contextlib.contextmanager
def _reaching(session: TrainingSession, what: str) -> Any:
    """Name the call and the cluster file when the cluster cannot be reached at all."""
    try:
        yield
    except ReplicaUnavailableError as exc:
        raise ReplicaUnavailableError(
            f"{what} could not reach the optimizer service of namespace "
            f"{session.config.namespace!r} ({', '.join(session.config.optimizers)}): {exc}. "
            f"Is the cluster up? deploy/cluster.sh up --config <your cluster file>"
        ) from exc
    except NodeUnavailableError as exc:  # its own type: a StoreTimeoutError stays one
        raise type(exc)(
            f"{what} could not reach memcached node {exc.node or ''} of namespace "
            f"{session.config.namespace!r}: {exc}. Is the cluster up? deploy/cluster.sh up "
            f"--config <your cluster file>",
            node=exc.node,
        ) from exc


def model_function(model: keras.Model, kind: str, *, force: bool = False) -> Any:
    """(`keras.Model.make_{kind}_function` of a model with `DistributedEmbedding`
    layers.) The function Keras' loop calls, after checking the model is compiled
    with a `RemoteOptimizer`."""
    layers = distributed_layers(model)
    optimizer = getattr(model, "optimizer", None)
    what = {"train": "model.fit", "test": "model.evaluate", "predict": "model.predict"}[kind]
    tables = ", ".join(repr(layer.table) for layer in layers)
    if not isinstance(optimizer, RemoteOptimizer):
        got = (
            "was not compiled"
            if optimizer is None
            else f"was compiled with optimizer {type(optimizer).__name__}"
        )
        raise ConfigError(
            f"{what}: model {model.name!r} has DistributedEmbedding layers (tables {tables}) "
            f"and {got}: their rows and the dense weights live in a cluster, whose optimizer "
            f"service trains them; compile it with optimizer=lookup_table.keras."
            f"RemoteOptimizer(config) (the cluster file sets the optimizer)"
        )
    if model.run_eagerly:
        raise ConfigError(
            f"{what}: RemoteOptimizer runs each step as a tf.function; compile with "
            f"run_eagerly=False (the default)"
        )
    if kind == "train" and type(model).train_step is not keras.Model.train_step:
        raise ConfigError(
            f"{what}: {type(model).__name__} overrides train_step; RemoteOptimizer trains with "
            f"Keras' own step (forward, compute_loss, metrics) and pushes its gradients, so a "
            f"custom train_step cannot run; use trainer.Trainer or the default train_step"
        )
    return optimizer._attach(model).begin(kind)
