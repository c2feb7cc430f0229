"""A Llama-shaped LightningModule written as users write them — not meshlight's GPT.

RMSNorm, rotary embeddings, grouped-query attention that reshapes with its own head-count attributes
(``view(b, t, self.n_heads, self.head_dim)``), SwiGLU with Meta's ``w1, w2, w3`` registration order, and a
``training_step`` that calls ``F.cross_entropy`` on the logits itself. ``LitLlama(experts=8)`` makes every
feed-forward a ``meshlight.nn.MoE``, as a user adopting meshlight's layer would; ``LitLlama(gated=True)`` scales
each feed-forward's output by a gate that reads the residual stream (``sigmoid(gate(x))``, a Linear no column→row
group holds: tensor parallelism leaves it whole); ``LitLlama(qk_norm=True)`` normalizes each head of q and k
(Qwen3's QK-norm); ``LitLlama(outside=True)`` holds modules outside the blocks that no tensor-parallel role
describes: a factorized token embedding (16 wide, projected to the model's width, ALBERT's) and a transform between
the final norm and the LM head (Linear, GELU, norm: BERT's masked-LM head); ``LitLlama(head_dim_only=True)`` keeps
only ``head_dim`` in its attention, as Hugging Face's Llama does: the head counts are the projections' widths over it,
and heads are reshaped with ``-1``. ``layers`` sets the number of blocks, ``seq`` the length of the rotary tables
(which the forward slices by its input's length).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlight.nn import MoE

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS, SEQ = 16, 64, 8, 4, 128, 2, 12

# The same split written as a plan dict, in the convention of model hubs.
DICT_PLAN = {
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, qk_norm: bool = False, head_dim_only: bool = False) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        if not head_dim_only:
            self.n_heads, self.n_kv_heads = HEADS, KV_HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)
        # Qwen3's QK-norm: an RMSNorm over each head of q and k
        self.q_norm, self.k_norm = (RMSNorm(self.head_dim), RMSNorm(self.head_dim)) if qk_norm else (None, None)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        heads, kv_heads = (self.n_heads, self.n_kv_heads) if hasattr(self, "n_heads") else (-1, -1)
        q = self.wq(x).view(b, t, heads, self.head_dim)
        k = self.wk(x).view(b, t, kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        n_rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, experts: int = 0, gated: bool = False, qk_norm: bool = False,
                 head_dim_only: bool = False) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention(qk_norm, head_dim_only)
        self.ffn_norm = RMSNorm(DIM)
        # (no expert bias: see tests/strategies/parity.py's WITHOUT_EXPERT_BIAS)
        self.feed_forward = MoE(DIM, HIDDEN // 2, experts, top_k=2, expert_bias_rate=0.0) if experts else FeedForward()
        self.gate = nn.Linear(DIM, 1) if gated else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        scale = torch.sigmoid(self.gate(x)) if self.gate is not None else 1.0
        return x + scale * self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, experts: int = 0, gated: bool = False, qk_norm: bool = False, outside: bool = False,
                 head_dim_only: bool = False, layers: int = LAYERS, seq: int = SEQ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, 16 if outside else DIM)
        self.project = nn.Linear(16, DIM, bias=False) if outside else None
        self.layers = nn.ModuleList(TransformerBlock(experts, gated, qk_norm, head_dim_only) for _ in range(layers))
        self.norm = RMSNorm(DIM)
        self.transform = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), RMSNorm(DIM)) if outside else None
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        head_dim = DIM // HEADS
        angles = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
        self.register_buffer("cos", angles.cos()[:, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[:, None, :], persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        if self.project is not None:
            h = self.project(h)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        return self.output(self.transform(h) if self.transform is not None else h)


class LitLlama(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, experts: int = 0, gated: bool = False, qk_norm: bool = False,
                 outside: bool = False, head_dim_only: bool = False, layers: int = LAYERS, seq: int = SEQ) -> None:
        super().__init__()
        self.lr = lr
        self.model = Llama(experts, gated, qk_norm, outside, head_dim_only, layers, seq)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
        self.log("train/loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LitLlamaParallelizedByUser(LitLlama):
    """Applies tensor parallelism itself in ``configure_model`` with the mesh the strategy provides
    (Lightning's convention): the strategy must then apply no plan of its own."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tp"]
        for layer in self.model.layers:
            for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv,
                           layer.feed_forward.w1, layer.feed_forward.w3):
                parallelize_module(linear, tp_mesh, ColwiseParallel())
            for linear in (layer.attention.wo, layer.feed_forward.w2):
                parallelize_module(linear, tp_mesh, RowwiseParallel())
            layer.attention.n_heads //= tp_mesh.size()
            layer.attention.n_kv_heads //= tp_mesh.size()
