"""The store's id hashes and initial rows in TF ops, bit for bit, for a SavedModel.

`id_hashes_tf` is `lookup_table.core.hashing.id_hashes` (BLAKE2b of string ids written in
TF ops) and `initial_rows_tf` the rows the cluster answers for an id it does not hold,
so a served model answers an unseen id as the cluster does, without this project.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from lookup_table.config import TableSpec
from lookup_table.core.hashing import stable_hash
from lookup_table.errors import ConfigError

__all__ = ["blake2b_8_tf", "check_reproducible", "id_hashes_tf", "initial_rows_tf"]

_EXACT_INITIALIZERS = ("zeros", "constant", "uniform")
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


def blake2b_8_tf(messages: tf.Tensor) -> tf.Tensor:
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
    ids: tf.Tensor, *, blake2b_8: Callable[[tf.Tensor], tf.Tensor] = blake2b_8_tf
) -> tf.Tensor:
    """`lookup_table.core.hashing.id_hashes` in TF ops: int64 or tf.string (n,) -> uint64.

    `blake2b_8`: the string hash to call (the export passes one tf.function of
    `blake2b_8_tf`, so its loop is in the SavedModel once however many tables use it).
    """
    if ids.dtype == tf.string:
        return _mix64(blake2b_8(tf.strings.join([tf.constant("s"), ids])))
    return _mix64(_xor(tf.bitcast(tf.cast(ids, tf.int64), _U64), _u64(_INT_TAG)))


def check_reproducible(spec: TableSpec) -> None:
    """Refuse a table whose unseen ids cannot get their initial rows in TF ops.

    Raises:
        ConfigError: normal and truncated_normal, naming unseen='zeros' as the way out.
    """
    name = spec.initializer.name
    if name not in _EXACT_INITIALIZERS:
        raise ConfigError(
            f"table {spec.name!r}: its {name} initializer cannot be computed exactly in "
            f"TF ops (TF's log1p and cos are not numpy's), so unseen ids cannot get their "
            f"initial rows; export with unseen='zeros' (--unseen zeros): unseen ids then "
            f"get zero rows"
        )


def initial_rows_tf(
    spec: TableSpec, ids: tf.Tensor, *, blake2b_8: Callable[[tf.Tensor], tf.Tensor] = blake2b_8_tf
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
    check_reproducible(spec)
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
