"""What a request to the replicas carries besides ids and gradients: a push's `stats`, and
the wire form of a request's tables (tables of one dim grouped into one array each)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.config import ClusterConfig
from lookup_table.core.keys import IdArray
from lookup_table.core.wire import encode_array, encode_ids
from lookup_table.errors import ConfigError

__all__ = ["push_stats", "wire_tables"]


def push_stats(examples: Any, loss: Any) -> dict[str, Any]:
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


def wire_tables(
    config: ClusterConfig,
    tables: Mapping[str, tuple[IdArray, NDArray[Any] | None]],
    *,
    grads: bool,
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
            and config.has_table(name)
        ):
            continue
        dim = config.table(name).dim
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
