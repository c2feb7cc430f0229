"""Bytes each rank sends per optimizer step, per data-parallel strategy, divided by the theoretical minimum.

Counted by instrumenting the collectives actually issued during one training step (after warm-up) with
``meshlight.parallel.CollectiveTraffic``, at bandwidth-optimal cost per collective. Theory, with P the
parameter bytes and N ranks: DDP, ZeRO-1 and ZeRO-2 move 2·P·(N−1)/N (all-reduce, or reduce-scatter +
all-gather); ZeRO-3 (3·P − R)·(N−1)/N (the blocks' parameters gathered again in backward; the root unit's R
bytes — embedding, head, final norm — stay gathered from forward to backward, as FSDP2 keeps a root). For
reference, Lightning's DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1 the way Lightning
users get it today) is measured against the same 2·P·(N−1)/N.

Tensor parallelism (tp = N, no data parallelism): per transformer block, forward and backward each move two
all-reduces of the B·S·H activations (without sequence parallelism), or the same bytes as all-gathers and
reduce-scatters (with it): 4 · 2·A·(N−1)/N per block, A = activation bytes. With sequence parallelism
meshlight by default gathers the two projection groups' inputs again in backward rather than keeping them
(Megatron-LM's trade): 2 · A·(N−1)/N more per block; ``keep_gathered_inputs=True`` is measured against the
plain 4 · 2·A·(N−1)/N. Per-block bytes are measured as
the difference between the same model with 4 and with 2 blocks, halved, so the embedding, the LM head and
the loss (which add two more such all-reduces and a few B·S-sized ones per step) cancel out; the whole
step is also reported against (4·blocks + 2) · 2·A·(N−1)/N.

Expert parallelism (ep = N, ``MoEStrategy``; every block's MLP a mixture of 8 top-2 experts): per MoE layer
the dispatch and the combine all_to_all each move T·k·D·(ep−1)/ep elements forward and the same backward
(T tokens per rank, k = top_k, D = dim; the (ep−1)/ep share leaves the rank when routing is uniform), so
theory = layers · 4 · T·k·D·(ep−1)/ep · 4 bytes. Measured: every all_to_all a rank issues in the step (the
token exchanges of forward and backward, and the small exchange of per-expert counts), bytes to other ranks. On 4
processes also tp=2 × ep=2 (dp=2): every tp rank routes its replica's whole tokens; with each expert split over tp
each tp rank sends all T of them (to its slices of the experts: tp times the bytes for the same tokens), folded over
the tp ranks each sends its T/tp.

    python benchmarks/comm.py [--nprocs 2 4]      # prints JSON
"""

from __future__ import annotations

from common import is_worker, main_over_world_sizes, report

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "lightning-ddp+ZeroRedundancyOptimizer")
TP_VARIANTS = {
    "tp, sequence parallel": dict(sequence_parallel=True, keep_gathered_inputs=False),
    "tp, sequence parallel, gathered inputs kept": dict(sequence_parallel=True, keep_gathered_inputs=True),
    "tp": dict(sequence_parallel=False, keep_gathered_inputs=False),
}
MEASURED_STEP = 2  # after DDP's bucket rebuild and FSDP's lazy initialization
BATCH, SEQ = 4, 64


