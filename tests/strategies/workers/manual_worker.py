"""torchrun worker (4 processes): manual optimization (``automatic_optimization=False``: the step calls
``manual_backward``, steps the optimizer and the LR scheduler itself) under tensor parallelism, expert parallelism
and 3-D without pipelining; rank 0 writes {run: result of tests/strategies/parity.py's ``train``} to OUT, and under
"pipeline" the error a pipelined layout raises."""

import sys
from typing import Any

import torch
import torch.distributed as dist

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig
from tests.strategies.parity import WITHOUT_EXPERT_BIAS, make_model, train

WORLD = 4


class ManualGPT(LitGPT):
    """LitGPT stepping its optimizer and LR scheduler by hand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        return loss


def model(moe: bool = False, cls: type[LitGPT] = LitGPT) -> LitGPT:
    """The parity model (or, ``moe``, tests/strategies/workers/moe_worker.py's), as a ``cls``."""
    config = make_model("adamw").config
    if moe:
        config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2,
                                bias=False, moe=MoEConfig(num_experts=8, **WITHOUT_EXPERT_BIAS))
    return cls(config, lr=1e-2, warmup_steps=2)


def manual(moe: bool = False) -> LitGPT:
    return model(moe, ManualGPT)


# name -> (strategy, data-parallel size, MoE model)
RUNS = {
    "tp2xdp2": (lambda: ml.TensorParallelStrategy(tp=2), 2, False),
    "moe ep2": (lambda: ml.MoEStrategy(ep=2), 4, True),
    "3d dp2 tp2": (lambda: ml.Hybrid3DStrategy(dp=2, pp=1, tp=2), 2, False),
}


def pipelined() -> str:
    try:
        train("adamw", ml.PipelineStrategy(pp=2, microbatches=2), devices=WORLD, data_parallel=2, model=manual)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


if __name__ == "__main__":
    results: dict[str, Any] = {}
    for name, (strategy, dp, moe) in RUNS.items():
        result = train("adamw", strategy(), devices=WORLD, data_parallel=dp, model=lambda moe=moe: manual(moe))
        result.pop("module")
        results[name] = result
    results["pipeline"] = pipelined()
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
