"""torchrun worker: pipelining bad input. Each case must raise PipelineError on every rank before anything is
sent (a rank that waited in a send would hang the launch); each rank records what it raised."""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPT, GPTConfig
from meshlight.parallel.pipeline import PipelineError
from tests.strategies.parity import make_data


class FailIfTrained(pl.Callback):
    def on_train_batch_end(self, *args: object) -> None:
        raise AssertionError("a training step completed")


class SkipConnectionGPT(GPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = x = self.embed(idx)  # not a chain: the last stage does not hold the embedding's output
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x + h))


def lit(n_layers: int = 4, tie: bool = False, model_cls: type = GPT) -> LitGPT:
    module = LitGPT(GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32,
                                   n_layers=n_layers, tie_embeddings=tie))
    if model_cls is not GPT:
        module.model = model_cls(module.config)
    return module


CASES = {  # name -> (module, strategy arguments, per-rank batch)
    "few microbatches": (lambda: lit(), dict(schedule="1f1b", microbatches=1), 16),
    "indivisible batch": (lambda: lit(), dict(schedule="1f1b", microbatches=3), 16),
    "more stages than blocks": (lambda: lit(n_layers=1), dict(schedule="1f1b"), 16),
    "not a chain": (lambda: lit(model_cls=SkipConnectionGPT), dict(schedule="1f1b"), 16),
    "tied embedding and head on one rank": (lambda: lit(tie=True), dict(schedule="zbvzerobubble", virtual_stages=2,
                                                                         microbatches=4), 16),
}
WIDE_CASES = {  # on 4 processes: pp=2 × dp=2
    "zero bubble with too few microbatches": (lambda: lit(), dict(schedule="zbvzerobubble", microbatches=2), 8),
}

if __name__ == "__main__":
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    errors = {}
    for name, (make, options, batch) in (CASES if world == 2 else WIDE_CASES).items():
        pl.seed_everything(0, verbose=False)
        trainer = ml.Trainer(strategy=ml.PipelineStrategy(pp=2, **options), devices=world, accelerator="cpu",
                             max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                             limit_val_batches=0, callbacks=[FailIfTrained()])
        try:
            trainer.fit(make(), make_data(batch))
            errors[name] = "no error"
        except PipelineError as error:
            errors[name] = str(error)
    torch.save(errors, out / f"rank{dist.get_rank()}.pt")
