"""torchrun worker: train every data-parallel strategy and variant on this world; rank 0 saves the results,
with the collectives of one optimizer step of each strategy's AdamW run."""

import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from meshlight.parallel import CollectiveTraffic, repeated_blocks
from tests.strategies.parity import train

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
RUNS = [(s, v) for s in STRATEGIES for v in ("adamw", "accumulate", "clip")]
RUNS += [(s, v) for s in ("zero1", "zero3") for v in ("sgd", "adafactor")]
MEASURED_STEP = 3  # after lazy initialization


class StepTraffic(Callback):
    """The collectives issued during batch ``MEASURED_STEP`` (forward, backward and optimizer step)."""

    def __init__(self) -> None:
        self.traffic = CollectiveTraffic()

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, index: int) -> None:
        if index == MEASURED_STEP:
            self.traffic.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
        if index == MEASURED_STEP:
            self.traffic.__exit__(None, None, None)


def run(strategy: str, variant: str, world: int) -> dict[str, Any]:
    probe = StepTraffic()
    result = train(variant, strategy, devices=world, callbacks=[probe] if variant == "adamw" else [])
    module = result.pop("module")
    if variant == "adamw":
        blocks = [p for block in repeated_blocks(module) for p in block.parameters()]
        result.update(traffic=probe.traffic.summary(), blocks=len(repeated_blocks(module)),
                      param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
                      block_bytes=sum(p.numel() * p.element_size() for p in blocks))
    return result


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {f"{strategy}/{variant}": run(strategy, variant, world) for strategy, variant in RUNS}
    if dist.get_rank() == 0:
        torch.save({**results, "world": world}, out)
