"""Shared by the benchmarks: launching a benchmark on N CPU processes and the model they measure.

A benchmark script run directly re-launches itself on each process count — ranks forked with torchrun's
environment by ``tests/forkrun.py``, which imports torch and Lightning once for all of them instead of once per
rank (~1 min of ``make bench`` here) — collects the JSON line its rank 0 prints, and prints the combined JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: what ``benchmarks/gpu.py --out`` last recorded on a GPU (kept in the repository: CI has no GPU)
GPU_RESULTS = REPO / "benchmarks" / "gpu_results.json"
#: what ``benchmarks/host_step.py`` printed on the host of that GPU machine (``run_all.GPU_COMMANDS``)
GPU_HOST_STEP = REPO / "benchmarks" / "gpu_host_step.json"
#: the speed section measured again on an H200 (``gpu.py --section speed --rounds 1``), beside the H100's full run
GPU_RESULTS_H200 = REPO / "benchmarks" / "gpu_results_h200.json"
#: what ``benchmarks/context_parallel.py --gpu`` printed on a GPU machine (``run_all.GPU_CONTEXT_COMMAND``)
GPU_CONTEXT = REPO / "benchmarks" / "gpu_context_parallel.json"
#: what ``benchmarks/cuda_paths.py`` printed on a GPU machine (``run_all.GPU_CUDA_PATHS_COMMAND``)
GPU_CUDA_PATHS = REPO / "benchmarks" / "gpu_cuda_paths.json"
RESULT_PREFIX = "BENCHMARK-RESULT "


def is_worker() -> bool:
    return "LOCAL_RANK" in os.environ


def launch(script: str, nprocs: int, *args: str, timeout: float = 900) -> Any:
    """Run ``script`` on ``nprocs`` gloo processes and return what its rank 0 passed to :func:`report`."""
    command = [sys.executable, str(REPO / "tests" / "forkrun.py"), str(nprocs), script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{script} on {nprocs} processes failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def report(value: Any) -> None:
    """Hand a JSON-serializable result from a worker's rank 0 to :func:`launch`."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT_PREFIX + json.dumps(value), flush=True)


def bench_config():  # noqa: ANN201 - a GPTConfig; imported lazily so the launcher stays light
    """The model the communication and memory benchmarks measure: 4 blocks, ~0.87M parameters."""
    from meshlight.models import GPTConfig

    return GPTConfig(vocab_size=256, max_seq_len=64, n_layers=4, n_heads=4, dim=128)


def measuring_trainer_options(world: int, max_steps: int, callbacks: list, **extra: Any) -> dict[str, Any]:
    """Trainer arguments for a measurement: CPU processes, no logger, checkpoints, progress bar or validation."""
    return dict(devices=world, accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
                **extra)


def main_over_world_sizes(script: str, description: str) -> None:
    """Command line of a benchmark measured per world size: ``--nprocs 2 4`` → one JSON list of all rows."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(json.dumps([row for n in args.nprocs for row in launch(script, n)], indent=1))


def model_state_bytes(trainer: Any, module: Any, *, leave_out_host: bool = False) -> dict[str, int]:
    """Bytes of the storages holding this rank's parameters (gathered and sharded copies), gradients, optimizer
    state and FSDP's gather buffers (in flight included), each storage once, FSDP's padding included.
    ``leave_out_host``: without what FSDP2's CPU offload policy keeps in host memory (the parameter shards, their
    gradients and the optimizer state), i.e. what stays on the accelerator under the Offload callback."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    def storage_of(tensor: torch.Tensor) -> Any:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()

    optimizer = trainer.optimizers[0]
    groups = [group for m in trainer.strategy.model.modules() if isinstance(m, FSDPModule)
              for group in [m._get_fsdp_state()._fsdp_param_group] if group is not None]
    fsdp_params = [p for group in groups for p in group.fsdp_params]
    # a unit's gather in flight (prefetched, not yet copied out to its parameters)
    pending = [group._all_gather_result.all_gather_output for group in groups if group._all_gather_result]
    host = [t for p in fsdp_params for t in (p.sharded_param, p.sharded_param.grad) if t is not None] + [
        t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    seen = {storage_of(t).data_ptr() for t in host} if leave_out_host else set()

    def storage_bytes(tensor: torch.Tensor) -> int:
        storage = storage_of(tensor)
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    # While gathered, the module holds the unsharded parameters; FSDP keeps the shards aside.
    params = [*module.parameters(), *trainer.strategy.model.parameters(), *(p.sharded_param for p in fsdp_params)]
    return {
        "parameters": sum(storage_bytes(p) for p in params),
        "gradients": sum(storage_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(storage_bytes(t) for state in optimizer.state.values() for t in state.values()
                         if isinstance(t, torch.Tensor)),
        "gathered_buffers": sum(storage_bytes(t) for t in [*pending, *(t for p in fsdp_params
                                                                      for t in p.all_gather_outputs)]),
    }
