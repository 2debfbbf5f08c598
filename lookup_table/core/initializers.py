"""Deterministic initial rows: a pure, vectorized function of (table seed, id).

Keras' initializer names and defaults, drawn from a counter-based generator so that
every trainer computes the same row on any CPU, numpy build or libm; the formula and how
the same bits are kept: docs/storage.md#initial-rows. Golden values in
tests/unit/test_initializers.py pin the first value of every new row.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from numba import types
from numpy.typing import NDArray

from lookup_table.core.hashing import (
    combine,
    id_hashes,
    mix64,
    mix64_one,
    stable_hash,
)
from lookup_table.core.jit import compiled
from lookup_table.core.keys import IdArray
from lookup_table.core.rows import blocks

__all__ = ["INITIALIZER_DEFAULTS", "InitializerSpec", "initial_rows", "initial_rows_many"]

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
# Bound on what libm/SIMD kernels may change in a float64 normal value, relative to
# |mean| + |stddev * z| (plus stddev * 2**-50 near zero): closer than this to a
# float32 rounding boundary (or to the truncation bound), the value is computed exactly.
_HARD_MARGIN = 2.0**-40
_EXACT = decimal.Context(prec=50)
_LOW_29 = (1 << 29) - 1
_TIE_28 = 1 << 28
_F32_TINY = float(np.finfo(np.float32).tiny)
_PI = decimal.Decimal("3.14159265358979323846264338327950288419716939937510582097494459")


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


_U64 = types.Array(types.uint64, 1, "C", readonly=True)
_F32_OUT = types.Array(types.float32, 2, "C")


@compiled(types.float64(types.uint64, types.uint64))
def _draw(base, counter):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`_uniform` of one (base, counter): wrapping uint64 operations, as numpy's, and one
    exact conversion, so the same bits."""
    z = mix64_one(base + (counter + np.uint64(1)) * _GOLDEN)
    return np.float64(z >> np.uint64(11)) * _TWO_POW_M53


