"""The summary over rounds, the table printed and the PNG."""

from __future__ import annotations

import math
import os
import statistics
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.cpu import memcached_work
from benchmarks.harness.data import HIDDEN, MODEL
from benchmarks.harness.plot import figure
from benchmarks.harness.report import met
from benchmarks.harness.rounds import DISTURBED_SHARE, undisturbed
from benchmarks.harness.variants import VARIANTS
from benchmarks.train import compact, torch_baselines
from benchmarks.train.torch_baselines import TORCH_METHODS

TARGET_RATIO = 1.0
TARGET_CPU_RATIO = 1.0  # examples per CPU-second, distributed / local
TARGET_AUC_GAP = 0.01
# the headline: distributed against the same math trained locally (lazy Adam)
TARGET_LAZY_RATIO = 0.5
TARGET_LAZY_CPU_RATIO = 0.5
TARGET_LAZY_AUC_GAP = 0.005
# each side's CPU a step against lazy Adam's whole step: the trainer's, and the replicas'
# and memcached's together
TARGET_LAZY_TRAINER_CPU = 1.0
TARGET_LAZY_INFRA_CPU = 1.0
# the PyTorch baselines: distributed against TorchRec on the CPU, and each baseline's AUC
# against lazy Adam's (the check that it trains the same model)
TARGET_TORCHREC_RATIO = 1.0
TARGET_TORCH_AUC_GAP = 0.005
METHODS = ("local", "lazy_adam", "torchrec", "torch_sparse_adam", "distributed", "mlp_floor")
LABELS = {
    "local": "Keras dense Adam",
    "lazy_adam": "lazy Adam (TF)",
    "torchrec": "TorchRec (FBGEMM)",
    "torch_sparse_adam": "PyTorch SparseAdam",
    "distributed": "distributed",
    "mlp_floor": "MLP alone",
}
MEANINGS = {
    "local": "keras.optimizers.Adam on an Embedding(100k, 16) per column: updates every row "
    'of every table every step (the JSON\'s "local")',
    "lazy_adam": "one tf.function: the batch's unique rows gathered, Adam on those rows only "
    "with a step count per row (the service's math), scattered back",
    "torchrec": "TorchRec FusedEmbeddingBagCollection on FBGEMM's CPU kernels, row-wise "
    "Adagrad fused into the backward pass (FBGEMM's CPU tables have no Adam)",
    "torch_sparse_adam": "an EmbeddingBag(sparse=True) a table with torch.optim.SparseAdam (one "
    "step count a table, not a row)",
    "distributed": "trainer.Trainer on a local cluster (2 memcached, 1 optimizer replica)",
    "mlp_floor": "embeddings held constant, only the MLP trained: the step's compute floor",
}
CPU_COLORS = {"optimizer": "tab:green", "memcached-1": "tab:gray", "memcached-2": "silver"}


def label(method: str) -> str:
    """A method's name in the table and the PNG (a variant's: "distributed <variant>")."""
    return LABELS.get(method) or f"distributed {compact.variant_of(method)}"


def meaning(method: str) -> str:
    variant = compact.variant_of(method)
    if method in MEANINGS or variant is None:
        return MEANINGS[method]
    return f"as distributed, the tables {VARIANTS[variant].made} (dtype, optimizer, rounding)"


def ordered(methods: Iterable[str]) -> list[str]:
    """METHODS' order, each variant's distributed method after distributed (VARIANTS' order)."""
    variants = list(VARIANTS)

    def key(m: str) -> tuple[int, int]:
        if m in METHODS:
            return (METHODS.index(m), -1)
        variant = compact.variant_of(m)
        if variant is None:
            raise ValueError(f"unknown method {m!r}")
        return (METHODS.index("distributed"), variants.index(variant))

    return sorted(set(methods), key=key)


def methods_in(summary: Mapping[str, Any]) -> list[str]:
    """The methods `summary` has, in `ordered` order."""
    return ordered(k for k in summary if k in METHODS or compact.variant_of(k) is not None)


