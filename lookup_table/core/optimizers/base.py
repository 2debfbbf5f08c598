"""The Optimizer protocol and the argument checks every optimizer shares.

An optimizer is pure numpy: it takes the rows of a table (n, dim), their summed
gradients (n, dim) and their slots (n, slot_width), all float32, and returns new
rows and new slots. It never mutates its inputs, so the service may run it in a
worker thread whose caller was cancelled: the thread "still runs its course"
(anyio.to_thread), and nothing it touches is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.precision import RowDtype, check_dtype

if TYPE_CHECKING:
    from lookup_table.config import OptimizerConfig

__all__ = ["AnyOptimizerConfig", "Float32Array", "Optimizer", "StoredSlot", "items_at"]

Float32Array: TypeAlias = NDArray[np.float32]
AnyOptimizerConfig: TypeAlias = "OptimizerConfig"


@dataclass(frozen=True, slots=True)
class StoredSlot:
    """How one slot of a row is stored: its next `width` float32 columns of the slots,
    each as `dtype` (`lookup_table.core.precision`: float32 is the float as it is)."""

    name: str
    width: int
    dtype: RowDtype = "float32"

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if self.width < 0:
            raise ValueError(f"slot {self.name!r}: width must be >= 0, got {self.width}")


class Optimizer(Protocol):
    """Updates rows and their slots; one instance per table, stateless between calls."""

    @property
    def config(self) -> AnyOptimizerConfig:
        """The hyperparameters, Keras names and defaults (lookup_table.config)."""
        ...

    @property
    def slot_names(self) -> tuple[str, ...]:
        """Names of the per-row state, as Keras names its optimizer variables."""
        ...

    def slot_width(self, dim: int) -> int:
        """Floats of slots per row of a table of `dim` floats (0: no slots stored)."""
        ...

    def slot_storage(self, dim: int) -> tuple[StoredSlot, ...]:
        """The slots in order, each with its width and the dtype its columns are stored
        as; the widths sum to `slot_width(dim)`. The values `next_slots` gives a column
        stored as a 16-bit dtype are already that dtype's, so storing them loses nothing."""
        ...

    def initial_slots(self, n: int, dim: int) -> Float32Array:
        """Slots of `n` rows that were never updated, float32 (n, slot_width(dim)): the
        same for every row (a new row's item is laid out from one row of them)."""
        ...

    def next_slots(self, grads: Float32Array, slots: Float32Array) -> Float32Array:
        """The slots after one step: (n, slot_width), from the grads and old slots alone.

        Never depends on the rows, so a journal replay that finds a row's slots not yet
        written recomputes them from the gradients, whatever state its row is in.
        """
        ...

    def finish(
        self, weights: Float32Array, grads: Float32Array, new_slots: Float32Array
    ) -> Float32Array:
        """The rows after one step, from the old rows, the grads and `next_slots`' result.

        `update(w, g, s) == (finish(w, g, next_slots(g, s)), next_slots(g, s))`, bit for
        bit: `update` is this composition.
        """
        ...

    def update(
        self, weights: Float32Array, grads: Float32Array, slots: Float32Array
    ) -> tuple[Float32Array, Float32Array]:
        """One step on `n` rows: (n, dim) rows and grads, (n, slot_width) slots.

        Returns new (weights, slots) arrays; the inputs are left untouched.

        Raises:
            ValueError: a dtype is not float32 or the shapes do not agree.
        """
        ...

    def update_at(
        self,
        values: Float32Array,
        at: NDArray[np.intp],
        extra: Float32Array,
        grads: Float32Array,
    ) -> tuple[Float32Array, Float32Array]:
        """`update` of rows laid out as items (a row, then its slots: dim + slot_width
        floats), read where they are: row i's item is `values[at[i]]`, or `extra[-1 -
        at[i]]` where `at[i] < 0`. The row cache's map is `values`, the rows it does not
        hold are `extra` (`optimizer_service.engine.stepping`): no gather of the items first.

        Returns the new rows (n, dim) and the new items (n, dim + slot_width), new arrays,
        bit for bit `update`'s; `values` and `extra` are left untouched.

        Raises:
            ValueError: as `update`, or an index outside `values` or `extra`.
        """
        ...


def check_update_args(
    weights: Float32Array,
    grads: Float32Array,
    slots: Float32Array,
    slot_width: Callable[[int], int],
) -> int:
    """Return dim; ValueError unless weights, grads are float32 (n, dim), slots (n, slot_width).

    float32 is required, not cast to: a float64 array would silently change the
    rounding, and the rows are stored as float32 anyway.
    """
    for name, arr in (("weights", weights), ("grads", grads), ("slots", slots)):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != 2:
            what = (
                f"{arr.dtype} array of shape {arr.shape}"
                if isinstance(arr, np.ndarray)
                else (type(arr).__name__)
            )
            raise ValueError(f"{name}: expected a float32 array of shape (n, dim), got {what}")
    if grads.shape != weights.shape:
        raise ValueError(f"grads: expected the shape of weights {weights.shape}, got {grads.shape}")
    dim = int(weights.shape[1])
    expected = (weights.shape[0], slot_width(dim))
    if slots.shape != expected:
        raise ValueError(
            f"slots: expected shape {expected} for weights of shape {weights.shape}, "
            f"got {slots.shape}"
        )
    return dim


