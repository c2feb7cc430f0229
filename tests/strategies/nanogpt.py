"""A GPT-2 LightningModule laid out as nanoGPT lays it out — not meshlight's GPT.

The pieces sit in a ``ModuleDict`` namespace (``transformer.wte``, ``wpe``, the block list ``h``, ``ln_f``), the
token embedding and the LM head share one weight (``transformer.wte.weight = lm_head.weight``), positions are
learned, and attention reshapes with ``n_head``. ``NanoGPT(post_norm=True)`` normalizes after each residual sum
instead, as BERT and the original Transformer do: a norm's output is the residual stream. Unlike nanoGPT, q, k and v
are separate Linears (nanoGPT splits its fused ``c_attn`` by the whole width, ``n_embd``, and reshapes by
``C // n_head``, which no longer fit once tensor parallelism divides its head count), and the Linears have
no biases (nanoGPT's ``bias=False``: a key's bias gets no gradient, and Adam turns rounding noise into steps).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.strategies.llama import LAYERS, SEQ, VOCAB

N_EMBD, N_HEAD = 32, 4


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(N_EMBD, N_EMBD, bias=False) for _ in range(3))
        self.c_proj = nn.Linear(N_EMBD, N_EMBD, bias=False)
        self.n_head = N_HEAD

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.n_head, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, post_norm: bool = False) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(N_EMBD), CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD, bias=False), nn.GELU(),
                                 nn.Linear(4 * N_EMBD, N_EMBD, bias=False))
        self.post_norm = post_norm

    def forward(self, x: Tensor) -> Tensor:
        if self.post_norm:
            x = self.ln_1(x + self.attn(x))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, post_norm: bool = False) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, N_EMBD), wpe=nn.Embedding(SEQ, N_EMBD),
            h=nn.ModuleList(Block(post_norm) for _ in range(LAYERS)), ln_f=nn.LayerNorm(N_EMBD)))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class LitNanoGPT(pl.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.model = NanoGPT()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
