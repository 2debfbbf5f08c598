"""Consistent checkpoints of a namespace that do not depend on the node count.

    lookup-table-checkpoint save    --config C --dir D [--no-pause]
    lookup-table-checkpoint restore --config C --dir D [--force] [--no-pause]
    lookup-table-checkpoint export  --dir D --out model.npz
    lookup-table-checkpoint export  --dir D --format savedmodel --model model.keras --out DIR

From Python, `save_checkpoint(config, dir)` and `restore_checkpoint(config, dir)` return
when done (also in Jupyter, where a loop runs); async code awaits their `_async` twins.

One concept per module: `format` (names, manifest, string-id packing, fit with a
cluster file), `files` (`.npy`, sha256, fsync, the atomic rename), `verify`,
`listing` (the namespace's keys from `lru_crawler metadump`), `pipeline`
(batches in flight, progress), `save`, `restore`, `export` (the `.npz`),
`savedmodel` (a TF SavedModel, TensorFlow loaded only when it runs) and `cli`
(the command line, the only module that prints).
"""

from __future__ import annotations

from lookup_table.ops.checkpoint.cli import main
from lookup_table.ops.checkpoint.export import export_checkpoint
from lookup_table.ops.checkpoint.files import finalize
from lookup_table.ops.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    check_compatible,
    dense_file_stems,
    pack_str_ids,
    unpack_str_ids,
)
from lookup_table.ops.checkpoint.listing import (
    NodeKeys,
    decode_bodies,
    decode_int_bodies,
    namespace_keys,
    parse_metadump,
)
from lookup_table.ops.checkpoint.pipeline import DEFAULT_BATCH_IDS
from lookup_table.ops.checkpoint.restore import restore_checkpoint, restore_checkpoint_async
from lookup_table.ops.checkpoint.save import save_checkpoint, save_checkpoint_async
from lookup_table.ops.checkpoint.savedmodel import checkpoint_rows, export_checkpoint_saved_model
from lookup_table.ops.checkpoint.verify import verify_checkpoint
from lookup_table.ops.metadump import metadump_prefix, namespace_lines

__all__ = [
    "DEFAULT_BATCH_IDS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NodeKeys",
    "check_compatible",
    "checkpoint_rows",
    "decode_bodies",
    "decode_int_bodies",
    "dense_file_stems",
    "export_checkpoint",
    "export_checkpoint_saved_model",
    "finalize",
    "main",
    "metadump_prefix",
    "namespace_keys",
    "namespace_lines",
    "pack_str_ids",
    "parse_metadump",
    "restore_checkpoint",
    "restore_checkpoint_async",
    "save_checkpoint",
    "save_checkpoint_async",
    "unpack_str_ids",
    "verify_checkpoint",
]
