"""`benchmarks.train --variants/--seeds`: what a variant's cluster file holds, its bad
input, and how its rounds are held against fp32 Adam distributed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness.cluster import DEMO_CONFIG, write_cluster_file
from benchmarks.harness.rounds import interleaved, rotated_within
from benchmarks.harness.variants import VARIANTS
from benchmarks.train.__main__ import parse_args
from benchmarks.train.compact import (
    check_cluster,
    compare,
    method_of,
    render,
    table_changes,
    variant_of,
)
from benchmarks.train.report import ordered
from lookup_table.config import load_config

pytestmark = pytest.mark.unit

COLUMNS = [f"C{i}" for i in range(1, 27)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seed", [0, 2])
def test_a_variants_cluster_file_has_its_dtype_optimizer_and_seed(
    variant: str, seed: int, tmp_path: Path
) -> None:
    demo = load_config(DEMO_CONFIG)
    changes = table_changes(demo, COLUMNS, variant, seed)
    write_cluster_file(tmp_path / "cluster.toml", tables=changes)
    config = load_config(tmp_path / "cluster.toml")
    check_cluster(config, COLUMNS, variant, changes)
    spec = VARIANTS[variant]
    for column in COLUMNS:
        t, before = config.table(column), demo.table(column)
        assert (t.dtype, t.optimizer.name, t.rounding) == spec.made
        # row-wise Adam steps at the demo table's own Adam rate (0.01), not the default 0.001
        want_rate = {"rowwise_adagrad": 0.01}.get(spec.optimizer, before.optimizer.learning_rate)
        assert t.optimizer.learning_rate == want_rate == pytest.approx(0.01)
        assert (t.seed == before.seed) == (seed == 0)
        assert t.dim == before.dim and t.initializer == before.initializer
    # the tables the model does not train stay the demo's
    assert [config.table(n) for n in ("user", "item", "query")] == [
        demo.table(n) for n in ("user", "item", "query")
    ]


def test_a_seeded_round_gives_every_table_a_seed_of_its_own() -> None:
    demo = load_config(DEMO_CONFIG)
    seeds = [table_changes(demo, COLUMNS, "fp32-adam", k) for k in (1, 2)]
    assert table_changes(demo, COLUMNS, "fp32-adam", 0) == {}
    firsts, seconds = ([s[c]["seed"] for c in COLUMNS] for s in seeds)
    assert len(set(firsts)) == len(set(seconds)) == 26 and not set(firsts) & set(seconds)


def test_a_cluster_without_the_variant_is_refused(tmp_path: Path) -> None:
    demo = load_config(DEMO_CONFIG)
    write_cluster_file(tmp_path / "cluster.toml")  # the demo's fp32 Adam tables
    config = load_config(tmp_path / "cluster.toml")
    changes = table_changes(demo, COLUMNS, "bf16-adam", 0)
    with pytest.raises(RuntimeError, match=r"variant 'bf16-adam' made tables of .*'float32'"):
        check_cluster(config, COLUMNS, "bf16-adam", changes)
    seeded = table_changes(demo, COLUMNS, "fp32-adam", 3)
    with pytest.raises(RuntimeError, match="table 'C1' has seed .* asked for"):
        check_cluster(config, COLUMNS, "fp32-adam", seeded)
    with pytest.raises(ValueError, match=r"no tables \['C99'\]"):
        write_cluster_file(tmp_path / "other.toml", tables={"C99": {"dtype": "float16"}})


def test_variant_methods_sit_after_distributed_and_name_their_variant() -> None:
    methods = [method_of(v) for v in ("bf16-adam", "fp32-adam", "f16-rowwise-adam")]
    assert ordered(["mlp_floor", "local", *methods, "lazy_adam"]) == [
        "local",
        "lazy_adam",
        "distributed",
        "distributed-f16-rowwise-adam",
        "distributed-bf16-adam",
        "mlp_floor",
    ]
    assert [variant_of(m) for m in ("distributed", "distributed-bf16-adam", "local")] == [
        "fp32-adam",
        "bf16-adam",
        None,
    ]


def test_seeds_set_the_rounds_and_variants_default_to_fp32_adam() -> None:
    plain = parse_args(["--quick"])
    assert (plain.variants, plain.seeds, plain.rounds) == (["fp32-adam"], 1, 1)
    seeded = parse_args(["--seeds", "3", "--variants", "fp32-adam,f16-rowwise-adagrad"])
    assert (seeded.variants, seeded.seeds, seeded.rounds) == (
        ["fp32-adam", "f16-rowwise-adagrad"],
        3,
        3,
    )
    assert parse_args(["--seeds", "2", "--rounds", "4"]).rounds == 4


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--variants", "fp16-adam"], "--variants takes distinct names from fp32-adam, "),
        (["--variants", "fp32-adam,bf16-adam,bf16-adam"], "got ['fp32-adam', 'bf16-adam', 'bf"),
        (["--variants", "bf16-adam"], "--variants must include fp32-adam, the distributed"),
        (["--seeds", "3", "--rounds", "4"], "got --rounds 4 for --seeds 3: give --rounds 3"),
        (["--seeds", "0"], "--seeds must be at least 1, got 0"),
    ],
)
def test_bad_variants_and_seeds_are_refused_saying_what_to_give(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err


def _round(method: str, paired: int, seed: int, rate: float, auc: float) -> dict[str, Any]:
    return {
        "method": method,
        "paired_round": paired,
        "seed": seed,
        "examples_per_s": rate,
        "eval_auc": auc,
        "eval_logloss": 1 - auc,
        "disturbed": False,
    }


def test_each_variant_is_paired_by_round_for_speed_and_by_seed_for_accuracy() -> None:
    rounds = [
        _round("distributed", 0, 0, 1000.0, 0.750),
        _round("distributed-f16-rowwise-adam", 0, 0, 1100.0, 0.749),
        _round("distributed-f16-rowwise-adagrad", 0, 0, 900.0, 0.740),
        _round("distributed", 1, 1, 500.0, 0.760),  # a slow round: the pairs hide it
        _round("distributed-f16-rowwise-adam", 1, 1, 520.0, 0.758),
        _round("distributed-f16-rowwise-adagrad", 1, 1, 450.0, 0.758),
        {**_round("distributed-f16-rowwise-adam", 2, 0, 1.0, 0.5), "disturbed": True},
        _round("distributed-f16-rowwise-adam", 2, 0, 1200.0, 0.751),
        _round("distributed", 2, 0, 1000.0, 0.752),
        _round("distributed-f16-rowwise-adagrad", 2, 0, 950.0, 0.744),
    ]
    out = compare(rounds, ["fp32-adam", "f16-rowwise-adam", "f16-rowwise-adagrad"])
    base, adam, adagrad = out["fp32-adam"], out["f16-rowwise-adam"], out["f16-rowwise-adagrad"]
    assert base["examples_per_s_met"] is None and base["auc_met"] is None
    assert adam["examples_per_s_ratio_per_round"] == pytest.approx({"0": 1.1, "1": 1.04, "2": 1.2})
    assert adam["examples_per_s_ratio_median"] == pytest.approx(1.1)
    assert adam["examples_per_s_met"] is True
    # seed 0 ran twice: its AUC is the mean of rounds 0 and 2
    assert adam["eval_auc_per_seed"] == pytest.approx({"0": 0.750, "1": 0.758})
    assert adam["auc_diff_per_seed"] == pytest.approx({"0": -0.001, "1": -0.002})
    assert adam["logloss_diff_per_seed"] == pytest.approx({"0": 0.001, "1": 0.002})
    assert adam["auc_diff_mean"] == pytest.approx(-0.0015)
    assert (adam["target_auc_diff"], adam["auc_met"]) == (0.002, True)
    assert adagrad["examples_per_s_ratio_median"] == pytest.approx(0.9)
    assert adagrad["examples_per_s_met"] is False
    assert adagrad["auc_diff_mean"] == pytest.approx((-0.009 - 0.002) / 2)
    assert (adagrad["target_auc_diff"], adagrad["auc_met"]) == (0.005, False)
    text = render(out)
    assert ">= 1.0: PASS" in text and ">= 1.0: FAIL" in text
    assert ">= -0.002: PASS" in text and ">= -0.005: FAIL" in text


def test_every_seed_counts_for_accuracy_and_only_quiet_pairs_for_speed() -> None:
    """A round whose every try was disturbed still gives its seed's AUC (the eval does
    not depend on the load), but its speed is left out while a quiet pair exists."""
    loud = {"disturbed": True}
    rounds = [
        _round("distributed", 0, 0, 1000.0, 0.750),
        _round("distributed-bf16-adam", 0, 0, 1050.0, 0.751),
        {**_round("distributed", 1, 1, 300.0, 0.760), **loud},
        {**_round("distributed-bf16-adam", 1, 1, 900.0, 0.761), **loud},
    ]
    out = compare(rounds, ["fp32-adam", "bf16-adam"])["bf16-adam"]
    assert out["eval_auc_per_seed"] == pytest.approx({"0": 0.751, "1": 0.761})
    assert out["auc_diff_mean"] == pytest.approx(0.001)
    assert out["examples_per_s_ratio_per_round"] == pytest.approx({"0": 1.05})
    assert out["examples_per_s_ratio_disturbed"] is False
    everything_loud = [{**r, **loud} for r in rounds]
    out = compare(everything_loud, ["fp32-adam", "bf16-adam"])["bf16-adam"]
    assert out["examples_per_s_ratio_per_round"] == pytest.approx({"0": 1.05, "1": 3.0})
    assert out["examples_per_s_ratio_disturbed"] is True


def test_each_cluster_method_takes_each_place_among_them_in_turn() -> None:
    """The rounds rotate the cluster methods among their own places (a cluster run right
    after another may run slower): over as many rounds as there are, each is first once,
    and the other methods keep `interleaved`'s places."""
    variants = ["fp32-adam", "f16-rowwise-adam", "f16-rowwise-adagrad", "bf16-adam"]
    clusters = [method_of(v) for v in variants]
    methods = ordered(["local", "lazy_adam", "mlp_floor", *clusters])
    plain = list(interleaved(methods, 4))
    plan = rotated_within(plain, clusters)
    assert [r for r, _ in plan] == [r for r, _ in plain]
    firsts = []
    for r in range(4):
        got = [m for k, m in plan if k == r]
        before = [m for k, m in plain if k == r]
        assert sorted(got) == sorted(before)
        assert [m for m in got if m not in clusters] == [m for m in before if m not in clusters]
        places = [i for i, m in enumerate(before) if m in clusters]
        assert [i for i, m in enumerate(got) if m in clusters] == places
        firsts.append(got[places[0]])
    assert sorted(firsts) == sorted(clusters)
    # one cluster method (no variants): the plan is interleaved's
    assert rotated_within(
        list(interleaved(ordered(["local", "distributed"]), 3)), ["distributed"]
    ) == list(interleaved(ordered(["local", "distributed"]), 3))
