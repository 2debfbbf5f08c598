"""`export_saved_model`: serve a trained model without this project, as a TF SavedModel.

    from lookup_table.keras import export_saved_model
    from lookup_table.ops.checkpoint import checkpoint_rows

    # a model bound to its cluster (compiled with RemoteOptimizer, or trained by
    # trainer.Trainer): a consistent snapshot of every row of its tables
    export_saved_model(model, "served/ctr/1")   # model.export("served/ctr/1") does the same
    # from a checkpoint:
    export_saved_model(model, "served/ctr/1", rows=checkpoint_rows("ckpt-0042"))
    # or, from the live cluster, the rows of chosen ids:
    export_saved_model(model, "served/ctr/1", config=config, ids={"user": ids, "item": items})

Every form that reads the live cluster first waits for the pushes of the model's own
session, then pauses the optimizer replicas, which write the rows they hold behind to
memcached, reads, and resumes them: the export holds one instant of the model, never
rows memcached has not been given yet.

The result is a standard SavedModel with one `serving_default` signature:
`tf.saved_model.load` serves it in a process that has TensorFlow and nothing of
this project, and TF Serving loads it as it is (only core TF ops: no custom op,
no py_function, no Python object). Each `DistributedEmbedding` table becomes

* a `tf.lookup.experimental.DenseHashTable` mapping an id (int64 or string) to
  its row's index, and
* a non-trainable float32 variable (n + 1, dim) of the rows (the last row zeros),

both saved in the SavedModel's `variables/` (not as graph constants, which a
GraphDef caps at 2 GB). Every layer of a table shares them. The dense weights
are the model's own variables, as they are when `export_saved_model` is called.

Inputs of the signature, by Keras input (`keras.Input(name=...)`):

* dense: one tensor named like the input, with its dtype and shape (batch first);
* ragged (`ragged=True`, multi-hot): `<name>_values` (the flat ids) and
  `<name>_row_lengths` (int64 (batch,)): exact for any ragged batch, with no
  padding value to agree on (a dense input with the layer's `padding_id` stays
  the other way to send multi-hot ids);
* sparse (`sparse=True`): `<name>_indices` int64 (nnz, rank), `<name>_values`,
  `<name>_dense_shape` int64 (rank,).

Outputs are named by the model's `output_names` (a dict output keeps its keys).

Ids the export does not hold ("unseen": never trained, or not in the chosen
`ids`) get what the cluster answers for them with `create=False`:
`unseen="initializer"` (the default) computes the table's deterministic initial
row in TF ops, bit for bit the float32 values of
`lookup_table.core.initializers.initial_rows` (for the `zeros`, `constant` and
`uniform` initializers; string ids are hashed with BLAKE2b written in TF ops);
`unseen="zeros"` serves zeros instead. The `normal` and `truncated_normal`
initializers need `log1p` and `cos`, whose TF kernels are not the ones numpy
uses, so they cannot be reproduced exactly: such a table needs `unseen="zeros"`.
Padding ids contribute nothing, and the combiners compute exactly what the layer
computes in training: the layer's own graph code runs, fed the exported rows.

Size and memory: the SavedModel holds per row `4 * dim` bytes of floats plus the
hash table's buckets (a power of two >= rows / 0.8, each an int64 index and an
8-byte int or a string key); docs/serving.md has measured sizes. An export needs
about `estimate_export_bytes` of memory; it is refused with `ExportTooLargeError`
before anything is written (and before the rows are read) when that exceeds the
memory available (MemAvailable and the cgroup's limit), or `memory_limit_bytes`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig, TableSpec
from lookup_table.core.hashing import stable_hash
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.errors import ConfigError, ExportTooLargeError

if TYPE_CHECKING:
    from lookup_table.layer import DistributedEmbedding
    from lookup_table.session import TrainingSession

__all__ = [
    "UNSEEN",
    "TableRows",
    "available_memory_bytes",
    "check_export_memory",
    "estimate_export_bytes",
    "export_saved_model",
    "id_hashes_tf",
    "initial_rows_tf",
]

logger = logging.getLogger(__name__)

UNSEEN = ("initializer", "zeros")
"""What an id the export does not hold gets: its initial row, or zeros."""

Unseen = Literal["initializer", "zeros"]

_EXACT_INITIALIZERS = ("zeros", "constant", "uniform")
_INSERT_CHUNK = 1 << 20  # ids per insert into a hash table (bounds the temporary tensors)
_CHUNK_BYTES = 16 << 20  # rows per copy into the rows variable
_FIXED_BYTES = 64 << 20  # tracing, the graph, TF's own buffers (measured 20-55 MB)
_MAX_LOAD_FACTOR = 0.8  # DenseHashTable's default
_INT64_MIN = -(2**63)
# Sentinel keys of a string table's DenseHashTable: 0xFF and 0xFE never occur in UTF-8,
# so no str id can be one (a query of such bytes is answered as an unseen id). Short:
# every empty bucket of the saved table holds the empty key.
_EMPTY_STR = b"\xff"
_DELETED_STR = b"\xfe"
_UNUSED_STR = b"\xff\xfe"


@dataclass(frozen=True, slots=True, kw_only=True)
class TableRows:
    """The rows of one table to export.

    Attributes:
        spec: the table (dim, id type, seed and initializer for unseen ids).
        ids: unique ids (n,): int64, or an object array of str.
        rows: float32 (n, dim), row i of ids[i].
    """

    spec: TableSpec
    ids: IdArray
    rows: NDArray[np.float32]


# ---------------------------------------------------------------- memory


def estimate_export_bytes(*, count: int, dim: int, id_type: str, id_bytes: int = 0) -> int:
    """Peak memory an export of one table needs, in bytes (benchmarks/export_size.py
    measures it: this is 1.05 to 1.4 times the peak it saw at 1M rows).

    Args:
        count: rows exported.
        dim: the table's dim.
        id_type: "int64" or "string".
        id_bytes: total UTF-8 bytes of the string ids (0 for int64 ids).
    """
    buckets = _buckets(count)
    key = 8 if id_type == "int64" else 32  # a tf.string key is a 32-byte tstring
    rows = 4 * dim * (count + 1)
    # Python str ids (object array, str objects) and their UTF-8 while inserted
    source_ids = 8 * count if id_type == "int64" else 70 * count + id_bytes
    # the source rows and the variable; the hash table and the copy its save makes
    return 2 * rows + source_ids + 2 * buckets * (key + 8) + _FIXED_BYTES


def _buckets(count: int) -> int:
    """A DenseHashTable's buckets for `count` keys without a resize: a power of two."""
    need = max(8, math.ceil((count + 1) / _MAX_LOAD_FACTOR))
    return 1 << (need - 1).bit_length()


