"""The parts of a Mixture-of-Experts layer that route tokens and compute experts: the router (top-k of fp32 scores,
with aux-loss-free bias) and the experts as stacked weights run by grouped GEMMs (see :mod:`meshlight.nn.moe`)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["GroupedExperts", "Router", "Routing", "grouped_matmul", "local_weight", "scale_gradient"]


class Routing(NamedTuple):
    logits: Tensor  # [N, E] fp32
    scores: Tensor  # [N, E] softmax or sigmoid of the logits
    experts: Tensor  # [N, k] chosen experts
    weights: Tensor  # [N, k] their gate weights


class Router(nn.Module):
    """Scores every expert for every token in fp32 and picks the ``top_k``."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str, normalize: bool) -> None:
        super().__init__()
        self.top_k, self.score, self.normalize = top_k, score, normalize
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # Aux-loss-free balancing (DeepSeek-V3): added to the scores for the choice only; moved by MoE.
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor) -> Routing:
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32 (fp64 models stay fp64)
        logits = F.linear(x.to(dtype), self.gate.weight.to(dtype))
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        experts = (scores.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(logits, scores, experts, weights)


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs as stacked weights: SwiGLU ``w2(silu(x·w1) · x·w3)`` or GELU ``w2(gelu(x·w1))``.

    ``forward(tokens, counts)`` takes tokens sorted by expert and the count of each. Under expert
    parallelism the weights are DTensors sharded over experts and this rank runs its own;
    ``gradient_scale`` then corrects for each expert seeing the tokens of ``ep`` data ranks.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, activation: str, grouped_mm: Optional[bool]):
        super().__init__()
        self.activation, self.grouped_mm = activation, grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim)) if activation == "swiglu" else None
        self.gradient_scale = 1.0

    def forward(self, tokens: Tensor, counts: Tensor) -> Tensor:
        w1, w2 = self._local(self.w1), self._local(self.w2)
        hidden = grouped_matmul(tokens, w1, counts, self.grouped_mm)
        if self.w3 is None:
            hidden = F.gelu(hidden, approximate="tanh")
        else:
            hidden = F.silu(hidden) * grouped_matmul(tokens, self._local(self.w3), counts, self.grouped_mm)
        return grouped_matmul(hidden, w2, counts, self.grouped_mm)

    def _local(self, weight: Tensor) -> Tensor:
        return local_weight(weight, self.gradient_scale)


def local_weight(weight: Tensor, gradient_scale: float = 1.0) -> Tensor:
    """This rank's experts of ``weight`` (a DTensor sharded over experts, or a plain tensor), its gradient scaled by
    ``gradient_scale`` (``1/ep``: each expert sees the tokens of ``ep`` data ranks)."""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return scale_gradient(local, gradient_scale)


def scale_gradient(x: Tensor, scale: float) -> Tensor:
    """``x`` unchanged; its gradient multiplied by ``scale`` in backward."""
    return _ScaleGradient.apply(x, scale) if scale != 1.0 else x


def grouped_matmul(x: Tensor, weights: Tensor, counts: Tensor, grouped_mm: Optional[bool] = None) -> Tensor:
    """Rows of ``x`` (``[sum(counts), in]``, grouped by expert) times their expert's ``weights[e]``
    (``[E, in, out]``). One ``torch._grouped_mm`` where it runs (``grouped_mm=None``: when available and the
    shapes are aligned), else a loop over experts; the two agree exactly on CPU."""
    if grouped_mm is not False and _grouped_mm_runs(x, weights):
        return torch._grouped_mm(x, weights, offs=counts.cumsum(0, dtype=torch.int32))
    if grouped_mm:
        raise RuntimeError(
            f"grouped_mm=True, but torch._grouped_mm cannot run {x.dtype} on {x.device} for shapes"
            f" {tuple(x.shape)} × {tuple(weights.shape)}; use grouped_mm=None to fall back to a loop."
        )
    chunks = x.split(counts.tolist())
    return torch.cat([chunk @ weights[e] for e, chunk in enumerate(chunks)])


def _grouped_mm_runs(x: Tensor, weights: Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0 or x.dtype != weights.dtype:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # torch 2.13's meta kernel (what torch.compile traces) refuses the fp32 its CPU kernel runs
    aligned = all(size * x.element_size() % 16 == 0 for size in (x.shape[-1], weights.shape[-1]))
    if x.device.type == "cpu":
        return aligned and x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None
