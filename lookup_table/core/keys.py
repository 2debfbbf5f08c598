"""The key codec: ids <-> memcached keys (pure; numpy + stdlib).

`{namespace}/{table}/{kind}/{encoded id}`: an int64 id as `i` + 11 base64url digits of its
64 bits (fixed width, so a batch is one uint8 matrix; characters memcached's metadump
prints as they are), a str id as `s` + its percent-encoded UTF-8, so `7` and `"7"`
differ and `decode_key` recovers the id. docs/wire-format.md is the format;
an id that cannot fit 250 bytes raises `KeyEncodingError` naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeAlias, cast
from urllib.parse import quote, unquote

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.jit import compiled
from lookup_table.errors import KeyEncodingError

__all__ = [
    "INT_ID_BYTES",
    "INT_ID_DIGITS",
    "MAX_KEY_BYTES",
    "MAX_KIND_BYTES",
    "MAX_NAME_BYTES",
    "DecodedKey",
    "IdArray",
    "IdBodies",
    "as_ids",
    "decode_int_digits",
    "decode_key",
    "encode_key",
    "encode_keys",
    "id_bodies",
    "id_text",
    "int_key_matrix",
    "key_prefix",
    "prefixed_keys",
    "validate_name",
]

MAX_KEY_BYTES = 250
INT_ID_DIGITS = 11  # base64url digits of an int64 (66 bits: the first digit is at most 15)
INT_ID_BYTES = 1 + INT_ID_DIGITS  # "i" + the digits
MAX_NAME_BYTES = 64  # a namespace or table name (ASCII, so bytes = characters)
MAX_KIND_BYTES = 4  # a key kind: 1-4 lowercase letters
_NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NAME_BYTES - 1}}}\Z")
_RESERVED_RE = re.compile(rf"_[A-Za-z0-9_.-]{{0,{MAX_NAME_BYTES - 1}}}\Z")
_KIND_RE = re.compile(rf"[a-z]{{1,{MAX_KIND_BYTES}}}\Z")
_SAFE_RE = re.compile(r"[A-Za-z0-9_.~-]*\Z")
_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_B64_DIGITS = np.frombuffer(_B64_ALPHABET, dtype=np.uint8)
_B64_VALUES = np.full(256, 255, dtype=np.uint8)
_B64_VALUES[_B64_DIGITS] = np.arange(64, dtype=np.uint8)
_SHIFTS = np.arange(6 * (INT_ID_DIGITS - 1), -1, -6, dtype=np.uint64)  # 60, 54, ..., 0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

IdArray: TypeAlias = "NDArray[np.int64] | NDArray[np.object_]"
"""A batch of ids: int64 (n,), or an object array (n,) of str."""


def validate_name(name: object, what: str, *, reserved_ok: bool = False) -> str:
    """Check a namespace or table name; return it.

    Raises:
        KeyEncodingError: the name would not make a safe, parseable key.
    """
    if isinstance(name, str) and (
        _NAME_RE.match(name) or (reserved_ok and _RESERVED_RE.match(name))
    ):
        return name
    raise KeyEncodingError(
        f"{what} must be 1-{MAX_NAME_BYTES} characters of A-Z a-z 0-9 _ . - starting with a "
        f"letter or digit; got {name!r}"
    )


@lru_cache(maxsize=1024)
def key_prefix(namespace: str, table: str, kind: str) -> bytes:
    """`b"{namespace}/{table}/{kind}/"`, validated once and cached."""
    validate_name(namespace, "namespace")
    validate_name(table, "table name", reserved_ok=True)
    if not _KIND_RE.match(kind):
        raise KeyEncodingError(
            f"key kind must be 1-{MAX_KIND_BYTES} lowercase letters; got {kind!r}"
        )
    prefix = f"{namespace}/{table}/{kind}/".encode("ascii")
    if len(prefix) + INT_ID_BYTES > MAX_KEY_BYTES:  # unreachable with 64-char names; kept honest
        raise KeyEncodingError(f"key prefix {prefix!r} leaves no room for an id")
    return prefix


def id_text(value: object) -> str:
    """An id (or any value) for a message: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def as_ids(ids: Any, *, table: str | None = None) -> IdArray:
    """Normalize a batch of ids to int64 (n,) or an object array (n,) of str.

    Accepts numpy arrays (any integer dtype that fits int64, str, bytes, object),
    lists and tuples. bytes ids are decoded as UTF-8, so a `tf.string` tensor's
    b"banana" is the same id as "banana". Floats, bools and mixtures of ints and
    strs are refused: silently casting 1.5 to 1 would alias two features.

    Raises:
        KeyEncodingError: with the offending value and its position.
    """
    where = f" for table {table!r}" if table else ""
    if isinstance(ids, str | bytes):
        ids = [ids]
    if isinstance(ids, list | tuple) and any(
        issubclass(t, str | bytes | bool | np.bool_) for t in set(map(type, ids))
    ):
        # np.asarray would read [1, "a"] as strs and [1, True] as ints, and strip the
        # trailing NULs of strs ("a\x00" -> "a"): check such lists value by value.
        return _object_ids(list(ids), where)
    arr = np.asarray(ids) if not isinstance(ids, np.ndarray) else ids
    if arr.ndim != 1:
        if arr.ndim == 0:
            arr = arr.reshape(1)
        else:
            raise KeyEncodingError(f"ids{where} must be 1-D; got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "i":
        return arr.astype(np.int64, copy=False)
    if kind == "u":
        if arr.size and arr.max() > _INT64_MAX:
            bad = int(arr[arr > _INT64_MAX][0])
            raise KeyEncodingError(f"id {bad}{where} does not fit in int64")
        return arr.astype(np.int64)
    if kind == "U":
        return np.array(arr.tolist(), dtype=object) if arr.size else arr.astype(object)
    if kind in "SO":
        return _object_ids(arr.tolist(), where)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    sample = arr.reshape(-1)[0]
    raise KeyEncodingError(
        f"ids{where} must be int64 or str; got dtype {arr.dtype} (e.g. {id_text(sample)})"
    )


def _object_ids(values: list[Any], where: str) -> IdArray:
    if not values:
        return np.empty(0, dtype=np.int64)
    first = values[0]
    if isinstance(first, str | bytes):
        out: list[str] = []
        for i, v in enumerate(values):
            if isinstance(v, str):
                out.append(v)
            elif isinstance(v, bytes):
                try:
                    out.append(v.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise KeyEncodingError(
                        f"id {id_text(v)} at position {i}{where} is bytes that are not UTF-8"
                    ) from exc
            else:
                raise KeyEncodingError(
                    f"ids{where} mix str and {type(v).__name__}: {id_text(v)} at position {i}"
                )
        arr = np.empty(len(out), dtype=object)
        arr[:] = out
        return arr
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise KeyEncodingError(
                f"ids{where} must be all int64 or all str; got {id_text(v)} "
                f"({type(v).__name__}) at position {i}"
            )
        if not _INT64_MIN <= int(v) <= _INT64_MAX:
            raise KeyEncodingError(f"id {int(v)} at position {i}{where} does not fit in int64")
    return np.array(values, dtype=np.int64)


def _write_int_bodies(out: NDArray[np.uint8], ids: NDArray[np.int64]) -> None:
    """Write `i` + the 11 base64url digits of each int id into `out` (n, 12), compiled:
    numpy's way goes through an (n, 11) uint64 array and a gather (a flush places every
    row written behind)."""
    bits = np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)
    if out.shape != (bits.shape[0], INT_ID_BYTES) or out.dtype != np.uint8:
        raise ValueError(f"int id bodies go into uint8 ({bits.shape[0]}, 12), not {out.shape}")
    _int_bodies(out, bits, _B64_DIGITS)


_U8_C = types.Array(types.uint8, 2, "C")
_U8_A = types.Array(types.uint8, 2, "A")
_DIGITS = types.Array(types.uint8, 1, "C", readonly=True)


@compiled(
    [
        types.void(out, bits, _DIGITS)
        for out in (_U8_C, _U8_A)
        for bits in (types.Array(types.uint64, 1, "C"), types.Array(types.uint64, 1, "C", True))
    ]
)
def _int_bodies(out, bits, digits):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`i`, then 6 bits a digit from the top (60, 54, ..., 0): `_SHIFTS`' order."""
    for i in range(bits.shape[0]):
        b = bits[i]
        row = out[i]
        row[0] = 105  # "i"
        for d in range(INT_ID_DIGITS):
            row[1 + d] = digits[(b >> np.uint64(60 - 6 * d)) & np.uint64(63)]


def decode_int_digits(digits: NDArray[np.uint8]) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """The int64 ids of rows of 11 base64url digits (n, 11), and which rows are such
    digits as `int_key_matrix` writes them (the others' ids are meaningless). No loop."""
    values = _B64_VALUES[digits]
    ok = (values.max(axis=1, initial=0) < 64) & (values[:, 0] < 16)
    bits = (values.astype(np.uint64) & np.uint64(63)) << _SHIFTS
    return np.bitwise_or.reduce(bits, axis=1).view(np.int64), ok


def int_key_matrix(prefix: bytes, ids: NDArray[np.int64]) -> NDArray[np.uint8]:
    """Keys of int ids as a uint8 matrix (n, len(prefix) + 12), one key per row. No loop."""
    out = np.empty((ids.shape[0], len(prefix) + INT_ID_BYTES), dtype=np.uint8)
    out[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    _write_int_bodies(out[:, len(prefix) :], ids)
    return out


def _str_body(value: str, table: str) -> bytes:
    try:
        body = value if _SAFE_RE.match(value) else quote(value, safe="", errors="strict")
        return b"s" + body.encode("ascii")
    except UnicodeEncodeError as exc:
        raise KeyEncodingError(
            f"id {id_text(value)} of table {table!r} is not valid Unicode text "
            f"(it cannot be encoded as UTF-8: {exc.reason})"
        ) from exc


def _too_long(value: str, key_bytes: int, table: str) -> KeyEncodingError:
    return KeyEncodingError(
        f"id {id_text(value)} of table {table!r} is too long for a memcached key: the key "
        f"would be {key_bytes} bytes, over the limit of {MAX_KEY_BYTES}; shorten or hash long "
        f"ids (e.g. hashlib.blake2b(id).hexdigest()) before looking them up"
    )


def _encode_str_id(value: str, prefix: bytes, table: str) -> bytes:
    key = prefix + _str_body(value, table)
    if len(key) > MAX_KEY_BYTES:
        raise _too_long(value, len(key), table)
    return key


@dataclass(frozen=True, slots=True, eq=False)
class IdBodies:
    """The encoded ids of a batch: each key without its `{namespace}/{table}/{kind}/` prefix.

    Encoded once and joined with the prefix of every kind (`prefixed_keys`), so rows
    and slots of the same ids share the work. `bodies` is a uint8 matrix (n, 12) for
    int ids, a list of bytes for str ids; `longest` is the longest body in bytes.
    """

    ids: IdArray
    table: str
    bodies: NDArray[np.uint8] | list[bytes]
    longest: int

    def check_prefix(self, prefix: bytes) -> None:
        """Raise if a key of `prefix` + a body would exceed MAX_KEY_BYTES.

        Raises:
            KeyEncodingError: naming the first id that does not fit.
        """
        if len(prefix) + self.longest <= MAX_KEY_BYTES:
            return
        if isinstance(self.bodies, np.ndarray):  # unreachable: key_prefix leaves room
            raise KeyEncodingError(f"key prefix {prefix!r} leaves no room for an id")
        for i, body in enumerate(self.bodies):
            if len(prefix) + len(body) > MAX_KEY_BYTES:
                raise _too_long(str(self.ids[i]), len(prefix) + len(body), self.table)


def id_bodies(table: str, ids: IdArray) -> IdBodies:
    """Encode a batch of ids once, for keys of any kind (`prefixed_keys`).

    Raises:
        KeyEncodingError: a str id that is not valid Unicode text.
    """
    if ids.dtype == np.int64:  # a dtype comparison does not narrow the union for mypy
        bodies = np.empty((ids.shape[0], INT_ID_BYTES), dtype=np.uint8)
        _write_int_bodies(bodies, cast("NDArray[np.int64]", ids))
        return IdBodies(ids=ids, table=table, bodies=bodies, longest=INT_ID_BYTES)
    encoded = [_str_body(s, table) for s in ids.tolist()]
    return IdBodies(ids=ids, table=table, bodies=encoded, longest=max(map(len, encoded), default=0))


def prefixed_keys(
    prefix: bytes | NDArray[np.uint8],
    bodies: NDArray[np.uint8] | list[bytes],
    index: NDArray[np.intp] | None = None,
) -> NDArray[np.uint8] | list[bytes]:
    """Keys `prefix + body` of the bodies at `index` (default: all), in that order.

    A uint8 matrix (m, len(prefix) + 12) for int bodies, a list of bytes for str
    bodies. `prefix` may be each body's own, a uint8 matrix (n, prefix length) aligned
    with the bodies (int bodies only: the ids of several tables of one prefix length).
    The caller has checked the lengths (`IdBodies.check_prefix`).
    """
    if isinstance(prefix, np.ndarray):
        if not isinstance(bodies, np.ndarray):
            raise ValueError("each body's own prefix: int bodies only")
        width = prefix.shape[1]
        rows = bodies if index is None else bodies[index]
        out = np.empty((rows.shape[0], width + rows.shape[1]), dtype=np.uint8)
        out[:, :width] = prefix if index is None else prefix[index]
        out[:, width:] = rows
        return out
    if isinstance(bodies, np.ndarray):
        picked = bodies if index is None else bodies[index]
        out = np.empty((picked.shape[0], len(prefix) + picked.shape[1]), dtype=np.uint8)
        out[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        out[:, len(prefix) :] = picked
        return out
    chosen = bodies if index is None else [bodies[i] for i in index.tolist()]
    return [prefix + body for body in chosen]


def encode_keys(namespace: str, table: str, kind: str, ids: IdArray) -> list[bytes]:
    """Keys of a batch of ids, in order."""
    prefix = key_prefix(namespace, table, kind)
    if ids.dtype == np.int64:  # a dtype comparison does not narrow the union for mypy
        matrix = int_key_matrix(prefix, cast("NDArray[np.int64]", ids))
        width = matrix.shape[1]
        flat = matrix.tobytes()
        return [flat[i : i + width] for i in range(0, len(flat), width)]
    return [_encode_str_id(s, prefix, table) for s in ids.tolist()]


def encode_key(namespace: str, table: str, kind: str, id_: int | str) -> bytes:
    """The key of one id."""
    return encode_keys(namespace, table, kind, as_ids([id_], table=table))[0]


@dataclass(frozen=True, slots=True)
class DecodedKey:
    """The parts of a key; `id` is an int or a str, exactly as it was encoded."""

    namespace: str
    table: str
    kind: str
    id: int | str


def decode_key(key: bytes | str) -> DecodedKey:
    """Invert the key codec.

    Raises:
        KeyEncodingError: the key was not produced by this codec.
    """
    raw = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise KeyEncodingError(f"not a lookup-table key (non-ASCII): {raw!r}") from None
    parts = text.split("/", 3)
    if len(parts) != 4:
        raise KeyEncodingError(f"not a lookup-table key (expected 4 '/'-separated parts): {raw!r}")
    namespace, table, kind, body = parts
    try:
        key_prefix(namespace, table, kind)
    except KeyEncodingError as exc:
        raise KeyEncodingError(f"not a lookup-table key ({exc}): {raw!r}") from None
    id_: int | str
    if body.startswith("i"):
        int_id = _int_id(body)
        if int_id is None:
            raise KeyEncodingError(
                f"not a lookup-table key (bad int id encoding: `i` and {INT_ID_DIGITS} "
                f"base64url digits of at most 64 bits): {raw!r}"
            )
        id_ = int_id
    elif body.startswith("s"):
        try:
            id_ = unquote(body[1:], errors="strict")
        except UnicodeDecodeError:
            raise KeyEncodingError(
                f"not a lookup-table key (str id is not UTF-8): {raw!r}"
            ) from None
        if _encode_str_id(id_, b"", table) != b"s" + body[1:].encode("ascii"):
            raise KeyEncodingError(f"not a lookup-table key (bad str id encoding): {raw!r}")
    else:
        raise KeyEncodingError(f"not a lookup-table key (unknown id tag): {raw!r}")
    return DecodedKey(namespace=namespace, table=table, kind=kind, id=id_)


def _int_id(body: str) -> int | None:
    """The id of an int key body, None if it is not one `int_key_matrix` writes."""
    if len(body) != INT_ID_BYTES:
        return None
    ids, ok = decode_int_digits(np.frombuffer(body[1:].encode("ascii"), np.uint8)[None, :])
    return int(ids[0]) if ok[0] else None
