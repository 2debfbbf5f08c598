"""The SavedModel writer: a Keras model and its tables' rows as a TF SavedModel that
serves without this project (docs/serving.md). It reads no cluster: the rows come from
the caller (`lookup_table.keras.export_saved_model`, or a checkpoint's).

`savedmodel` (the tables, the signature, the writing), `tfhash` (the store's hashes and
initial rows in TF ops), `memory` (what an export needs, refused before it starts).
"""

from __future__ import annotations

from lookup_table.keras.serving.memory import (
    available_memory_bytes,
    check_export_memory,
    estimate_export_bytes,
    hash_table_buckets,
)
from lookup_table.keras.serving.savedmodel import (
    UNSEEN,
    TableRows,
    Unseen,
    check_export,
    check_rows,
    write_saved_model,
)
from lookup_table.keras.serving.tfhash import (
    blake2b_8_tf,
    check_reproducible,
    id_hashes_tf,
    initial_rows_tf,
)

__all__ = [
    "UNSEEN",
    "TableRows",
    "Unseen",
    "available_memory_bytes",
    "blake2b_8_tf",
    "check_export",
    "check_export_memory",
    "check_reproducible",
    "check_rows",
    "estimate_export_bytes",
    "hash_table_buckets",
    "id_hashes_tf",
    "initial_rows_tf",
    "write_saved_model",
]
