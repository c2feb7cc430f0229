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
  (:mod:`meshlight.parallel.expert`) installs an all-to-all one; tensor parallelism
  (:mod:`meshlight.parallel.expert_tensor`) splits each expert over the tp ranks or folds the experts across them.
- **Balancing**: the Switch/GShard auxiliary loss ``E·Σ_e f_e·P_e`` (per sequence by default, or with ``f`` over
  every data-parallel rank's micro-batch), the router z-loss ``mean(logsumexp(logits)²)``, and aux-loss-free
  expert bias moved against each expert's load after every optimizer step (the step's own load, ready for the
  next forward; in proportion to the load's error by default, or by a fixed step). The losses reach the router's
  gradient through autograd — the training loss needs no change — and are reported with the expert load in
  :attr:`MoE.last_step`.
- **After each optimizer step**: :func:`attach_moe_updates` puts a hook on the optimizer that finishes the step
  of its MoE layers (load summed over data-parallel ranks, ``last_step``, expert bias). meshlight's strategies
  and :class:`~meshlight.callbacks.ExpertLoadMonitor` call it; a plain PyTorch loop calls it once.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from meshlight.nn.experts import GroupedExperts, Router, Routing

if TYPE_CHECKING:
    from meshlight.parallel.context import SequenceShares
    from meshlight.parallel.expert_tensor import ExpertTensorParallel

__all__ = ["ExpertLoad", "MoE", "MoEConfig", "MoEUpdates", "attach_moe_updates"]

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
    expert_bias_rate: float = 1e-2
    expert_bias_update: Literal["sign", "proportional"] = "proportional"
    grouped_mm: Optional[bool] = None
    balance: Literal["sequence", "global"] = "sequence"

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
        if self.balance not in ("global", "sequence"):
            raise ValueError(f"balance={self.balance!r}; choose 'sequence' (the aux loss per sequence, averaged) or"
                             " 'global' (from the expert counts of every data-parallel rank's micro-batch).")
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
        balance: what the load-balancing loss ``E·Σ_e f_e·P_e`` balances. ``"sequence"`` (default): each
            sequence's, averaged (GShard's groups, DeepSeek-V3's sequence-wise loss): the same in every layout,
            pipeline microbatches included. ``"global"``: the expert shares ``f`` of the whole micro-batch of every
            data-parallel rank (counts all-reduced over the data-parallel group, as Megatron-Core's
            ``global_aux_loss`` does over its batch); under pipeline parallelism each pipeline microbatch's (one
            process matches it with the same batches).
        z_loss_coeff: weight of the router z-loss (0 = off).
        expert_bias_rate: aux-loss-free balancing — after each optimizer step every expert's bias moves
            against its load in that step (0 = off; DeepSeek-V3 uses 1e-3 with the sign rule). The defaults —
            this bias at 1e-2, moved proportionally, beside the aux loss — keep the demo's experts within
            1.2× of an even load on every seed tried (``benchmarks/RESULTS.md``; the aux loss alone does not).
        expert_bias_update: how far the bias moves. ``"proportional"`` (default): by
            ``expert_bias_rate · (mean − load) / mean``, the full rate for an idle expert and less the nearer an
            expert is to its even share (overloaded experts may move more: twice the rate at three times the mean
            load), so the biases settle instead of stepping past balance. ``"sign"`` (DeepSeek-V3, Megatron-Core,
            torchtitan): by ``expert_bias_rate`` whatever the load's error; use it with ``score="sigmoid"``, as
            DeepSeek-V3 does: softmax scores of an untrained router differ across tokens by less than one bias
            step, so each full step moves whole batches between experts.
        grouped_mm: use ``torch._grouped_mm`` (None: where it runs), or a loop over experts (False).
        init_std: standard deviation of the initial weights.

    The auxiliary losses are added to the gradients scaled by :attr:`aux_gradient_scale` (set by
    :class:`~meshlight.callbacks.ExpertLoadMonitor` to match Lightning's loss scaling under gradient
    accumulation); :attr:`last_step` holds the expert load of the last optimizer step, which needs
    :func:`attach_moe_updates` on the optimizer (meshlight's strategies and ``ExpertLoadMonitor`` call it).
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
        expert_bias_rate: float = 1e-2,
        expert_bias_update: Literal["sign", "proportional"] = "proportional",
        grouped_mm: Optional[bool] = None,
        balance: Literal["sequence", "global"] = "sequence",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if activation not in ("swiglu", "gelu"):
            raise ValueError(f"activation={activation!r}; choose 'swiglu' or 'gelu'.")
        self.config = MoEConfig(
            num_experts, top_k, hidden_dim, score, normalize_top_k, capacity_factor, min_capacity,
            aux_loss_coeff, z_loss_coeff, expert_bias_rate, expert_bias_update, grouped_mm, balance,
        )
        self.num_experts, self.top_k, self.init_std = num_experts, top_k, init_std
        self.router = Router(dim, num_experts, top_k, score, self.config.normalizes)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim, activation, grouped_mm)
        # Set by expert / data parallelism: how tokens reach the experts, and the ranks whose loads add up.
        self.dispatcher: Dispatcher = _call_experts
        # Set by tensor parallelism (meshlight.parallel.expert_tensor.ExpertTensorParallel): the whole tokens on every
        # tp rank, the router's gradients made whole, this rank's part of the expert work, the output's partial sums.
        self.tensor_parallel: Optional[ExpertTensorParallel] = None
        # Set by context parallelism (meshlight.parallel.context.SequenceShares): each sequence's tokens spread over
        # ranks, whose routing is gathered to count capacity and balance per whole sequence.
        self.sequence_split: Optional[SequenceShares] = None
        self.data_parallel_group: Optional[dist.ProcessGroup] = None
        self.aux_gradient_scale = 1.0
        self.last_step: Optional[ExpertLoad] = None
        self._pending: Optional[Tensor] = None  # this step's [tokens per expert, dropped, assigned, aux, z, forwards]
        self._updates: Optional[weakref.ref[MoEUpdates]] = None  # the optimizer hook finishing this layer's steps
        self._warned_unattached = False
        self.reset_parameters()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_updates"] = None  # a copy is not what the original's optimizer updates (and weakrefs do not pickle)
        return state

    def reset_parameters(self) -> None:
        for param in (self.router.gate.weight, *self.experts.parameters()):
            if not param.is_meta:
                nn.init.normal_(param, mean=0.0, std=self.init_std)
        if not self.router.expert_bias.is_meta:
            self.router.expert_bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        tp = self.tensor_parallel
        if tp is not None:
            x = tp.whole(x)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        seq_len = shape[-2] if x.dim() >= 3 else tokens.shape[0]
        routing = self.router(tokens) if tp is None else tp.route(self.router, tokens)
        keep = self._capacity_mask(routing, seq_len) if self.config.capacity_factor is not None else None
        out = self._dispatch_and_combine(tokens, routing, keep)
        if self.training and torch.is_grad_enabled() and not x.is_meta:
            aux, z = self._balance_losses(routing, seq_len)
            loss = self.config.aux_loss_coeff * aux + self.config.z_loss_coeff * z
            if loss.requires_grad:
                out = _AttachLoss.apply(out, loss, self.aux_gradient_scale)
            if torch._C._current_graph_task_id() == -1:  # not an activation-checkpointing recompute
                self._record(routing, keep, aux, z)
        out = out.view(shape)
        return out if tp is None else tp.share(out)

    def capacity(self, seq_len: int) -> int:
        """Assignments each expert accepts per sequence of ``seq_len`` tokens (with a capacity factor)."""
        assert self.config.capacity_factor is not None
        even_share = seq_len * self.top_k / self.num_experts
        return max(self.config.min_capacity, math.ceil(even_share * self.config.capacity_factor))

    def _capacity_mask(self, routing: Routing, seq_len: int) -> Tensor:
        """``[N, k]``: which assignments fit their expert's capacity in their sequence, highest scores first (the whole
        sequence's, where context parallelism spreads it over ranks)."""
        k, num_experts = self.top_k, self.num_experts
        experts = routing.experts.view(-1, seq_len, k)
        scores = routing.scores.gather(-1, routing.experts).detach().view(-1, seq_len, k)
        split = self._split()
        if split is not None:
            experts, scores = split.whole(experts), split.whole(scores)
            seq_len = experts.shape[1]
        experts, scores = experts.reshape(-1, seq_len * k), scores.reshape(-1, seq_len * k)
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
        if split is not None:
            keep = split.local(keep.view(-1, seq_len, k))
        return keep.view(-1, k)

    def _split(self) -> Optional[SequenceShares]:
        """The ranks sharing each sequence, while more than one does."""
        split = self.sequence_split
        return split if split is not None and split.count > 1 else None

    def _dispatch_and_combine(self, tokens: Tensor, routing: Routing, keep: Optional[Tensor]) -> Tensor:
        num_tokens, k = routing.experts.shape
        flat_experts = routing.experts.flatten()
        slots = keep.flatten().nonzero().squeeze(1) if keep is not None else torch.arange(
            num_tokens * k, device=tokens.device)
        if self.tensor_parallel is not None:
            slots = self.tensor_parallel.own_slots(slots, num_tokens * k)
        slots = slots[flat_experts[slots].argsort(stable=True)]  # assignment slots grouped by expert
        counts = torch.bincount(flat_experts[slots], minlength=self.num_experts)
        expert_out = self.dispatcher(tokens[slots // k], counts, self.experts)
        per_slot = tokens.new_zeros(num_tokens * k, tokens.shape[-1]).index_copy(0, slots, expert_out)
        weights = routing.weights.to(tokens.dtype).unsqueeze(-1)
        return (per_slot.view(num_tokens, k, -1) * weights).sum(1)

    def _balance_losses(self, routing: Routing, seq_len: int) -> tuple[Tensor, Tensor]:
        """Load-balancing loss per sequence ``E·Σ_e f_e·P_e`` (f: share of the sequence's assignments, P: mean
        score share), averaged over sequences; and the z-loss ``mean(logsumexp(logits)²)``. Under context parallelism
        f counts the whole sequence and P this rank's tokens: the ranks' mean is the whole sequence's loss, and each
        rank's gradient cp times its part, as context parallelism weighs the training loss."""
        scores = routing.scores
        probs = scores if self.config.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        z = torch.logsumexp(routing.logits, dim=-1).square().mean()
        if self.config.balance == "global":
            return self._global_balance_loss(routing.experts, probs), z
        experts = routing.experts.reshape(-1, seq_len * self.top_k)
        counts = torch.zeros(experts.shape[0], self.num_experts, device=scores.device)
        counts.scatter_add_(-1, experts, torch.ones_like(experts, dtype=counts.dtype))
        split = self._split()
        if split is not None:  # the whole sequence's shares; the mean score stays this rank's tokens' (see below)
            counts = split.summed(counts)
        share = counts / counts.sum(-1, keepdim=True).clamp_min(1)
        mean_prob = probs.view(-1, seq_len, self.num_experts).mean(1)
        aux = self.num_experts * (share * mean_prob).sum(-1).mean()
        return aux, z

    def _global_balance_loss(self, experts: Tensor, probs: Tensor) -> Tensor:
        """``E·Σ_e f_e·P_e`` with ``f`` the shares of every data-parallel rank's assignments in this forward and ``P``
        this rank's tokens' mean score: averaged over the ranks (as their gradients are), the loss of their whole
        micro-batch."""
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).to(probs.dtype)
        group = self.data_parallel_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        share = counts / counts.sum().clamp_min(1)
        return self.num_experts * (share * probs.mean(0)).sum()

    def _record(self, routing: Routing, keep: Optional[Tensor], aux: Tensor, z: Tensor) -> None:
        if self.config.expert_bias_rate > 0 and not self._warned_unattached and (
                self._updates is None or self._updates() is None):
            self._warned_unattached = True
            warnings.warn(
                f"This MoE layer (expert_bias_rate={self.config.expert_bias_rate}) is training, but no optimizer"
                " moves its expert bias: call meshlight.nn.attach_moe_updates(optimizer, model) once the optimizer"
                " exists (meshlight's strategies, and ExpertLoadMonitor, which meshlight.Trainer adds, do it).",
                stacklevel=2)
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


def attach_moe_updates(optimizer: Optimizer, model: nn.Module) -> Optional[MoEUpdates]:
    """After every step of ``optimizer``, finish the step of each MoE layer of ``model`` whose parameters it holds:
    sum the layer's load over its data-parallel ranks, report it in :attr:`MoE.last_step`, move its expert bias.

    Call it once the optimizer exists and holds the parameters ``model`` has now (``fully_shard`` replaces
    them, so after parallelizing); again after ``add_param_group``. A second call adds any new layers to the
    same hook. Returns that hook (``remove()`` takes it off), or None when the optimizer holds no MoE
    layer's parameters, which then gets no hook.
    """
    held = {id(param) for group in optimizer.param_groups for param in group["params"]}
    layers = [m for m in model.modules() if isinstance(m, MoE) and any(id(p) in held for p in m.parameters())]
    updates: Optional[MoEUpdates] = getattr(optimizer, _UPDATES, None)
    if updates is None and layers:
        updates = MoEUpdates(optimizer)
    if updates is not None:
        updates.add(layers)
    return updates


class MoEUpdates:
    """The step post-hook of one optimizer that finishes its MoE layers' steps (see :func:`attach_moe_updates`).

    After the step, not before: Lightning (and any closure-taking loop) runs the step's forwards inside
    ``optimizer.step(closure)``, so only then are they all counted.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.layers: list[MoE] = []  # in model order: every rank issues the same all-reduces in the same order
        self._optimizer = weakref.ref(optimizer)
        self._handle: RemovableHandle = optimizer.register_step_post_hook(self._after_step)
        setattr(optimizer, _UPDATES, self)

    def add(self, layers: Sequence[MoE]) -> None:
        for layer in layers:
            if layer not in self.layers:
                self.layers.append(layer)
            layer._updates = weakref.ref(self)

    def remove(self) -> None:
        """Take the hook off its optimizer: its layers' steps are no longer finished."""
        self._handle.remove()
        optimizer = self._optimizer()
        if optimizer is not None and getattr(optimizer, _UPDATES, None) is self:
            delattr(optimizer, _UPDATES)
        for layer in self.layers:
            if layer._updates is not None and layer._updates() is self:
                layer._updates = None

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        _finish_steps(self.layers)


_UPDATES = "_meshlight_moe_updates"  # the optimizer's attribute holding its MoEUpdates


def _finish_steps(layers: Sequence[MoE]) -> None:
    """Sum the statistics of the ``layers`` that ran since their last step over their data-parallel ranks (one
    all-reduce per group; every rank of a group must give the same layers in the same order), record them
    and move the expert biases."""
    by_group: dict[Optional[dist.ProcessGroup], list[MoE]] = defaultdict(list)
    for layer in layers:
        if layer._pending is not None:
            by_group[layer.data_parallel_group].append(layer)
    for group, members in by_group.items():
        stats = torch.cat([layer._pending for layer in members])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        for layer, part in zip(members, stats.split([layer._pending.numel() for layer in members])):
            layer._finish_step(part)
