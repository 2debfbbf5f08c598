"""Parse and validate one gradient push completely, before anything is written (pure).

`parse_push(obj, config=..., replica=K)` turns the unpacked msgpack body of
`POST /v1/gradients` into a `Push` whose table gradients are already summed per
unique id (IndexedSlices semantics), or raises `BadRequestError` /
`NotOwnerError` with a message naming the field; `parse_rows_request` does the same for
the body of `POST /v1/rows`. `check_sender` first refuses a request from a process whose
cluster file differs from this replica's (`ClusterConfig.fingerprint`). No I/O here.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.keys import IdArray, encode_keys
from lookup_table.core.optimizers import check_finite, segment_sum
from lookup_table.core.rows import blocks
from lookup_table.core.sharding import owner_of
from lookup_table.core.wire import WireError, decode_array, decode_ids, describe
from lookup_table.errors import ClusterMismatchError, KeyEncodingError
from optimizer_service.errors import BadRequestError, NotOwnerError

__all__ = [
    "ANSWERS",
    "PUSH_ID_RE",
    "SENDER_KEYS",
    "Push",
    "RowsRequest",
    "TableGrads",
    "check_sender",
    "parse_push",
    "parse_rows_request",
]

PUSH_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}\Z")
SENDER_KEYS = ("namespace", "fingerprint", "replica")
"""What every push and read of rows carries (`ClusterConfig.sender`): whose file sent it."""
_PUSH_KEYS = {
    "push_id",
    "worker",
    "version",
    "tables",
    "groups",
    "dense",
    "answer",
    "read",
    "stats",
    *SENDER_KEYS,
}
_ROWS_KEYS = {"tables", "groups", *SENDER_KEYS}
ANSWERS = ("rows", "dense")
"""What a push may ask back (`answer`): its tables' updated rows, the dense parameters."""


@dataclass(frozen=True, slots=True)
class TableGrads:
    """The summed gradient of one table: unique ids (n,), grads float32 (n, dim)."""

    table: str
    ids: IdArray
    grads: NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Push:
    push_id: str
    worker: int
    version: int
    tables: tuple[TableGrads, ...] = ()
    dense: Mapping[str, NDArray[np.float32]] = field(default_factory=dict)
    answer: frozenset[str] = frozenset()
    groups: tuple[tuple[str, ...], ...] = ()
    """The tables that came as `groups` (each group's names, in order): the answer groups
    their rows the same way."""
    examples: int | None = None
    """The training examples the worker reports for this push (`stats.examples`)."""
    loss: float | None = None
    """The training loss the worker reports with it (`stats.loss`; NaN or Inf allowed:
    that a loss diverged is worth a metric)."""
    reads: RowsRequest | None = None
    """Rows to read once the push's new values are computed (`read`, a `POST /v1/rows`
    body's tables and groups): its answer carries them, so that a trainer reads the rows
    of its next batch without a request of their own."""

    @property
    def num_rows(self) -> int:
        return sum(t.ids.shape[0] for t in self.tables)


