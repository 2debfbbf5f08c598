"""Benchmark on real data: UCI Adult and MovieLens-100k from raw CSV, the CLI against tf.keras.

docs/benchmarks.md says where the data comes from, how it measures and how to read it::

    python -m benchmarks.real_data                    # Adult 10 epochs, MovieLens-100k 5
    python -m benchmarks.real_data --quick            # 1 epoch each (a smoke run)
    python -m benchmarks.real_data --prepare-only     # fetch and write the CSV files, no training
    python -m benchmarks.real_data --sides ours --variants fp32-adam,f16-rowwise-adam
                                                      # the tables' dtype and optimizer side by side
"""

from __future__ import annotations

from typing import Any

MODEL = "mlp"
HIDDEN = (256, 128)
BATCH_SIZE = 1024
LEARNING_RATE = 0.001
EMBEDDING_DIM = 16
INIT_RANGE = 0.05  # uniform +-0.05: keras.layers.Embedding's default initializer
SEED = 0
MEMCACHED_MEMORY_MB = 256
TARGET_AUC_DIFF = 0.005
TARGET_LOGLOSS_REL_DIFF = 0.01
SIDES = ("keras", "ours")
LABELS = {"keras": "tf.keras", "ours": "lookup-table"}
COLORS = {"keras": "tab:blue", "ours": "tab:orange"}
ROWWISE_ADAGRAD_LEARNING_RATE = 0.01  # FBGEMM's default: adagrad's steps shrink as 1/sqrt(t)
# what every `[[tables]]` entry of our side gets: its dtype and its optimizer (none: the
# cluster's `[optimizer]`, Adam as Keras'); the first is the one the others are held against
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32-adam": {},
    "f16-rowwise-adam": {
        "dtype": "float16",
        "optimizer": {
            "name": "rowwise_adam",
            "learning_rate": LEARNING_RATE,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-7,
        },
    },
    "f16-rowwise-adagrad": {
        "dtype": "float16",
        "optimizer": {"name": "rowwise_adagrad", "learning_rate": ROWWISE_ADAGRAD_LEARNING_RATE},
    },
    "bf16-adam": {"dtype": "bfloat16"},
}
# the same with the stored rows rounded to nearest instead of stochastically
VARIANTS |= {
    f"{name}-nearest": {**spec, "rounding": "nearest"}
    for name, spec in VARIANTS.items()
    if "dtype" in spec
}
BASE_VARIANT = "fp32-adam"
# how far from fp32 Adam's mean eval AUC each variant may be
VARIANT_TARGET_AUC_DIFF = {
    "f16-rowwise-adam": 0.002,
    "f16-rowwise-adagrad": 0.005,
    "bf16-adam": 0.002,
}
VARIANT_TARGET_AUC_DIFF |= {f"{v}-nearest": d for v, d in VARIANT_TARGET_AUC_DIFF.items()}
