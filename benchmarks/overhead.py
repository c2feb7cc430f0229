"""Step time of meshlight's DDP vs the same training hand-written in plain PyTorch vs Lightning's DDP.

Same model, data, sampler, optimizer (AdamW, two parameter groups, warmup-cosine schedule) and DDP engine
configuration (``gradient_as_bucket_view=True``, meshlight's default) in all three; every step also
all-reduces the loss for logging, as ``self.log(..., sync_dist=True)`` does. The three run interleaved in
one launch, in rotating order, so drift of the machine cancels; a step is the wall time between the starts
of consecutive training steps, the median over all measured steps is reported.

    python benchmarks/overhead.py [--nprocs 2] [--rounds 5] [--steps 12]      # prints JSON
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import is_worker, launch, report

VARIANTS = ("pytorch", "lightning", "meshlight")
WARMUP = 3


def worker(rounds: int, steps: int) -> None:
    import time

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from common import measuring_trainer_options
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy as LightningDDP
    from torch.utils.data import DataLoader, DistributedSampler

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.models import GPTConfig

    config = GPTConfig(vocab_size=256, max_seq_len=128, n_layers=4, n_heads=8, dim=192)
    dist.init_process_group("gloo")  # the hand-written loop needs it first; Lightning reuses it
    world = dist.get_world_size()
    total_steps = WARMUP + steps

    def data() -> RandomTokensDataModule:
        return RandomTokensDataModule(vocab_size=256, seq_len=128, batch_size=8, train_size=8 * world * total_steps)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

    def run_lightning(variant: str) -> list[float]:
        pl.seed_everything(0, verbose=False)
        timer = StepTimer()
        options = measuring_trainer_options(world, total_steps, [timer])
        if variant == "lightning":
            trainer = pl.Trainer(strategy=LightningDDP(gradient_as_bucket_view=True), **options)
        else:
            trainer = ml.Trainer(strategy="ddp", **options)
        trainer.fit(LitGPT(config), data())
        return timer.starts

    def run_pytorch() -> list[float]:
        """The same training, written by hand: DDP, DistributedSampler, AdamW groups, schedule, loss logging."""
        pl.seed_everything(0, verbose=False)
        module = LitGPT(config)  # the same model construction and optimizer recipe, no Trainer
        ddp = torch.nn.parallel.DistributedDataParallel(module.model, gradient_as_bucket_view=True)
        matrices = [p for p in ddp.parameters() if p.dim() >= 2]
        vectors = [p for p in ddp.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
        from meshlight.demos.lit_gpt import _warmup_cosine

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(10, total_steps, 0.1))
        source = data()
        source.setup()
        sampler = DistributedSampler(source.train_set, shuffle=True, seed=0)
        loader = DataLoader(source.train_set, batch_size=8, sampler=sampler, drop_last=True)
        starts = []
        for inputs, targets in loader:
            starts.append(time.perf_counter())
            loss = module.model.loss(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # what sync_dist logging does
        starts.append(time.perf_counter())
        return starts

    step_times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(rounds):
        order = VARIANTS[round_index % 3:] + VARIANTS[: round_index % 3]
        for variant in order:
            dist.barrier()
            starts = run_pytorch() if variant == "pytorch" else run_lightning(variant)
            step_times[variant] += [b - a for a, b in zip(starts[WARMUP:], starts[WARMUP + 1:])]
    median = {variant: statistics.median(times) for variant, times in step_times.items()}
    report({
        "world": world, "rounds": rounds, "steps_per_round": steps,
        "median_step_seconds": median,
        "meshlight_over_pytorch": median["meshlight"] / median["pytorch"],
        "meshlight_over_lightning": median["meshlight"] / median["lightning"],
        "lightning_over_pytorch": median["lightning"] / median["pytorch"],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print(json.dumps(launch(__file__, args.nprocs, str(args.rounds), str(args.steps)), indent=1))


if __name__ == "__main__":
    import sys

    worker(int(sys.argv[1]), int(sys.argv[2])) if is_worker() else main()
