"""The cluster file (lookup_table.config): load, validate, round trip."""

from __future__ import annotations

import copy
import dataclasses
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lookup_table.config import (
    AdagradConfig,
    AdamConfig,
    NodeSpec,
    RowwiseAdagradConfig,
    RowwiseAdamConfig,
    SGDConfig,
    StoreConfig,
    TableSpec,
    load_config,
    parse_config,
)
from lookup_table.core.initializers import InitializerSpec
from lookup_table.errors import ConfigError, LookupTableError

pytestmark = pytest.mark.unit

FULL_TOML = """\
namespace = "demo"                       # key prefix: many jobs, one fleet
memcached = ["127.0.0.1:11211", "127.0.0.1:11212"]
optimizers = ["http://127.0.0.1:8470", "http://127.0.0.1:8471/"]
mode = "sync"
workers = 2
token = ""

[optimizer]
name = "adam"
learning_rate = 0.001
beta_1 = 0.9
beta_2 = 0.999
epsilon = 1e-7

[store]
timeout_s = 2.5
connect_timeout_s = 1
pool_size = 8
max_batch_keys = 4096

[[tables]]
name = "user"
dim = 16
seed = 1
initializer = { name = "uniform", minval = -0.05, maxval = 0.05 }

[[tables]]
name = "item"
dim = 64
initializer = { name = "truncated_normal", stddev = 0.02 }
optimizer = { learning_rate = 0.01 }

[[tables]]
name = "query"
dim = 8
seed = 3
id_type = "string"
initializer = "zeros"
optimizer = { name = "adagrad", learning_rate = 0.05 }
"""

# The default seed of a table is stored implicitly (its initial rows derive from it).
GOLDEN_DEFAULT_SEEDS = {"user": 507504317, "item": 340219258}


def minimal(**extra: Any) -> dict[str, Any]:
    return {"namespace": "demo", "memcached": ["127.0.0.1:11211"], **extra}


def full_raw() -> dict[str, Any]:
    return tomllib.loads(FULL_TOML)


# ------------------------------------------------------------------ loading


def test_full_example_loads(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(FULL_TOML, encoding="utf-8")
    config = load_config(path)
    assert config.namespace == "demo"
    assert config.memcached == (
        NodeSpec(host="127.0.0.1", port=11211),
        NodeSpec(host="127.0.0.1", port=11212),
    )
    assert config.node_addresses == ("127.0.0.1:11211", "127.0.0.1:11212")
    assert config.optimizers == ("http://127.0.0.1:8470", "http://127.0.0.1:8471")
    assert config.mode == "sync"
    assert config.workers == 2
    assert config.optimizer == AdamConfig(
        learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7
    )
    assert config.store == StoreConfig(
        timeout_s=2.5, connect_timeout_s=1.0, pool_size=8, max_batch_keys=4096
    )
    assert isinstance(config.store.connect_timeout_s, float)
    user, item, query = config.tables
    assert user == TableSpec(
        name="user",
        dim=16,
        seed=1,
        initializer=InitializerSpec(name="uniform", params={"minval": -0.05, "maxval": 0.05}),
        optimizer=config.optimizer,
    )
    assert item.seed == GOLDEN_DEFAULT_SEEDS["item"]
    assert item.initializer == InitializerSpec(
        name="truncated_normal", params={"mean": 0.0, "stddev": 0.02}
    )
    assert item.optimizer == AdamConfig(learning_rate=0.01)
    assert query.id_type == "string"
    assert query.initializer == InitializerSpec(name="zeros", params={})
    assert query.optimizer == AdagradConfig(learning_rate=0.05)
    assert config.table("query") is query


def test_defaults_are_safe() -> None:
    config = parse_config(minimal(), env={})
    assert config.optimizers == ()
    assert config.mode == "async"
    assert config.workers == 1
    assert config.token == ""
    assert config.optimizer == AdamConfig()
    assert config.tables == ()
    assert config.store == StoreConfig()
    assert config.store.timeout_s > 0  # timeouts are on unless turned off
    assert config.store.connect_timeout_s > 0


def test_keras_optimizer_defaults() -> None:
    assert AdamConfig() == AdamConfig(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7)
    assert SGDConfig() == SGDConfig(learning_rate=0.01, momentum=0.0, nesterov=False)
    assert AdagradConfig() == AdagradConfig(
        learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7
    )


# ------------------------------------------------------------------ round trip


ROUND_TRIP_CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "full": full_raw,
    "minimal": minimal,
    "sgd": lambda: minimal(
        optimizer={"name": "sgd", "momentum": 0.9, "nesterov": True},
        tables=[{"name": "a", "dim": 1}, {"name": "b", "dim": 2, "optimizer": {"name": "adam"}}],
    ),
    "adagrad": lambda: minimal(
        optimizer={"name": "adagrad", "initial_accumulator_value": 0.0},
        tables=[{"name": "c.v2", "dim": 3, "initializer": {"name": "constant", "value": -1}}],
    ),
    "token": lambda: minimal(token="s3cret", workers=5, mode="async"),
    "lifecycle": lambda: minimal(
        tables=[
            {"name": "a", "dim": 2, "ttl_s": 3},
            {"name": "b", "dim": 2, "admit_after": 3},
            {"name": "c", "dim": 2, "ttl_s": 90 * 86_400, "admit_after": 2, "admit_ttl_s": 60},
        ]
    ),
    "precision": lambda: minimal(
        optimizer={"name": "rowwise_adam", "learning_rate": 0.01, "momentum_dtype": "float32"},
        tables=[
            {"name": "a", "dim": 2, "dtype": "float16", "rounding": "nearest"},
            {"name": "b", "dim": 3, "dtype": "bfloat16", "optimizer": {"name": "rowwise_adam"}},
            {"name": "c", "dim": 4, "optimizer": {"name": "rowwise_adagrad", "epsilon": 0.1}},
        ],
    ),
}


