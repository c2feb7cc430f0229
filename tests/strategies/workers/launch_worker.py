"""Started as a user starts a script (no torchrun): Lightning's launcher path, meshlight's forking launcher on
this CPU machine. Prints what tests/strategies/test_launcher.py checks.

    python launch_worker.py ok|fail|threads

``threads``: the script ran an op on two OpenMP threads before ``fit`` (so a pool's worker thread exists).
"""

import os
import sys

import lightning.pytorch as pl
import torch

import meshlight as ml
from meshlight.demos import LitGPT, RandomTokensDataModule
from meshlight.models import GPTConfig

print(f"script start in process {os.getpid()}", flush=True)


class FailOnRank1(pl.Callback):
    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_rank == 1:
            raise RuntimeError("rank 1 fails on purpose")


if __name__ == "__main__":
    if sys.argv[1] == "threads":  # a parallel region: OpenMP starts its pool's worker thread, which stays
        torch.set_num_threads(2)
        torch.ones(1 << 22).exp_()
    pl.seed_everything(0, verbose=False)
    module = LitGPT(GPTConfig.tiny(dim=32, vocab_size=32, max_seq_len=16))
    data = RandomTokensDataModule(vocab_size=32, seq_len=16, batch_size=2, train_size=8, val_size=2)
    trainer = ml.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=3, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[FailOnRank1()] if sys.argv[1] == "fail" else [])
    trainer.fit(module, data)
    checksum = sum(p.detach().double().sum().item() for p in module.parameters())
    # one write per line: with PYTHONUNBUFFERED print writes the text and its newline separately, and the ranks'
    # lines (sharing one pipe) could interleave between the two
    sys.stdout.write(f"rank {trainer.global_rank}/{trainer.world_size} local {trainer.local_rank} in process"
                     f" {os.getpid()}: weights {checksum:.10f} env LOCAL_RANK={os.environ['LOCAL_RANK']}\n")
    sys.stdout.flush()
    torch.distributed.barrier()