def summarize(
    rounds: Sequence[Mapping[str, Any]],
    reference_auc: float,
    batch_size: int,
    *,
    variants: Sequence[str] = (),
) -> dict[str, Any]:
    """Each method's medians over its used rounds and the ratios between them; with
    `variants`, each against fp32 Adam distributed (`compact.compare`)."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    out: dict[str, Any] = {}
    for m in methods_of(rounds):
        tried = [r for r in rounds if r["method"] == m]
        rs = by[m] = undisturbed(tried)
        cpu_names = sorted({k for r in rs for k in r["cpu"]["cpu_ms_per_step"]})
        out[m] = {
            "rounds_used": [f"{r['round']}.{r['attempt']}" for r in rs],
            "rounds_run": len(tried),
            "all_used_rounds_disturbed": all(r["disturbed"] for r in rs),
            "examples_per_s": statistics.median(r["examples_per_s"] for r in rs),
            "examples_per_s_rounds": [r["examples_per_s"] for r in rs],
            "step_ms_median": statistics.median(r["step_ms_median"] for r in rs),
            "eval_auc": statistics.fmean(r["eval_auc"] for r in rs),
            "eval_auc_rounds": [r["eval_auc"] for r in rs],
            "eval_logloss": statistics.fmean(r["eval_logloss"] for r in rs),
            "final_train_loss_last10": statistics.fmean(
                statistics.fmean(r["losses"][-10:]) for r in rs
            ),
            "cpu_ms_per_step": {
                k: statistics.median(r["cpu"]["cpu_ms_per_step"][k] for r in rs) for k in cpu_names
            },
            "total_cpu_ms_per_step": statistics.median(
                r["cpu"]["total_cpu_ms_per_step"] for r in rs
            ),
            # load-robust: examples per CPU-second of every process taking part
            "examples_per_cpu_s": statistics.median(
                batch_size * 1e3 / r["cpu"]["total_cpu_ms_per_step"] for r in rs
            ),
            "other_processes_share": statistics.median(
                r["cpu"]["other_processes_share"] for r in rs
            ),
        }
        memcached = [c for r in rs if (c := r["cpu"].get("memcached_per_step"))]
        if memcached:
            out[m]["memcached_per_step"] = {
                k: statistics.median(c[k] for c in memcached) for k in memcached[0]
            }
    ratio = out["distributed"]["examples_per_s"] / out["local"]["examples_per_s"]
    # rounds are ABBA: pair the k-th local round used with the k-th distributed one
    paired = statistics.median(
        d["examples_per_s"] / lo["examples_per_s"]
        for lo, d in zip(by["local"], by["distributed"], strict=False)
    )
    gap = out["distributed"]["eval_auc"] - out["local"]["eval_auc"]
    out["ratio_distributed_vs_local"] = ratio
    out["ratio_median_of_paired_rounds"] = paired
    out["ratio_examples_per_cpu_s"] = (
        out["distributed"]["examples_per_cpu_s"] / out["local"]["examples_per_cpu_s"]
    )
    out["auc_gap_distributed_minus_local"] = gap
    out["reference_auc_hidden_model"] = reference_auc
    if "lazy_adam" in out:
        out.update(_against_lazy_adam(out, by))
    if any(m in out for m in TORCH_METHODS):
        out.update(_against_torch(out, by))
    cpu = out["distributed"]["cpu_ms_per_step"]
    trainer_ms = cpu.get("trainer", 0.0)
    infra = sum(v for k, v in cpu.items() if k != "trainer")
    out["infrastructure_cpu_per_trainer_cpu"] = infra / trainer_ms if trainer_ms else math.nan
    out["acceptance"] = {
        f"distributed/local examples/s >= {TARGET_RATIO}": ratio >= TARGET_RATIO,
        f"|eval AUC gap| <= {TARGET_AUC_GAP}": abs(gap) <= TARGET_AUC_GAP,
        f"distributed/local examples per CPU-second >= {TARGET_CPU_RATIO}": (
            out["ratio_examples_per_cpu_s"] >= TARGET_CPU_RATIO
        ),
    }
    if variants:
        out["variants"] = compact.compare(rounds, variants)
        out["variants_acceptance"] = compact.verdicts(out["variants"])
    return out


def methods_of(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """The methods that ran, in `ordered` order."""
    return ordered(r["method"] for r in rounds)


def _against_lazy_adam(
    out: Mapping[str, Any], by: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """The headline figures: distributed against lazy Adam, and their targets."""
    dist, lazy = out["distributed"], out["lazy_adam"]
    ratio = dist["examples_per_s"] / lazy["examples_per_s"]
    cpu_ratio = dist["examples_per_cpu_s"] / lazy["examples_per_cpu_s"]
    gap = dist["eval_auc"] - lazy["eval_auc"]
    lazy_step = lazy["total_cpu_ms_per_step"]
    per_process = dist["cpu_ms_per_step"]
    trainer = per_process["trainer"] / lazy_step
    infra = sum(v for k, v in per_process.items() if k != "trainer") / lazy_step
    return {
        "ratio_distributed_vs_lazy_adam": ratio,
        "ratio_distributed_vs_lazy_adam_median_of_paired_rounds": statistics.median(
            d["examples_per_s"] / lo["examples_per_s"]
            for lo, d in zip(by["lazy_adam"], by["distributed"], strict=False)
        ),
        "ratio_examples_per_cpu_s_vs_lazy_adam": cpu_ratio,
        "auc_gap_distributed_minus_lazy_adam": gap,
        "ratio_trainer_cpu_vs_lazy_adam_step": trainer,
        "ratio_infrastructure_cpu_vs_lazy_adam_step": infra,
        "lazy_adam_acceptance": {
            f"distributed/lazy_adam examples/s >= {TARGET_LAZY_RATIO}": ratio >= TARGET_LAZY_RATIO,
            f"distributed/lazy_adam examples per CPU-second >= {TARGET_LAZY_CPU_RATIO}": (
                cpu_ratio >= TARGET_LAZY_CPU_RATIO
            ),
            f"|eval AUC distributed - lazy_adam| <= {TARGET_LAZY_AUC_GAP}": (
                abs(gap) <= TARGET_LAZY_AUC_GAP
            ),
            f"trainer CPU / lazy_adam step CPU <= {TARGET_LAZY_TRAINER_CPU}": (
                trainer <= TARGET_LAZY_TRAINER_CPU
            ),
            f"(replicas + memcached) CPU / lazy_adam step CPU <= {TARGET_LAZY_INFRA_CPU}": (
                infra <= TARGET_LAZY_INFRA_CPU
            ),
        },
    }


def _against_torch(
    out: Mapping[str, Any], by: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """Distributed against each PyTorch baseline that ran, and each one's AUC against lazy
    Adam's."""
    figures: dict[str, Any] = {}
    acceptance: dict[str, bool] = {}
    for m in (m for m in TORCH_METHODS if m in out):
        ratio = out["distributed"]["examples_per_s"] / out[m]["examples_per_s"]
        figures[f"ratio_distributed_vs_{m}"] = ratio
        figures[f"ratio_distributed_vs_{m}_median_of_paired_rounds"] = statistics.median(
            d["examples_per_s"] / t["examples_per_s"]
            for t, d in zip(by[m], by["distributed"], strict=False)
        )
        figures[f"ratio_examples_per_cpu_s_vs_{m}"] = (
            out["distributed"]["examples_per_cpu_s"] / out[m]["examples_per_cpu_s"]
        )
        if m == "torchrec":
            acceptance[f"distributed/torchrec examples/s >= {TARGET_TORCHREC_RATIO}"] = (
                ratio >= TARGET_TORCHREC_RATIO
            )
        if "lazy_adam" in out:
            gap = out[m]["eval_auc"] - out["lazy_adam"]["eval_auc"]
            figures[f"auc_gap_{m}_minus_lazy_adam"] = gap
            acceptance[f"|eval AUC {m} - lazy_adam| <= {TARGET_TORCH_AUC_GAP}"] = (
                abs(gap) <= TARGET_TORCH_AUC_GAP
            )
    return {**figures, "torch_acceptance": acceptance}