def test_row_dtypes_and_the_row_wise_optimizers() -> None:
    config = parse_config(ROUND_TRIP_CASES["precision"](), env={})
    a, b, c = config.tables
    assert (a.dtype, b.dtype, c.dtype) == ("float16", "bfloat16", "float32")  # float32: default
    assert a.optimizer == RowwiseAdamConfig(learning_rate=0.01, momentum_dtype="float32")
    # a table's own optimizer of the same name starts from the default one's values
    assert b.optimizer == RowwiseAdamConfig(learning_rate=0.01, momentum_dtype="float32")
    assert c.optimizer == RowwiseAdagradConfig(epsilon=0.1)
    assert c.optimizer.learning_rate == 0.01  # FBGEMM's default
    assert config.agreement()["tables"]["a"]["dtype"] == "float16"
    assert (a.rounding, b.rounding) == ("nearest", "stochastic")  # stochastic: default
    assert config.agreement()["tables"]["a"]["rounding"] == "nearest"


@pytest.mark.parametrize("case", sorted(ROUND_TRIP_CASES))
def test_round_trip_toml_object_dict_object(case: str) -> None:
    config = parse_config(ROUND_TRIP_CASES[case](), env={})
    as_dict = config.to_dict()
    again = parse_config(as_dict, env={})
    assert again == config
    assert again.to_dict() == as_dict
    # the dict only holds TOML types
    assert _toml_types_only(as_dict), as_dict


def _toml_types_only(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _toml_types_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_toml_types_only(v) for v in value)
    return isinstance(value, str | int | float | bool)


def test_replace_keeps_objects_frozen() -> None:
    config = parse_config(full_raw(), env={})
    changed = dataclasses.replace(config, workers=3)
    assert changed.workers == 3
    assert config.workers == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.workers = 4  # type: ignore[misc]


# ------------------------------------------------------------------ optimizer override


def test_table_without_optimizer_uses_the_global_one() -> None:
    config = parse_config(
        minimal(optimizer={"name": "sgd", "learning_rate": 0.5}, tables=[{"name": "t", "dim": 2}]),
        env={},
    )
    assert config.tables[0].optimizer == SGDConfig(learning_rate=0.5)


def test_override_with_the_same_name_merges_with_the_global_optimizer() -> None:
    raw = minimal(
        optimizer={"name": "adam", "learning_rate": 0.01, "beta_1": 0.8, "epsilon": 1e-6},
        tables=[
            {"name": "implicit", "dim": 2, "optimizer": {"beta_2": 0.99}},
            {"name": "explicit", "dim": 2, "optimizer": {"name": "adam", "learning_rate": 0.1}},
        ],
    )
    implicit, explicit = parse_config(raw, env={}).tables
    assert implicit.optimizer == AdamConfig(
        learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6
    )
    assert explicit.optimizer == AdamConfig(learning_rate=0.1, beta_1=0.8, epsilon=1e-6)


