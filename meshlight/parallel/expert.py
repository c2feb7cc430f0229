"""Expert parallelism: each of ``ep`` ranks holds ``num_experts / ep`` experts of every MoE layer, and tokens
travel to their experts and back by all-to-all.

Ranks are borrowed from data parallelism (the mesh axis ``ep`` is carved out of ``dp_shard``, or of
``dp_replicate`` without ZeRO): the ``ep`` ranks of a group read different data and exchange tokens. Dense
weights stay data parallel over all data ranks; expert weights — DTensors ``Shard(0)`` over ``ep`` — are
data parallel over the ``dp / ep`` ranks that hold the same experts (:func:`expert_data_mesh`).

An expert's gradient collects the tokens of ``ep`` data ranks, while data parallelism averages over only
``dp / ep`` replicas of it; :class:`~meshlight.nn.experts.GroupedExperts` scales it by ``1/ep`` so that the
result is the gradient of the mean loss over all data ranks, as for dense weights.

Under tensor parallelism each expert is also split over the tp ranks (a DTensor on ``(ep, tp)``), or the experts are
folded over them: ``ep`` then spans the tp ranks too (:mod:`meshlight.parallel.expert_tensor`).

Models that bring their own MoE blocks are split the same way where their experts are *stacked* — one module whose
weights are ``[num_experts, …]`` and whose ``forward(hidden_states, top_k_index, top_k_weights)`` runs the tokens'
chosen experts (Hugging Face's Mixtral, Qwen3-MoE, …): the model's own router decides, the tokens travel, and the
module's own forward runs this rank's experts on what arrives (:class:`StackedExpertsParallel`). Stacked experts
that take every token instead (:func:`dense_experts`, Llama 4's) have nothing to dispatch: tensor parallelism splits
each of them (:class:`DenseExpertsParallel`), and expert parallelism leaves them alone. Experts held as a list, each
an MLP module of its own (litgpt's ``LLaMAMoE``), are split where meshlight knows their block's forward
(:data:`LISTED_MOE_FORWARDS`): each rank keeps its experts in the list, under the names one process gives them, and
the block's own routing sends the tokens (:class:`ListedExpertsParallel`); under tensor parallelism they are folded
(whole experts, ep spanning the tp ranks), never split over them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard

from meshlight.nn.experts import GroupedExperts, local_weight, scale_gradient
from meshlight.nn.moe import MoE
from meshlight.parallel.blocks import class_path
from meshlight.parallel.dtensors import shallow_copy
from meshlight.parallel.expert_tensor import (
    ExpertTensorParallel,
    added_once,
    check_expert_split,
    grouped_split,
    local_slice,
    split_placements,
    stacked_expert_width,
    stacked_split_placements,
)
from meshlight.parallel.layout import DATA_AXES, ParallelLayout, axis, hybrid_mesh, same_experts_axis
from meshlight.parallel.parameter_adapters import ExpertAdapters, adapters_of, parameter_adapters

__all__ = [
    "AllToAllDispatcher",
    "DenseExpertsParallel",
    "LISTED_MOE_FORWARDS",
    "ListedExpertsParallel",
    "StackedExpertsParallel",
    "apply_expert_parallel",
    "check_expert_adapters",
    "check_listed_experts",
    "dense_experts",
    "expert_data_mesh",
    "expert_layers",
    "has_experts",
    "is_stacked_experts",
    "listed_expert_parameters",
    "listed_experts",
    "listed_experts_split",
    "sharded_experts",
    "split_dense_experts",
    "split_over_tp",
    "splittable_listed_experts",
    "stacked_experts",
]


def expert_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def stacked_experts(module: nn.Module) -> list[nn.Module]:
    """Expert modules of a model's own MoE blocks that expert parallelism splits: a ``num_experts`` attribute, every
    weight ``[num_experts, …]`` (matrices, and biases ``[num_experts, width]`` as GPT-OSS's), and
    ``forward(hidden_states, top_k_index, top_k_weights)`` (Hugging Face's; GPT-OSS names the last two
    ``router_indices, routing_weights``)."""
    return [m for m in module.modules() if is_stacked_experts(m)]


def is_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` is stacked experts (see :func:`stacked_experts`)."""
    return _stacked_weights(module) and _forward_arguments(module)[:3] in _STACKED_SIGNATURES


def dense_experts(module: nn.Module) -> list[nn.Module]:
    """Stacked experts (weights ``[num_experts, …]``) that run every expert on a group of the tokens of its own —
    ``forward(hidden_states)`` on ``[num_experts × tokens, hidden]``, the groups as long — rather than on the tokens
    routed to it: Llama 4's, whose MoE block hands each expert every token scaled by the router's score (zero where
    the token did not choose it). Nothing travels to an expert, so expert parallelism leaves them alone; tensor
    parallelism splits each (:class:`DenseExpertsParallel`)."""
    return [m for m in module.modules() if is_dense_experts(m)]


def is_dense_experts(module: nn.Module) -> bool:
    """Whether ``module`` is dense stacked experts (see :func:`dense_experts`)."""
    return _stacked_weights(module) and _forward_arguments(module) == ("hidden_states",)


def _stacked_weights(module: nn.Module) -> bool:
    """A ``num_experts`` attribute, and every weight ``[num_experts, …]``: matrices, and biases ``[num_experts,
    width]``."""
    count, weights = getattr(module, "num_experts", None), list(module.parameters(recurse=False))
    if not (isinstance(count, int) and count > 1 and weights):
        return False
    return any(w.dim() == 3 for w in weights) and all(w.dim() in (2, 3) and w.shape[0] == count for w in weights)


def _forward_arguments(module: nn.Module) -> tuple[str, ...]:
    return tuple(inspect.signature(type(module).forward).parameters)[1:]


def listed_experts(module: nn.Module) -> dict[str, nn.ModuleList]:
    """Experts a model's own MoE blocks hold as a list (litgpt's ``LLaMAMoE``), by name: an ``nn.ModuleList`` of two
    or more modules of one type beside a router whose weight scores that many (``[experts, hidden]``). Expert
    parallelism splits them where it knows their block's forward (:func:`splittable_listed_experts`); tensor
    parallelism keeps each whole on every rank, running on that rank's share of the tokens."""
    found = {}
    for name, block in module.named_modules():
        for list_name, experts in block.named_children():
            if not (isinstance(experts, nn.ModuleList) and len(experts) > 1 and len({type(e) for e in experts}) == 1):
                continue
            routers = [p for other in block.children() if other is not experts
                       for p in other.parameters(recurse=False) if p.dim() == 2 and p.shape[0] == len(experts)]
            if routers:
                found[f"{name}.{list_name}" if name else list_name] = experts
    return found


#: The experts a block holding them as a list routes its tokens to: ``routed(rows, chosen, weights)`` — the tokens
#: ``[tokens, hidden]``, the experts each chose ``[tokens, k]`` and their weights — returns the weighted sum of each
#: token's experts' outputs.
RoutedExperts = Callable[[Tensor, Tensor, Tensor], Tensor]


def _litgpt_moe(block: nn.Module, x: Tensor, routed: RoutedExperts) -> Tensor:
    """litgpt's ``LLaMAMoE.forward``, its loop over the experts handed to ``routed``: the top k of the gate's scores,
    their softmax in float32 (or its grouped router's choice), scaled by ``routed_scaling_factor``, and its shared
    experts added."""
    config, (batch, length, width) = block.config, x.shape
    rows = x.reshape(-1, width)
    if config.n_expert_groups:
        weights, chosen = block.gate(rows)
    else:
        weights, chosen = torch.topk(block.gate(rows), config.n_expert_per_token)
        weights = weights.softmax(dim=1, dtype=torch.float).to(dtype=rows.dtype)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    out = routed(rows, chosen, weights).view(batch, length, width)
    return out + block.shared_experts(x) if config.n_shared_expert else out


#: MoE blocks holding their experts as a list (:func:`listed_experts`) whose forward expert parallelism runs, by class
#: (``package.module.Class``): the block, its input, and its routed experts (:data:`RoutedExperts`) → its output, as
#: the block's own forward computes it.
LISTED_MOE_FORWARDS: dict[str, Callable[[nn.Module, Tensor, RoutedExperts], Tensor]] = {
    "litgpt.model.LLaMAMoE": _litgpt_moe,
}


def splittable_listed_experts(module: nn.Module) -> dict[str, nn.ModuleList]:
    """The experts held as a list (:func:`listed_experts`) that expert parallelism splits, by name: those of blocks
    whose forward it knows (:data:`LISTED_MOE_FORWARDS`)."""
    return {name: experts for name, experts in listed_experts(module).items()
            if class_path(module.get_submodule(name.rpartition(".")[0])) in LISTED_MOE_FORWARDS}


def check_listed_experts(module: nn.Module, layout: ParallelLayout) -> None:
    """Experts held as a list are split over ``ep`` ranks whole, each rank holding as many: data ranks, or under
    tensor parallelism ranks spanning the tp ranks too (``experts="fold"``); split over tp they cannot be."""
    listed = splittable_listed_experts(module) if layout.ep > 1 else {}
    if listed and layout.tp > 1 and not layout.folded:
        raise NotImplementedError(
            f"{layout.describe()}: {next(iter(listed)).rpartition('.')[0]} holds its experts as a list (litgpt's"
            " MoE), which meshlight does not split over the tp ranks (experts='split'). Fold expert parallelism over"
            f" them instead: experts='fold' with ep in {layout.folded_ep_choices()}, or ep=1 (the experts whole on"
            " every tp rank)."
        )
    for experts in listed.values():
        _check_experts_divide(len(experts), layout.ep, layout.tp if layout.folded else 1)


def split_over_tp(experts: nn.Module, layout: ParallelLayout) -> bool:
    """Whether a model's own stacked ``experts`` are spread over the tp ranks (folded) or each split over them (in
    a layout :func:`~meshlight.parallel.expert_tensor.stacked_split_placements` knows), rather than kept whole."""
    return layout.folded or stacked_split_placements(experts) is not None


def check_expert_adapters(module: nn.Module, layout: ParallelLayout) -> None:
    """PEFT's LoRA on a module's parameters (:func:`~meshlight.parallel.parameter_adapters.parameter_adapters`)
    follows a model's own stacked experts as they are split (:class:`~meshlight.parallel.parameter_adapters.
    ExpertAdapters`): over ep ranks, folded over the tp ranks too, or each expert over the tp ranks in a layout
    :func:`~meshlight.parallel.expert_tensor.stacked_split_placements` knows. Refused, naming the way out: experts in
    another layout under tp (kept whole on every tp rank), and LoRA on any other parameter tensor or expert
    parallelism would split."""
    if layout.tp == 1 and layout.ep == 1:
        return
    for name, wrapper in parameter_adapters(module):
        base = wrapper.get_base_layer()
        if is_stacked_experts(base) and (layout.tp == 1 or split_over_tp(base, layout)):
            continue
        parameters = ", ".join(repr(other.parameter_name) for other_name, other in parameter_adapters(module)
                               if other_name.startswith(name))
        adapted = f"{layout.describe()}: {name} is PEFT's LoRA on the parameters {parameters} of {type(base).__name__}"
        if is_stacked_experts(base):
            raise NotImplementedError(
                f"{adapted}, stacked experts in a layout meshlight does not split over the tp ranks (it would keep them"
                " whole on every tp rank, where their adapters would train on each rank's share of the tokens alone):"
                " fold expert parallelism over the tp ranks instead, each rank holding whole experts: experts='fold'"
                f" with ep in {layout.folded_ep_choices()}, or tp=1."
            )
        raise NotImplementedError(
            f"{adapted} (target_parameters), which tp or ep would split but not their adapters: leave them out of the"
            " adapter (target_modules naming Linears, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj'], and no"
            " target_parameters), or train with tp=1 and ep=1 (data, ZeRO and pipeline parallelism run it)."
        )


def has_experts(module: nn.Module) -> bool:
    """Whether ``module`` has experts expert parallelism splits: ``meshlight.nn.MoE`` layers, stacked experts, or
    experts held as a list in a block whose forward it knows (split already, or not)."""
    return bool(expert_layers(module) or stacked_experts(module) or splittable_listed_experts(module)
                or listed_experts_split(module))


def listed_experts_split(module: nn.Module) -> list[ListedExpertsParallel]:
    """How the blocks of ``module`` whose listed experts are split over ep run (their installed forwards)."""
    return [m.forward for m in module.modules() if isinstance(m.__dict__.get("forward"), ListedExpertsParallel)]


def listed_expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trained parameters of the listed experts this rank holds alone among its ep ranks
    (:class:`ListedExpertsParallel`): the norm of their gradients is summed over those ranks, as a DTensor's would
    be."""
    return [p for split in listed_experts_split(module) for expert in split.local for p in expert.parameters()
            if p.requires_grad]


def sharded_experts(module: nn.Module) -> list[nn.Module]:
    """The expert modules whose weights are split over ``ep`` (data parallelism treats them apart): stacked ones, and
    each expert of a list that this rank holds."""
    # split over tp alone (DTensors on the tp mesh) or kept whole on every tp rank (replicated DTensors), they are
    # data parallel with the rest, as dense tensor-parallel weights are
    experts = [layer.experts for layer in expert_layers(module)] + stacked_experts(module)
    return [m for m in experts if isinstance(weight := next(m.parameters()), DTensor)
            and "ep" in (weight.device_mesh.mesh_dim_names or ())] + [
        expert for split in listed_experts_split(module) for expert in split.local]


def expert_data_mesh(mesh: DeviceMesh, zero: int) -> DeviceMesh:
    """The ranks holding the same experts, as the data-parallel mesh for expert weights: ``edp_shard`` (with
    ``dp_replicate`` for hybrid sharding) under ZeRO; ``edp_replicate × dp_shard`` (shard size 1) under DDP. Under
    context parallelism the cp ranks hold the same experts too (``edp_*_cp``); there, without ZeRO, they shard the
    experts instead of replicating them (the same bytes: no 2-D mesh replicates over both)."""
    replicate, shard = DATA_AXES
    if mesh["cp"].size() > 1:
        name = same_experts_axis(replicate if zero == 0 else shard) + "_cp"
        return hybrid_mesh(mesh, name) if zero and axis(mesh, replicate).size() > 1 else axis(mesh, name)
    if zero == 0:
        return mesh[same_experts_axis(replicate), shard]
    if axis(mesh, replicate).size() > 1:
        return mesh[replicate, same_experts_axis(shard)]
    return mesh[same_experts_axis(shard)]


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh, ep: int, *, sequence_parallel: bool = False,
                          fold: bool = False) -> None:
    """Split every MoE layer's experts over the mesh's ``ep`` axis in place (when ``ep > 1``) and, under tensor
    parallelism, each expert over ``tp`` — or, with ``fold``, the experts over ``ep`` ranks that span the tp ranks too
    (:mod:`meshlight.parallel.expert_tensor`; ``sequence_parallel``: the layers run on shares of the sequence); and
    tell every MoE layer the data-parallel group its expert loads add up over (for balancing and telemetry)."""
    layers = expert_layers(module)
    data_group = axis(mesh, "dp_cp" if mesh["cp"].size() > 1 else "dp").get_group()  # every rank's own tokens
    tp = mesh["tp"].size()
    fold = fold and tp > 1
    for layer in layers:
        layer.data_parallel_group = data_group
        if tp > 1:
            if not fold:
                check_expert_split(layer.experts.w1.shape[-1], tp)
            layer.tensor_parallel = ExpertTensorParallel(mesh["tp"].get_group(), sequence_parallel=sequence_parallel,
                                                         fold=fold)
    if ep == 1 and tp == 1:
        return
    for layer in layers:
        _check_experts_divide(layer.num_experts, ep, tp if fold else 1)
    split_over_tp = tp > 1 and not fold
    data_ranks = ep // tp if fold else ep  # the data ranks whose tokens each expert sees
    split_mesh = mesh["ep", "tp"] if ep > 1 and split_over_tp else mesh["tp" if split_over_tp else "ep"]
    placements = _split_over(grouped_split, ep) if split_over_tp else _over_experts
    for layer in layers:
        if _split(layer.experts, layer.num_experts, split_mesh, placements) and ep > 1:
            # each expert sees the tokens of ep data ranks (of ep / tp when the ep ranks span the tp ranks)
            layer.experts.gradient_scale = 1.0 / data_ranks
            layer.dispatcher = AllToAllDispatcher(mesh["ep"].get_group(), layer.num_experts // ep)
    for experts in stacked_experts(module):
        _split_stacked(experts, mesh, ep, sequence_parallel=sequence_parallel, fold=fold, data_ranks=data_ranks,
                       adapters=adapters_of(module, experts))
    if ep > 1:  # (under tp: folded, checked by check_listed_experts)
        for name in splittable_listed_experts(module):
            parent, _, list_name = name.rpartition(".")
            ListedExpertsParallel(module.get_submodule(parent), list_name, mesh["ep"].get_group(),
                                  data_ranks=data_ranks, tensor_parallel=_same_tokens(mesh, fold, sequence_parallel))


def _same_tokens(mesh: DeviceMesh, fold: bool, sequence_parallel: bool) -> Optional[ExpertTensorParallel]:
    """Folded without sequence parallelism, the tp ranks hold the same tokens, and each sends its part of them."""
    if fold and not sequence_parallel:
        return ExpertTensorParallel(mesh["tp"].get_group(), sequence_parallel=False, fold=True)
    return None


def _split_stacked(experts: nn.Module, mesh: DeviceMesh, ep: int, *, sequence_parallel: bool, fold: bool,
                   data_ranks: int, adapters: Mapping[str, nn.Module]) -> None:
    """Split a model's own stacked experts: over ``ep`` (folded over the tp ranks, or over data ranks alone), and
    under tensor parallelism (not folded) each expert over tp where its weights are in the layout
    :func:`~meshlight.parallel.expert_tensor.stacked_split_placements` knows — else, with ``ep=1``, they stay whole
    on every tp rank, as the tensor-parallel plan left them. ``adapters``: PEFT's LoRA on its weights, by name, whose
    updates are split as the weights are (:class:`~meshlight.parallel.parameter_adapters.ExpertAdapters`)."""
    tp_split = stacked_split_placements(experts) if mesh["tp"].size() > 1 and not fold else None
    if tp_split is not None:
        check_expert_split(stacked_expert_width(experts), mesh["tp"].size())
        split_mesh, placements = mesh["ep", "tp"] if ep > 1 else mesh["tp"], _split_over(tp_split, ep)
        tensor_parallel = ExpertTensorParallel(mesh["tp"].get_group(), sequence_parallel=sequence_parallel,
                                               fold=False)
    elif ep > 1:
        split_mesh, placements = mesh["ep"], _over_experts
        tensor_parallel = _same_tokens(mesh, fold, sequence_parallel)
    else:
        return
    if _split(experts, experts.num_experts, split_mesh, placements):
        once = added_once(tp_split, [name for name, _ in experts.named_parameters(recurse=False)]) if tp_split else []
        coordinates = [(split_mesh.get_local_rank(dim), split_mesh.size(dim)) for dim in range(split_mesh.ndim)]
        # (the tp ranks hold other experts, or other slices of each)
        summed_over = mesh["tp"].get_group() if mesh["tp"].size() > 1 else None
        adapted = ExpertAdapters(adapters, coordinates, placements, summed_over) if adapters else None
        StackedExpertsParallel(experts, mesh["ep"].get_group() if ep > 1 else None, data_ranks=data_ranks,
                               tensor_parallel=tensor_parallel, added_once=once, adapters=adapted)


def split_dense_experts(module: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Split each expert of ``module``'s dense stacked experts (:func:`dense_experts`) over the mesh's tp ranks, in
    place, where their weights are in a layout :func:`~meshlight.parallel.expert_tensor.stacked_split_placements`
    knows (others stay whole on every rank, on the whole tokens: the tensor-parallel plan refuses them under sequence
    parallelism); ``sequence_parallel``: they receive this rank's share of the tokens."""
    tp = mesh["tp"]
    for experts in dense_experts(module):
        placements = stacked_split_placements(experts)
        if placements is None:
            continue
        check_expert_split(stacked_expert_width(experts), tp.size())
        if not _split(experts, experts.num_experts, tp, _split_over(placements, 1)):
            continue
        tensor_parallel = ExpertTensorParallel(tp.get_group(), sequence_parallel=sequence_parallel, fold=False)
        DenseExpertsParallel(experts, tensor_parallel, added_once(placements, list(dict(experts.named_parameters(
            recurse=False)))))


def _split_over(tp_placement: Callable[[str], Placement], ep: int) -> Callable[[str], list[Placement]]:
    """Weight name → its placements over ``(ep, tp)`` (``(tp,)`` with ``ep=1``), each expert split by
    ``tp_placement``."""
    return lambda name: split_placements(tp_placement(name), ep)


def _over_experts(name: str) -> list[Placement]:
    return [Shard(0)]


def _split(experts: nn.Module, num_experts: int, mesh: DeviceMesh,
           placements: Callable[[str], list[Placement]]) -> bool:
    """Make ``experts``' stacked weights DTensors on ``mesh`` with each weight's ``placements`` (experts split over
    ``ep``, and under tensor parallelism each expert over ``tp``), this rank keeping its block; False where they
    already are."""
    names = mesh.mesh_dim_names or ()
    _check_experts_divide(num_experts, mesh.size(names.index("ep")) if "ep" in names else 1)
    if any(isinstance(p, DTensor) for p in experts.parameters(recurse=False)):
        return False
    coordinates = [(mesh.get_local_rank(dim), mesh.size(dim)) for dim in range(mesh.ndim)]
    for name, param in list(experts.named_parameters(recurse=False)):
        shard = local_slice(param.detach(), coordinates, placements(name))
        sharded = DTensor.from_local(shard, mesh, placements(name), run_check=False)
        setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return True


def _check_experts_divide(num_experts: int, ep: int, folded_over: int = 1) -> None:
    """Each of the ``ep`` ranks must hold the same number of experts (``folded_over``: the tp size ep spans too)."""
    if num_experts % ep:
        valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and d % folded_over == 0]
        folded = f", a multiple of tp={folded_over} (experts='fold')" if folded_over > 1 else ""
        raise ValueError(
            f"num_experts={num_experts} is not divisible by ep={ep}: each rank must hold the same number"
            f" of experts. Choose ep in {valid} that also divides the data-parallel size{folded}."
        )


