"""Pipeline parallelism: split a model into stages and run ``torch.distributed.pipelining`` schedules.

The model contract (README, "Pipeline parallelism"): the *pipelined module* owns its blocks in a
``ModuleList``/``ModuleDict`` and its ``forward`` is a chain — the pieces with parameters registered before
the blocks (embeddings) run first, then the blocks in order, then the pieces registered after (norm, head),
each piece's output being the next one's first input. A stage is that same module with the pieces it does
not own replaced by :class:`PassThrough`; :func:`check_chain` verifies the contract on real inputs without
any communication, so a model that breaks it fails identically on every rank instead of hanging in a send.

Stage balancing: by parameter count (default), by block count, or at explicit split points. Virtual
stages: "loop" placement puts stage ``s`` on rank ``s % pp``; "v" placement (ZBVZeroBubble, DualPipeV)
puts stages ``r`` and ``2·pp − 1 − r`` on rank ``r``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from meshlight.parallel.blocks import holds_blocks
from meshlight.parallel.rank_zero import rank_zero_warn

__all__ = [
    "SCHEDULES",
    "PassThrough",
    "PipelineError",
    "StagePlan",
    "build_schedule",
    "default_virtual_stages",
    "check_chain",
    "find_pipelined_module",
    "materialize",
    "plan_stages",
    "split_stages",
    "rank_holding",
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
SplitSpec = Union[None, str, Sequence[str]]


def default_virtual_stages(schedule: str) -> int:
    """Stages per rank a schedule runs unless told otherwise: 1 for GPipe and 1F1B, 2 for the rest."""
    return 1 if schedule in SINGLE_STAGE else 2


class PipelineError(ValueError):
    """A model, split or schedule the pipeline cannot run as asked; the message names the fix."""


class PassThrough(nn.Module):
    """Stands in for a piece another stage owns: returns its first argument."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0]


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


def find_pipelined_module(root: nn.Module) -> tuple[str, nn.Module, str]:
    """``(name, module, container)``: the module that owns the outermost container of blocks in ``root``
    (:func:`~meshlight.parallel.data_parallel.holds_blocks`; e.g. ``model`` holding ``blocks``), and that
    container's attribute name."""
    for name, module in root.named_modules():
        for child_name, child in module.named_children():
            if holds_blocks(child):
                return name, module, child_name
    raise PipelineError(
        f"{type(root).__name__} has no blocks in an nn.ModuleList or nn.ModuleDict, which pipeline parallelism"
        " splits into stages. Keep the transformer layers in one (see README, 'Pipeline parallelism')."
    )


def plan_stages(module: nn.Module, container: str, num_stages: int, split: SplitSpec = None) -> StagePlan:
    """Assign blocks to ``num_stages`` contiguous stages.

    ``split``: ``None`` or ``"parameters"`` balances parameter counts (the pieces before the blocks count
    toward stage 0, those after toward the last stage); ``"layers"`` balances block counts; a list of block
    names (``["blocks.4"]`` or full names ending so) starts a new stage at each.
    """
    blocks = getattr(module, container)
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks))]
    children = list(module.named_children())
    position = [name for name, _ in children].index(container)
    with_params = [name for name, child in children if name != container and _numel(child) > 0]
    pre = tuple(n for n in with_params if [c for c, _ in children].index(n) < position)
    post = tuple(n for n in with_params if [c for c, _ in children].index(n) > position)
    if num_stages > len(keys):
        raise PipelineError(
            f"{num_stages} pipeline stages but only {len(keys)} blocks in {container!r}: every stage needs at least"
            f" one block; use pp·virtual_stages <= {len(keys)}."
        )
    if split is None or split == "parameters":
        sizes = [_numel(blocks[k] if isinstance(blocks, nn.ModuleDict) else blocks[int(k)]) for k in keys]
        extra = (sum(_numel(getattr(module, n)) for n in pre), sum(_numel(getattr(module, n)) for n in post))
        bounds = _balanced_bounds(sizes, num_stages, extra)
    elif split == "layers":
        base, remainder = divmod(len(keys), num_stages)
        counts = [base + (1 if s >= num_stages - remainder else 0) for s in range(num_stages)]
        bounds = [sum(counts[:s]) for s in range(num_stages + 1)]
    elif isinstance(split, str):
        raise PipelineError(f"split={split!r}: use 'parameters', 'layers' or a list of block names.")
    else:
        starts = [_block_index(point, container, keys) for point in split]
        if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or 0 in starts:
            raise PipelineError(
                f"split={list(split)} must name {num_stages - 1} distinct blocks in increasing order, after the"
                f" first, where stages 2..{num_stages} begin (the pipeline has {num_stages} stages)."
            )
        bounds = [0, *starts, len(keys)]
    return StagePlan(container, pre, post, tuple(tuple(keys[bounds[s]:bounds[s + 1]]) for s in range(num_stages)))


