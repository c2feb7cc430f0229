"""torchrun worker: resume exactness of DistributedCheckpoint under every strategy on 2 processes (3-D: reshard_worker),
and restarts after faults.

    kill DIR NAME       train NAME with checkpoints every 5 steps into DIR/NAME; every rank SIGKILLs itself
                        right after step 12 (the async save of step 10 may still be in flight)
    resume DIR OUT NAMES...  for each: train 20 steps uninterrupted (checkpoints every 5 steps too, into
                        DIR/full), then fit(ckpt_path="last") from DIR/NAME to step 20; rank 0 writes
                        {name: ({step: loss} uninterrupted, {step: loss} of the steps resumed)} to OUT
    fault DIR OUT FAULT  under torchrun --max-restarts=1, zero3 on 2 processes, fit(ckpt_path="last") to step 20
                        (synchronous saves); in the first attempt FAULT = "rank": rank 1 SIGKILLs itself after
                        step 12; "save": every rank SIGKILLs itself inside the save of step 10, once its shards
                        and DCP's metadata are written but before the folder is committed; "none": no fault.
                        Rank 0 writes the final full weights, the restart count, the step the last attempt
                        resumed from, and whether the step-5 checkpoint's files were unchanged by the fault
    async-crash DIR OUT ATTEMPT  one process, asynchronous saves every 2 steps; "first": killed from the writing
                        thread inside the save of step 4; "resume": fit(ckpt_path="last") and an uninterrupted run
                        (see crash_in_async_save)
    from-one-device CKPT OUT  zero3 on 2 processes from CKPT (written on one device at step 4) to step 6
    validated DIR OUT   zero3 on 2 processes, validating every 3 steps and saving when the validation loss
                        improves (so after a validation, when ZeRO-3's root unit is still gathered), 12 steps;
                        then from the step-6 checkpoint to step 12. Rank 0 writes both runs' {step: loss} to OUT

Epochs are 8 steps long, so step 10 is mid-epoch: the resumed data position comes from the sampler skipping
what the epoch consumed.
"""

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import meshlight as ml
from meshlight.callbacks import DistributedCheckpoint
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig
from tests.strategies.parity import full_weights

GLOBAL_BATCH, STEPS_PER_EPOCH, MAX_STEPS, KILL_AFTER = 16, 8, 20, 12
KILLED = f"SIGKILL after step {KILL_AFTER}"

# name -> (strategy factory, experts), each on WORLD processes
WORLD = 2
STRATEGIES = {
    "ddp": (lambda: "ddp", 0),
    "zero2": (lambda: "zero2", 0),  # and ZeRO-1's sharded optimizer state with it
    "zero3": (lambda: "zero3", 0),
    "tp": (lambda: "tp", 0),
    "pipeline": (lambda: "pipeline", 0),
    "moe": (lambda: "moe", 4),
    # PowerSGD's error feedback and factors, per rank, continue where they were (after 3 plain steps), in DDP
    # buckets of 40 kB: the resumed run's first step has one bucket of every gradient, the next steps DDP's rebuilt ones
    "ddp-powersgd": (lambda: ml.DDPStrategy(grad_compression=ml.GradientCompression("powersgd", rank=2, start_step=3),
                                            bucket_cap_mb=0.04), 0),
}  # and "3d", (dp, pp, tp) = (2, 2, 2) on 8 processes: reshard_worker


def model(experts: int, dropout: float = 0.1) -> LitGPT:
    """``dropout`` on by default: a resumed run must continue every random stream where the uninterrupted one was."""
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2, bias=False,
                            dropout=dropout, moe=MoEConfig(num_experts=experts) if experts else None)
    return LitGPT(config, lr=1e-2, warmup_steps=2)


class Losses(Callback):
    def __init__(self, kill: bool = False) -> None:
        self.losses: dict[int, float] = {}
        self.kill = kill

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])
        if self.kill and trainer.global_step == KILL_AFTER:
            print(KILLED, flush=True)  # what the launch's output must show: killed here, not failed earlier
            os.kill(os.getpid(), signal.SIGKILL)


