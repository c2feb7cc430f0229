"""torchrun worker: training with compressed gradient reductions or saved activations on WORLD processes, against the
uncompressed control of tests/strategies/parity.py (the test runs the control in its own process).

    compression_worker.py OUT DIR   rank 0 writes {run name: {"losses", "weights", ...}} to OUT, and under
                                    "resumed without state" the warnings of a PowerSGD run resumed from a
                                    checkpoint (in DIR) that an uncompressed run saved
    compression_worker.py --mesh OUT    on 4 processes: bf16 reductions over dp=2 under tp=2 and under pp=2
                                    (data parallelism on FSDP2 beside the other axes), with the reduce dtypes the
                                    FSDP units were given

ZeRO-1 with bf16 reductions and 2 micro-batches also records, after the first micro-batch's backward (gradients
waiting for the reduction), the dtypes FSDP2 keeps them in: meshlight keeps them fp32.
"""

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.fsdp import FSDPModule

import meshlight as ml
from meshlight.callbacks import ActivationCheckpointing, ActivationCompression
from meshlight.parallel import GradientCompression
from tests.strategies.parity import train

WORLD = 2
# name -> (strategy, Trainer arguments (and parity.train's data_parallel)[, callbacks])
RUNS: dict[str, tuple[Any, ...]] = {
    "ddp/bf16": (lambda: ml.DDPStrategy(grad_compression="bf16"), {}),
    "ddp/fp16": (lambda: ml.DDPStrategy(grad_compression="fp16"), {}),
    "zero1/bf16/accumulate": (lambda: ml.ZeroStrategy(1, grad_compression="bf16"), {"accumulate_grad_batches": 2}),
    "zero2/bf16/accumulate": (lambda: ml.ZeroStrategy(2, grad_compression="bf16"), {"accumulate_grad_batches": 2}),
    "zero3/bf16": (lambda: ml.ZeroStrategy(3, grad_compression="bf16"), {}),
    # several buckets: gloo would run their factors' all-reduces in different orders on different ranks
    "ddp/powersgd": (lambda: ml.DDPStrategy(grad_compression=GradientCompression("powersgd", rank=2, start_step=3),
                                            bucket_cap_mb=0.04), {}),
    # saved activations compressed: DTensors under tensor parallelism; a recomputed block's inputs under ZeRO-3
    "tp/activations-bf16": (lambda: "tp", {"data_parallel": 1}, lambda: [ActivationCompression("bf16")]),
    "zero3/recompute/activations-fp8": (lambda: "zero3", {}, lambda: [ActivationCheckpointing(),
                                                                        ActivationCompression("fp8_e4m3")]),
}


MESH_RUNS = {
    "tp2xdp2/bf16": (lambda: ml.TensorParallelStrategy(tp=2, grad_compression="bf16"), 2),
    "pp2xdp2/bf16": (lambda: ml.PipelineStrategy(pp=2, microbatches=2, grad_compression="bf16"), 2),
}  # name -> (strategy, data-parallel size)


def fsdp_params(trainer: pl.Trainer) -> list[Any]:
    """FSDP2's per-parameter objects in the trainer's model (private: the touch point under test)."""
    units = [unit for unit in trainer.strategy.model.modules() if isinstance(unit, FSDPModule)]
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
    return [param for group in groups if group is not None for param in group.fsdp_params]


class WaitingGradients(Callback):
    """The dtypes of the gradients FSDP2 holds after the first micro-batch of the second step, and the reduce dtypes
    its units were given."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()
        self.reduce_dtypes: set[str] = set()

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step != 1 or self.dtypes:
            return
        for param in fsdp_params(trainer):
            waiting = param.unsharded_accumulated_grad
            if waiting is None:
                waiting = param._unsharded_param.grad
            self.dtypes.add(str(waiting.dtype) if waiting is not None else "none")
            self.reduce_dtypes.add(str(param.reduce_dtype))


def run(name: str) -> dict[str, Any]:
    strategy, trainer_args, *callbacks = RUNS[name]
    probe = WaitingGradients()
    extra = callbacks[0]() if callbacks else []
    result = train("adamw-3e-3", strategy(), devices=WORLD, callbacks=[probe, *extra], **trainer_args)
    result.pop("module")
    return {**result, "waiting_dtypes": sorted(probe.dtypes)}


def run_on_mesh(name: str) -> dict[str, Any]:
    strategy, dp = MESH_RUNS[name]
    probe = WaitingGradients()
    result = train("adamw-3e-3", strategy(), devices=4, data_parallel=dp, callbacks=[probe])
    result.pop("module")
    return {**result, "reduce_dtypes": sorted(probe.reduce_dtypes)}


def resumed_without_state(directory: Path) -> list[str]:
    """The warnings of a PowerSGD run resumed from a checkpoint of an uncompressed run."""
    train("adamw-3e-3", "ddp", devices=WORLD, save_to=directory / "uncompressed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train("adamw-3e-3", RUNS["ddp/powersgd"][0](), devices=WORLD, max_steps=22,
              ckpt_path=directory / "uncompressed")
    return [str(w.message) for w in caught if "PowerSGD" in str(w.message)]


if __name__ == "__main__":
    if sys.argv[1] == "--mesh":
        results = {name: run_on_mesh(name) for name in MESH_RUNS}
    else:
        results = {name: run(name) for name in RUNS}
        results["resumed without state"] = resumed_without_state(Path(sys.argv[2]))
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[-1] if sys.argv[1] == "--mesh" else sys.argv[1])
