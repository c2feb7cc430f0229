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
tp        a torchtitan-style plan through                    ``ModelParallelStrategy``, the same plan in
          ``parallelize_module`` (sequence and loss          ``configure_model``
          parallel), the norms' partial gradients summed in
          one all-reduce
pipeline  the GPT cut in place (other stages' blocks,        —
          embedding or norm and head made pass-throughs) +
          ``PipelineStage`` + ``Schedule1F1B`` (4
          microbatches)
moe       experts ``Shard(0)`` over every process, tokens    —
          exchanged by ``all_to_all_single`` through the
          MoE layer's ``dispatcher``; dense weights
          ``fully_shard`` with ``reshard_after_forward=False``
          (ZeRO-1 as meshlight runs it) + a plain loop
loop      as ddp, on a 1-block GPT of dim 16 (seq 16,        as ddp
          batch 4): a step that is almost all loop, whose
          differences are the loops' own cost per step
========= ================================================== =============================================

The hand-written parallelism uses PyTorch's public APIs only, nothing of ``meshlight.parallel``: the model
(``meshlight.models.GPT`` in ``LitGPT``), the data and the schedule are what is measured. The moe baseline leaves
out the MoE layers' load all-reduce after each step that meshlight runs (``meshlight.nn.attach_moe_updates``).
``first_losses``: each variant's loss at the first steps of its first round, the same within float noise.

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
CHECKED_STEPS = 3  # first steps whose losses are reported, to show the variants compute the same thing


def tensor_parallel(model, mesh) -> None:  # noqa: ANN001 - a meshlight GPT, a 1-D DeviceMesh
    """torchtitan's plan for meshlight's GPT on ``mesh``: Megatron-LM's column→row pairs, sequence parallelism from
    the token embedding's output to the LM head's input, logits left sharded over the vocabulary for loss
    parallelism. Attention reshapes heads with -1, so it runs on this rank's heads unchanged."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "embed.tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # learned positions: whole on every rank, each adds its share of the sequence's (the backward gathers them)
        "embed.positions": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.blocks)):
        block = f"blocks.{index}"
        plan.update({
            f"{block}.attn_norm": SequenceParallel(),
            f"{block}.attn": PrepareModuleInput(input_layouts=(Shard(1), None),  # (x, rope)
                                                desired_input_layouts=(Replicate(), None)),
            **{f"{block}.attn.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")},
            f"{block}.attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"{block}.mlp_norm": SequenceParallel(),
            f"{block}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{block}.mlp.w1": ColwiseParallel(),
            f"{block}.mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    parallelize_module(model, mesh, plan)


def sum_partial_gradients(model) -> None:  # noqa: ANN001 - a model under tensor_parallel
    """The norms' gradients, partial sums over the sequence shares, summed in one all-reduce (tp = the world)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    partial = [p for p in model.parameters() if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()]
    flat = torch.cat([p.grad.to_local().flatten() for p in partial])
    dist.all_reduce(flat)
    for param, values in zip(partial, flat.split([p.numel() for p in partial])):
        param.grad = DTensor.from_local(values.view(param.shape), param.device_mesh, [Replicate()], run_check=False)


def pipeline_stage(model, rank: int, stages: int):  # noqa: ANN001, ANN201 - a meshlight GPT, cut in place
    """This rank's stage of meshlight's GPT, whose forward is the chain embed → blocks → norm → head: its share of
    the blocks (halves at 2 stages, as meshlight balances them), the embedding on the first stage, norm and head on
    the last; the other pieces pass their first argument on."""
    from torch import nn

    class PassThrough(nn.Module):
        def forward(self, x, *args):  # noqa: ANN001, ANN002, ANN202
            return x

    per_stage = len(model.blocks) // stages
    for index in range(len(model.blocks)):
        if index // per_stage != rank:
            model.blocks[index] = PassThrough()
    if rank > 0:
        model.embed = PassThrough()
    if rank < stages - 1:
        model.norm, model.head = PassThrough(), PassThrough()
    return model


