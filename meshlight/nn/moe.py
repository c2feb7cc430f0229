"""Mixture-of-Experts feed-forward layer: a router sends each token to ``top_k`` of ``num_experts`` MLPs.

In the order a token meets it:

- **Router**: a bias-free ``gate`` applied in fp32; softmax or sigmoid scores; the ``top_k`` experts by
  score (plus ``expert_bias`` when aux-loss-free balancing is on — it changes which experts are chosen,
  not their weights); the chosen scores renormalized to sum to 1 when ``normalize_top_k``.
- **Capacity** (optional): an expert takes at most ``capacity`` tokens of each sequence; beyond that, the
  assignments with the lowest router scores are dropped (the token keeps its other experts and the
  residual). Counting per sequence — GShard's groups — makes dropping independent of how a batch is split
  across devices or pipeline microbatches.
- **Experts**: stacked weights ``w1, w3: [E, dim, hidden]`` and ``w2: [E, hidden, dim]``; the tokens,
  sorted by expert, go through one grouped GEMM per weight (``torch._grouped_mm``) or a loop over experts.
- **Dispatch**: :attr:`MoE.dispatcher` moves the sorted tokens to the ranks holding their experts and the
  results back; here it calls the experts directly. Expert parallelism
  (:mod:`meshlight.parallel.expert`) installs an all-to-all one.
- **Balancing**: the Switch/GShard auxiliary loss ``E·Σ_e f_e·P_e`` (per sequence, averaged), the router
  z-loss ``mean(logsumexp(logits)²)``, and aux-loss-free expert bias moved against each expert's load
  after every optimizer step (the step's own load, ready for the next forward; by a fixed step or in
  proportion to the load's error). The losses reach the router's gradient through autograd — the training
  loss needs no change — and are reported with the expert load in :attr:`MoE.last_step`.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["ExpertLoad", "GroupedExperts", "MoE", "MoEConfig", "Router", "grouped_matmul"]

Dispatcher = Callable[[Tensor, Tensor, "GroupedExperts"], Tensor]


@dataclass(frozen=True)
class MoEConfig:
    """Options of a :class:`MoE` layer besides its sizes (see :class:`MoE` for each).

    ``hidden_dim`` is each expert's MLP width; None: the model's (used by :class:`~meshlight.models.GPT`).
    """

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: Optional[int] = None
    score: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: Optional[bool] = None
    capacity_factor: Optional[float] = None
    min_capacity: int = 4
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    expert_bias_rate: float = 0.0
    expert_bias_update: Literal["sign", "proportional"] = "sign"
    grouped_mm: Optional[bool] = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts!r} must be a positive integer.")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k!r} must be between 1 and num_experts={self.num_experts}: each token picks top_k"
                " different experts (1 = Switch, 2 = GShard)."
            )
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"score={self.score!r}; choose 'softmax' or 'sigmoid'.")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor!r} must be > 0 (1.0 = room for an even share of each"
                " sequence's tokens per expert), or None for no token dropping."
            )
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity={self.min_capacity} must be >= 0.")
        for name in ("aux_loss_coeff", "z_loss_coeff", "expert_bias_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 turns it off).")
        if self.expert_bias_update not in ("sign", "proportional"):
            raise ValueError(f"expert_bias_update={self.expert_bias_update!r}; choose 'sign' (DeepSeek-V3) or"
                             " 'proportional'.")

    @property
    def normalizes(self) -> bool:
        return self.top_k > 1 if self.normalize_top_k is None else self.normalize_top_k

    def build(self, dim: int, hidden_dim: int, activation: Literal["swiglu", "gelu"] = "swiglu") -> MoE:
        """A :class:`MoE` of these options (``self.hidden_dim`` wins over ``hidden_dim`` when set)."""
        options = {k: v for k, v in asdict(self).items() if k not in ("num_experts", "top_k", "hidden_dim")}
        return MoE(dim, self.hidden_dim or hidden_dim, self.num_experts, self.top_k, activation=activation, **options)


class Routing(NamedTuple):
    logits: Tensor  # [N, E] fp32
    scores: Tensor  # [N, E] softmax or sigmoid of the logits
    experts: Tensor  # [N, k] chosen experts
    weights: Tensor  # [N, k] their gate weights


@dataclass(frozen=True)
class ExpertLoad:
    """What one MoE layer did in the last optimizer step, summed over every forward of the step (all
    gradient-accumulation micro-batches and pipeline microbatches) and every data-parallel rank."""

    tokens: Tensor  # [E] token assignments routed to each expert, before capacity dropping
    dropped_fraction: float  # of all assignments
    aux_loss: float  # mean over forwards, without its coefficient
    z_loss: float

    @property
    def fraction(self) -> Tensor:
        """Share of the assignments routed to each expert (sums to 1)."""
        return self.tokens / self.tokens.sum().clamp_min(1)

    @property
    def imbalance(self) -> float:
        """max / mean of the expert loads: 1.0 is perfect balance, ``num_experts`` is one expert taking all."""
        return float(self.tokens.max() / self.tokens.mean().clamp_min(1e-12))


class Router(nn.Module):
    """Scores every expert for every token in fp32 and picks the ``top_k``."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str, normalize: bool) -> None:
        super().__init__()
        self.top_k, self.score, self.normalize = top_k, score, normalize
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # Aux-loss-free balancing (DeepSeek-V3): added to the scores for the choice only; moved by MoE.
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor) -> Routing:
        logits = F.linear(x.float(), self.gate.weight.float())
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
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return _ScaleGradient.apply(local, self.gradient_scale) if self.gradient_scale != 1.0 else local


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