def available_memory_bytes() -> int | None:
    """Memory this process may still use: /proc/meminfo's MemAvailable, lowered to the
    cgroup v2 limit's headroom (memory.max - memory.current) when there is one; None
    when neither can be read (not Linux)."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    if not found:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - current))
    return min(found) if found else None


def check_export_memory(
    needed_bytes: int, *, limit_bytes: int | None = None, what: str = "the export"
) -> None:
    """Refuse an export that would not fit in memory.

    Args:
        needed_bytes: from `estimate_export_bytes`, summed over the tables.
        limit_bytes: the memory it may use; None: `available_memory_bytes()`.
        what: named in the message.

    Raises:
        ExportTooLargeError: naming both sizes and what to do.
    """
    source = "the limit given"
    if limit_bytes is None:
        limit_bytes = available_memory_bytes()
        source = "the memory available (MemAvailable, cgroup memory.max)"
        if limit_bytes is None:
            logger.warning("cannot tell the memory available: %s is not checked", what)
            return
    if needed_bytes > limit_bytes:
        raise ExportTooLargeError(
            f"{what} needs about {needed_bytes:,} bytes ({needed_bytes / 2**30:.2f} GiB) of "
            f"memory but {source} is {limit_bytes:,} bytes ({limit_bytes / 2**30:.2f} GiB); "
            f"nothing was written. Export fewer ids (ids=...), or on a machine with more "
            f"memory",
            needed_bytes=needed_bytes,
            limit_bytes=limit_bytes,
        )


# ---------------------------------------------------------------- ids -> hashes, in TF ops

_U64 = tf.uint64
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_INT_TAG = 0x6C6F6F6B75702D69  # lookup_table.core.hashing: "lookup-i"
_GOLDEN = 0x9E3779B97F4A7C15
_BLAKE2B_IV = (
    0x6A09E667F3BCC908,
    0xBB67AE8584CAA73B,
    0x3C6EF372FE94F82B,
    0xA54FF53A5F1D36F1,
    0x510E527FADE682D1,
    0x9B05688C2B3E6C1F,
    0x1F83D9ABFB41BD6B,
    0x5BE0CD19137E2179,
)
_BLAKE2B_SIGMA = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
    (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
    (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
    (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
    (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
    (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
    (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
    (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
    (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0),
)
_BLOCK = 128  # BLAKE2b's block, bytes


def _u64(value: int) -> tf.Tensor:
    return tf.constant(np.uint64(value & 0xFFFFFFFFFFFFFFFF), _U64)


def _xor(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.bitwise.bitwise_xor(a, b)


def _shr(a: tf.Tensor, n: int) -> tf.Tensor:
    return tf.bitwise.right_shift(a, _u64(n))


def _rotr(a: tf.Tensor, n: int) -> tf.Tensor:
    return tf.bitwise.bitwise_or(_shr(a, n), tf.bitwise.left_shift(a, _u64(64 - n)))


def _mix64(z: tf.Tensor) -> tf.Tensor:
    """`lookup_table.core.hashing.mix64` on a uint64 tensor (TF wraps uint64 products)."""
    z = _xor(z, _shr(z, 30)) * _u64(_M1)
    z = _xor(z, _shr(z, 27)) * _u64(_M2)
    return _xor(z, _shr(z, 31))


def _g(
    a: tf.Tensor, b: tf.Tensor, c: tf.Tensor, d: tf.Tensor, x: tf.Tensor, y: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """BLAKE2b's G on 4 lanes at once (each (n, 4) uint64)."""
    a = a + b + x
    d = _rotr(_xor(d, a), 32)
    c = c + d
    b = _rotr(_xor(b, c), 24)
    a = a + b + y
    d = _rotr(_xor(d, a), 16)
    c = c + d
    b = _rotr(_xor(b, c), 63)
    return a, b, c, d


