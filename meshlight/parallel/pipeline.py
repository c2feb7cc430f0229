"""Pipeline parallelism: how a model is split into stages, where each stage runs, and the
``torch.distributed.pipelining`` schedules.

The model contract (docs/guides/pipeline.md): the *pipelined module* owns its blocks in a
``ModuleList``/``ModuleDict``, each block's output the next one's first input. The pieces with parameters
registered before the blocks (embeddings) belong to the first stage, those after (norm, head) to the last. The
*model root* — the module the step calls, holding every parameter — may sit above it with *heads* beside it
(Hugging Face's ``LlamaForCausalLM``: ``model`` and ``lm_head``), which belong to the last stage too. The stage
modules themselves: :mod:`meshlight.parallel.pipeline_stages`.

Stage balancing: by parameter count (default), by block count, or at explicit split points. Virtual
stages: "loop" placement puts stage ``s`` on rank ``s % pp``; "v" placement (ZBVZeroBubble, DualPipeV)
puts stages ``r`` and ``2·pp − 1 − r`` on rank ``r``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from meshlight.parallel.adapters import read_without_adapters
from meshlight.parallel.blocks import holds_blocks
from meshlight.parallel.model_shape import blocks_fed_between, decoder_container, encoder_blocks, lm_heads

__all__ = [
    "SCHEDULES",
    "ModelRoot",
    "PipelineError",
    "StagePlan",
    "beside_parameters",
    "build_schedule",
    "check_split",
    "default_virtual_stages",
    "find_pipelined_module",
    "model_root",
    "module_stage_plan",
    "named_stages",
    "plan_stages",
    "rank_holding",
    "stage_blocks_of",
    "stages_of_rank",
]

# Our names → torch's schedule names; and how many stages each puts on a rank.
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved1f1b": "Interleaved1F1B",
    "loopedbfs": "LoopedBFS",
    "interleavedzerobubble": "InterleavedZeroBubble",
    "zbvzerobubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")
V_PLACEMENT = ("zbvzerobubble", "dualpipev")
#: schedules that defer weight gradients: with data parallelism they need a microbatch per stage (PyTorch 2.13 reduces
#: the gradients before the last deferred passes otherwise)
ZERO_BUBBLE = ("interleavedzerobubble", "zbvzerobubble")
SplitSpec = Union[None, str, Sequence[str]]


def default_virtual_stages(schedule: str) -> int:
    """Stages per rank a schedule runs unless told otherwise: 1 for GPipe and 1F1B, 2 for the rest."""
    return 1 if schedule in SINGLE_STAGE else 2


class PipelineError(ValueError):
    """A model, split or schedule the pipeline cannot run as asked; the message names the fix."""


@dataclass(frozen=True)
class StagePlan:
    """Which pieces of the pipelined module each stage owns, by child name (blocks as ``blocks.3``)."""

    container: str  # name of the blocks ModuleList/ModuleDict inside the pipelined module
    pre: tuple[str, ...]  # children with parameters before the blocks: stage 0
    post: tuple[str, ...]  # children with parameters after the blocks: the last stage
    blocks: tuple[tuple[str, ...], ...]  # per stage, the block keys it owns

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def owned(self, stage: int) -> set[str]:
        """Child names (``embed``, ``blocks.3``, ``head``) stage ``stage`` owns."""
        names = {f"{self.container}.{key}" for key in self.blocks[stage]}
        if stage == 0:
            names |= set(self.pre)
        if stage == self.num_stages - 1:
            names |= set(self.post)
        return names


def validate_schedule(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> None:
    """Reject an unknown schedule or an impossible stage/microbatch count, naming the valid choices."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"Unknown pipeline schedule {schedule!r}; choose one of {list(SCHEDULES)}.")
    if schedule in SINGLE_STAGE and virtual_stages != 1:
        raise PipelineError(f"{schedule!r} runs one stage per rank: set virtual_stages=1, or use 'interleaved1f1b'.")
    if schedule in V_PLACEMENT and virtual_stages != 2:
        raise PipelineError(f"{schedule!r} places exactly 2 stages per rank (a V): set virtual_stages=2.")
    if schedule in ("interleaved1f1b", "loopedbfs") and virtual_stages < 2:
        raise PipelineError(f"{schedule!r} interleaves several stages per rank: set virtual_stages >= 2.")
    if microbatches < 1:
        raise PipelineError(f"microbatches={microbatches} must be >= 1.")


def named_stages(split: SplitSpec) -> Optional[int]:
    """The pipeline stages in all (pp × virtual stages) that ``split`` fixes: one more than the blocks a list names
    (each starts a stage); None for the balanced splits, which suit any count. Refuses any other string."""
    if split is None or split in ("parameters", "layers"):
        return None
    if isinstance(split, str):
        raise PipelineError(f"split={split!r}: use 'parameters', 'layers' or a list of block names.")
    return len(split) + 1


