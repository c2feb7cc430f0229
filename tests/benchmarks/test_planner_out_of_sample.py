"""The planner against published runs its constants were not set from (``benchmarks/planner.py``'s
``OUT_OF_SAMPLE``): each run's predicted tokens/s per GPU for its published layout within 25% of the published
figure, and where the run tuned its layout for speed, that layout among the planner's three best. Runs that miss
are strict xfails naming the measured ratio."""

import pytest

from meshlight.parallel.planner import HARDWARE
from tests.launch import benchmark_modules

planner_benchmark, run_all = benchmark_modules("planner", "run_all")  # run_all: RESULTS.md's sections

#: run id -> why the planner misses it by more than 25% (predicted ÷ published, as measured)
MISSES = {
    "mpt-30b-a100-8x-b504": ("0.666: compute-bound with recomputation; at half the dense peak the planner predicts"
                             " 36% MFU, and llm-foundry's A100 run reached 55% (73% counting the recomputation)"),
    "gpt3-175b-h100-512x-b2048": ("0.702: an FP8 run compared at torchtitan's Float8 speedup (1.445×); the planner's"
                                  " bf16 prediction (44% MFU) against 62% implied, so either NeMo's FP8 gains more"
                                  " here or half the peak is too little for 12,288-wide matmuls"),
}
#: run id -> why the published layout, tuned for speed, is not among the planner's three best
RANK_MISSES: dict[str, str] = {}


def _id(run):
    return f"{run.model}-{run.hardware}-{run.gpus}x-b{run.global_batch}"


def _params(misses, runs):
    return [pytest.param(run, id=_id(run), marks=[pytest.mark.xfail(strict=True, reason=misses[_id(run)])]
                         if _id(run) in misses else []) for run in runs]


def _planned(run):
    """The planner's candidate for the run's published layout, its layouts that fit, and that layout's rank."""
    model = planner_benchmark.out_of_sample_model(run.model, run.seq_len)
    return planner_benchmark.planned_layout(model, HARDWARE[run.hardware], run.gpus, run.global_batch, run.layout)


def test_the_out_of_sample_runs_are_five_or_more_and_not_in_the_in_sample_table():
    runs = planner_benchmark.OUT_OF_SAMPLE
    in_sample = {(source, gpus, batch) for source, _, _, gpus, batch, *_ in planner_benchmark.PUBLISHED}
    assert len(runs) >= 5 and not in_sample & {(r.source, r.gpus, r.global_batch) for r in runs}
    assert len({_id(run) for run in runs}) == len(runs)
    assert set(MISSES) | set(RANK_MISSES) <= {_id(run) for run in runs}


@pytest.mark.parametrize("run", _params(MISSES, planner_benchmark.OUT_OF_SAMPLE))
def test_out_of_sample_throughput_within_25_percent(run):
    chosen, _, _ = _planned(run)
    assert chosen.fits, chosen.describe()
    assert chosen.tokens_per_second_per_device / run.bf16_published == pytest.approx(1, abs=0.25), chosen.describe()


@pytest.mark.parametrize("run", _params(RANK_MISSES, [r for r in planner_benchmark.OUT_OF_SAMPLE
                                                      if r.chosen_as_fastest]))
def test_a_layout_tuned_for_speed_is_among_the_planners_three_best(run):
    _, ranked, rank = _planned(run)
    assert rank is not None and rank <= 3, [c.describe() for c in ranked[:3]]


def test_the_benchmark_reports_the_ratios_and_ranks_the_tests_check():
    rows = planner_benchmark.out_of_sample()
    assert len(rows) == len(planner_benchmark.OUT_OF_SAMPLE)
    for run, row in zip(planner_benchmark.OUT_OF_SAMPLE, rows):
        assert (0.75 <= row["ratio"] <= 1.25) == (_id(run) not in MISSES), _id(run)
        if run.chosen_as_fastest:
            assert (row["rank"] <= 3) == (_id(run) not in RANK_MISSES), _id(run)
    assert sum(0.75 <= row["ratio"] <= 1.25 for row in rows) == 32  # of 34
    section = run_all.planner_out_of_sample_section({"out_of_sample": rows})
    assert "Within 25%: 32 of 34 (**not met**). Chosen layouts among the planner's three best: 5 of 5." in section