def train(name: str, directory: Path, *, kill: bool = False, resume: bool = False) -> dict[int, float]:
    strategy, experts = STRATEGIES[name]
    world = WORLD
    pl.seed_everything(0, verbose=False)
    dp = world // {"tp": 2, "pipeline": 2}.get(name, 1)
    data = AdditionDataModule(3, batch_size=GLOBAL_BATCH // dp, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
    losses = Losses(kill)
    checkpoint = DistributedCheckpoint(directory / name, every_n_train_steps=5, keep_last_k=2)
    trainer = ml.Trainer(strategy=strategy(), devices=world, accelerator="cpu", max_steps=MAX_STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[losses, checkpoint])
    trainer.fit(model(experts), data, ckpt_path="last" if resume else None)
    return losses.losses


def fault(directory: Path, out: Path, kind: str) -> None:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    rank = int(os.environ["RANK"])
    step = {"now": 0, "resumed_from": None}
    before_fault = Path(f"{out}.step5")

    class Fault(Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
            step["resumed_from"] = trainer.global_step

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            step["now"] = trainer.global_step
            if first_attempt and kind == "rank" and rank == 1 and trainer.global_step == KILL_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)

    if first_attempt and kind == "save":
        import meshlight.parallel.checkpoint as checkpoint_module

        real_save = checkpoint_module.dcp.save

        def crashing_save(*args: object, **kwargs: object) -> object:
            written = real_save(*args, **kwargs)
            if step["now"] == 10:  # every shard and DCP's .metadata written, the folder still marked incomplete
                if rank == 0:
                    torch.save(_digests(directory / "step=000000005"), before_fault)
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        checkpoint_module.dcp.save = crashing_save
    intact = None
    if not first_attempt and rank == 0 and before_fault.exists():
        intact = torch.load(before_fault) == _digests(directory / "step=000000005")

    pl.seed_everything(0, verbose=False)
    data = AdditionDataModule(3, batch_size=GLOBAL_BATCH // 2, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
    checkpoint = DistributedCheckpoint(directory, every_n_train_steps=5, keep_last_k=2, async_save=False)
    trainer = ml.Trainer(strategy="zero3", devices=2, accelerator="cpu", max_steps=MAX_STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Fault(), checkpoint])
    module = model(0)
    trainer.fit(module, data, ckpt_path="last")
    weights = full_weights(module)
    if rank == 0:
        torch.save({"weights": weights, "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "steps": checkpoint.complete_steps(), "resumed_from": step["resumed_from"],
                    "step5_intact": intact}, out)


def validated(directory: Path, out: Path) -> None:
    def run(ckpt_path: object) -> dict[int, float]:
        pl.seed_everything(0, verbose=False)
        data = AdditionDataModule(3, batch_size=GLOBAL_BATCH // 2, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH,
                                  val_size=32)
        losses = Losses()
        checkpoint = DistributedCheckpoint(directory, monitor="val/loss", save_top_k=4, async_save=False)
        trainer = ml.Trainer(strategy="zero3", devices=2, accelerator="cpu", max_steps=KILL_AFTER, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, val_check_interval=3,
                             limit_val_batches=2, num_sanity_val_steps=0, callbacks=[losses, checkpoint])
        trainer.fit(model(0), data, ckpt_path=ckpt_path)
        return losses.losses

    results = (run(None), run(directory / "step=000000006"))
    if dist.get_rank() == 0:
        torch.save(results, out)


def crash_in_async_save(directory: Path, out: Path, attempt: str) -> None:
    """One process, checkpoints every 2 steps written in the background. ``first``: the process is SIGKILLed from
    the writing thread inside the save of step 4 (its shards written, DCP's metadata and the commit not yet), while
    training goes on. ``resume``: rank 0 writes the step-2 checkpoint's file digests from before the crash against
    after it, the step the resumed run starts from, and its losses against an uninterrupted run's."""
    digests_before = Path(f"{out}.step2")

    def run(folder: Path, resume: bool) -> tuple[dict[int, float], int]:
        pl.seed_everything(0, verbose=False)
        losses, started = Losses(), {}

        class Started(Callback):
            def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
                started["step"] = trainer.global_step

        data = AdditionDataModule(3, batch_size=GLOBAL_BATCH, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
        trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=6, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             callbacks=[losses, Started(), DistributedCheckpoint(folder, every_n_train_steps=2,
                                                                                  keep_last_k=3)])
        trainer.fit(model(0), data, ckpt_path="last" if resume else None)
        return losses.losses, started["step"]

    if attempt == "first":
        from meshlight.parallel import integrity

        real_write = integrity._ChecksumRecording.write_data

        def crashing_write(self: object, plan: object, planner: object) -> object:
            written = real_write(self, plan, planner)
            if "step=000000004" in self.checkpoint:
                torch.save(_digests(directory / "step=000000002"), digests_before)
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        integrity._ChecksumRecording.write_data = crashing_write
        run(directory, resume=False)
        raise AssertionError("the save of step 4 was meant to kill this process")
    full, _ = run(directory.parent / f"{directory.name}-full", resume=False)
    intact = torch.load(digests_before) == _digests(directory / "step=000000002")
    resumed, started = run(directory, resume=True)
    torch.save({"full": full, "resumed": resumed, "started": started, "step2_intact": intact}, out)


def from_one_device(checkpoint: Path, out: Path) -> None:
    """zero3 on 2 processes from a checkpoint one device wrote at step 4, to step 6; rank 0 writes {step: loss}."""
    pl.seed_everything(0, verbose=False)
    losses = Losses()
    data = AdditionDataModule(3, batch_size=GLOBAL_BATCH // 2, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
    trainer = ml.Trainer(strategy="zero3", devices=2, accelerator="cpu", max_steps=6, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[losses])
    trainer.fit(model(0, dropout=0.0), data, ckpt_path=str(checkpoint))
    if dist.get_rank() == 0:
        torch.save(losses.losses, out)


def _digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file in ``folder``."""
    import hashlib

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def main(mode: str, args: list[str]) -> None:
    if mode == "fault":
        fault(Path(args[0]), Path(args[1]), args[2])
        return
    if mode == "validated":
        validated(Path(args[0]), Path(args[1]))
        return
    if mode == "from-one-device":
        from_one_device(Path(args[0]), Path(args[1]))
        return
    if mode == "async-crash":
        crash_in_async_save(Path(args[0]), Path(args[1]), args[2])
        return
    if mode == "kill":
        train(args[1], Path(args[0]), kill=True)
        return
    assert mode == "resume", mode
    directory, out, names = Path(args[0]), Path(args[1]), args[2:]
    results = {}
    for name in names:  # one launch for both: every process start costs seconds of imports here
        results[name] = (train(name, directory / "full"), train(name, directory, resume=True))
    if dist.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
