"""`OptimizerClient`: push gradients to the optimizer service replicas.

    async with OptimizerClient(config, worker=0) as client:
        await client.push({"user": (ids, grads)})

One aiohttp session per client. A push is split by replica (each replica owns a
fixed hash partition of the rows); every part carries the same `push_id`, and a
part that fails with a connection error, a timeout or a 5xx is retried with that
same `push_id` and exponential backoff, so a retry is applied at most once.
Before its first request that reads or changes the model, the client compares its
cluster file with each replica's (`GET /v1/tables`: `ClusterConfig.agreement`) and
raises `ClusterMismatchError` naming each field that differs; every push and read of
rows also carries the file's fingerprint, which the replica checks (409).
A 4xx raises `PushRejectedError` with the service's message. A memcached error
the replica reports is raised at once, without retries, as the store's own
error naming the node: `DataLossError` (a node lost its data), `StoreFullError`
(a `-M` node is full), `StoreTimeoutError`/`NodeUnavailableError` (a node did
not answer within `store.timeout_s` or refused), `CorruptValueError`; so a push
fails within about `store.timeout_s`, as a trainer's own lookups do.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import numbers
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import aiohttp
import msgpack
import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.core.rows import blocks
from lookup_table.core.sharding import owner_of
from lookup_table.core.wire import (
    CONTENT_TYPE,
    decode_array,
    decode_ids,
    encode_array,
    encode_ids,
    pack,
    unpack,
)
from lookup_table.errors import (
    ClusterMismatchError,
    ConfigError,
    CorruptValueError,
    DataLossError,
    LookupTableError,
    NodeUnavailableError,
    ProtocolError,
    PushRejectedError,
    ReplicaUnavailableError,
    StorageFormatError,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
)
from lookup_table.store import EmbeddingStore

__all__ = ["OptimizerClient"]  # RowReader: the training session's, re-exported there

logger = logging.getLogger(__name__)

# The store errors a replica answers with (JSON `type`), re-raised here without retries.
_STORE_ERRORS: dict[str, type[StoreError]] = {
    cls.__name__: cls
    for cls in (
        StoreError,
        StoreFullError,
        CorruptValueError,
        StorageFormatError,
        ProtocolError,
        NodeUnavailableError,
        StoreTimeoutError,
    )
}


def _stats(examples: Any, loss: Any) -> dict[str, Any]:
    """A push's `stats` (what is given of examples and loss), checked."""
    stats: dict[str, Any] = {}
    if examples is not None:
        if isinstance(examples, bool) or not isinstance(examples, int | np.integer):
            raise ConfigError(
                f"examples must be the step's number of training examples, an int >= 0. "
                f"Received: examples={examples!r}"
            )
        if examples < 0:
            raise ConfigError(f"examples must be an int >= 0. Received: examples={examples}")
        stats["examples"] = int(examples)
    if loss is not None:
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            raise ConfigError(
                f"loss must be a real number (a Python or numpy float: convert a tensor with "
                f"float(t)). Received: loss of type {type(loss).__name__}"
            )
        stats["loss"] = float(loss)
    return stats