class AllToAllDispatcher:
    """Sends tokens sorted by expert to the ranks holding those experts, runs the local experts on what
    arrives, and returns each result to the rank its token came from, in the order it was sent."""

    def __init__(self, group: dist.ProcessGroup, local_experts: int) -> None:
        self.group, self.local_experts = group, local_experts
        self.ranks = dist.get_world_size(group)

    def __call__(self, tokens: Tensor, counts: Tensor, experts: GroupedExperts) -> Tensor:
        # counts[r·L + e]: tokens for expert e of rank r. Exchange the counts first: the split sizes must be
        # known on the host (a device sync, as in every dropless all-to-all dispatcher).
        send = counts.view(self.ranks, self.local_experts)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        send_splits, receive_splits = send.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_single_autograd(tokens, receive_splits, send_splits, self.group)
        # Arrived rows are grouped by source rank, then by local expert; the experts want them by expert.
        source_major = torch.repeat_interleave(
            torch.arange(received.numel(), device=tokens.device), received.flatten(), output_size=sum(receive_splits)
        )
        expert_major = (source_major % self.local_experts) * self.ranks + source_major // self.local_experts
        order = expert_major.argsort(stable=True)
        out = experts(arrived[order], received.sum(0))
        out = out[order.argsort()]
        return all_to_all_single_autograd(out, send_splits, receive_splits, self.group)