def check_split(split: SplitSpec, pp: Optional[int], virtual_stages: Optional[int]) -> None:
    """Refuse a ``split`` naming blocks where stages begin whose count the pipeline given (``pp`` ranks of
    ``virtual_stages`` stages; None: not given) cannot have, naming the sizes that would."""
    stages = named_stages(split)
    if stages is None or pp is None:
        return
    named = f"split={list(split)} starts {stages} stages"  # type: ignore[arg-type]
    if pp == 1:
        raise PipelineError(f"{named}, but pp=1 runs no pipeline: give a pp above 1 that divides {stages}, or leave"
                            " split out.")
    if virtual_stages is None and stages % pp:
        raise PipelineError(f"{named}, which pp={pp} ranks cannot share evenly: give a pp that divides {stages}, or"
                            f" name {pp - 1} blocks (or a multiple of pp, less one) in split.")
    if virtual_stages is not None and pp * virtual_stages != stages:
        raise PipelineError(f"{named}, but pp={pp} × virtual_stages={virtual_stages} runs {pp * virtual_stages}: name"
                            f" {pp * virtual_stages - 1} blocks in split, or give pp and virtual_stages whose product"
                            f" is {stages}.")


@read_without_adapters
def find_pipelined_module(root: nn.Module) -> tuple[str, nn.Module, str]:
    """``(name, module, container)``: the module that owns the outermost container of blocks in ``root``
    (:func:`~meshlight.parallel.data_parallel.holds_blocks`; e.g. ``model`` holding ``blocks``), and that
    container's attribute name; in a model with blocks beside its decoder's (a multimodal model's encoder:
    :func:`~meshlight.parallel.model_shape.encoder_blocks`), the decoder's container."""
    decoder = decoder_container(root)
    if decoder is not None:
        holder, _, container = decoder.rpartition(".")
        return holder, root.get_submodule(holder), container
    for name, module in root.named_modules():
        for child_name, child in module.named_children():
            if holds_blocks(child):
                return name, module, child_name
    raise PipelineError(
        f"{type(root).__name__} has no blocks in an nn.ModuleList or nn.ModuleDict, which pipeline parallelism"
        " splits into stages. Keep the transformer layers in one (see docs/guides/pipeline.md)."
    )


@dataclass(frozen=True)
class ModelRoot:
    """Where the pipelined module sits in the model a step calls. ``name``: the root in the LightningModule, the
    innermost module above (or at) the pipelined module that holds every parameter; ``pipelined``: the pipelined
    module's name inside the root (``""``: the root is the pipelined module); ``container``: its blocks; ``heads``:
    the root's modules with parameters beside the pipelined module (an LM head), which the last stage owns;
    ``encoders``: in a model with encoders beside its decoder (a multimodal model's), the modules beside the
    pipelined module but the LM head's (a vision tower, its projector), and the parameters held by the modules above
    it (LLaVA-NeXT's ``image_newline``), which the first stage owns."""

    name: str
    pipelined: str
    container: str
    heads: tuple[str, ...]
    encoders: tuple[str, ...] = ()


@read_without_adapters
def model_root(module: nn.Module) -> ModelRoot:
    """The :class:`ModelRoot` of ``module`` (a LightningModule): Hugging Face's ``LlamaForCausalLM`` over the
    ``LlamaModel`` holding the layers, beside ``lm_head``; meshlight's GPT is its own root."""
    name, _, container = find_pipelined_module(module)
    # by name, shared ones under each: a head tied to the embedding still lives beside it
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    parts = name.split(".") if name else []
    depth = next(d for d in range(len(parts), -1, -1)
                 if all(n.startswith("".join(f"{p}." for p in parts[:d])) for n in names))
    ancestor, heads, encoders = module.get_submodule(".".join(parts[:depth])), [], []
    # a multimodal model's modules beside the decoder are its encoders (and projectors), but the one holding its LM
    # head (a Linear from the decoder's token embedding's width to its vocabulary, outside the encoders)
    multimodal = bool(encoder_blocks(module))
    lm_head = {id(m) for m in lm_heads(module)}
    for index, step in enumerate([*parts[depth:], None]):
        own = [n for n, _ in ancestor.named_parameters(recurse=False)]
        prefix = "".join(f"{p}." for p in parts[depth:depth + index])
        if own and multimodal and step is not None:  # beside the decoder, as its encoders are (LLaVA-NeXT's
            encoders += [prefix + name for name in own]  # image_newline, which ends each row of an image's features)
        elif own:
            raise PipelineError(f"{type(ancestor).__name__} holds parameters of its own ({own}); put them in a child"
                                " module so that one stage owns them.")
        if step is None:
            break
        for child, module_ in ancestor.named_children():
            if child != step and _numel(module_):
                head = not multimodal or any(id(m) in lm_head for m in module_.modules())
                (heads if head else encoders).append(prefix + child)
        ancestor = getattr(ancestor, step)
    return ModelRoot(".".join(parts[:depth]), ".".join(parts[depth:]), container, tuple(heads), tuple(encoders))


