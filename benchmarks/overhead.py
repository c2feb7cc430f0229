"""Step time per strategy: meshlight vs the same training written by hand in plain PyTorch on the same engines vs
Lightning's built-in strategy where one exists.

Same model (4-block GPT, dim 192, seq 128; 4 experts per block for moe), data, sampler, optimizer (AdamW, two
parameter groups, warmup-cosine schedule) everywhere; every step also all-reduces the loss for logging, as
``self.log(..., sync_dist=True)`` does. Per strategy:

========= ================================================== =============================================
strategy  hand-written PyTorch                               Lightning
========= ================================================== =============================================
ddp       ``DistributedDataParallel``                        ``DDPStrategy``
zero3     ``fully_shard`` per block and root                 ``ModelParallelStrategy``, the same calls in
                                                             ``configure_model``
tp        meshlight's plan through ``parallelize_module``    ``ModelParallelStrategy``, the same plan in
          (SP, loss parallel)                                ``configure_model``
pipeline  meshlight's split + ``PipelineStage`` +            —
          ``Schedule1F1B`` (4 microbatches)
moe       ``meshlight.parallel.parallelize`` (ep = 2, the    —
          same dispatch, ZeRO-1) + a plain loop
loop      as ddp, on a 1-block GPT of dim 16 (seq 16,        as ddp
          batch 4): a step that is almost all loop, whose
          differences are the loops' own cost per step
========= ================================================== =============================================

DDP keeps meshlight's ``gradient_as_bucket_view=True`` in all three. The hand-written loops manage Python's garbage
collector as meshlight does (and torchtitan): automatic collection off while training, generation 1 collected
every 50 steps; Lightning keeps the automatic one, its default. The variants of a strategy run interleaved in one
launch: a round runs each once, back to back, and the order rotates so that over ``--rotations`` each variant has
run first that many times (2 or 3 variants: rounds = rotations × variants). A step is the wall time between the
starts of consecutive training steps. Reported per variant the median over all measured steps; per pair the ratio
of the two variants' medians in each round (paired in time, so the machine's drift cancels) and the median of those
ratios, the figure; their spread is the machine's noise. Beside it, the ratio of the two variants' lower deciles
over all their measured steps: load from outside the benchmark (this VM's neighbours) only ever adds time, so the
fastest tenth of steps shows what each variant costs on a quiet machine, and what is ours (a per-step cost) is in
every step, the fastest included.

    python benchmarks/overhead.py [--nprocs 2] [--strategies ddp zero3 tp pipeline moe loop] [--rotations 2] [--steps 8]
                                  [--variants pytorch lightning meshlight]
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import is_worker, launch, report

STRATEGIES = ("ddp", "zero3", "tp", "pipeline", "moe", "loop")
LIGHTNING = ("ddp", "zero3", "tp", "loop")  # where Lightning has a built-in strategy for it
WARMUP = 2  # steps before the measured ones (the first builds lazily initialized state)
BATCH = 8  # sequences per data-parallel replica
MICROBATCHES = 4  # pipeline, 1F1B
GC_EVERY_N_STEPS = 50  # meshlight's default


def worker(name: str, rotations: int, steps: int, only: tuple[str, ...] = ()) -> None:
    import gc
    import time
    from contextlib import ExitStack, nullcontext

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from common import measuring_trainer_options
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy as LightningDDP
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils.data import DataLoader, DistributedSampler

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.demos.lit_gpt import _warmup_cosine
    from meshlight.models import GPTConfig
    from meshlight.nn import MoEConfig
    from meshlight.parallel import ParallelLayout, build_device_mesh, parallelize
    from meshlight.parallel.pipeline import plan_stages, split_stages
    from meshlight.parallel.tensor import apply_tensor_parallel
    from meshlight.parallel.tensor_plan import model_plan

    strategy = "ddp" if name == "loop" else name  # the engines; "loop" measures them on a tiny model
    moe = MoEConfig(num_experts=4) if strategy == "moe" else None
    vocab, seq, batch, shape = (64, 16, 4, dict(n_layers=1, n_heads=2, dim=16)) if name == "loop" else (
        256, 128, BATCH, dict(n_layers=4, n_heads=8, dim=192))
    config = GPTConfig(vocab_size=vocab, max_seq_len=seq, moe=moe, **shape)
    dist.init_process_group("gloo")  # the hand-written loops need it first; the Trainers reuse it
    world = dist.get_world_size()
    replicas = 1 if strategy in ("tp", "pipeline") else world
    total_steps = WARMUP + steps

    def data() -> RandomTokensDataModule:
        return RandomTokensDataModule(vocab_size=vocab, seq_len=seq, batch_size=batch,
                                      train_size=batch * replicas * total_steps)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

    class LitFSDP(LitGPT):
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    class LitTP(LitGPT):
        def configure_model(self) -> None:
            apply_tensor_parallel(self.model, self.device_mesh["tensor_parallel"], model_plan(self.model))

        def on_train_start(self) -> None:  # cross-entropy on sharded logits, forward and backward
            self._loss_parallel = ExitStack()
            self._loss_parallel.enter_context(loss_parallel())

        def on_train_end(self) -> None:
            self._loss_parallel.close()

    def run_trainer(variant: str) -> list[float]:
        pl.seed_everything(0, verbose=False)
        timer = StepTimer()
        options = measuring_trainer_options(world, total_steps, [timer])
        module = LitGPT(config)
        if variant == "meshlight":
            chosen = ml.PipelineStrategy(pp=world, microbatches=MICROBATCHES) if strategy == "pipeline" else strategy
            trainer = ml.Trainer(strategy=chosen, **options)
        elif strategy == "ddp":
            trainer = pl.Trainer(strategy=LightningDDP(gradient_as_bucket_view=True), **options)
        else:
            module = (LitFSDP if strategy == "zero3" else LitTP)(config)
            size = {"data_parallel_size": world, "tensor_parallel_size": 1} if strategy == "zero3" else {
                "data_parallel_size": 1, "tensor_parallel_size": world}
            trainer = pl.Trainer(strategy=ModelParallelStrategy(**size), **options)
        trainer.fit(module, data())
        return timer.starts

    def run_pytorch() -> list[float]:
        """The same training, written by hand on the same engines."""
        pl.seed_everything(0, verbose=False)
        module = LitGPT(config)  # the same model construction and optimizer recipe, no Trainer
        model, forward, context, schedule = module.model, None, nullcontext(), None
        if strategy == "ddp":
            forward = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        elif strategy == "zero3":
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            forward = fully_shard(model, mesh=mesh)
        elif strategy == "tp":
            apply_tensor_parallel(model, init_device_mesh("cpu", (world,)), model_plan(model))
            forward, context = model, loss_parallel()
        elif strategy == "pipeline":
            rank = dist.get_rank()
            (stage,) = split_stages(model, plan_stages(model, "blocks", world), [rank])
            model = stage  # the optimizer sees this rank's pieces only
            schedule = Schedule1F1B(PipelineStage(stage, rank, world, torch.device("cpu")),
                                    n_microbatches=MICROBATCHES, loss_fn=module.model.loss)
        else:  # moe: experts over ep = world, ZeRO-1 over the dense weights (meshlight's "moe" layout)
            layout = ParallelLayout.for_world(world, dp_shard="auto", ep=world, zero=1)
            forward = parallelize(model, layout, build_device_mesh(layout, "cpu"))
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
        from meshlight.nn import attach_moe_updates  # here: benchmarks/paired_commits.py runs older meshlights

        attach_moe_updates(optimizer, model)  # the MoE layers' load all-reduce after each step, as meshlight runs it
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(10, total_steps, 0.1))
        source = data()
        source.setup()
        sampler = DistributedSampler(source.train_set, num_replicas=replicas, rank=dist.get_rank() % replicas,
                                     shuffle=True, seed=0)
        loader = DataLoader(source.train_set, batch_size=batch, sampler=sampler, drop_last=True)
        starts = []
        gc.disable()  # as meshlight (and torchtitan) do while training
        gc.collect(1)
        with context:
            for inputs, targets in loader:
                starts.append(time.perf_counter())
                if len(starts) % GC_EVERY_N_STEPS == 0:
                    gc.collect(1)
                if schedule is not None:
                    losses: list[torch.Tensor] = []
                    if dist.get_rank() == 0:
                        schedule.step(inputs)
                        loss = torch.zeros(())
                    else:
                        schedule.step(target=targets, losses=losses)
                        loss = torch.stack(losses).mean()
                else:
                    loss = module.model.loss(forward(inputs), targets)
                    loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                logged = loss.detach().clone()
                dist.all_reduce(logged)  # what sync_dist logging does (the pipeline: the last stage's loss)
        starts.append(time.perf_counter())
        gc.collect()
        gc.enable()
        return starts

    variants = ("pytorch", "lightning", "meshlight") if name in LIGHTNING else ("pytorch", "meshlight")
    variants = tuple(v for v in variants if v in only) if only else variants
    step_times: dict[str, list[float]] = {variant: [] for variant in variants}
    round_medians: list[dict[str, float]] = []
    rounds = rotations * len(variants)
    for round_index in range(rounds):
        shift = round_index % len(variants)
        medians = {}
        for variant in variants[shift:] + variants[:shift]:
            dist.barrier()
            starts = run_pytorch() if variant == "pytorch" else run_trainer(variant)
            times = [b - a for a, b in zip(starts[WARMUP:], starts[WARMUP + 1:])]
            step_times[variant] += times
            medians[variant] = statistics.median(times)
        round_medians.append(medians)
    median = {variant: statistics.median(times) for variant, times in step_times.items()}
    result = {"strategy": name, "world": world, "rotations": rotations, "rounds": rounds, "steps_per_round": steps,
              "median_step_seconds": median, "round_ratios": {}, "lower_decile_ratios": {}}
    lower_decile = {variant: statistics.quantiles(times, n=10)[0] for variant, times in step_times.items()}
    for over in variants[:-1]:  # meshlight ÷ each other variant, and Lightning ÷ PyTorch
        for numerator in ("meshlight", "lightning"):
            if numerator in median and numerator != over:
                key = f"{numerator}_over_{over}"
                ratios = [r[numerator] / r[over] for r in round_medians]
                result[key], result["round_ratios"][key] = statistics.median(ratios), ratios
                result["lower_decile_ratios"][key] = lower_decile[numerator] / lower_decile[over]
    report(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--rotations", type=int, default=2, help="times each variant runs first")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", nargs="+", choices=("pytorch", "lightning", "meshlight"), default=[],
                        help="run only these (default: all)")
    args = parser.parse_args()
    rows = [launch(__file__, args.nprocs, name, str(args.rotations), str(args.steps), *args.variants)
            for name in args.strategies]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    import sys

    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), tuple(sys.argv[4:])) if is_worker() else main()
