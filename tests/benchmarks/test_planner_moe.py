"""The planner against published MoE runs its constants were not set from (``benchmarks/planner_moe.py``): each
run's predicted throughput for its published layout within 25% of the published figure. Runs that miss are strict
xfails naming the measured ratio and why."""

import pytest

from tests.launch import benchmark_modules

planner_moe, run_all = benchmark_modules("planner_moe", "run_all")  # run_all: RESULTS.md's sections

_FINE_GRAINED = ("{ratio}: a fine-grained MoE ({experts} experts of width {width}, top-{k}) that Megatron-Bridge ran"
                 " at {mfu} of the bf16 peak; the planner prices every matmul at half the peak whatever its size, and"
                 " the tokens' permutation, like every kernel between the matmuls, as its memory traffic alone, so"
                 " it predicts {planned}")
#: model -> why the planner misses it by more than 25% (predicted ÷ published, as measured)
MISSES = {
    "qwen3-30b-a3b": _FINE_GRAINED.format(ratio="2.52", experts=128, width=768, k=8, mfu="12% (FP8)", planned="26%"),
    "qwen3-30b-a3b-25.09": ("1.27: the same model, layout and batch, published by the same page two releases"
                            " earlier (token dropping) at twice the 25.11 dropless figure; still above the"
                            " planner's 25%"),
    "gpt-oss-120b": _FINE_GRAINED.format(ratio="1.37", experts=128, width=2880, k=4, mfu="15%", planned="30%"),
}


@pytest.fixture(scope="module")
def rows() -> dict:
    return {run.key: row for run, row in zip(planner_moe.RUNS, planner_moe.rows())}


@pytest.mark.parametrize("run", [
    pytest.param(run, id=run.key, marks=[pytest.mark.xfail(strict=True, reason=MISSES[run.key])]
                 if run.key in MISSES else []) for run in planner_moe.RUNS])
def test_the_planner_predicts_published_moe_runs_within_25_percent(rows, run):
    assert rows[run.key]["ratio"] == pytest.approx(1, abs=0.25), rows[run.key]["predicted_config"]


def test_the_section_says_how_many_runs_are_within_25_percent(rows):
    section = run_all.planner_moe_section(list(rows.values()))
    assert f"Within 25%: {len(planner_moe.RUNS) - len(MISSES)} of {len(planner_moe.RUNS)}." in section
    assert all(row["published_layout"]["ep"] > 1 for row in rows.values())
