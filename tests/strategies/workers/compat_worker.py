"""torchrun worker: the Lightning-compatibility scenarios under every data-parallel strategy; each rank saves
its own results (predictions differ per rank)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.strategies.compat import run_scenarios

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")

if __name__ == "__main__":
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    results = {name: run_scenarios(name, world, out / name) for name in STRATEGIES}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