def beside_parameters(root: nn.Module, place: ModelRoot) -> tuple[int, int]:
    """Parameters the first and the last stage hold beside the pipelined module: the encoders and the heads of
    ``place`` in ``root`` (its model root: Hugging Face's ``lm_head``, a multimodal model's vision tower)."""
    def count(name: str) -> int:
        owner, _, leaf = name.rpartition(".")
        found = getattr(root.get_submodule(owner), leaf)
        return found.numel() if isinstance(found, torch.Tensor) else _numel(found)

    return sum(map(count, place.encoders)), sum(map(count, place.heads))


def plan_stages(module: nn.Module, container: str, num_stages: int, split: SplitSpec = None,
                run_after: Sequence[str] = (), first_blocks: int = 1, beside: tuple[int, int] = (0, 0)) -> StagePlan:
    """Assign blocks to ``num_stages`` contiguous stages.

    ``split``: ``None`` or ``"parameters"`` balances parameter counts (the pieces before the blocks count
    toward stage 0, those after toward the last stage, as do the ``beside`` parameters outside ``module`` that the
    first and the last stage hold: :func:`beside_parameters`); ``"layers"`` balances block counts; a list of block
    names (``["blocks.4"]`` or full names ending so) starts a new stage at each. Pieces are before or after the
    blocks as registered, except those named in ``run_after``: registered before them, run after them (OPT's
    final norm), in the order they run. ``first_blocks``: the fewest blocks stage 0 holds — those after which a
    decoder adds what its encoder computed, and the next, as only the first stage runs the encoder and a stage ends at
    its last block's output (:func:`~meshlight.parallel.model_shape.blocks_fed_between`: Qwen3-VL's deepstack); the
    balanced splits give it that many, a list of block names that does not is refused, naming where stage 2 may
    start.
    """
    blocks = getattr(module, container)
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks))]
    children = list(module.named_children())
    position = [name for name, _ in children].index(container)
    with_params = [name for name, child in children if name != container and _numel(child) > 0]
    pre = tuple(n for n in with_params if [c for c, _ in children].index(n) < position and n not in run_after)
    post = (*run_after, *(n for n in with_params if [c for c, _ in children].index(n) > position))
    if num_stages > len(keys):
        raise PipelineError(
            f"{num_stages} pipeline stages but only {len(keys)} blocks in {container!r}: every stage needs at least"
            f" one block; use pp·virtual_stages <= {len(keys)}."
        )
    if num_stages - 1 > len(keys) - first_blocks:
        raise PipelineError(
            f"{num_stages} pipeline stages over {len(keys)} blocks in {container!r}, of which the first stage holds"
            f" {first_blocks} (the decoder adds its encoder's features after its first {first_blocks - 1}, which"
            f" only the first stage has): use pp·virtual_stages <= {len(keys) - first_blocks + 1}."
        )
    if split is None or split == "parameters":
        sizes = [_numel(blocks[k] if isinstance(blocks, nn.ModuleDict) else blocks[int(k)]) for k in keys]
        extra = (sum(_numel(getattr(module, n)) for n in pre) + beside[0],
                 sum(_numel(getattr(module, n)) for n in post) + beside[1])
        bounds = _balanced_bounds(sizes, num_stages, extra, first_blocks)
    elif split == "layers":
        base, remainder = divmod(len(keys), num_stages)
        counts = [base + (1 if s >= num_stages - remainder else 0) for s in range(num_stages)]
        if counts[0] < first_blocks:  # the rest over the later stages, as evenly
            base, remainder = divmod(len(keys) - first_blocks, num_stages - 1)
            counts = [first_blocks] + [base + (1 if s >= num_stages - 1 - remainder else 0)
                                       for s in range(num_stages - 1)]
        bounds = [sum(counts[:s]) for s in range(num_stages + 1)]
    else:
        named_stages(split)  # refuses any other string
        starts = [_block_index(point, container, keys) for point in split]
        if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or 0 in starts:
            raise PipelineError(
                f"split={list(split)} must name {num_stages - 1} distinct blocks in increasing order, after the"
                f" first, where stages 2..{num_stages} begin (the pipeline has {num_stages} stages)."
            )
        if starts and starts[0] < first_blocks:
            raise PipelineError(
                f"split={list(split)} starts stage 2 at {container}.{keys[starts[0]]}, but the first stage must hold"
                f" {first_blocks} blocks (the decoder adds its encoder's features after its first {first_blocks - 1},"
                f" which only the first stage has): start stage 2 at {container}.{keys[first_blocks]} or later."
            )
        bounds = [0, *starts, len(keys)]
    return StagePlan(container, pre, post, tuple(tuple(keys[bounds[s]:bounds[s + 1]]) for s in range(num_stages)))


