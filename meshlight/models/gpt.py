"""A decoder-only transformer (GPT-2 / Llama shapes) written to be split, sharded and pipelined.

The contract every meshlight parallelism relies on (docs/guides/pipeline.md):

- ``forward`` is a chain: ``embed → blocks[0] → … → blocks[-1] → norm → head``; each top-level piece's
  output is the next one's first input, so a pipeline stage is this same forward with the pieces it does
  not own replaced by pass-throughs.
- Blocks live in ``self.blocks`` (a ``ModuleList``), the unit of pipeline splitting, FSDP wrapping and
  activation checkpointing. With ``GPTConfig.moe`` every ``moe_every``-th block's MLP is a
  :class:`~meshlight.nn.MoE` (its experts are what expert parallelism splits).
- Attention reshapes heads with ``-1``: under tensor parallelism each rank holds ``n_heads/tp`` query heads
  and ``n_kv_heads/tp`` key/value heads and the same code runs.
- Initialization is a function of (``init_seed``, parameter name) only, so every layout, every rank and a
  model materialized from the meta device start from the same weights.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlight.nn.moe import MoE, MoEConfig

__all__ = ["GPT", "GPTConfig"]

Rope = Optional[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`. Presets: :meth:`tiny`, :meth:`small`, :meth:`gpt2` … :meth:`gpt2_xl`."""

    vocab_size: int = 50304
    max_seq_len: int = 1024
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: Optional[int] = None  # None: same as n_heads; fewer = grouped-query attention
    dim: int = 768
    hidden_dim: Optional[int] = None  # MLP width; None: 4·dim for gelu, 8/3·dim (rounded up to 64) for swiglu
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    positions: Literal["learned", "rotary"] = "learned"
    bias: bool = True
    tie_embeddings: bool = False
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    init_seed: int = 0
    moe: Optional[MoEConfig] = None  # None: dense MLPs everywhere
    moe_every: int = 1  # with moe: blocks moe_every-1, 2·moe_every-1, … use it (1: all blocks)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layers", "n_heads", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}.")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"Rotary positions need an even head_dim, got {self.head_dim}.")
        for name, choices in (("mlp", ("gelu", "swiglu")), ("norm", ("layernorm", "rmsnorm")),
                              ("positions", ("learned", "rotary"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r}; choose one of {choices}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1).")
        if self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every} must be >= 1 (1: every block's MLP is a mixture of experts).")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        if self.mlp == "gelu":
            return 4 * self.dim
        return 64 * math.ceil(8 * self.dim / 3 / 64)

    def uses_moe(self, block: int) -> bool:
        """Whether block ``block`` (0-based) has a mixture-of-experts MLP."""
        return self.moe is not None and (block + 1) % self.moe_every == 0

    def replace(self, **changes: object) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: object) -> GPTConfig:
        """About 0.1M parameters: tests and quick CPU runs."""
        return cls(vocab_size=256, max_seq_len=128, n_layers=2, n_heads=4, dim=64).replace(**overrides)

    @classmethod
    def small(cls, **overrides: object) -> GPTConfig:
        """About 5M parameters: CPU benchmarks and a demo that learns in minutes."""
        return cls(vocab_size=256, max_seq_len=256, n_layers=6, n_heads=8, dim=256).replace(**overrides)

    @classmethod
    def gpt2(cls, **overrides: object) -> GPTConfig:
        """GPT-2 small, 124M parameters (tied embeddings, learned positions)."""
        return cls(vocab_size=50304, max_seq_len=1024, n_layers=12, n_heads=12, dim=768,
                   tie_embeddings=True).replace(**overrides)

    @classmethod
    def gpt2_medium(cls, **overrides: object) -> GPTConfig:
        """GPT-2 medium, 350M parameters."""
        return cls.gpt2(n_layers=24, n_heads=16, dim=1024).replace(**overrides)

    @classmethod
    def gpt2_large(cls, **overrides: object) -> GPTConfig:
        """GPT-2 large, 774M parameters."""
        return cls.gpt2(n_layers=36, n_heads=20, dim=1280).replace(**overrides)

    @classmethod
    def gpt2_xl(cls, **overrides: object) -> GPTConfig:
        """GPT-2 XL, 1.5B parameters."""
        return cls.gpt2(n_layers=48, n_heads=25, dim=1600).replace(**overrides)