def rank_holding(stage: int, pp: int, schedule: str) -> int:
    """The rank of ``pp`` that holds stage ``stage``: stages loop over the ranks, or (V placement) go down and back."""
    if schedule in V_PLACEMENT:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stages_of_rank(rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stage indices rank ``rank`` of ``pp`` holds, in order (:func:`rank_holding`'s inverse)."""
    stages = 2 * pp if schedule in V_PLACEMENT else pp * virtual_stages
    return [stage for stage in range(stages) if rank_holding(stage, pp, schedule) == rank]


def split_stages(module: nn.Module, plan: StagePlan, stages: Sequence[int]) -> list[nn.Module]:
    """Keep in ``module`` only the pieces of ``stages`` (others become :class:`PassThrough`, freeing them) and
    return one stage module per stage: a shallow copy of ``module`` sharing the pieces it owns."""
    mine = set().union(*(plan.owned(s) for s in stages))
    blocks = getattr(module, plan.container)
    for name in (*plan.pre, *plan.post):
        if name not in mine:
            setattr(module, name, PassThrough())
    for key in (k for stage_keys in plan.blocks for k in stage_keys):
        if f"{plan.container}.{key}" not in mine:
            blocks[key if isinstance(blocks, nn.ModuleDict) else int(key)] = PassThrough()
    return [_stage_view(module, plan, stage) for stage in stages]


def _stage_view(module: nn.Module, plan: StagePlan, stage: int) -> nn.Module:
    view = copy.copy(module)
    view._modules = dict(module._modules)
    # Hooks registered on a view (FSDP's root, sequence-share inputs) are its own: a shallow copy would share
    # the hook dicts with the whole module — run by the step's call to it — and with the rank's other stages.
    for name, value in vars(module).items():
        if "hooks" in name and isinstance(value, dict):
            setattr(view, name, copy.copy(value))
    owned = plan.owned(stage)
    for name in (*plan.pre, *plan.post):
        if name not in owned:
            view._modules[name] = PassThrough()
    blocks = module._modules[plan.container]
    entries = blocks.items() if isinstance(blocks, nn.ModuleDict) else ((str(i), b) for i, b in enumerate(blocks))
    kept = [(k, b if f"{plan.container}.{k}" in owned else PassThrough()) for k, b in entries]
    view._modules[plan.container] = nn.ModuleDict(kept) if isinstance(blocks, nn.ModuleDict) else nn.ModuleList(
        b for _, b in kept)
    return view


def shared_parameters(module: nn.Module, plan: StagePlan) -> list[tuple[str, str]]:
    """Pairs of pieces owned by different stages that share a parameter (tied embedding and head)."""
    owner: dict[int, tuple[str, int]] = {}
    pairs = []
    for stage in range(plan.num_stages):
        for piece in sorted(plan.owned(stage)):
            for param in module.get_submodule(piece).parameters():
                first = owner.setdefault(id(param), (piece, stage))
                if first[1] != stage:
                    pairs.append((first[0], piece))
    return pairs


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta-device tensors on ``device`` and initialize them: with the module's own
    ``init_weights()`` when it has one (meshlight's GPT: the same values as an unsplit model), else every
    submodule's ``reset_parameters()``. Non-persistent buffers must be recomputed there too."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return
    module.to_empty(device=device)
    init_weights = getattr(module, "init_weights", None)
    if callable(init_weights):
        init_weights()
        return
    rank_zero_warn(
        f"{type(module).__name__} was built on the meta device (configure_model under pipelining) and has no"
        " init_weights(): each stage's modules are initialized with their own reset_parameters(), so the weights"
        " differ from those one process draws, and initialization done in configure_model is not applied. Give"
        f" {type(module).__name__} an init_weights() method that initializes its parameters (from a seed per"
        " parameter, as meshlight's GPT does, for the same weights under any layout)."
    )
    for submodule in module.modules():
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset):
            reset()


def check_chain(module: nn.Module, plan: StagePlan, args: tuple, kwargs: dict) -> None:
    """Run ``module.forward`` on its real inputs with every piece replaced by a probe that returns its
    input unchanged: in a chain every piece receives the previous piece's output (here: the very same
    object) and the forward returns it. No piece computes and nothing is communicated."""
    pieces = [*plan.pre, *(f"{plan.container}.{k}" for keys in plan.blocks for k in keys), *plan.post]
    received: list[tuple[str, Any]] = []
    probes = {name: _Probe(name, received) for name in pieces}
    view = copy.copy(module)
    view._modules = dict(module._modules)
    blocks = module._modules[plan.container]
    for name in (*plan.pre, *plan.post):
        view._modules[name] = probes[name]
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks))]
    probed = [probes[f"{plan.container}.{k}"] for k in keys]
    view._modules[plan.container] = (nn.ModuleDict(zip(keys, probed)) if isinstance(blocks, nn.ModuleDict)
                                     else nn.ModuleList(probed))
    try:
        with torch.no_grad():
            output = type(module).forward(view, *args, **kwargs)
    except Exception as error:  # an operation on what a piece returned: the input, passed through unchanged
        done = [name for name, _ in received]
        raise PipelineError(
            f"{type(module).__name__}.forward is not a chain of its pieces {pieces}: run with every piece passing its"
            f" input through, it failed after {done[-1] if done else 'no piece'!r} with {type(error).__name__}:"
            f" {error}. An operation between pieces or after the last (pooling, a reshape, a second input) is not a"
            " piece of its own: move it into one (see README, 'Pipeline parallelism')."
        ) from error
    first = args[0] if args else next(iter(kwargs.values()), None)
    order = [name for name, _ in received]
    if order != pieces:
        raise PipelineError(
            f"{type(module).__name__}.forward is not a chain of its pieces: it calls {order} but pipelining needs"
            f" {pieces}, each once and in order (see README, 'Pipeline parallelism')."
        )
    expected = first
    for name, value in received:
        if value is not expected:
            raise PipelineError(
                f"{type(module).__name__}.forward is not a chain: {name} does not receive the previous piece's"
                " output as its first argument (an operation between pieces, or an input reused later). Move such"
                " operations into the pieces (see README, 'Pipeline parallelism')."
            )
    if output is not expected:
        raise PipelineError(
            f"{type(module).__name__}.forward does not return the output of its last piece {pieces[-1]!r}; move"
            " what it does after it into a module of its own."
        )


class _Probe(nn.Module):
    def __init__(self, name: str, received: list) -> None:
        super().__init__()
        self.name, self.received = name, received

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.received.append((self.name, args[0] if args else None))
        return args[0] if args else None


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


def _balanced_bounds(sizes: list[int], parts: int, extra: tuple[int, int]) -> list[int]:
    """Contiguous partition of ``sizes`` into ``parts`` (each non-empty) minimizing the largest part, where
    the first part also carries ``extra[0]`` and the last ``extra[1]``. Returns the ``parts + 1`` bounds."""
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
    for i in range(1, n + 1):
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