def _torch_lines(summary: Mapping[str, Any]) -> list[str]:
    """The PyTorch baselines' ratios, or the line that says why they did not run."""
    lines = torch_baselines.grouped(summary.get("skipped", {}))
    for m in (m for m in TORCH_METHODS if m in summary):
        target = (
            f"  target >= {TARGET_TORCHREC_RATIO}: "
            f"{met(summary['ratio_distributed_vs_torchrec'] >= TARGET_TORCHREC_RATIO)}"
            if m == "torchrec"
            else "  (no target)"
        )
        lines.append(
            f"distributed/{label(m)} examples/s: {summary[f'ratio_distributed_vs_{m}']:.2f} "
            f"(paired rounds {summary[f'ratio_distributed_vs_{m}_median_of_paired_rounds']:.2f})"
            f"{target}; examples per CPU-second "
            f"{summary[f'ratio_examples_per_cpu_s_vs_{m}']:.2f}"
        )
        if f"auc_gap_{m}_minus_lazy_adam" in summary:
            gap = summary[f"auc_gap_{m}_minus_lazy_adam"]
            lines.append(
                f"eval AUC {label(m)} - lazy Adam: {gap:+.4f}  target |gap| <= "
                f"{TARGET_TORCH_AUC_GAP}: {met(abs(gap) <= TARGET_TORCH_AUC_GAP)}"
                + (" (row-wise Adagrad, not Adam)" if m == "torchrec" else "")
            )
    return ["", *lines] if lines else []