class TokenEmbedding(nn.Module):
    """Token ids ``[B, T]`` → hidden states ``[B, T, dim]``, plus learned positions when configured."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        self.positions = nn.Embedding(config.max_seq_len, config.dim) if config.positions == "learned" else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tokens(idx)
        if self.positions is not None:
            x = x + self.positions(torch.arange(idx.shape[1], device=idx.device))
        return self.dropout(x)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for rotary positions; a non-persistent buffer, recomputed by :meth:`reset_parameters`."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("table", torch.empty(2, max_seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.table.is_meta:
            return
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), inv_freq)
        self.table.copy_(torch.stack([angles.cos(), angles.sin()]))

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        return self.table[0, :seq_len], self.table[1, :seq_len]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs of channels of ``x`` ``[B, T, heads, head_dim]`` by position-dependent angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with separate q, k, v and output projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.bias)
        self.wk = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=config.bias)
        self.wv = nn.Linear(config.dim, config.kv_heads * config.head_dim, bias=config.bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, rope: Rope = None) -> Tensor:
        batch, seq = x.shape[:2]
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(batch, seq, -1)))


class MLP(nn.Module):
    """Feed-forward: ``w2(gelu(w1 x))``, or SwiGLU ``w2(silu(w1 x) · w3 x)``. ``w2`` writes back to the residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=config.bias)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=config.bias) if config.mlp == "swiglu" else None
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.w3 is None:
            hidden = F.gelu(self.w1(x), approximate="tanh")
        else:
            hidden = F.silu(self.w1(x)) * self.w3(x)
        return self.dropout(self.w2(hidden))


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.dim, eps=config.norm_eps)
    return nn.LayerNorm(config.dim, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the MLP may be a MoE."""

    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config)
        if config.uses_moe(index):
            assert config.moe is not None
            self.mlp: nn.Module = config.moe.build(config.dim, config.ffn_dim, config.mlp)
        else:
            self.mlp = MLP(config)

    def forward(self, x: Tensor, rope: Rope = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer: token ids ``[B, T]`` → logits ``[B, T, vocab_size]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config)
        self.rope = (
            RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
            if config.positions == "rotary" else None
        )
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = make_norm(config)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.tokens.weight
        self.init_weights()

    def forward(self, idx: Tensor) -> Tensor:
        seq_len = idx.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"Sequence length {seq_len} exceeds max_seq_len={self.config.max_seq_len}.")
        x = self.embed(idx)
        rope = self.rope(seq_len) if self.rope is not None else None
        for block in self.blocks:
            x = block(x, rope)
        return self.head(self.norm(x))

    @staticmethod
    def loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
        """Mean next-token cross-entropy in fp32 (fp64 for fp64 logits) over targets that are not ``ignore_index``.

        Logits sharded over the vocabulary (a DTensor, under tensor parallelism with loss parallelism) are
        never gathered; the loss comes back as an ordinary tensor.
        """
        logits = logits.flatten(0, -2)
        logits = logits.double() if logits.dtype == torch.float64 else logits.float()  # fp64 models keep fp64
        loss = F.cross_entropy(logits, targets.flatten(), ignore_index=ignore_index)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialization drawn from one generator per parameter, seeded by ``init_seed`` and its name.

        Linear and embedding weights, routers and experts ~ N(0, init_std); the projections that write to the
        residual stream (``attn.wo``, ``mlp.w2``, experts' ``w2``) use ``init_std / sqrt(2·n_layers)``; biases
        0, norm weights 1, expert biases 0. Skipped for tensors on the meta device (call again after
        ``to_empty``).
        """
        config = self.config
        residual_std = config.init_std / math.sqrt(2 * config.n_layers)
        seen: set[int] = set()
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) in seen or param.is_meta:
                    continue
                seen.add(id(param))
                name = f"{module_name}.{param_name}" if module_name else param_name
                if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or param_name == "bias":
                    param.fill_(1.0 if param_name == "weight" else 0.0)
                    continue
                residual = name.endswith(("attn.wo.weight", "mlp.w2.weight", "mlp.experts.w2"))
                std = residual_std if residual else config.init_std
                seed = (config.init_seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
                generator = torch.Generator(device=param.device).manual_seed(seed)
                nn.init.normal_(param, mean=0.0, std=std, generator=generator)
        if self.rope is not None:
            self.rope.reset_parameters()
        for module in self.modules():
            if isinstance(module, MoE) and not module.router.expert_bias.is_meta:
                module.router.expert_bias.zero_()

    def num_params(self, *, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights once). ``exclude_embeddings`` drops the lookup tables but keeps a tied
        LM head, whose matmul is real work."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(p.numel() for p in self.embed.parameters())
            if self.config.tie_embeddings:
                total += self.head.weight.numel()
        return total

    def num_active_params(self) -> int:
        """Non-embedding parameters one token is multiplied by: in MoE layers only ``top_k`` of the experts."""
        inactive = sum(
            sum(p.numel() for p in module.experts.parameters()) * (module.num_experts - module.top_k)
            // module.num_experts
            for module in self.modules() if isinstance(module, MoE)
        )
        return self.num_params(exclude_embeddings=True) - inactive

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM/torchtitan convention for MFU.

        ``6·N`` for the matmuls of the N non-embedding parameters a token uses (:meth:`num_active_params`),
        plus ``12·layers·heads·head_dim·seq`` for the attention scores and values (two matmuls, ×3 for
        backward, ×2 for multiply-add; causal masking not discounted).
        """
        seq = seq_len or self.config.max_seq_len
        c = self.config
        return 6 * self.num_active_params() + 12 * c.n_layers * c.n_heads * c.head_dim * seq
