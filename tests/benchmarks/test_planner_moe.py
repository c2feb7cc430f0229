"""The planner against published MoE runs its constants were not set from (``benchmarks/planner_moe.py``): each
run's predicted throughput for its published layout within 25% of the published figure. Runs that miss are strict
xfails naming the measured ratio and why."""

import pytest

from tests.launch import benchmark_modules

planner_moe, run_all = benchmark_modules("planner_moe", "run_all")  # run_all: RESULTS.md's sections

#: model -> why the planner misses it by more than 25% (predicted ÷ published, as measured)
MISSES = {
    "qwen3-30b-a3b": ("2.46: a fine-grained MoE (128 experts of width 768, top-8) that Megatron-Bridge's 25.11 release"
                      " ran dropless at 12% of the bf16 peak (FP8), where the planner, pricing every matmul at half"
                      " the peak whatever its size, predicts 25%; the same page's 25.09 release published the same"
                      " model, layout and batch (token dropping) at twice the figure, within 25% of the planner's"),
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
