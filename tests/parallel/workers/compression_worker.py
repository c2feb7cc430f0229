"""torchrun worker: training with compressed gradient reductions or saved activations on WORLD processes, against the
uncompressed control of tests/strategies/parity.py (the test runs the control in its own process).

    compression_worker.py OUT DIR   rank 0 writes {run name: {"losses", "weights", ...}} to OUT, and under
                                    "resumed without state" the warnings of a PowerSGD run resumed from a
                                    checkpoint (in DIR) that an uncompressed run saved
    compression_worker.py --mesh OUT    on 4 processes: bf16 reductions over dp=2 under tp=2 and under pp=2
                                    (data parallelism on FSDP2 beside the other axes) and over the dense and the
                                    expert weights under ep=2, with the reduce dtypes the FSDP units were given

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
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule

import meshlight as ml
from meshlight.callbacks import ActivationCheckpointing, ActivationCompression
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig
from meshlight.parallel import GradientCompression
from tests.strategies.parity import WITHOUT_EXPERT_BIAS, train
from tests.strategies.workers.moe_worker import EXPERTS

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
    # a torch communication hook given as it is: torch's plain all-reduce hook, with the data-parallel group as state
    "ddp/torch-hook": (lambda: ml.DDPStrategy(grad_compression=allreduce_hook), {}),
    # saved activations compressed: DTensors under tensor parallelism; a recomputed block's inputs under ZeRO-3
    "tp/activations-bf16": (lambda: "tp", {"data_parallel": 1}, lambda: [ActivationCompression("bf16")]),
    "zero3/recompute/activations-fp8": (lambda: "zero3", {}, lambda: [ActivationCheckpointing(),
                                                                        ActivationCompression("fp8_e4m3")]),
}


MESH_RUNS = {
    "tp2xdp2/bf16": (lambda: ml.TensorParallelStrategy(tp=2, grad_compression="bf16"), 2, None),
    "pp2xdp2/bf16": (lambda: ml.PipelineStrategy(pp=2, microbatches=2, grad_compression="bf16"), 2, None),
    # experts over ep=2 are data parallel over the 2 ranks holding the same ones, the dense weights over all 4
    "moe ep2/bf16": (lambda: ml.MoEStrategy(ep=2, grad_compression="bf16"), 4, True),
}  # name -> (strategy, data-parallel size, whether the model is moe_model's (else parity's GPT-tiny))


def moe_model() -> LitGPT:
    """GPT-tiny with MoE blocks at the learning rate of 3e-3: at 1e-2 (the MoE parity runs') routing is chaotic
    enough that bf16's rounding moves a token to another expert by step 3, and the curves part."""
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2, bias=False,
                            moe=MoEConfig(num_experts=EXPERTS, **WITHOUT_EXPERT_BIAS))
    return LitGPT(config, lr=3e-3, warmup_steps=2)


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
    strategy, dp, moe = MESH_RUNS[name]
    probe = WaitingGradients()
    model = moe_model if moe else None
    result = train("adamw-3e-3", strategy(), devices=4, data_parallel=dp, callbacks=[probe], model=model)
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
