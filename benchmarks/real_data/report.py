"""The comparison of both sides against the acceptance, the table printed and the PNG."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.plot import figure
from benchmarks.harness.variants import VARIANT_TARGET_AUC_DIFF, auc_target_met
from benchmarks.real_data import COLORS, LABELS, SIDES, TARGET_AUC_DIFF, TARGET_LOGLOSS_REL_DIFF


def brief(run: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("seed", "eval_auc", "eval_logloss", "examples_per_s", "first_step_loss")
    return {k: run[k] for k in keys}


def _numeric_stats_diff(keras_side: Mapping[str, Any], ours: Mapping[str, Any]) -> dict[str, Any]:
    """How far the CLI's standardization statistics are from Keras' Normalization's."""
    theirs = keras_side.get("numeric_stats") or {}
    mine = (ours.get("summary", {}).get("numeric_stats") or {}).get("columns", {})
    if not theirs or set(theirs) != set(mine):
        return {"numeric_stats_compared": False}
    mean_diff = max(
        abs(mine[c]["mean"] - theirs[c]["mean"]) / max(theirs[c]["std"], 1e-12) for c in theirs
    )
    std_diff = max(
        abs(math.sqrt(mine[c]["variance"]) / max(theirs[c]["std"], 1e-12) - 1) for c in theirs
    )
    return {
        "numeric_stats_compared": True,
        "numeric_mean_max_diff_in_std": mean_diff,
        "numeric_std_max_rel_diff": std_diff,
    }


