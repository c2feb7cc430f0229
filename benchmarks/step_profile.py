"""Where a training step's time goes, per strategy: a ``torch.profiler`` record of optimizer steps 4–6 on rank 0
(``meshlight.callbacks.ProfileSteps``' settings), its top three operators by self CPU time, each as a share
of all operators' self time. The model of the overhead benchmark (4 blocks, dim 192, seq 128, batch 8 per
replica), CPU processes.

    python benchmarks/step_profile.py [--nprocs 2 4]      # prints JSON
"""

from __future__ import annotations

import argparse
import json

from common import is_worker, launch, report

STRATEGIES = {2: ["ddp", "zero1", "zero3", "tp", "pipeline"], 4: ["3d"]}
PROFILED = range(4, 7)


def worker() -> None:
    import os

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.models import GPTConfig

    from common import measuring_trainer_options

    world = int(os.environ["WORLD_SIZE"])
    config = GPTConfig(vocab_size=256, max_seq_len=128, n_layers=4, n_heads=8, dim=192)

    class Profile(Callback):
        def __init__(self) -> None:
            self.profiler, self.top, self.total = None, [], 0.0

        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == PROFILED.start and self.profiler is None:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if self.profiler is not None and trainer.global_step == PROFILED.stop:
                self.profiler.__exit__(None, None, None)
                events = [e for e in self.profiler.key_averages() if e.self_cpu_time_total > 0]
                self.total = sum(e.self_cpu_time_total for e in events)
                events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
                self.top = [(e.key, e.self_cpu_time_total / self.total) for e in events[:3]]
                self.profiler = None

    rows = []
    for name in STRATEGIES[world]:
        strategy = ml.Hybrid3DStrategy(dp=1, pp=2, tp=2, ep=1, zero=1) if name == "3d" else name
        dp = 1 if name in ("tp", "pipeline", "3d") else world
        pl.seed_everything(0, verbose=False)
        profile = Profile()
        trainer = ml.Trainer(strategy=strategy, **measuring_trainer_options(world, PROFILED.stop + 1, [profile]))
        data = RandomTokensDataModule(vocab_size=256, seq_len=128, batch_size=8, train_size=8 * dp * 20)
        trainer.fit(LitGPT(config), data)
        rows.append({"strategy": name, "world": world, "steps": len(PROFILED),
                     "self_cpu_seconds_per_step": profile.total / 1e6 / len(PROFILED),
                     "top": [{"op": op, "share": share} for op, share in profile.top]})
    report(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(json.dumps([row for n in args.nprocs for row in launch(__file__, n)], indent=1))


if __name__ == "__main__":
    worker() if is_worker() else main()
