"""Per-rank bytes of model state, divided by the ZeRO formula for the stage, at two moments.

``after_step``: right after an optimizer step (the classic ZeRO accounting). ``mid_accumulation``: after
the first micro-batch of an ``accumulate_grad_batches=2`` window, when ZeRO-1/2 hold gathered parameters
(and ZeRO-1 full gradients) — their peak. Measured by summing the storages that hold this rank's
parameters (gathered and sharded copies), gradients and optimizer state, each storage once, FSDP's padding
included. Formulas for fp32 AdamW (4 + 4 + 8 bytes per parameter, Ψ parameters, N ranks): DDP 16Ψ,
ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N.

Tensor parallelism (tp = N): this rank's bytes of the weight matrices tensor parallelism shards (the blocks'
Linears, the token embedding, the LM head), and of their gradients after the last step, each divided by their total
bytes / N.

    python benchmarks/memory.py [--nprocs 2 4]      # prints JSON
"""

from __future__ import annotations

from common import is_worker, main_over_world_sizes, report

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MOMENTS = {"after_step": 1, "mid_accumulation": 2}  # moment -> accumulate_grad_batches


def formula_bytes(strategy: str, numel: int, world: int) -> float:
    per_stage = {"ddp": 16 * numel, "zero1": 8 * numel + 8 * numel / world, "zero2": 4 * numel + 12 * numel / world,
                 "zero3": 16 * numel / world}
    return per_stage[strategy]


def worker() -> None:
    import os

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.parallel.tensor_plan import derive_plan

    from common import bench_config, measuring_trainer_options, model_state_bytes

    class StateProbe(Callback):
        def __init__(self, moment: str) -> None:
            self.moment = moment
            self.bytes: dict[str, int] = {}

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: object,
                               batch: object, batch_idx: int) -> None:
            after_step = self.moment == "after_step" and trainer.global_step == 2
            mid_accumulation = self.moment == "mid_accumulation" and trainer.global_step == 1 and batch_idx % 2 == 0
            if not (after_step or mid_accumulation):
                return
            self.bytes = model_state_bytes(trainer, module)

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for name in STRATEGIES:
        for moment, accumulate in MOMENTS.items():
            pl.seed_everything(0, verbose=False)
            module, probe = LitGPT(bench_config()), StateProbe(moment)
            trainer = ml.Trainer(strategy=name, **measuring_trainer_options(world, 2, [probe],
                                                                            accumulate_grad_batches=accumulate))
            trainer.fit(module, RandomTokensDataModule(vocab_size=256, seq_len=64, batch_size=4, train_size=64))
            numel = sum(p.numel() for p in module.parameters())
            measured = sum(probe.bytes.values())
            formula = formula_bytes(name, numel, world)
            results.append({"strategy": name, "world": world, "moment": moment, "parameters": numel,
                            "measured_bytes": measured,
                            "formula_bytes": formula, "ratio": measured / formula, "breakdown": probe.bytes})
    pl.seed_everything(0, verbose=False)
    module = LitGPT(bench_config())
    trainer = ml.Trainer(strategy=ml.TensorParallelStrategy(tp=world), **measuring_trainer_options(world, 1, []))
    trainer.fit(module, RandomTokensDataModule(vocab_size=256, seq_len=64, batch_size=4, train_size=64))
    modules = dict(module.named_modules())
    sharded = [p for name, role in derive_plan(module).items() if role in ("colwise", "rowwise", "embedding", "head")
               for p in [modules[name].weight]]  # row-parallel biases are replicated by design
    local = sum(p.to_local().numel() * p.element_size() for p in sharded)
    total = sum(p.numel() * p.element_size() for p in sharded)
    gradients = sum(p.grad.to_local().numel() * p.grad.element_size() for p in sharded)
    results.append({"strategy": "tp", "world": world, "moment": "after_step", "sharded_layer_bytes": local,
                    "total_sharded_layer_bytes": total, "ratio": local / (total / world),
                    "sharded_layer_gradient_bytes": gradients, "gradient_ratio": gradients / (total / world)})
    report(results)


if __name__ == "__main__":
    worker() if is_worker() else main_over_world_sizes(__file__, __doc__)
