"""The cluster file: one TOML file every component reads (`--config PATH`).

`load_config(path)` is the only code that reads TOML. It validates everything at
load time and rejects unknown keys and bad values with one message naming the key
path and what was expected, e.g. `tables[1].dim: expected a positive integer,
got -3`. The objects are frozen; change them with `dataclasses.replace`.

See docs/configuration.md for every key, its unit and its default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias, cast
from urllib.parse import urlsplit

from lookup_table.core.expiry import MAX_RELATIVE_TTL_S, MAX_TTL_S
from lookup_table.core.hashing import stable_hash
from lookup_table.core.initializers import InitializerSpec
from lookup_table.core.keys import validate_name
from lookup_table.core.precision import ROW_DTYPES, Rounding, RowDtype
from lookup_table.errors import ConfigError, KeyEncodingError

__all__ = [
    "AdagradConfig",
    "AdamConfig",
    "ClusterConfig",
    "NodeSpec",
    "OptimizerConfig",
    "RowwiseAdagradConfig",
    "RowwiseAdamConfig",
    "SGDConfig",
    "ServiceConfig",
    "StoreConfig",
    "TableSpec",
    "load_config",
    "parse_config",
]

TOKEN_ENV = "LOOKUP_TABLE_TOKEN"
DEFAULT_ADMIT_TTL_S = 86_400
"""An admission counter's life without a sighting when neither admit_ttl_s nor ttl_s is set."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """One memcached server."""

    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamConfig:
    """Adam (Kingma & Ba, 2015) with Keras' parameter names and defaults."""

    name: Literal["adam"] = "adam"
    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7


@dataclass(frozen=True, slots=True, kw_only=True)
class SGDConfig:
    """SGD with optional (Nesterov) momentum, Keras' names and defaults."""

    name: Literal["sgd"] = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AdagradConfig:
    """Adagrad (Duchi et al., 2011), Keras' names and defaults."""

    name: Literal["adagrad"] = "adagrad"
    learning_rate: float = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7


@dataclass(frozen=True, slots=True, kw_only=True)
class RowwiseAdagradConfig:
    """Row-wise Adagrad (one float32 accumulator a row) with FBGEMM's defaults (its
    `learning_rate`, `eps`, zero state); `core.optimizers.rowwise_adagrad`."""

    name: Literal["rowwise_adagrad"] = "rowwise_adagrad"
    learning_rate: float = 0.01
    initial_accumulator_value: float = 0.0
    epsilon: float = 1e-8


MOMENTUM_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True, slots=True, kw_only=True)
class RowwiseAdamConfig:
    """Row-wise Adam with Keras Adam's names and defaults; `momentum_dtype` is how the
    first moment is stored ("bfloat16": float32's range in half the bytes);
    `core.optimizers.rowwise_adam`."""

    name: Literal["rowwise_adam"] = "rowwise_adam"
    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    momentum_dtype: Literal["float32", "bfloat16"] = "bfloat16"

    def __post_init__(self) -> None:
        if self.momentum_dtype not in MOMENTUM_DTYPES:
            raise ConfigError(
                f"momentum_dtype {self.momentum_dtype!r}: expected 'float32' or 'bfloat16' "
                f"(the first moment needs float32's range: bfloat16 keeps it in 2 bytes)"
            )


