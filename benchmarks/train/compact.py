"""The compact-rows variants as distributed methods of the rounds: each variant's
cluster tables (its dtype and optimizer, the round's seed), the check that the cluster
has them, and each variant against fp32 Adam distributed: examples/s paired by round,
eval AUC and log loss paired by seed, with the table lines and the PNG's panels."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.harness.rounds import undisturbed
from benchmarks.harness.variants import (
    BASE_VARIANT,
    VARIANT_TARGET_AUC_DIFF,
    VARIANTS,
    auc_target_met,
    check_tables,
)
from lookup_table.config import AdamConfig, ClusterConfig

TARGET_SPEED_RATIO = 1.0  # a variant's examples/s / fp32 Adam distributed's, same round
BASE_METHOD = "distributed"
_PREFIX = "distributed-"


def method_of(variant: str) -> str:
    """The rounds' method that trains `variant`'s tables on a cluster."""
    return BASE_METHOD if variant == BASE_VARIANT else _PREFIX + variant


def variant_of(method: str) -> str | None:
    """The variant a distributed method trains (None for a method trained locally)."""
    if method == BASE_METHOD:
        return BASE_VARIANT
    name = method.removeprefix(_PREFIX)
    return name if name != method and name in VARIANTS else None


def table_seed(seed: int, round_seed: int) -> int:
    """A table's seed in a round of seed `round_seed` (0: the table's own seed)."""
    return (seed + round_seed) & 0x7FFFFFFF


def table_changes(
    config: ClusterConfig, columns: Sequence[str], variant: str, seed: int
) -> dict[str, dict[str, Any]]:
    """The `[[tables]]` keys that give the tables of `columns` in `config` `variant`'s
    dtype and optimizer (at each table's own Adam rate) and, with `seed` > 0, a seed of
    their own for the round."""
    out: dict[str, dict[str, Any]] = {}
    for column in columns:
        spec = config.table(column)
        if not isinstance(spec.optimizer, AdamConfig):
            raise RuntimeError(
                f"table {column!r} steps with {spec.optimizer.name!r}; the variants replace an "
                "Adam table's optimizer: give it Adam in deploy/demo.toml"
            )
        keys = VARIANTS[variant].table_keys(spec.optimizer)
        if seed:
            keys["seed"] = table_seed(spec.seed, seed)
        if keys:
            out[column] = keys
    return out


def check_cluster(
    config: ClusterConfig,
    columns: Sequence[str],
    variant: str,
    changes: Mapping[str, Mapping[str, Any]],
) -> None:
    """RuntimeError unless the cluster's tables of `columns` are `variant`'s, with the
    learning rate and seed `changes` asked for."""
    tables = [config.table(c) for c in columns]
    check_tables(variant, tables)
    for t in tables:
        want = changes.get(t.name, {})
        rate = want.get("optimizer", {}).get("learning_rate", t.optimizer.learning_rate)
        if t.seed != want.get("seed", t.seed) or t.optimizer.learning_rate != rate:
            raise RuntimeError(
                f"variant {variant!r}: table {t.name!r} has seed {t.seed} and learning rate "
                f"{t.optimizer.learning_rate}; the cluster file asked for {dict(want)}"
            )


# ---------------------------------------------------------------- against fp32 Adam


def _by_round(rounds: Sequence[Mapping[str, Any]], method: str) -> dict[int, Mapping[str, Any]]:
    """`method`'s result in each round: its last undisturbed attempt, else its last (a
    round's eval figures do not depend on the load; its speed is paired only when both
    sides were undisturbed, see `compare`)."""
    tries: dict[int, list[Mapping[str, Any]]] = {}
    for r in rounds:
        if r["method"] == method:
            tries.setdefault(r["paired_round"], []).append(r)
    return {k: undisturbed(rs)[-1] for k, rs in tries.items()}


def _by_seed(rs: Mapping[int, Mapping[str, Any]], key: str) -> dict[int, float]:
    """The mean of `key` over the rounds of each seed."""
    seeds = sorted({r["seed"] for r in rs.values()})
    return {s: statistics.fmean(r[key] for r in rs.values() if r["seed"] == s) for s in seeds}


def compare(rounds: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> dict[str, Any]:
    """Each of `variants` against fp32 Adam distributed: the examples/s ratio of each
    round and their median; the eval AUC and log loss of each seed (mean over its
    rounds), their means and the same-seed differences; each against its target."""
    base = _by_round(rounds, BASE_METHOD)
    base_auc, base_logloss = _by_seed(base, "eval_auc"), _by_seed(base, "eval_logloss")
    out: dict[str, Any] = {}
    for variant in variants:
        mine = _by_round(rounds, method_of(variant))
        auc, logloss = _by_seed(mine, "eval_auc"), _by_seed(mine, "eval_logloss")
        auc_diff = {s: auc[s] - base_auc[s] for s in auc if s in base_auc}
        logloss_diff = {s: logloss[s] - base_logloss[s] for s in logloss if s in base_logloss}
        paired = [k for k in mine if k in base]
        quiet = [k for k in paired if not (mine[k]["disturbed"] or base[k]["disturbed"])]
        ratio = {  # rounds where both sides ran undisturbed; every round if there is none
            k: mine[k]["examples_per_s"] / base[k]["examples_per_s"] for k in quiet or paired
        }
        target = VARIANT_TARGET_AUC_DIFF.get(variant) if variant != BASE_VARIANT else None
        mean_auc_diff = statistics.fmean(auc_diff.values()) if auc_diff else float("nan")
        median_ratio = statistics.median(ratio.values()) if ratio else float("nan")
        out[variant] = {
            "method": method_of(variant),
            "eval_auc_mean": statistics.fmean(auc.values()),
            "eval_logloss_mean": statistics.fmean(logloss.values()),
            "eval_auc_per_seed": {str(s): v for s, v in auc.items()},
            "eval_logloss_per_seed": {str(s): v for s, v in logloss.items()},
            "auc_diff_per_seed": {str(s): v for s, v in auc_diff.items()},
            "logloss_diff_per_seed": {str(s): v for s, v in logloss_diff.items()},
            "auc_diff_mean": mean_auc_diff,
            "logloss_diff_mean": (
                statistics.fmean(logloss_diff.values()) if logloss_diff else float("nan")
            ),
            "target_auc_diff": target,
            "auc_met": None if target is None else auc_target_met(mean_auc_diff, target),
            "examples_per_s_ratio_per_round": {str(k): v for k, v in sorted(ratio.items())},
            "examples_per_s_ratio_median": median_ratio,
            "examples_per_s_ratio_disturbed": not quiet,
            "target_examples_per_s_ratio": None if variant == BASE_VARIANT else TARGET_SPEED_RATIO,
            "examples_per_s_met": None
            if variant == BASE_VARIANT
            else bool(median_ratio >= TARGET_SPEED_RATIO),
        }
    return out


def _verdict(ok: bool | None) -> str:
    return "(reference)" if ok is None else "PASS" if ok else "FAIL"


def render(compared: Mapping[str, Mapping[str, Any]]) -> str:
    """The variants' lines of the printed table."""
    width = max(len(v) for v in compared)
    lines = [
        f"compact rows against {BASE_VARIANT} distributed (examples/s paired by round, "
        "eval AUC and log loss paired by seed):",
        f"{'variant':<{width}} {'ex/s ratio':>10}  {'target':<13} {'AUC mean':>8} "
        f"{'diff':>8}  {'target':<15} {'logloss':>8} {'diff':>8}",
    ]
    for variant, v in compared.items():
        speed = (
            "-"
            if v["target_examples_per_s_ratio"] is None
            else f">= {v['target_examples_per_s_ratio']:.1f}: {_verdict(v['examples_per_s_met'])}"
        )
        auc = (
            "-"
            if v["target_auc_diff"] is None
            else f">= -{v['target_auc_diff']}: {_verdict(v['auc_met'])}"
        )
        lines.append(
            f"{variant:<{width}} {v['examples_per_s_ratio_median']:>10.3f}  {speed:<13} "
            f"{v['eval_auc_mean']:>8.4f} {v['auc_diff_mean']:>+8.4f}  {auc:<15} "
            f"{v['eval_logloss_mean']:>8.4f} {v['logloss_diff_mean']:>+8.4f}"
        )
    for variant, v in compared.items():
        rounds = ", ".join(f"{r}: {x:.3f}" for r, x in v["examples_per_s_ratio_per_round"].items())
        seeds = ", ".join(
            f"{s}: {v['eval_auc_per_seed'][s]:.4f} ({v['auc_diff_per_seed'].get(s, 0.0):+.4f}) / "
            f"{v['eval_logloss_per_seed'][s]:.4f} ({v['logloss_diff_per_seed'].get(s, 0.0):+.4f})"
            for s in v["eval_auc_per_seed"]
        )
        lines.append(f"  {variant}: ex/s ratio per round {rounds}; per seed AUC / logloss {seeds}")
    lines.append(
        "(ex/s ratio: median over rounds of the variant's examples/s / fp32 Adam's in the same "
        "round; diff: mean over seeds of the variant's value - fp32 Adam's with the same seed)"
    )
    loud = [
        v
        for v, x in compared.items()
        if v != BASE_VARIANT and x.get("examples_per_s_ratio_disturbed")
    ]
    if loud:
        lines.append(
            f"warning: no round of {', '.join(loud)} ran undisturbed beside fp32 Adam's: "
            "their ex/s ratios are disturbed rounds' (the AUC figures do not depend on it)"
        )
    return "\n".join(lines)