def worker() -> None:
    import os

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.parallel import CollectiveTraffic, repeated_blocks

    from common import bench_config, measuring_trainer_options

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

    def step_traffic(module: LitGPT, strategy: object, trainer_cls: type = ml.Trainer) -> CollectiveTraffic:
        probe = TrafficProbe()
        trainer = trainer_cls(strategy=strategy, **measuring_trainer_options(world, MEASURED_STEP + 1, [probe]))
        data = RandomTokensDataModule(vocab_size=256, seq_len=SEQ, batch_size=BATCH, train_size=16 * BATCH * world)
        trainer.fit(module, data)
        return probe.traffic

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for name in STRATEGIES:
        pl.seed_everything(0, verbose=False)
        lightning_zero = name.startswith("lightning")
        module = (ZeroRedundancyGPT if lightning_zero else LitGPT)(bench_config())
        traffic = step_traffic(module, "ddp" if lightning_zero else name, pl.Trainer if lightning_zero else ml.Trainer)
        param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        root_bytes = param_bytes - sum(p.numel() * p.element_size() for block in repeated_blocks(module)
                                       for p in block.parameters())
        moved = 3 * param_bytes - root_bytes if name == "zero3" else 2 * param_bytes
        theory = moved * (world - 1) / world
        results.append({
            "strategy": name, "world": world, "param_bytes": param_bytes, "root_bytes": root_bytes,
            "bytes_sent": traffic.bytes_sent,
            "theory_bytes": theory, "ratio": traffic.bytes_sent / theory, "by_collective": traffic.summary(),
        })
    config = bench_config()
    activation_bytes = BATCH * SEQ * config.dim * 4
    all_reduce = 2 * activation_bytes * (world - 1) / world
    for name, options in TP_VARIANTS.items():
        traffic_by_blocks = {}
        for blocks in (4, 2):
            pl.seed_everything(0, verbose=False)
            module = LitGPT(config.replace(n_layers=blocks))
            strategy = ml.TensorParallelStrategy(tp=world, **options)
            traffic_by_blocks[blocks] = step_traffic(module, strategy)
        per_block = (traffic_by_blocks[4].bytes_sent - traffic_by_blocks[2].bytes_sent) / 2
        # two all-gathers again in backward, A·(N−1)/N each: an all-reduce's bytes
        regathers = all_reduce if options["sequence_parallel"] and not options["keep_gathered_inputs"] else 0
        per_block_theory = 4 * all_reduce + regathers
        step, step_theory = traffic_by_blocks[4].bytes_sent, (4 * 4 + 2) * all_reduce + 4 * regathers
        results.append({
            "strategy": name, "world": world,
            "activation_bytes": activation_bytes, "per_block_bytes": per_block, "per_block_theory": per_block_theory,
            "ratio": per_block / per_block_theory, "step_bytes": step, "step_theory": step_theory,
            "step_ratio": step / step_theory, "by_collective": traffic_by_blocks[4].summary(),
        })
    results.append(expert_parallel_row(world, step_traffic))
    if world == 4:  # tp=2 × ep=2: each expert split over tp, and experts folded over the tp ranks
        results += [expert_parallel_row(world, step_traffic, tp=2, experts=experts) for experts in ("split", "fold")]
    report(results)


def expert_parallel_row(world: int, step_traffic: object, tp: int = 1, experts: str = "split") -> dict:
    import lightning.pytorch as pl

    import meshlight as ml
    from meshlight.demos import LitGPT
    from meshlight.nn import MoEConfig

    from common import bench_config

    pl.seed_everything(0, verbose=False)
    config = bench_config().replace(moe=MoEConfig(num_experts=8, top_k=2))
    ep = world if tp == 1 else 2
    strategy = ml.MoEStrategy(ep=ep, zero=1, tp=tp, experts=experts)
    traffic = step_traffic(LitGPT(config), strategy)
    all_to_all = traffic.summary().get("all_to_all", {"calls": 0, "bytes_sent": 0.0})
    # every tp rank routes its replica's whole tokens; split, each sends all of them to its slices of the experts,
    # folded, its 1/tp part
    tokens = BATCH * SEQ // (tp if experts == "fold" else 1)
    theory = config.n_layers * 4 * tokens * config.moe.top_k * config.dim * (ep - 1) / ep * 4
    layout = f"ep={ep}" if tp == 1 else f"tp={tp} × ep={ep}, " + (
        "experts folded over tp" if experts == "fold" else "each expert split over tp")
    return {
        "strategy": "moe", "layout": layout, "world": world, "ep": ep, "tp": tp, "experts": experts,
        "moe_layers": config.n_layers, "tokens_per_rank": tokens,
        "top_k": config.moe.top_k, "all_to_all_bytes": all_to_all["bytes_sent"],
        "all_to_all_calls": all_to_all["calls"], "theory_bytes": theory, "ratio": all_to_all["bytes_sent"] / theory,
        "by_collective": traffic.summary(),
    }


if __name__ == "__main__":
    worker() if is_worker() else main_over_world_sizes(__file__, __doc__)