def _spread(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    aucs = [r["eval_auc"] for r in runs]
    losses = [r["eval_logloss"] for r in runs]
    return {
        "seeds": [r["seed"] for r in runs],
        "auc_mean": float(np.mean(aucs)),
        "auc_range": [min(aucs), max(aucs)],
        "logloss_mean": float(np.mean(losses)),
        "logloss_range": [min(losses), max(losses)],
    }


def _verdict(auc_diff: float, rel: float) -> dict[str, Any]:
    return {
        "auc_ok": abs(auc_diff) <= TARGET_AUC_DIFF,
        "logloss_ok": abs(rel) <= TARGET_LOGLOSS_REL_DIFF,
        "met": abs(auc_diff) <= TARGET_AUC_DIFF and abs(rel) <= TARGET_LOGLOSS_REL_DIFF,
    }


def compare(
    keras_side: Mapping[str, Any],
    ours: Mapping[str, Any],
    keras_other_seeds: Sequence[Mapping[str, Any]] = (),
    ours_other_seeds: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The acceptance on the seed-0 runs; with more seeds, also on the means over seeds."""
    auc_diff = ours["eval_auc"] - keras_side["eval_auc"]
    rel = ours["eval_logloss"] / keras_side["eval_logloss"] - 1
    out: dict[str, Any] = {
        **_numeric_stats_diff(keras_side, ours),
        "auc_diff_ours_minus_keras": auc_diff,
        "logloss_rel_diff_ours_vs_keras": rel,
        "examples_per_s_ratio_ours_vs_keras": ours["examples_per_s"] / keras_side["examples_per_s"],
        **_verdict(auc_diff, rel),
    }
    if keras_other_seeds or ours_other_seeds:
        # each side's own seed-to-seed spread: how much of a diff is noise
        k, o = _spread([keras_side, *keras_other_seeds]), _spread([ours, *ours_other_seeds])
        mean_auc_diff = o["auc_mean"] - k["auc_mean"]
        mean_rel = o["logloss_mean"] / k["logloss_mean"] - 1
        out["seeds"] = {
            "keras": k,
            "ours": o,
            "auc_diff_of_means": mean_auc_diff,
            "logloss_rel_diff_of_means": mean_rel,
            **_verdict(mean_auc_diff, mean_rel),
        }
    return out


def _verdict_text(c: Mapping[str, Any]) -> str:
    if c["met"]:
        return "met"
    failed = [w for w, ok in (("AUC", c["auc_ok"]), ("logloss", c["logloss_ok"])) if not ok]
    return f"NOT MET ({', '.join(failed)})"


def render_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [
        f"{'data set':<14} {'side':<13} {'epochs':>6} {'eval AUC':>9} {'logloss':>9} "
        f"{'examples/s':>11}",
    ]
    for name, r in results.items():
        for side in SIDES:
            s = r[side]
            lines.append(
                f"{name:<14} {LABELS[side]:<13} {s['epochs']:>6} {s['eval_auc']:>9.4f} "
                f"{s['eval_logloss']:>9.4f} {s['examples_per_s']:>11,.0f}"
            )
    lines += [
        "",
        f"{'data set':<14} {'AUC diff':>9} {'logloss rel diff':>17} {'ex/s ratio':>11}  acceptance",
    ]
    for name, r in results.items():
        c = r["comparison"]
        verdict = _verdict_text(c)
        lines.append(
            f"{name:<14} {c['auc_diff_ours_minus_keras']:>+9.4f} "
            f"{c['logloss_rel_diff_ours_vs_keras']:>+16.2%} "
            f"{c['examples_per_s_ratio_ours_vs_keras']:>10.2f}x  {verdict}"
        )
    seeded = {n: r["comparison"]["seeds"] for n, r in results.items() if "seeds" in r["comparison"]}
    if seeded:
        lines += ["", "means over seeds (range in brackets):"]
        for name, sd in seeded.items():
            for side in SIDES:
                m = sd[side]
                lines.append(
                    f"{name:<14} {LABELS[side]:<13} seeds {','.join(map(str, m['seeds'])):<6} "
                    f"AUC {m['auc_mean']:.4f} [{m['auc_range'][0]:.4f}..{m['auc_range'][1]:.4f}]"
                    f"  logloss {m['logloss_mean']:.4f} [{m['logloss_range'][0]:.4f}.."
                    f"{m['logloss_range'][1]:.4f}]"
                )
            lines.append(
                f"{name:<14} diff of means: AUC {sd['auc_diff_of_means']:+.4f}, logloss "
                f"{sd['logloss_rel_diff_of_means']:+.2%}: {_verdict_text(sd)}"
            )
        lines.append("")
    for name, r in results.items():
        c = r["comparison"]
        if c["numeric_stats_compared"]:
            lines.append(
                f"{name}: numeric statistics, ours vs Keras' Normalization: means differ by at "
                f"most {c['numeric_mean_max_diff_in_std']:.1e} std, stds by at most "
                f"{c['numeric_std_max_rel_diff']:.1e} (relative)"
            )
    lines.append(
        f"(acceptance: |AUC diff| <= {TARGET_AUC_DIFF}, |logloss rel diff| <= "
        f"{TARGET_LOGLOSS_REL_DIFF:.0%}; AUC diff = ours - keras, rel diff = ours / keras - 1)"
    )
    return "\n".join(lines)


def plot(results: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    names = list(results)
    with figure(path, nrows=3, ncols=len(names), figsize=(6 * len(names), 11), squeeze=False) as (
        _,
        axes,
    ):
        for j, name in enumerate(names):
            _plot_dataset([axes[row][j] for row in range(3)], name, results[name])


def _plot_dataset(axes: Sequence[Any], name: str, result: Mapping[str, Any]) -> None:
    """One data set's column: the training loss per epoch, eval AUC, eval log loss."""
    ax = axes[0]
    for side in SIDES:
        losses = result[side]["epoch_train_loss"]
        ax.plot(range(1, len(losses) + 1), losses, "o-", color=COLORS[side], label=LABELS[side])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"{name}: training loss per epoch")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean training log loss")
    ax.grid(alpha=0.3)
    ax.legend()
    c = result["comparison"]
    ref_auc, ref_loss = (
        result["keras"]["eval_auc"],
        result["keras"]["eval_logloss"],
    )
    bands = {
        "eval_auc": (ref_auc - TARGET_AUC_DIFF, ref_auc + TARGET_AUC_DIFF),
        "eval_logloss": (
            ref_loss * (1 - TARGET_LOGLOSS_REL_DIFF),
            ref_loss * (1 + TARGET_LOGLOSS_REL_DIFF),
        ),
    }
    titles = {
        "eval_auc": f"{name}: eval AUC (diff {c['auc_diff_ours_minus_keras']:+.4f})",
        "eval_logloss": f"{name}: eval log loss (diff {c['logloss_rel_diff_ours_vs_keras']:+.2%})",
    }
    for row, metric in ((1, "eval_auc"), (2, "eval_logloss")):
        ax = axes[row]
        ax.axhspan(*bands[metric], color="tab:green", alpha=0.12, label="acceptance band")
        for i, side in enumerate(SIDES):
            first = result[side]
            others = result.get(f"{side}_other_seeds", [])
            ax.plot([i], [first[metric]], "o", ms=10, color=COLORS[side], label="seed 0")
            ax.plot(
                [i] * len(others),
                [r[metric] for r in others],
                "o",
                ms=5,
                mfc="none",
                color=COLORS[side],
                label="other seeds" if others and i == 0 else None,
            )
            ax.annotate(
                f"{first[metric]:.4f}",
                (i, first[metric]),
                xytext=(12, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_xlim(-0.6, len(SIDES) - 0.4)
        ax.set_xticks(
            range(len(SIDES)),
            [f"{LABELS[s]}\n{result[s]['examples_per_s']:,.0f} examples/s" for s in SIDES],
        )
        ax.set_title(titles[metric], fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        handles, labels = ax.get_legend_handles_labels()
        keep = {lab: h for h, lab in zip(handles, labels, strict=True)}
        ax.legend(keep.values(), keep.keys(), fontsize=7, loc="best")


# ---------------------------------------------------------------- our side's variants


def compare_variants(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Each variant's runs (one per seed) against the first variant's: the means over
    seeds, the same-seed differences and the verdict on the mean AUC difference."""
    base_name, *_ = runs
    base = _spread(runs[base_name])
    by_seed = {r["seed"]: r for r in runs[base_name]}
    out: dict[str, Any] = {}
    for variant, rs in runs.items():
        s = _spread(rs)
        auc_diff = s["auc_mean"] - base["auc_mean"]
        target = VARIANT_TARGET_AUC_DIFF.get(variant) if variant != base_name else None
        out[variant] = {
            **s,
            "runs": [
                {
                    **brief(r),
                    "seconds": r.get("seconds"),
                    "process_wall_seconds": r.get("process_wall_seconds"),
                }
                for r in rs
            ],
            "against": base_name,
            "auc_diff_of_means": auc_diff,
            "logloss_rel_diff_of_means": s["logloss_mean"] / base["logloss_mean"] - 1,
            "auc_diff_per_seed": {
                str(r["seed"]): r["eval_auc"] - by_seed[r["seed"]]["eval_auc"]
                for r in rs
                if r["seed"] in by_seed
            },
            "target_auc_diff": target,
            "met": None if target is None else auc_target_met(auc_diff, target),
        }
    return out


def render_variants(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """One line per data set and variant: means over seeds, each seed, the verdict."""
    lines = [
        f"{'data set':<14} {'variant':<26} {'AUC mean':>9} {'diff':>8} {'logloss':>8} "
        f"{'rel diff':>9} {'s/run':>6}  per seed AUC / logloss  target",
    ]
    for name, variants in results.items():
        for variant, v in variants.items():
            seeds = "  ".join(
                f"{r['seed']}: {r['eval_auc']:.4f}/{r['eval_logloss']:.4f}" for r in v["runs"]
            )
            walls = [r["process_wall_seconds"] for r in v["runs"] if r["process_wall_seconds"]]
            target = v["target_auc_diff"]
            verdict = (
                "(reference)"
                if target is None and v["auc_diff_of_means"] == 0
                else "no target"
                if target is None
                else f"diff >= -{target}: {'met' if v['met'] else 'NOT MET'}"
            )
            lines.append(
                f"{name:<14} {variant:<26} {v['auc_mean']:>9.4f} {v['auc_diff_of_means']:>+8.4f} "
                f"{v['logloss_mean']:>8.4f} {v['logloss_rel_diff_of_means']:>+9.2%} "
                f"{np.mean(walls) if walls else float('nan'):>6.0f}  {seeds}  {verdict}"
            )
    lines.append(
        "(diff = variant's mean eval AUC over seeds - the first variant's; rel diff of the "
        "mean logloss; s/run = the trainer process's wall seconds, cluster start excluded)"
    )
    return "\n".join(lines)


def plot_variants(results: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path) -> None:
    """Per data set: eval AUC and log loss of each seed (dots) and their mean (bar) per variant."""
    names = list(results)
    with figure(path, nrows=2, ncols=len(names), figsize=(6 * len(names), 8), squeeze=False) as (
        _,
        axes,
    ):
        for j, name in enumerate(names):
            variants = results[name]
            labels = list(variants)
            for row, (metric, mean) in enumerate(
                (("eval_auc", "auc_mean"), ("eval_logloss", "logloss_mean"))
            ):
                ax = axes[row][j]
                x = np.arange(len(labels))
                ax.bar(x, [variants[v][mean] for v in labels], 0.6, color="tab:orange", alpha=0.4)
                for i, v in enumerate(labels):
                    ax.plot(
                        [i] * len(variants[v]["runs"]),
                        [r[metric] for r in variants[v]["runs"]],
                        "o",
                        color="tab:orange",
                    )
                    ax.annotate(
                        f"{variants[v][mean]:.4f}",
                        (i, variants[v][mean]),
                        ha="center",
                        va="bottom",
                        fontsize=8,
                    )
                lo = min(r[metric] for v in labels for r in variants[v]["runs"])
                hi = max(r[metric] for v in labels for r in variants[v]["runs"])
                pad = max(hi - lo, 1e-3)
                ax.set_ylim(lo - pad, hi + pad)
                ax.set_xticks(x, labels, fontsize=8)
                ax.set_title(f"{name}: {metric.replace('_', ' ')} per variant (dots: seeds)")
                ax.grid(alpha=0.3, axis="y")
