"""torchrun worker: tensor parallelism over a model whose 3 heads tp=2 cannot split — must fail on every rank
before the first training step."""

import lightning.pytorch as pl

import meshlight as ml
from meshlight.demos import LitGPT
from meshlight.models import GPTConfig
from tests.strategies.parity import make_data


class FailIfTrained(pl.Callback):
    def on_train_batch_start(self, *args: object) -> None:
        raise AssertionError("training started")


if __name__ == "__main__":
    module = LitGPT(GPTConfig.tiny(vocab_size=16, max_seq_len=12, dim=48, n_heads=3))
    trainer = ml.Trainer(strategy=ml.TensorParallelStrategy(tp=2), devices=2, accelerator="cpu", max_steps=1,
                         logger=False, enable_progress_bar=False, callbacks=[FailIfTrained()])
    trainer.fit(module, make_data(16))
