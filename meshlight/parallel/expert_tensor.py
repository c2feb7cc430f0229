"""MoE layers under tensor parallelism: attention is split as in any block, and the experts take one of two layouts.

- ``"split"`` (Megatron-Core's expert tensor parallelism): each expert is split over the tp ranks as a dense MLP is
  — ``w1``/``w3`` by columns, ``w2`` by rows — and every rank runs each routed token through its slice of the hidden
  width; the output is a partial sum over tp. Expert parallelism, if any, splits the experts over data ranks as well.
- ``"fold"`` (Megatron-Core's parallel folding): the tp ranks hold different experts — expert parallelism spans
  them — and each tp rank sends its part of the tokens to the experts; the output is again a sum over tp, each rank
  contributing its tokens' rows.

Either way every tp rank routes the whole tokens (under sequence parallelism the shares are all-gathered first), so
capacity and the balancing losses are counted per whole sequence, as on one device, and every tp rank routes alike.
Gradients: the tokens' are summed over tp (all-reduce, or reduce-scatter back to the shares); the router's reach it
divided by tp (they are the same on every rank), and its gate weights' gradient — a partial sum, each rank having
used them on its part of the work — is summed before it reaches the router, whose weight therefore gets the same
whole gradient on every tp rank and stays a plain replicated parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshlight.nn.experts import Router, Routing, scale_gradient
from meshlight.parallel.collectives import all_gather_along, reduce_scatter_along, sum_in_backward, sum_in_forward

__all__ = [
    "EXPERT_LAYOUTS", "ExpertLayout", "ExpertTensorParallel", "added_once", "check_expert_split", "contiguous_part",
    "grouped_split", "local_slice", "split_placements", "stacked_expert_width", "stacked_split_placements",
]

ExpertLayout = Literal["split", "fold"]
#: How a MoE layer's experts sit on the tp ranks (see the module's docstring).
EXPERT_LAYOUTS: tuple[ExpertLayout, ...] = ("split", "fold")


class ExpertTensorParallel:
    """What a :class:`~meshlight.nn.MoE` layer does differently on the ranks of tp ``group``: set as its
    ``tensor_parallel``. ``sequence_parallel``: the layer receives, and must return, this rank's share of the sequence
    (dimension −2); otherwise the whole tokens, the same on every rank. ``fold``: this rank dispatches only its part of
    the token assignments (the tp ranks hold different experts); otherwise every assignment, to its slice of every
    expert."""

    def __init__(self, group: dist.ProcessGroup, *, sequence_parallel: bool, fold: bool) -> None:
        self.group, self.sequence_parallel, self.fold = group, sequence_parallel, fold
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def whole(self, x: Tensor) -> Tensor:
        """The whole tokens; in backward each rank's partial gradient is summed (and cut back to its share)."""
        if self.sequence_parallel:
            return all_gather_along(x, x.dim() - 2, self.group)
        return sum_in_backward(x, self.group)

    def whole_weights(self, weights: Tensor, tokens: Tensor) -> Tensor:
        """A model's own router's ``weights`` for the whole ``tokens`` (:meth:`whole`), in the wider of their dtype
        and the tokens': a float32 router in a float64 model gets its gradient, the ranks' partial sums added, rounded
        to float32 once, as one process rounds it (not each rank's part)."""
        return self.whole(weights.to(torch.promote_types(weights.dtype, tokens.dtype)))

    def route(self, router: Router, tokens: Tensor) -> Routing:
        """``router``'s choice for the whole ``tokens``: the same on every rank; what reaches ``tokens`` from it is
        divided by tp (:meth:`whole` sums it), and the gate weights' partial gradients are summed."""
        routing = router(scale_gradient(tokens, 1.0 / self.size))
        return routing._replace(weights=sum_in_backward(routing.weights, self.group))

    def own_slots(self, slots: Tensor, total: int) -> Tensor:
        """The assignment ``slots`` (of ``total``, token-major) this rank sends to the experts: all of them when the
        experts are split; its contiguous part of the tokens' when they are folded."""
        if not self.fold:
            return slots
        return contiguous_part(slots, total, self.group)

    def share(self, out: Tensor) -> Tensor:
        """The layer's output summed over the ranks' parts: this rank's share of it under sequence parallelism."""
        if self.sequence_parallel:
            return reduce_scatter_along(out, out.dim() - 2, self.group)
        return sum_in_forward(out, self.group)