def _blake2b_compress(h: tf.Tensor, m: tf.Tensor, t: tf.Tensor, last: tf.Tensor) -> tf.Tensor:
    """BLAKE2b's F (RFC 7693 3.2) on n messages at once: state h (n, 8), block m (n, 16),
    byte counter t (n,) (its high word stays 0), final-block flags last (n,).

    The state v0..v15 is four (n, 4) lanes a, b, c, d (v0-3, v4-7, v8-11, v12-15): a
    round's column step is G on the lanes as they are, its diagonal step G on b, c, d
    rotated left by 1, 2 and 3."""
    iv = tf.constant(np.array(_BLAKE2B_IV, np.uint64), _U64)
    zeros = tf.zeros_like(t)
    a, b = h[:, :4], h[:, 4:]
    c = tf.zeros_like(a) + iv[None, :4]
    flag = tf.where(last, tf.bitwise.invert(zeros), zeros)
    d = _xor(tf.zeros_like(a) + iv[None, 4:], tf.stack([t, zeros, flag, zeros], axis=1))
    for r in range(12):
        s = _BLAKE2B_SIGMA[r % 10]
        a, b, c, d = _g(a, b, c, d, tf.gather(m, s[0:8:2], axis=1), tf.gather(m, s[1:8:2], axis=1))
        b, c, d = (tf.gather(lane, _ROTATE[k], axis=1) for k, lane in ((1, b), (2, c), (3, d)))
        a, b, c, d = _g(
            a, b, c, d, tf.gather(m, s[8:16:2], axis=1), tf.gather(m, s[9:16:2], axis=1)
        )
        b, c, d = (tf.gather(lane, _ROTATE[-k], axis=1) for k, lane in ((1, b), (2, c), (3, d)))
    return _xor(h, tf.concat([_xor(a, c), _xor(b, d)], axis=1))


_ROTATE = {k: [(i + k) % 4 for i in range(4)] for k in (-3, -2, -1, 1, 2, 3)}


