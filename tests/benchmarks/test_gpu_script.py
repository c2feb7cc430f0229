"""The GPU benchmark (run when a GPU machine is lent) keeps working: its code, on CPU with a tiny model."""

import json
import subprocess
import sys

from tests.launch import REPO, benchmark_modules


def test_gpu_benchmark_runs_every_variant_and_formats(tmp_path):
    out = tmp_path / "gpu.json"
    for section in ("speed", "memory"):  # two commands, as on the GPU machine: --out keeps the first's section
        subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--section", section, "--out", str(out)],
                       cwd=REPO, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    speed, memory = result["sections"]["speed"], result["sections"]["memory"]
    assert set(speed["variants"]) == {"plain autocast", "plain fsdp2", "meshlight", "meshlight bf16 norms"}
    assert set(memory["variants"]) == {"meshlight", "meshlight recompute", "meshlight offload optimizer",
                                       "meshlight offload activations"}
    assert all(row["step_seconds"] > 0 and row["mfu"] > 0 for section in (speed, memory)
               for row in section["variants"].values())
    assert speed["command"] == f"python benchmarks/gpu.py --smoke --section speed --out {out}"
    assert memory["command"] == f"python benchmarks/gpu.py --smoke --section memory --out {out}"
    assert result["ratios"]["meshlight / plain fsdp2"] > 0
    (run_all,) = benchmark_modules("run_all")
    section = run_all.gpu_section(result)
    assert "| meshlight recompute |" in section and "| meshlight / plain fsdp2 |" in section
    threads = memory["variants"]["meshlight offload optimizer"]["host_threads"]  # what the host stepped on
    assert threads >= 1 and f" on {threads} threads." in section


def test_gpu_benchmark_merges_only_sections_of_the_same_setup(tmp_path, capsys):
    (gpu,) = benchmark_modules("gpu")
    setup = {"device": "NVIDIA H100", "torch": "2.13.0", "model": {"params": 10, "seq": 2048}}
    out = tmp_path / "gpu.json"
    assert gpu.earlier_summary(out, setup) == {}
    out.write_text(json.dumps({**setup, "date": "2026-11-20", "sections": {"speed": {"variants": {}}}}))
    assert gpu.earlier_summary(out, setup)["sections"] == {"speed": {"variants": {}}}
    out.write_text(json.dumps({**setup, "device": "NVIDIA H200", "sections": {"speed": {"variants": {}}}}))
    assert gpu.earlier_summary(out, setup) == {}
    assert "different device: its sections ['speed'] are replaced" in capsys.readouterr().err
