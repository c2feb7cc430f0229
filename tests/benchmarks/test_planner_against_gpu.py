"""The planner against what one H100 measured (``benchmarks/gpu_results.json``, recorded by ``benchmarks/gpu.py``):
step time within 25% and peak memory within 10%, offload's host copies included."""

import json
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


def test_the_host_step_is_planned_with_that_machines_host_on_the_runs_threads(planner_benchmark, tmp_path):
    import run_all

    one = planner_benchmark.one_gpu()
    measured = json.loads(planner_benchmark.GPU_HOST_STEP.read_text())
    threads = {row["threads"]: row["fused_params_per_second"] for row in measured["rows"]}
    assert one["host_measured"] and one["host_step_rate"] == threads[1]
    assert one["host_memory_bandwidth"] == 28 * threads[max(threads)]  # AdamW: 7 fp32 values per parameter
    rows = {row["variant"]: row for row in one["rows"]}
    recorded = json.loads(planner_benchmark.GPU_RESULTS.read_text())
    offloaded = recorded["sections"]["memory"]["variants"]["meshlight offload optimizer"]
    offloaded_threads = offloaded["host_threads"]
    assert rows["meshlight offload optimizer"]["host_threads"] == offloaded_threads
    # the same run recorded on one thread is planned as one thread's step: several times longer
    offloaded["host_threads"] = 1
    (tmp_path / "one_thread.json").write_text(json.dumps(recorded))
    one_thread = {row["variant"]: row for row in planner_benchmark.one_gpu(tmp_path / "one_thread.json")["rows"]}
    assert one_thread["meshlight offload optimizer"]["host_seconds"] > 4 * rows["meshlight offload optimizer"][
        "host_seconds"]
    assert one_thread["meshlight"]["predicted_step"] == rows["meshlight"]["predicted_step"]  # no host step there
    # without the host's measurement, the preset's figures, and the text says so
    preset = planner_benchmark.one_gpu(host_step=tmp_path / "none.json")
    assert not preset["host_measured"] and preset["host_step_rate"] == 0.78e9
    assert "the preset's." in " ".join(run_all.one_gpu_lines(preset))
    text = "\n".join(run_all.one_gpu_lines(one))
    assert f"| meshlight offload optimizer ({offloaded_threads} host threads) |" in text
    assert "that machine's host" in text
    section = run_all.host_step_section(measured, measured)
    assert f"The host of the GPU machine below ({max(threads)} cores)" in section
    assert f"| {threads[max(threads)] / 1e9:.2f} billion |" in section
