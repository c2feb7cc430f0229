"""Hugging Face causal LMs of every dense family trained under each layout named, all in one launch of 2 processes;
rank 0 saves each run's losses and full final weights to ``OUT/<layout>-<family>.pt``.

    python tests/forkrun.py 2 tests/strategies/workers/hf_worker.py OUT tp2 ddp zero3
"""

import sys
from pathlib import Path

import torch

import meshlight as ml
from tests.strategies import parity
from tests.strategies.hf_models import FAMILIES, LitCausalLM, training_options

# name -> (the strategy, data-parallel replicas of the 2 processes)
LAYOUTS = {
    "tp2": (lambda: ml.TensorParallelStrategy(tp=2), 1),
    "ddp": (lambda: "ddp", 2),
    "zero3": (lambda: ml.ZeroStrategy(stage=3), 2),
}


def main(out: Path, layouts: list[str]) -> None:
    for layout in layouts:
        strategy, replicas = LAYOUTS[layout]
        for family in FAMILIES:
            result = parity.train("adamw", strategy=strategy(), devices=2, data_parallel=replicas,
                                  model=lambda family=family: LitCausalLM(family, **training_options(family)))
            result.pop("module")
            if torch.distributed.get_rank() == 0:
                torch.save(result, out / f"{layout}-{family}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
