"""Consistent checkpoints of a namespace that do not depend on the node count.

`save_checkpoint(config, dir)` and `restore_checkpoint(config, dir)` return when done
(async code awaits their `_async` twins). One concept per module: `format`, `files`,
`verify`, `listing`, `pipeline`, `save`, `restore`, `export` (to npz). The command line
`lookup-table-checkpoint` is `cli`, the only module that prints, and the only one that
reaches up to `lookup_table.keras` (for `export --format savedmodel`); nothing here
imports it. docs/checkpoints.md is the manual.
"""

from __future__ import annotations

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
from lookup_table.ops.checkpoint.verify import verify_checkpoint
from lookup_table.ops.metadump import metadump_prefix, namespace_lines

__all__ = [
    "DEFAULT_BATCH_IDS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NodeKeys",
    "check_compatible",
    "decode_bodies",
    "decode_int_bodies",
    "dense_file_stems",
    "export_checkpoint",
    "finalize",
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
