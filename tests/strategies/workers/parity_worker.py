"""torchrun worker: train every data-parallel strategy and variant on this world; rank 0 saves the results,
with the collectives of one optimizer step of each strategy's AdamW run. Besides the named strategies: HSDP (ZeRO-3
sharded within groups of world/2 ranks, replicated across the 2 groups) and a model that applies FSDP2 itself in
``configure_model`` (the strategy then applies none)."""

import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import meshlight as ml
from meshlight.demos import LitGPT
from meshlight.parallel import CollectiveTraffic, repeated_blocks
from tests.strategies.parity import make_model, train

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
RUNS = [(s, v) for s in STRATEGIES for v in ("adamw", "accumulate", "clip")]
RUNS += [(s, v) for s in ("zero1", "zero3") for v in ("sgd", "adafactor")]
RUNS += [("hsdp", "adamw"), ("own fsdp", "adamw")]
MEASURED_STEP = 3  # after lazy initialization


def runs(world: int) -> list[tuple[str, str]]:
    """On 2 processes every run; on 4 those whose traffic and optimizer-state shares are measured (they change with
    the world size), HSDP's and the model's own sharding: the optimizers and clipping are 2 processes' concern."""
    return RUNS if world == 2 else [run for run in RUNS if run[1] in ("adamw", "accumulate")]


class OwnShardingGPT(LitGPT):
    """A LightningModule sharding itself with FSDP2 over the strategy's data-parallel mesh, block by block."""

    def configure_model(self) -> None:
        if any(isinstance(m, FSDPModule) for m in self.modules()):
            return
        mesh = self.device_mesh["dp"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def strategy_of(name: str) -> Any:
    if name == "hsdp":
        return ml.ZeroStrategy(3, dp_replicate=2)
    return "zero3" if name == "own fsdp" else name


class StepTraffic(Callback):
    """The collectives issued during optimizer step ``MEASURED_STEP`` (forward, backward of each of its
    ``micro_batches`` and the optimizer step), and the bytes of optimizer state this rank holds after training."""

    def __init__(self, micro_batches: int = 1) -> None:
        self.traffic = CollectiveTraffic()
        self.micro_batches = micro_batches
        self.optimizer_state_bytes = 0

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, index: int) -> None:
        if index == MEASURED_STEP * self.micro_batches:
            self.traffic.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
        if index == MEASURED_STEP * self.micro_batches + self.micro_batches - 1:
            self.traffic.__exit__(None, None, None)

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        values = [value for optimizer in trainer.optimizers for state in optimizer.state.values()
                  for value in state.values() if torch.is_tensor(value)]
        locals_ = [value.to_local() if isinstance(value, DTensor) else value for value in values]
        self.optimizer_state_bytes = sum(t.numel() * t.element_size() for t in locals_ if t.dim())  # not step counts


def run(strategy: str, variant: str, world: int) -> dict[str, Any]:
    probe = StepTraffic(micro_batches=2 if variant == "accumulate" else 1)
    measured = variant in ("adamw", "accumulate")
    own = strategy == "own fsdp"
    model = (lambda: OwnShardingGPT(make_model(variant).config, lr=1e-2, warmup_steps=2)) if own else None
    result = train(variant, strategy_of(strategy), devices=world, callbacks=[probe] if measured else [], model=model)
    module = result.pop("module")
    # the strategy applied no data parallelism of its own over the model's (FSDP units: the model's own)
    result["fsdp_units"] = sorted(name for name, m in module.named_modules() if isinstance(m, FSDPModule))
    if measured:
        blocks = [p for block in repeated_blocks(module) for p in block.parameters()]
        result.update(traffic=probe.traffic.summary(), blocks=len(repeated_blocks(module)),
                      optimizer_state_bytes=probe.optimizer_state_bytes,
                      param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
                      block_bytes=sum(p.numel() * p.element_size() for p in blocks))
    return result


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {f"{strategy}/{variant}": run(strategy, variant, world) for strategy, variant in runs(world)}
    if dist.get_rank() == 0:
        torch.save({**results, "world": world}, out)