class MoE(nn.Module):
    """A feed-forward replacement, ``[..., dim] → [..., dim]``, routing each token to ``top_k`` experts.

    Args:
        dim, hidden_dim: model width and each expert's MLP width.
        num_experts, top_k: experts, and how many each token uses (1 = Switch, 2 = GShard).
        activation: ``"swiglu"`` or ``"gelu"`` experts.
        score: ``"softmax"`` or ``"sigmoid"`` router scores.
        normalize_top_k: renormalize the chosen scores to sum to 1 (default: when ``top_k > 1``).
        capacity_factor: None (default) drops nothing. Otherwise each expert takes at most
            ``max(min_capacity, ceil(T·top_k/E · capacity_factor))`` of the T tokens of each sequence
            (the last-but-one input dimension; a 2-D input is one sequence), dropping the lowest scores.
        aux_loss_coeff: weight of the load-balancing loss (0 = off).
        z_loss_coeff: weight of the router z-loss (0 = off).
        expert_bias_rate: aux-loss-free balancing — after each optimizer step every expert's bias moves
            against its load in that step (0 = off; DeepSeek-V3 uses 1e-3). Use it with
            ``score="sigmoid"``, as DeepSeek-V3 does: softmax scores of an untrained router differ across
            tokens by less than one bias step, so each step moves whole batches between experts.
        expert_bias_update: how far the bias moves. ``"sign"`` (DeepSeek-V3, Megatron-Core, torchtitan): by
            ``expert_bias_rate`` whatever the load's error, so near balance the biases keep stepping by the
            full rate. ``"proportional"``: by ``expert_bias_rate · (mean − load) / mean``, the full rate for an
            idle expert and less the nearer an expert is to its even share (overloaded experts may move
            more: twice the rate at three times the mean load).
        grouped_mm: use ``torch._grouped_mm`` (None: where it runs), or a loop over experts (False).
        init_std: standard deviation of the initial weights.

    The auxiliary losses are added to the gradients scaled by :attr:`aux_gradient_scale` (set by
    :class:`~meshlight.callbacks.ExpertLoadMonitor` to match Lightning's loss scaling under gradient
    accumulation); :attr:`last_step` holds the expert load of the last optimizer step.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        *,
        activation: Literal["swiglu", "gelu"] = "swiglu",
        score: Literal["softmax", "sigmoid"] = "softmax",
        normalize_top_k: Optional[bool] = None,
        capacity_factor: Optional[float] = None,
        min_capacity: int = 4,
        aux_loss_coeff: float = 1e-2,
        z_loss_coeff: float = 0.0,
        expert_bias_rate: float = 0.0,
        expert_bias_update: Literal["sign", "proportional"] = "sign",
        grouped_mm: Optional[bool] = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation={activation!r}; choose 'swiglu' or 'gelu'.")
        self.config = MoEConfig(
            num_experts, top_k, hidden_dim, score, normalize_top_k, capacity_factor, min_capacity,
            aux_loss_coeff, z_loss_coeff, expert_bias_rate, expert_bias_update, grouped_mm,
        )
        self.num_experts, self.top_k, self.init_std = num_experts, top_k, init_std
        self.router = Router(dim, num_experts, top_k, score, self.config.normalizes)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim, activation, grouped_mm)
        # Set by expert / data parallelism: how tokens reach the experts, and the ranks whose loads add up.
        self.dispatcher: Dispatcher = _call_experts
        self.data_parallel_group: Optional[dist.ProcessGroup] = None
        self.aux_gradient_scale = 1.0
        self.last_step: Optional[ExpertLoad] = None
        self._pending: Optional[Tensor] = None  # this step's [tokens per expert, dropped, assigned, aux, z, forwards]
        self._order = next(_CREATION_ORDER)
        _LAYERS.add(self)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for param in (self.router.gate.weight, *self.experts.parameters()):
            if not param.is_meta:
                nn.init.normal_(param, mean=0.0, std=self.init_std)
        if not self.router.expert_bias.is_meta:
            self.router.expert_bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        seq_len = shape[-2] if x.dim() >= 3 else tokens.shape[0]
        routing = self.router(tokens)
        keep = self._capacity_mask(routing, seq_len) if self.config.capacity_factor is not None else None
        out = self._dispatch_and_combine(tokens, routing, keep)
        if self.training and torch.is_grad_enabled() and not x.is_meta:
            aux, z = self._balance_losses(routing, seq_len)
            loss = self.config.aux_loss_coeff * aux + self.config.z_loss_coeff * z
            if loss.requires_grad:
                out = _AttachLoss.apply(out, loss, self.aux_gradient_scale)
            if torch._C._current_graph_task_id() == -1:  # not an activation-checkpointing recompute
                self._record(routing, keep, aux, z)
        return out.view(shape)

    def capacity(self, seq_len: int) -> int:
        """Assignments each expert accepts per sequence of ``seq_len`` tokens (with a capacity factor)."""
        assert self.config.capacity_factor is not None
        even_share = seq_len * self.top_k / self.num_experts
        return max(self.config.min_capacity, math.ceil(even_share * self.config.capacity_factor))

    def _capacity_mask(self, routing: Routing, seq_len: int) -> Tensor:
        """``[N, k]``: which assignments fit their expert's capacity in their sequence, highest scores first."""
        k, num_experts = self.top_k, self.num_experts
        experts = routing.experts.reshape(-1, seq_len * k)
        scores = routing.scores.gather(-1, routing.experts).detach().reshape(-1, seq_len * k)
        # Sort each sequence's assignments by expert, and within an expert by score (ties: position).
        by_score = scores.argsort(dim=-1, descending=True, stable=True)
        order = by_score.gather(-1, experts.gather(-1, by_score).argsort(dim=-1, stable=True))
        sorted_experts = experts.gather(-1, order)
        counts = torch.zeros(experts.shape[0], num_experts, dtype=torch.long, device=experts.device)
        counts.scatter_add_(-1, sorted_experts, torch.ones_like(sorted_experts))
        starts = (counts.cumsum(-1) - counts).gather(-1, sorted_experts)
        rank_in_expert = torch.arange(seq_len * k, device=experts.device) - starts
        keep = torch.empty_like(rank_in_expert, dtype=torch.bool)
        keep.scatter_(-1, order, rank_in_expert < self.capacity(seq_len))
        return keep.view(-1, k)

    def _dispatch_and_combine(self, tokens: Tensor, routing: Routing, keep: Optional[Tensor]) -> Tensor:
        num_tokens, k = routing.experts.shape
        flat_experts = routing.experts.flatten()
        slots = keep.flatten().nonzero().squeeze(1) if keep is not None else torch.arange(
            num_tokens * k, device=tokens.device)
        slots = slots[flat_experts[slots].argsort(stable=True)]  # assignment slots grouped by expert
        counts = torch.bincount(flat_experts[slots], minlength=self.num_experts)
        expert_out = self.dispatcher(tokens[slots // k], counts, self.experts)
        per_slot = tokens.new_zeros(num_tokens * k, tokens.shape[-1]).index_copy(0, slots, expert_out)
        weights = routing.weights.to(tokens.dtype).unsqueeze(-1)
        return (per_slot.view(num_tokens, k, -1) * weights).sum(1)

    def _balance_losses(self, routing: Routing, seq_len: int) -> tuple[Tensor, Tensor]:
        """Load-balancing loss per sequence ``E·Σ_e f_e·P_e`` (f: share of the sequence's assignments, P: mean
        score share), averaged over sequences; and the z-loss ``mean(logsumexp(logits)²)``."""
        scores = routing.scores
        probs = scores if self.config.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        experts = routing.experts.reshape(-1, seq_len * self.top_k)
        counts = torch.zeros(experts.shape[0], self.num_experts, device=scores.device)
        counts.scatter_add_(-1, experts, torch.ones_like(experts, dtype=counts.dtype))
        share = counts / (seq_len * self.top_k)
        mean_prob = probs.view(-1, seq_len, self.num_experts).mean(1)
        aux = self.num_experts * (share * mean_prob).sum(-1).mean()
        z = torch.logsumexp(routing.logits, dim=-1).square().mean()
        return aux, z

    def _record(self, routing: Routing, keep: Optional[Tensor], aux: Tensor, z: Tensor) -> None:
        counts = torch.bincount(routing.experts.flatten(), minlength=self.num_experts).double()
        assigned = routing.experts.new_tensor(routing.experts.numel(), dtype=torch.float64)
        dropped = (~keep).sum().double() if keep is not None else torch.zeros_like(assigned)
        one = torch.ones_like(assigned)
        stats = torch.cat([counts, torch.stack([dropped, assigned, aux.detach().double(), z.detach().double(), one])])
        self._pending = stats if self._pending is None else self._pending + stats

    def _finish_step(self, stats: Tensor) -> None:
        """Called after an optimizer step with this step's statistics summed over the data-parallel ranks."""
        tokens, (dropped, assigned, aux, z, forwards) = stats[: self.num_experts], stats[self.num_experts:].tolist()
        self.last_step = ExpertLoad(tokens.float().cpu(), dropped / max(assigned, 1), aux / forwards, z / forwards)
        if self.config.expert_bias_rate > 0:
            mean = tokens.mean()  # a step without tokens (mean 0) moves nothing
            step = (mean - tokens).sign() if self.config.expert_bias_update == "sign" else (
                (mean - tokens) / mean.clamp_min(1e-12))
            with torch.no_grad():
                self.router.expert_bias += self.config.expert_bias_rate * step.float()
        self._pending = None


def _call_experts(tokens: Tensor, counts: Tensor, experts: GroupedExperts) -> Tensor:
    return experts(tokens, counts)


class _AttachLoss(torch.autograd.Function):
    """Returns ``output`` unchanged; in backward also sends gradient ``scale`` into ``loss``, as if ``loss``
    had been added to the training loss."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


# Every MoE layer alive, so the optimizer-step hook below can finish their steps without being told about them.
_LAYERS: weakref.WeakSet[MoE] = weakref.WeakSet()
_CREATION_ORDER = itertools.count()


def _finish_moe_steps(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer step: sum each MoE layer's statistics over its data-parallel ranks (one all-reduce
    per group; every rank of a group holds the same layers, created in the same order), record them and move
    the expert biases. After, not before: Lightning (and any closure-taking loop) runs the step's forwards
    inside ``optimizer.step(closure)``, so only then are they all counted."""
    by_group: dict[Optional[dist.ProcessGroup], list[MoE]] = defaultdict(list)
    for layer in sorted((m for m in _LAYERS if m._pending is not None), key=lambda m: m._order):
        by_group[layer.data_parallel_group].append(layer)
    for group, layers in by_group.items():
        stats = torch.cat([layer._pending for layer in layers])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        for layer, part in zip(layers, stats.split([layer._pending.numel() for layer in layers])):
            layer._finish_step(part)


register_optimizer_step_post_hook(_finish_moe_steps)
