"""One LightningModule fitted under DDP, then under ZeRO-3, then offered a third layout (2 processes); each rank saves
what it saw to ``OUT/rank<r>.pt``."""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import meshlight as ml
from meshlight.demos import LitGPT, RandomTokensDataModule
from meshlight.models import GPTConfig


def _weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters()}


def main(out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    module = LitGPT(GPTConfig.tiny(dim=32, vocab_size=32, max_seq_len=16, n_layers=4))
    data = RandomTokensDataModule(vocab_size=32, seq_len=16, batch_size=2, train_size=8, val_size=4)
    options = dict(devices=2, accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, num_sanity_val_steps=0)
    initial = _weights(module)
    result, trained = {}, {}
    for name in ("ddp", "zero3"):
        trainer = ml.Trainer(strategy=name, **options)
        trainer.validate(module, data, verbose=False)  # parallelizes, trains nothing
        if name == "zero3":
            now = _weights(module)
            result["zero3_weights_are_the_ddp_trained_ones"] = all(torch.equal(now[n], trained[n]) for n in now)
        trainer.fit(module, data)
        root = trainer.strategy.model
        trainer.test(module, data, verbose=False)
        result[f"{name}_test_reused_fit_model"] = trainer.strategy.model is root
        result[f"{name}_fsdp_units"] = sum(isinstance(m, FSDPModule) for m in root.modules())
        if name == "ddp":
            trained = _weights(module)
            result["ddp_changed_weights"] = any(not torch.equal(trained[n], initial[n]) for n in trained)
    try:
        ml.Trainer(strategy="ddp", **options).fit(module, data)
        result["third_layout_error"] = ""
    except RuntimeError as error:
        result["third_layout_error"] = str(error)
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
