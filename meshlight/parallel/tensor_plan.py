"""Tensor-parallel plans: which role each module of a model takes (:mod:`meshlight.parallel.tensor` applies them).

Plans come from :func:`derive_plan` (structure: inside each repeated block, the Linears that read the
hidden state are colwise and the one that writes back to it is rowwise) or from a user dict of
module-name patterns, resolved by :func:`resolve_plan`. A model must keep its head counts in attributes the
strategy can scale (``n_heads``, ``num_key_value_heads`` …), or keep ``head_dim`` and reshape heads with ``-1``
(:mod:`meshlight.parallel.model_shape` reads them, for the planner too);
:func:`validate_plan` refuses attention with neither (it would train narrower heads without an error) and a
column→row group that does not have a module of its own (that module's input is gathered for the group).
:func:`sequence_region` decides where sequence parallelism holds shares of the sequence.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from fnmatch import fnmatch
from typing import Any, Optional, Union

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from meshlight.nn.moe import MoE
from meshlight.parallel.adapters import adapters_unwrapped, read_without_adapters
from meshlight.parallel.blocks import class_path
from meshlight.parallel.checkpoint import _shorten
from meshlight.parallel.expert import is_dense_experts, is_stacked_experts, listed_experts
from meshlight.parallel.expert_tensor import stacked_split_placements
from meshlight.parallel.model_shape import (
    HEAD_COUNT_ATTRIBUTES,
    KEPT_WHOLE,
    KEY_SELECTORS,
    WHOLE_MIXERS,
    attention_heads,
    decoder_blocks,
    fused_parts,
    head_counts,
    head_dim_of,
    head_width,
    hidden_size,
    is_transposed_linear,
    linear_widths,
    per_head_parameters,
    projection_heads,
    projections,
)
from meshlight.parallel.precision import is_norm

__all__ = [
    "COLUMN_ROLES", "HEAD_BIASES", "PARTS_IN_ORDER", "ROLES", "WHOLE_MIXERS", "TensorParallelError",
    "block_held_groups", "derive_plan", "fused_projection", "head_biases", "model_plan", "moe_blocks_of",
    "published_roles", "replicated_kv_heads", "resolve_plan", "sequence_region", "stage_plan", "validate_plan",
    "whole_mixers",
]

ROLES = ("colwise", "fused_colwise", "rowwise", "embedding", "head", "norm", "head_norm", "colwise_norm", "latent",
         "interior", "replicate", "whole")
#: where a latent attention (DeepSeek-V2/V3's multi-head latent attention, as Hugging Face and DeepSeek name it) keeps
#: the widths of the latents every head reads: its down-projections write them (k's with the shared rotary part, of
#: ``qk_rope_head_dim``), its up-projections read them
LATENT_RANK_ATTRIBUTES = ("q_lora_rank", "kv_lora_rank")
COLUMN_ROLES = ("colwise", "fused_colwise")
Plan = dict[str, str]
UserPlan = Mapping[str, Union[str, ParallelStyle]]


class TensorParallelError(ValueError):
    """A model or plan that tensor parallelism cannot split as asked; the message names the fix."""


# ------------------------------------------------------------------------------------------- plans


def derive_plan(model: nn.Module) -> Plan:
    """Roles derived from the model's structure (no class names).

    Inside each repeated block, Linears (and Hugging Face's ``Conv1D``) are grouped by the module that owns them. In
    each group the last Linear that writes the hidden size ``D`` back is rowwise (not an output gate registered after
    it: :func:`~meshlight.parallel.model_shape.projections`) and the Linears that read ``D`` are colwise — a fused one
    (q|k|v, gate|up) split part by part (:func:`fused_projection`); groups without such a writer (a gate) are
    replicated. Outside the blocks: the Embedding whose vocabulary the LM head produces is the token embedding, other
    ``D``-wide Embeddings are position tables, and parameter-only modules of width ``D`` (norms) run sequence parallel.
    """
    blocks = _named_blocks(model)
    if not blocks:
        raise TensorParallelError(
            f"{_model_name(model)} has no repeated blocks (an nn.ModuleList/ModuleDict of layers), which the"
            " automatic tensor-parallel plan works on; pass a plan, e.g. TensorParallelStrategy(plan={"
            '"layers.*.attn.q": "colwise", …}).'
        )
    _check_per_layer_inputs(blocks)
    hidden = _hidden_size(blocks)
    modules = dict(model.named_modules())
    plan: Plan = {}
    published = published_roles(model)
    latent: Plan = {}
    mixers, selectors = _whole_mixers(blocks), _kept_whole(blocks, KEY_SELECTORS)
    for prefix, readers, writer in _column_row_groups(blocks, hidden):
        latent.update(_latent_roles(modules[prefix], prefix, readers, writer, hidden))
        readers = [name for name in readers if name not in latent]
        fused = _fused_readers(modules, prefix, readers, writer, hidden, published)
        plan[writer] = "rowwise"
        plan.update({name: "fused_colwise" if name in fused else "colwise" for name in readers})
        plan.update(_interior(modules[prefix], prefix))
    plan = {**plan, **_structural_roles(model, blocks, hidden), **_colwise_norms(model, blocks, hidden, plan),
            **latent}
    plan = {name: role for name, role in plan.items() if not _within(name, [*mixers, *selectors])}
    whole = {**dict.fromkeys(mixers, "whole"), **dict.fromkeys(selectors, "latent")}
    return {**_left_whole(blocks, {**plan, **whole}, hidden), **plan, **whole}


@read_without_adapters
def whole_mixers(model: nn.Module) -> list[str]:
    """The sequence mixers in ``model``'s blocks that tensor parallelism keeps whole on every rank
    (:data:`WHOLE_MIXERS`), by full name."""
    return _whole_mixers(_named_blocks(model))


def _whole_mixers(blocks: list[tuple[str, nn.Module]]) -> list[str]:
    return _kept_whole(blocks, WHOLE_MIXERS)


def _kept_whole(blocks: list[tuple[str, nn.Module]], classes: frozenset[str]) -> list[str]:
    """The modules of ``classes`` in the blocks, by full name."""
    return [_join(block_name, name) for block_name, block in blocks for name, module in block.named_modules()
            if class_path(module) in classes]


def _interior(owner: nn.Module, prefix: str) -> Plan:
    """The children of a column→row group's ``owner`` (named ``prefix``) that hold parameters of their own alone and
    are neither Linears nor norms: a learned activation between the readers and the writer (Apertus's xIELU), role
    ``interior``. Each rank runs it on its hidden units, so each rank's gradient is its units' part of the sum over
    tp (:class:`~meshlight.parallel.tensor_styles.Interior`, which refuses one whose input turns out to be something
    else at its first call)."""
    return {_join(prefix, name): "interior" for name, child in owner.named_children()
            if not linear_widths(child) and _norm_width(child) in (None, 1)  # (scalars: no norm)
            and 0 < len(list(child.parameters(recurse=False))) == len(list(child.parameters()))}


def _colwise_norms(model: nn.Module, blocks: list[tuple[str, nn.Module]], hidden: int,
                   plan: Mapping[str, Any]) -> Plan:
    """Norms over a whole colwise output: a norm held beside a column→row group in a module of its own (an
    attention, not a block) and as wide as the output of one of the projections ``plan`` makes colwise (not
    fused), but not one head wide — OLMo 2's q and k norms over all heads at once. Each rank holds 1/tp of that
    output; the norm runs on it with its statistics summed over tp (:mod:`meshlight.parallel.tensor`, which refuses
    one whose input turns out to be of another width: a norm of the module's input, as wide by chance)."""
    modules, block_ids = dict(model.named_modules()), {id(block) for _, block in blocks}
    roles: Plan = {}
    for prefix, readers, _ in _column_row_groups(blocks, hidden):
        if id(modules[prefix]) in block_ids:  # a block holding its Linears itself: refused by _check_groups
            continue
        # (not one head wide: a norm over each head, where one key/value head makes a projection as wide)
        widths = {linear_widths(modules[name])[1] for name in readers if plan.get(name) == "colwise"}
        widths.discard(head_dim_of(modules[prefix]))
        roles.update({_join(prefix, n): "colwise_norm" for n, m in modules[prefix].named_children()
                      if _norm_width(m) in widths})
    return roles


def _column_row_groups(blocks: list[tuple[str, nn.Module]], hidden: int) -> Iterator[tuple[str, list[str], str]]:
    """(owner, readers, writer) by full name: in each module of the blocks, its Linears that read the hidden size
    and the last one that writes it back (a module without such a pair — a gate — holds no group). Not inside a
    list of experts (:func:`~meshlight.parallel.expert.listed_experts`): each expert runs on the tokens routed to it,
    whole on every rank."""
    for block_name, block in blocks:
        listed = [*listed_experts(block), *(n for n, m in block.named_modules()
                                            if class_path(m) in KEPT_WHOLE)]
        for group_name, group in block.named_modules():
            if _within(group_name, listed):
                continue
            readers, writer = projections(group, hidden)
            if writer and readers:
                prefix = _join(block_name, group_name)
                yield prefix, [_join(prefix, n) for n in readers], _join(prefix, writer)


def _structural_roles(model: nn.Module, blocks: list[tuple[str, nn.Module]], hidden: int) -> Plan:
    """Every role but the blocks' Linears: norms (in and outside the blocks, and over each head inside
    attention), the LM head, the token embedding whose vocabulary it produces, and other ``D``-wide embeddings
    (positions) replicated."""
    roles: Plan = {}
    for block_name, block in blocks:
        roles.update({_join(block_name, n): "norm" for n, m in block.named_modules() if _is_norm(m, hidden)})
        for owner_name, owner in block.named_modules():  # QK-norms: norms as wide as the attention's head_dim
            head_dim = head_dim_of(owner)
            roles.update({_join(block_name, owner_name, n): "head_norm" for n, m in owner.named_children()
                          if head_dim not in (None, hidden) and _is_norm(m, head_dim)})
    outside = list(_outside_blocks(model, blocks))
    embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
    vocabularies = {m.num_embeddings for _, m in embeddings}
    heads = [(n, m) for n, m in outside if isinstance(m, nn.Linear) and m.in_features == hidden
             and m.out_features in vocabularies]
    roles.update({n: "norm" for n, m in outside if _is_norm(m, hidden)})
    vocabulary = heads[-1][1].out_features if heads else None
    if heads:
        roles[heads[-1][0]] = "head"
    # the token embedding (any width: a factorized one is projected to D after it): the first with the head's
    # vocabulary (a position table may be as long as the vocabulary is wide); other D-wide tables: positions
    token = next((n for n, m in embeddings if m.num_embeddings == vocabulary), None)
    roles.update({n: "embedding" if n == token else "replicate" for n, m in embeddings
                  if n == token or m.embedding_dim == hidden})
    return roles


@read_without_adapters
def sequence_region(model: nn.Module, plan: Mapping[str, Union[str, ParallelStyle]]) -> Optional[tuple[str, str]]:
    """Where sequence parallelism holds this rank's share of the sequence; ``None``: Megatron-LM's region, from the
    token embedding's output to the LM head's input.

    That region needs everything outside the blocks to have a role: a token embedding that hands on the share, an LM
    head that gathers it, norms and position tables that run on it. A module outside the blocks the plan gives no
    role (an adapter after the embedding, a factorized embedding's projection, a value or classification head, a
    learned class token) would read a share where it expects the sequence — trained on its share alone, or failing
    on the shapes; so would a table outside the blocks computed for the positions the model counts from the
    embedding's output (:func:`_tables`: Hugging Face's rotary embeddings), and any model whose forward takes the
    embedding's output as ``inputs_embeds`` (:func:`_takes_embeddings`: Hugging Face's count positions from it).
    Then the region is the blocks only, returned as (first block, last block): the first block's input is cut to the
    share and the last block's output gathered, and the rest runs on the whole sequence, as without sequence
    parallelism. Layouts a user plan gives to modules outside the blocks (styles, colwise/rowwise roles) keep
    Megatron-LM's region (the user chose them); beside a module outside the blocks with no role they are refused, as
    no region suits both."""
    blocks = _named_blocks(model)
    if not blocks:
        return None
    outside = {name: role for name, role in plan.items() if not _within(name, [n for n, _ in blocks])}
    # layouts a user plan chose there (a style, or a column→row group, which splits a share of the sequence)
    styled = [name for name, role in outside.items()
              if isinstance(role, ParallelStyle) or role in (*COLUMN_ROLES, "rowwise")]
    unplanned = _outside_unplanned(model, blocks, plan)
    if styled and unplanned:
        raise TensorParallelError(
            f"The tensor-parallel plan splits {', '.join(map(_shown, styled[:3]))} outside the blocks (a style, or a"
            f" colwise/rowwise role) and gives no role to {', '.join(map(_shown, unplanned[:3]))}, also outside them:"
            " under sequence parallelism those layouts expect Megatron-LM's (shares of the sequence from the token"
            " embedding to the LM head), which would train the latter on this rank's share alone. Give them roles or"
            " styles too, leave the modules outside the blocks to meshlight, or pass sequence_parallel=False."
        )
    if styled or ({"embedding", "head"} <= set(outside.values()) and not unplanned and not _tables(model, blocks)
                  and not _takes_embeddings(model, blocks)):
        return None
    owners = sorted({name.rpartition(".")[0].rpartition(".")[0] for name, _ in blocks})
    if len(owners) > 1:
        raise TensorParallelError(
            f"Under sequence parallelism {_model_name(model)}'s blocks hold this rank's share of the sequence, cut"
            " where the first begins and gathered where the last ends, but its blocks live in"
            f" {len(owners)} modules ({', '.join(map(_shown, owners))}): its forward hands the hidden state on between"
            " them (HRM's runs them in cycles, adding the states of both), where it would be a share beside the"
            " whole. Pass sequence_parallel=False: the blocks' layers are still split over tp."
        )
    return blocks[0][0], blocks[-1][0]


def _tables(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """Modules outside the blocks that hold buffers and no parameters: tables computed from what the model's forward
    gives them, such as Hugging Face's ``rotary_emb``, called with positions the model counts from the embedding's
    output. On a share of the sequence they would cover the share's positions only."""
    return [name for name, module in _outside_blocks(model, blocks)
            if next(module.buffers(recurse=False), None) is not None and next(module.parameters(), None) is None]


def _takes_embeddings(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """Modules outside the blocks whose forward takes ``inputs_embeds`` (Hugging Face's models): they count positions
    from the embedding's output — GPT-2's position ids, masks, rotary tables — which on a share of the sequence
    would cover the share alone."""
    return [name for name, module in _outside_blocks(model, blocks)
            if "inputs_embeds" in inspect.signature(module.forward).parameters]


def _outside_blocks(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> Iterator[tuple[str, nn.Module]]:
    """``model``'s named modules that are not inside one of its ``blocks``."""
    in_blocks = {id(m) for _, block in blocks for m in block.modules()}
    return ((name, module) for name, module in model.named_modules() if id(module) not in in_blocks)


def _outside_unplanned(model: nn.Module, blocks: list[tuple[str, nn.Module]], plan: Mapping[str, Any]) -> list[str]:
    """Parameters outside the blocks that no role covers, by full name (a role names one module; a style covers
    the modules inside it too)."""
    styled = [name for name, role in plan.items() if isinstance(role, ParallelStyle)]
    return [_join(name, p) for name, module in _outside_blocks(model, blocks)
            if name not in plan and not _within(name, styled) for p, _ in module.named_parameters(recurse=False)]


def resolve_plan(model: nn.Module, patterns: UserPlan) -> dict[str, Union[str, ParallelStyle]]:
    """Match each pattern (``fnmatch`` per dotted component, e.g. ``"layers.*.attention.wq"``) against the
    model's module names — as a full name or as a suffix at a component boundary, so a plan written for an
    inner model also applies inside the LightningModule that holds it.

    Modules the patterns do not mention keep the structural roles :func:`derive_plan` gives them (norms —
    with sequence parallelism a norm left out would see part of the sequence and its replicated weight
    would get different gradients on each rank —, norms over a colwise output the patterns form, token embedding,
    LM head): the patterns decide how the blocks' Linears are split. Raises listing close names for a pattern that
    matches nothing, and for unknown style names.
    """
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, Union[str, ParallelStyle]] = {}
    for pattern, style in patterns.items():
        if isinstance(style, str) and style not in ROLES:
            raise TensorParallelError(
                f"Unknown tensor-parallel style {style!r} for {pattern!r}; choose one of {ROLES}."
            )
        matches = [name for name in names if _matches(name, pattern)]
        if not matches:
            # suggest modules a plan can give a role: those holding parameters, named as the user wrote them
            held = [_shown(name) for name, m in model.named_modules()
                    if name and next(m.parameters(recurse=False), None) is not None]
            close = difflib.get_close_matches(pattern, held, n=5, cutoff=0.5)
            close = close or _close_by_last_component(pattern, held)
            listed = (f"Close module names: {', '.join(close)}." if close else
                      f"Modules that hold parameters: {_shorten(held)}.")
            raise TensorParallelError(f"The tensor-parallel plan pattern {pattern!r} matches no module. {listed}")
        resolved.update(dict.fromkeys(matches, style))
    blocks = _named_blocks(model)
    if not blocks:
        return resolved
    hidden = _hidden_size(blocks)
    plan = {**_structural_roles(model, blocks, hidden), **_colwise_norms(model, blocks, hidden, resolved), **resolved}
    return {**_left_whole(blocks, plan, hidden), **plan}


@read_without_adapters
def model_plan(model: nn.Module, patterns: Optional[UserPlan] = None) -> dict[str, Union[str, ParallelStyle]]:
    """The plan for ``model``: the user's ``patterns`` resolved (:func:`resolve_plan`), else :func:`derive_plan`."""
    return resolve_plan(model, patterns) if patterns else derive_plan(model)


def stage_plan(plan: Mapping[str, Union[str, ParallelStyle]], stage: nn.Module) -> dict[str, Union[str, ParallelStyle]]:
    """The part of the whole model's ``plan`` that concerns a pipeline stage cut from it (same module names).

    Plans are made on the whole model, before the split: a stage alone misleads the structural roles (without
    the token embedding the LM head is not recognizable as one, and without the head the embedding is not).
    Pieces of other stages are parameter-free pass-throughs under the same names, and are left out.
    """
    with adapters_unwrapped(stage):  # (a LoRA layer's parameters are its Linears')
        owned = {name for name, module in stage.named_modules() if any(True for _ in module.parameters(recurse=False))}
    return {name: role for name, role in plan.items() if name in owned}


@read_without_adapters
def validate_plan(model: nn.Module, plan: Mapping[str, Union[str, ParallelStyle]], tp: int, world_size: int, *,
                  sequence_parallel: bool = True) -> None:
    """Raise, naming the valid tp values, when ``tp`` does not divide every dimension the plan shards, the
    attention head counts, or the hidden size — but an attention's key/value heads, where tp is a multiple of them
    (:func:`replicated_kv_heads`); and naming the fix when a block holds parameters the plan leaves
    whole where they would train wrong (:func:`_reject_unsplit`). The vocabulary is no constraint: the token
    embedding and the LM head are split into uneven shards where tp does not divide it (DTensor's, the last
    shards a row shorter), exact like the even split and without padded rows in checkpoints."""
    modules = dict(model.named_modules())
    # (what, value, the attention it belongs to, whether it counts heads or is a width)
    constraints: list[tuple[str, int, Optional[str], str]] = []
    hidden: Optional[int] = None
    for name, role in plan.items():
        widths = linear_widths(modules[name])
        owner = name.rpartition(".")[0]
        if role in COLUMN_ROLES and widths:
            parts = fused_projection(modules, plan, name)
            constraints += ([(f"{name} part {i + 1} of {len(parts)}", part, owner, "width")
                             for i, part in enumerate(parts)] if parts
                            else [(f"{name} outputs", widths[1], owner, "width")])
            hidden = hidden or widths[0]
        elif role == "rowwise" and widths:
            constraints.append((f"{name} inputs", widths[0], None, "width"))
    if hidden is not None:
        constraints.append(("hidden size", hidden, None, "width"))
    _check_groups(model, plan)
    _reject_unsplit(_named_blocks(model), plan, sequence_parallel)
    if sequence_parallel:
        _reject_moe_arguments(_named_blocks(model))
    for parent in _colwise_parents(plan):
        constraints += [(_join(parent, attribute), count, parent, "heads")
                        for attribute, count in head_counts(modules[parent]).items()]
        # (a fused projection's heads are its parts', each checked above)
        colwise = [name.rpartition(".")[2] for name, role in plan.items()
                   if role == "colwise" and name.rpartition(".")[0] == parent]
        constraints += [(f"heads of {_shown(_join(parent, name))}", heads, parent, "heads")
                        for name, heads in projection_heads(modules[parent], colwise).items()]

    def unmet(size: int) -> list[tuple[str, int]]:
        replicated = {parent: kv for parent in {c[2] for c in constraints if c[2] in modules}
                      if (kv := replicated_kv_heads(modules, plan, parent, hidden or 0, size))}
        return [(what, value) for what, value, parent, kind in constraints if value % size
                and not (parent in replicated
                         and value == replicated[parent][0] * (replicated[parent][1] if kind == "width" else 1))]

    bad = unmet(tp)
    if bad:
        valid = [t for t in range(1, world_size + 1) if world_size % t == 0 and not unmet(t)]
        what, value = bad[0]
        raise TensorParallelError(f"tp={tp} does not divide {_shown(what)}={value}; choose tp in {valid}.")
    for name, role in plan.items():
        parent = name.rpartition(".")[0]
        if role == "colwise_norm" and parent in modules and hidden and (
                kv := replicated_kv_heads(modules, plan, parent, hidden, tp)) and (
                _norm_width(modules[name]) == kv[0] * kv[1]):
            raise TensorParallelError(
                f"tp={tp} exceeds the {kv[0]} key/value heads of {_shown(parent)}, which meshlight then holds whole on"
                f" several ranks, but {_shown(name)} normalizes over all of them at once: choose a tp that divides"
                f" {kv[0]}.")


# ------------------------------------------------------------------------------------------- structure


def fused_projection(modules: Mapping[str, nn.Module], plan: Mapping[str, Any], name: str) -> Optional[tuple[int, ...]]:
    """The parts (:func:`~meshlight.parallel.model_shape.fused_parts`) of ``name`` when the plan gives it the role
    ``fused_colwise`` (its parts one after another, split part by part), told from its widths against those of the
    rowwise projection beside it; None for any other role. ``modules``: the model's, by name. Raises where the parts
    cannot be told."""
    if plan.get(name) != "fused_colwise":
        return None
    owner, _, _ = name.rpartition(".")
    reader, writer = linear_widths(modules[name]), _writer_widths(modules, plan, owner)
    parts = (fused_parts(modules[owner], reader[1], writer[0], writer[1], kv=_named_kv(name)) if reader and writer
             else None)
    if parts is None:
        raise TensorParallelError(
            f"{_shown(name)} has the tensor-parallel role 'fused_colwise', but its parts cannot be told: it needs a"
            " rowwise output projection beside it in the plan and head counts on its module (n_heads, n_kv_heads or"
            " head_dim) that explain its width, or a width twice what the output projection reads (gate|up)."
        )
    return parts


def replicated_kv_heads(modules: Mapping[str, nn.Module], plan: Mapping[str, Any], parent: str, hidden: int,
                        tp: int) -> Optional[tuple[int, int]]:
    """(key/value heads, head width) of attention ``parent`` where ``tp`` splits its query heads but exceeds its
    key/value heads and is a multiple of them (multi- and grouped-query attention with few key/value heads: Gemma's
    one, Falcon-7B's, StarCoder's): each rank then computes the one key/value head its query heads read, ``tp/kv``
    ranks each, as Megatron-LM replicates them. None otherwise. ``modules``: the model's, by name."""
    heads = attention_heads(modules[parent], hidden)
    if not heads or not (heads[1] < heads[0] and heads[0] % tp == 0 and heads[1] % tp and tp % heads[1] == 0):
        return None
    writer = _writer_widths(modules, plan, parent)
    head_dim = head_width(modules[parent], heads, writer[0] if writer else None)
    # (not where a plain colwise projection packs several heads' q, k and v together: GPT-NeoX's, Falcon's grouped
    # q|k|v, which column sharding splits only into whole heads or groups)
    readers = [linear_widths(modules[n]) for n, role in plan.items()
               if role == "colwise" and n.rpartition(".")[0] == parent]
    if not head_dim or any(w and w[1] not in (heads[0] * head_dim, heads[1] * head_dim) for w in readers):
        return None
    return heads[1], head_dim


def _writer_widths(modules: Mapping[str, nn.Module], plan: Mapping[str, Any],
                   owner: str) -> Optional[tuple[int, int]]:
    """(in, out) widths of the output projection ``plan`` gives ``owner`` (its last rowwise child), or None."""
    writers = [n for n, role in plan.items() if role == "rowwise" and n.rpartition(".")[0] == owner]
    return linear_widths(modules[writers[-1]]) if writers else None


def published_roles(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel styles a Hugging Face model publishes for its modules (``config.base_model_tp_plan``,
    patterns relative to its base model), by full module name. (A wrapper forwarding attributes to the model it wraps,
    PEFT's, shows that model's config and base model: the base model's name is where it truly is.)"""
    names = {module: name for name, module in model.named_modules()}
    for module in names:
        published = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if not isinstance(published, Mapping) or not published:
            continue
        base_name = getattr(module, "base_model_prefix", "")
        base = getattr(module, base_name, None) if base_name else None
        root = base if isinstance(base, nn.Module) and base in names else module
        return {_join(names[root], name): style for name, _ in root.named_modules() if name
                for pattern, style in published.items() if _matches_whole(name, pattern)}
    return {}


#: Attention (and MLP) classes whose fused q|k|v (gate|up) holds its parts one after another (the forward splits it
#: by their widths: Phi-3's q|k|v by the config's head counts, its, GLM's and Granite's gate|up by chunk(2)).
PARTS_IN_ORDER = frozenset({
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention", "litgpt.model.CausalSelfAttention",
    "transformers.models.phi3.modeling_phi3.Phi3Attention", "transformers.models.phi3.modeling_phi3.Phi3MLP",
    "transformers.models.glm.modeling_glm.GlmMLP", "transformers.models.glm4.modeling_glm4.Glm4MLP",
    "transformers.models.glm4v.modeling_glm4v.Glm4vTextMLP", "transformers.models.openai.modeling_openai.Attention",
    "transformers.models.mpt.modeling_mpt.MptAttention",
    # Granite 4's shared expert beside its routed ones (gate|up by chunk(2))
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMLP",
    "transformers.models.granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedMLP",
})


#: Attention classes whose fused q|k|v holds its parts one after another or head by head as their config says:
#: ``"parts"`` (q|k|v, split part by part) or ``"heads"`` (each head's, or each key/value group's, q, k and v together,
#: which plain column sharding splits into whole heads or groups).
LAYOUT_BY_CONFIG: dict[str, Callable[[nn.Module], str]] = {
    # Falcon-7B's multi-query q|k|v; Falcon-40B's and later groups of q heads with their key and value; the first
    # Falcons' heads of q, k, v
    "transformers.models.falcon.modeling_falcon.FalconAttention":
        lambda attention: "parts" if attention.multi_query and not attention.new_decoder_architecture else "heads",
    # StarCoder's multi-query q|k|v, or heads of q, k, v
    "transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention":
        lambda attention: "parts" if attention.multi_query else "heads",
    # heads of q, k, v whatever the config (Fuyu's language model is Persimmon's)
    "transformers.models.persimmon.modeling_persimmon.PersimmonAttention": lambda attention: "heads",
    "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention":
        lambda attention: "heads",
    # BLOOM's heads of q, k, v (the forward views them as [heads, 3, head_dim])
    "transformers.models.bloom.modeling_bloom.BloomAttention": lambda attention: "heads",
}

#: Attention classes that receive a bias per head from their model (ALiBi's, built for all heads before the blocks):
#: argument -> the dimension holding the heads, or None where dimension 0 holds batch × heads (BLOOM's
#: ``[batch·heads, 1, keys]``). Tensor parallelism hands each rank the biases of the heads it holds
#: (:func:`~meshlight.parallel.tensor.apply_tensor_parallel`). Falcon-RW also folds its ALiBi biases into the
#: attention mask, ``[batch, heads, queries, keys]`` (``[batch, 1, …]`` without ALiBi: left whole).
HEAD_BIASES: dict[str, dict[str, Optional[int]]] = {
    "transformers.models.bloom.modeling_bloom.BloomAttention": {"alibi": None},
    "transformers.models.falcon.modeling_falcon.FalconAttention": {"alibi": 1, "attention_mask": 1},
    "transformers.models.mpt.modeling_mpt.MptAttention": {"position_bias": 0},
}


def head_biases(attention: nn.Module) -> dict[str, Optional[int]]:
    """The arguments that bring ``attention`` a bias per head, and the dimension of their heads (:data:`HEAD_BIASES`;
    empty for other classes)."""
    return HEAD_BIASES.get(class_path(attention), {})


def _fused_layout(owner: nn.Module) -> Optional[str]:
    """How ``owner``'s fused q|k|v (gate|up) packs its parts, where its class is known: ``"parts"`` one after another
    (:data:`PARTS_IN_ORDER`), ``"heads"`` head by head (:data:`LAYOUT_BY_CONFIG`); None where it is not."""
    name = class_path(owner)
    rule = LAYOUT_BY_CONFIG.get(name)
    return "parts" if name in PARTS_IN_ORDER else rule(owner) if rule else None


def _fused_readers(modules: Mapping[str, nn.Module], group: str, readers: list[str], writer: str,
                   hidden: int, published: Mapping[str, str]) -> set[str]:
    """The readers of a column→row group that are fused projections packing their parts one after another
    (:func:`fused_parts`: q|k|v from the owner's head counts, k|v, gate|up), split part by part.

    Structure tells a fused projection's parts, not their order: GPT-2's and litgpt's q|k|v hold all of q, then
    all of k, then all of v, while GPT-NeoX and BLOOM hold each head's q, k, v together (plain column sharding suits
    those), and nothing in their modules tells the two apart (BLOOM keeps GPT-2's ``split_size`` and never uses
    it). One after another is taken for the classes known to do so (:data:`PARTS_IN_ORDER`, and by their config
    :data:`LAYOUT_BY_CONFIG`); head by head where the model's published plan (:func:`published_roles`) gives the
    projection Hugging Face's plain ``colwise``, or the class's config says so. (Phi-3 publishes
    ``colwise_gather_output`` for its q|k|v and gate|up, each rank gathering the whole output; its attention slices
    q by the config's head count, which the attention's own copy of the config holds divided by tp:
    :func:`~meshlight.parallel.tensor.apply_tensor_parallel`.) Other
    fused projections — that order unknown, or parts the head counts do not explain (a reader wider than what the
    writer reads, a fused k|v by name) — would train a different model without an error: refused, naming the
    fix."""
    owner, read = modules[group], linear_widths(modules[writer])[0]
    widths = {name: linear_widths(modules[name])[1] for name in readers}
    parts = {name: fused_parts(owner, width, read, hidden, kv=_named_kv(name)) for name, width in widths.items()}
    layout = _fused_layout(owner)
    by_head = {name for name in readers if published.get(name) == "colwise" or layout == "heads"}
    fused = [name for name, width in widths.items() if (parts[name] or width > read or _named_kv(name))
             and name not in by_head]
    unknown = [name for name in fused if not (parts[name] and layout == "parts")]
    plain = [width for name, width in widths.items() if name not in by_head]
    if unknown or not fused and plain and all(width != read for width in plain):
        named = f" ({', '.join(_shown(name) for name in unknown)})" if unknown else ""
        known = bool(unknown) and all(parts[name] for name in unknown)
        why = ("its parts are known from the head counts, but not whether they sit one after another (q|k|v, as"
               " GPT-2's and litgpt's) or head by head (each head's q, k, v together, as GPT-NeoX's): give it the"
               " role 'fused_colwise' for the first or 'colwise' for the second in the strategy's plan=" if known else
               "meshlight cannot tell its parts: it splits a fused q|k|v by the attention's head counts (n_heads and"
               " n_kv_heads, or head_dim; see HEAD_COUNT_ATTRIBUTES), and a fused gate|up as two halves of what the"
               " output projection reads. Keep the head counts under those names, use separate q, k, v (gate, up)"
               " layers")
        raise TensorParallelError(
            f"{_shown(group)} looks like a fused projection{named} (outputs {', '.join(map(str, widths.values()))}"
            f" feeding a {read}-wide output projection): {why}, or parallelize the module yourself in"
            " configure_model()."
        )
    return set(fused)


def _latent_roles(owner: nn.Module, prefix: str, readers: list[str], writer: str, hidden: int) -> Plan:
    """A latent attention's roles (multi-head latent attention: ``owner`` keeps the
    :data:`LATENT_RANK_ATTRIBUTES`): the ``readers`` of the hidden state that write a latent (of a rank it keeps, plus
    ``qk_rope_head_dim`` for k's shared rotary part), and the norms over a latent, ``latent`` — whole on every rank,
    as every head reads them; the Linears that read a latent, and a q projection of the hidden state where q has no
    latent (``q_lora_rank`` None), ``colwise`` — they make the heads; never the ``writer`` (the output projection,
    rowwise) nor a reader of the hidden state, though the width either reads may equal a latent's rank. Empty for
    other modules (their readers are q, k, v: :func:`_fused_readers`). A latent as wide as the hidden state is
    refused: its norm and up-projection would read as the block's."""
    ranks = {rank for a in LATENT_RANK_ATTRIBUTES if isinstance(rank := getattr(owner, a, None), int)}
    if not ranks:
        return {}
    if hidden in ranks:
        named = ", ".join(f"{a}={hidden}" for a in LATENT_RANK_ATTRIBUTES if getattr(owner, a, None) == hidden)
        raise TensorParallelError(
            f"{prefix} is a latent attention whose latent is as wide as the hidden state ({named}, hidden size"
            f" {hidden}): the automatic tensor-parallel plan tells a latent's norm and up-projection from the block's"
            " by their widths. Pass the attention's roles in the strategy's plan= (the latents' down-projections and"
            " norms 'latent', their up-projections 'colwise', the output projection 'rowwise')."
        )
    shared = getattr(owner, "qk_rope_head_dim", 0) or 0
    writes = {name: linear_widths(owner.get_submodule(name.rpartition(".")[2]))[1] for name in readers}
    roles: Plan = {name: "latent" if width in ranks or width - shared in ranks else "colwise"  # (q without a latent:
                   for name, width in writes.items()}  # DeepSeek-V2-Lite's, Kimi Linear's; its heads' widths)
    for name, child in owner.named_children():
        if _norm_width(child) in ranks:
            roles[_join(prefix, name)] = "latent"
        elif (width := linear_widths(child)) and width[0] in ranks and _join(prefix, name) not in (*readers, writer):
            roles[_join(prefix, name)] = "colwise"
    return roles


def _named_kv(name: str) -> bool:
    """Whether module ``name`` is named as a fused k|v (``kv``, ``to_kv``, ``kv_proj``, ``wkv``)."""
    return bool(re.search(r"(^|_)kv(_proj)?$", name.rsplit(".", 1)[-1].removeprefix("w")))


def _left_whole(blocks: list[tuple[str, nn.Module]], plan: Mapping[str, Any], hidden: int) -> Plan:
    """The blocks' Linears outside every column→row group and every role (a gate), and the router and stacked
    experts of a model's own MoE blocks (Hugging Face's): ``replicate``. Under sequence parallelism they run on this
    rank's share of the sequence; left plain, each rank's weight would get the gradient of its share alone and the
    ranks' weights would drift apart without an error. Linears the
    automatic plan would split (a group a user plan leaves out) stay as they are, for
    :func:`_reject_unsplit`: run on the share, attention would see only that share of the sequence."""
    grouped = {name for _, readers, writer in _column_row_groups(blocks, hidden) for name in (*readers, writer)}
    # a model's own MoE blocks: their router and experts (the blocks: beside the experts they route to)
    moe_blocks = {name for block_name, block in blocks for name in moe_blocks_of(block, block_name)}
    return {name: "replicate" for name, module in _unsplit(blocks, plan) if name not in grouped and (
        linear_widths(module) or _within(name, moe_blocks) and any(True for _ in module.parameters(recurse=False)))}


def moe_blocks_of(module: nn.Module, prefix: str = "") -> set[str]:
    """The names of ``module``'s own MoE blocks (Hugging Face's, litgpt's; under ``prefix``): the modules holding
    stacked experts or a list of experts, beside the router that scores them. They flatten the tokens before the
    router, so under sequence parallelism what they hold runs on this rank's share of the tokens. Dense stacked
    experts (Llama 4's) count where tensor parallelism can split them (their layout known); kept whole, they would
    take their input's groups of tokens for shares of one sequence."""
    stacked = [n for n, m in module.named_modules() if is_stacked_experts(m) or (
        is_dense_experts(m) and stacked_split_placements(m) is not None)]
    return {_join(prefix, name.rpartition(".")[0]) for name in (*stacked, *listed_experts(module))}


def _unsplit(blocks: list[tuple[str, nn.Module]], plan: Mapping[str, Any]) -> Iterator[tuple[str, nn.Module]]:
    """The blocks' modules outside every column→row group, planned module (a style given to a parent covers its
    children; a role names one module: ``replicate`` on a container reaches its Linears through
    :func:`_left_whole`) and MoE layer (split, or folded, by :mod:`meshlight.parallel.expert_tensor` instead of a
    plan)."""
    covered = (*_colwise_parents(plan),
               *(name for name, role in plan.items() if isinstance(role, ParallelStyle) or role == "whole"))
    for block_name, block in blocks:
        experts = [_join(block_name, n) for n, m in block.named_modules() if isinstance(m, MoE)]
        for name, module in block.named_modules():
            full = _join(block_name, name)
            if full not in plan and not _within(full, (*covered, *experts)):
                yield full, module


def _reject_unsplit(blocks: list[tuple[str, nn.Module]], plan: Mapping[str, Any], sequence_parallel: bool) -> None:
    """A block's parameters outside any role or column→row group would stay whole on every rank. Under sequence
    parallelism they meet the activations of this rank's share of the sequence: their gradients would differ
    between ranks, or the op would mix plain tensors and DTensors (a per-channel scale), or a group a user plan
    leaves out would attend over the share alone. A packed q|k|v weight (``nn.MultiheadAttention``'s) is refused
    either way: the attention would not be split at all. Refused, naming them."""
    for full, module in _unsplit(blocks, plan):
        own = [(n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        if linear_widths(module) and sequence_parallel:
            raise TensorParallelError(
                f"{_shown(full)} reads or writes the hidden state in a column→row group the tensor-parallel plan leaves"
                " out: under sequence parallelism it would run on this rank's share of the sequence, and attention"
                " between such Linears would see only that share. Give the group roles (colwise, rowwise), give a"
                " Linear that works token by token 'replicate', or pass sequence_parallel=False."
            )
        packed = isinstance(module, nn.MultiheadAttention)
        if sequence_parallel or packed:
            why = (" (nn.MultiheadAttention packs q, k and v into one parameter)" if packed else
                   ": under sequence parallelism each rank would train them on its share of the sequence alone")
            listed = ", ".join(f"{n} {list(shape)}" for n, shape in own)
            if any(len(shape) == 3 for _, shape in own):  # experts stacked in a way meshlight does not know
                fix = ("They look like stacked experts: meshlight splits those whose forward takes (hidden_states,"
                       " top_k_index, top_k_weights), as most of Hugging Face's MoE models' do, and those taking"
                       " every token in groups, forward(hidden_states) (Llama 4's), with a fused gate_up_proj and a"
                       " down_proj [experts, hidden, 2 × width] and [experts, width, hidden] (or [experts, 2 × width,"
                       " hidden] and [experts, hidden, width]); train this one with pipeline or data parallelism, or"
                       " parallelize it yourself in configure_model()")
            else:
                fix = ("Write attention with separate q, k, v nn.Linear layers (and an output projection), and keep"
                       " other parameters in a norm or a Linear" + ("" if packed else
                                                                    " (or pass sequence_parallel=False)"))
            raise TensorParallelError(
                f"{_shown(full)} ({type(module).__name__}) holds parameters the automatic tensor-parallel plan"
                f" cannot split: {listed}{why}. {fix}."
            )


def _reject_moe_arguments(blocks: list[tuple[str, nn.Module]]) -> None:
    """Under sequence parallelism a block's MoE layer (the module it calls that holds its MoE blocks) runs on this
    rank's share of the sequence, and its experts gather the shares' tokens over tp. One whose forward takes more
    than the hidden state — ERNIE 4.5-VL's token types, which route each token to the text or the image experts — would
    meet a whole sequence's values beside a share's tokens, and send the tp ranks unequal numbers of tokens: refused,
    naming it."""
    for block_name, block in blocks:
        for moe in sorted(moe_blocks_of(block) - {""}):  # (a block that is its own MoE block: its experts beside it)
            layer_name = moe.split(".")[0]
            layer = block.get_submodule(layer_name)
            extra = list(inspect.signature(layer.forward).parameters)[1:]
            if extra:
                raise TensorParallelError(
                    f"{_shown(_join(block_name, layer_name))} ({type(layer).__name__}) takes {', '.join(extra)} beside"
                    " its hidden state: under sequence parallelism it would run on this rank's share of the sequence"
                    " with values for the whole sequence, and its experts would gather unequal numbers of tokens from"
                    " the tp ranks. Pass sequence_parallel=False (tensor parallelism without it splits this model),"
                    " or train it with pipeline, expert or data parallelism."
                )


def _check_groups(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Each module holding a column→row group must hold it alone — tensor parallelism hands it its input
    gathered over the sequence, as a DTensor, and it computes 1/tp of the heads (parameters beside the group
    would see only those) — and an attention group must say how many heads it has."""
    modules = dict(model.named_modules())
    blocks = {id(b) for b in decoder_blocks(model)}
    hidden = hidden_size(decoder_blocks(model))
    owners = _colwise_parents(plan)
    block_held = block_held_groups(model, plan)
    for owner in owners:
        module = modules[owner]
        # the group: the owner's children with a role of their own (a string, or a ParallelStyle given)
        group = [n for n in modules if n.rpartition(".")[0] == owner and n in plan
                 and plan[n] not in ("norm", "head_norm", "colwise_norm", "replicate")]
        nested = [o for o in owners if o != owner and (not owner or o.startswith(owner + "."))]
        block_or_model = id(module) in blocks or not owner  # where norms live beside the sublayers
        others = _beside_group(module, owner, group, nested, plan, norms=block_or_model)
        if others and owner in block_held:
            continue  # an MLP on the block's own residual stream, beside its norms: nothing more to check
        if others:
            what = "a repeated block" if id(module) in blocks else "the whole model" if not owner else "a module"
            raise TensorParallelError(
                f"{_shown(owner) or _model_name(module)} ({what}) holds the tensor-parallel group"
                f" {', '.join(map(_shown, group))}, and also {', '.join(map(_shown, others[:4]))}. Tensor"
                " parallelism hands the module that holds a column→row group its input gathered over the sequence,"
                " as a DTensor, so that module must hold the group alone (a block may hold an MLP's Linears beside"
                " its norms, as OPT's does, but not beside other Linears): move"
                f" {', '.join(n.rpartition('.')[2] for n in group)} into a submodule of their own (e.g."
                " `self.mlp = MLP(dim)` whose forward is `fc2(act(fc1(x)))`)."
            )
        if getattr(getattr(module, "config", None), "alibi", False) is True and not head_biases(module):
            raise TensorParallelError(
                f"{_shown(owner)} ({type(module).__name__}) adds ALiBi position biases, which the model builds for all"
                " its heads before its blocks, and meshlight does not know the argument that brings them (it hands"
                f" each rank its heads' biases for {', '.join(c.rpartition('.')[2] for c in HEAD_BIASES)}): each"
                " rank would get the biases of heads it does not hold. Train it without tensor parallelism (pp,"
                " ZeRO), or with rotary positions (the config's alibi=False).")
        per_head = per_head_parameters(module, hidden) if hidden else []  # split with the heads
        stray = [f"{_shown(_join(owner, n, p))} {list(t.shape)}" for n, m in module.named_modules()
                 if (full := _join(owner, n)) not in group
                 and plan.get(full) not in ("head_norm", "colwise_norm", "interior")
                 and not _within(full, [*nested, *group])
                 for p, t in m.named_parameters(recurse=False) if n or p not in per_head]
        if stray:
            raise TensorParallelError(
                f"{_shown(owner) or _model_name(module)} holds the tensor-parallel group"
                f" {', '.join(map(_shown, group))} and also the parameters {', '.join(stray[:4])}, which tensor"
                " parallelism does not split: each rank computes 1/tp of the group's heads (or hidden units) and"
                " would train them on those alone (a norm over all heads at once, a learned scale; a norm as wide as"
                " one head and a vector of one value per head, as attention sinks, are split). Splitting them is not"
                " supported yet: parallelize the module yourself in configure_model(), or train without tensor"
                " parallelism (pp, ZeRO)."
            )
        readers = {n: width[1] for n in group if plan[n] in COLUMN_ROLES and (width := linear_widths(modules[n]))}
        qkv = [n for n in readers if len(fused_projection(modules, plan, n) or ()) == 3]  # a fused q|k|v
        fused = [n for n in readers if fused_projection(modules, plan, n)]
        latent = any(plan[n] == "latent" for n in group)  # (DeepSeek's q and k|v up-projections read latents)
        writer = next((n for n in group if n not in readers), None)
        # a reader wider than the writer reads packs several heads' q, k and v (GPT-NeoX's, Falcon's)
        packed = writer is not None and any(w > (linear_widths(modules[writer]) or (w,))[0] for w in readers.values())
        if writer and len(readers) < 3 and not (fused or latent or packed) and head_counts(module, own=True):
            raise TensorParallelError(
                f"{_shown(owner)} keeps a head count (attention), but its column→row group would be"
                f" {', '.join(n.rpartition('.')[2] for n in readers)} → {writer.rpartition('.')[2]}: its q, k, v and"
                " output projection are not in one module (BERT's attention holds its output projection in a"
                " sibling module, BertSelfOutput), and a value projection split as the output projection would"
                " train another model. Tensor parallelism splits attention as one column→row group in the module"
                " that holds it: hold q, k, v and the output projection in one module, or train without tensor"
                " parallelism (pp, ZeRO)."
            )
        attention = len(readers) >= 3 or len(set(readers.values())) > 1 or bool(qkv)
        if attention and not (head_counts(module) or head_dim_of(module)):
            counts = [f"{a}={v}" for a, v in vars(module).items()
                      if isinstance(v, int) and not isinstance(v, bool) and not a.startswith("_") and v > 1]
            seen = f" (it has {', '.join(counts)})" if counts else ""
            raise TensorParallelError(
                f"{_shown(owner)} looks like attention ({len(readers)} column-parallel projections) but keeps no head"
                f" count under a name meshlight divides by tp ({', '.join(HEAD_COUNT_ATTRIBUTES)}) and no head_dim"
                f"{seen}. Each rank holds 1/tp of q, k and v: reshaping them by the full head count would train"
                " heads 1/tp as wide, a different model, without an error. Name the count n_heads (and n_kv_heads),"
                " or store head_dim and reshape with view(batch, seq, -1, head_dim)."
            )


def _check_per_layer_inputs(blocks: list[tuple[str, nn.Module]]) -> None:
    """Blocks handed a per-layer input beside the hidden state (Gemma 3n's and Gemma 4's per-layer embeddings, which
    scale a narrow projection of the block's output, ``hidden_size_per_layer_input`` wide) are refused: the model
    computes that input for all of them at once, whole, outside the blocks."""
    for name, block in blocks:
        if width := getattr(block, "hidden_size_per_layer_input", 0):
            raise TensorParallelError(
                f"{name} ({type(block).__name__}) takes a per-layer input beside the hidden state (per-layer"
                f" embeddings, hidden_size_per_layer_input={width}), which the model computes for every layer at"
                " once: meshlight's automatic tensor-parallel plan does not split it. Train this model with tp=1"
                " (data parallelism or ZeRO shard it: strategy=\"ddp\" or \"zero3\")."
            )


def _named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks = {id(b) for b in decoder_blocks(model)}
    return [(name, module) for name, module in model.named_modules() if id(module) in blocks]


def _hidden_size(blocks: list[tuple[str, nn.Module]]) -> int:
    hidden = hidden_size(block for _, block in blocks)
    if hidden is None:
        name, block = blocks[0]
        weighted = [(f"{_shown(name)}.{n}", type(m).__name__) for n, m in block.named_modules()
                    if any(p.dim() == 2 for p in m.parameters(recurse=False))]
        held = (f": their weights sit in {', '.join(sorted({kind for _, kind in weighted}))}"
                f" ({', '.join(n for n, _ in weighted[:3])}{', …' if len(weighted) > 3 else ''})") if weighted else ""
        raise TensorParallelError(
            f"The repeated blocks ({_shown(name)} …) hold no linear layers (nn.Linear, or Hugging Face's Conv1D), which"
            f" tensor parallelism splits{held}."
            " Train this model with data or pipeline parallelism (tp=1), give those modules torch ParallelStyles in"
            " the tensor-parallel plan (the strategy's plan=), or parallelize it yourself in configure_model()."
        )
    return hidden


def _is_norm(module: nn.Module, hidden: int) -> bool:
    """A norm (:func:`~meshlight.parallel.precision.is_norm`) whose vectors have the hidden size."""
    return _norm_width(module) == hidden


def _norm_width(module: nn.Module) -> Optional[int]:
    """The length of a norm's vectors (:func:`~meshlight.parallel.precision.is_norm`), all of one length; ``None``
    for other modules."""
    widths = {p.shape[0] for p in module.parameters(recurse=False)}
    return widths.pop() if is_norm(module) and len(widths) == 1 else None


def block_held_groups(model: nn.Module, plan: Mapping[str, Any]) -> set[str]:
    """The repeated blocks that hold a column→row MLP group themselves, beside their norms and sublayers (OPT's,
    XGLM's, BioGPT's ``fc1`` → ``fc2``): its Linears read and write the hidden state (plain ``nn.Linear``), the block
    keeps no head count of its own, and what else it holds are norms and modules holding groups of their own
    (attention). Such a block's input is its residual stream, which stays this rank's share of the sequence under
    sequence parallelism: the group's first Linear gathers its input itself
    (:func:`~meshlight.parallel.tensor.apply_tensor_parallel`)."""
    modules = dict(model.named_modules())
    blocks = decoder_blocks(model)
    hidden = hidden_size(blocks)
    block_ids = {id(b) for b in blocks}
    owners = _colwise_parents(plan)
    held = set()
    for owner in owners:
        module = modules[owner]
        if id(module) not in block_ids or not hidden or head_counts(module, own=True):
            continue
        group = [n for n in modules if n.rpartition(".")[0] == owner and plan.get(n) in ("colwise", "rowwise")]
        if len(group) < 2 or any(not isinstance(modules[n], nn.Linear) or is_transposed_linear(modules[n])
                                 for n in group):
            continue
        readers = [n for n in group if plan[n] == "colwise"]
        writers = [n for n in group if plan[n] == "rowwise"]
        if (len(writers) != 1 or not 1 <= len(readers) <= 2 or modules[writers[0]].out_features != hidden
                or any(modules[n].in_features != hidden for n in readers)):
            continue
        nested = [o for o in owners if o != owner and o.startswith(owner + ".")]
        if not _beside_group(module, owner, group, nested, plan, norms=False):  # (norms beside it are fine)
            held.add(owner)
    return held


def _beside_group(module: nn.Module, owner: str, group: list[str], nested: list[str], plan: Mapping[str, Any],
                  norms: bool) -> list[str]:
    """What ``module`` (named ``owner``) holds beside its column→row ``group`` and the ``nested`` owners of groups
    of their own: Linears and Embeddings, and (``norms``) the modules the plan gives the role "norm"."""
    return [full for n, m in module.named_modules() if n and (full := _join(owner, n)) not in group
            and not _within(full, [*nested, *group])  # (a key selector's own Linears: it is one of the group)
            and (linear_widths(m) or isinstance(m, nn.Embedding) or (norms and plan.get(full) == "norm"))]


def _colwise_parents(plan: Mapping[str, Union[str, ParallelStyle]]) -> list[str]:
    return sorted({name.rpartition(".")[0] for name, role in plan.items() if role in COLUMN_ROLES})


def _matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` matches ``name`` as a whole or as a suffix at a component boundary; a component equal to
    the pattern's matches even where fnmatch would read it as a pattern (a ModuleDict key ``"h[0]"``)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) >= len(wanted) and all(p == w or fnmatch(p, w) for p, w in zip(parts[-len(wanted):], wanted))


def _matches_whole(name: str, pattern: str) -> bool:
    """Whether ``pattern`` matches all of ``name``, ``fnmatch`` per dotted component."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch(p, w) for p, w in zip(parts, wanted))


def _close_by_last_component(pattern: str, names: list[str]) -> list[str]:
    last = pattern.rsplit(".", 1)[-1]
    leaves = {name.rsplit(".", 1)[-1] for name in names}
    close = set(difflib.get_close_matches(last, leaves, n=3, cutoff=0.5))
    return [name for name in names if name.rsplit(".", 1)[-1] in close][:5]


def _shown(name: str) -> str:
    """A module name as the user's model has it: without the ``module.`` of meshlight's root wrapper (or the
    ``root.`` of a pipeline stage)."""
    return name.removeprefix("module.").removeprefix("root.")


def _model_name(model: nn.Module) -> str:
    """The class of the user's model: inside a wrapper whose one child is ``module``, that child's."""
    inner = getattr(model, "module", None)
    return type(inner if isinstance(inner, nn.Module) and len(list(model.children())) == 1 else model).__name__


def _within(name: str, modules: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``modules`` or inside one of them."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)
