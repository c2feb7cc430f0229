"""Tensor parallelism (+ sequence parallelism) with DTensor on the mesh's ``tp`` axis.

A plan gives each module a role; :func:`apply_tensor_parallel` turns roles into PyTorch parallel styles (its own,
named here, are :mod:`meshlight.parallel.tensor_styles`'s):

================= =========================================================================================
role              what it does
================= =========================================================================================
``colwise``       Linear sharded by output features (a block's q, k, v, up, gate projections)
``fused_colwise`` a fused projection (q|k|v, k|v, gate|up, its parts one after another): this rank computes its
                  share of each part (see below)
``rowwise``       Linear sharded by input features, output summed over tp (a block's output projections)
``embedding``     token embedding sharded by vocabulary (masked lookup, outputs summed over tp; each rank's
                  gradient its own rows', ``VocabEmbedding``)
``head``          LM head sharded by vocabulary; in training its logits stay sharded for loss parallelism
``norm``          with sequence parallelism: runs on this rank's share of the sequence (outside the blocks, only in
                  Megatron-LM's region; see below)
``head_norm``     a norm over each head inside attention (QK-norm): runs on this rank's heads, its weight a
                  replicated DTensor, so its gradient is the sum over the ranks' heads
``colwise_norm``  a norm over a colwise projection's whole output (OLMo 2's q and k norms over all heads at once):
                  its vectors sharded as that output, its statistics summed over tp (``ColwiseNorm``)
``latent``        a latent attention's down-projection to a latent every head reads, or a norm over it (DeepSeek's
                  multi-head latent attention), or a module picking the keys every head reads (a sparse attention's
                  indexer, with its submodules): whole on every rank, run on plain tensors, its gradient summed over
                  tp; the up-projections that read a latent (``colwise``) run on plain tensors too, each rank's
                  heads (``OnLocalWeights``)
``interior``      a module holding parameters between a column→row group's readers and its writer (a learned
                  activation, Apertus's xIELU): runs on this rank's hidden units, its parameters replicated DTensors
                  whose gradients are summed over tp (``Interior``)
``replicate``     left whole on every rank. Under sequence parallelism (in its region) an Embedding's output is cut
                  to this rank's share of the sequence (learned positions), and a Linear runs on that share with its
                  weights a replicated DTensor, so its gradient is the sum over the shares (a gate)
``whole``         a sequence mixer left whole on every rank (a linear attention's recurrence, Qwen3.5's): under
                  sequence parallelism it reads the whole sequence and hands on its share (``WholeMixer``)
================= =========================================================================================

With sequence parallelism the region that runs on this rank's share of the sequence is Megatron-LM's when the model
holds nothing outside its blocks but a token embedding, position tables, norms and an LM head: the embedding's output is
reduce-scattered over the sequence and the LM head gathers its input. A model with more outside its blocks (an adapter,
a factorized embedding's projection, a value head, a class token) keeps those on the whole sequence, as without
sequence parallelism: the first block's input is cut to this rank's share and the last block's output gathered
(:func:`sequence_region`).

Linear means ``nn.Linear`` or Hugging Face's ``Conv1D`` (GPT-2's, its weight stored ``[in, out]``). A fused projection
packs its parts one after another (GPT-2's ``c_attn`` is q|k|v; litgpt's ``qkv`` is q|k|v with fewer key/value heads);
column sharding would hand one rank all of q and another all of v. Each rank computes its heads of every part instead
(``FusedColwise``): the weight is stored sharded over tp by rows like any other, gathered whole for the forward
(an all-gather of the fused weight per call), and its gradient reduce-scattered back, as FSDP does for a whole
model. Checkpoints, full state dicts and resharding see the weight in its own layout. Storing each rank's rows of
every part instead would save that traffic; DTensor has no placement for it (``_StridedShard`` has equal parts only,
and DCP would save its non-contiguous shard as one chunk), so it is not done.

Per block the traffic is Megatron-LM's: in forward the input of each colwise group is gathered once — an
all-gather of the sequence with sequence parallelism, nothing otherwise — and in backward its gradient is
reduced once; each rowwise output is reduce-scattered over the sequence (or all-reduced without sequence
parallelism). Backward keeps a colwise group's input as this rank's share of the sequence and gathers it
once more, as Megatron-LM does (:mod:`meshlight.parallel.sequence_gather`; ``keep_gathered_inputs`` keeps it
whole instead).

Plans — which module takes which role, derived from the model's structure or resolved from a user's patterns, and
validated against tp — are :mod:`meshlight.parallel.tensor_plan`'s.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections import defaultdict
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

from meshlight.parallel.adapters import (
    adapted_linear,
    adapters_unwrapped,
    check_splittable_adapter,
    saved_copy,
    trained_tokens,
)
from meshlight.parallel.model_shape import (
    GROUP_ATTRIBUTES,
    WIDTH_ATTRIBUTES,
    blocks_fed_between,
    head_counts,
    hidden_size,
    is_transposed_linear,
    linear_widths,
    per_head_parameters,
)
from meshlight.parallel.sequence_gather import register_sequence_gather
from meshlight.parallel.sequence_parallel import (
    check_sequence_divisible,
    cut_to_share,
    gather_sequence,
    stream_of_own,
    unwrap_share,
)
from meshlight.parallel.tensor_plan import (
    TensorParallelError,
    _colwise_parents,
    _named_blocks,
    _shown,
    _within,
    block_held_groups,
    fused_projection,
    head_biases,
    moe_blocks_of,
    replicated_kv_heads,
)
from meshlight.parallel.tensor_styles import (
    ColwiseFromShare,
    ColwiseNorm,
    FusedColwise,
    Interior,
    LMHead,
    LowRankColwise,
    LowRankFused,
    LowRankHead,
    LowRankOnLocalWeights,
    LowRankReplicated,
    LowRankRowwise,
    OnLocalWeights,
    Replicated,
    Rowwise,
    SequenceNorm,
    TrainedTokens,
    TransposedColwise,
    TransposedRowwise,
    VocabEmbedding,
    WholeMixer,
    split_by_head,
)

__all__ = [
    "apply_tensor_parallel", "explaining_tensor_parallel_errors", "reduce_partial_gradients",
]


# ------------------------------------------------------------------------------------------- apply


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, Union[str, ParallelStyle]],
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    keep_gathered_inputs: bool = False,
    sequence_region: Optional[tuple[str, str]] = None,
) -> None:
    """Shard ``model`` in place over the 1-D ``mesh`` (the tp axis) following ``plan`` (name → role or style).
    ``keep_gathered_inputs``: backward keeps each colwise group's sequence-gathered input whole rather than
    gathering it again (more memory, one all-gather fewer per group). ``sequence_region``: with sequence
    parallelism, :func:`sequence_region` of the whole model (``model`` may be a pipeline stage cut from it)."""
    tp = mesh.size()
    # with sequence parallelism, whether the modules outside the blocks run on this rank's share of the sequence
    shares_outside = sequence_parallel and sequence_region is None
    with adapters_unwrapped(model):  # roles are read off the model without its LoRA layers' own Linears
        modules = dict(model.named_modules())
        blocks = [name for name, _ in _named_blocks(model)]
        styles: dict[str, ParallelStyle] = {}
        hidden = hidden_size(modules[name] for name in blocks)
        # latent attentions: their down-projections and up-projections run on plain tensors, all but the heads whole
        latent = {name.rpartition(".")[0] for name, role in plan.items() if role == "latent"}
        # MoE blocks, which flatten the tokens for their experts (and what else they hold: a shared expert's gate)
        flattening = moe_blocks_of(model)
        # attention whose key/value heads tp exceeds: each rank computes the one its query heads read
        replicated = {parent: kv for parent in _colwise_parents(plan)
                      if hidden and (kv := replicated_kv_heads(modules, plan, parent, hidden, tp))}
        # MLPs a block holds beside its norms: the block's input is its residual stream, so the first Linear gathers
        # its own input over the sequence (and its gradient is reduce-scattered back to the share)
        block_held = block_held_groups(model, plan)
        for name, role in plan.items():
            on_share = sequence_parallel if _within(name, blocks) else shares_outside
            if isinstance(role, ParallelStyle):
                styles[name] = role
            elif role == "fused_colwise":
                parts = fused_projection(modules, plan, name)
                styles[name] = FusedColwise(parts, replicated.get(name.rpartition(".")[0]))
            elif role == "colwise" and (kv := replicated.get(name.rpartition(".")[0])) and (
                    linear_widths(modules[name])[1] == kv[0] * kv[1]):  # key/value heads fewer than the ranks
                styles[name] = FusedColwise((kv[0] * kv[1],), kv)
            elif role == "colwise" and name.rpartition(".")[0] in latent and linear_widths(modules[name])[0] != hidden:
                styles[name] = OnLocalWeights(sharded=True)  # a latent attention's up-projection: reads a latent
            elif role == "colwise" and name.rpartition(".")[0] in block_held:
                styles[name] = ColwiseFromShare() if on_share else ColwiseParallel()
            elif role == "colwise":
                styles[name] = TransposedColwise() if is_transposed_linear(modules[name]) else ColwiseParallel()
            elif role == "rowwise":
                rowwise = TransposedRowwise if is_transposed_linear(modules[name]) else Rowwise
                styles[name] = rowwise(output_layouts=Shard(1) if sequence_parallel else Replicate())
            elif role == "embedding" and VocabEmbedding.fits(modules[name]):
                styles[name] = VocabEmbedding(sequence_parallel=on_share)
            elif role == "embedding":
                styles[name] = Rowwise(input_layouts=Replicate(), output_layouts=Shard(1) if on_share else Replicate())
            elif role == "head":
                styles[name] = LMHead(sequence_parallel=on_share, loss_parallel=loss_parallel)
            elif role == "norm" and on_share:
                styles[name] = SequenceNorm(use_local_output=True)  # a plain share: post-norm blocks add it to others
            elif role == "head_norm":
                styles[name] = Replicated(name, over="heads")
            elif role == "colwise_norm":
                styles[name] = ColwiseNorm(name)
            elif role == "replicate" and on_share and isinstance(modules[name], nn.Embedding):
                styles[name] = Replicated(name, over="whole")
            elif role == "replicate" and on_share and isinstance(modules[name], nn.Linear) and (
                    not _within(name, flattening)):
                styles[name] = Replicated(name, over="sequence")
            elif role == "replicate" and on_share or role == "latent":  # an MoE block's router, experts and shared
                # expert's gate; a latent attention's down-projections and their norms (a block's own parameters alone
                # where its submodules are split)
                styles[name] = OnLocalWeights(own=any(n.startswith(name + ".") and r != "replicate"
                                                      for n, r in plan.items()))
            elif role == "interior":
                owner = name.rpartition(".")[0]
                writer = next((n for n, r in plan.items() if r == "rowwise" and n.rpartition(".")[0] == owner), None)
                if writer is None:
                    raise TensorParallelError(
                        f"{_shown(name)} has the role 'interior' (a module between a column→row group's"
                        f" projections), but {_shown(owner) or 'the model'} holds no 'rowwise' projection beside it to"
                        " tell this rank's share of the hidden units: give the group's output projection the role"
                        " 'rowwise', or give this module another role.")
                styles[name] = Interior(name, linear_widths(modules[writer])[0])
            elif role == "whole" and on_share:  # (without sequence parallelism every rank computes the same)
                styles[name] = WholeMixer()
        per_head = {parent: names for parent in _colwise_parents(plan)
                    if hidden and (names := per_head_parameters(modules[parent], hidden))}
    styles = _with_adapters(model, plan, styles, streams_of_own=sequence_parallel)
    tied = _tied_parameters(model)
    parallelize_module(model, mesh, styles)
    _tie_again(model, tied)
    for parent in _colwise_parents(plan):
        if parent not in block_held:
            register_sequence_gather(modules[parent], mesh, sequence_parallel=sequence_parallel,
                                     keep_gathered=keep_gathered_inputs)
        if biases := head_biases(modules[parent]):
            _narrow_head_biases(modules[parent], biases, max(head_counts(modules[parent]).values()), mesh)
        divided = _divide_counts(modules[parent], tp, replicated.get(parent))
        _name_while_running(modules[parent], _shown(parent), divided)
    for parent, names in per_head.items():  # after the gather has read the forward's signature
        split_by_head(modules[parent], names, mesh)
    if sequence_parallel:
        for name in blocks:
            modules[name].register_forward_pre_hook(unwrap_share, prepend=True)
    if shares_outside:
        for module in modules.values():
            if isinstance(module, nn.Embedding):
                module.register_forward_pre_hook(check_sequence_divisible(tp))
    elif sequence_parallel:  # the blocks only: cut where the first begins, gather where the last ends (this stage's)
        first, last = sequence_region
        if first not in modules or last not in modules:  # a stage holds the others' under their names too
            raise ValueError(f"sequence_region {sequence_region} names no blocks of this {type(model).__name__}: it"
                             " must come from sequence_region() of the same model (or of the model a stage is cut"
                             " from).")
        # a decoder that changes the hidden state after its first blocks (Qwen3-VL's deepstack) gets it whole there
        fed = blocks_fed_between(model)
        for name in blocks:
            index = int(key) if (key := name.rpartition(".")[2]).isdigit() else len(blocks)
            if name == first or 0 < index <= fed:
                modules[name].register_forward_pre_hook(cut_to_share(mesh))
            if name == last or index < fed:
                modules[name].register_forward_hook(gather_sequence(mesh))
        enter, leave = stream_of_own(mesh.get_local_rank())
        for name in blocks:
            modules[name].register_forward_pre_hook(enter, prepend=True)
            modules[name].register_forward_hook(leave, always_call=True)


def _with_adapters(model: nn.Module, plan: Mapping[str, Union[str, ParallelStyle]], styles: dict[str, ParallelStyle],
                   *, streams_of_own: bool) -> dict[str, ParallelStyle]:
    """``styles`` with each LoRA layer's (:mod:`meshlight.parallel.adapters`) the low-rank form of its Linear's: the
    layer splits with its Linear and its adapters (or, where its Linear is kept whole, stays whole with them); one that
    cannot split is refused, naming it. A ``modules_to_save`` wrapper's style (planned on the module it runs) splits its
    original and each trainable copy alike; a trainable-token wrapper's (``trainable_token_indices``, on the token
    embedding or the head) splits its module and puts the trained rows in their places on each forward
    (``TrainedTokens``). ``streams_of_own``: the tp ranks draw random numbers from streams of their own (sequence
    parallelism), so a column-parallel layer's adapters drop their whole input by one gathered mask."""
    for name, module in model.named_modules():
        style = styles.get(name)
        if style is not None and saved_copy(module) is not None:  # PEFT's modules_to_save: each copy and the original
            del styles[name]
            styles.update({f"{name}.{held}": style for held in ("original_module", *(
                f"modules_to_save.{adapter}" for adapter in module.modules_to_save))})
        if style is not None and trained_tokens(module) is not None:  # (the embedding's or the head's: checked)
            styles[name] = TrainedTokens(style)
            continue
        if style is None or adapted_linear(module) is None:
            continue
        role = plan[name] if isinstance(plan[name], str) else type(plan[name]).__name__
        plain = type(style) in (ColwiseParallel, TransposedColwise, Rowwise, TransposedRowwise, FusedColwise, LMHead,
                                Replicated, OnLocalWeights)
        check_splittable_adapter(_shown(name), module, role if plain else f"{role} ({type(style).__name__})")
        if isinstance(style, OnLocalWeights) and role == "replicate":  # (an MoE block's: on this rank's tokens)
            continue
        if isinstance(style, OnLocalWeights):  # a latent attention's projection: on the input every rank holds whole
            styles[name] = LowRankOnLocalWeights(sharded=style.sharded, agreed_dropout=streams_of_own)
        elif isinstance(style, Replicated):
            styles[name] = LowRankReplicated(style.name)
        elif isinstance(style, LMHead):
            styles[name] = LowRankHead(sequence_parallel=style.sequence_parallel, loss_parallel=style.loss_parallel,
                                       agreed_dropout=streams_of_own)
        elif isinstance(style, FusedColwise):
            styles[name] = LowRankFused(style.parts, style.kv, agreed_dropout=streams_of_own)
        elif role == "rowwise":  # (its input is split by columns: each rank drops its own, as one mask would)
            styles[name] = LowRankRowwise(output_layouts=style.output_layouts[0])
        else:
            styles[name] = LowRankColwise(agreed_dropout=streams_of_own)
    return styles