def _int_field(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequestError(f"{key}: expected a non-negative integer, got {describe(value)}")
    return value


def check_sender(obj: Any, *, config: ClusterConfig, replica: int) -> None:
    """Refuse a push or read of rows not sent for this replica of this cluster file: its
    `namespace`, `fingerprint` and `replica` must be this replica's, or rows would be
    read or written under another file's namespace, tables or optimizers.

    Raises:
        BadRequestError: a field is missing or not of its type (400).
        ClusterMismatchError: a field differs (409); nothing of the request is used.
    """
    if not isinstance(obj, Mapping):
        return  # the parser names what is wrong with the body
    for key in SENDER_KEYS:
        value = obj.get(key)
        if key == "replica":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = isinstance(value, str)
        if not ok:
            what = "missing" if value is None else f"got {describe(value)}"
            raise BadRequestError(
                f"{key}: {what}; every push and read of rows carries the namespace, "
                f"fingerprint and replica index of the cluster file it was made with "
                f"(GET /v1/tables shows this replica's; OptimizerClient sends them)",
                reason="no_sender",
            )
    mine = config.sender(replica)
    wrong = [key for key in SENDER_KEYS if obj[key] != mine[key]]
    if wrong:
        got = "; ".join(f"{k} {describe(obj[k])}, this replica's {mine[k]!r}" for k in wrong)
        raise ClusterMismatchError(
            f"the request was made with another cluster file than this replica runs: {got} "
            f"(GET /v1/tables shows what differs). The replicas run another cluster file: "
            f"use the same file for trainers and replicas, or restart the replicas with the "
            f"trainer's (deploy/cluster.sh down/up, or lookup-table-optimizer --config ...)",
            replica=replica,
        )


def parse_push(obj: Any, *, config: ClusterConfig, replica: int = 0) -> Push:
    """Validate an unpacked push body for replica `replica`.

    Raises:
        BadRequestError: anything malformed; the message names the field.
        NotOwnerError: some rows belong to another replica.
    """
    if not isinstance(obj, Mapping):
        raise BadRequestError(f"body: expected a msgpack map, got {type(obj).__name__}")
    unknown = set(obj) - _PUSH_KEYS
    if unknown:
        raise BadRequestError(
            f"body: unknown keys {sorted(map(str, unknown))}; expected {sorted(_PUSH_KEYS)}"
        )
    push_id = obj.get("push_id")
    if not isinstance(push_id, str) or not PUSH_ID_RE.match(push_id):
        raise BadRequestError(
            f"push_id: expected 1-128 characters of A-Z a-z 0-9 _ . : -, got {describe(push_id)}"
        )
    worker = _int_field(obj, "worker")
    version = _int_field(obj, "version")
    tables_raw = obj.get("tables", {})
    if not isinstance(tables_raw, Mapping):
        raise BadRequestError(
            f"tables: expected a map of table name -> {{ids, grads}}, got "
            f"{type(tables_raw).__name__}"
        )
    num_replicas = max(len(config.optimizers), 1)
    tables: list[TableGrads] = []
    for name, entry in tables_raw.items():
        tables.append(_parse_table(config, name, entry, replica, num_replicas))
    groups: list[tuple[str, ...]] = []
    seen = {t.table for t in tables}
    for i, entry in enumerate(_group_list(obj.get("groups", []), "{tables, counts, ids, grads}")):
        members = _parse_group(config, entry, f"groups[{i}]", seen, replica, num_replicas, True)
        tables.extend(
            TableGrads(name, ids, grads) for name, ids, grads in members if grads is not None
        )
        groups.append(tuple(name for name, _, _ in members))
    dense_raw = obj.get("dense", {})
    if not isinstance(dense_raw, Mapping):
        raise BadRequestError(
            f"dense: expected a map of name -> array, got {type(dense_raw).__name__}"
        )
    dense: dict[str, NDArray[np.float32]] = {}
    for name, arr in dense_raw.items():
        if not isinstance(name, str) or not name:
            raise BadRequestError(
                f"dense: parameter names must be non-empty str, got {describe(name)}"
            )
        try:
            grad = decode_array(arr, field=f"dense.{name}", dtype="<f4")
            check_finite(grad.reshape(1, -1), f"dense.{name}")
        except ValueError as exc:
            raise BadRequestError(
                str(exc), reason="nan" if "finite" in str(exc) else None
            ) from None
        dense[name] = grad
    answer = _parse_answer(obj.get("answer", []), replica)
    reads = None if obj.get("read") is None else _parse_reads(obj["read"], config, replica)
    examples, loss = _parse_stats(obj.get("stats", {}))
    return Push(
        push_id=push_id,
        worker=worker,
        version=version,
        tables=tuple(tables),
        dense=dense,
        answer=answer,
        groups=tuple(groups),
        examples=examples,
        loss=loss,
        reads=reads,
    )


def _parse_reads(raw: Any, config: ClusterConfig, replica: int) -> RowsRequest:
    """A push's `read`: `{tables: {name: {ids}}, groups: [{tables, counts, ids}]}`, as the
    body of `POST /v1/rows` (without the sender, which the push carries)."""
    if not isinstance(raw, Mapping) or "tables" not in raw or not set(raw) <= {"tables", "groups"}:
        got = sorted(map(str, raw)) if isinstance(raw, Mapping) else describe(raw)
        raise BadRequestError(
            f"read: expected a map with tables (and groups), as POST /v1/rows takes; got {got}"
        )
    try:
        return parse_rows_request(raw, config=config, replica=replica)
    except BadRequestError as exc:
        raise BadRequestError(f"read: {exc}", reason=exc.reason) from None
    except NotOwnerError as exc:
        raise NotOwnerError(f"read: {exc}") from None


def _parse_stats(raw: Any) -> tuple[int | None, float | None]:
    """`stats: {examples, loss}` (each optional): what the worker reports for /metrics."""
    if not isinstance(raw, Mapping) or not set(raw) <= {"examples", "loss"}:
        got = sorted(map(str, raw)) if isinstance(raw, Mapping) else describe(raw)
        raise BadRequestError(
            f"stats: expected a map with examples (int >= 0) and/or loss (a number), got {got}",
            reason="stats",
        )
    examples = raw.get("examples")
    if examples is not None and (type(examples) is not int or examples < 0):
        raise BadRequestError(
            f"stats.examples: expected the push's training examples as an int >= 0, got "
            f"{describe(examples)}",
            reason="stats",
        )
    loss = raw.get("loss")
    if loss is not None and type(loss) not in (int, float):
        raise BadRequestError(
            f"stats.loss: expected the training loss as a number, got {describe(loss)}",
            reason="stats",
        )
    return examples, None if loss is None else float(loss)


def _parse_answer(raw: Any, replica: int) -> frozenset[str]:
    if not isinstance(raw, list | tuple) or not all(isinstance(a, str) for a in raw):
        raise BadRequestError(
            f"answer: expected a list of {', '.join(ANSWERS)}, got {describe(raw)}"
        )
    unknown = sorted(set(raw) - set(ANSWERS))
    if unknown:
        raise BadRequestError(
            f"answer: unknown {unknown}; a push can ask back {', '.join(ANSWERS)}"
        )
    if "dense" in raw and replica != 0:
        raise NotOwnerError(
            f"answer: dense parameters live on replica 0; this is replica {replica}"
        )
    return frozenset(raw)


@dataclass(frozen=True, slots=True)
class RowsRequest:
    """A parsed `POST /v1/rows`: (table, unique sorted ids) per table, and the tables
    that came as `groups` (each group's names): the answer groups their rows the same
    way."""

    reads: list[tuple[str, IdArray]]
    groups: tuple[tuple[str, ...], ...] = ()


def parse_rows_request(obj: Any, *, config: ClusterConfig, replica: int = 0) -> RowsRequest:
    """Validate an unpacked `POST /v1/rows` body (`{tables: {name: {ids}}, groups:
    [{tables, counts, ids}]}`, `groups` optional) for replica `replica`: (table, unique
    sorted ids) per table, each id one this replica owns, and the tables that came
    grouped.

    Raises:
        BadRequestError: anything malformed; the message names the field.
        NotOwnerError: some rows belong to another replica.
    """
    if not isinstance(obj, Mapping) or "tables" not in obj or not set(obj) <= _ROWS_KEYS:
        got = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
        raise BadRequestError(
            f"body: expected a msgpack map with tables (and groups), {', '.join(SENDER_KEYS)}; "
            f"got {got}"
        )
    tables_raw = obj["tables"]
    if not isinstance(tables_raw, Mapping):
        raise BadRequestError(
            f"tables: expected a map of table name -> {{ids}}, got {type(tables_raw).__name__}"
        )
    num_replicas = max(len(config.optimizers), 1)
    out: list[tuple[str, IdArray]] = []
    for name, entry in tables_raw.items():
        _check_table(config, name)
        where = f"tables.{name}"
        if not isinstance(entry, Mapping) or set(entry) != {"ids"}:
            got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise BadRequestError(f"{where}: expected a map with exactly ids, got {got}")
        try:
            ids = decode_ids(entry["ids"], field=f"{where}.ids")
        except WireError as exc:
            raise BadRequestError(str(exc)) from None
        _check_ids(config, name, ids, replica, num_replicas)
        ascending = ids.dtype == np.int64 and bool((ids[1:] > ids[:-1]).all())
        # OptimizerClient.rows sends them sorted and distinct: no sort then
        out.append((name, ids if ascending else cast(IdArray, np.unique(ids))))
    groups: list[tuple[str, ...]] = []
    seen = {name for name, _ in out}
    for i, entry in enumerate(_group_list(obj.get("groups", []), "{tables, counts, ids}")):
        members = _parse_group(config, entry, f"groups[{i}]", seen, replica, num_replicas, False)
        out.extend((name, ids) for name, ids, _ in members)
        groups.append(tuple(name for name, _, _ in members))
    return RowsRequest(out, tuple(groups))


def _group_list(raw: Any, shape: str) -> list[Any]:
    if not isinstance(raw, list):
        raise BadRequestError(f"groups: expected a list of {shape}, got {describe(raw)}")
    return raw


def _parse_group(
    config: ClusterConfig,
    entry: Any,
    where: str,
    seen: set[str],
    replica: int,
    num_replicas: int,
    pushed: bool,
) -> list[tuple[str, IdArray, NDArray[np.float32] | None]]:
    """One group of tables (int64 ids, one dim) sent as one: `{tables: [name], counts:
    [ids of each], ids, grads}` (`grads` in a push, not in a read), each array the
    tables' concatenated in that order. Returns (table, unique sorted ids, their summed
    gradients or None) per table: views of one copy of the group's arrays. A push of
    26 tables so costs the service one decode and one check of each kind, not 26.
    `seen`: the tables parsed so far (a table may come once), updated. `pushed`: a
    push's group (with grads), else a read's."""
    keys = ["tables", "counts", "ids", "grads"] if pushed else ["tables", "counts", "ids"]
    if not isinstance(entry, Mapping) or set(entry) != set(keys):
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        raise BadRequestError(f"{where}: expected a map with exactly {', '.join(keys)}, got {got}")
    names, counts = entry["tables"], entry["counts"]
    if not isinstance(names, list) or not names:
        raise BadRequestError(f"{where}.tables: expected a non-empty list of table names")
    for name in names:
        _check_table(config, name)
        if name in seen:
            raise BadRequestError(f"{where}.tables: table {name!r} comes twice in the request")
        seen.add(name)
    specs = [config.table(name) for name in names]
    for spec in specs:
        if spec.id_type != "int64":
            raise BadRequestError(
                f"{where}.tables: table {spec.name!r} has string ids; a group holds tables "
                f"of int64 ids (send it under tables)",
                reason="id_type",
            )
        if spec.dim != specs[0].dim:
            raise BadRequestError(
                f"{where}.tables: a group's tables have one dim; {specs[0].name!r} has "
                f"{specs[0].dim}, {spec.name!r} has {spec.dim}",
                reason="shape",
            )
    if (
        not isinstance(counts, list)
        or len(counts) != len(names)
        or not all(type(c) is int and c >= 0 for c in counts)
    ):
        raise BadRequestError(
            f"{where}.counts: expected {len(names)} non-negative ints (the ids of each "
            f"table), got {describe(counts)}"
        )
    try:
        ids = decode_array(entry["ids"], field=f"{where}.ids", dtype="<i8", ndim=1)
        grads = (
            decode_array(entry["grads"], field=f"{where}.grads", dtype="<f4", ndim=2)
            if pushed
            else None
        )
    except WireError as exc:
        raise BadRequestError(str(exc)) from None
    n, dim = ids.shape[0], specs[0].dim
    if sum(counts) != n:
        raise BadRequestError(f"{where}.counts: they sum to {sum(counts)}, but ids has {n}")
    bounds = list(itertools.accumulate(counts, initial=0))
    if grads is not None:
        if grads.shape != (n, dim):
            raise BadRequestError(
                f"{where}.grads: expected shape ({n}, {dim}) for {n} ids of dim {dim}, got "
                f"{tuple(grads.shape)}",
                reason="shape",
            )
        if not np.isfinite(grads).all():  # name the table
            for name, table_grads in zip(names, blocks(grads, counts), strict=True):
                _finite(table_grads, f"tables.{name}")
        grads = grads.copy()
    ids = ids.astype(np.int64)  # a copy: the body's bytes are read-only
    # each table's ids ascending and distinct (what trainers send) but for a table boundary
    starts = set(bounds)
    inside = [p for p in (np.flatnonzero(ids[1:] <= ids[:-1]) + 1).tolist() if p not in starts]
    unsorted = set(np.searchsorted(bounds, inside, side="right").tolist())  # table k + 1
    out: list[tuple[str, IdArray, NDArray[np.float32] | None]] = []
    each_grads = [None] * len(names) if grads is None else blocks(grads, counts)
    for k, (name, t_ids, t_grads) in enumerate(
        zip(names, blocks(ids, counts), each_grads, strict=True)
    ):
        if num_replicas > 1:
            _check_ids(config, name, t_ids, replica, num_replicas)
        if k + 1 in unsorted:  # rare: a client that sends duplicates or unsorted ids
            if t_grads is None:
                t_ids = cast(IdArray, np.unique(t_ids))
            else:
                t_ids, t_grads = _summed(t_ids, t_grads, f"tables.{name}")
        out.append((name, t_ids, t_grads))
    return out


def _check_table(config: ClusterConfig, name: Any) -> None:
    if not isinstance(name, str) or not config.has_table(name):
        known = ", ".join(t.name for t in config.tables) or "none"
        raise BadRequestError(
            f"tables: unknown table {describe(name)}; the service knows: {known}",
            reason="unknown_table",
        )


def _check_ids(
    config: ClusterConfig, name: str, ids: IdArray, replica: int, num_replicas: int
) -> None:
    """Raise unless `ids` are of table `name`'s type, encodable, and this replica's."""
    where = f"tables.{name}.ids"
    spec = config.table(name)
    is_int = ids.dtype == np.int64
    if ids.shape[0] and is_int != (spec.id_type == "int64"):
        raise BadRequestError(
            f"{where}: table {name!r} has id_type={spec.id_type!r} but the request has "
            f"{'int64' if is_int else 'string'} ids",
            reason="id_type",
        )
    if not is_int:
        try:
            encode_keys(config.namespace, name, "w", ids)
        except KeyEncodingError as exc:
            raise BadRequestError(f"{where}: {exc}", reason="bad_id") from None
    if num_replicas > 1 and ids.shape[0]:
        owners = owner_of(name, ids, num_replicas)
        foreign = np.flatnonzero(owners != replica)
        if foreign.size:
            raise NotOwnerError(
                f"{where}: {foreign.size} of {ids.shape[0]} rows belong to other replicas "
                f"(e.g. id {ids[foreign[0]]!r} -> replica {int(owners[foreign[0]])}); this is "
                f"replica {replica}: split requests by owner (OptimizerClient does)"
            )


def _parse_table(
    config: ClusterConfig, name: Any, entry: Any, replica: int, num_replicas: int
) -> TableGrads:
    _check_table(config, name)
    spec = config.table(name)
    where = f"tables.{name}"
    if not isinstance(entry, Mapping) or set(entry) != {"ids", "grads"}:
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        raise BadRequestError(f"{where}: expected a map with exactly ids and grads, got {got}")
    try:
        ids = decode_ids(entry["ids"], field=f"{where}.ids")
        grads = decode_array(entry["grads"], field=f"{where}.grads", dtype="<f4", ndim=2)
    except WireError as exc:
        raise BadRequestError(str(exc)) from None
    if grads.shape != (ids.shape[0], spec.dim):
        raise BadRequestError(
            f"{where}.grads: expected shape ({ids.shape[0]}, {spec.dim}) for {ids.shape[0]} ids "
            f"of dim {spec.dim}, got {tuple(grads.shape)}",
            reason="shape",
        )
    _finite(grads, where)
    _check_ids(config, name, ids, replica, num_replicas)
    uniq, summed = _summed(ids, grads, where)
    return TableGrads(table=name, ids=uniq, grads=summed)


def _finite(grads: NDArray[np.float32], where: str) -> None:
    """`check_finite` as a 400 (`reason` nan) naming `where`."""
    try:
        check_finite(grads, where)
    except ValueError as exc:
        raise BadRequestError(str(exc), reason="nan") from None


def _summed(
    ids: IdArray, grads: NDArray[np.float32], where: str
) -> tuple[IdArray, NDArray[np.float32]]:
    """A table's gradients summed per unique id (`segment_sum`), the sums checked where ids
    repeated (finite gradients can sum to an Inf; without duplicates the sums are the
    checked gradients)."""
    uniq, summed = segment_sum(ids, grads)
    if uniq.shape[0] != ids.shape[0]:
        _finite(summed, where + " (summed over duplicate ids)")
    return uniq, summed
