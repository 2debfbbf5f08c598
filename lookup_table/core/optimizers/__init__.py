"""Optimizer math on rows (pure numpy): Adam, SGD (momentum, Nesterov), Adagrad, and
the compact row-wise Adagrad and Adam.

`make_optimizer(config)` returns the `Optimizer` for a table's `OptimizerConfig`
(lookup_table.config, Keras' names and defaults). Adam, SGD and Adagrad compute
exactly what Keras 3's optimizers compute, op for op in float32; the row-wise ones
follow FBGEMM (their module docstrings give the formulas, the references and the
conventions for sparse rows, such as Adam's per-row step).

Slot layout, version 1. This is a storage format: the value of a row's `s` key
is its slots as `slot_width(dim)` little-endian float32, in this order; changing
it is a data migration.

=========================  ==========  =====================================
optimizer                  slot_width  floats of one row's slots, in order
=========================  ==========  =====================================
adam                       2*dim + 1   momentum (m, dim), velocity (v, dim),
                                       step (1: updates of this row so far)
sgd, momentum != 0         dim         momentum (dim), lr already folded in
sgd, momentum == 0         0           none (nothing to store)
adagrad                    dim         accumulator (dim)
rowwise_adagrad            1           accumulator (1)
rowwise_adam               dim + 2     momentum (m, dim), velocity (v, 1),
                                       step (1)
=========================  ==========  =====================================

Every slot is stored as little-endian float32 except rowwise_adam's momentum, stored
as its `momentum_dtype` (bfloat16 by default): `Optimizer.slot_storage` says so per
slot, and `layout` turns it into the bytes of an item.

Initial slots: adam and rowwise_adam all 0 (step 0), sgd momentum 0, adagrad and
rowwise_adagrad every float at `initial_accumulator_value` (Keras: 0.1, FBGEMM: 0).

`segment_sum` and `check_finite` prepare a push's gradients: duplicate ids are
summed (IndexedSlices semantics, in a fixed order) and NaN/Inf is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from lookup_table.core.optimizers.adagrad import Adagrad
from lookup_table.core.optimizers.adam import Adam, step_sizes
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
