"""torchrun worker (2 processes): a model with a parameter no loss reaches under DDP (zero=0) — refused on every
rank after the first step's backward, naming it, before any optimizer step; trained with
``find_unused_parameters=True``, and under ZeRO-1. Rank 0 writes {run: the error's message or None, the optimizer
steps taken} to OUT."""

import sys
from typing import Any

import torch
import torch.distributed as dist

import meshlight as ml
from meshlight.demos import LitGPT
from meshlight.models import GPTConfig
from tests.strategies.hf_models import lit_causal_lm
from tests.strategies.parity import make_data


class WithUnused(LitGPT):
    def __init__(self) -> None:
        super().__init__(GPTConfig.tiny(vocab_size=16, max_seq_len=12, dim=32, n_layers=2))
        self.probe = torch.nn.Linear(4, 4)  # (as a sparse attention's key selector: no loss reaches it)


def run(strategy: Any, accumulate: int = 1, model: Any = WithUnused) -> Any:
    module = model()
    trainer = ml.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=3, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate)
    try:
        trainer.fit(module, make_data(8))
    except RuntimeError as error:
        return {"error": str(error), "steps": trainer.global_step}
    return {"error": None, "steps": trainer.global_step}


if __name__ == "__main__":
    results = {
        "ddp": run(ml.DDPStrategy()),
        "3d zero=0": run(ml.Hybrid3DStrategy(dp=2, pp=1, tp=1, ep=1, zero=0)),
        "ddp accumulate": run(ml.DDPStrategy(), accumulate=2),  # (after the window's last, synchronizing backward)
        # a model we did not write: Hugging Face's DeepSeek-V3.2, whose sparse attention's key selector no loss reaches
        "ddp deepseek_v32": run(ml.DDPStrategy(), model=lambda: lit_causal_lm("deepseek_v32")),
        "ddp find_unused": run(ml.DDPStrategy(find_unused_parameters=True)),
        "3d zero=0 find_unused": run(ml.Hybrid3DStrategy(dp=2, pp=1, tp=1, ep=1, zero=0,
                                                         ddp_kwargs={"find_unused_parameters": True})),
        "zero1": run("zero1"),
    }
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
