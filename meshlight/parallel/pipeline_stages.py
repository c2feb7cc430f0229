"""The stage modules cut from a model for pipeline parallelism: views of the model root in which the pieces of other
stages stand in (:class:`Stage`), the chain check run on the first batch, weights tied across stages, and
materialization of stages built on the meta device. How a model is split and scheduled:
:mod:`meshlight.parallel.pipeline`."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from meshlight.parallel.adapters import as_planned
from meshlight.parallel.pipeline import ModelRoot, PipelineError, StagePlan
from meshlight.parallel.rank_zero import rank_zero_warn
from meshlight.parallel.router_logits import CarriedRouterLogits, router_logits_collected

__all__ = [
    "ENCODER_INPUTS",
    "TOKEN_IDS",
    "BlockOutput",
    "PassThrough",
    "Stage",
    "TiedParameter",
    "check_chain",
    "first_positional",
    "materialize",
    "root_stages",
    "run_after_blocks",
    "split_stages",
    "tied_parameters",
    "without_encoder_inputs",
]


class BlockOutput:
    """What a model's blocks return, shared by the stand-ins of its blocks and its stages: the hidden state, or
    (``tuples``) a tuple whose first element is the hidden state, which the forward takes out with ``outputs[0]``
    before the next block (BLOOM's, Falcon's, MPT's; what :func:`check_chain` finds on the first batch)."""

    def __init__(self) -> None:
        self.tuples = False

    def wrap(self, hidden: Any) -> Any:
        """``hidden`` as a block returns it."""
        return (hidden, None) if self.tuples else hidden

    def hidden(self, output: Any) -> Any:
        """The hidden state in what a block returned."""
        return output[0] if self.tuples else output


class PassThrough(nn.Module):
    """Stands in for a piece another stage owns: returns its first argument (for a block, as the block returns its
    output: ``block_output``)."""

    def __init__(self, block_output: Optional[BlockOutput] = None) -> None:
        super().__init__()
        self.block_output = block_output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block_output.wrap(args[0]) if self.block_output else args[0]


#: Keyword arguments of a multimodal model's forward that only its encoders read (Hugging Face's names): a later
#: pipeline stage's forward is given None for them, so that the model skips its encoders, which the first stage runs.
ENCODER_INPUTS = ("pixel_values", "pixel_values_videos")
#: The keyword under which the token ids a model is given reach the stages after the first (the schedule hands those
#: the hidden state in their place): a Hugging Face model's forward runs on them there as on the first stage, and
#: reads them beside the embedding (a multimodal model's image places and positions, DeepSeek-V4's hash routing).
TOKEN_IDS = "_meshlight_token_ids"


class _EncoderStandIn(nn.Module):
    """Stands in, on a stage after the first, for an encoder the first stage runs: such a stage's forward is given
    none of :data:`ENCODER_INPUTS`, so the model skips its encoders; one called all the same is refused."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"A later pipeline stage ran {self.name}, an encoder the first stage owns: meshlight gives later stages"
            f" None for the forward's {list(ENCODER_INPUTS)}, so that the model skips its encoders, but this model"
            " passed its encoder another input. Train it with pp=1."
        )


def bearing_attributes(stand_in: nn.Module, block: nn.Module) -> nn.Module:
    """``stand_in`` carrying ``block``'s own plain attributes (not its modules, parameters or buffers), which a
    model's forward may read from each block between calls: Nemotron-H picks each block's mask by its
    ``block_type``, Dory by its ``attention_type``."""
    for name, value in vars(block).items():
        if not name.startswith("_") and not isinstance(value, (nn.Module, torch.Tensor)) and not hasattr(
                stand_in, name):
            setattr(stand_in, name, value)
    return stand_in


def split_stages(module: nn.Module, plan: StagePlan, stages: Sequence[int],
                 block_output: Optional[BlockOutput] = None) -> list[nn.Module]:
    """Keep in ``module`` only the pieces of ``stages`` (others become :class:`PassThrough`, freeing them) and
    return one stage module per stage: a shallow copy of ``module`` sharing the pieces it owns. ``block_output``:
    what the blocks return, which the stand-ins of blocks return alike."""
    block_output = block_output or BlockOutput()
    views = [_stage_view(module, plan, stage, block_output) for stage in stages]
    mine = set().union(*(plan.owned(s) for s in stages))
    blocks = getattr(module, plan.container)
    for name in (*plan.pre, *plan.post):
        if name not in mine:
            setattr(module, name, _stand_in(getattr(module, name)) if name in plan.pre else PassThrough())
    for key in (k for stage_keys in plan.blocks for k in stage_keys):
        if f"{plan.container}.{key}" not in mine:
            index = key if isinstance(blocks, nn.ModuleDict) else int(key)
            blocks[index] = bearing_attributes(PassThrough(block_output), blocks[index])
    return views


def _stage_view(module: nn.Module, plan: StagePlan, stage: int, block_output: BlockOutput) -> nn.Module:
    owned = plan.owned(stage)
    blocks = module._modules[plan.container]
    entries = blocks.items() if isinstance(blocks, nn.ModuleDict) else ((str(i), b) for i, b in enumerate(blocks))
    kept = [(k, b if f"{plan.container}.{k}" in owned else bearing_attributes(PassThrough(block_output), b))
            for k, b in entries]
    replacements: dict[str, nn.Module] = {name: _stand_in(module.get_submodule(name)) for name in plan.pre
                                          if name not in owned}
    replacements.update({name: PassThrough() for name in plan.post if name not in owned})
    replacements[plan.container] = nn.ModuleDict(kept) if isinstance(blocks, nn.ModuleDict) else nn.ModuleList(
        b for _, b in kept)
    return _replaced(module, replacements)


def _is_parameter(root: nn.Module, name: str) -> bool:
    """Whether ``name`` (dotted, relative to ``root``) is a parameter rather than a module."""
    holder, _, attribute = name.rpartition(".")
    return attribute in root.get_submodule(holder)._parameters


def _replaced(module: nn.Module, replacements: dict[str, Optional[nn.Module]]) -> nn.Module:
    """A view of ``module`` with the submodules named (dotted, relative to it) replaced: ``module`` and each module
    on the way down are shallow-copied, so the originals and the modules not on those paths stay shared. A
    parameter named with None is left out of the view."""
    if "" in replacements:
        return replacements[""]
    view = copy.copy(module)
    view._modules = dict(module._modules)
    # Hooks registered on a view (FSDP's root, sequence-share inputs, a stage's stop) are its own: a shallow copy
    # would share the hook dicts with the whole module — run by the step's call to it — and with other stages.
    for name, value in vars(module).items():
        if "hooks" in name and isinstance(value, dict):
            setattr(view, name, copy.copy(value))
    below: dict[str, dict[str, nn.Module]] = {}
    for name, replacement in replacements.items():
        child, _, rest = name.partition(".")
        below.setdefault(child, {})[rest] = replacement
    for child, inner in below.items():
        if inner == {"": None}:  # (a parameter: freed already where this rank holds no first stage)
            view._parameters = {name: p for name, p in module._parameters.items() if name != child}
        else:
            view._modules[child] = _replaced(module._modules[child], inner)
    return view


class _StageDone(Exception):
    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


class Stage(nn.Module):
    """One pipeline stage: the model root's forward on a view in which the pieces of other stages stand in.

    A stage after the first runs the root's forward on the step's token ids where the root's forward also takes
    ``inputs_embeds``, as Hugging Face models' do (given under :data:`TOKEN_IDS`; a multimodal model's with None for
    its encoders' inputs, :data:`ENCODER_INPUTS`); otherwise (or given no token ids) it passes its input where the root
    takes its first input, or as ``inputs_embeds``. So the forward computes what the blocks need beside it (masks,
    positions, rotary tables, the image tokens' places, token-hashed routing) as one process would; the embeddings
    of earlier stages return zeros of their output's shape (which DeepSeek-V4 widens into its hyper-connections'
    streams), and the stage's first block gets the stage's input in place of what reached it. A stage before the last
    stops at the output of its last block and hands that on (the hidden state, where blocks return tuples:
    ``block_output``); the last runs the root's forward to its end (norm, head, a loss it computes). What the last
    returns reaches the schedule as its tensors, and :meth:`rebuild` makes it whole again. Where the model computes
    its load-balancing loss from every layer's router logits, they travel beside the hidden state
    (:class:`~meshlight.parallel.router_logits.CarriedRouterLogits`)."""

    def __init__(self, root: nn.Module, blocks: Sequence[str], first: bool, last: bool, as_embeddings: bool,
                 block_output: Optional[BlockOutput] = None, multimodal: bool = False) -> None:
        super().__init__()
        self.root = root
        self._multimodal = multimodal
        self.block_output = block_output or BlockOutput()
        self._router_logits = CarriedRouterLogits(root, blocks) if router_logits_collected(root) else None
        self.first, self.last = first, last
        self._as_embeddings = as_embeddings
        self._blocks = (blocks[0], blocks[-1])
        self._hooked = False
        self._input: Optional[Any] = None
        self._in_first_block = False  # (a later stage's, while its forward runs)
        self._output: Optional[tuple[list[Any], TreeSpec]] = None  # the last stage's latest output, as leaves

    def _hook_blocks(self) -> None:
        # At the first call, when the strategy's own hooks are on the blocks: the stage input goes in before them
        # (sequence parallelism turns it into this rank's share), and the stage ends after them (FSDP's, which
        # prepare the output's backward).
        if not self.first:
            first = self.root.get_submodule(self._blocks[0])
            first.register_forward_pre_hook(self._substitute, prepend=True)
            first.register_forward_hook(self._first_block_done)
        if not self.last:
            self.root.get_submodule(self._blocks[1]).register_forward_hook(self._stop)
        self._hooked = True

    def _substitute(self, module: nn.Module, args: tuple) -> tuple:
        self._in_first_block = True
        return (self._input, *args[1:])

    def _first_block_done(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._in_first_block = False

    def _explain(self, error: Exception) -> None:
        """Where a later stage's first block failed and the blocks return tuples, say what it may have lacked."""
        if self._in_first_block and self.block_output.tuples:
            error.add_note(
                f"meshlight: under pipelining, {self._blocks[0]} begins a stage, and a stage hands on the hidden"
                " state alone: where the model's forward gives each block what the previous one returned beside it"
                " (its blocks return tuples), a stage's first block is given None for that (HY-V4's shared indexer"
                " layers read the previous layer's key selection). Begin stages at blocks that compute it"
                " themselves: PipelineStrategy(split=[...]) names the blocks that begin stages."
            )

    def _stop(self, module: nn.Module, args: tuple, output: Any) -> None:
        raise _StageDone(self.block_output.hidden(output))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._hooked:
            self._hook_blocks()
        received: tuple = ()
        ids = kwargs.pop(TOKEN_IDS, None)
        if not self.first:
            if self._router_logits is not None:  # the earlier layers' router logits come after the hidden state
                args, received = args[:1], args[1:]
            self._input = args[0]
            if ids is not None and (self._as_embeddings or self._multimodal):
                args, kwargs = (ids, *args[1:]), without_encoder_inputs(kwargs)
            elif self._as_embeddings:
                args, kwargs = args[1:], {**kwargs, "inputs_embeds": _whole_shaped(args[0])}
            else:
                args = (_whole_shaped(args[0]), *args[1:])
        carried = self._router_logits
        self._in_first_block = False
        with carried.running(received) if carried else contextlib.nullcontext():
            try:
                output = self.root(*args, **kwargs)
            except _StageDone as done:
                return carried.handed_on(done.output) if carried else done.output
            except Exception as error:
                self._explain(error)
                raise
            finally:
                self._input, self._in_first_block = None, False
        if not self.last:
            raise PipelineError(f"{type(self.root).__name__}.forward returned without running its blocks.")
        if isinstance(output, torch.Tensor):
            return output
        leaves, spec = tree_flatten(output)
        self._output = (leaves, spec)
        # a scalar (a loss the model computed) as one element, which the schedule can concatenate over microbatches
        return tuple(leaf.reshape(1) if leaf.dim() == 0 else leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    def rebuild(self, output: Any) -> Any:
        """What the root's forward returned, from the tensors the schedule holds of it (``output``: one microbatch's,
        or all merged, where a scalar is the mean of the microbatches'); the leaves that are not tensors are the
        latest call's."""
        if self._output is None:
            return output
        leaves, spec = self._output
        tensors = iter((output,) if isinstance(output, torch.Tensor) else output)  # torch unwraps a 1-tuple
        return tree_unflatten([_as_returned(next(tensors), leaf) if isinstance(leaf, torch.Tensor) else leaf
                               for leaf in leaves], spec)


def _as_returned(held: torch.Tensor, returned: torch.Tensor) -> torch.Tensor:
    """A tensor the schedule holds as the root's forward returned it: a scalar it holds as one element per
    microbatch becomes their mean."""
    return held.mean() if returned.dim() == 0 else held


def _whole_shaped(stage_input: Any) -> Any:
    """What the root's forward is given for a later stage's input: zeros of its shape — of the whole sequence's for
    this rank's share under sequence parallelism (a DTensor whose shape is the whole sequence's) — so that the
    forward counts positions and builds masks for the whole sequence, adds plain tensors to it (GPT-2's learned
    positions) and may scale it in place (CTRL scales its embedding's output). Its first block gets the stage's input
    itself."""
    if not isinstance(stage_input, torch.Tensor) or not stage_input.is_floating_point():
        return stage_input
    local = stage_input.to_local() if isinstance(stage_input, DTensor) else stage_input
    return torch.zeros(stage_input.shape, dtype=stage_input.dtype, device=local.device)


def without_encoder_inputs(kwargs: dict) -> dict:
    """A multimodal model's forward arguments with None for :data:`ENCODER_INPUTS` (its encoders are skipped)."""
    return {key: None if key in ENCODER_INPUTS else value for key, value in kwargs.items()}


class _ZerosLike(nn.Module):
    """Stands in for an embedding of an earlier stage: zeros of its output's shape for token ids (the stage's first
    block gets the stage's input instead), so that what the forward adds to it (learned positions) still fits. Its
    ``weight`` is empty, for a forward that reads the embedding's device from it (Llama 4's). ``features``: it stands
    in for a Linear (OPT's ``project_in``, from a narrower embedding to the blocks' width), whose output replaces its
    input's last dimension."""

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device, features: bool = False) -> None:
        super().__init__()
        self.dim, self.dtype, self.features = dim, dtype, features
        self.register_buffer("weight", torch.empty(0, dim, dtype=dtype, device=device), persistent=False)

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if ids.is_floating_point() and ids.shape[-1:] == (self.dim,):
            return ids  # the stage's input where the root takes token ids: handed on as it is
        # token ids, or what a learned position embedding reads (OPT's: the attention mask, floats)
        shape = ids.shape[:-1] if self.features else ids.shape
        return torch.zeros(*shape, self.dim, dtype=self.dtype, device=ids.device)


def _stand_in(piece: nn.Module) -> nn.Module:
    piece = as_planned(piece)  # (an embedding PEFT trains a copy of, in modules_to_save: the copy's shape)
    if isinstance(piece, _ZerosLike):
        return piece
    if isinstance(piece, nn.Embedding):
        return _ZerosLike(piece.embedding_dim, piece.weight.dtype, piece.weight.device)
    if isinstance(piece, nn.Linear):
        return _ZerosLike(piece.out_features, piece.weight.dtype, piece.weight.device, features=True)
    return PassThrough()


def root_stages(root: nn.Module, place: ModelRoot, plan: StagePlan, stages: Sequence[int]) -> list[Stage]:
    """This rank's :class:`Stage` modules, one per index in ``stages``, from the model ``root`` (described by
    ``place``). Pieces of other stages are freed in ``root`` (replaced by :class:`PassThrough`), heads too where
    this rank holds no last stage; the stages share the modules they own with ``root``."""
    pipelined = root.get_submodule(place.pipelined)
    block_output = BlockOutput()
    views = split_stages(pipelined, plan, stages, block_output)
    last = plan.num_stages - 1
    if last not in stages:
        for head in place.heads:
            root.set_submodule(head, PassThrough())
    parameters = {encoder for encoder in place.encoders if _is_parameter(root, encoder)}
    if 0 not in stages:
        for encoder in place.encoders:
            if encoder in parameters:  # freed: a later stage's forward, given no images, does not read it
                holder, _, name = encoder.rpartition(".")
                del root.get_submodule(holder)._parameters[name]
            else:
                root.set_submodule(encoder, _EncoderStandIn(encoder))
    as_embeddings = "inputs_embeds" in inspect.signature(type(root).forward).parameters
    prefix = f"{place.pipelined}." if place.pipelined else ""
    result = []
    for view, stage in zip(views, stages):
        replacements = {place.pipelined: view}
        if stage != last:
            replacements.update({head: PassThrough() for head in place.heads})
        if stage != 0:  # (a parameter: left out of the view)
            replacements.update({encoder: None if encoder in parameters else _EncoderStandIn(encoder)
                                 for encoder in place.encoders})
        blocks = [f"{prefix}{plan.container}.{key}" for key in plan.blocks[stage]]
        result.append(Stage(_replaced(root, replacements), blocks, stage == 0, stage == last, as_embeddings,
                            block_output, multimodal=bool(place.encoders)))
    return result


@dataclass(frozen=True)
class TiedParameter:
    """A parameter the first and the last stage both use (an LM head tied to the token embedding): its names in the
    model root under the first stage's pieces and under the last's."""

    first: str
    last: str


def tied_parameters(root: nn.Module, place: ModelRoot, plan: StagePlan) -> list[TiedParameter]:
    """The parameters shared between the first and the last stage (the heads beside the pipelined module belong to
    the last). Sharing between other stages is refused: only an embedding and a head are tied in practice."""
    prefix = f"{place.pipelined}." if place.pipelined else ""
    last = plan.num_stages - 1
    users: dict[int, dict[int, str]] = {}
    for stage in range(plan.num_stages):
        pieces = (sorted(prefix + name for name in plan.owned(stage)) + (list(place.heads) if stage == last else [])
                  + (list(place.encoders) if stage == 0 else []))
        for piece in pieces:
            held = ([("", root.get_parameter(piece))] if _is_parameter(root, piece) else
                    root.get_submodule(piece).named_parameters(remove_duplicate=False))
            for name, param in held:
                users.setdefault(id(param), {}).setdefault(stage, f"{piece}.{name}".rstrip("."))
    tied = []
    for names in users.values():
        if len(names) == 1:
            continue
        if set(names) != {0, last}:
            shown = ", ".join(f"{name} (stage {stage})" for stage, name in names.items())
            raise PipelineError(
                f"{shown} share one parameter across pipeline stages; only the first and the last stage may share"
                " one (a token embedding tied to the LM head). Untie it, or split the blocks so they fall on one stage."
            )
        tied.append(TiedParameter(names[0], names[last]))
    return tied


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


def check_chain(root: nn.Module, plan: StagePlan, args: tuple, kwargs: dict,
                place: Optional[ModelRoot] = None) -> bool:
    """Run the model root's ``forward`` on its real inputs up to the first piece after the blocks, with the blocks
    replaced by probes that return their input unchanged: each block must receive the previous block's output
    (here: the very same object), and the first piece after them the last block's. No piece computes and nothing is
    communicated. What runs before the blocks runs on the first stage only, and what runs after them on the last
    only, so any operations are fine there; between blocks, or from before the blocks to after them (a skip
    connection), they would be lost at a stage boundary. A head beside the pipelined module (``place``; default: the
    root is the pipelined module) must run after the blocks: the last stage owns it. Blocks may return their output
    alone or first in a tuple, which the forward takes out (``hidden_states = outputs[0]``, as BLOOM's, Falcon's and
    MPT's do): the probes return it alone, and in a tuple where that breaks the chain. Returns whether the blocks
    return tuples (:class:`BlockOutput`)."""
    alone: list[tuple[str, Any]] = []
    kwargs = {key: value for key, value in kwargs.items() if key != TOKEN_IDS}
    if place is not None and place.encoders:  # (the first stage's encoders are not checked: they run before the blocks)
        kwargs = without_encoder_inputs(kwargs)
    try:
        _check_chain(root, plan, args, kwargs, place, alone, tuples=False)
        return False
    except PipelineError as error:
        in_tuples: list[tuple[str, Any]] = []
        try:
            _check_chain(root, plan, args, kwargs, place, in_tuples, tuples=True)
        except PipelineError as tuple_error:
            # the refusal of the run that got further through the pieces says what breaks the chain
            raise (tuple_error if len(in_tuples) > len(alone) else error) from None
        return True


def run_after_blocks(root: nn.Module, plan: StagePlan, place: ModelRoot) -> tuple[str, ...]:
    """The pieces registered before the blocks that ``root``'s forward runs only after them all, in the order it runs
    them (OPT's decoder registers its final norm before its layers): found by :func:`check_chain`'s probe on the
    model's own example inputs (Hugging Face's ``dummy_inputs``), before the stages are made, so that the last stage
    owns them (:func:`~meshlight.parallel.pipeline.plan_stages`' ``run_after``). None where the model has no such
    inputs, is not on a device yet, or the probe does not get through its forward on them: :func:`check_chain` then
    refuses such a piece at the first step, naming how to register it after the blocks — as it refuses one that also
    runs before the blocks, or between them."""
    inputs = getattr(root, "dummy_inputs", None)
    device = next((t.device for t in (*root.parameters(), *root.buffers()) if t.device.type != "meta"), None)
    if not plan.pre or not isinstance(inputs, dict) or device is None:
        return ()
    inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    prefix = f"{place.pipelined}." if place.pipelined else ""
    for tuples in (False, True):
        late: list[str] = []
        try:
            _check_chain(root, plan, (), inputs, place, [], tuples, late=late)
        except Exception:  # noqa: BLE001 — the first step's check names what breaks the chain
            continue
        return tuple(name.removeprefix(prefix) for name in late)
    return ()


def _check_chain(root: nn.Module, plan: StagePlan, args: tuple, kwargs: dict, place: Optional[ModelRoot],
                 received: list[tuple[str, Any]], tuples: bool, late: Optional[list[str]] = None) -> None:
    """:func:`check_chain` with blocks returning their output alone or (``tuples``) first in a tuple; ``received``
    gets each piece's name and first input as it runs. ``late``: gets the pieces registered before the blocks that
    run only once every block has, in the order they run, which are then not refused (nor is the rest checked)."""
    place = place or ModelRoot("", "", plan.container, ())
    prefix = f"{place.pipelined}." if place.pipelined else ""
    container_name = prefix + plan.container
    blocks = [f"{container_name}.{k}" for keys in plan.blocks for k in keys]
    # the pieces after the blocks stop the forward, whichever runs first (DeepSeek-V4 runs its hyper-connections'
    # head, registered after its final norm, before the norm)
    post = [prefix + name for name in plan.post]
    pieces = [*blocks, *post]
    # with no piece after the blocks, the forward runs on to a head beside the pipelined module, where it stops: a
    # piece registered before the blocks but run after them shows there
    on_to_head = not post and bool(place.heads)
    block_output = BlockOutput()
    block_output.tuples = tuples
    probes = {name: _Probe(name, received, stop=name in post or (name == blocks[-1] and not post and not on_to_head),
                           block_output=block_output if name in blocks else None) for name in pieces}
    container = root.get_submodule(container_name)
    keys = list(container.keys()) if isinstance(container, nn.ModuleDict) else [str(i) for i in range(len(container))]
    probed = [probes[f"{container_name}.{k}"] for k in keys]
    for key, probe in zip(keys, probed):
        block = container[key if isinstance(container, nn.ModuleDict) else int(key)]
        bearing_attributes(probe, block)
        # a parameter of each block this rank holds stays in the view, for a forward that reads its device or dtype
        # from its parameters (Idefics3's); not the block itself, whose modules a forward may hook (router logits)
        held = next(block.parameters(), None)
        if held is not None:
            probe.register_parameter("held", held)
    # an embedding's stand-in hands on zeros of its output's dtype, which what runs before the blocks may read (an
    # eager attention mask takes its minimum)
    calls: list[tuple[str, int]] = []  # pieces registered before the blocks as they run: name, pieces run before
    replacements: dict[str, nn.Module] = {prefix + name: _stand_in(root.get_submodule(prefix + name))
                                          for name in plan.pre}
    watches = [stand_in.register_forward_pre_hook(functools.partial(_watch, name, received, calls))
               for name, stand_in in replacements.items()]
    replacements.update({name: probes[name] for name in pieces[len(blocks):]})
    replacements.update({head: _Probe(head, received, stop=True) for head in place.heads})
    replacements[container_name] = (nn.ModuleDict(zip(keys, probed)) if isinstance(container, nn.ModuleDict)
                                    else nn.ModuleList(probed))
    view = _replaced(root, replacements)
    name = type(root).__name__
    try:
        with torch.no_grad():
            type(root).forward(view, *args, **kwargs)
    except _StageDone:
        pass
    except Exception as error:  # an operation on what a piece returned: the input, passed through unchanged
        done = [piece for piece, _ in received]
        raise PipelineError(
            f"{name}.forward is not a chain of its blocks {blocks[0]} … {blocks[-1]}: run with the blocks passing their"
            f" input through, it failed after {done[-1] if done else 'no block'!r} with {type(error).__name__}:"
            f" {error}. An operation between blocks is not a piece of its own: move it into them (see"
            " docs/guides/pipeline.md)."
        ) from error
    finally:
        for watch in watches:  # (a stage's own stand-in may be one of them)
            watch.remove()
    if late is not None:
        late.extend(name for name in dict.fromkeys(n for n, _ in calls)
                    if all(count >= len(blocks) for n, count in calls if n == name))
        return
    late = list(dict.fromkeys(n for n, count in calls if count > 0))  # run once the blocks began
    if late:
        parent, _, leaf = late[0].rpartition(".")
        owner = f"{name}.{parent}" if parent else name
        raise PipelineError(
            f"{name}.forward runs {late[0]!r} after the blocks {blocks[0]} … {blocks[-1]}, but it is registered"
            f" before {container_name!r}: the first stage would own it and the last would skip it. Register it after"
            f" the blocks in configure_model() — on {owner}: `norm = parent.{leaf}; del parent.{leaf}; parent.{leaf}"
            " = norm` puts it last among its parent's modules — or train without pipelining."
        )
    heads = [i for i, (piece, _) in enumerate(received) if piece in place.heads]
    if on_to_head and heads and heads[0] > 0 and received[heads[0] - 1][0] == blocks[-1]:
        received = received[:heads[0]]  # the head ran after the last block, as it should
    order = [piece for piece, _ in received]
    early = [piece for piece in order if piece in place.heads]
    if early:
        raise PipelineError(
            f"{name}.forward runs {early[0]!r} before the blocks {blocks[0]} … {blocks[-1]} are done: a module beside"
            f" the one holding them ({place.pipelined!r}) belongs to the last stage, after them. Move it into"
            f" {place.pipelined!r}, before the blocks."
        )
    after = next((piece for piece in order if piece in post), post[0] if post else None)
    chain = [*blocks, after] if post else blocks
    if order != chain:
        raise PipelineError(
            f"{name}.forward is not a chain of its blocks: it calls {order} but pipelining needs {chain}, each once"
            " and in order (see docs/guides/pipeline.md)."
        )
    for (_, before), (piece, value) in zip(received, received[1:]):
        if value is not before:
            raise PipelineError(
                f"{name}.forward is not a chain: {piece} does not receive the previous piece's output as its first"
                " argument (an operation between blocks, or an input from before the blocks reused after them)."
                " Move such operations into the blocks (see docs/guides/pipeline.md)."
            )


def _watch(name: str, received: list, calls: list, module: nn.Module, args: tuple) -> None:
    """A forward pre-hook on the stand-in of a piece registered before the blocks, in :func:`check_chain`: ``calls``
    gets its ``name`` and how many pieces had run (``received``) when it runs."""
    calls.append((name, len(received)))


class _Probe(nn.Module):
    def __init__(self, name: str, received: list, stop: bool, block_output: Optional[BlockOutput] = None) -> None:
        super().__init__()
        self.name, self.received, self.stop, self.block_output = name, received, stop, block_output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.received.append((self.name, args[0] if args else None))
        if self.stop:
            raise _StageDone(None)
        hidden = args[0] if args else None
        return self.block_output.wrap(hidden) if self.block_output else hidden


def first_positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call to ``module`` with its first input positional where it was passed by keyword
    (``model(input_ids=…)``), the slot where stages after the first receive theirs."""
    if args:
        return args, kwargs
    first = next(iter(list(inspect.signature(type(module).forward).parameters)[1:]), None)  # after `self`
    if first not in kwargs:
        return args, kwargs
    kwargs = dict(kwargs)
    return (kwargs.pop(first),), kwargs
