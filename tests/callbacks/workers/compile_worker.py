"""torchrun worker (2 processes): the parity experiment with every block compiled, under each kind of layout;
rank 0 writes {run: result} to OUT (losses, full weights, and whether every block of the parallelized model runs
compiled code). ``torch.compile`` uses the ``aot_eager`` backend here (Dynamo's capture and AOTAutograd's
traced backward, without generating kernels: this machine's budget); the inductor backend is tested on one
process in test_compile.py."""

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import meshlight as ml
from meshlight.callbacks import ActivationCheckpointing, Compile
from meshlight.parallel.blocks import repeated_blocks
from tests.strategies.llama import LitLlama
from tests.strategies.parity import train
from tests.strategies.workers.hybrid_worker import moe_gpt4


class CompiledBlocks(Callback):
    """Whether every block of the model the strategy runs has a compiled ``forward``, and how many frames
    Dynamo captured while training."""

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        blocks = [b for stage in _stages(trainer) for b in repeated_blocks(stage)]
        self.compiled = bool(blocks) and all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks)
        self.frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _stages(trainer: pl.Trainer) -> list[torch.nn.Module]:
    pipeline = trainer.strategy.pipeline
    return pipeline.stage_modules if pipeline is not None else [trainer.lightning_module]


def run(strategy: Any, *callbacks: Callback, compiled: bool = True, model: Any = None, data_parallel: int = 0,
        ) -> dict[str, Any]:
    torch._dynamo.reset()  # a fresh cache per run: no run leans on another's compilation
    torch._dynamo.utils.counters.clear()
    probe = CompiledBlocks()
    extra = [Compile(backend="aot_eager"), probe] if compiled else []
    result = train("adamw" if model is None else "adamw-3e-3", strategy, devices=int(os.environ["WORLD_SIZE"]),
                   callbacks=[*callbacks, *extra], model=model, data_parallel=data_parallel)
    result.pop("module")
    if compiled:
        result.update(compiled=probe.compiled, frames=probe.frames)
    return result


if __name__ == "__main__":
    out = sys.argv[1]
    results = {
        "ddp": run("ddp"),
        "zero3 recompute": run("zero3", ActivationCheckpointing()),
        "tp": run(ml.TensorParallelStrategy(tp=2), data_parallel=1),
        # its first block's input is the token embedding's to_local() view, whose gradient compiled code lost
        "tp llama": run(ml.TensorParallelStrategy(tp=2), data_parallel=1, model=LitLlama),
        "pipeline": run(ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=2), data_parallel=1),
        "moe": run(ml.MoEStrategy(ep=2, zero=1), model=moe_gpt4),
        "moe eager": run(ml.MoEStrategy(ep=2, zero=1), compiled=False, model=moe_gpt4),
    }
    if dist.get_rank() == 0:
        torch.save(results, out)
