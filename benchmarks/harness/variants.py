"""The compact-rows variants the training benchmarks compare (`benchmarks.real_data`,
`benchmarks.train`): a variant is a row dtype, an optimizer kind and a rounding; the
`[[tables]]` keys it gives a table take their learning rate from that benchmark's own
table settings; the check that a cluster really has it; its accuracy target against
fp32 Adam."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from lookup_table.config import AdamConfig, TableSpec

# FBGEMM's default rate: adagrad's steps shrink as 1/sqrt(t) on their own, so it does not
# take the table's Adam rate
ROWWISE_ADAGRAD_LEARNING_RATE = 0.01


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """How a benchmark's trained tables keep and step their rows.

    `optimizer`: "adam" keeps the table's own Adam; "rowwise_adam" is row-wise Adam with
    that Adam's learning rate, betas and epsilon; "rowwise_adagrad" has
    ROWWISE_ADAGRAD_LEARNING_RATE. `rounding`: a 16-bit dtype's (None: the table's
    default, stochastic).
    """

    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    optimizer: Literal["adam", "rowwise_adam", "rowwise_adagrad"] = "adam"
    rounding: Literal["stochastic", "nearest"] | None = None

    def table_keys(self, adam: AdamConfig) -> dict[str, Any]:
        """The `[[tables]]` keys that make a table whose optimizer is `adam` this variant."""
        keys: dict[str, Any] = {}
        if self.dtype != "float32":
            keys["dtype"] = self.dtype
        if self.optimizer == "rowwise_adam":
            keys["optimizer"] = {
                "name": "rowwise_adam",
                "learning_rate": adam.learning_rate,
                "beta_1": adam.beta_1,
                "beta_2": adam.beta_2,
                "epsilon": adam.epsilon,
            }
        elif self.optimizer == "rowwise_adagrad":
            keys["optimizer"] = {
                "name": "rowwise_adagrad",
                "learning_rate": ROWWISE_ADAGRAD_LEARNING_RATE,
            }
        if self.rounding is not None:
            keys["rounding"] = self.rounding
        return keys

    @property
    def made(self) -> tuple[str, str, str]:
        """(dtype, optimizer name, rounding) of a table of this variant."""
        return (self.dtype, self.optimizer, self.rounding or "stochastic")


# the first is the one the others are held against
VARIANTS: dict[str, Variant] = {
    "fp32-adam": Variant(),
    "f16-rowwise-adam": Variant(dtype="float16", optimizer="rowwise_adam"),
    "f16-rowwise-adagrad": Variant(dtype="float16", optimizer="rowwise_adagrad"),
    "bf16-adam": Variant(dtype="bfloat16"),
}
# the same with the stored rows rounded to nearest instead of stochastically
VARIANTS |= {
    f"{name}-nearest": dataclasses.replace(v, rounding="nearest")
    for name, v in VARIANTS.items()
    if v.dtype != "float32"
}
BASE_VARIANT = "fp32-adam"
# how far below fp32 Adam's eval AUC each variant may be
VARIANT_TARGET_AUC_DIFF = {
    "f16-rowwise-adam": 0.002,
    "f16-rowwise-adagrad": 0.005,
    "bf16-adam": 0.002,
}
VARIANT_TARGET_AUC_DIFF |= {f"{v}-nearest": d for v, d in VARIANT_TARGET_AUC_DIFF.items()}


def auc_target_met(auc_diff: float, target: float) -> bool:
    """A variant's AUC minus fp32 Adam's meets `target`: no more than it below (above is
    fine)."""
    return auc_diff >= -target


def parse_variants(text: str) -> list[str]:
    """`--variants`' comma-separated names; ValueError saying what to give otherwise."""
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--variants takes distinct names from {', '.join(VARIANTS)}, got {names}")
    return names


def check_tables(variant: str, tables: Iterable[TableSpec]) -> None:
    """RuntimeError unless every table of `tables` has `variant`'s dtype, optimizer and
    rounding (the cluster file really made the variant)."""
    made = {(t.dtype, t.optimizer.name, t.rounding) for t in tables}
    if made != {VARIANTS[variant].made}:
        raise RuntimeError(
            f"variant {variant!r} made tables of (dtype, optimizer, rounding) {made}; "
            f"expected {VARIANTS[variant].made}"
        )