@compiled(types.void(_U64, types.uint64, types.Array(types.float64, 2, "C")))
def _uniform_block(base, first_counter, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`_uniform` of (base[i], first_counter + j) into out[i, j], in one pass (numpy's
    version makes ~10 passes over (n, count) uint64 temporaries)."""
    for i in range(out.shape[0]):
        b = base[i]
        row = out[i]
        for j in range(out.shape[1]):
            row[j] = _draw(b, first_counter + np.uint64(j))


@compiled(types.void(_U64, types.float64, types.float64, types.float32, _F32_OUT))
def _uniform_rows(base, lo, span, top, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """float32(lo + span * u) capped at `top`, u = `_uniform` of (base[i], j): what
    `_rows_from` computes for `uniform` in float64 numpy, op for op (no fused
    multiply-add: see `lookup_table.core.jit`), in one pass."""
    for i in range(out.shape[0]):
        b = base[i]
        row = out[i]
        for j in range(out.shape[1]):
            value = np.float32(lo + span * _draw(b, np.uint64(j)))
            row[j] = value if value < top else top


@compiled(types.void(_U64, _U64, types.Array(types.float64, 1, "C")))
def _draws(bases, counters, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`_draw` of each (bases[k], counters[k])."""
    for k in range(out.shape[0]):
        out[k] = _draw(bases[k], counters[k])


def _uniform(base: NDArray[np.uint64], counters: NDArray[np.uint64]) -> NDArray[np.float64]:
    """Uniform [0, 1) float64 of each (base, counter) pair, broadcast (the module's formula)."""
    b, c = np.broadcast_arrays(np.asarray(base, np.uint64), np.asarray(counters, np.uint64))
    out = np.empty(b.shape, dtype=np.float64)
    _draws(_bases(b.ravel()), _bases(c.ravel()), out.reshape(-1))
    return out


def _bases(base: NDArray[np.uint64]) -> NDArray[np.uint64]:
    out = np.ascontiguousarray(base, dtype=np.uint64)
    if out.flags.writeable:  # the kernels take read-only arrays (one signature)
        out = out.view()
        out.flags.writeable = False
    return out


def _uniform01(base: NDArray[np.uint64], first_counter: int, count: int) -> NDArray[np.float64]:
    """Uniform [0, 1) float64 (n, count) from counters first_counter .. first_counter+count-1."""
    out = np.empty((base.shape[0], count), dtype=np.float64)
    _uniform_block(_bases(base), np.uint64(first_counter), out)
    return out


def _box_muller(u1: NDArray[np.float64], u2: NDArray[np.float64]) -> NDArray[np.float64]:
    radius = np.sqrt(-2.0 * np.log1p(-u1))  # 1 - u is in (0, 1]: log is finite
    return radius * np.cos(2.0 * np.pi * u2)


def _normal(
    base: NDArray[np.uint64], round_: int, dim: int
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Standard normal float64 (n, dim) via Box-Muller from 2*dim counters per round.

    Returns (z, u1, u2): z and the two uniforms it came from, for `_exact_normal`.
    """
    u = _uniform01(base, round_ * 2 * dim, 2 * dim)
    u1, u2 = u[:, :dim], u[:, dim:]
    return _box_muller(u1, u2), u1, u2


def _normal_at(
    base: NDArray[np.uint64], cols: NDArray[np.intp], round_: int, dim: int
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """`_normal(base, round_, dim)`'s entry at column `cols[k]` of each `base[k]`, (k,).

    The same counters and formula, for the entries a truncation redraws only (about 1 in
    22 per round), where `_normal` of their rows would compute every column of them.
    """
    first = np.uint64(round_ * 2 * dim) + cols.astype(np.uint64)
    u1 = _uniform(base, first)
    u2 = _uniform(base, first + np.uint64(dim))
    return _box_muller(u1, u2), u1, u2


def _exact_cos(x: decimal.Decimal) -> decimal.Decimal:
    """cos(x) for x in [0, 2*pi) to about 48 digits (Taylor series after folding to [0, pi])."""
    with decimal.localcontext(_EXACT):
        if x > _PI:
            x = 2 * _PI - x
        x2 = x * x
        total = term = decimal.Decimal(1)
        k = 0
        while abs(term) > decimal.Decimal("1e-55"):
            k += 2
            term = -term * x2 / (k * (k - 1))
            total += term
        return +total


def _exact_normal(u1: float, u2: float) -> decimal.Decimal:
    """Box-Muller's z for these float64 uniforms, exact to about 48 digits.

    The argument of cos is the float64 `2.0 * pi * u2`, exactly what `_normal`
    passes to np.cos; only log1p, sqrt and cos are computed here without libm.
    """
    with decimal.localcontext(_EXACT):
        one_minus_u1 = 1 - decimal.Decimal(u1)
        radius = (-2 * one_minus_u1.ln()).sqrt() if u1 > 0 else decimal.Decimal(0)
        return radius * _exact_cos(decimal.Decimal(2.0 * math.pi * u2))


def _nearest_float32(x: decimal.Decimal) -> np.float32:
    """The float32 nearest to x (ties to even); float(x) alone would round twice."""
    guess = np.float32(float(x))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess]
    candidates.append(np.nextafter(guess, np.float32(np.inf)))
    with decimal.localcontext(_EXACT):
        return min(
            candidates,
            key=lambda c: (abs(decimal.Decimal(float(c)) - x), int(c.view(np.uint32)) & 1),
        )


def _normal_to_float32(
    mean: float,
    stddev: float,
    z: NDArray[np.float64],
    u1: NDArray[np.float64],
    u2: NDArray[np.float64],
) -> NDArray[np.float32]:
    """float32 (n, dim) nearest to mean + stddev * z, the same on every CPU
    (docs/storage.md#initial-rows)."""
    scaled = stddev * z
    value = mean + scaled
    out = value.astype(np.float32)
    # float64 -> float32 rounding drops the low 29 mantissa bits: the boundary (a tie)
    # is at 1 << 28, so this is the distance to it in float64 ulps (valid while value
    # is a normal float32; smaller values, never seen in practice, go exact).
    low_bits = (value.view(np.uint64) & np.uint64(_LOW_29)).view(np.int64)
    to_boundary = np.abs(low_bits - _TIE_28) * np.spacing(np.abs(value))
    to_boundary[np.abs(value) < _F32_TINY] = 0.0
    margin = _HARD_MARGIN * (abs(mean) + np.abs(scaled)) + stddev * 2.0**-50
    for i, j in zip(*np.nonzero(to_boundary <= margin), strict=True):  # ~1 in 30,000
        z_exact = _exact_normal(u1[i, j], u2[i, j])
        with decimal.localcontext(_EXACT):
            exact = decimal.Decimal(mean) + decimal.Decimal(stddev) * z_exact
        out[i, j] = _nearest_float32(exact)
    return out


def _beyond_two(
    z: NDArray[np.float64], u1: NDArray[np.float64], u2: NDArray[np.float64]
) -> NDArray[np.bool_]:
    """|z| > 2, decided exactly where float64 z is too close to 2 to call."""
    size = np.abs(z)
    beyond = size > 2.0
    for at in zip(*np.nonzero(np.abs(size - 2.0) <= 2.0 * _HARD_MARGIN), strict=True):
        beyond[at] = abs(_exact_normal(u1[at], u2[at])) > 2
    return beyond


def initial_rows(
    spec: InitializerSpec, *, seed: int, ids: IdArray, dim: int
) -> NDArray[np.float32]:
    """The initial rows of `ids`, float32 (n, dim); row i depends only on (seed, ids[i])."""
    if spec.name in ("zeros", "constant"):
        return _rows_from(spec, None, ids.shape[0], dim)
    base = combine(id_hashes(ids), stable_hash(f"init-seed:{seed}"))
    return _rows_from(spec, base, ids.shape[0], dim)


def initial_rows_many(
    parts: Sequence[tuple[InitializerSpec, int, IdArray, int]],
) -> list[NDArray[np.float32]]:
    """`initial_rows` of each (spec, seed, ids, dim), bit for bit, computed as one batch
    per initializer and dim: a push or a read of many small tables (a recommender's
    categorical columns) costs one pass of numpy calls, not one per table. The int ids
    of a batch are hashed together, each with its own table's seed."""
    out: list[NDArray[np.float32] | None] = [None] * len(parts)
    groups: dict[tuple[str, tuple[tuple[str, float], ...], int], list[int]] = {}
    for k, (spec, _, ids, dim) in enumerate(parts):
        if len(parts) == 1 or spec.name in ("zeros", "constant") or ids.dtype != np.int64:
            out[k] = initial_rows(spec, seed=parts[k][1], ids=ids, dim=dim)
        else:
            groups.setdefault((spec.name, tuple(sorted(spec.params.items())), dim), []).append(k)
    for (_, _, dim), members in groups.items():
        counts = [parts[k][2].shape[0] for k in members]
        ids = np.concatenate([parts[k][2] for k in members])
        salts = np.array(
            [stable_hash(f"init-seed:{parts[k][1]}") for k in members], dtype=np.uint64
        )
        # `combine(id_hashes(ids), salt)` of each table's ids, in one pass
        base = mix64(id_hashes(ids) ^ np.repeat(salts, counts))
        rows = _rows_from(parts[members[0]][0], base, ids.shape[0], dim)
        for k, block in zip(members, blocks(rows, counts), strict=True):
            out[k] = block
    return cast("list[NDArray[np.float32]]", out)


def _rows_from(
    spec: InitializerSpec, base: NDArray[np.uint64] | None, n: int, dim: int
) -> NDArray[np.float32]:
    """`n` initial rows of `spec` from each row's counter base (None for `zeros` and
    `constant`, which need none)."""
    p = spec.params
    if spec.name == "zeros":
        return np.zeros((n, dim), dtype=np.float32)
    if spec.name == "constant":
        return np.full((n, dim), p["value"], dtype=np.float32)
    if base is None:
        raise ValueError(f"initializer {spec.name!r} draws from the ids' counter bases: none given")
    if spec.name == "uniform":
        lo, hi = p["minval"], p["maxval"]
        rows = np.empty((n, dim), dtype=np.float32)
        # float32(lo + (hi - lo) * u), float64 math; float32 rounding may land on maxval:
        # Keras' interval is half-open, so it is capped below it
        top = np.nextafter(np.float32(hi), np.float32(lo))
        _uniform_rows(_bases(base), float(lo), float(hi - lo), top, rows)
        return rows
    if spec.name == "normal":
        return _normal_to_float32(p["mean"], p["stddev"], *_normal(base, 0, dim))
    if spec.name == "truncated_normal":
        z, u1, u2 = _normal(base, 0, dim)
        # a value beyond two stddev is redrawn from the same column of the next round's
        # counters, until it is within: only those entries are computed
        redo_rows, redo_cols = np.nonzero(_beyond_two(z, u1, u2))
        for round_ in range(1, _MAX_TRUNCATION_ROUNDS):
            if redo_rows.size == 0:
                break
            redraw = _normal_at(base[redo_rows], redo_cols, round_, dim)
            z[redo_rows, redo_cols], u1[redo_rows, redo_cols], u2[redo_rows, redo_cols] = redraw
            still_out = _beyond_two(*redraw)
            redo_rows, redo_cols = redo_rows[still_out], redo_cols[still_out]
        np.clip(z, -2.0, 2.0, out=z)  # after 64 rounds: probability ~1e-86, never in practice
        return _normal_to_float32(p["mean"], p["stddev"], z, u1, u2)
    raise ValueError(f"unknown initializer {spec.name!r}")