def _blake2b_8(messages: tf.Tensor) -> tf.Tensor:
    """The first 8 bytes (little-endian uint64) of `blake2b(msg, digest_size=8)` of each
    of `messages`, a tf.string (n,): hashlib's value, in TF ops (a while loop over
    128-byte blocks, every message at once)."""
    n = tf.size(messages, out_type=tf.int64)
    length = tf.cast(tf.strings.length(messages, unit="BYTE"), tf.int64)
    blocks = tf.maximum((length + _BLOCK - 1) // _BLOCK, 1)
    most = tf.reduce_max(tf.concat([blocks, tf.zeros([1], tf.int64)], axis=0))
    width = most * _BLOCK
    pad = tf.strings.reduce_join(tf.fill(tf.reshape(width, [1]), "\x00"))
    padded = tf.strings.substr(tf.strings.join([messages, pad]), 0, tf.cast(width, tf.int32))
    words = tf.reshape(
        tf.bitcast(tf.io.decode_raw(padded, tf.int64, little_endian=True), _U64),
        tf.stack([n, most * (_BLOCK // 8)]),
    )
    iv = tf.constant(np.array(_BLAKE2B_IV, np.uint64), _U64)
    # digest 8 bytes, no key, fanout and depth 1
    first = _xor(iv, tf.constant(np.array([0x01010008] + [0] * 7, np.uint64), _U64))
    h0 = tf.zeros(tf.stack([n, 8]), _U64) + first[None, :]

    def body(b: tf.Tensor, h: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        last = tf.equal(b, blocks - 1)
        t = tf.cast(tf.where(last, length, (b + 1) * _BLOCK), _U64)
        new = _blake2b_compress(h, words[:, b * 16 : (b + 1) * 16], t, last)
        return b + 1, tf.where((b < blocks)[:, None], new, h)

    _, h = tf.while_loop(
        lambda b, h: b < most,
        body,
        (tf.constant(0, tf.int64), h0),
        shape_invariants=(tf.TensorShape([]), tf.TensorShape([None, 8])),
    )
    return h[:, 0]


def id_hashes_tf(
    ids: tf.Tensor, *, blake2b_8: Callable[[tf.Tensor], tf.Tensor] = _blake2b_8
) -> tf.Tensor:
    """`lookup_table.core.hashing.id_hashes` in TF ops: int64 or tf.string (n,) -> uint64.

    `blake2b_8`: the string hash to call (the export passes one tf.function of
    `_blake2b_8`, so its loop is in the SavedModel once however many tables use it).
    """
    if ids.dtype == tf.string:
        return _mix64(blake2b_8(tf.strings.join([tf.constant("s"), ids])))
    return _mix64(_xor(tf.bitcast(tf.cast(ids, tf.int64), _U64), _u64(_INT_TAG)))


def _check_reproducible(spec: TableSpec) -> None:
    name = spec.initializer.name
    if name not in _EXACT_INITIALIZERS:
        raise ConfigError(
            f"table {spec.name!r}: its {name} initializer cannot be computed exactly in "
            f"TF ops (TF's log1p and cos are not numpy's), so unseen ids cannot get their "
            f"initial rows; export with unseen='zeros' (--unseen zeros): unseen ids then "
            f"get zero rows"
        )


def initial_rows_tf(
    spec: TableSpec, ids: tf.Tensor, *, blake2b_8: Callable[[tf.Tensor], tf.Tensor] = _blake2b_8
) -> tf.Tensor:
    """`initial_rows(spec.initializer, seed=spec.seed, ids=..., dim=spec.dim)` in TF ops,
    float32 (n, dim), bit for bit (zeros, constant, uniform).

    Raises:
        ConfigError: normal and truncated_normal (not reproducible exactly in TF ops).
    """
    init, dim = spec.initializer, spec.dim
    n = tf.size(ids)
    if init.name == "zeros":
        return tf.zeros(tf.stack([n, dim]), tf.float32)
    if init.name == "constant":
        return tf.fill(tf.stack([n, dim]), tf.constant(np.float32(init.params["value"])))
    _check_reproducible(spec)
    lo, hi = init.params["minval"], init.params["maxval"]
    salt = _u64(stable_hash(f"init-seed:{spec.seed}"))
    base = _mix64(_xor(id_hashes_tf(ids, blake2b_8=blake2b_8), salt))
    with np.errstate(over="ignore"):
        steps = (np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(_GOLDEN)).astype(np.uint64)
    bits = _mix64(base[:, None] + tf.constant(steps, _U64)[None, :])
    u = tf.cast(_shr(bits, 11), tf.float64) * tf.constant(2.0**-53, tf.float64)
    rows = tf.cast(tf.constant(lo, tf.float64) + tf.constant(hi - lo, tf.float64) * u, tf.float32)
    top = np.nextafter(np.float32(hi), np.float32(lo))  # Keras' interval is half-open
    return tf.minimum(rows, tf.constant(top, tf.float32))


# ---------------------------------------------------------------- one table in the SavedModel


class _TableLookup:
    """One table in the SavedModel: id -> row index (a DenseHashTable), the rows."""

    def __init__(
        self, source: TableRows, unseen: Unseen, blake2b_8: Callable[[tf.Tensor], tf.Tensor]
    ) -> None:
        spec = source.spec
        self.spec = spec
        self.unseen = unseen
        self.count = int(source.ids.shape[0])
        self.string = spec.id_type == "string"
        self.blake2b_8 = blake2b_8
        if unseen == "initializer":
            _check_reproducible(spec)
        _check_ids(source.ids, self.string, spec.name)
        if self.string:
            self.sentinels: tuple[Any, Any, Any] = (_EMPTY_STR, _DELETED_STR, _UNUSED_STR)
        else:
            self.sentinels = _int_sentinels(np.asarray(source.ids, np.int64))
        self.table = tf.lookup.experimental.DenseHashTable(
            key_dtype=tf.string if self.string else tf.int64,
            value_dtype=tf.int64,
            default_value=-1,
            empty_key=self.sentinels[0],
            deleted_key=self.sentinels[1],
            initial_num_buckets=_buckets(self.count),
            name=f"ids_{_safe_name(spec.name)}",
        )
        for start in range(0, self.count, _INSERT_CHUNK):
            stop = min(start + _INSERT_CHUNK, self.count)
            keys = _key_tensor(source.ids[start:stop], self.string)
            self.table.insert(keys, tf.range(start, stop, dtype=tf.int64))
        # The last row stays zeros. Filled in chunks with scatter_update, so the variable is
        # the only full copy TF makes (the source may be memory-mapped); a zeros initial
        # value or slice assignments cost a second copy of the rows (measured).
        shape = [self.count + 1, spec.dim]
        self.rows = tf.Variable(
            lambda: tf.zeros(shape, tf.float32),
            trainable=False,
            name=f"rows_{_safe_name(spec.name)}",
        )
        step = max(1, _CHUNK_BYTES // (4 * spec.dim))
        for start in range(0, self.count, step):
            stop = min(start + step, self.count)
            chunk = np.asarray(source.rows[start:stop], np.float32)
            self.rows.scatter_update(tf.IndexedSlices(chunk, tf.range(start, stop)))

    def ids_of(self, flat: tf.Tensor, where: str) -> tf.Tensor:
        """A layer's flat input as this table's key dtype (int64 or tf.string)."""
        if self.string:
            if flat.dtype != tf.string:
                raise ConfigError(
                    f"{where}: table {self.spec.name!r} has string ids but the layer gets "
                    f"{flat.dtype.name} ids"
                )
            return flat
        if not flat.dtype.is_integer:
            raise ConfigError(
                f"{where}: table {self.spec.name!r} has int64 ids but the layer gets "
                f"{flat.dtype.name} ids"
            )
        return tf.cast(flat, tf.int64)

    def rows_of(self, ids: tf.Tensor, wanted: tf.Tensor) -> tf.Tensor:
        """float32 (m, dim): each id's row; an unseen one's initial row (or zeros) where
        `wanted` (bool (m,)), zeros elsewhere."""
        empty, deleted, unused = (tf.constant(s, self.table.key_dtype) for s in self.sentinels)
        # the sentinels may not be looked up; they are never exported ids
        sentinel = tf.logical_or(tf.equal(ids, empty), tf.equal(ids, deleted))
        index = self.table.lookup(tf.where(sentinel, unused, ids))
        index.set_shape(ids.shape)
        found = index >= 0
        rows = tf.gather(self.rows, tf.where(found, index, self.count))
        if self.unseen == "zeros" or self.spec.initializer.name == "zeros":
            return rows
        need = tf.logical_and(tf.logical_not(found), wanted)
        fresh = initial_rows_tf(self.spec, tf.boolean_mask(ids, need), blake2b_8=self.blake2b_8)
        return tf.tensor_scatter_nd_update(rows, tf.where(need), fresh)


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name) or "_"


def _check_ids(ids: IdArray, string: bool, table: str) -> None:
    want = "an object array of str" if string else "an int64 array"
    if ids.ndim != 1 or (ids.shape[0] and ids.dtype != (object if string else np.int64)):
        raise ConfigError(f"table {table!r}: ids must be {want} (n,), got {ids.dtype} {ids.shape}")


def _key_tensor(ids: IdArray, string: bool) -> tf.Tensor:
    if string:
        return tf.constant([s.encode("utf-8") for s in ids.tolist()], tf.string, shape=[len(ids)])
    return tf.constant(np.asarray(ids, np.int64))


def _int_sentinels(ids: NDArray[np.int64]) -> tuple[int, int, int]:
    """The three smallest int64 values that are not among `ids` (the hash table's empty
    and deleted keys, and the key a query of either is replaced with)."""
    taken = set(ids[ids < _INT64_MIN + ids.shape[0] + 3].tolist())
    free: list[int] = []
    value = _INT64_MIN
    while len(free) < 3:
        if value not in taken:
            free.append(value)
        value += 1
    return free[0], free[1], free[2]


# ---------------------------------------------------------------- the layers in the export


def _embedding_layers(model: keras.Model) -> list[DistributedEmbedding]:
    from lookup_table.layer import DistributedEmbedding

    return [
        layer
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, DistributedEmbedding)
    ]


def _padding(layer: DistributedEmbedding, string: bool) -> tf.Tensor | None:
    """The layer's padding id as a constant of the table's key dtype; None if it has
    none or one of the other type (which, as in training, matches no id)."""
    pad = layer.padding_id
    if pad is None:
        return None
    if isinstance(pad, bool) or not isinstance(pad, int | np.integer | str):
        raise ConfigError(f"layer {layer.name!r}: padding_id must be an int or a str, got {pad!r}")
    if string:
        return tf.constant(pad.encode("utf-8"), tf.string) if isinstance(pad, str) else None
    return None if isinstance(pad, str) else tf.constant(int(pad), tf.int64)


def _serving_call(
    layer: DistributedEmbedding, lookup: _TableLookup, call: Callable[..., Any]
) -> Callable[..., Any]:
    """The layer's call in the export: its rows come from `lookup` (graph ops) and are fed
    to the layer's own graph code (`DistributedEmbedding.feed`), which gathers and
    combines exactly as in training."""
    where = f"layer {layer.name!r}"

    def serving_call(inputs: Any, sparse_weights: Any = None, training: bool = False) -> Any:
        if isinstance(inputs, tf.SparseTensor):
            flat = inputs.values
        elif isinstance(inputs, tf.RaggedTensor):
            flat = inputs.flat_values
        else:
            flat = tf.reshape(tf.convert_to_tensor(inputs), [-1])
        ids = lookup.ids_of(flat, where)
        size = tf.size(ids, out_type=tf.int64)
        keep = tf.ones(tf.reshape(size, [1]), tf.bool)
        pad = _padding(layer, lookup.string)
        if pad is not None:
            keep = tf.not_equal(ids, pad)
        weights = None
        if isinstance(inputs, tf.SparseTensor) and sparse_weights is not None:
            weights = tf.cast(sparse_weights.values, tf.float32)
            # as the layer: mean and sqrtn prune weights <= 0, sum only zero weights
            keep &= tf.not_equal(weights, 0.0) if layer.combiner == "sum" else weights > 0.0
        rows = lookup.rows_of(ids, keep)
        table = tf.concat([rows, tf.zeros([1, layer.dim], tf.float32)], axis=0)
        index = tf.where(keep, tf.range(size), size)
        if weights is not None:
            return _weighted_sparse(layer, inputs, weights, table, index, size)
        layer.feed(inputs, table, index)
        try:
            out = call(inputs, training=training)
        finally:
            layer.end_step()
        if not layer.fed:
            raise RuntimeError(f"{where} did not take the exported rows (a bug)")
        return out

    return serving_call


def _weighted_sparse(
    layer: DistributedEmbedding,
    inputs: tf.SparseTensor,
    weights: tf.Tensor,
    table: tf.Tensor,
    index: tf.Tensor,
    num_rows: tf.Tensor,
) -> tf.Tensor:
    """A SparseTensor with `sparse_weights`, which `feed` does not take: the same ops as
    the layer's graph code (`DistributedEmbedding._call_graph`) on the exported rows."""
    if layer.combiner is None:
        raise ConfigError(
            f"layer {layer.name!r} got a SparseTensor: pass combiner='sum', 'mean' or 'sqrtn'"
        )
    segments = inputs.indices[:, 0]
    groups = inputs.dense_shape[0]
    emb = tf.gather(table, index)
    from lookup_table.layer import combine_segments

    w = weights * tf.cast(index < num_rows, tf.float32)
    return combine_segments(emb * w[:, None], w, segments, groups, layer.combiner)


class _NoRows:
    """The row source of a layer during the export: its rows come from the SavedModel."""

    def rows(self, table: str, ids: IdArray, *, training: bool) -> NDArray[np.float32]:
        raise RuntimeError(f"an exported layer of table {table!r} looked up rows (a bug)")


@contextlib.contextmanager
def _serving_layers(
    layers: Sequence[DistributedEmbedding], lookups: Mapping[str, _TableLookup]
) -> Iterator[None]:
    """While tracing the export: every layer's call reads its table's exported rows."""
    saved = [(layer, getattr(layer, "_source", None)) for layer in layers]
    try:
        for layer in layers:
            if getattr(layer, "_source", None) is None:
                layer.bind(_NoRows())  # the layer refuses to run unbound
            # an instance attribute: Keras' __call__ calls `self.call`
            object.__setattr__(
                layer, "call", _serving_call(layer, lookups[layer.table], layer.call)
            )
        yield
    finally:
        for layer, source in saved:
            if "call" in vars(layer):
                object.__delattr__(layer, "call")
            layer.bind(source)


# ---------------------------------------------------------------- the signature


@dataclass(frozen=True, slots=True)
class _Input:
    """One Keras input and the signature tensors it is sent as."""

    name: str
    kind: Literal["dense", "ragged", "sparse"]
    specs: tuple[tf.TensorSpec, ...]

    def build(self, tensors: Mapping[str, tf.Tensor]) -> Any:
        got = [tensors[s.name] for s in self.specs]
        if self.kind == "dense":
            return got[0]
        if self.kind == "ragged":
            return tf.RaggedTensor.from_row_lengths(got[0], got[1], validate=True)
        return tf.SparseTensor(got[0], got[1], got[2])


def _inputs(model: keras.Model) -> list[_Input]:
    keras_inputs = getattr(model, "inputs", None)
    if not keras_inputs:
        raise ConfigError(
            f"model {model.name!r} has no known inputs: export a functional or Sequential "
            f"model built from keras.Input"
        )
    out: list[_Input] = []
    for kt in keras_inputs:
        name, dtype = kt.name, tf.as_dtype(kt.dtype)
        shape = tuple(kt.shape)
        if getattr(kt, "sparse", False):
            rank = len(shape)
            specs: tuple[tf.TensorSpec, ...] = (
                tf.TensorSpec([None, rank], tf.int64, name=f"{name}_indices"),
                tf.TensorSpec([None], dtype, name=f"{name}_values"),
                tf.TensorSpec([rank], tf.int64, name=f"{name}_dense_shape"),
            )
            out.append(_Input(name, "sparse", specs))
        elif getattr(kt, "ragged", False):
            specs = (
                tf.TensorSpec([None, *shape[2:]], dtype, name=f"{name}_values"),
                tf.TensorSpec([None], tf.int64, name=f"{name}_row_lengths"),
            )
            out.append(_Input(name, "ragged", specs))
        else:
            out.append(_Input(name, "dense", (tf.TensorSpec(shape, dtype, name=name),)))
    names = [s.name for i in out for s in i.specs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ConfigError(
            f"the signature's inputs {clash} clash (a ragged or sparse input sends "
            f"<name>_values, ...): rename the Keras inputs"
        )
    return out


def _outputs(model: keras.Model, result: Any) -> dict[str, tf.Tensor]:
    if isinstance(result, Mapping):
        named = dict(result)
    else:
        flat = keras.tree.flatten(result)
        names = list(getattr(model, "output_names", None) or [])
        if len(names) != len(flat) or len(set(names)) != len(names):
            names = [f"output_{i}" for i in range(len(flat))]
        named = dict(zip(names, flat, strict=True))
    for name, value in named.items():
        if not isinstance(value, tf.Tensor):
            raise ConfigError(
                f"model output {name!r} is a {type(value).__name__}; a SavedModel signature "
                f"returns dense tensors (e.g. use a combiner, or .to_tensor())"
            )
    return named


# ---------------------------------------------------------------- the export


def export_saved_model(
    model: keras.Model,
    path: str | os.PathLike[str],
    *,
    rows: Mapping[str, TableRows] | None = None,
    config: ClusterConfig | None = None,
    ids: Mapping[str, Any] | None = None,
    unseen: Unseen = "initializer",
    memory_limit_bytes: int | None = None,
) -> dict[str, Any]:
    """Write `model` as a TF SavedModel that serves without this project (module docstring).

    The rows of its `DistributedEmbedding` tables come from exactly one source:

    * nothing given: the model must be bound to its cluster (compiled with
      `RemoteOptimizer`, or its layers bound by `trainer.Trainer`). Its pushes are
      waited for, the replicas paused (they write what they hold behind), every row of
      the namespace and the dense parameters saved as a checkpoint into a temporary
      sibling of `path`, the replicas resumed, and the export made from that snapshot:
      rows and dense weights of one instant (the model's trainable weights are set to
      the snapshot's; a cluster without dense parameters yet keeps the model's). Needs
      disk for the checkpoint (rows and optimizer slots) while it runs.
    * `rows`: table -> `TableRows`, e.g. `lookup_table.ops.checkpoint.checkpoint_rows(dir)`;
    * `config` and `ids`: table -> the ids to include, read from the live cluster with
      the store (`get`: nothing is written; ids without a row are left out, so they
      are served as unseen) while the replicas are paused (after the bound model's
      pushes, if it is bound to this cluster).

    With `rows` or `ids`, the dense weights are the model's, as they are now.

    Args:
        model: a functional or Sequential Keras model (built from `keras.Input`).
        path: the SavedModel directory to create (e.g. `models/ctr/1` for TF Serving);
            it must not exist, or be empty. Written to a temporary sibling and renamed.
        unseen: "initializer" (an unseen id gets its table's initial row, as the
            cluster answers with `create=False`) or "zeros".
        memory_limit_bytes: refuse an export needing more; None: the memory available.

    Returns:
        {"path", "bytes", "tables": {table: rows}, "inputs": [...], "outputs": [...]}.

    Raises:
        ExportTooLargeError: it would not fit in memory (nothing read or written).
        ConfigError: a bad argument, a table missing from the source, a layer whose
            dim or id type does not fit its table, a target that exists, no source
            given for a model that is not bound to a cluster.
        CheckpointError: the snapshot failed (a replica could not write what it holds).
        DataLossError, NodeUnavailableError, ...: reading from the cluster failed.
    """
    if unseen not in UNSEEN:
        raise ConfigError(f"unseen must be 'initializer' or 'zeros', got {unseen!r}")
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"{target} already exists and is not an empty directory; export into a new one "
            f"(e.g. the next version number for TF Serving)"
        )
    layers = _embedding_layers(model)
    inputs = _inputs(model)
    wanted = sorted({layer.table for layer in layers})
    bound = _bound(model, layers)
    if rows is None and config is None and ids is None:
        return _export_snapshot(
            model, target, bound, wanted, unseen=unseen, memory_limit_bytes=memory_limit_bytes
        )
    session = None if bound is None else bound[1]
    if session is not None and config is not None and session.config.namespace == config.namespace:
        session.settle_pushes()  # the read must see what this model pushed
    sources = _sources(
        wanted, rows=rows, config=config, ids=ids, unseen=unseen, limit=memory_limit_bytes
    )
    for layer in layers:
        spec = sources[layer.table].spec
        if spec.dim != layer.dim:
            raise ConfigError(
                f"layer {layer.name!r} expects dim={layer.dim} but table {layer.table!r} "
                f"has dim={spec.dim}"
            )
    # one string hash for every table: its loop is in the SavedModel once
    blake2b_8 = tf.function(
        _blake2b_8, input_signature=[tf.TensorSpec([None], tf.string)], autograph=False
    )
    lookups = {name: _TableLookup(sources[name], unseen, blake2b_8) for name in wanted}
    holder = tf.Module(name="lookup_tables")  # what the SavedModel saves of them
    holder.hash_tables = [lookups[name].table for name in wanted]
    holder.rows = [lookups[name].rows for name in wanted]
    names = [s.name for i in inputs for s in i.specs]
    output_names: list[str] = []

    def serve(*args: tf.Tensor) -> dict[str, tf.Tensor]:
        tensors = dict(zip(names, args, strict=True))
        built = {i.name: i.build(tensors) for i in inputs}
        structure = keras.tree.map_structure(lambda kt: built[kt.name], model.input)
        with _serving_layers(layers, lookups):
            result = _outputs(model, model(structure, training=False))
        output_names[:] = sorted(result)
        return result

    specs = [s for i in inputs for s in i.specs]
    created = [p for p in target.parents if not p.exists()]  # innermost first
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        archive = keras.export.ExportArchive()
        # The layers, not the model: tracking a model traces its default signature with
        # the layers' own lookups. Their variables, and resources such as a StringLookup's
        # table, are what the SavedModel needs of them.
        for layer in model._flatten_layers(include_self=False):
            if not isinstance(layer, keras.Model) and layer not in layers:
                archive.track(layer)
        archive.track(holder)
        archive.add_endpoint("serving_default", serve, input_signature=specs)
        archive.write_out(str(tmp), verbose=False)
        if target.exists():
            target.rmdir()  # checked empty above
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return {
        "path": str(target),
        "bytes": size,
        "tables": {name: lookups[name].count for name in wanted},
        "inputs": names,
        "outputs": output_names,
    }


def _bound(
    model: keras.Model, layers: Sequence[DistributedEmbedding]
) -> tuple[ClusterConfig, TrainingSession | None] | None:
    """The cluster `model` is bound to and the open session that trains it, if any: its
    `RemoteOptimizer`'s (None before its first fit, evaluate or predict), or the
    `trainer.Trainer` its layers are bound to."""
    from lookup_table.remote import RemoteOptimizer
    from lookup_table.session import TrainingSession

    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, RemoteOptimizer):
        session = optimizer.session
        return optimizer.config, None if session is None or session.closed else session
    sessions = [
        layer.source
        for layer in layers
        if isinstance(layer.source, TrainingSession) and not layer.source.closed
    ]
    namespaces = sorted({s.config.namespace for s in sessions})
    if len(namespaces) > 1:
        raise ConfigError(
            f"model {model.name!r}: its layers are bound to sessions of namespaces "
            f"{namespaces}; an export reads one cluster: pass rows=checkpoint_rows(dir)"
        )
    return (sessions[0].config, sessions[0]) if sessions else None


def _export_snapshot(
    model: keras.Model,
    target: Path,
    bound: tuple[ClusterConfig, TrainingSession | None] | None,
    wanted: Sequence[str],
    *,
    unseen: Unseen,
    memory_limit_bytes: int | None,
) -> dict[str, Any]:
    """`export_saved_model` of a bound model: a checkpoint of its cluster into a temporary
    sibling of `target`, exported with its rows and dense weights, then removed."""
    from lookup_table.ops.checkpoint import export_checkpoint_saved_model, save_checkpoint

    if bound is None:
        raise ConfigError(
            f"model {model.name!r} is not bound to a cluster, so there are no rows to export: "
            f"compile it with optimizer=lookup_table.keras.RemoteOptimizer(config) (or train "
            f"it with trainer.Trainer) and call lookup_table.keras.export_saved_model(model, "
            f"path), or pass rows=lookup_table.ops.checkpoint.checkpoint_rows(checkpoint_dir), "
            f"or config= and ids={{table: ids}}"
        )
    config, session = bound
    for name in wanted:
        spec = config.table(name)
        if unseen == "initializer":
            _check_reproducible(spec)
    if session is not None:
        session.settle_pushes()
    snapshot = target.with_name(f".{target.name}.snapshot-{uuid.uuid4().hex[:8]}")
    try:
        manifest = save_checkpoint(config, snapshot, progress=False)
        dense = "checkpoint" if manifest.get("dense") is not None else "model"
        result = export_checkpoint_saved_model(
            snapshot,
            model,
            target,
            dense=dense,
            unseen=unseen,
            memory_limit_bytes=memory_limit_bytes,
        )
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)
    logger.info(
        "exported %s from a snapshot of namespace %r (dense weights from the %s)",
        target,
        config.namespace,
        "snapshot" if dense == "checkpoint" else "model",
    )
    return result


def _sources(
    wanted: Sequence[str],
    *,
    rows: Mapping[str, TableRows] | None,
    config: ClusterConfig | None,
    ids: Mapping[str, Any] | None,
    unseen: Unseen,
    limit: int | None,
) -> dict[str, TableRows]:
    """The rows of every table in `wanted`, from `rows` or read from the cluster, after
    checking that unseen ids can be served and that the export fits in memory."""
    if rows is None and (config is None or ids is None) or rows is not None and ids is not None:
        raise ConfigError(
            "pass the rows to export as rows=checkpoint_rows(dir), or as config= and "
            "ids={table: ids} to read from the cluster (exactly one of them), or neither "
            "for a model bound to its cluster (export_saved_model(model, path))"
        )
    if rows is not None:
        missing = [t for t in wanted if t not in rows]
        if missing:
            raise ConfigError(
                f"the model's tables {missing} are not in rows (it has {sorted(rows)})"
            )
        for name in wanted:
            got = rows[name]
            if got.rows.shape != (got.ids.shape[0], got.spec.dim):
                raise ConfigError(
                    f"table {name!r}: rows of shape {got.rows.shape} for {got.ids.shape[0]} "
                    f"ids of dim {got.spec.dim}"
                )
        if unseen == "initializer":
            for t in wanted:
                _check_reproducible(rows[t].spec)
        needed = sum(_estimate(rows[t].spec, rows[t].ids) for t in wanted)
        check_export_memory(needed, limit_bytes=limit)
        return {t: rows[t] for t in wanted}
    if config is None or ids is None:  # checked above (for mypy)
        raise ConfigError("config and ids are both needed")
    missing = [t for t in wanted if t not in ids]
    if missing:
        raise ConfigError(
            f"ids has no entry for the model's tables {missing}; pass the ids to export of "
            f"every table (an empty list serves all its ids as unseen)"
        )
    specs = {t: config.table(t) for t in wanted}
    if unseen == "initializer":
        for spec in specs.values():
            _check_reproducible(spec)
    chosen: dict[str, IdArray] = {}
    for t in wanted:
        given = as_ids(ids[t], table=t)
        # np.unique keeps the dtype: int64 or object
        chosen[t] = given if given.shape[0] == 0 else cast(IdArray, np.unique(given))
    needed = sum(_estimate(specs[t], chosen[t]) for t in wanted)
    check_export_memory(needed, limit_bytes=limit)
    read = _read_rows(config, chosen)
    out: dict[str, TableRows] = {}
    for t in wanted:
        values, found = read.pop(t)  # not two copies of the rows at once
        kept = values if found.all() else values[found]
        out[t] = TableRows(spec=specs[t], ids=chosen[t][found], rows=kept)
    return out


def _estimate(spec: TableSpec, ids: IdArray) -> int:
    id_bytes = sum(len(s.encode("utf-8")) for s in ids.tolist()) if spec.id_type == "string" else 0
    return estimate_export_bytes(
        count=int(ids.shape[0]), dim=spec.dim, id_type=spec.id_type, id_bytes=id_bytes
    )


def _read_rows(
    config: ClusterConfig, ids: Mapping[str, IdArray]
) -> dict[str, tuple[NDArray[np.float32], NDArray[np.bool_]]]:
    """Rows of unique `ids` per table with the store (one request per node; nothing
    written) while the optimizer replicas are paused (they write the rows they hold
    behind first), on a loop of its own (the caller may be inside one)."""
    from lookup_table.ops.checkpoint.pipeline import run_blocking
    from lookup_table.ops.checkpoint.save import paused_replicas
    from lookup_table.store import EmbeddingStore, TableRead

    names = list(ids)

    async def read() -> list[tuple[NDArray[np.float32], NDArray[np.bool_]]]:
        async with EmbeddingStore(config) as store, paused_replicas(config) as held:
            got = await store.get_many([TableRead(t, ids[t]) for t in names], unique=True)
            held.check("the export's read")
            return got

    return dict(zip(names, run_blocking(read()), strict=True))
