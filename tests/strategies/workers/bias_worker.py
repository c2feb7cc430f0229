"""torchrun worker (2 processes): parity with biases at the examples' learning rate (3e-3) — GPT with biases in
every Linear and norm, as ``GPTConfig``'s default, under tp=2, pp=2 (4 blocks, 4 microbatches) and ep=2 (4 experts
in every block, dp=2) — each in fp32 and again in fp64."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig
from tests.strategies.parity import WITHOUT_EXPERT_BIAS, train

DTYPES = ("fp32", "fp64")


def biased_gpt(layers: int = 2, experts: int = 0, dtype: str = "fp32") -> LitGPT:
    moe = MoEConfig(num_experts=experts, aux_loss_coeff=0.0, **WITHOUT_EXPERT_BIAS) if experts else None
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=layers,
                            bias=True, moe=moe)
    module = LitGPT(config, lr=3e-3, warmup_steps=2)
    return module.double() if dtype == "fp64" else module


# layout -> (strategy factory, data-parallel size, model arguments)
LAYOUTS: dict[str, tuple[Callable[[], Any], int, dict[str, int]]] = {
    "tp2": (lambda: ml.TensorParallelStrategy(tp=2), 1, {}),
    "pp2": (lambda: ml.PipelineStrategy(pp=2, microbatches=4), 1, {"layers": 4}),
    "ep2": (lambda: ml.MoEStrategy(ep=2), 2, {"experts": 4}),
}


def model_factory(layout: str, dtype: str) -> Callable[[], LitGPT]:
    return lambda: biased_gpt(**LAYOUTS[layout][2], dtype=dtype)


if __name__ == "__main__":
    results = {}
    for layout, (strategy, dp, _) in LAYOUTS.items():
        for dtype in DTYPES:
            result = train("adamw", strategy(), devices=2, data_parallel=dp, model=model_factory(layout, dtype))
            result.pop("module")
            results[(layout, dtype)] = result
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
