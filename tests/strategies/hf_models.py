"""Tiny, randomly initialized Hugging Face causal LMs wrapped in a plain LightningModule, as users write them: the
model is built from a config (never downloaded) and ``training_step`` calls ``F.cross_entropy`` on its logits."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 16, 64, 8, 4, 128, 4
FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")


def hf_config(family: str) -> Any:
    """A tiny config of ``family``: 4 layers, no dropout; GQA (8 query, 4 key/value heads) and an untied head, except
    GPT-2 (8 heads, its head tied to the token embedding)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":  # q, k, v biases
        return transformers.Qwen2Config(**common)
    if family == "qwen3":  # QK-norm, an explicit head_dim
        return transformers.Qwen3Config(**common, head_dim=DIM // HEADS)
    if family == "gpt2":  # Conv1D, a fused q|k|v, learned positions, the head tied to the token embedding
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=DIM, n_layer=LAYERS, n_head=HEADS, n_inner=HIDDEN,
                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       use_cache=False)
    raise ValueError(f"family={family!r}: choose one of {FAMILIES}")


def training_options(family: str) -> dict[str, Any]:
    """The optimizer a parity run trains ``family`` with: AdamW, except SGD for Qwen2 and GPT-2, whose key biases have
    an exactly-zero gradient (softmax ignores a per-query constant) that Adam would turn from float noise into
    full-size steps that no two layouts take alike."""
    return {"optimizer": "sgd", "lr": 0.3} if family in ("qwen2", "gpt2") else {}


class LitCausalLM(pl.LightningModule):
    """Next-token training of a Hugging Face ``AutoModelForCausalLM`` on ``(inputs, targets)`` batches."""

    def __init__(self, family: str, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        import transformers

        self.lr, self.optimizer = lr, optimizer
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="sdpa")

    def forward(self, inputs: Tensor) -> Tensor:
        return self.model(input_ids=inputs).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        return F.cross_entropy(self(inputs).flatten(0, -2).float(), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