class OptimizerClient:
    """Async client of every optimizer replica of a cluster.

    Args:
        config: the cluster file; `optimizers` lists the replicas in partition order.
        worker: this trainer's index (sent with every push, for the service's logs).
        max_retries: retries of one replica part on connection errors, timeouts, 5xx.
        backoff_s: first retry delay; doubles up to 5 s.
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        worker: int = 0,
        max_retries: int = 6,
        backoff_s: float = 0.1,
    ) -> None:
        if not config.optimizers:
            raise ValueError("the cluster file lists no optimizer replicas (`optimizers`)")
        self.config = config
        self.worker = worker
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None
        # the replicas whose cluster file agrees with ours, and the checks under way (one
        # per replica, however many requests wait for it)
        self._agreed: set[int] = set()
        self._checking: dict[int, asyncio.Future[None]] = {}

    async def __aenter__(self) -> OptimizerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Content-Type": CONTENT_TYPE}
            if self.config.token:
                headers["Authorization"] = f"Bearer {self.config.token}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(
                    total=self.config.service.request_timeout_s, sock_connect=5
                ),
            )
        return self._session

    async def push(
        self,
        tables: Mapping[str, tuple[Any, NDArray[np.float32]]],
        *,
        dense: Mapping[str, NDArray[np.float32]] | None = None,
        version: int = 0,
        push_id: str | None = None,
        answer: Sequence[str] = (),
        on_answer: Callable[[dict[str, Any]], None] | None = None,
        examples: int | None = None,
        loss: float | None = None,
    ) -> dict[str, Any]:
        """Push the gradients of one step: `{table: (ids, grads (n, dim))}`.

        Returns a summary: `{push_id, applied, duplicate, rows, replicas, version,
        created}` (`created`: per table, the rows the push created; in sync mode the
        rows its round created, told to the worker whose push applied the round; a
        duplicate creates none).

        `answer` asks the replicas to send back what the push changed (read your
        writes): with "rows", `updated` maps each pushed table to (unique ids sorted,
        their rows after the push); with "dense", `params` and `dense_version` are the
        dense parameters after it (replica 0 answers whenever "dense" is asked).
        `stamps` maps each replica that applied the push and keeps a row cache to
        (epoch, seq): the push was its seq-th change of its rows since epoch.
        Replicas send that answer as soon as they computed it, before writing:
        `on_answer(answer)` (called on the client's loop) gets it then, while `push`
        returns only once every replica wrote the push (or raises if one failed).

        `examples` (the step's batch size) and `loss` are reported to the service's
        /metrics by this client's worker (`lookup_table_worker_examples_total`,
        `lookup_table_worker_loss`); they go with the part of the lowest replica the push
        reaches, so summing over replicas counts each example once.

        Raises:
            ClusterMismatchError: a replica runs another cluster file (`check_cluster`);
                nothing was pushed.
            ConfigError: `examples` is not an int >= 0 or `loss` not a real number.
            PushRejectedError: a replica answered 4xx (its message says why).
            DataLossError, StoreFullError: the store refused; not retried.
            ReplicaUnavailableError: a replica stayed unreachable through every retry.
        """
        stats = _stats(examples, loss)
        push_id = push_id or uuid.uuid4().hex
        n_replicas = len(self.config.optimizers)
        await self._agree(range(n_replicas))
        split: list[dict[str, tuple[IdArray, NDArray[Any]]]] = [{} for _ in range(n_replicas)]
        for name, (ids, grads) in tables.items():
            id_array = as_ids(ids, table=name)
            g = np.asarray(grads)
            owners = (
                owner_of(name, id_array, n_replicas)
                if n_replicas > 1
                else np.zeros(id_array.shape[0], dtype=np.intp)
            )
            for k in range(n_replicas):
                mine = np.flatnonzero(owners == k) if n_replicas > 1 else slice(None)
                sub_ids = id_array[mine]
                if sub_ids.shape[0] == 0 and n_replicas > 1:
                    continue
                split[k][name] = (sub_ids, g[mine])
        parts = [self._grouped(mine, grads=True) for mine in split]
        bodies: dict[int, bytes] = {}
        every = self.config.mode == "sync"  # each replica counts every worker's push
        want_dense = "dense" in answer
        for k in range(n_replicas):
            singles, groups = parts[k]
            if every or singles or groups or (k == 0 and (dense or want_dense)):
                body: dict[str, Any] = {
                    "push_id": push_id,
                    "worker": self.worker,
                    "version": version,
                    "tables": singles,
                    **self.config.sender(k),
                }
                if groups:
                    body["groups"] = groups
                if k == 0 and dense:
                    body["dense"] = {name: encode_array(g) for name, g in dense.items()}
                asked = [a for a in answer if a != "dense" or k == 0]
                if asked:
                    body["answer"] = asked
                if stats and not bodies:  # one replica counts them
                    body["stats"] = stats
                bodies[k] = pack(body)
        answers: dict[int, dict[str, Any]] = {}

        def answered(k: int, doc: dict[str, Any]) -> None:
            if k in answers:  # a retry answers again: the first answer stands
                return
            answers[k] = doc
            if on_answer is not None and len(answers) == len(bodies):
                on_answer(_merged_answer(answers, answer))

        results = await asyncio.gather(
            *(
                self._request(
                    k,
                    "POST",
                    "/v1/gradients",
                    body,
                    first=functools.partial(answered, k) if answer else None,
                )
                for k, body in bodies.items()
            )
        )
        summary: dict[str, Any] = {
            "push_id": push_id,
            "applied": all(r.get("applied") for r in results) if results else True,
            "duplicate": any(r.get("duplicate") for r in results),
            "rows": sum(int(r.get("rows", 0)) for r in results),
            "replicas": sorted(bodies),
            "version": max((int(r.get("version", 0)) for r in results), default=version),
            "created": _created(results),
        }
        if answer:
            summary.update(_merged_answer(answers, answer))
        return summary

    async def rows(self, tables: Mapping[str, Any]) -> dict[str, tuple[NDArray[np.float32], int]]:
        """Rows read through their owners (`POST /v1/rows`): `{table: ids}` ->
        `{table: (rows (len(ids), dim) in the order of ids, how many ids had no row yet)}`.

        Each replica answers from what it knows: rows written behind that memcached may
        not hold yet, memcached for the rest, and the initial values of ids without a row
        (nothing is created). One request per replica; retried like a push (a read
        changes nothing).

        Raises:
            ClusterMismatchError: a replica runs another cluster file (`check_cluster`).
            PushRejectedError: a replica answered 4xx (its message says why).
            DataLossError, StoreFullError, ...: the store's error, as a push raises it.
            ReplicaUnavailableError: a replica stayed unreachable through every retry.
        """
        n_replicas = len(self.config.optimizers)
        await self._agree(range(n_replicas))
        split: list[dict[str, tuple[IdArray, None]]] = [{} for _ in range(n_replicas)]
        unique: dict[str, tuple[Any, NDArray[np.intp], list[tuple[int, Any]]]] = {}
        for name, ids in tables.items():
            id_array = as_ids(ids, table=name)
            uniq = cast(IdArray, np.unique(id_array))
            inverse = np.searchsorted(uniq, id_array)
            owners = (
                owner_of(name, uniq, n_replicas)
                if n_replicas > 1
                else np.zeros(uniq.shape[0], dtype=np.intp)
            )
            where: list[tuple[int, Any]] = []
            for k in range(n_replicas):
                mine = np.flatnonzero(owners == k) if n_replicas > 1 else slice(None)
                sub = uniq[mine]
                if sub.shape[0]:
                    split[k][name] = (sub, None)
                    where.append((k, mine))
            unique[name] = (uniq, inverse, where)
        ks = [k for k in range(n_replicas) if split[k]]
        requests = {k: self._grouped(split[k], grads=False) for k in ks}
        bodies = {
            k: pack(
                {
                    "tables": singles,
                    **({"groups": groups} if groups else {}),
                    **self.config.sender(k),
                }
            )
            for k, (singles, groups) in requests.items()
        }
        docs = dict(
            zip(
                ks,
                await asyncio.gather(
                    *(self._request(k, "POST", "/v1/rows", bodies[k]) for k in ks)
                ),
                strict=True,
            )
        )
        answered = {k: _rows_answer(docs[k], requests[k][1], k) for k in ks}
        out: dict[str, tuple[NDArray[np.float32], int]] = {}
        for name, (uniq, inverse, where) in unique.items():
            dim = self.config.table(name).dim
            rows = np.empty((uniq.shape[0], dim), dtype=np.float32)
            new = 0
            for k, mine in where:
                got, their_new = answered[k][name]
                n = uniq[mine].shape[0]
                if got.shape != (n, dim):
                    raise LookupTableError(
                        f"replica {k} answered {got.shape} rows of table {name!r} for {n} ids "
                        f"of dim {dim}"
                    )
                rows[mine] = got
                new += their_new
            out[name] = (rows[inverse], new)
        return out

    def _grouped(
        self, tables: Mapping[str, tuple[IdArray, NDArray[Any] | None]], *, grads: bool
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The wire form of one request's tables: (`tables`, `groups`). The tables of
        int64 ids and one dim go as one group (`{tables, counts, ids, grads}`, each array
        theirs concatenated; `grads` only in a push), so the service decodes and checks
        one array of each kind, not one per table; the others (string ids, a dim alone)
        go under `tables` as `{ids[, grads]}`."""
        by_dim: dict[int, list[str]] = {}
        for name, (ids, values) in tables.items():
            # a table the cluster file lacks, or grads of another shape, go alone: the
            # service's answer then names the table and what is wrong
            if not (
                isinstance(ids, np.ndarray)
                and ids.dtype == np.int64
                and ids.ndim == 1
                and self.config.has_table(name)
            ):
                continue
            dim = self.config.table(name).dim
            if grads and (values is None or np.shape(values) != (ids.shape[0], dim)):
                continue
            by_dim.setdefault(dim, []).append(name)
        grouped = {name for names in by_dim.values() if len(names) > 1 for name in names}
        singles: dict[str, Any] = {}
        for name, (ids, values) in tables.items():
            if name not in grouped:
                singles[name] = {"ids": encode_ids(ids)}
                if grads:
                    singles[name]["grads"] = encode_array(np.asarray(values))
        groups: list[dict[str, Any]] = []
        for names in by_dim.values():
            if len(names) > 1:
                group: dict[str, Any] = {
                    "tables": names,
                    "counts": [int(tables[n][0].shape[0]) for n in names],
                    "ids": encode_array(np.concatenate([tables[n][0] for n in names])),
                }
                if grads:
                    group["grads"] = encode_array(
                        np.concatenate([np.asarray(tables[n][1], dtype=np.float32) for n in names])
                    )
                groups.append(group)
        return singles, groups

    async def tables(self, *, replica: int = 0) -> dict[str, Any]:
        """`GET /v1/tables` of replica `replica`: the cluster file it runs (not checked)."""
        return await self._request(replica, "GET", "/v1/tables", None)

    async def check_cluster(self, replicas: Iterable[int] | None = None) -> None:
        """Check, once per replica (of every replica, or those given), that it runs a
        cluster file that agrees with this client's; push, rows, dense_init, dense,
        version and pause call it first.

        Raises:
            ClusterMismatchError: a replica runs another file (or has another index than
                its place in `optimizers`); the message names each field that differs.
            ReplicaUnavailableError: a replica could not be asked (checked again next time).
        """
        await self._agree(range(len(self.config.optimizers)) if replicas is None else replicas)

    async def _agree(self, replicas: Iterable[int]) -> None:
        todo = [k for k in replicas if k not in self._agreed]
        if not todo:
            return
        checks = []
        for k in todo:
            check = self._checking.get(k)
            if check is None:
                check = asyncio.ensure_future(self._check_replica(k))
                self._checking[k] = check
                check.add_done_callback(functools.partial(self._checked, k))
            checks.append(check)
        # shielded: a waiter cancelled does not cancel the check another request awaits
        outcomes = await asyncio.gather(*map(asyncio.shield, checks), return_exceptions=True)
        for outcome in outcomes:  # the first replica's error, if any
            if isinstance(outcome, BaseException):
                raise outcome

    def _checked(self, k: int, check: asyncio.Future[None]) -> None:
        if self._checking.get(k) is check:
            del self._checking[k]
        if not check.cancelled() and check.exception() is None:
            self._agreed.add(k)

    async def _check_replica(self, k: int) -> None:
        url = self.config.optimizers[k]
        doc = await self.tables(replica=k)
        fix = (
            "the replicas run another cluster file: use the same file for trainers and "
            "replicas, or restart the replicas with this one (deploy/cluster.sh down/up, or "
            "lookup-table-optimizer --config ...)"
        )
        theirs, fingerprint = doc.get("agreement"), doc.get("fingerprint")
        if not isinstance(theirs, dict) or not isinstance(fingerprint, str):
            raise ClusterMismatchError(
                f"replica {k} ({url}) does not report the cluster file it runs (GET /v1/tables "
                f"has no agreement and fingerprint): it runs an older version of "
                f"lookup-table; upgrade it and restart the replicas",
                replica=k,
            )
        index = doc.get("replica")
        if index != k:
            raise ClusterMismatchError(
                f"replica {k} ({url}) of this cluster file is replica {index!r} of the file it "
                f"runs (lookup-table-optimizer --replica): `optimizers` must list the replicas "
                f"in the order of their --replica; {fix}",
                replica=k,
                differences=(("replica", k, index),),
            )
        if fingerprint == self.config.fingerprint:
            return
        differences = tuple(self.config.differences(theirs))
        shown = "; ".join(
            f"{path}: {_shown(mine)} in this trainer's cluster file, {_shown(other)} in "
            f"replica {k}'s"
            for path, mine, other in differences[:6]
        )
        more = f" (and {len(differences) - 6} more)" if len(differences) > 6 else ""
        raise ClusterMismatchError(
            f"replica {k} ({url}) runs another cluster file than this trainer: "
            f"{shown or 'its fingerprint ' + fingerprint + ' differs'}{more}; {fix}",
            replica=k,
            differences=differences,
        )

    async def dense_init(
        self, params: Mapping[str, NDArray[np.float32]]
    ) -> tuple[int, dict[str, NDArray[np.float32]]]:
        """Offer initial dense parameters; the first trainer's win. Returns (version, params)."""
        await self._agree(range(len(self.config.optimizers)))
        body = pack({"params": {n: encode_array(v) for n, v in params.items()}})
        doc = await self._request(0, "POST", "/v1/dense/init", body)
        return int(doc["version"]), _arrays(doc["params"])

    async def dense(self) -> tuple[int, dict[str, NDArray[np.float32]]]:
        """The current dense parameters and their version (replica 0)."""
        await self._agree(range(len(self.config.optimizers)))
        doc = await self._request(0, "GET", "/v1/dense", None)
        return int(doc["version"]), _arrays(doc["params"])

    async def version(self, *, after: int | None = None) -> int:
        """The model version: with `after`, waits until every replica is past it (sync mode)."""
        await self._agree(range(len(self.config.optimizers)))
        path = "/v1/version" if after is None else f"/v1/version?after={after}"
        docs = await asyncio.gather(
            *(self._request(k, "GET", path, None) for k in range(len(self.config.optimizers)))
        )
        return min(int(d["version"]) for d in docs)

    async def pause(
        self,
        *,
        timeout_s: float = 600.0,
        replicas: Sequence[int] | None = None,
        drop_unfinished: bool = False,
    ) -> dict[int, int]:
        """Pause every replica (or those given): in-flight pushes finish, new ones wait.

        They resume by themselves after `timeout_s`. Returns, per replica, how many
        pushes it is still finishing in the background (a failed write being replayed):
        non-zero means the rows are not consistent yet. `drop_unfinished` cancels those
        (only for a restore, which replaces their rows).
        """
        path = f"/v1/admin/pause?timeout_s={timeout_s}" + (
            "&drop_unfinished=1" if drop_unfinished else ""
        )
        indexes = list(self._replicas(replicas))
        await self._agree(indexes)  # a pause for a checkpoint of another file's rows
        docs = await asyncio.gather(*(self._request(k, "POST", path, b"") for k in indexes))
        return {k: int(d.get("unfinished_pushes", 0)) for k, d in zip(indexes, docs, strict=True)}

    async def resume(self, *, reload: bool = False, replicas: Sequence[int] | None = None) -> None:
        """Resume every replica (or those given); `reload` (paused replicas only) makes them
        read their version again first, as after a checkpoint restore. Not checked
        against the replicas' cluster file: a resume only ends a pause."""
        path = "/v1/admin/resume" + ("?reload=1" if reload else "")
        await asyncio.gather(
            *(self._request(k, "POST", path, b"") for k in self._replicas(replicas))
        )

    def _replicas(self, replicas: Sequence[int] | None) -> range | Sequence[int]:
        n = len(self.config.optimizers)
        if replicas is None:
            return range(n)
        bad = [k for k in replicas if not 0 <= k < n]
        if bad:
            raise ValueError(f"replicas {bad} out of range: the cluster file has {n}")
        return replicas

    async def _request(
        self,
        replica: int,
        method: str,
        path: str,
        body: bytes | None,
        *,
        first: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """One request with retries. With `first`, a 2xx reply is two msgpack maps (an
        answer, handed to `first` as soon as it arrives, then the outcome, returned or
        raised as an error answer would be)."""
        url = self.config.optimizers[replica] + path
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            typed: LookupTableError | None = None
            try:
                async with self._get_session().request(method, url, data=body) as resp:
                    status = resp.status
                    if status < 300:
                        if first is None:
                            result: dict[str, Any] = unpack(await resp.read())
                            return result
                        outcome = await _two_part_answer(resp, first)
                        if "error" not in outcome:
                            return outcome
                        status = int(outcome.get("status", 500))
                        message, doc = str(outcome["error"]), outcome
                    else:
                        message, doc = _error_of(await resp.read(), status)
                    typed = _store_error(doc, f"replica {replica} ({url}): {message}")
                    if doc.get("type") == "ClusterMismatchError":
                        raise ClusterMismatchError(
                            f"replica {replica} ({url}) refused the request ({status}): {message}",
                            replica=replica,
                        )
                    if typed is None and status < 500:
                        raise PushRejectedError(
                            f"replica {replica} ({url}) refused the request ({status}): {message}",
                            status=status,
                        )
                    problem = f"answered {status}: {message}"
            # a replica killed mid-answer cuts the body (ClientPayloadError): retrying is
            # safe, a push keeps its push_id
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if typed is not None:  # raised out here: a StoreTimeoutError is a TimeoutError
                raise typed
            if attempt == self.max_retries:
                break
            logger.debug("replica %d %s; retry %d in %.2f s", replica, problem, attempt + 1, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        raise ReplicaUnavailableError(
            f"optimizer replica {replica} ({url}) failed after {self.max_retries + 1} attempts: "
            f"{problem}; is it running? (deploy/cluster.sh status)"
        )


def _shown(value: Any) -> str:
    """A value of a cluster file's agreement in a message (None: the side lacks it)."""
    if value is None:
        return "not set"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_shown(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _created(results: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Per table, the rows the replicas created applying a push or, in sync mode, the
    round it completed (ids that had no row, which the trainer read as new through their
    owner)."""
    out: dict[str, int] = {}
    for r in results:
        for table, n in r.get("created", {}).items():
            out[str(table)] = out.get(str(table), 0) + int(n)
    return out


def _merged_answer(
    answers: Mapping[int, Mapping[str, Any]], asked: Sequence[str]
) -> dict[str, Any]:
    """The replicas' answers to one push as one: `updated` rows, `params`, `dense_version`,
    and `stamps` (replica -> (epoch, seq) of the replicas that stamped their answer)."""
    out: dict[str, Any] = {}
    if "rows" in asked:
        out["updated"] = _updated_rows([answers[k] for k in sorted(answers)])
    out["stamps"] = {
        k: (str(a["stamp"][0]), int(a["stamp"][1])) for k, a in answers.items() if "stamp" in a
    }
    first = answers.get(0, {})
    if "dense" in asked and "params" in first:
        out["params"] = _arrays(first["params"])
        out["dense_version"] = int(first["dense_version"])
    return out


def _updated_rows(results: Sequence[Mapping[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """Per table, (unique ids sorted, rows) from every replica's `updated` answer (and
    `updated_groups`: tables that came grouped, their rows as one array)."""
    parts: dict[str, list[tuple[Any, NDArray[np.float32]]]] = {}
    for r in results:
        for i, group in enumerate(r.get("updated_groups", [])):
            where = f"updated_groups[{i}]"
            ids = decode_ids(group["ids"], field=f"{where}.ids")
            rows = decode_array(group["rows"], field=f"{where}.rows", dtype="<f4", ndim=2)
            for name, (table_ids, table_rows) in _cut(
                group["tables"], group["counts"], [ids, rows], where
            ):
                parts.setdefault(name, []).append((table_ids, table_rows))
        for name, doc in r.get("updated", {}).items():
            ids = decode_ids(doc["ids"], field=f"updated.{name}.ids")
            rows = decode_array(doc["rows"], field=f"updated.{name}.rows", dtype="<f4", ndim=2)
            parts.setdefault(name, []).append((ids, rows))
    out: dict[str, tuple[Any, Any]] = {}
    for name, got in parts.items():
        if len(got) == 1:
            ids, rows = got[0]
            if ids.dtype == np.int64 and bool((ids[1:] > ids[:-1]).all()):
                out[name] = (ids, rows)  # one replica's: sorted already
                continue
        else:
            ids = np.concatenate([i for i, _ in got])
            rows = np.concatenate([r for _, r in got])
        order = np.argsort(ids, kind="stable")
        out[name] = (ids[order], rows[order])
    return out


def _cut(
    names: Any, counts: Any, arrays: Sequence[NDArray[Any]], where: str
) -> list[tuple[str, list[NDArray[Any]]]]:
    """Each table of a group in an answer with its block of each of the group's `arrays`
    (`rows.blocks`); LookupTableError where the tables and counts do not fit them."""
    total = arrays[0].shape[0]
    if (
        not isinstance(names, list)
        or not isinstance(counts, list)
        or len(names) != len(counts)
        or not all(isinstance(c, int) and c >= 0 for c in counts)
        or sum(counts) != total
        or any(a.shape[0] != total for a in arrays)
    ):
        raise LookupTableError(
            f"{where}: tables {names!r} with counts {counts!r} do not fit its {total} rows"
        )
    cut = [blocks(a, counts) for a in arrays]
    return [(str(n), [c[k] for c in cut]) for k, n in enumerate(names)]


def _rows_answer(
    doc: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], replica: int
) -> dict[str, tuple[NDArray[np.float32], int]]:
    """Per table, (rows, how many had no row) from one replica's `POST /v1/rows` answer,
    the tables of the request's `groups` taken from its `groups` (one array each)."""
    out: dict[str, tuple[NDArray[np.float32], int]] = {}
    answered = doc.get("groups", [])
    if len(answered) != len(groups):
        raise LookupTableError(
            f"replica {replica} answered {len(answered)} groups of rows for {len(groups)}"
        )
    for i, (sent, got) in enumerate(zip(groups, answered, strict=True)):
        where = f"groups[{i}]"
        rows = decode_array(got["rows"], field=f"{where}.rows", dtype="<f4", ndim=2)
        new = got["new"]
        if not isinstance(new, list) or len(new) != len(sent["tables"]):
            raise LookupTableError(
                f"replica {replica} answered {where}.new {new!r} for tables {sent['tables']!r}"
            )
        for (name, (table_rows,)), fresh in zip(
            _cut(sent["tables"], sent["counts"], [rows], where), new, strict=True
        ):
            out[name] = (table_rows, int(fresh))
    for name, value in doc["rows"].items():
        got = decode_array(value, field=f"rows.{name}", dtype="<f4", ndim=2)
        out[name] = (got, int(doc["new"][name]))
    return out


async def _two_part_answer(
    resp: aiohttp.ClientResponse, first: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Read a streamed answer: hand its first map to `first` on arrival, return the second.
    A reply cut before the second map raises ClientPayloadError (the push is retried)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True)
    docs: list[Any] = []
    async for chunk in resp.content.iter_any():
        unpacker.feed(chunk)
        for doc in unpacker:
            if not isinstance(doc, dict):
                raise aiohttp.ClientPayloadError(f"expected msgpack maps, got {type(doc).__name__}")
            docs.append(doc)
            if len(docs) == 1:
                first(doc)
    if len(docs) != 2:
        raise aiohttp.ClientPayloadError(f"the answer was cut after {len(docs)} of 2 maps")
    outcome: dict[str, Any] = docs[1]
    return outcome


def _arrays(doc: Mapping[str, Any]) -> dict[str, NDArray[np.float32]]:
    return {n: decode_array(v, field=f"params.{n}", dtype="<f4").copy() for n, v in doc.items()}


def _error_of(raw: bytes, status: int) -> tuple[str, dict[str, Any]]:
    """The message and the whole document of a JSON error body (or its first bytes)."""
    try:
        doc = json.loads(raw)
        return str(doc.get("error", doc)), doc
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace") or f"HTTP {status}", {}


def _store_error(doc: Mapping[str, Any], message: str) -> LookupTableError | None:
    """The store error a replica answered with (its `type`, `node`, `nodes`), if any."""
    kind = doc.get("type")
    if kind == "DataLossError":
        nodes = doc.get("nodes")
        return DataLossError(
            message, nodes=tuple(str(n) for n in nodes) if isinstance(nodes, list) else ()
        )
    cls = _STORE_ERRORS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return None
    node = doc.get("node")
    return cls(message, node=node if isinstance(node, str) else None)


class RowReader:
    """Where a trainer reads rows: memcached (`EmbeddingStore.lookup_many`: missing rows
    created with `add`), or, for tables whose rows are written behind
    (`ClusterConfig.reads_through_owner`), their owning replicas (`OptimizerClient.rows`:
    memcached may not hold the newest values yet; a missing row gets its initial value
    and its first push creates it)."""

    def __init__(self, store: EmbeddingStore, client: OptimizerClient) -> None:
        self.config = store.config
        self._store = store
        self._client = client
        config = store.config
        self._owned = {t.name for t in config.tables if config.reads_through_owner(t.name)}

    async def lookup(self, table: str, ids: Any, *, create: bool = True) -> NDArray[np.float32]:
        return (await self.lookup_many({table: ids}, create=create))[table]

    async def lookup_many(
        self, ids: Mapping[str, Any], *, create: bool = True
    ) -> dict[str, NDArray[np.float32]]:
        """`EmbeddingStore.lookup_many`'s answer, each table read where it must be (the
        store and the replicas at once)."""
        owned = {t: i for t, i in ids.items() if t in self._owned}
        rest = {t: i for t, i in ids.items() if t not in self._owned}
        if not owned:
            return await self._store.lookup_many(rest, create=create)
        if rest:
            from_store, from_owners = await asyncio.gather(
                self._store.lookup_many(rest, create=create), self._client.rows(owned)
            )
        else:
            from_store, from_owners = {}, await self._client.rows(owned)
        return {**from_store, **{table: rows for table, (rows, _) in from_owners.items()}}