def expert_parallel(model, mesh) -> set:  # noqa: ANN001 - a meshlight GPT with MoE blocks, a 1-D DeviceMesh
    """Split every MoE layer's stacked experts over ``mesh`` (this rank keeps ``E / world`` of them) and send each
    token to its expert's rank and back by all-to-all. Returns the expert parameters (no other rank holds them)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.nn.functional import all_to_all_single
    from torch.distributed.tensor import Shard, distribute_tensor

    ranks = mesh.size()

    def dispatch(tokens, counts, experts):  # noqa: ANN001, ANN202 - the MoE layer's dispatcher
        # tokens sorted by expert, counts[e] of them for expert e; rank r holds experts r·L … r·L + L - 1
        send = counts.view(ranks, -1)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send)  # the split sizes, known on the host before the tokens travel
        send_splits, receive_splits = send.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_single(tokens.new_empty(sum(receive_splits), tokens.shape[1]), tokens,
                                    receive_splits, send_splits)
        local = torch.arange(send.shape[1]).repeat(ranks).repeat_interleave(received.flatten())
        order = local.argsort(stable=True)  # arrived by source rank, then expert: the experts want them by expert
        out = experts(arrived[order], received.sum(0))[order.argsort()]
        return all_to_all_single(out.new_empty(sum(send_splits), out.shape[1]), out, send_splits, receive_splits)

    held = set()
    for block in model.blocks:
        moe = block.mlp
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            shard = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
            # an expert's gradient collects the tokens of every rank; data parallelism averages the dense ones
            shard.register_hook(lambda grad: grad / ranks)
            setattr(moe.experts, name, shard)
            held.add(shard)
        moe.dispatcher = dispatch
    return held


def worker(name: str, rotations: int, steps: int, only: tuple[str, ...] = ()) -> None:
    import gc
    import time
    from contextlib import ExitStack, nullcontext

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy as LightningDDP
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils.data import DataLoader, DistributedSampler

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.demos.lit_gpt import _warmup_cosine
    from meshlight.models import GPTConfig
    from meshlight.nn import MoEConfig

    from common import measuring_trainer_options

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
            self.losses: list[object] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: object, module: object, outputs: object, *args: object) -> None:
            if len(self.losses) < CHECKED_STEPS:
                self.losses.append(outputs["loss"] if isinstance(outputs, dict) else outputs)

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
            tensor_parallel(self.model, self.device_mesh["tensor_parallel"])

        def on_train_start(self) -> None:  # cross-entropy on sharded logits, forward and backward
            self._loss_parallel = ExitStack()
            self._loss_parallel.enter_context(loss_parallel())

        def on_train_end(self) -> None:
            self._loss_parallel.close()

    def run_trainer(variant: str) -> tuple[list[float], list[object]]:
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
        return timer.starts, timer.losses

    def run_pytorch() -> tuple[list[float], list[object]]:
        """The same training, written by hand on the same engines."""
        pl.seed_everything(0, verbose=False)
        module = LitGPT(config)  # the same model construction and optimizer recipe, no Trainer
        model, forward, context, schedule, partial_gradients = module.model, None, nullcontext(), None, False
        if strategy == "ddp":
            forward = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        elif strategy == "zero3":
            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            forward = fully_shard(model, mesh=mesh)
        elif strategy == "tp":
            tensor_parallel(model, init_device_mesh("cpu", (world,)))
            forward, context, partial_gradients = model, loss_parallel(), True
        elif strategy == "pipeline":
            rank = dist.get_rank()
            stage = pipeline_stage(model, rank, world)  # the optimizer sees this rank's pieces only
            schedule = Schedule1F1B(PipelineStage(stage, rank, world, torch.device("cpu")),
                                    n_microbatches=MICROBATCHES, loss_fn=module.model.loss)
        else:  # moe: experts over ep = world, ZeRO-1 over the dense weights (meshlight's "moe" layout)
            mesh = init_device_mesh("cpu", (world,))
            experts = expert_parallel(model, mesh)
            for block in model.blocks:  # ZeRO-1 as meshlight runs it on FSDP2: gathered weights kept to the backward
                fully_shard(block, mesh=mesh, reshard_after_forward=False, ignored_params=experts)
            forward = fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=experts)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(10, total_steps, 0.1))
        source = data()
        source.setup()
        sampler = DistributedSampler(source.train_set, num_replicas=replicas, rank=dist.get_rank() % replicas,
                                     shuffle=True, seed=0)
        loader = DataLoader(source.train_set, batch_size=batch, sampler=sampler, drop_last=True)
        starts, losses = [], []
        gc.disable()  # as meshlight (and torchtitan) do while training
        gc.collect(1)
        with context:
            for inputs, targets in loader:
                starts.append(time.perf_counter())
                if len(starts) % GC_EVERY_N_STEPS == 0:
                    gc.collect(1)
                if schedule is not None:
                    microbatch_losses: list[torch.Tensor] = []
                    if dist.get_rank() == 0:
                        schedule.step(inputs)
                        loss = torch.zeros(())
                    else:
                        schedule.step(target=targets, losses=microbatch_losses)
                        loss = torch.stack(microbatch_losses).mean()
                else:
                    loss = module.model.loss(forward(inputs), targets)
                    loss.backward()
                if partial_gradients:
                    sum_partial_gradients(model)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                logged = loss.detach().clone()
                dist.all_reduce(logged)  # what sync_dist logging does (the pipeline: the last stage's loss)
                if len(losses) < CHECKED_STEPS:
                    losses.append(None if schedule is not None and dist.get_rank() == 0 else loss.detach())
        starts.append(time.perf_counter())
        gc.collect()
        gc.enable()
        return starts, losses

    def mean_over_ranks(losses: list[object]) -> list[float]:
        """Each step's loss averaged over the ranks that have one (a pipeline's last stage only)."""
        local = [None if loss is None else float(loss.full_tensor() if isinstance(loss, DTensor) else loss)
                 for loss in losses]
        everyone: list[list] = [[] for _ in range(world)]
        dist.all_gather_object(everyone, local)
        steps = zip(*everyone)
        return [statistics.mean(v for v in step if v is not None) for step in steps]

    variants = ("pytorch", "lightning", "meshlight") if name in LIGHTNING else ("pytorch", "meshlight")
    variants = tuple(v for v in variants if v in only) if only else variants
    step_times: dict[str, list[float]] = {variant: [] for variant in variants}
    round_medians: list[dict[str, float]] = []
    first_losses: dict[str, list[float]] = {}
    rounds = rotations * len(variants)
    for round_index in range(rounds):
        shift = round_index % len(variants)
        medians = {}
        for variant in variants[shift:] + variants[:shift]:
            dist.barrier()
            starts, losses = run_pytorch() if variant == "pytorch" else run_trainer(variant)
            if round_index == 0:
                first_losses[variant] = mean_over_ranks(losses)
            times = [b - a for a, b in zip(starts[WARMUP:], starts[WARMUP + 1:])]
            step_times[variant] += times
            medians[variant] = statistics.median(times)
        round_medians.append(medians)
    median = {variant: statistics.median(times) for variant, times in step_times.items()}
    result = {"strategy": name, "world": world, "rotations": rotations, "rounds": rounds, "steps_per_round": steps,
              "median_step_seconds": median, "round_ratios": {}, "lower_decile_ratios": {},
              "first_losses": first_losses}
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