def test_override_with_another_name_starts_from_keras_defaults() -> None:
    raw = minimal(
        optimizer={"name": "adam", "learning_rate": 0.01, "epsilon": 1e-3},
        tables=[
            {"name": "s", "dim": 2, "optimizer": {"name": "sgd", "momentum": 0.5}},
            {"name": "a", "dim": 2, "optimizer": {"name": "adagrad"}},
        ],
    )
    sgd, adagrad = parse_config(raw, env={}).tables
    assert sgd.optimizer == SGDConfig(momentum=0.5)  # learning_rate 0.01 is SGD's default
    assert adagrad.optimizer == AdagradConfig()  # not the global epsilon=1e-3


def test_override_keys_must_belong_to_the_override_optimizer() -> None:
    raw = minimal(tables=[{"name": "t", "dim": 2, "optimizer": {"name": "sgd", "beta_1": 0.9}}])
    with pytest.raises(ConfigError, match=r"^tables\[0\]\.optimizer\.beta_1: unknown key"):
        parse_config(raw, env={})


# ------------------------------------------------------------------ seeds


def test_default_seed_is_stable_per_table_name() -> None:
    tables = [{"name": "user", "dim": 4}, {"name": "item", "dim": 4}]
    config = parse_config(minimal(tables=tables), env={})
    assert {t.name: t.seed for t in config.tables} == GOLDEN_DEFAULT_SEEDS
    # independent of position, namespace and other tables
    alone = parse_config({**minimal(tables=tables[1:]), "namespace": "other"}, env={})
    assert alone.tables[0].seed == GOLDEN_DEFAULT_SEEDS["item"]


def test_default_seeds_differ_between_tables() -> None:
    names = [f"table{i}" for i in range(200)]
    config = parse_config(minimal(tables=[{"name": n, "dim": 1} for n in names]), env={})
    seeds = [t.seed for t in config.tables]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**31 for s in seeds)


def test_explicit_seed_wins() -> None:
    config = parse_config(minimal(tables=[{"name": "user", "dim": 4, "seed": -7}]), env={})
    assert config.tables[0].seed == -7


