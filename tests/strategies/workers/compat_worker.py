"""torchrun worker: the Lightning-compatibility scenarios under every data-parallel strategy; each rank saves
its own results (predictions differ per rank)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import meshlight as ml
from tests.strategies.compat import run_scenarios

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def reductions() -> dict:
    """MeshStrategy.reduce (what self.log(sync_dist=True) calls) of rank + 1 under each reduce_op, and the
    barriers it issues."""
    strategy, barriers, barrier = ml.DDPStrategy(), [], dist.barrier
    dist.barrier = lambda *args, **kwargs: barriers.append(1) or barrier(*args, **kwargs)
    try:
        value = float(dist.get_rank() + 1)
        out = {op: strategy.reduce(torch.tensor(value), reduce_op=op).item() for op in ("mean", "sum", "max", None)}
        out["mean of integers"] = strategy.reduce(torch.tensor(dist.get_rank() + 1), reduce_op="mean").item()
        large = torch.tensor(100_000_001 + 3 * dist.get_rank())  # beyond float32's exact integers
        out["mean of large integers"] = strategy.reduce(large, reduce_op="mean").item()
    finally:
        dist.barrier = barrier
    return {"values": out, "barriers": len(barriers)}


if __name__ == "__main__":
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    results = {name: run_scenarios(name, world, out / name) for name in STRATEGIES}
    results["reductions"] = reductions()
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
