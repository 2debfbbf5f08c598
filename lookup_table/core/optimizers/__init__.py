"""Optimizer math on rows (pure numpy and compiled loops): Adam, SGD, Adagrad as Keras 3
computes them, and FBGEMM's row-wise Adagrad and Adam.

`make_optimizer(config)` returns a table's `Optimizer`; `segment_sum` and `check_finite`
prepare a push's gradients; `layout` turns rows and slots into an item's bytes. The slot
layout of each optimizer is a storage format (docs/optimizers.md, "Slots"), given
there with the formulas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from lookup_table.core.optimizers.adagrad import Adagrad
from lookup_table.core.optimizers.adam import Adam, column_at, step_sizes
from lookup_table.core.optimizers.base import (
    AnyOptimizerConfig,
    Float32Array,
    Optimizer,
    StoredSlot,
    items_at,
)
from lookup_table.core.optimizers.gradients import check_finite, segment_sum
from lookup_table.core.optimizers.rowwise_adagrad import RowwiseAdagrad, mean_square
from lookup_table.core.optimizers.rowwise_adam import RowwiseAdam
from lookup_table.core.optimizers.sgd import SGD

if TYPE_CHECKING:  # the runtime imports stay numpy + stdlib
    from lookup_table.config import (
        AdagradConfig,
        AdamConfig,
        RowwiseAdagradConfig,
        RowwiseAdamConfig,
        SGDConfig,
        TableSpec,
    )

__all__ = [
    "MAX_EXACT_STEP",
    "SGD",
    "Adagrad",
    "Adam",
    "AnyOptimizerConfig",
    "Float32Array",
    "Optimizer",
    "RowwiseAdagrad",
    "RowwiseAdam",
    "StoredSlot",
    "check_finite",
    "column_at",
    "items_at",
    "make_optimizer",
    "mean_square",
    "segment_sum",
    "slot_width",
    "step_sizes",
    "step_slot",
]


def make_optimizer(config: AnyOptimizerConfig) -> Optimizer:
    """The optimizer of `config` (AdamConfig, SGDConfig, AdagradConfig,
    RowwiseAdagradConfig or RowwiseAdamConfig).

    Dispatches on `config.name`, so this package never imports lookup_table at
    run time.

    Raises:
        ValueError: `config` is not one of the five optimizer configs.
    """
    # getattr, not config.name: anything without a name is a ValueError below; the
    # casts say what the name tells (mypy does not narrow on a getattr result)
    name = getattr(config, "name", None)
    if name == "adam":
        return Adam(cast("AdamConfig", config))
    if name == "sgd":
        return SGD(cast("SGDConfig", config))
    if name == "adagrad":
        return Adagrad(cast("AdagradConfig", config))
    if name == "rowwise_adagrad":
        return RowwiseAdagrad(cast("RowwiseAdagradConfig", config))
    if name == "rowwise_adam":
        return RowwiseAdam(cast("RowwiseAdamConfig", config))
    raise ValueError(
        f"unknown optimizer config {config!r}; expected an AdamConfig, SGDConfig, "
        f"AdagradConfig, RowwiseAdagradConfig or RowwiseAdamConfig (lookup_table.config)"
    )


def slot_width(spec: TableSpec) -> int:
    """Floats of one row's slots in table `spec`: its optimizer's `slot_width(spec.dim)`."""
    return make_optimizer(spec.optimizer).slot_width(spec.dim)


# float32 counts every whole number up to 2**24 exactly: below it, `step + 1` is the next
MAX_EXACT_STEP = float(2**24)


def step_slot(optimizer: Optimizer, dim: int) -> int | None:
    """The slot column that counts a row's updates, or None for an optimizer without one.

    Adam's `step` (its last slot) goes up by exactly 1 at every update of the row while it
    is below `MAX_EXACT_STEP` (float32: above it, `step + 1 == step`). A stored row's step
    then says exactly which of the updates journaled for it it has already had: the
    journal of rows written behind keeps the gradients and each row's step before the
    push instead of the new values (`optimizer_service.engine.journal`).
    """
    names = optimizer.slot_names
    return optimizer.slot_width(dim) - 1 if names and names[-1] == "step" else None
