"""Bytes each rank sends per optimizer step, per data-parallel strategy, divided by the theoretical minimum.

Counted by instrumenting the collectives actually issued during one training step (after warm-up) with
``meshlight.parallel.CollectiveTraffic``, at bandwidth-optimal cost per collective. Theory, with P the
parameter bytes and N ranks: DDP, ZeRO-1 and ZeRO-2 move 2·P·(N−1)/N (all-reduce, or reduce-scatter +
all-gather); ZeRO-3 3·P·(N−1)/N (parameters gathered again in backward). For reference, Lightning's DDP
with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1 the way Lightning users get it today) is
measured against the same 2·P·(N−1)/N.

    python benchmarks/comm.py [--nprocs 2 4]      # prints JSON
"""

from __future__ import annotations

from common import is_worker, main_over_world_sizes, report

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "lightning-ddp+ZeroRedundancyOptimizer")
MEASURED_STEP = 2  # after DDP's bucket rebuild and FSDP's lazy initialization


def worker() -> None:
    import os

    import lightning.pytorch as pl
    import torch
    from common import bench_config, measuring_trainer_options
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.parallel import CollectiveTraffic

    class ZeroRedundancyGPT(LitGPT):
        def configure_optimizers(self):  # noqa: ANN202
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

    class TrafficProbe(Callback):
        def __init__(self) -> None:
            self.traffic = CollectiveTraffic()

        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == MEASURED_STEP:
                self.traffic.__enter__()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == MEASURED_STEP + 1:
                self.traffic.__exit__(None, None, None)

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for name in STRATEGIES:
        pl.seed_everything(0, verbose=False)
        lightning_zero = name.startswith("lightning")
        module = (ZeroRedundancyGPT if lightning_zero else LitGPT)(bench_config())
        probe = TrafficProbe()
        trainer_cls = pl.Trainer if lightning_zero else ml.Trainer
        trainer = trainer_cls(strategy="ddp" if lightning_zero else name,
                              **measuring_trainer_options(world, MEASURED_STEP + 1, [probe]))
        trainer.fit(module, RandomTokensDataModule(vocab_size=256, seq_len=64, batch_size=4, train_size=64))
        param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        theory = (3 if name == "zero3" else 2) * param_bytes * (world - 1) / world
        results.append({
            "strategy": name, "world": world, "param_bytes": param_bytes, "bytes_sent": probe.traffic.bytes_sent,
            "theory_bytes": theory, "ratio": probe.traffic.bytes_sent / theory,
            "by_collective": probe.traffic.summary(),
        })
    report(results)


if __name__ == "__main__":
    worker() if is_worker() else main_over_world_sizes(__file__, __doc__)
