"""The Keras side of the cluster: the names a Keras user imports, in one place.

Importing it also wraps `keras.Model`'s methods, for models with `DistributedEmbedding`
layers only: `fit`, `evaluate` and `predict` run against the cluster, numpy string ids are
passed as object arrays, `model.export` exports with `export_saved_model`, and `fit`
refuses `EarlyStopping(restore_best_weights=True)` (docs/training.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np

from lookup_table.config import ClusterConfig
from lookup_table.errors import ConfigError
from lookup_table.keras.export import (
    checkpoint_rows,
    export_checkpoint_saved_model,
    export_saved_model,
)
from lookup_table.keras.fit import RemoteOptimizer, model_function
from lookup_table.keras.layer import (
    DistributedEmbedding,
    RecordedLookup,
    RowSource,
    distributed_layers,
)

__all__ = [
    "CheckpointCallback",
    "DistributedEmbedding",
    "RecordedLookup",
    "RemoteOptimizer",
    "RowSource",
    "checkpoint_rows",
    "distributed_layers",
    "export_checkpoint_saved_model",
    "export_saved_model",
]

logger = logging.getLogger(__name__)


class CheckpointCallback(keras.callbacks.Callback):
    """Save a checkpoint of the model's cluster every `every_epochs` epochs of `model.fit`.

    Each checkpoint is `lookup_table.ops.checkpoint.save_checkpoint(config, dir)` (the
    replicas paused, rows, optimizer slots and dense parameters of one instant) into a
    new directory `{directory}/epoch-{epoch:04d}` (Keras' 1-based epoch), after this
    worker's pushes are written. Restore one with `restore_checkpoint(config, dir,
    force=True)` or export it with `export_saved_model(model, path,
    rows=checkpoint_rows(dir))`.

    Args:
        directory: where the per-epoch checkpoint directories go (created if missing).
        every_epochs: save at the end of every N-th epoch (and of the last one, when
            `save_last`).
        keep_last: keep only the newest N checkpoints this callback wrote (older ones
            are deleted after a save succeeds); None keeps them all.
        monitor: a metric of the epoch's logs (e.g. "val_auc"): then an epoch is saved
            only when it improves on the best so far (`best_path` is its directory):
            with `EarlyStopping(restore_best_weights=False)`, restoring `best_path`
            gives the best epoch's rows and dense weights.
        mode: "min", "max" or "auto" (min for a name containing "loss" or "error",
            else max).
        save_last: also save the final epoch when `every_epochs` skips it (not with
            `monitor`).
        config: the cluster file; default: the model's `RemoteOptimizer`'s.
        all_workers: save on every worker; default only on `worker_index == 0` (each
            save pauses the whole cluster and holds the whole namespace).

    Attributes:
        saved: the checkpoint directories this callback wrote and kept, oldest first.
        best_path, best: the best epoch's directory and its monitored value.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_epochs: int = 1,
        keep_last: int | None = None,
        monitor: str | None = None,
        mode: str = "auto",
        save_last: bool = True,
        config: ClusterConfig | None = None,
        all_workers: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(every_epochs, bool) or not isinstance(every_epochs, int) or every_epochs < 1:
            raise ConfigError(
                f"every_epochs must be a positive integer. Received: every_epochs={every_epochs!r}"
            )
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ConfigError(
                f"keep_last must be a positive integer or None. Received: keep_last={keep_last!r}"
            )
        if mode not in ("auto", "min", "max"):
            raise ConfigError(f"mode must be 'auto', 'min' or 'max'. Received: mode={mode!r}")
        if config is not None and not isinstance(config, ClusterConfig):
            raise ConfigError(
                f"config must be the cluster file's ClusterConfig (lookup_table.load_config). "
                f"Received: {config!r}"
            )
        self.directory = Path(directory)
        self.every_epochs = every_epochs
        self.keep_last = keep_last
        self.monitor = monitor
        if mode == "auto" and monitor is not None:
            mode = "min" if "loss" in monitor or "error" in monitor else "max"
        self.mode = mode
        self.save_last = save_last and monitor is None
        self.config = config
        self.all_workers = all_workers
        self.saved: list[Path] = []
        self.best: float | None = None
        self.best_path: Path | None = None
        self._epochs: int | None = None

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        self._config_and_worker()  # fail at the start, not after the first epoch

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        epochs = (params or {}).get("epochs")
        self._epochs = int(epochs) if isinstance(epochs, int) else None

    def _config_and_worker(self) -> tuple[ClusterConfig, int, Any]:
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, RemoteOptimizer):
            return self.config or optimizer.config, optimizer.worker_index, optimizer.session
        if self.config is None:
            raise ConfigError(
                f"CheckpointCallback: model {self.model.name!r} is not compiled with "
                f"lookup_table.keras.RemoteOptimizer(config): pass config= (the cluster file) "
                f"to say which cluster to checkpoint"
            )
        return self.config, 0, None

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        number = epoch + 1
        last = self._epochs is not None and number == self._epochs
        if self.monitor is not None:
            value = (logs or {}).get(self.monitor)
            if value is None:
                raise ConfigError(
                    f"CheckpointCallback(monitor={self.monitor!r}): epoch {number}'s logs "
                    f"have no such value (they have {sorted(logs or {})}); monitor one of them "
                    f"(val_* needs validation_data)"
                )
            current = float(value)
            if self.best is not None and not (
                current < self.best if self.mode == "min" else current > self.best
            ):
                return
            path = self._save(number)
            if path is not None:
                self.best, self.best_path = current, path
            return
        if number % self.every_epochs == 0 or (last and self.save_last):
            self._save(number)

    def _save(self, epoch: int) -> Path | None:
        from lookup_table.ops.checkpoint import save_checkpoint

        config, worker, session = self._config_and_worker()
        if worker != 0 and not self.all_workers:
            return None
        if session is not None and not session.closed:
            session.settle_pushes()
        path = self.directory / f"epoch-{epoch:04d}"
        save_checkpoint(config, path, progress=False)
        logger.info("epoch %d: saved checkpoint %s", epoch, path)
        self.saved.append(path)
        if self.keep_last is not None:
            old, self.saved = self.saved[: -self.keep_last], self.saved[-self.keep_last :]
            for stale in old:
                shutil.rmtree(stale, ignore_errors=True)
        return path


def _hook_model_functions() -> None:
    """Make `model.fit`, `evaluate` and `predict` of models with `DistributedEmbedding`
    layers run against their cluster (`lookup_table.keras.fit`).

    Wraps `keras.Model.make_train_function`, `make_test_function` and
    `make_predict_function` (once per process): a model without these layers gets
    Keras' own functions; one with them gets the cluster's, or a clear error if it was
    not compiled with a `RemoteOptimizer` (evaluate and predict of a model whose layers
    a `trainer.Trainer` bound keep Keras' own functions: the layers read their rows).
    A subclass that overrides one of them keeps its own."""
    if getattr(keras.Model, "_lookup_table_hooked", False):
        return
    for kind in ("train", "test", "predict"):
        name = f"make_{kind}_function"
        original = getattr(keras.Model, name)

        def hooked(
            self: keras.Model, force: bool = False, *, _original: Any = original, _kind: str = kind
        ) -> Any:
            layers = distributed_layers(self)
            if not layers:
                return _original(self, force)
            if (
                _kind != "train"
                and not isinstance(getattr(self, "optimizer", None), RemoteOptimizer)
                and all(layer.source is not None for layer in layers)
            ):  # layers a Trainer bound: they look their rows up themselves
                return _original(self, force)
            return model_function(self, _kind, force=force)

        hooked.__name__ = hooked.__qualname__ = name
        hooked.__doc__ = original.__doc__
        hooked.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(keras.Model, name, hooked)
    keras.Model._lookup_table_hooked = True


def _object_strings(x: Any) -> Any:
    """`x` with every numpy str or bytes array (dtype `<U...`, `S...`) as an object array
    (what Keras' array adapter takes for a string input); other values as they are."""
    if isinstance(x, np.ndarray) and x.dtype.kind in "US":
        return x.astype(object)
    if isinstance(x, dict):
        return {k: _object_strings(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_object_strings(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):  # not a namedtuple
        return tuple(_object_strings(v) for v in x)
    return x


def _refuse_restore_best_weights(model: keras.Model, callbacks: Any) -> None:
    found = [
        cb
        for cb in (getattr(callbacks, "callbacks", callbacks) or [])
        if isinstance(cb, keras.callbacks.EarlyStopping) and cb.restore_best_weights
    ]
    if found:
        tables = sorted({layer.table for layer in distributed_layers(model)})
        monitor = found[0].monitor
        raise ConfigError(
            f"model.fit: EarlyStopping(restore_best_weights=True) would restore only the "
            f"dense weights Keras holds; the rows of tables {tables} live in the cluster and "
            f"would stay at the last epoch's. Pass EarlyStopping(monitor={monitor!r}, "
            f"restore_best_weights=False) together with lookup_table.keras."
            f"CheckpointCallback(directory, monitor={monitor!r}), and after fit restore the "
            f"best epoch with lookup_table.ops.checkpoint.restore_checkpoint(config, "
            f"callback.best_path, force=True) (rows and dense weights)"
        )


def _hook_model_methods() -> None:
    """For models with `DistributedEmbedding` layers only: string ids as numpy str
    arrays in fit / evaluate / predict / *_on_batch, `EarlyStopping(restore_best_weights
    =True)` refused at fit, and `model.export` exporting with `export_saved_model`
    (module docstring). A subclass that overrides one of them keeps its own."""
    if getattr(keras.Model, "_lookup_table_methods_hooked", False):
        return

    def wrap(name: str) -> None:
        original = getattr(keras.Model, name)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def hooked(self: keras.Model, *args: Any, **kwargs: Any) -> Any:
            if distributed_layers(self):
                bound = signature.bind(self, *args, **kwargs)
                given = bound.arguments
                if "x" in given:
                    given["x"] = _object_strings(given["x"])
                if name == "fit":
                    _refuse_restore_best_weights(self, given.get("callbacks"))
                    data = given.get("validation_data")
                    if isinstance(data, tuple | list) and data:
                        given["validation_data"] = (_object_strings(data[0]), *data[1:])
                return original(*bound.args, **bound.kwargs)
            return original(self, *args, **kwargs)

        setattr(keras.Model, name, hooked)

    for name in (
        "fit",
        "evaluate",
        "predict",
        "train_on_batch",
        "test_on_batch",
        "predict_on_batch",
    ):
        wrap(name)

    original_export = keras.Model.export

    @functools.wraps(original_export)
    def export(
        self: keras.Model,
        filepath: Any,
        format: str = "tf_saved_model",
        verbose: Any = None,
        input_signature: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not distributed_layers(self):
            return original_export(
                self,
                filepath,
                format=format,
                verbose=verbose,
                input_signature=input_signature,
                **kwargs,
            )
        if format != "tf_saved_model" or input_signature is not None or kwargs:
            raise ConfigError(
                f"model.export of model {self.name!r} (DistributedEmbedding layers) writes a "
                f"TF SavedModel with its rows, from its own inputs: call "
                f"lookup_table.keras.export_saved_model(model, path) (format="
                f"'tf_saved_model', no input_signature or other arguments). Received: "
                f"format={format!r}, input_signature={input_signature!r}, "
                f"other arguments {sorted(kwargs)}"
            )
        result = export_saved_model(self, filepath)
        logger.info("saved artifact at %s: %s", filepath, result)
        return None

    keras.Model.export = export
    keras.Model._lookup_table_methods_hooked = True


_hook_model_functions()
_hook_model_methods()
# files that name the layer without the package prefix load as well
keras.saving.get_custom_objects().setdefault("DistributedEmbedding", DistributedEmbedding)