# ------------------------------------------------------------------ errors


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation of the full example: set (or with value=DELETE remove) one key path."""

    def apply(raw: dict[str, Any]) -> None:
        node: Any = raw
        parts = re.findall(r"[^.\[\]]+", path)
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        last = parts[-1]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


DELETE = object()

BAD_VALUES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown top-level key", _set("memcache", ["h:1"]), "memcache: unknown key; expected one of"),
    ("unknown table key", _set("tables[1].dims", 3), r"tables\[1\]\.dims: unknown key"),
    ("unknown optimizer key", _set("optimizer.beta1", 0.9), r"optimizer\.beta1: unknown key"),
    ("unknown store key", _set("store.timeout", 1), r"store\.timeout: unknown key"),
    (
        "negative dim",
        _set("tables[1].dim", -3),
        r"tables\[1\]\.dim: expected a positive integer, got -3",
    ),
    ("zero dim", _set("tables[0].dim", 0), r"tables\[0\]\.dim: expected a positive integer, got 0"),
    ("float dim", _set("tables[0].dim", 16.0), r"tables\[0\]\.dim: expected a positive integer"),
    ("bool dim", _set("tables[0].dim", True), r"tables\[0\]\.dim: expected a positive integer"),
    ("missing dim", _set("tables[2].dim", DELETE), r"tables\[2\]\.dim: .*missing"),
    ("missing namespace", _set("namespace", DELETE), "namespace: expected a string, missing"),
    ("bad namespace", _set("namespace", "my ns"), "namespace: .*'my ns'"),
    ("reserved namespace", _set("namespace", "_meta"), "namespace: .*'_meta'"),
    ("namespace not a string", _set("namespace", 3), "namespace: expected a string, got 3"),
    ("no nodes", _set("memcached", []), "memcached: expected a non-empty list"),
    ("nodes not a list", _set("memcached", "127.0.0.1:11211"), "memcached: expected a non-empty"),
    (
        "node without port",
        _set("memcached[1]", "127.0.0.1"),
        r"memcached\[1\]: expected 'host:port', got '127.0.0.1'",
    ),
    ("node port 0", _set("memcached[0]", "h:0"), r"memcached\[0\]: .*port in 1-65535"),
    ("node port too big", _set("memcached[0]", "h:65536"), r"memcached\[0\]: .*1-65535"),
    ("node port not digits", _set("memcached[0]", "h:abc"), r"memcached\[0\]: .*'h:abc'"),
    ("node port superscript", _set("memcached[0]", "h:\u00b2"), r"memcached\[0\]: .*port"),
    ("node port fullwidth", _set("memcached[0]", "h:\uff11\uff12"), r"memcached\[0\]: .*port"),
    ("node without host", _set("memcached[0]", ":11211"), r"memcached\[0\]: .*host:port"),
    ("node not a string", _set("memcached[0]", 11211), r"memcached\[0\]: expected 'host:port'"),
    (
        "duplicate node",
        _set("memcached[1]", "127.0.0.1:11211"),
        r"memcached\[1\]: 127.0.0.1:11211 is listed twice",
    ),
    ("bad URL scheme", _set("optimizers[0]", "ftp://h:1"), r"optimizers\[0\]: expected an http"),
    ("URL without host", _set("optimizers[1]", "http://"), r"optimizers\[1\]: expected an http"),
    ("URL bad port", _set("optimizers[0]", "http://h:99999"), r"optimizers\[0\]: bad port"),
    ("URL not a string", _set("optimizers[0]", 8470), r"optimizers\[0\]: expected an http"),
    ("optimizers not a list", _set("optimizers", "http://h:1"), "optimizers: expected a list"),
    ("duplicate URL", _set("optimizers[1]", "http://127.0.0.1:8470"), "optimizers: .*twice"),
    ("bad mode", _set("mode", "parallel"), "mode: expected 'async' or 'sync', got 'parallel'"),
    ("workers 0", _set("workers", 0), "workers: expected a positive integer, got 0"),
    ("workers str", _set("workers", "2"), "workers: expected a positive integer, got '2'"),
    ("token not a string", _set("token", 5), "token: expected a string, got 5"),
    (
        "negative learning rate",
        _set("optimizer.learning_rate", -0.1),
        r"optimizer\.learning_rate: expected a positive number, got -0.1",
    ),
    ("zero learning rate", _set("optimizer.learning_rate", 0), r"optimizer\.learning_rate: "),
    (
        "nan learning rate",
        _set("optimizer.learning_rate", float("nan")),
        r"optimizer\.learning_rate: expected a finite number",
    ),
    (
        "string learning rate",
        _set("optimizer.learning_rate", "0.1"),
        r"optimizer\.learning_rate: expected a finite number, got '0.1'",
    ),
    (
        "beta_1 = 1",
        _set("optimizer.beta_1", 1.0),
        r"optimizer\.beta_1: expected a number in \[0, 1\)",
    ),
    ("beta_2 > 1", _set("optimizer.beta_2", 1.5), r"optimizer\.beta_2: .*\[0, 1\)"),
    (
        "negative beta_1",
        _set("optimizer.beta_1", -0.1),
        r"optimizer\.beta_1: expected a number >= 0",
    ),
    ("zero epsilon", _set("optimizer.epsilon", 0.0), r"optimizer\.epsilon: expected a positive"),
    (
        "unknown optimizer",
        _set("optimizer.name", "adamw"),
        r"optimizer\.name: unknown optimizer 'adamw'; expected one of adagrad, adam, "
        r"rowwise_adagrad, rowwise_adam, sgd",
    ),
    ("optimizer not a table", _set("optimizer", "adam"), "optimizer: expected a table"),
    (
        "unknown row dtype",
        _set("tables[1].dtype", "float8"),
        r"tables\[1\]\.dtype: expected one of 'float32', 'float16', 'bfloat16', got 'float8'",
    ),
    (
        "row dtype not a string",
        _set("tables[0].dtype", 16),
        r"tables\[0\]\.dtype: expected one of .* got 16 \(float32 stores rows",
    ),
    (
        "unknown rounding",
        _set("tables[1].rounding", "up"),
        r"tables\[1\]\.rounding: expected one of 'stochastic', 'nearest', got 'up' \(stochastic",
    ),
    (
        "rounding of a float32 table",
        _set("tables[0].rounding", "nearest"),
        r"tables\[0\]\.rounding: only used with dtype 'float16' or 'bfloat16' .* remove it or "
        r"set dtype",
    ),
    (
        "momentum dtype of row-wise adam",
        _set("tables[1].optimizer", {"name": "rowwise_adam", "momentum_dtype": "float16"}),
        r"tables\[1\]\.optimizer\.momentum_dtype: expected one of 'bfloat16', 'float32', "
        r"got 'float16'",
    ),
    (
        "momentum_dtype on adam",
        _set("optimizer.momentum_dtype", "bfloat16"),
        r"optimizer\.momentum_dtype: unknown key",
    ),
    (
        "unknown row-wise adagrad key",
        _set("tables[1].optimizer", {"name": "rowwise_adagrad", "beta_1": 0.9}),
        r"tables\[1\]\.optimizer\.beta_1: unknown key",
    ),
    (
        "negative row-wise adagrad accumulator",
        _set("tables[1].optimizer", {"name": "rowwise_adagrad", "initial_accumulator_value": -1}),
        r"tables\[1\]\.optimizer\.initial_accumulator_value: expected a number >= 0",
    ),
    (
        "unknown table optimizer",
        _set("tables[1].optimizer", {"name": "rmsprop"}),
        r"tables\[1\]\.optimizer\.name: unknown optimizer 'rmsprop'",
    ),
    (
        "table beta_1 >= 1",
        _set("tables[1].optimizer", {"beta_1": 1}),
        r"tables\[1\]\.optimizer\.beta_1: expected a number in \[0, 1\), got 1",
    ),
    (
        "sgd nesterov not bool",
        _set("tables[1].optimizer", {"name": "sgd", "nesterov": 1}),
        r"tables\[1\]\.optimizer\.nesterov: expected true or false, got 1",
    ),
    (
        "unknown initializer",
        _set("tables[0].initializer", {"name": "glorot_uniform"}),
        r"tables\[0\]\.initializer\.name: unknown initializer 'glorot_uniform'",
    ),
    (
        "unknown initializer by name",
        _set("tables[0].initializer", "he_normal"),
        r"tables\[0\]\.initializer\.name: unknown initializer 'he_normal'",
    ),
    (
        "initializer param",
        _set("tables[0].initializer", {"name": "normal", "stdev": 1}),
        r"tables\[0\]\.initializer\.stdev: unknown parameter",
    ),
    (
        "initializer minval >= maxval",
        _set("tables[0].initializer.minval", 0.1),
        r"tables\[0\]\.initializer: expected minval < maxval",
    ),
    (
        "initializer stddev 0",
        _set("tables[1].initializer.stddev", 0),
        r"tables\[1\]\.initializer\.stddev: expected a positive number",
    ),
    (
        "initializer not a table",
        _set("tables[0].initializer", 3),
        r"tables\[0\]\.initializer: expected a table or a name, got 3",
    ),
    (
        "duplicate table name",
        _set("tables[2].name", "user"),
        r"tables\[2\]\.name: table 'user' is defined twice",
    ),
    ("bad table name", _set("tables[1].name", "my table"), r"tables\[1\]\.name: .*'my table'"),
    ("table name with slash", _set("tables[0].name", "a/b"), r"tables\[0\]\.name: .*'a/b'"),
    ("reserved table name", _set("tables[0].name", "_meta"), r"tables\[0\]\.name: .*'_meta'"),
    ("missing table name", _set("tables[0].name", DELETE), r"tables\[0\]\.name: .*missing"),
    (
        "bad id_type",
        _set("tables[2].id_type", "str"),
        r"tables\[2\]\.id_type: expected 'int64' or 'string', got 'str'",
    ),
    ("seed not an int", _set("tables[0].seed", 1.5), r"tables\[0\]\.seed: expected an integer"),
    ("table not a table", _set("tables[1]", "user"), r"tables\[1\]: expected a table"),
    (
        "ttl_s 0",
        _set("tables[0].ttl_s", 0),
        r"tables\[0\]\.ttl_s: expected a positive integer number of seconds, got 0",
    ),
    ("ttl_s negative", _set("tables[0].ttl_s", -5), r"tables\[0\]\.ttl_s: .*got -5"),
    ("ttl_s float", _set("tables[0].ttl_s", 1.5), r"tables\[0\]\.ttl_s: .*got 1.5"),
    ("ttl_s str", _set("tables[0].ttl_s", "3600"), r"tables\[0\]\.ttl_s: .*got '3600'"),
    ("ttl_s bool", _set("tables[0].ttl_s", True), r"tables\[0\]\.ttl_s: .*got True"),
    (
        "ttl_s over a year",
        _set("tables[0].ttl_s", 365 * 86_400 + 1),
        r"tables\[0\]\.ttl_s: at most 31536000 seconds \(365 days\), got 31536001; values "
        r"above 2592000 \(30 days\) are sent to memcached as absolute unix times",
    ),
    (
        "admit_after 0",
        _set("tables[1].admit_after", 0),
        r"tables\[1\]\.admit_after: expected a positive integer, got 0",
    ),
    ("admit_after float", _set("tables[1].admit_after", 2.0), r"tables\[1\]\.admit_after: "),
    (
        "admit_ttl_s without admission",
        _set("tables[1].admit_ttl_s", 600),
        r"tables\[1\]\.admit_ttl_s: only used with admit_after >= 2",
    ),
    (
        "admit_ttl_s 0",
        _set("tables[1]", {"name": "item", "dim": 4, "admit_after": 2, "admit_ttl_s": 0}),
        r"tables\[1\]\.admit_ttl_s: expected a positive integer number of seconds, got 0",
    ),
    (
        "unknown lifecycle key",
        _set("tables[0].ttl", 60),
        r"tables\[0\]\.ttl: unknown key; expected one of admit_after, admit_ttl_s, dim, "
        r"dtype, id_type, initializer, name, optimizer, rounding, seed, ttl_s",
    ),
    (
        "push_record_ttl_s over a year",
        _set("service.push_record_ttl_s", 400 * 86_400),
        r"service\.push_record_ttl_s: at most 31536000 seconds",
    ),
    ("tables not an array", _set("tables", {"name": "user"}), "tables: expected an array"),
    (
        "store.pool_size 0",
        _set("store.pool_size", 0),
        r"store\.pool_size: expected a positive integer, got 0",
    ),
    ("store.timeout_s 0", _set("store.timeout_s", 0), r"store\.timeout_s: expected a positive"),
    ("store.timeout_s negative", _set("store.timeout_s", -1.0), r"store\.timeout_s: "),
    ("store.max_batch_keys 0", _set("store.max_batch_keys", 0), r"store\.max_batch_keys: "),
    (
        "store.trainer_cache_mb negative",
        _set("store.trainer_cache_mb", -1),
        r"store\.trainer_cache_mb: ",
    ),
    (
        "store.trainer_cache_mb not an integer",
        _set("store.trainer_cache_mb", "lots"),
        r"store\.trainer_cache_mb: ",
    ),
    ("store not a table", _set("store", 5), "store: expected a table, got 5"),
    (
        "service.dense_flush_pushes 0",
        _set("service.dense_flush_pushes", 0),
        r"service\.dense_flush_pushes: expected a positive integer, got 0",
    ),
    (
        "service.dense_flush_s negative",
        _set("service.dense_flush_s", -1.0),
        r"service\.dense_flush_s: expected a positive",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [pytest.param(m, p, id=name) for name, m, p in BAD_VALUES],
)
def test_bad_values_name_the_key_path(
    mutate: Callable[[dict[str, Any]], None], pattern: str
) -> None:
    raw = full_raw()
    mutate(raw)
    with pytest.raises(ConfigError, match="^" + pattern) as info:
        parse_config(raw, env={})
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, LookupTableError)


def test_example_message_from_the_docstring() -> None:
    raw = full_raw()
    raw["tables"][1]["dim"] = -3
    with pytest.raises(ConfigError) as info:
        parse_config(raw, env={})
    assert str(info.value) == "tables[1].dim: expected a positive integer, got -3"


def test_mutations_really_start_from_a_valid_config() -> None:
    config = parse_config(full_raw(), env={})  # the base of every BAD_VALUES case is fine
    assert len(config.tables) == 3
    raw = full_raw()
    _set("tables[1].dim", 5)(raw)
    assert parse_config(raw, env={}).tables[1].dim == 5


def test_not_a_mapping_at_all() -> None:
    with pytest.raises(ConfigError, match="expected a table"):
        parse_config(["namespace"], env={})  # type: ignore[arg-type]


def test_unknown_table_lookup_lists_known_tables() -> None:
    config = parse_config(full_raw(), env={})
    with pytest.raises(ConfigError, match="unknown table 'ads'.*user, item, query"):
        config.table("ads")


# ------------------------------------------------------------------ load_config


def test_load_config_prefixes_the_file_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(FULL_TOML.replace("workers = 2", "workers = 0"), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: workers: expected a positive integer, got 0"
    assert info.value.__cause__ is None  # one clear message, no chained traceback noise


def test_load_config_accepts_str_paths(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(FULL_TOML, encoding="utf-8")
    assert load_config(str(path)) == load_config(path)


def test_load_config_reports_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: cluster file not found"):
        load_config(path)


def test_load_config_reports_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('namespace = "demo"\nmemcached = [\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: not valid TOML"):
        load_config(path)


def test_load_config_reports_non_utf8_as_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('namespace = "d\xe9mo"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: not valid TOML"):
        load_config(path)


def test_load_config_reports_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))}: "):
        load_config(tmp_path)


# ------------------------------------------------------------------ token


def test_token_from_env_when_empty() -> None:
    config = parse_config(minimal(), env={"LOOKUP_TABLE_TOKEN": "from-env"})
    assert config.token == "from-env"
    config = parse_config(minimal(token=""), env={"LOOKUP_TABLE_TOKEN": "from-env"})
    assert config.token == "from-env"


def test_token_in_file_wins_over_env() -> None:
    config = parse_config(minimal(token="from-file"), env={"LOOKUP_TABLE_TOKEN": "from-env"})
    assert config.token == "from-file"


def test_no_token_anywhere() -> None:
    assert parse_config(minimal(), env={}).token == ""


def test_env_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOKUP_TABLE_TOKEN", "process-token")
    assert parse_config(minimal()).token == "process-token"
    monkeypatch.delenv("LOOKUP_TABLE_TOKEN")
    assert parse_config(minimal()).token == ""


def test_token_is_not_in_repr() -> None:
    config = parse_config(minimal(token="hunter2-secret"), env={})
    assert "hunter2-secret" not in repr(config)
    assert "hunter2-secret" not in str(config)
    env_config = parse_config(minimal(), env={"LOOKUP_TABLE_TOKEN": "env-secret-123"})
    assert "env-secret-123" not in repr(env_config)
    assert config.token == "hunter2-secret"


def test_config_is_unchanged_by_parsing() -> None:
    raw = full_raw()
    before = copy.deepcopy(raw)
    parse_config(raw, env={})
    assert raw == before  # sections are popped from copies, not from the caller's dict


def test_node_spec() -> None:
    node = NodeSpec(host="10.0.0.1", port=11211)
    assert node.address == "10.0.0.1:11211"
    assert str(node) == "10.0.0.1:11211"


def test_lifecycle_keys_and_their_defaults() -> None:
    config = parse_config(ROUND_TRIP_CASES["lifecycle"](), env={})
    a, b, c = config.tables
    assert (a.ttl_s, a.admit_after, a.admit_ttl_s) == (3, 1, None)
    assert (b.ttl_s, b.admit_after, b.counter_ttl_s) == (None, 3, 86_400)  # a day by default
    assert (c.ttl_s, c.admit_after, c.counter_ttl_s) == (90 * 86_400, 2, 60)
    one = {"name": "d", "dim": 1, "ttl_s": 7, "admit_after": 2}
    with_ttl = parse_config(minimal(tables=[one]), env={})
    assert with_ttl.tables[0].counter_ttl_s == 7  # derived: a counter lives as long as a row
    plain = parse_config(minimal(tables=[{"name": "e", "dim": 1}]), env={})
    assert (plain.tables[0].ttl_s, plain.tables[0].admit_after) == (None, 1)  # the defaults


# ------------------------------------------------------------------ agreement

# Trainers and replicas compare it across processes, machines and versions: a change here
# makes every running replica refuse every trainer (`ClusterMismatchError`).
GOLDEN_FINGERPRINT = "875ec9f84c27b96d035240bf60bb30e99241bd1d2aab704dfc065b309e2be423"


def test_the_fingerprint_of_the_full_example_is_pinned() -> None:
    config = parse_config(full_raw(), env={})
    assert config.fingerprint == GOLDEN_FINGERPRINT
    assert config.agreement()["tables"]["item"]["optimizer"]["learning_rate"] == 0.01
    assert config.agreement()["workers"] == 2  # sync mode: every worker's push is counted


@pytest.mark.parametrize(
    "change",
    [
        lambda raw: raw.update(token="s3cret"),
        lambda raw: raw.update(optimizers=["http://replica-a:8470", "http://replica-b:8470"]),
        lambda raw: raw["store"].update(timeout_s=9.0, pool_size=2),
        lambda raw: raw.update(service={"cache_mb": 1, "row_flush_pushes": 1}),
        lambda raw: raw.update(memcached=raw["memcached"][::-1]),  # placement ignores order
        lambda raw: raw.update(tables=raw["tables"][::-1]),  # tables are known by name
    ],
    ids=["token", "replica URLs", "store", "service", "node order", "table order"],
)
def test_what_does_not_decide_rows_leaves_the_fingerprint(
    change: Callable[[dict[str, Any]], None],
) -> None:
    raw = full_raw()
    change(raw)
    config = parse_config(raw, env={})
    assert config.fingerprint == GOLDEN_FINGERPRINT
    assert config.differences(parse_config(full_raw(), env={}).agreement()) == []


@pytest.mark.parametrize(
    ("change", "path", "mine", "theirs"),
    [
        (lambda raw: raw.update(namespace="other"), "namespace", "other", "demo"),
        (
            lambda raw: raw.update(memcached=["127.0.0.1:11211"]),
            "memcached",
            ["127.0.0.1:11211"],
            ["127.0.0.1:11211", "127.0.0.1:11212"],
        ),
        (lambda raw: raw.update(optimizers=["http://a:1"]), "replicas", 1, 2),
        (lambda raw: raw.update(mode="async"), "mode", "async", "sync"),
        (lambda raw: raw.update(workers=3), "workers", 3, 2),
        (lambda raw: raw["optimizer"].update(beta_1=0.8), "optimizer.beta_1", 0.8, 0.9),
        (lambda raw: raw["tables"][0].update(dim=32), "tables[user].dim", 32, 16),
        (lambda raw: raw["tables"][0].update(seed=9), "tables[user].seed", 9, 1),
        (
            lambda raw: raw["tables"][1]["optimizer"].update(learning_rate=0.5),
            "tables[item].optimizer.learning_rate",
            0.5,
            0.01,
        ),
        (
            lambda raw: raw["tables"][0].update(initializer={"name": "uniform", "maxval": 0.1}),
            "tables[user].initializer.maxval",
            0.1,
            0.05,
        ),
        (
            lambda raw: raw["tables"][2].update(id_type="int64"),
            "tables[query].id_type",
            "int64",
            "string",
        ),
        (lambda raw: raw["tables"][0].update(ttl_s=60), "tables[user].ttl_s", 60, None),
        (lambda raw: raw["tables"][0].update(admit_after=2), "tables[user].admit_after", 2, 1),
        (
            lambda raw: raw["tables"][0].update(dtype="bfloat16"),
            "tables[user].dtype",
            "bfloat16",
            "float32",
        ),
    ],
)
def test_each_field_of_the_agreement_changes_the_fingerprint_and_is_named(
    change: Callable[[dict[str, Any]], None], path: str, mine: Any, theirs: Any
) -> None:
    raw = full_raw()
    change(raw)
    config = parse_config(raw, env={})
    assert config.fingerprint != GOLDEN_FINGERPRINT
    # (the default optimizer is also the one of the tables that name none)
    assert (path, mine, theirs) in config.differences(parse_config(full_raw(), env={}).agreement())


def test_another_optimizer_or_a_missing_table_is_named_whole() -> None:
    raw = full_raw()
    raw["tables"][2]["optimizer"] = {"name": "sgd", "learning_rate": 0.05}
    del raw["tables"][1]
    config = parse_config(raw, env={})
    theirs = parse_config(full_raw(), env={}).agreement()
    got = dict((path, (mine, other)) for path, mine, other in config.differences(theirs))
    assert sorted(got) == ["tables[item]", "tables[query].optimizer"]
    assert got["tables[item]"][0] is None and got["tables[item]"][1]["dim"] == 64
    mine, other = got["tables[query].optimizer"]
    assert (mine["name"], other["name"]) == ("sgd", "adagrad")