def module_stage_plan(module: nn.Module, num_stages: int, split: SplitSpec = None,
                      run_after: Sequence[str] = ()) -> tuple[ModelRoot, nn.Module, StagePlan]:
    """Where ``module``'s blocks are (:func:`model_root`), the model holding them, and how ``num_stages`` stages split
    them under ``split`` (:func:`plan_stages`): a decoder adding its encoder's features after its first blocks keeps
    them, and the next, on the first stage; what the first and the last stage hold beside the pipelined module
    counts towards their parameters."""
    place = model_root(module)
    root = module.get_submodule(place.name)
    pipelined = root.get_submodule(place.pipelined)
    first_blocks, beside = blocks_fed_between(root) + 1, beside_parameters(root, place)
    return place, root, plan_stages(pipelined, place.container, num_stages, split, run_after, first_blocks, beside)


def stage_blocks_of(module: nn.Module, split: SplitSpec = None) -> Callable[[int], Optional[tuple[int, ...]]]:
    """The blocks of each stage as ``split`` cuts ``module`` into a count of stages (what the planner prices each
    pipeline rank by), or None where it has too few blocks for that many; each count computed once."""

    @functools.cache
    def blocks(stages: int) -> Optional[tuple[int, ...]]:
        try:
            return tuple(len(b) for b in module_stage_plan(module, stages, split)[2].blocks)
        except PipelineError:
            return None

    return blocks


def rank_holding(stage: int, pp: int, schedule: str) -> int:
    """The rank of ``pp`` that holds stage ``stage``: stages loop over the ranks, or (V placement) go down and back."""
    if schedule in V_PLACEMENT:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@functools.cache  # the planner asks for each rank's of every layout it prices
def stages_of_rank(rank: int, pp: int, virtual_stages: int, schedule: str) -> tuple[int, ...]:
    """The stage indices rank ``rank`` of ``pp`` holds, in order (:func:`rank_holding`'s inverse)."""
    stages = 2 * pp if schedule in V_PLACEMENT else pp * virtual_stages
    return tuple(stage for stage in range(stages) if rank_holding(stage, pp, schedule) == rank)


def build_schedule(
    stages: Sequence[PipelineStage],
    schedule: str,
    microbatches: int,
    loss_fn: Optional[Callable[..., torch.Tensor]],
) -> Any:
    """A ``torch.distributed.pipelining`` schedule by our name. Torch validates the microbatch count here;
    its error is re-raised with the schedule's requirement and the fix."""
    cls = get_schedule_class(SCHEDULES[schedule])
    try:
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
        return cls(list(stages), n_microbatches=microbatches, loss_fn=loss_fn)
    except ValueError as error:
        raise PipelineError(
            f"Schedule {schedule!r} cannot run {microbatches} microbatches over {stages[0].num_stages} stages"
            f" ({error}). Use more microbatches (at least the number of stages, and a multiple of the pipeline"
            " size for interleaved schedules)."
        ) from error


def _balanced_bounds(sizes: list[int], parts: int, extra: tuple[int, int], first: int = 1) -> list[int]:
    """Contiguous partition of ``sizes`` into ``parts`` (each non-empty, the first of ``first`` sizes at least)
    minimizing the largest part, where the first part also carries ``extra[0]`` and the last ``extra[1]``. Returns
    the ``parts + 1`` bounds."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def load(start: int, end: int, part: int) -> int:
        return prefix[end] - prefix[start] + (extra[0] if part == 0 else 0) + (extra[1] if part == parts - 1 else 0)

    infinity = float("inf")
    # best[p][i]: the smallest possible largest load of parts 0..p covering sizes[:i]
    best = [[infinity] * (n + 1) for _ in range(parts)]
    cut = [[0] * (n + 1) for _ in range(parts)]
    for i in range(first, n + 1):
        best[0][i] = load(0, i, 0)
    for p in range(1, parts):
        for i in range(p + 1, n + 1):
            for j in range(p, i):
                candidate = max(best[p - 1][j], load(j, i, p))
                if candidate < best[p][i]:
                    best[p][i], cut[p][i] = candidate, j
    bounds = [n]
    for p in range(parts - 1, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    return [0, *reversed(bounds)]


def _block_index(point: str, container: str, keys: list[str]) -> int:
    for index, key in enumerate(keys):
        if point == f"{container}.{key}" or point.endswith(f".{container}.{key}") or point == key:
            return index
    raise PipelineError(f"Split point {point!r} names no block; blocks are {container}.{keys[0]} … "
                        f"{container}.{keys[-1]}.")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
