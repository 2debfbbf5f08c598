"""Benchmark on real data: UCI Adult and MovieLens-100k from raw CSV, the CLI against tf.keras.

docs/benchmarks.md says where the data comes from, how it measures and how to read it::

    python -m benchmarks.real_data                    # Adult 10 epochs, MovieLens-100k 5
    python -m benchmarks.real_data --quick            # 1 epoch each (a smoke run)
    python -m benchmarks.real_data --prepare-only     # fetch and write the CSV files, no training
    python -m benchmarks.real_data --sides ours --variants fp32-adam,f16-rowwise-adam
                                                      # the tables' dtype and optimizer side by side

`--variants` names `benchmarks.harness.variants`' VARIANTS.
"""

from __future__ import annotations

from lookup_table.config import AdamConfig

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
# our side's tables have no optimizer of their own: the cluster's `[optimizer]`, Adam as
# Keras'; a variant's row-wise Adam takes its rate and betas
ADAM = AdamConfig(learning_rate=LEARNING_RATE)