OptimizerConfig: TypeAlias = (
    AdamConfig | SGDConfig | AdagradConfig | RowwiseAdagradConfig | RowwiseAdamConfig
)
_OPTIMIZERS: dict[str, type[OptimizerConfig]] = {
    "adam": AdamConfig,
    "sgd": SGDConfig,
    "adagrad": AdagradConfig,
    "rowwise_adagrad": RowwiseAdagradConfig,
    "rowwise_adam": RowwiseAdamConfig,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TableSpec:
    """A named embedding table with a fixed dim.

    `seed` defaults to a stable hash of the table name, so two tables never share
    initial rows unless the user gives them the same seed on purpose.

    Lifecycle (docs/storage.md): `ttl_s` lets a row and its slots expire in memcached
    when nothing read or updated them for that many seconds (None: never);
    `admit_after` stores a row only from the K-th sighting of its id in training
    lookups (1: at once), counted in memcached by counters that expire after
    `admit_ttl_s` without a sighting (None: the table's `ttl_s`, else one day).

    `dtype`: how the rows are stored (float32, or float16/bfloat16 in half the bytes:
    stepped in float32, rounded when stored; trainers get float32 rows). `rounding`: how
    a 16-bit table's stepped rows are rounded (stochastic where a replay can repeat it,
    or to nearest).
    """

    name: str
    dim: int
    seed: int
    id_type: Literal["int64", "string"] = "int64"
    initializer: InitializerSpec = field(default_factory=InitializerSpec)
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    ttl_s: int | None = None
    admit_after: int = 1
    admit_ttl_s: int | None = None
    dtype: RowDtype = "float32"
    rounding: Rounding = "stochastic"

    @property
    def plain_rows(self) -> bool:
        """Whether its rows may be held outside memcached (written behind by the replicas,
        kept from answers by trainers): int64 ids, no `ttl_s` (memcached expires those),
        no `admit_after` (each lookup counts a sighting in memcached)."""
        return self.id_type == "int64" and self.ttl_s is None and self.admit_after == 1

    @property
    def counter_ttl_s(self) -> int:
        """How long an admission counter lives after the last sighting it counted."""
        if self.admit_ttl_s is not None:
            return self.admit_ttl_s
        return self.ttl_s if self.ttl_s is not None else DEFAULT_ADMIT_TTL_S


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How clients talk to memcached (`[store]`)."""

    timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    pool_size: int = 4
    max_batch_keys: int = 16384
    trainer_cache_mb: int = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceConfig:
    """How the optimizer service runs (`[service]`)."""

    max_body_bytes: int = 64 * 2**20
    push_record_ttl_s: int = 86_400
    long_poll_timeout_s: float = 30.0
    request_timeout_s: float = 60.0
    cache_mb: int = 256
    dense_flush_pushes: int = 20
    dense_flush_s: float = 10.0
    # rows written behind (docs/write-behind.md), every this many pushes; 1 writes each
    # push's rows at the push (written through)
    row_flush_pushes: int = 56
    row_flush_s: float = 10.0


# a replica's journal slots (optimizer_service.engine.journal.MAX_JOURNAL_SLOTS) hold the pushes
# written behind (row_flush_pushes) and those in flight (8)
MAX_ROW_FLUSH_PUSHES = 56


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """The whole cluster file."""

    namespace: str
    memcached: tuple[NodeSpec, ...]
    optimizers: tuple[str, ...] = ()
    mode: Literal["async", "sync"] = "async"
    workers: int = 1
    token: str = field(default="", repr=False)
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    tables: tuple[TableSpec, ...] = ()
    store: StoreConfig = field(default_factory=StoreConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    # the tables by name: `table` is on every push's path, several times per table
    _by_name: dict[str, TableSpec] = field(init=False, repr=False, compare=False)
    # `fingerprint`, computed once: every push carries it
    _fingerprint: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tables})
        canonical = json.dumps(
            self.agreement(), sort_keys=True, separators=(",", ":"), allow_nan=False
        )
        object.__setattr__(self, "_fingerprint", hashlib.sha256(canonical.encode()).hexdigest())

    def has_table(self, name: str) -> bool:
        return name in self._by_name

    def table(self, name: str) -> TableSpec:
        """The spec of table `name`; ConfigError listing the known tables otherwise."""
        spec = self._by_name.get(name)
        if spec is not None:
            return spec
        known = ", ".join(t.name for t in self.tables) or "none"
        raise ConfigError(f"unknown table {name!r}; the cluster file defines: {known}")

    def reads_through_owner(self, name: str) -> bool:
        """Whether trainers read table `name`'s rows from their owning replica, not from
        memcached: its rows are written behind (`service.row_flush_pushes` > 1), so
        memcached may not hold their newest values yet (docs/write-behind.md). Not for
        string ids or `ttl_s` (the replicas do not cache those: written through), nor for
        `admit_after` (its lookups count sightings in memcached: written through too)."""
        return self.service.row_flush_pushes > 1 and self.table(name).plain_rows

    @property
    def node_addresses(self) -> tuple[str, ...]:
        return tuple(n.address for n in self.memcached)

    def agreement(self) -> dict[str, Any]:
        """What trainers and every optimizer replica must agree on, as JSON-able data:
        the namespace, the memcached nodes (a row's node is chosen from their addresses),
        the number of replicas (a row's owner is chosen from it), the mode (and in sync
        mode the workers), the default optimizer and every table by name with all that
        decides its rows. Not the service's or store's tuning, the token, nor the
        replicas' URLs (a trainer may reach a replica by another host name)."""
        out: dict[str, Any] = {
            "namespace": self.namespace,
            "memcached": sorted(self.node_addresses),
            "replicas": max(len(self.optimizers), 1),
            "mode": self.mode,
            "optimizer": dataclasses.asdict(self.optimizer),
            "tables": {
                t.name: {
                    "dim": t.dim,
                    "dtype": t.dtype,
                    **({"rounding": t.rounding} if t.dtype != "float32" else {}),
                    "id_type": t.id_type,
                    "seed": t.seed,
                    "initializer": t.initializer.to_dict(),
                    "optimizer": dataclasses.asdict(t.optimizer),
                    "ttl_s": t.ttl_s,
                    "admit_after": t.admit_after,
                    "admit_ttl_s": t.admit_ttl_s,
                }
                for t in self.tables
            },
        }
        if self.mode == "sync":
            out["workers"] = self.workers
        return out

    @property
    def fingerprint(self) -> str:
        """The sha256 (hex) of `agreement()` as canonical JSON: equal in every process
        whose cluster file agrees, whatever the Python version or hash seed."""
        return self._fingerprint

    def sender(self, replica: int) -> dict[str, Any]:
        """What every push and read of rows to replica `replica` carries, so the replica
        refuses it unless it runs an agreeing file: `{namespace, fingerprint, replica}`."""
        return {"namespace": self.namespace, "fingerprint": self.fingerprint, "replica": replica}

    def differences(self, agreement: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        """Where `agreement` (another process's `agreement()`) differs from this file's:
        (field path such as `tables[ads].optimizer.learning_rate`, this file's value,
        theirs), in a stable order; None stands for a field one side lacks."""
        out: list[tuple[str, Any, Any]] = []
        _diff(self.agreement(), agreement, "", out)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The TOML-shaped dict that `parse_config` turns back into an equal object."""
        return {
            "namespace": self.namespace,
            "memcached": list(self.node_addresses),
            "optimizers": list(self.optimizers),
            "mode": self.mode,
            "workers": self.workers,
            "token": self.token,
            "optimizer": dataclasses.asdict(self.optimizer),
            "store": dataclasses.asdict(self.store),
            "service": dataclasses.asdict(self.service),
            "tables": [
                {
                    "name": t.name,
                    "dim": t.dim,
                    "seed": t.seed,
                    "id_type": t.id_type,
                    "initializer": t.initializer.to_dict(),
                    "optimizer": dataclasses.asdict(t.optimizer),
                    **({"ttl_s": t.ttl_s} if t.ttl_s is not None else {}),
                    **({"admit_after": t.admit_after} if t.admit_after != 1 else {}),
                    **({"admit_ttl_s": t.admit_ttl_s} if t.admit_ttl_s is not None else {}),
                    **({"dtype": t.dtype} if t.dtype != "float32" else {}),
                    **({"rounding": t.rounding} if t.rounding != "stochastic" else {}),
                }
                for t in self.tables
            ],
        }


def _diff(mine: Any, theirs: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    # another optimizer or initializer: the whole of it, not each parameter
    if (
        isinstance(mine, Mapping)
        and isinstance(theirs, Mapping)
        and mine.get("name", "") == theirs.get("name", "")
    ):
        for key in sorted(set(mine) | set(theirs), key=str):
            # tables are keyed by name: tables[ads].dim reads as the cluster file does
            sub = f"{path}[{key}]" if path == "tables" else f"{path}.{key}" if path else str(key)
            _diff(mine.get(key), theirs.get(key), sub, out)
    elif mine != theirs:
        out.append((path, mine, theirs))


# ---------------------------------------------------------------- validation


class _Section:
    """Take keys out of one TOML table, checking types; leftovers are unknown keys."""

    def __init__(self, raw: object, path: str) -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path or 'the file'}: expected a table, got {raw!r}")
        self.raw = dict(raw)
        self.path = path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, default: Any) -> Any:
        return self.raw.pop(key, default)

    def string(self, key: str, default: str | None = None) -> str:
        value = self.take(key, default)
        if not isinstance(value, str):
            what = "missing" if value is None else f"got {value!r}"
            raise ConfigError(f"{self.at(key)}: expected a string, {what}")
        return value

    def integer(
        self,
        key: str,
        default: int | None = None,
        *,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int:
        value = self.take(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            what = "missing" if value is None else f"got {value!r}"
            expect = "a positive integer" if minimum == 1 else "an integer"
            raise ConfigError(f"{self.at(key)}: expected {expect}, {what}")
        if minimum is not None and value < minimum:
            expect = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ConfigError(f"{self.at(key)}: expected {expect}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{self.at(key)}: expected at most {maximum}, got {value}")
        return value

    def number(
        self, key: str, default: float, *, positive: bool = False, below_one: bool = False
    ) -> float:
        value = self.take(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigError(f"{self.at(key)}: expected a finite number, got {value!r}")
        if positive and not value > 0:
            raise ConfigError(f"{self.at(key)}: expected a positive number, got {value}")
        if not positive and value < 0:
            raise ConfigError(f"{self.at(key)}: expected a number >= 0, got {value}")
        if below_one and not value < 1:
            raise ConfigError(f"{self.at(key)}: expected a number in [0, 1), got {value}")
        return float(value)

    def seconds(self, key: str) -> int | None:
        """An optional whole number of seconds in [1, MAX_TTL_S] (an expiry time)."""
        if key not in self.raw:
            return None
        value = self.take(key, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{self.at(key)}: expected a positive integer number of seconds, got {value!r}"
            )
        if value > MAX_TTL_S:
            raise ConfigError(
                f"{self.at(key)}: at most {MAX_TTL_S} seconds (365 days), got {value}; "
                f"values above {MAX_RELATIVE_TTL_S} (30 days) are sent to memcached as "
                f"absolute unix times, which must fit in 32 bits"
            )
        return value

    def choice(self, key: str, default: str, allowed: tuple[str, ...], *, why: str) -> str:
        """A string that is one of `allowed`; `why` says what the choices mean."""
        value = self.take(key, default)
        if value not in allowed:
            raise ConfigError(
                f"{self.at(key)}: expected one of {', '.join(repr(a) for a in allowed)}, "
                f"got {value!r} ({why})"
            )
        return cast(str, value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.take(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.at(key)}: expected true or false, got {value!r}")
        return value

    def finish(self, allowed: list[str]) -> None:
        for key in self.raw:
            raise ConfigError(
                f"{self.at(key)}: unknown key; expected one of {', '.join(sorted(allowed))}"
            )


def _parse_node(value: object, path: str) -> NodeSpec:
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(f"{path}: expected 'host:port', got {value!r}")
    host, port_text = value.split(":")
    # isascii: str.isdigit() is also true for "²" (int() refuses it) and "１２" (int() takes it)
    digits = port_text.isascii() and port_text.isdigit()
    if not host or not digits or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{path}: expected 'host:port' with a port in 1-65535, got {value!r}")
    return NodeSpec(host=host, port=int(port_text))


def _parse_url(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected an http:// URL, got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{path}: expected an http:// URL like 'http://127.0.0.1:8470', got {value!r}"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ConfigError(f"{path}: bad port in URL {value!r}") from None
    return value.rstrip("/")


def _parse_optimizer(
    raw: object, path: str, base: OptimizerConfig | None = None
) -> OptimizerConfig:
    """Parse `[optimizer]`; a table's override starts from `base` when the name matches."""
    section = _Section(raw, path)
    default_name = base.name if base is not None else "adam"
    name = section.string("name", default_name)
    if name not in _OPTIMIZERS:
        raise ConfigError(
            f"{section.at('name')}: unknown optimizer {name!r}; expected one of "
            f"{', '.join(sorted(_OPTIMIZERS))}"
        )
    cls = _OPTIMIZERS[name]
    start = base if base is not None and base.name == name else cls()
    fields = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
    values: dict[str, Any] = {}
    for key in fields:
        current = getattr(start, key)
        if isinstance(current, bool):
            values[key] = section.boolean(key, current)
        elif key == "learning_rate" or key == "epsilon":
            values[key] = section.number(key, current, positive=True)
        elif key in ("beta_1", "beta_2", "momentum"):
            values[key] = section.number(key, current, below_one=True)
        elif key == "momentum_dtype":
            values[key] = section.choice(
                key,
                current,
                MOMENTUM_DTYPES,
                why="bfloat16 keeps the first moment's float32 range in 2 bytes",
            )
        else:
            values[key] = section.number(key, current)
    section.finish(["name", *fields])
    return cls(**values)


def _parse_table(raw: object, path: str, default_optimizer: OptimizerConfig) -> TableSpec:
    section = _Section(raw, path)
    name = section.string("name")
    try:
        validate_name(name, "table name")
    except KeyEncodingError as exc:
        raise ConfigError(f"{section.at('name')}: {exc}") from None
    dim = section.integer("dim", minimum=1)
    seed = section.integer("seed", stable_hash("seed:" + name) & 0x7FFFFFFF)
    id_type = section.string("id_type", "int64")
    if id_type not in ("int64", "string"):
        raise ConfigError(f"{section.at('id_type')}: expected 'int64' or 'string', got {id_type!r}")
    init_raw = section.take("initializer", {"name": "uniform"})
    if isinstance(init_raw, str):
        init_raw = {"name": init_raw}
    if not isinstance(init_raw, Mapping):
        raise ConfigError(
            f"{section.at('initializer')}: expected a table or a name, got {init_raw!r}"
        )
    try:
        initializer = InitializerSpec.from_dict(init_raw, where=section.at("initializer"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    opt_raw = section.take("optimizer", None)
    optimizer = (
        default_optimizer
        if opt_raw is None
        else _parse_optimizer(opt_raw, section.at("optimizer"), default_optimizer)
    )
    dtype = section.choice(
        "dtype",
        "float32",
        ROW_DTYPES,
        why="float32 stores rows as they are; float16 and bfloat16 in half the bytes",
    )
    rounding_given = "rounding" in section.raw
    rounding = section.choice(
        "rounding",
        "stochastic",
        ("stochastic", "nearest"),
        why="stochastic keeps updates smaller than the dtype's gap on average; nearest rounds "
        "each stored value to the closest one",
    )
    if rounding_given and dtype == "float32":
        raise ConfigError(
            f"{section.at('rounding')}: only used with dtype 'float16' or 'bfloat16' (float32 "
            f"rows are stored as stepped); remove it or set dtype"
        )
    ttl_s = section.seconds("ttl_s")
    admit_after = section.integer("admit_after", 1, minimum=1)
    admit_ttl_s = section.seconds("admit_ttl_s")
    if admit_ttl_s is not None and admit_after == 1:
        raise ConfigError(
            f"{section.at('admit_ttl_s')}: only used with admit_after >= 2 (admit_after is 1: "
            f"every id gets a row at once, nothing is counted); remove it or set admit_after"
        )
    section.finish(
        [
            "admit_after",
            "admit_ttl_s",
            "dim",
            "dtype",
            "id_type",
            "initializer",
            "name",
            "optimizer",
            "rounding",
            "seed",
            "ttl_s",
        ]
    )
    return TableSpec(
        name=name,
        dim=dim,
        seed=seed,
        id_type=cast(Literal["int64", "string"], id_type),  # checked above; str does not narrow
        initializer=initializer,
        optimizer=optimizer,
        ttl_s=ttl_s,
        admit_after=admit_after,
        admit_ttl_s=admit_ttl_s,
        dtype=cast(RowDtype, dtype),  # checked above; str does not narrow
        rounding=cast(Rounding, rounding),
    )


def _parse_store(raw: object) -> StoreConfig:
    section = _Section(raw, "store")
    defaults = StoreConfig()
    store = StoreConfig(
        timeout_s=section.number("timeout_s", defaults.timeout_s, positive=True),
        connect_timeout_s=section.number(
            "connect_timeout_s", defaults.connect_timeout_s, positive=True
        ),
        pool_size=section.integer("pool_size", defaults.pool_size, minimum=1),
        max_batch_keys=section.integer("max_batch_keys", defaults.max_batch_keys, minimum=1),
        trainer_cache_mb=section.integer("trainer_cache_mb", defaults.trainer_cache_mb, minimum=0),
    )
    section.finish([f.name for f in dataclasses.fields(StoreConfig)])
    return store


def _parse_service(raw: object) -> ServiceConfig:
    section = _Section(raw, "service")
    defaults = ServiceConfig()
    service = ServiceConfig(
        max_body_bytes=section.integer("max_body_bytes", defaults.max_body_bytes, minimum=1024),
        push_record_ttl_s=section.seconds("push_record_ttl_s") or defaults.push_record_ttl_s,
        long_poll_timeout_s=section.number(
            "long_poll_timeout_s", defaults.long_poll_timeout_s, positive=True
        ),
        request_timeout_s=section.number(
            "request_timeout_s", defaults.request_timeout_s, positive=True
        ),
        cache_mb=section.integer("cache_mb", defaults.cache_mb, minimum=0),
        dense_flush_pushes=section.integer(
            "dense_flush_pushes", defaults.dense_flush_pushes, minimum=1
        ),
        dense_flush_s=section.number("dense_flush_s", defaults.dense_flush_s, positive=True),
        row_flush_pushes=section.integer(
            "row_flush_pushes",
            defaults.row_flush_pushes,
            minimum=1,
            maximum=MAX_ROW_FLUSH_PUSHES,
        ),
        row_flush_s=section.number("row_flush_s", defaults.row_flush_s, positive=True),
    )
    section.finish([f.name for f in dataclasses.fields(ServiceConfig)])
    return service


def parse_config(raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Validate a TOML-shaped dict (what `tomllib` returns) into a ClusterConfig.

    The token comes from `token`, or from $LOOKUP_TABLE_TOKEN when `token` is empty.
    """
    env = os.environ if env is None else env
    top = _Section(raw, "")
    namespace = top.string("namespace")
    try:
        validate_name(namespace, "namespace")
    except KeyEncodingError as exc:
        raise ConfigError(f"namespace: {exc}") from None

    nodes_raw = top.take("memcached", None)
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ConfigError(f"memcached: expected a non-empty list of 'host:port', got {nodes_raw!r}")
    nodes = tuple(_parse_node(v, f"memcached[{i}]") for i, v in enumerate(nodes_raw))
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if node.address in seen:
            raise ConfigError(f"memcached[{i}]: {node.address} is listed twice")
        seen.add(node.address)

    urls_raw = top.take("optimizers", [])
    if not isinstance(urls_raw, list):
        raise ConfigError(f"optimizers: expected a list of URLs, got {urls_raw!r}")
    optimizers = tuple(_parse_url(v, f"optimizers[{i}]") for i, v in enumerate(urls_raw))
    if len(set(optimizers)) != len(optimizers):
        raise ConfigError(f"optimizers: a URL is listed twice in {list(optimizers)}")

    mode = top.string("mode", "async")
    if mode not in ("async", "sync"):
        raise ConfigError(f"mode: expected 'async' or 'sync', got {mode!r}")
    workers = top.integer("workers", 1, minimum=1)
    token = top.string("token", "") or env.get(TOKEN_ENV, "")
    optimizer = _parse_optimizer(top.take("optimizer", {}), "optimizer")
    store = _parse_store(top.take("store", {}))
    service = _parse_service(top.take("service", {}))

    tables_raw = top.take("tables", [])
    if not isinstance(tables_raw, list):
        raise ConfigError(f"tables: expected an array of tables ([[tables]]), got {tables_raw!r}")
    tables = tuple(_parse_table(t, f"tables[{i}]", optimizer) for i, t in enumerate(tables_raw))
    names = [t.name for t in tables]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"tables[{i}].name: table {name!r} is defined twice")
    top.finish(
        [
            "memcached",
            "mode",
            "namespace",
            "optimizer",
            "optimizers",
            "service",
            "store",
            "tables",
            "token",
            "workers",
        ]
    )
    return ClusterConfig(
        namespace=namespace,
        memcached=nodes,
        optimizers=optimizers,
        mode=cast(Literal["async", "sync"], mode),  # checked above; str does not narrow
        workers=workers,
        token=token,
        optimizer=optimizer,
        tables=tables,
        store=store,
        service=service,
    )


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate a cluster file.

    Raises:
        ConfigError: the file is missing, not TOML, or has a bad key; the message
            starts with the file path and names the key.
    """
    p = Path(path)
    try:
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{p}: cluster file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # tomllib.load decodes UTF-8 first
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the cluster file: {exc.strerror or exc}") from None
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