def step(
    optimizer: Optimizer, weights: Float32Array, grads: Float32Array, slots: Float32Array
) -> tuple[Float32Array, Float32Array]:
    """Every optimizer's `update`: check the arrays, then `finish(w, g, next_slots(g, s))`.

    One composition for all, so a journal replay that recomputes an item with
    `next_slots` and `finish` computes exactly what `update` did.
    """
    check_update_args(weights, grads, slots, optimizer.slot_width)
    new_slots = optimizer.next_slots(grads, slots)
    return optimizer.finish(weights, grads, new_slots), new_slots


def check_update_at_args(
    values: Float32Array,
    at: NDArray[np.intp],
    extra: Float32Array,
    grads: Float32Array,
    slot_width: Callable[[int], int],
) -> int:
    """Return dim; ValueError unless `update_at`'s arguments agree (float32 C-contiguous
    items of dim + slot width floats in `values` and `extra`, grads (n, dim), `at` (n,)
    intp within them). Compiled loops index without bounds checks: this is their check."""
    if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.ndim != 2:
        raise ValueError(f"grads: expected a float32 array of shape (n, dim), got {grads!r:.80}")
    dim = int(grads.shape[1])
    width = dim + slot_width(dim)
    for name, arr in (("values", values), ("extra", extra)):
        if (
            not isinstance(arr, np.ndarray)
            or arr.dtype != np.float32
            or arr.ndim != 2
            or arr.shape[1] != width
            or not arr.flags.c_contiguous
        ):
            got = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise ValueError(
                f"{name}: expected C-contiguous float32 items of {width} floats (dim {dim} + "
                f"slots), got {got}"
            )
    if not isinstance(at, np.ndarray) or at.dtype != np.intp or at.shape != grads.shape[:1]:
        raise ValueError(f"at: expected {grads.shape[0]} intp positions, got {at!r:.80}")
    if at.shape[0] and (int(at.max()) >= values.shape[0] or -1 - int(at.min()) >= extra.shape[0]):
        raise ValueError(
            f"at: positions {int(at.min())}..{int(at.max())} outside {values.shape[0]} values "
            f"and {extra.shape[0]} extra items"
        )
    return dim


class UpdateAtArgs(NamedTuple):
    """`update_at`'s arguments as a compiled pass takes them, and its outputs."""

    dim: int
    values: Float32Array
    at: NDArray[np.intp]
    extra: Float32Array
    rows: Float32Array  # (n, dim), to be written
    items: Float32Array  # (n, dim + slot width), to be written


def update_at_args(
    values: Float32Array,
    at: NDArray[np.intp],
    extra: Float32Array,
    grads: Float32Array,
    slot_width: Callable[[int], int],
) -> UpdateAtArgs:
    """`check_update_at_args`, then the arrays a compiled `update_at` pass takes: read-only
    ones copied (its signatures match one exact array type each: writable ones), and
    empty outputs for the new rows and items."""
    dim = check_update_at_args(values, at, extra, grads, slot_width)
    values, extra = (a if a.flags.writeable else a.copy() for a in (values, extra))
    at = at if at.flags.writeable else at.copy()
    n = at.shape[0]
    rows = np.empty((n, dim), dtype=np.float32)
    items = np.empty((n, values.shape[1]), dtype=np.float32)
    return UpdateAtArgs(dim, values, at, extra, rows, items)


def items_at(values: Float32Array, at: NDArray[np.intp], extra: Float32Array) -> Float32Array:
    """The items `update_at` reads, gathered into a new (n, width) array: row i's
    `values[at[i]]`, or `extra[-1 - at[i]]` where at[i] < 0."""
    held = at >= 0
    items = np.empty((at.shape[0], values.shape[1]), dtype=np.float32)
    items[held] = values[at[held]]
    items[~held] = extra[-1 - at[~held]]
    return items


class GatheredUpdateAt:
    """`Optimizer.update_at` for optimizers without a compiled pass of their own (SGD,
    Adagrad): the items gathered (`items_at`), then `update`."""

    __slots__ = ()

    def update_at(
        self,
        values: Float32Array,
        at: NDArray[np.intp],
        extra: Float32Array,
        grads: Float32Array,
    ) -> tuple[Float32Array, Float32Array]:
        optimizer = cast("Optimizer", self)
        dim = check_update_at_args(values, at, extra, grads, optimizer.slot_width)
        items = items_at(values, at, extra)
        rows, slots = optimizer.update(items[:, :dim], grads, items[:, dim:])
        items[:, :dim] = rows
        items[:, dim:] = slots
        return rows, items