def contiguous_part(slots: Tensor, total: int, group: dist.ProcessGroup) -> Tensor:
    """The ``slots`` (indices among ``total``) in this rank's contiguous part of ``range(total)`` over ``group``."""
    return slots[slots * dist.get_world_size(group) // max(total, 1) == dist.get_rank(group)]


def grouped_split(name: str) -> Placement:
    """The tp placement of :class:`~meshlight.nn.experts.GroupedExperts`' weight ``name`` (``w1``, ``w2``, ``w3``:
    ``[E, in, out]``) under the ``"split"`` layout: hidden columns of ``w1``/``w3``, hidden rows of ``w2``."""
    return Shard(1) if name == "w2" else Shard(2)


def split_placements(tp_placement: Placement, ep: int) -> list[Placement]:
    """An expert weight's placements over the mesh ``(ep, tp)`` (``(tp,)`` when ``ep == 1``) under the ``"split"``
    layout: the experts over ``ep``, each expert's ``tp_placement``."""
    return [Shard(0), tp_placement] if ep > 1 else [tp_placement]


def stacked_split_placements(experts: nn.Module) -> Optional[Callable[[str], Placement]]:
    """How a model's own stacked experts (Hugging Face's) split over tp under ``"split"``, weight name → its tp
    placement: ``None`` where their weights are in no layout meshlight knows (:func:`_stacked_layout`)."""
    layout = _stacked_layout(experts)
    return None if layout is None else layout[1].__getitem__


def stacked_expert_width(experts: nn.Module) -> int:
    """The hidden width of each of a model's own stacked experts that ``"split"`` divides over tp (their layout
    known: :func:`stacked_split_placements`)."""
    layout = _stacked_layout(experts)
    assert layout is not None, f"{type(experts).__name__}'s layout is not one meshlight splits over tp"
    return layout[0]


def added_once(placements: Callable[[str], Placement], names: list[str]) -> list[str]:
    """Of stacked experts' weights ``names`` split over tp by ``placements``, those each tp rank holds whole whose
    term the ranks' partial outputs must add once (GPT-OSS's ``down_proj_bias``): the tp rank 0 adds it."""
    return [name for name in names if isinstance(placements(name), Replicate)]


def _stacked_layout(experts: nn.Module) -> Optional[tuple[int, dict[str, Placement]]]:
    """The expert width and each weight's tp placement, for Hugging Face's stacked experts: a fused ``gate_up_proj``
    and ``down_proj``, biases ``gate_up_proj_bias`` ``[E, 2·I]`` and ``down_proj_bias`` ``[E, H]`` where they have
    them, read from the shapes (and transformers' ``is_transposed``/``is_concatenated`` marks where the class has
    them):

    - most of them ``[E, 2·I, H]`` and ``[E, H, I]``; transposed (Llama 4's, GPT-OSS's) ``[E, H, 2·I]`` and
      ``[E, I, H]``. The two cannot be told apart only where no width fits both (never: that needs ``I = 0``);
    - the fused weight concatenated (the gate's part, then the up projection's, which the forward chunks in two:
      transformers' default) or, marked ``is_concatenated=False`` (GPT-OSS), the two interleaved.

    A concatenated fused weight (and bias) is split part by part (``_StridedShard``: each rank holds its part of
    the gate and of the up projection, which its forward's chunk separates again), an interleaved one by a
    contiguous block (whole gate/up pairs); ``down_proj`` by its expert width; ``down_proj_bias`` is held whole and
    added once (:func:`added_once`). None for any other layout, and for experts that normalize each expert's output
    (``has_post_expert_norm``), which a rank's partial sum is not."""
    shapes = {name: tuple(param.shape[1:]) for name, param in experts.named_parameters(recurse=False)}
    if not {"gate_up_proj", "down_proj"} <= set(shapes) <= {"gate_up_proj", "down_proj", "gate_up_proj_bias",
                                                          "down_proj_bias"}:
        return None
    fused, down = shapes["gate_up_proj"], shapes["down_proj"]
    if len(fused) != 2 or len(down) != 2:
        return None
    if fused == (2 * down[1], down[0]):
        transposed, width, hidden = False, down[1], down[0]
    elif fused == (down[1], 2 * down[0]):
        transposed, width, hidden = True, down[0], down[1]
    else:
        return None
    concatenated = getattr(experts, "is_concatenated", True)
    if getattr(experts, "is_transposed", transposed) is not transposed or not isinstance(concatenated, bool):
        return None
    if getattr(experts, "has_post_expert_norm", False):  # a norm of each expert's output: not of a partial sum
        return None
    biases = {"gate_up_proj_bias": (2 * width,), "down_proj_bias": (hidden,)}
    if any(shapes[name] != shape for name, shape in biases.items() if name in shapes):
        return None
    fused_dim = 2 if transposed else 1
    placements = {"gate_up_proj": _StridedShard(fused_dim, split_factor=2) if concatenated else Shard(fused_dim),
                  "gate_up_proj_bias": _StridedShard(1, split_factor=2) if concatenated else Shard(1),
                  "down_proj": Shard(1 if transposed else 2), "down_proj_bias": Replicate()}
    return width, {name: placements[name] for name in shapes}


def check_expert_split(hidden_dim: int, tp: int) -> None:
    """The ``"split"`` layout needs each expert's hidden width divisible by ``tp``."""
    if hidden_dim % tp:
        valid = [d for d in range(1, hidden_dim + 1) if hidden_dim % d == 0 and d <= 64]
        raise ValueError(
            f"The experts' hidden size {hidden_dim} is not divisible by tp={tp}: experts='split' splits each expert's"
            f" hidden width over the tp ranks. Choose tp in {valid}, or experts='fold' (whole experts, spread over"
            " the tp ranks by expert parallelism)."
        )


def local_slice(weight: Tensor, coordinates: list[tuple[int, int]], placements: list[Placement]) -> Tensor:
    """This rank's block of ``weight`` under ``placements``, at mesh ``coordinates`` ``(rank, size)`` per mesh dim."""
    block = weight
    for (rank, size), placement in zip(coordinates, placements):
        if isinstance(placement, _StridedShard):  # this rank's part of each of split_factor consecutive parts
            parts = block.unflatten(placement.dim, (placement.split_factor, -1))
            step = parts.shape[placement.dim + 1] // size
            block = parts.narrow(placement.dim + 1, rank * step, step).flatten(placement.dim, placement.dim + 1)
            continue
        if isinstance(placement, Replicate):
            continue
        assert isinstance(placement, Shard)
        step = block.shape[placement.dim] // size
        block = block.narrow(placement.dim, rank * step, step)
    return block.clone()

