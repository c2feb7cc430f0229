"""benchmarks/cuda_paths.py (run on a GPU machine) keeps working: on CPU it trains its fp32 run, and the run
recorded on a lent H200 formats into RESULTS.md with every CUDA path within its tolerance of fp32."""

import json
import subprocess
import sys

from tests.launch import REPO, benchmark_modules


def test_the_script_runs_on_cpu_and_the_recorded_cuda_runs_format():
    done = subprocess.run([sys.executable, "benchmarks/cuda_paths.py", "--cpu", "--steps", "6"], cwd=REPO,
                          check=True, capture_output=True, text=True, timeout=300)
    (fp32,) = json.loads(done.stdout)["runs"]
    assert fp32["run"] == "fp32" and fp32["steps_taken"] == 6
    run_all, common = benchmark_modules("run_all", "common")

    recorded = json.loads(common.GPU_CUDA_PATHS.read_text())
    runs = {row["run"]: row for row in recorded["runs"]}
    assert runs["fp16"]["max_relative_loss_difference"] <= 2e-2  # fp16 tracks fp32
    assert runs["offload optimizer"]["max_relative_loss_difference"] <= 1e-5  # the same arithmetic, moved
    assert runs["offload activations"]["max_relative_loss_difference"] <= 1e-5
    (section,) = run_all.cuda_paths_section(recorded)
    assert "| offload optimizer | 9.1e-07 |" in section
