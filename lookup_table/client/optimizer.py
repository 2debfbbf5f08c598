"""`OptimizerClient`: push gradients to the optimizer service replicas, read rows and dense
parameters through them, pause and resume them; before its first request that reads or
changes the model, it checks that each replica runs a cluster file that agrees with its own.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import aiohttp
import numpy as np
from numpy.typing import NDArray

from lookup_table.client.answers import (
    created,
    error_of,
    merged_answer,
    params_of,
    rows_answer,
    store_error,
    two_part_answer,
)
from lookup_table.client.requests import push_stats, wire_tables
from lookup_table.config import ClusterConfig
from lookup_table.core.keys import IdArray, as_ids
from lookup_table.core.sharding import owner_of
from lookup_table.core.wire import CONTENT_TYPE, encode_array, pack, pack_view, unpack
from lookup_table.errors import (
    ClusterMismatchError,
    LookupTableError,
    PushRejectedError,
    ReplicaUnavailableError,
)

__all__ = ["OptimizerClient"]

logger = logging.getLogger(__name__)


class OptimizerClient:
    """Async client of every optimizer replica of a cluster.

        async with OptimizerClient(config, worker=0) as client:
            await client.push({"user": (ids, grads)})

    A push is split by replica (each replica owns a fixed hash partition of the rows);
    every part carries the same `push_id`, and a part that fails with a connection
    error, a timeout or a 5xx is retried with that `push_id` and exponential backoff, so
    a retry is applied at most once. A 4xx raises `PushRejectedError`; a memcached error
    a replica reports is raised at once, without retries, as the store's own error
    naming the node.

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
        reads: Mapping[str, Any] | None = None,
        on_answer: Callable[[dict[str, Any]], None] | None = None,
        on_read: Callable[[dict[str, tuple[NDArray[np.float32], int]]], None] | None = None,
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
        `reads` (`{table: ids}`) are rows to read as `rows` does, with the push (a
        trainer's next batch, without a request of its own): `read` in the summary is
        what `rows` returns for them, read once the push's new values are computed (its
        own rows as it changed them; read-only arrays); the replicas send it after their
        answer, and `on_read(read)` (on the client's loop) gets it once every replica's
        arrived.
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
        stats = push_stats(examples, loss)
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
        parts = [wire_tables(self.config, mine, grads=True) for mine in split]
        read = _Reads(self.config, reads) if reads else None
        bodies: dict[int, bytes | memoryview] = {}
        every = self.config.mode == "sync"  # each replica counts every worker's push
        want_dense = "dense" in answer
        for k in range(n_replicas):
            singles, groups = parts[k]
            reading = read is not None and k in read.requests
            if every or singles or groups or reading or (k == 0 and (dense or want_dense)):
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
                if read is not None and reading:
                    body["read"] = read.body(k)
                if stats and not bodies:  # one replica counts them
                    body["stats"] = stats
                # a push's body is a megabyte: the packer's own buffer, not a copy of it
                bodies[k] = pack_view(body)
        answers: dict[int, dict[str, Any]] = {}
        # decoded once, when every replica answered: for `on_answer` and the summary
        merged: dict[str, Any] = {}

        def answered(k: int, doc: dict[str, Any]) -> None:
            if k in answers:  # a retry answers again: the first answer stands
                return
            answers[k] = doc
            if len(answers) == len(bodies):
                merged.update(merged_answer(answers, answer, copy=False))
                if on_answer is not None:
                    on_answer(dict(merged))

        docs_read: dict[int, dict[str, Any]] = {}
        got_read: dict[str, Any] = {}

        def read_answered(k: int, doc: dict[str, Any]) -> None:
            if read is None or k in docs_read:  # a retry answers again: the first stands
                return
            if not isinstance(doc.get("read"), dict):
                raise LookupTableError(f"replica {k} answered a push's read without its rows")
            docs_read[k] = doc["read"]
            if len(docs_read) == len(read.requests):
                got_read.update(read.rows(docs_read, copy=False))
                if on_read is not None:
                    on_read(dict(got_read))

        results = await asyncio.gather(
            *(
                self._request(
                    k,
                    "POST",
                    "/v1/gradients",
                    body,
                    first=functools.partial(answered, k) if answer or read else None,
                    then=(
                        functools.partial(read_answered, k)
                        if read is not None and k in read.requests
                        else None
                    ),
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
            "created": created(results),
        }
        if answer or read:
            # (merged is empty only when no replica was asked: a read asks one)
            summary.update(merged or merged_answer(answers, answer, copy=False))
            if "params" in summary:  # the caller's own, writable
                summary["params"] = {n: p.copy() for n, p in summary["params"].items()}
        if read is not None:
            summary["read"] = got_read
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
        reads = _Reads(self.config, tables)
        ks = list(reads.requests)
        bodies = {k: pack({**reads.body(k), **self.config.sender(k)}) for k in ks}
        docs = await asyncio.gather(*(self._request(k, "POST", "/v1/rows", bodies[k]) for k in ks))
        return reads.rows(dict(zip(ks, docs, strict=True)))

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
        return int(doc["version"]), params_of(doc["params"])

    async def dense(self) -> tuple[int, dict[str, NDArray[np.float32]]]:
        """The current dense parameters and their version (replica 0)."""
        await self._agree(range(len(self.config.optimizers)))
        doc = await self._request(0, "GET", "/v1/dense", None)
        return int(doc["version"]), params_of(doc["params"])

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
        body: bytes | memoryview | None,
        *,
        first: Callable[[dict[str, Any]], None] | None = None,
        then: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """One request with retries. With `first`, a 2xx reply is two msgpack maps (an
        answer, handed to `first` as soon as it arrives, then the outcome, returned or
        raised as an error answer would be); with `then` too, three: the second (a
        push's `read`) is handed to `then`."""
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
                        outcome = await two_part_answer(resp, first, then)
                        if "error" not in outcome:
                            return outcome
                        status = int(outcome.get("status", 500))
                        message, doc = str(outcome["error"]), outcome
                    else:
                        message, doc = error_of(await resp.read(), status)
                    typed = store_error(doc, f"replica {replica} ({url}): {message}")
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


class _Reads:
    """Rows to read through their owners (`OptimizerClient.rows`, a push's `reads`): each
    table's unique ids split by owner, the request of each replica, and its answers put
    back into the order of the ids asked."""

    def __init__(self, config: ClusterConfig, tables: Mapping[str, Any]) -> None:
        self.config = config
        n_replicas = len(config.optimizers)
        split: list[dict[str, tuple[IdArray, None]]] = [{} for _ in range(n_replicas)]
        # per table: its unique ids, where each id asked is among them (None: they are
        # the ids asked, as a trainer asks: sorted and distinct), and each replica's share
        # of them (None: all, one replica)
        self.unique: dict[str, tuple[Any, NDArray[np.intp] | None, list[tuple[int, Any]]]] = {}
        for name, ids in tables.items():
            id_array = as_ids(ids, table=name)
            inverse: NDArray[np.intp] | None = None
            uniq = id_array
            if id_array.dtype != np.int64 or not bool((id_array[1:] > id_array[:-1]).all()):
                uniq = cast(IdArray, np.unique(id_array))
                inverse = np.searchsorted(uniq, id_array)
            where: list[tuple[int, Any]] = []
            if n_replicas == 1:
                if uniq.shape[0]:
                    split[0][name] = (uniq, None)
                    where.append((0, None))
            else:
                owners = owner_of(name, uniq, n_replicas)
                for k in range(n_replicas):
                    mine = np.flatnonzero(owners == k)
                    if mine.shape[0]:
                        split[k][name] = (uniq[mine], None)
                        where.append((k, mine))
            self.unique[name] = (uniq, inverse, where)
        self.requests = {
            k: wire_tables(config, split[k], grads=False) for k in range(n_replicas) if split[k]
        }

    def body(self, k: int) -> dict[str, Any]:
        """Replica `k`'s read: `{tables, groups}` (groups only when there are some)."""
        singles, groups = self.requests[k]
        return {"tables": singles, **({"groups": groups} if groups else {})}

    def rows(
        self, docs: Mapping[int, Mapping[str, Any]], *, copy: bool = True
    ) -> dict[str, tuple[Any, int]]:
        """`{table: (rows in the order of its ids, how many had no row)}` from each
        replica's answer (`rows_answer`): the caller's own arrays, or (`copy=False`)
        perhaps read-only views of the answer's bytes."""
        answered = {k: rows_answer(docs[k], self.requests[k][1], k) for k in self.requests}
        out: dict[str, tuple[Any, int]] = {}
        for name, (uniq, inverse, where) in self.unique.items():
            dim = self.config.table(name).dim
            if len(where) == 1 and where[0][1] is None:  # one replica's, all of them
                k = where[0][0]
                rows, new = _replica_rows(answered[k], k, name, uniq.shape[0], dim)
                if inverse is None and copy:
                    rows = np.array(rows)
            else:
                rows, new = np.empty((uniq.shape[0], dim), dtype=np.float32), 0
                for k, mine in where:
                    got, their_new = _replica_rows(answered[k], k, name, mine.shape[0], dim)
                    rows[mine] = got
                    new += their_new
            out[name] = (rows if inverse is None else rows[inverse], new)
        return out


def _replica_rows(
    answered: Mapping[str, tuple[NDArray[np.float32], int]], k: int, name: str, n: int, dim: int
) -> tuple[NDArray[np.float32], int]:
    """Replica `k`'s (rows, how many had no row) of table `name`, checked to be `n` rows
    of `dim`."""
    rows, new = answered[name]
    if rows.shape != (n, dim):
        raise LookupTableError(
            f"replica {k} answered {rows.shape} rows of table {name!r} for {n} ids of dim {dim}"
        )
    return rows, new


def _shown(value: Any) -> str:
    """A value of a cluster file's agreement in a message (None: the side lacks it)."""
    if value is None:
        return "not set"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_shown(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
