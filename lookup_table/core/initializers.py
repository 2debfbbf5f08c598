"""Deterministic initial rows: a pure, vectorized function of (table seed, id).

Every trainer that meets a new id computes the same row, whichever batch, process
or node count it runs with, so the `add` race between trainers is harmless and
runs are reproducible. NumPy's `Generator` promises the same stream only on the
same build and machine, so rows come from a counter-based generator instead:

    bits[i, c] = mix64(mix64(id_hash[i] ^ seed_salt) + (c + 1) * 0x9E3779B97F4A7C15)
    u[i, c]    = (bits[i, c] >> 11) * 2**-53          # uniform in [0, 1)

Initializers follow Keras' names and defaults: `zeros`, `constant(value=0)`,
`uniform(minval=-0.05, maxval=0.05)` (alias `random_uniform`), `normal(mean=0,
stddev=0.05)` (alias `random_normal`, Box-Muller), `truncated_normal(mean=0,
stddev=0.05)` (values beyond two stddev are redrawn from the next counters, as
Keras' TruncatedNormal does). Math is float64, the result float32 (n, dim).
Changing any of this changes the first value of every new row: golden values in
`tests/unit/test_initializers.py` pin it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lookup_table.core.hashing import combine, id_hashes, mix64, stable_hash
from lookup_table.core.keys import IdArray

__all__ = ["INITIALIZER_DEFAULTS", "InitializerSpec", "initial_rows"]

INITIALIZER_DEFAULTS: Mapping[str, Mapping[str, float]] = {
    "zeros": {},
    "constant": {"value": 0.0},
    "uniform": {"minval": -0.05, "maxval": 0.05},
    "normal": {"mean": 0.0, "stddev": 0.05},
    "truncated_normal": {"mean": 0.0, "stddev": 0.05},
}
_ALIASES = {"random_uniform": "uniform", "random_normal": "normal", "zero": "zeros"}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TWO_POW_M53 = 2.0**-53
_MAX_TRUNCATION_ROUNDS = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class InitializerSpec:
    """An initializer by Keras name, with every parameter filled in."""

    name: str = "uniform"
    params: Mapping[str, float] = field(default_factory=lambda: {"minval": -0.05, "maxval": 0.05})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str = "initializer") -> InitializerSpec:
        """Validate `{name = "...", param = value, ...}`; raise ValueError naming the key."""
        name = raw.get("name", "uniform")
        if not isinstance(name, str):
            raise ValueError(f"{where}.name: expected a string, got {name!r}")
        name = _ALIASES.get(name, name)
        if name not in INITIALIZER_DEFAULTS:
            raise ValueError(
                f"{where}.name: unknown initializer {name!r}; expected one of "
                f"{', '.join(sorted(INITIALIZER_DEFAULTS))}"
            )
        defaults = INITIALIZER_DEFAULTS[name]
        params = dict(defaults)
        for key, value in raw.items():
            if key == "name":
                continue
            if key not in defaults:
                expected = ", ".join(sorted(defaults)) or "no parameters"
                raise ValueError(
                    f"{where}.{key}: unknown parameter for initializer {name!r}; "
                    f"expected {expected}"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{where}.{key}: expected a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{where}.{key}: expected a finite number, got {value!r}")
            params[key] = float(value)
        if name == "uniform" and not params["minval"] < params["maxval"]:
            raise ValueError(
                f"{where}: expected minval < maxval, got minval={params['minval']}, "
                f"maxval={params['maxval']}"
            )
        if name in ("normal", "truncated_normal") and not params["stddev"] > 0:
            raise ValueError(f"{where}.stddev: expected a positive number, got {params['stddev']}")
        return cls(name=name, params=params)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}


def _uniform01(base: NDArray[np.uint64], first_counter: int, count: int) -> NDArray[np.float64]:
    """Uniform [0, 1) float64 (n, count) from counters first_counter .. first_counter+count-1."""
    counters = np.arange(first_counter, first_counter + count, dtype=np.uint64) + np.uint64(1)
    bits = mix64(base[:, None] + counters[None, :] * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * _TWO_POW_M53


def _normal(base: NDArray[np.uint64], round_: int, dim: int) -> NDArray[np.float64]:
    """Standard normal float64 (n, dim) via Box-Muller from 2*dim counters per round."""
    u = _uniform01(base, round_ * 2 * dim, 2 * dim)
    radius = np.sqrt(-2.0 * np.log1p(-u[:, :dim]))  # 1 - u is in (0, 1]: log is finite
    return radius * np.cos(2.0 * np.pi * u[:, dim:])


def initial_rows(
    spec: InitializerSpec, *, seed: int, ids: IdArray, dim: int
) -> NDArray[np.float32]:
    """The initial rows of `ids`, float32 (n, dim); row i depends only on (seed, ids[i])."""
    n = ids.shape[0]
    p = spec.params
    if spec.name == "zeros":
        return np.zeros((n, dim), dtype=np.float32)
    if spec.name == "constant":
        return np.full((n, dim), p["value"], dtype=np.float32)
    base = combine(id_hashes(ids), stable_hash(f"init-seed:{seed}"))
    if spec.name == "uniform":
        lo, hi = p["minval"], p["maxval"]
        rows = (lo + (hi - lo) * _uniform01(base, 0, dim)).astype(np.float32)
        # float32 rounding may land on maxval; Keras' interval is half-open.
        return np.minimum(rows, np.nextafter(np.float32(hi), np.float32(lo)))
    if spec.name == "normal":
        return (p["mean"] + p["stddev"] * _normal(base, 0, dim)).astype(np.float32)
    if spec.name == "truncated_normal":
        z = _normal(base, 0, dim)
        bad_rows = np.flatnonzero((np.abs(z) > 2.0).any(axis=1))
        for round_ in range(1, _MAX_TRUNCATION_ROUNDS):
            if bad_rows.size == 0:
                break
            redraw = _normal(base[bad_rows], round_, dim)
            sub = z[bad_rows]
            out_of_range = np.abs(sub) > 2.0
            sub[out_of_range] = redraw[out_of_range]
            z[bad_rows] = sub
            bad_rows = bad_rows[(np.abs(sub) > 2.0).any(axis=1)]
        np.clip(z, -2.0, 2.0, out=z)  # after 64 rounds: probability ~1e-86, never in practice
        return (p["mean"] + p["stddev"] * z).astype(np.float32)
    raise ValueError(f"unknown initializer {spec.name!r}")