def _divide_counts(module: nn.Module, tp: int, kv: Optional[tuple[int, int]] = None) -> list[str]:
    """Give an attention ``module`` this rank's heads: divide by ``tp`` the head counts it keeps, those of its config
    — in a copy for it alone, as its forward may read them there (litgpt's reads them all there; Phi-3's slices its
    fused q|k|v at ``config.num_attention_heads`` · head_dim) — and the widths it splits a fused projection by
    (:data:`~meshlight.parallel.model_shape.WIDTH_ATTRIBUTES`). ``kv``: (key/value heads, head width) where tp
    exceeds those heads: each rank one of them (:func:`~meshlight.parallel.tensor_plan.replicated_kv_heads`).
    Returns the attributes divided."""
    if not head_counts(module):  # not attention (or attention that keeps no count: nothing to divide)
        return []
    own, config = head_counts(module, own=True), getattr(module, "config", None)
    in_config = head_counts(config, own=True) if config is not None else {}
    if in_config:
        module.config = copy.copy(config)
    widths = {a: v for a in WIDTH_ATTRIBUTES if isinstance(v := getattr(module, a, None), int)}
    for attribute, value in own.items():
        setattr(module, attribute, _local_count(value, tp))
    for attribute, value in widths.items():  # one key/value head's width where tp exceeds them (kv: heads, width)
        setattr(module, attribute, kv[1] if kv and value == kv[0] * kv[1] else value // tp)
    for attribute, value in in_config.items():
        setattr(module.config, attribute, _local_count(value, tp))
    # key/value heads tp exceeds (one on each rank): fewer query heads share each than in one process
    sharing = max((tp // value for value in {**own, **in_config}.values() if value % tp), default=1)
    groups = {a: v for a in GROUP_ATTRIBUTES if isinstance(v := getattr(module, a, None), int) and sharing > 1}
    for attribute, value in groups.items():
        setattr(module, attribute, value // sharing)
    return sorted([*own, *widths, *groups, *(f"config.{attribute}" for attribute in in_config)])


def _local_count(value: int, tp: int) -> int:
    """A rank's share of ``value`` heads: ``value/tp``, or one where tp exceeds them (key/value heads, each then
    held by ``tp/value`` ranks: :func:`~meshlight.parallel.tensor_plan.replicated_kv_heads`)."""
    return value // tp if value % tp == 0 else 1


def reduce_partial_gradients(parameters: Iterable[Tensor]) -> None:
    """Turn gradients that are partial sums over tp into replicated ones, one all-reduce per mesh, placement and dtype.

    A replicated parameter applied to sharded activations (a norm under sequence parallelism) gets a
    ``Partial`` gradient: each tp rank holds its share of the sum. Left so, every op that reads it
    reduces it again — AdamW three times per parameter, the norm for clipping once more. FSDP reduces such
    gradients itself; where no data-parallel engine wraps the model (dp = 1) the strategy calls this once per
    optimizer step, after the last backward, as Megatron-LM reduces its sequence-parallel norm gradients.
    """
    groups: dict[tuple, list[Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            summed = all(type(p) is Partial and p.reduce_op in ("sum", "avg")
                         for p in grad.placements if p.is_partial())
            if summed and grad.to_local().device.type == grad.device_mesh.device_type:
                groups[(grad.device_mesh, grad.placements, grad.dtype)].append(param)
            else:  # other reductions, or offloaded gradients: DTensor's own redistribution
                param.grad = grad.redistribute(grad.device_mesh, _replicated(grad.placements))
    for (mesh, placements, _), params in groups.items():
        locals_ = [param.grad.to_local() for param in params]
        flat = torch.cat([local.reshape(-1) for local in locals_])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                group = mesh.get_group(dim)
                dist.all_reduce(flat, group=group)
                if placement.reduce_op == "avg":
                    flat /= dist.get_world_size(group)
        for param, values in zip(params, flat.split([local.numel() for local in locals_])):
            grad = param.grad
            contiguous = torch.empty(grad.shape, device="meta").stride()  # the buffer's layout, not the old one
            param.grad = DTensor.from_local(values.view_as(grad.to_local()), mesh, _replicated(placements),
                                            run_check=False, shape=grad.shape, stride=contiguous)


def _replicated(placements: tuple) -> tuple:
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Each parameter that several modules hold (a tied embedding and LM head): its ``(module, attribute)``
    places, first the one ``named_parameters`` reports."""
    places: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module_name, attribute))
    return [where for where in places.values() if len(where) > 1]


def _tie_again(model: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """``parallelize_module`` gives every module a parameter of its own: hand the first place's to the others, which
    keeps one weight trained by both (embedding and LM head are sharded alike: over the vocabulary, dim 0). A tie
    whose places are sharded differently cannot be kept, and is refused."""
    for places in tied:
        params = [model.get_submodule(name).get_parameter(attribute) for name, attribute in places]
        layouts = {(type(p).__name__, tuple(p.placements) if isinstance(p, DTensor) else None) for p in params}
        if len(layouts) > 1:
            described = ", ".join(f"{name or type(model).__name__}.{attribute} ({_layout_of(p)})"
                                  for (name, attribute), p in zip(places, params))
            raise TensorParallelError(
                f"Tensor parallelism would split one tied parameter differently where it is held: {described}."
                " Give the modules that share it roles that shard it alike (a tied embedding and LM head:"
                " \"embedding\" and \"head\", both over the vocabulary), or untie it.")
        for name, attribute in places[1:]:
            setattr(model.get_submodule(name), attribute, params[0])


def _layout_of(param: Tensor) -> str:
    return f"DTensor {list(param.placements)}" if isinstance(param, DTensor) else "a plain tensor"


def _narrow_head_biases(attention: nn.Module, biases: Mapping[str, Optional[int]], heads: int,
                        mesh: DeviceMesh) -> None:
    """Hand ``attention`` the biases of this rank's ``heads``/tp heads (consecutive, as the q, k, v columns it holds)
    where its model passes the biases of all ``heads`` (ALiBi's) as the arguments ``biases`` names (argument ->
    dimension of the heads; None: dimension 0 holds batch × heads). A tensor whose dimension is not ``heads`` wide
    (a mask broadcast over the heads) is left whole."""
    local = heads // mesh.size()
    start = mesh.get_local_rank() * local
    names = [p for p in inspect.signature(attention.forward).parameters]
    positions = {name: names.index(name) for name in biases if name in names}

    def narrowed(value: Any, dim: Optional[int]) -> Any:
        if not isinstance(value, Tensor):
            return value
        if dim is None:
            if value.shape[0] % heads:
                raise TensorParallelError(
                    f"{type(attention).__name__} received biases of {value.shape[0]} rows, not a multiple of its"
                    f" {heads} heads: meshlight cannot tell this rank's. Train it without tensor parallelism.")
            return value.unflatten(0, (-1, heads))[:, start:start + local].flatten(0, 1)
        return value.narrow(dim, start, local) if value.dim() > dim and value.shape[dim] == heads else value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for name, position in positions.items():
            if name in kwargs:
                kwargs[name] = narrowed(kwargs[name], biases[name])
            elif position < len(args):
                args[position] = narrowed(args[position], biases[name])
        return tuple(args), kwargs

    attention.register_forward_pre_hook(hook, with_kwargs=True)


#: the split group (an attention) whose forward is running, left set when it raises: (its name, the head-count
#: attributes the strategy divided in it)
_RUNNING: list[Optional[tuple[str, list[str]]]] = [None]


def _name_while_running(module: nn.Module, name: str, divided: list[str]) -> None:
    def enter(*_: Any) -> None:
        _RUNNING[0] = (name, divided)

    def leave(*_: Any) -> None:
        _RUNNING[0] = None

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _reshape_note(tp: int, running: Optional[tuple[str, list[str]]]) -> str:
    general = (f"meshlight: under tensor parallelism each rank holds 1/{tp} of the attention heads, and the strategy"
               " divides the head-count attributes (n_heads, num_heads, n_head, …) by tp.")
    fix = (" A reshape whose other sizes come from the full width no longer fits (nanoGPT's view(B, T, self.n_head,"
           " C // self.n_head) with C = x.size(-1)): reshape with the head size or -1, e.g. view(B, T, self.n_head,"
           " -1).")
    if running is None:
        return general + fix
    name, divided = running
    if divided:
        return f"{general} In {name} it divided {', '.join(divided)}.{fix}"
    return (f"{general} {name} has none of them, so it still reshapes by the whole model's head count: name that"
            f" attribute n_heads (or num_heads, …), or reshape by -1; or give {name} its own entry in the"
            " tensor-parallel plan (the strategy's plan=), or parallelize it yourself in configure_model().")


@contextmanager
def explaining_tensor_parallel_errors(tp: int, loss_parallel: bool) -> Generator[None, None, None]:
    """Add what meshlight knows to PyTorch's error, in a training step (or its backward) at tensor-parallel size
    ``tp`` and with loss parallelism on or off as the strategy has it, when a plain tensor meets a DTensor or a
    reshape does not fit a rank's heads."""
    _RUNNING[0] = None
    try:
        yield
    except RuntimeError as error:
        explained = any(note.startswith("meshlight:") for note in getattr(error, "__notes__", ()))
        if tp > 1 and not explained and re.search(r"shape '\[.*\]' is invalid for input of size", str(error)):
            error.add_note(_reshape_note(tp, _RUNNING[0]))
        if tp > 1 and "got mixed torch.Tensor and DTensor" in str(error) and not explained:
            if loss_parallel:
                error.add_note(
                    "meshlight: under tensor parallelism the LM head's training logits are a DTensor sharded over"
                    " the vocabulary (loss parallelism), and F.cross_entropy on them returns a DTensor. Call"
                    " loss.full_tensor() (or logits.full_tensor()) before combining them with plain tensors (an"
                    " auxiliary loss), or pass loss_parallel=False."
                )
            error.add_note(
                "meshlight: inside the model, a plain tensor meeting a DTensor is a module or parameter tensor"
                " parallelism does not split: give it a role in the tensor-parallel plan (the strategy's plan= or"
                " tp_plan=) or pass sequence_parallel=False."
            )
        raise