def render_table(summary: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    methods = methods_in(summary)
    width = max(17, *(len(label(m)) for m in methods))
    lines = [
        f"{MODEL} {HIDDEN}, 26 tables dim 16, batch {params['batch_size']}, {params['steps']} "
        f"steps ({params['warmup']} warm-up steps not timed), {params['rounds']} round(s) each, "
        f"eval on {params['eval_batches']} held-out batches; distributed: {params['mode']} "
        f"mode, max_pushes_in_flight {params['pushes_in_flight']}",
        "rounds used (other processes under "
        f"{DISTURBED_SHARE * 100:.0f}% of the machine): "
        + ", ".join(
            f"{label(m)} {len(summary[m]['rounds_used'])} of {summary[m]['rounds_run']}"
            + (" (all disturbed)" if summary[m]["all_used_rounds_disturbed"] else "")
            for m in methods
        ),
        "",
        f"{'method':<{width}} {'examples/s':>10} {'ms/step':>8} {'eval AUC':>9} {'logloss':>8} "
        f"{'CPU ms/step':>11} {'ex/CPU-s':>9} {'other CPU':>9}",
    ]
    for m in methods:
        s = summary[m]
        lines.append(
            f"{label(m):<{width}} {s['examples_per_s']:>10,.0f} {s['step_ms_median']:>8.1f} "
            f"{s['eval_auc']:>9.4f} {s['eval_logloss']:>8.4f} {s['total_cpu_ms_per_step']:>11.0f} "
            f"{s['examples_per_cpu_s']:>9,.0f} {s['other_processes_share']:>9.0%}"
        )
    lines += [f"  {label(m)}: {meaning(m)}" for m in methods]
    if "lazy_adam" in summary:
        lazy = list(summary["lazy_adam_acceptance"].values())
        lines += [
            "",
            f"distributed/lazy Adam examples/s: {summary['ratio_distributed_vs_lazy_adam']:.2f} "
            "(paired rounds "
            f"{summary['ratio_distributed_vs_lazy_adam_median_of_paired_rounds']:.2f})  "
            f"target >= {TARGET_LAZY_RATIO}: {met(lazy[0])}",
            "distributed/lazy Adam examples per CPU-second: "
            f"{summary['ratio_examples_per_cpu_s_vs_lazy_adam']:.2f}  target >= "
            f"{TARGET_LAZY_CPU_RATIO}: {met(lazy[1])}",
            "eval AUC distributed - lazy Adam: "
            f"{summary['auc_gap_distributed_minus_lazy_adam']:+.4f}  "
            f"target |gap| <= {TARGET_LAZY_AUC_GAP}: {met(lazy[2])}",
            "trainer CPU per step / lazy Adam's whole step: "
            f"{summary['ratio_trainer_cpu_vs_lazy_adam_step']:.2f}  target <= "
            f"{TARGET_LAZY_TRAINER_CPU}: {met(lazy[3])}",
            "(replicas + memcached) CPU per step / lazy Adam's whole step: "
            f"{summary['ratio_infrastructure_cpu_vs_lazy_adam_step']:.2f}  target <= "
            f"{TARGET_LAZY_INFRA_CPU}: {met(lazy[4])}",
        ]
    lines += _torch_lines(summary)
    ok = list(summary["acceptance"].values())
    lines += [
        "",
        'against Keras dense Adam ("local"):',
        f"distributed/local examples/s: {summary['ratio_distributed_vs_local']:.2f} "
        f"(paired rounds {summary['ratio_median_of_paired_rounds']:.2f})  "
        f"target >= {TARGET_RATIO}: {met(ok[0])}",
        f"distributed/local examples per CPU-second (all processes; robust to other load): "
        f"{summary['ratio_examples_per_cpu_s']:.2f}  target >= {TARGET_CPU_RATIO}: "
        f"{met(ok[2])}",
        f"eval AUC distributed - local: {summary['auc_gap_distributed_minus_local']:+.4f}  "
        f"target |gap| <= {TARGET_AUC_GAP}: {met(ok[1])}",
        f"AUC of the data's noise-free logit on the same batches (ceiling): "
        f"{summary['reference_auc_hidden_model']:.4f}",
        "",
        "distributed CPU ms/step: "
        + ", ".join(f"{k} {v:.1f}" for k, v in summary["distributed"]["cpu_ms_per_step"].items())
        + f" (total {summary['distributed']['total_cpu_ms_per_step']:.1f} over "
        f"{summary['distributed']['step_ms_median']:.0f} ms wall, {os.cpu_count()} cores)",
        *memcached_lines(summary["distributed"]),
        f"infrastructure (service + memcached) CPU / trainer CPU: "
        f"{summary['infrastructure_cpu_per_trainer_cpu']:.2f}",
    ]
    if "variants" in summary:
        lines += ["", compact.render(summary["variants"])]
    return "\n".join(lines)


def memcached_lines(side: Mapping[str, Any]) -> list[str]:
    """The memcached line of a method's summary (`memcached_work`), if it has counters."""
    per_step = side.get("memcached_per_step")
    if not per_step:
        return []
    cpu = sum(v for k, v in side["cpu_ms_per_step"].items() if k.startswith("memcached-"))
    return [memcached_work(per_step, cpu)]


def _smooth(values: Sequence[float], window: int) -> Any:
    arr = np.asarray(values, dtype=np.float64)
    if window <= 1 or arr.shape[0] < window:
        return arr
    head = np.cumsum(arr[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(arr, np.ones(window) / window, mode="valid")])


def plot(
    rounds: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any],
    path: Path,
    params: Mapping[str, Any],
    costs: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    compared = summary.get("variants", {})
    varied = len(compared) > 1
    ratios = [2.2, 1.6 + 0.3 * varied, 1.7 + 0.3 * varied] + ([1.3] if costs else [])
    ratios += [1.3, 1.3] if varied else []
    with figure(
        path,
        nrows=1,
        ncols=len(ratios),
        figsize=(5 * len(ratios), 4.8),
        gridspec_kw={"width_ratios": ratios},
    ) as (_, axes):
        _plot_loss(axes[0], rounds, summary, params)
        _plot_rate(axes[1], summary)
        _plot_cpu(axes[2], summary)
        if costs:
            _plot_costs(axes[3], costs)
        if varied:
            compact.plot_speed(axes[-2], compared)
            compact.plot_accuracy(axes[-1], compared)


_COLORS = {
    "local": "tab:blue",
    "lazy_adam": "tab:purple",
    "torchrec": "crimson",
    "torch_sparse_adam": "goldenrod",
    "distributed": "tab:orange",
    "mlp_floor": "tab:brown",
}
_VARIANT_COLORS = ("tab:red", "tab:green", "tab:olive", "tab:cyan", "tab:pink", "tab:gray")
_COST_COLORS = {"math": "tab:blue", "bytes": "tab:orange", "else": "tab:red"}


def _color(method: str) -> str:
    if method in _COLORS:
        return _COLORS[method]
    variant = compact.variant_of(method) or ""
    return _VARIANT_COLORS[list(VARIANTS).index(variant) % len(_VARIANT_COLORS)]


def _plot_loss(
    ax_loss: Any,
    rounds: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any],
    params: Mapping[str, Any],
) -> None:
    seen: set[str] = set()
    window = max(1, min(10, len(rounds[0]["losses"]) // 5))
    for r in rounds:
        m = r["method"]
        steps = np.arange(1, len(r["losses"]) + 1)
        ax_loss.plot(steps, r["losses"], color=_color(m), alpha=0.15, lw=0.8)
        ax_loss.plot(
            steps,
            _smooth(r["losses"], window),
            color=_color(m),
            lw=1.6,
            label=None if m in seen else f"{label(m)} (AUC {summary[m]['eval_auc']:.4f})",
        )
        seen.add(m)
    ax_loss.axvline(params["warmup"], color="grey", ls=":", lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"training loss (faint: per step; bold: mean of {window})")
    ax_loss.set_title(f"loss, batch {params['batch_size']}, same batches")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)


def _plot_rate(ax_rate: Any, summary: Mapping[str, Any]) -> None:
    methods = methods_in(summary)
    x = np.arange(len(methods))
    bars = ax_rate.bar(
        x, [summary[m]["examples_per_s"] for m in methods], color=[_color(m) for m in methods]
    )
    # inside the bars: above them, the rounds' dots would cover the figures
    ax_rate.bar_label(
        bars,
        labels=[f"{summary[m]['examples_per_s'] / 1000:.1f}k" for m in methods],
        label_type="center",
        fontsize=8,
        color="white",
        fontweight="bold",
    )
    for i, m in enumerate(methods):
        pts = summary[m]["examples_per_s_rounds"]
        ax_rate.plot([i] * len(pts), pts, "k.", ms=5)
    ax_rate.set_xticks(x, _tick_labels(methods), fontsize=7)
    ax_rate.set_ylabel("examples/s (median of rounds; dots: rounds)")
    title = f"distributed / Keras dense = {summary['ratio_distributed_vs_local']:.2f}"
    if "ratio_distributed_vs_lazy_adam" in summary:
        title = (
            f"distributed / lazy Adam = {summary['ratio_distributed_vs_lazy_adam']:.2f}\n{title}"
        )
    ax_rate.set_title(title, fontsize=10)
    ax_rate.grid(alpha=0.3, axis="y")


def _tick_labels(methods: Sequence[str]) -> list[str]:
    """The methods' labels in lines narrow enough for a bar each."""
    return [textwrap.fill(label(m), 10, break_long_words=False) for m in methods]


def _plot_cpu(ax_cpu: Any, summary: Mapping[str, Any]) -> None:
    methods = methods_in(summary)
    x = np.arange(len(methods))
    tallest = max(summary[m]["total_cpu_ms_per_step"] for m in methods)
    for i, m in enumerate(methods):
        bottom = 0.0
        for k, v in summary[m]["cpu_ms_per_step"].items():
            color = _color(m) if k in (m, "trainer") else CPU_COLORS.get(k, "tab:gray")
            ax_cpu.bar(i, v, bottom=bottom, color=color, edgecolor="white")
            if v >= 0.05 * tallest:  # a thinner part's name would cover its neighbours'
                text = f"{v:.0f}" if k == m else f"{k}\n{v:.0f}"  # its own: named below
                ax_cpu.text(i, bottom + v / 2, text, ha="center", va="center", fontsize=7)
            bottom += v
        wall = summary[m]["step_ms_median"]
        ax_cpu.plot([i - 0.4, i + 0.4], [wall * (os.cpu_count() or 1)] * 2, "k--", lw=1)
    ax_cpu.set_xticks(x, _tick_labels(methods), fontsize=7)
    ax_cpu.set_ylabel("CPU ms per step (dashed: wall ms/step x cores)")
    ax_cpu.set_title("where the CPU goes")
    ax_cpu.grid(alpha=0.3, axis="y")


def _plot_costs(ax: Any, costs: Mapping[str, Mapping[str, Any]]) -> None:
    """The profiled distributed run's cost table: a stacked bar per process."""
    names = list(costs)
    x = np.arange(len(names))
    bottom = np.zeros(len(names))
    for category, color in _COST_COLORS.items():
        values = np.array([costs[n][f"{category}_ms_per_step"] for n in names])
        ax.bar(x, values, bottom=bottom, color=color, edgecolor="white", label=category)
        bottom += values
    ax.set_xticks(x, [n.replace("-", "\n") for n in names], fontsize=8)
    ax.set_ylabel("CPU ms per step (profiled distributed run)")
    ax.set_title("math, bytes moved, else")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