def verdicts(compared: Mapping[str, Mapping[str, Any]]) -> dict[str, bool]:
    """Every variant's targets as the JSON's acceptance lists them."""
    out: dict[str, bool] = {}
    for variant, v in compared.items():
        if v["examples_per_s_met"] is not None:
            out[f"{variant}/{BASE_VARIANT} examples/s >= {TARGET_SPEED_RATIO}"] = v[
                "examples_per_s_met"
            ]
        if v["auc_met"] is not None:
            out[f"{variant} eval AUC - {BASE_VARIANT} >= -{v['target_auc_diff']}"] = v["auc_met"]
    return out


def plot_speed(ax: Any, compared: Mapping[str, Mapping[str, Any]]) -> None:
    """Bars: each variant's median examples/s ratio to fp32 Adam; dots: its rounds."""
    names = [v for v in compared if v != BASE_VARIANT]
    x = np.arange(len(names))
    medians = [compared[v]["examples_per_s_ratio_median"] for v in names]
    colors = ["tab:green" if compared[v]["examples_per_s_met"] else "tab:red" for v in names]
    bars = ax.bar(x, medians, 0.6, color=colors, alpha=0.6)
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    for i, v in enumerate(names):
        pts = list(compared[v]["examples_per_s_ratio_per_round"].values())
        ax.plot([i] * len(pts), pts, "k.", ms=5)
    ax.axhline(TARGET_SPEED_RATIO, color="grey", ls="--", lw=1)
    ax.set_xticks(x, [n.replace("-", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel(f"examples/s / {BASE_VARIANT}'s, same round (dots: rounds)")
    ax.set_title(f"compact rows: speed (target >= {TARGET_SPEED_RATIO})", fontsize=10)
    ax.grid(alpha=0.3, axis="y")


def plot_accuracy(ax: Any, compared: Mapping[str, Mapping[str, Any]]) -> None:
    """Bars: each variant's mean eval AUC difference to fp32 Adam; dots: its seeds; the
    target as a tick below each bar."""
    names = [v for v in compared if v != BASE_VARIANT]
    x = np.arange(len(names))
    means = [compared[v]["auc_diff_mean"] for v in names]
    colors = ["tab:green" if compared[v]["auc_met"] is not False else "tab:red" for v in names]
    ax.bar(x, means, 0.6, color=colors, alpha=0.6)
    for i, v in enumerate(names):
        pts = list(compared[v]["auc_diff_per_seed"].values())
        ax.plot([i] * len(pts), pts, "k.", ms=5)
        target = compared[v]["target_auc_diff"]
        if target is not None:
            ax.plot([i - 0.35, i + 0.35], [-target] * 2, color="grey", ls="--", lw=1)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, [n.replace("-", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel(f"eval AUC - {BASE_VARIANT}'s (dots: seeds; dashed: target)")
    ax.set_title("compact rows: accuracy", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
