"""Trainers: data readers, the model zoo, the training loop and `lookup-table-train`.

`trainer.Trainer` and `trainer.TrainResult` are imported lazily so that the data
readers (`trainer.data`) do not pay for importing TensorFlow.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainResult", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from trainer import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
