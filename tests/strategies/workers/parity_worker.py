"""torchrun worker: train every data-parallel strategy and variant on this world; rank 0 saves the results."""

import sys

import torch
import torch.distributed as dist

from tests.strategies.parity import train

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
RUNS = [(s, v) for s in STRATEGIES for v in ("adamw", "accumulate", "clip")]
RUNS += [(s, v) for s in ("zero1", "zero3") for v in ("sgd", "adafactor")]

if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {f"{strategy}/{variant}": train(variant, strategy, devices=world) for strategy, variant in RUNS}
    for result in results.values():
        result.pop("module")
    if dist.get_rank() == 0:
        torch.save(results, out)
