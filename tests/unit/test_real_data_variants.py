"""`benchmarks.real_data --variants`: what each variant makes of the tables, its bad
input, and how its runs are held against the first variant's."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from benchmarks.harness.variants import VARIANTS
from benchmarks.real_data.__main__ import parse_args
from benchmarks.real_data.ours import with_variant
from benchmarks.real_data.report import compare_variants, render_variants
from lookup_table.config import parse_config

pytestmark = pytest.mark.unit

TABLES = """
[[tables]]
name = "a"
dim = 16
id_type = "string"
initializer = {name = "uniform", minval = -0.05, maxval = 0.05}

[[tables]]
name = "b"
dim = 16
id_type = "string"
"""


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variant_sets_every_tables_dtype_optimizer_and_rounding(variant: str) -> None:
    raw = tomllib.loads(with_variant(TABLES, variant))
    config = parse_config({"namespace": "n", "memcached": ["127.0.0.1:1"], **raw}, env={})
    want = VARIANTS[variant].made
    assert [(t.dtype, t.optimizer.name, t.rounding) for t in config.tables] == [want] * 2
    assert config.tables[0].initializer.params == {"minval": -0.05, "maxval": 0.05}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--variants", "fp16-adam"], "--variants takes distinct names from fp32-adam, "),
        (["--variants", "fp32-adam,fp32-adam"], "got ['fp32-adam', 'fp32-adam']"),
        (["--sides", "keras", "--variants", "fp32-adam,bf16-adam"], "add ours to --sides"),
    ],
)
def test_bad_variants_are_refused_saying_what_to_give(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err


def _run(seed: int, auc: float, logloss: float) -> dict[str, Any]:
    return {
        "seed": seed,
        "eval_auc": auc,
        "eval_logloss": logloss,
        "examples_per_s": 1000.0,
        "first_step_loss": 0.69,
        "seconds": 10.0,
        "process_wall_seconds": 12.0,
    }


def test_each_variant_is_held_against_the_first_by_its_mean_over_seeds() -> None:
    out = compare_variants(
        {
            "fp32-adam": [_run(0, 0.780, 0.50), _run(1, 0.770, 0.52)],
            "f16-rowwise-adam": [_run(0, 0.776, 0.51), _run(1, 0.771, 0.52)],
            "f16-rowwise-adagrad": [_run(0, 0.760, 0.55), _run(1, 0.770, 0.53)],
        }
    )
    base, adam, adagrad = out["fp32-adam"], out["f16-rowwise-adam"], out["f16-rowwise-adagrad"]
    assert base["met"] is None and base["auc_diff_of_means"] == 0
    assert adam["auc_diff_of_means"] == pytest.approx(-0.0015)
    assert adam["auc_diff_per_seed"] == pytest.approx({"0": -0.004, "1": 0.001})
    assert (adam["target_auc_diff"], adam["met"]) == (0.002, True)
    assert adagrad["auc_diff_of_means"] == pytest.approx(-0.01)
    assert (adagrad["target_auc_diff"], adagrad["met"]) == (0.005, False)
    text = render_variants({"movielens100k": out})
    assert "diff >= -0.005: NOT MET" in text and "diff >= -0.002: met" in text