_STACKED_SIGNATURES = (("hidden_states", "top_k_index", "top_k_weights"),
                       ("hidden_states", "router_indices", "routing_weights"))


def _dispatched(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, pairs: Tensor, num_experts: int,
                dispatcher: Optional[AllToAllDispatcher], local_experts: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """The (token, choice) ``pairs`` (indices into the token-major ``top_k_index``) each through its expert — sent to
    the rank holding it by ``dispatcher``, or run here by ``local_experts(rows grouped by expert, counts)`` — weighted
    here by their ``top_k_weights`` (in the wider of the two dtypes, as the models' loops multiply them), and added
    into their tokens' rows sorted by expert (on CPU ``index_add`` adds in that order, the loops' order)."""
    choices = top_k_index.reshape(-1)[pairs]
    order = choices.argsort(stable=True)
    pairs = pairs[order]
    tokens = pairs // top_k_index.shape[-1]
    counts = torch.bincount(choices, minlength=num_experts)
    if dispatcher is not None:
        out = dispatcher(hidden_states[tokens], counts, local_experts)
    else:
        out = local_experts(hidden_states[tokens], counts)
    weighted = out * top_k_weights.reshape(-1)[pairs, None]
    return torch.zeros_like(hidden_states).index_add(0, tokens, weighted.to(hidden_states.dtype))


class StackedExpertsParallel:
    """A stacked-experts module (:func:`stacked_experts`) whose weights are split over ranks: installed as the
    module's ``forward``. Under expert parallelism (``group``: the ranks the experts are split over) each (token,
    choice) pair travels to the rank holding its expert (:class:`AllToAllDispatcher`), where the module's own forward
    runs this rank's experts on what arrives, with weight 1; the results come back and are weighted there, where the
    router's weights (and their gradient) stay. ``data_ranks``: the data ranks among ``group``'s (fewer where
    ``group`` spans tp ranks too, folded over them): each expert sees the tokens of that many, and its gradient is
    scaled by their inverse, as :class:`GroupedExperts`' are. ``tensor_parallel``: what the tp ranks do around that
    (:class:`~meshlight.parallel.expert_tensor.ExpertTensorParallel`) where they hold the same tokens or each expert
    is split over them — the whole tokens go through this rank's slice of every expert, or (folded) each rank sends
    its part of the pairs; the outputs are summed over tp, and the gradients of the tokens and the router's weights,
    each rank's partial, in backward. ``added_once``: weights each tp rank holds whole (each expert split over tp)
    whose term the ranks' partial outputs add once — tp rank 0 adds it, the others add zeros (and the gradient, a
    partial sum over tp, is rank 0's). ``adapters``: PEFT's LoRA on the weights, whose updates of this rank's
    experts are added to them (:class:`~meshlight.parallel.parameter_adapters.ExpertAdapters`)."""

    def __init__(self, experts: nn.Module, group: Optional[dist.ProcessGroup], *, data_ranks: int,
                 tensor_parallel: Optional[ExpertTensorParallel] = None, added_once: Sequence[str] = (),
                 adapters: Optional[ExpertAdapters] = None) -> None:
        self.experts, self.added_once, self.adapters = experts, tuple(added_once), adapters
        self.ranks = dist.get_world_size(group) if group is not None else 1
        self.gradient_scale = 1.0 / data_ranks
        self.tensor_parallel = tensor_parallel
        self.num_experts = experts.num_experts
        self.dispatcher = AllToAllDispatcher(group, self.num_experts // self.ranks) if group is not None else None
        experts.forward = self

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        tp = self.tensor_parallel
        if tp is not None:
            top_k_weights = tp.whole_weights(top_k_weights, hidden_states)
            hidden_states, top_k_index = tp.whole(hidden_states), tp.whole(top_k_index)
        pairs = torch.arange(top_k_index.numel(), device=hidden_states.device)  # token-major
        if tp is not None:
            pairs = tp.own_slots(pairs, len(pairs))
        out = _dispatched(hidden_states, top_k_index, top_k_weights, pairs, self.num_experts, self.dispatcher,
                          self._local_experts)
        return out if tp is None else tp.share(out)

    def _local_experts(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The module's own forward on this rank's experts: ``rows`` grouped by local expert, ``counts`` of each."""
        tp_rank = self.tensor_parallel.rank if self.tensor_parallel is not None else 0
        local = _on_local_weights(self.experts, self.gradient_scale, self.added_once, tp_rank, self.adapters)
        object.__setattr__(local, "num_experts", len(counts))
        index = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts, output_size=len(rows))
        ones = torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
        return type(self.experts).forward(local, rows, index[:, None], ones)


class ListedExpertsParallel:
    """A MoE block holding its experts as a list (:func:`splittable_listed_experts`), the list ``experts_name``
    split over the ep ranks of ``group``: installed as the block's ``forward``. This rank keeps experts ``r·L`` to
    ``r·L + L − 1`` (rank ``r``, ``L`` = experts ÷ ep) in their places in the list, and the others are dropped from it:
    a checkpoint names each expert as one process does. The block's own routing (:data:`LISTED_MOE_FORWARDS`) chooses,
    each (token, choice) pair travels to the rank holding its expert (:class:`AllToAllDispatcher`) and back, and is
    weighted here, as :class:`StackedExpertsParallel` does. Each expert's gradient collects the tokens of the
    ``data_ranks`` whose tokens reach it (ep, or ep ÷ tp where ``group`` spans the tp ranks too) and is scaled by their
    inverse, as :class:`GroupedExperts`' are: data parallelism averages it over the ranks holding the same experts
    alone. ``tensor_parallel``: where ``group`` spans tp ranks that hold the same tokens (folded, without sequence
    parallelism), each sends its part of the pairs; the outputs are summed over tp, and the gradients of the tokens
    and of the router's weights, each rank's partial, in backward. Every rank builds the whole list first, as one
    process does, and drops the others' experts here: expert parallelism lowers the memory of training such a model,
    not of building it."""

    def __init__(self, block: nn.Module, experts_name: str, group: dist.ProcessGroup, *, data_ranks: int,
                 tensor_parallel: Optional[ExpertTensorParallel] = None) -> None:
        experts = block.get_submodule(experts_name)
        self.block, self.block_forward = block, LISTED_MOE_FORWARDS[class_path(block)]
        self.num_experts, ranks = len(experts), dist.get_world_size(group)  # (checked: check_listed_experts)
        self.data_ranks, self.tensor_parallel = data_ranks, tensor_parallel
        held = self.num_experts // ranks
        first = dist.get_rank(group) * held
        for index in [*range(first), *range(first + held, self.num_experts)]:
            del experts._modules[str(index)]  # not `del experts[index]`, which would number the rest anew
        self.local = list(experts)
        self.dispatcher = AllToAllDispatcher(group, held)
        block.forward = self

    def __call__(self, x: Tensor) -> Tensor:
        return self.block_forward(self.block, x, self._routed)

    def _routed(self, rows: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        tp = self.tensor_parallel
        pairs = torch.arange(chosen.numel(), device=rows.device)
        if tp is not None:
            rows, weights, pairs = tp.whole(rows), tp.whole_weights(weights, rows), tp.own_slots(pairs, len(pairs))
        out = _dispatched(rows, chosen, weights, pairs, self.num_experts, self.dispatcher, self._local_experts)
        return out if tp is None else tp.share(out)

    def _local_experts(self, rows: Tensor, counts: Tensor) -> Tensor:
        """This rank's experts, each on its group of ``rows``; the gradient reaching their weights scaled by
        1/``data_ranks`` (and what reaches the rows back by ``data_ranks``)."""
        parts = rows.split(counts.tolist())
        return torch.cat([scale_gradient(expert(scale_gradient(part, self.data_ranks)), 1.0 / self.data_ranks)
                          for expert, part in zip(self.local, parts)])


class DenseExpertsParallel:
    """Dense stacked experts (:func:`dense_experts`) each split over the tp ranks: installed as the module's
    ``forward``. Its input, each expert's group of the tokens, is made whole over tp (each group's shares gathered
    under sequence parallelism, the gradient summed in backward otherwise), the module's own forward runs it through
    this rank's slice of every expert, and the partial outputs are summed over tp (each group reduce-scattered back
    to this rank's share under sequence parallelism). ``added_once``: weights each tp rank holds whole whose term the
    partial outputs add once (tp rank 0 adds it)."""

    def __init__(self, experts: nn.Module, tensor_parallel: ExpertTensorParallel,
                 added_once: Sequence[str] = ()) -> None:
        self.experts, self.tensor_parallel, self.added_once = experts, tensor_parallel, tuple(added_once)
        experts.forward = self

    def __call__(self, hidden_states: Tensor) -> Tensor:
        tp, width = self.tensor_parallel, hidden_states.shape[-1]
        groups = tp.whole(hidden_states.view(self.experts.num_experts, -1, width))  # [experts, tokens, hidden]
        local = _on_local_weights(self.experts, 1.0, self.added_once, tp.rank)
        out = type(self.experts).forward(local, groups.reshape(-1, width))
        return tp.share(out.view(self.experts.num_experts, -1, out.shape[-1])).reshape(-1, out.shape[-1])


def _on_local_weights(experts: nn.Module, gradient_scale: float, once: Sequence[str], tp_rank: int,
                      adapters: Optional[ExpertAdapters] = None) -> nn.Module:
    """A shallow copy of ``experts`` holding this rank's part of each weight as a plain tensor, its gradient scaled by
    ``gradient_scale``, for the module's own forward to run on without the module's hooks (which ran for the call
    being served); with ``adapters``' updates added (not scaled: the adapters are dense weights). Weights named in
    ``once`` count on tp rank ``0`` alone (see :class:`StackedExpertsParallel`)."""
    local = shallow_copy(experts)
    local._parameters = {}
    for name, param in experts.named_parameters(recurse=False):
        if name in once:
            partial = [Partial() if p.is_replicate() else p for p in param.placements]
            weight = scale_gradient(param.to_local(grad_placements=partial), gradient_scale)
            weight = weight if tp_rank == 0 else weight * 0  # a zero gradient, not none
        else:
            weight = local_weight(param, gradient_scale)
        if adapters is not None:
            weight = adapters.adapted(name, weight)
        object.__setattr__(local, name, weight)
    return local
