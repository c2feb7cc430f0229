"""The planner against what one H100 measured (``benchmarks/gpu_results.json``, recorded by ``benchmarks/gpu.py``):
step time within 25% and peak memory within 10%, offload's host copies included."""

import sys

import pytest

from tests.launch import REPO


@pytest.fixture
def planner_benchmark():
    sys.path.insert(0, str(REPO / "benchmarks"))  # its imports of gpu.py and common.py
    try:
        import planner

        yield planner
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_planner_step_time_and_memory_match_one_gpu(planner_benchmark, tmp_path):
    one = planner_benchmark.one_gpu()
    rows = {row["variant"]: row for row in one["rows"]}
    assert set(rows) == set(planner_benchmark.ONE_GPU_VARIANTS)
    for variant, row in rows.items():
        assert row["predicted_bytes"] / row["measured_peak_bytes"] == pytest.approx(1, abs=0.10), variant
        if variant != "meshlight offload optimizer" or row["host_step"] is not None:  # not the loop it measured
            assert row["predicted_step"] / row["measured_step"] == pytest.approx(1, abs=0.25), variant
    # offloading every block's activations over PCIe more than triples the step, and the planner says so
    offloaded, plain = rows["meshlight offload activations"], rows["meshlight"]
    assert offloaded["measured_step"] > 3 * plain["measured_step"]
    assert offloaded["predicted_step"] > 3 * plain["predicted_step"] and offloaded["host_seconds"] > 0
    assert planner_benchmark.one_gpu(tmp_path / "none.json") is None
