"""Weights in Hugging Face's layout (``save_pretrained`` folders of safetensors files), or saved by ``torch.save``
(litgpt's ``lit_model.pth``, Hugging Face's older ``pytorch_model*.bin``): loaded into a model of any layout, each rank
reading only what it holds, and written from a checkpoint of any layout.

:func:`load_pretrained` matches the model's state names under a prefix (``"model."``: a LightningModule's
``self.model``) with the files' keys, checks every shape against the whole tensor's, and lets DCP's
``HuggingFaceStorageReader`` read, for each parameter, the rectangle of the stored tensor this rank holds: a
tensor-parallel or ZeRO shard, a pipeline stage's parameters only. Every layout meshlight makes stores its shards as
such rectangles — a fused q|k|v too (:mod:`meshlight.parallel.tensor`), and uneven vocabulary shards — or is read
as rectangles and redistributed (stacked experts' fused gate|up, split part by part over tp:
:func:`~meshlight.parallel.dtensors.in_blocks`), so no load planner of its own is needed. A weight tied to another
that the files hold once (GPT-2's head, Hugging Face's ``all_tied_weights_keys``) is read from its partner's key, and
a later pipeline stage's copy of it too. Stacked experts the files hold one by one (Mixtral's and Qwen-MoE's files)
are read part by part (:mod:`meshlight.parallel.expert_files`). Non-persistent buffers (rotary tables) are not in the
state and are left as the model computed them. A ``torch.save`` file is memory-mapped on every rank (read with
``weights_only``: it runs no code), and each rank copies the rectangles it holds from it: the pages it touches are
all it reads.

:func:`export_pretrained` reads a meshlight checkpoint in one process (the code path ``meshlight consolidate``
uses), keeps the names under the prefix without it, and writes safetensors shards with their index, and the model's
``config.json`` where the checkpoint holds it (see :func:`model_configs`).

meshlight's own :class:`~meshlight.models.GPT` goes both ways in Hugging Face's Llama layout where its configuration
has a Llama equivalent (:mod:`meshlight.models.hf_layout`): names mapped, and q and k rows reordered within each head
for Llama's rotary channel pairs — on load by a reader that reads each rank's rows in that order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from meshlight.models.gpt import GPT, GPTConfig
from meshlight.models.hf_layout import (
    LlamaLayoutError,
    check_llama_equivalent,
    gpt_config_from_dict,
    gpt_config_json,
    llama_config_json,
    llama_name,
    rotary_order,
)
from meshlight.parallel.adapters import (
    adapter_configs,
    adapter_layers,
    base_name,
    initialize_adapters,
    initialize_dora_magnitudes,
    initialize_trained_tokens,
    peft_base,
    rebuilt_peft_model,
)
from meshlight.parallel.dtensors import block_to_fill, from_blocks, in_blocks
from meshlight.parallel.expert_files import file_names, per_expert_sources, read_per_expert

__all__ = [
    "CONFIGS_KEY", "GPT_CONFIGS_KEY", "LoadReport", "PEFT_CONFIGS_KEY", "PretrainedWeightsError", "export_pretrained",
    "load_pretrained", "model_configs",
]

PathLike = Union[str, Path]
#: Where a checkpoint's metadata keeps the Hugging Face configs of the models a LightningModule holds.
CONFIGS_KEY = "hf_configs"
#: … and the configs of the meshlight GPTs it holds (exported in Hugging Face's Llama layout)
GPT_CONFIGS_KEY = "gpt_configs"
#: … and the adapter configs of the PEFT models it holds (exported merged, or as PEFT's adapter folder)
PEFT_CONFIGS_KEY = "peft_configs"
_INDEX = "model.safetensors.index.json"


class PretrainedWeightsError(ValueError):
    """Weights files that cannot be read, or that do not fit the model; the message names the file or the keys."""


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did: keys loaded, the model's names the files lack, the files' keys no model name
    takes, the (stored, parameter) dtype pairs it cast between, and the adapters' weights it left."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    cast: set[tuple[str, str]] = field(default_factory=set)
    #: the LoRA adapters' own weights, which base model files do not hold: left as PEFT initialized them
    adapters: list[str] = field(default_factory=list)


def load_pretrained(module: nn.Module, path: PathLike, *, prefix: str = "model.", strict: bool = True) -> LoadReport:
    """Load the weights at ``path`` into ``module``'s state names under ``prefix``, in place, in any layout; collective
    where a process group exists. ``path``: a folder of safetensors files (one, or shards with their index), or of a
    ``torch.save``'d state dict (``lit_model.pth``, ``pytorch_model*.bin``), or such a file itself.

    Raises :class:`PretrainedWeightsError` naming a file that cannot be read, every shape that differs, and — with
    ``strict`` — every name the files lack and every key no name takes (``strict=False`` loads what matches). A
    dtype that differs (bf16 files into fp32 parameters) is cast, and noted in the report's ``cast``.

    A PEFT model under ``prefix`` (LoRA) loads its base model's files: each adapted Linear's (or parameter's) weights
    from its own keys, a module it trains a copy of (``modules_to_save``) into the original and the copy alike, the
    adapters left as PEFT initialized them (initialized again where the model was built on the meta device), rows of
    the embedding it trains (``trainable_token_indices``) starting from the rows loaded and DoRA's magnitudes from the
    weights loaded, as PEFT computes them."""
    folder = Path(path)
    files = _weights_files(folder)
    stored = files.stored
    distributed = dist.is_initialized()
    peft_model, prefix = peft_base(module, prefix)
    built_on_meta = _allocate(module)
    if built_on_meta and peft_model is not None:
        initialize_adapters(peft_model)
    adapted = adapter_layers(module)
    state = get_model_state_dict(module) if distributed else module.state_dict()
    aliases = _tied_keys(module, prefix)
    renamed = _renamed_keys(module, prefix, stored)
    gpt = _meshlight_gpt(module, prefix)
    report, reads, copies, wrong, orders, per_expert = LoadReport(), {}, [], [], {}, {}
    for name, tensor in state.items():
        if not name.startswith(prefix):
            continue
        base = base_name(name, adapted)
        if base is None:
            report.adapters.append(name[len(prefix):])
            continue
        key = base[len(prefix):]
        if gpt is not None:  # Llama's names, q and k rows in Llama's rotary order
            key = llama_name(key) or key
            order = rotary_order(name, tensor.shape[0], gpt.head_dim)
            if order is not None:
                orders[key] = torch.argsort(order)
        source = _stored_name(key, stored, renamed) or _stored_name(aliases.get(key), stored, renamed)
        if source not in stored and (experts := per_expert_sources(key, tuple(tensor.shape), stored)):
            per_expert[key] = (tensor, experts)  # stacked experts the files hold one by one
            report.cast.update(_cast(stored[experts[0][0]][1], tensor.dtype))
            report.loaded.append(key)
            continue
        if source not in stored:
            report.missing.append(key)
            continue
        shape, dtype = stored[source][:2]
        if tuple(tensor.shape) != shape:
            wrong.append(f"{key}: the model's is {list(tensor.shape)}, the file's {list(shape)}")
            continue
        if source in reads:  # a tied weight held twice on this rank, or a module and the copy of it PEFT trains
            # (modules_to_save): read once, copied
            copies.append((reads[source], tensor))
        else:
            reads[source] = tensor
        report.cast.update(_cast(dtype, tensor.dtype))
        report.loaded.append(key)
    report.loaded = list(dict.fromkeys(report.loaded))  # (a module and its copy load one key)
    taken = set(reads) | {k for _, experts in per_expert.values() for row in experts for k in row}
    if distributed:  # a pipeline stage holds some names; the files' keys are taken by the whole model's
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (taken, report.missing, wrong))
        taken = set().union(*(names for names, _, _ in gathered))
        report.missing = sorted({key for _, missing, _ in gathered for key in missing} - taken)
        wrong = sorted({problem for _, _, problems in gathered for problem in problems})  # every rank raises alike
    report.unexpected = sorted(set(stored) - taken)
    if built_on_meta and report.missing:
        raise PretrainedWeightsError(
            f"The model was built on the meta device, and the weights in {str(folder)!r} lack"
            f" {_listed(report.missing)}: nothing would initialize them. Build the model on a real device, or load"
            " files that hold every weight."
        )
    _check(folder, wrong, report, strict)
    if files.tensors is None:
        _read(folder, reads, distributed, orders)
    else:
        _read_mapped(files.tensors, reads, orders)
    read_per_expert(files.slice, per_expert)
    for loaded, copy in copies:
        if copy is not loaded:
            copy.detach().copy_(loaded.detach())
    if built_on_meta:
        _compute_buffers(module, prefix)
    if distributed:
        set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    else:
        module.load_state_dict(state, strict=False)
    if peft_model is not None:  # what PEFT computed from the base weights, from the weights just loaded
        initialize_trained_tokens(peft_model, built_on_meta)
        initialize_dora_magnitudes(peft_model)
    return report


def _allocate(module: nn.Module) -> bool:
    """Allocate a model built on the meta device (``configure_model``), each rank its shards only, uninitialized:
    the files initialize it. Returns whether it was on the meta device."""
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return False
    held = next((t.device for t in (*module.parameters(), *module.buffers()) if not t.is_meta), None)
    module.to_empty(device=held or torch.device("cpu"))
    return True


def _compute_buffers(module: nn.Module, prefix: str) -> None:
    """Compute what a model built on the meta device holds outside its state: the non-persistent buffers (rotary
    tables), by the ``reset_parameters()`` of a module holding them and no parameters (meshlight's), else by Hugging
    Face's initialization of that module (``_init_weights``)."""
    inner = module.get_submodule(prefix.rstrip(".")) if prefix else module
    initialize = getattr(inner, "_init_weights", None)
    for holder in (m for m in inner.modules() if m._non_persistent_buffers_set):
        reset = getattr(holder, "reset_parameters", None)
        own = next(holder.parameters(recurse=False), None) is not None
        if not (callable(reset) and not own or callable(initialize)):
            raise PretrainedWeightsError(
                f"{type(inner).__name__} was built on the meta device and its {type(holder).__name__} holds buffers"
                " outside its state that meshlight cannot compute: build the model on a real device (the files still"
                " initialize the weights)."
            )
        with torch.no_grad():
            reset() if callable(reset) and not own else initialize(holder)


def _check(folder: Path, wrong: list[str], report: LoadReport, strict: bool) -> None:
    problems = []
    if wrong:
        problems.append(f"shapes differ: {'; '.join(wrong[:8])}{' …' if len(wrong) > 8 else ''}")
    if strict and report.missing:
        problems.append(f"the files lack {_listed(report.missing)}")
    if strict and report.unexpected:
        problems.append(f"no parameter takes {_listed(report.unexpected)}")
    if problems:
        raise PretrainedWeightsError(
            f"The weights in {str(folder)!r} do not fit the model: {'; '.join(problems)}. Check the folder was saved"
            " from this architecture and configuration, and the prefix the model's names have in the LightningModule"
            " (prefix=)" + ("" if wrong else ", or pass strict=False to load the keys that match") + "."
        )


def _cast(stored: torch.dtype, model: torch.dtype) -> set[tuple[str, str]]:
    """The (stored, parameter) dtype pair a load casts between, if they differ."""
    return {(str(stored).removeprefix("torch."), str(model).removeprefix("torch."))} if stored != model else set()


def _listed(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _read_mapped(tensors: Mapping[str, torch.Tensor], reads: dict[str, torch.Tensor],
                 orders: dict[str, torch.Tensor]) -> None:
    """:func:`_read` from memory-mapped ``tensors`` (a ``torch.save`` file): each rank copies the block of each stored
    tensor its state holds (of a fused weight split part by part, its plain blocks: :func:`in_blocks`)."""
    for key, target in reads.items():
        block, local, offset = block_to_fill(target)
        stored = tensors[key]
        if key in orders:  # rows in another order: this rank's rows, picked
            stored = stored[orders[key][offset[0]:offset[0] + local.shape[0]]]
            offset = (0, *offset[1:])
        with torch.no_grad():
            local.copy_(stored[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])
        from_blocks(target, block)


def _read(folder: Path, reads: dict[str, torch.Tensor], distributed: bool, orders: dict[str, torch.Tensor]) -> None:
    """Each rank reads, of each stored tensor, the part its state holds (DCP with Hugging Face's storage); row ``r``
    of a tensor in ``orders`` from the file's row ``orders[key][r]``."""
    readable = {key: in_blocks(tensor) for key, tensor in reads.items()}  # a fused weight split part by part
    try:
        dcp.load(readable, storage_reader=_reader(str(folder), orders), no_dist=not distributed)
    except Exception as error:  # DCP wraps a rank's failure; the safetensors error names what broke
        raise PretrainedWeightsError(f"Reading the weights in {str(folder)!r} failed: {error}") from error
    for key, tensor in reads.items():
        from_blocks(tensor, readable[key])


def _reader(folder: str, orders: dict[str, torch.Tensor]) -> Any:
    """DCP's Hugging Face reader, reading the rows of the tensors in ``orders`` in the order given (a rank's rows of q
    and k, reordered within each head): the rows its request covers are read as one slice and picked from it."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError as error:
        raise PretrainedWeightsError("Loading Hugging Face weights needs torch >= 2.8 (DCP's"
                                     f" HuggingFaceStorageReader); this is torch {torch.__version__}.") from error

    class Reordering(HuggingFaceStorageReader):
        # torch's reader handles one request at a time here (private in torch 2.13, as is the planner's part)
        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            order = orders.get(req.storage_index.fqn)
            if order is None:
                return super()._process_read_request(f, req, planner)
            rows = order[req.storage_offsets[0]:req.storage_offsets[0] + req.lengths[0]]
            first, last = int(rows.min()), int(rows.max()) + 1
            rest = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets[1:], req.lengths[1:]))
            tensor = f.get_slice(req.storage_index.fqn)[(slice(first, last), *rest)][rows - first]
            target = planner.resolve_tensor(req).detach()
            target.copy_(tensor)
            planner.commit_tensor(req, target)
            return None

    return Reordering(folder)


def _meshlight_gpt(module: nn.Module, prefix: str) -> Optional[GPTConfig]:
    """The config of the meshlight GPT under ``prefix``, checked to have a Llama equivalent; None for another model."""
    inner = module.get_submodule(prefix.rstrip(".")) if prefix else module
    if not isinstance(inner, GPT):
        return None
    try:
        check_llama_equivalent(inner.config)
    except LlamaLayoutError as error:
        raise PretrainedWeightsError(f"Hugging Face weights load into meshlight's GPT in Llama's layout only: {error}"
                                     ) from None
    return inner.config


@dataclass
class _WeightsFiles:
    """The weights files at a path: ``stored``, key → (shape, dtype, file name); ``tensors``, for ``torch.save``
    files, each key's memory-mapped tensor (None for safetensors, which DCP's Hugging Face reader reads); ``slice``,
    a key's sliceable view (safetensors' ``get_slice``, or the tensor)."""

    stored: dict[str, tuple[tuple[int, ...], torch.dtype, str]]
    tensors: Optional[dict[str, torch.Tensor]]
    slice: Any


#: ``torch.save`` files, by the names their writers give them, before any other ``.pth``/``.bin``/``.pt``
_TORCH_FILES = ("lit_model.pth", "pytorch_model*.bin", "*.pth", "*.bin", "*.pt")


def _weights_files(path: Path) -> _WeightsFiles:
    """The weights at ``path``: a folder's safetensors files, else its ``torch.save`` files (the first pattern of
    :data:`_TORCH_FILES` that matches), or the file ``path`` names."""
    if path.is_file():
        return _torch_files(path, [path]) if path.suffix != ".safetensors" else _safetensors(path, [path])
    safetensors = sorted(path.glob("*.safetensors"))
    if safetensors:
        return _safetensors(path, safetensors)
    torch_files = next((found for pattern in _TORCH_FILES if (found := sorted(path.glob(pattern)))), [])
    if torch_files:
        return _torch_files(path, torch_files)
    raise PretrainedWeightsError(f"{str(path)!r} holds no weights files (.safetensors; or lit_model.pth,"
                                 " pytorch_model.bin, …, as torch.save writes them): pass the folder save_pretrained"
                                 " (or litgpt) wrote, or the file.")


def _safetensors(folder: Path, files: list[Path]) -> _WeightsFiles:
    """Every tensor the safetensors ``files`` hold. A file that cannot be read (a damaged header, or data shorter
    than the header says: safetensors checks both) is named."""
    from safetensors import safe_open

    stored = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    stored[key] = (tuple(view.get_shape()), _DTYPES[view.get_dtype()], file.name)
        except Exception as error:  # safetensors' own SafetensorError (for a file shorter than its header says too)
            raise PretrainedWeightsError(f"{str(file)!r} cannot be read as safetensors ({error}): the file is"
                                         " damaged or truncated.") from error
    handles: dict[str, Any] = {}

    def slice_of(key: str) -> Any:
        name = stored[key][2]
        if name not in handles:
            handles[name] = safe_open(str(files[0].parent / name), framework="pt")
        return handles[name].get_slice(key)

    return _WeightsFiles(stored, None, slice_of)


def _torch_files(folder: Path, files: list[Path]) -> _WeightsFiles:
    """Every tensor the ``torch.save``'d state dicts in ``files`` hold, memory-mapped (a file of the legacy format,
    which cannot be mapped, is read whole), read as tensors only: a file needing more is refused, named."""
    tensors: dict[str, torch.Tensor] = {}
    stored = {}
    for file in files:
        try:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # an unpickling refusal, a damaged zip archive, …
            raise PretrainedWeightsError(
                f"{str(file)!r} cannot be read as a state dict of tensors ({error}).") from error
        if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
            state = state["model"]  # a training checkpoint holding the weights under "model" (litgpt's, Fabric's)
        if not isinstance(state, Mapping):
            raise PretrainedWeightsError(f"{str(file)!r} holds a {type(state).__name__}, not a state dict.")
        for key, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                tensors[key] = tensor
                stored[key] = (tuple(tensor.shape), tensor.dtype, file.name)
    return _WeightsFiles(stored, tensors, tensors.__getitem__)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _stored_name(key: Optional[str], stored: Mapping[str, Any], renamed: Mapping[str, str]) -> Optional[str]:
    """The files' key holding weight ``key``: its own name or an older one of its MoE block
    (:func:`~meshlight.parallel.expert_files.file_names`), or the key Hugging Face renames to it (``renamed``)."""
    if key is None:
        return None
    return next((name for name in (*file_names(key), renamed.get(key)) if name in stored), None)


def _renamed_keys(module: nn.Module, prefix: str, stored: Mapping[str, Any]) -> dict[str, str]:
    """Weight name (without ``prefix``) → the files' key that Hugging Face's loading renames to it, where the model
    under ``prefix`` is a ``transformers`` model whose published files keep an older layout (its conversion mapping:
    LLaVA's and Gemma 3's ``language_model.model.*``, Qwen2.5-VL's ``model.layers.*`` and ``visual.*``, for
    ``model.language_model.*`` and ``model.visual.*``). Renamings only: converters of the weights themselves (experts
    stored one by one) are :mod:`meshlight.parallel.expert_files`'."""
    inner = module.get_submodule(prefix.rstrip(".")) if prefix else module
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # (no transformers, or one without conversion mappings: its files use the model's names)
        return {}
    if not isinstance(inner, PreTrainedModel):
        return {}
    renamings = [t for t in get_model_conversion_mapping(inner) if isinstance(t, WeightRenaming)]
    if not renamings:
        return {}
    names = dict.fromkeys(inner.state_dict(), True)
    renamed: dict[str, str] = {}
    for key in stored:
        name, _ = rename_source_key(key, renamings, [], inner.base_model_prefix, names)
        if name != key and name in names:
            renamed.setdefault(name, key)
    return renamed


def _tied_keys(module: nn.Module, prefix: str) -> dict[str, str]:
    """Names (without ``prefix``) of weights tied to another that the files may hold alone → that other's name:
    Hugging Face's ``all_tied_weights_keys`` of the model under ``prefix`` (the ties its config makes; its class's
    ``_tied_weights_keys`` declares them for an untied Llama too, whose head must come from the files), and
    parameters held under two names."""
    tied: dict[str, str] = {}
    inner = module.get_submodule(prefix.rstrip(".")) if prefix else module
    declared = getattr(inner, "all_tied_weights_keys", None)
    if isinstance(declared, Mapping):
        tied.update({str(k): str(v) for k, v in declared.items()})
    names: dict[int, str] = {}
    for name, param in inner.named_parameters(remove_duplicate=False):
        if id(param) in names and name != names[id(param)]:
            tied.setdefault(name, names[id(param)])
        names.setdefault(id(param), name)
    return tied


def model_configs(module: nn.Module) -> dict[str, dict[str, str]]:
    """The configs (as JSON) of the models ``module`` holds, by their name in it (``"model"``), for a checkpoint's
    metadata: Hugging Face models' under :data:`CONFIGS_KEY` (a PEFT model's, its base model's), meshlight GPTs' under
    :data:`GPT_CONFIGS_KEY`, and a PEFT model's adapters' under :data:`PEFT_CONFIGS_KEY`. :func:`export_pretrained`
    writes the one it exports as ``config.json`` (a GPT's as its Llama equivalent's)."""
    configs: dict[str, dict[str, str]] = {}
    for name, child in module.named_modules():
        if not name or any(name.startswith(held + ".") for kind in configs.values() for held in kind):
            continue
        config = getattr(child, "config", None)
        if callable(getattr(config, "to_json_string", None)) and getattr(config, "model_type", None):
            configs.setdefault(CONFIGS_KEY, {})[name] = config.to_json_string()
            if (adapters := adapter_configs(child)) is not None:
                configs.setdefault(PEFT_CONFIGS_KEY, {})[name] = adapters
        elif isinstance(child, GPT):
            configs.setdefault(GPT_CONFIGS_KEY, {})[name] = gpt_config_json(child.config)
    return configs


def export_pretrained(checkpoint: PathLike, out: PathLike, *, prefix: str = "model.", config: Optional[PathLike] = None,
                      max_shard_bytes: int = 5 * 2**30, to: str = "hf") -> list[str]:
    """Write the model weights of a meshlight checkpoint (any layout) as Hugging Face safetensors in the folder
    ``out``: the names under ``prefix``, without it; shards of at most ``max_shard_bytes`` with their index when they
    do not fit one file. ``config.json`` comes from ``config`` (a file, or a folder holding one), else from the
    checkpoint's metadata. Returns the files written. One process, no process group.

    A PEFT model (LoRA) is rebuilt from the checkpoint's configs (:data:`PEFT_CONFIGS_KEY`): ``to="hf"`` writes it
    merged (``merge_and_unload``: each adapter added into its Linear, the copies ``modules_to_save`` trained in the
    modules' places), a folder ``from_pretrained`` loads as the base model's class; ``to="peft"`` writes PEFT's
    adapter folder (``save_pretrained``: ``adapter_model.safetensors``, ``adapter_config.json``), which
    ``PeftModel.from_pretrained`` loads onto the base model."""
    from safetensors.torch import save_file

    from meshlight.parallel.checkpoint import load_metadata, read_model_weights

    if to not in ("hf", "peft"):
        raise ValueError(f"to={to!r}: export writes 'hf' (Hugging Face's layout; a PEFT model merged) or 'peft' (a"
                         " PEFT model's adapter folder).")
    weights = read_model_weights(checkpoint)
    state = {name[len(prefix):]: tensor.contiguous() for name, tensor in weights.items() if name.startswith(prefix)}
    if not state:
        raise PretrainedWeightsError(f"{str(checkpoint)!r} holds no weights under prefix {prefix!r}; its names start"
                                     f" {sorted({n.split('.')[0] + '.' for n in weights})}.")
    metadata = load_metadata(checkpoint, weights_only=True)
    adapters = (metadata.get(PEFT_CONFIGS_KEY) or {}).get(prefix.rstrip("."))
    if adapters is not None:
        peft_model = rebuilt_peft_model(_peft_base_config(checkpoint, metadata, prefix, config), adapters, state)
        if to == "peft":
            # (the embedding saved where a LoRA adapts it, as PEFT's "auto" would, without its look-up on the Hub)
            embedding = any(hasattr(module, "lora_embedding_A") for module in peft_model.modules())
            peft_model.save_pretrained(str(out), save_embedding_layers=embedding)
            return sorted(path.name for path in Path(out).iterdir())
        state = _unshared(peft_model.merge_and_unload().state_dict())
    elif any(".base_layer." in name or ".modules_to_save." in name for name in state):
        raise PretrainedWeightsError(f"{str(checkpoint)!r} holds a PEFT model's weights under prefix {prefix!r}, but"
                                     " its metadata names no adapter configs (it was saved before meshlight kept"
                                     " them): resume it for one step and save again, or load it into the same"
                                     " LightningModule in one process (meshlight consolidate, then load_state_dict)"
                                     " and write it with PEFT's save_pretrained or merge_and_unload.")
    elif to == "peft":
        raise PretrainedWeightsError(f"{str(checkpoint)!r} holds no PEFT model under prefix {prefix!r} (its metadata"
                                     " names no adapters): --to peft writes a PEFT model's adapters; write this model"
                                     " with --to hf.")
    gpt = (metadata.get(GPT_CONFIGS_KEY) or {}).get(prefix.rstrip("."))
    if gpt is not None:  # meshlight's GPT, written as its Llama equivalent
        state, llama_text = _as_llama(state, gpt_config_from_dict(json.loads(gpt)))
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name in sorted(state):
        size = state[name].numel() * state[name].element_size()
        if shards[-1] and sum(t.numel() * t.element_size() for t in shards[-1].values()) + size > max_shard_bytes:
            shards.append({})
        shards[-1][name] = state[name]
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(files, shards):
        save_file(shard, str(target / file), metadata={"format": "pt"})
    written = list(files)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
        (target / _INDEX).write_text(json.dumps(index, indent=2))
        written.append(_INDEX)
    text = llama_text if gpt is not None and config is None else _config_text(metadata, prefix, config)
    if text is not None:
        (target / "config.json").write_text(text)
        written.append("config.json")
    return written


def _peft_base_config(checkpoint: PathLike, metadata: dict[str, Any], prefix: str, config: Optional[PathLike]) -> str:
    text = _config_text(metadata, prefix, config)
    if text is None:
        raise PretrainedWeightsError(f"{str(checkpoint)!r} holds a PEFT model under prefix {prefix!r} but no config of"
                                     " the model it adapts: pass --config (its config.json, or the folder holding it).")
    return text


def _unshared(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor in memory of its own (a head tied to the embedding copied), as safetensors wants."""
    seen: set[int] = set()
    unshared = {}
    for name, tensor in state.items():
        tensor = tensor.contiguous()
        unshared[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    return unshared


def _config_text(metadata: dict[str, Any], prefix: str, config: Optional[PathLike]) -> Optional[str]:
    if config is not None:
        given = Path(config)
        return (given / "config.json" if given.is_dir() else given).read_text()
    return (metadata.get(CONFIGS_KEY) or {}).get(prefix.rstrip("."))


def _as_llama(state: dict[str, torch.Tensor], config: GPTConfig) -> tuple[dict[str, torch.Tensor], str]:
    """A GPT's weights under Llama's names, q and k rows in Llama's rotary order, and Llama's ``config.json``."""
    try:
        text = llama_config_json(config)
    except LlamaLayoutError as error:
        raise PretrainedWeightsError(f"meshlight's GPT exports to Hugging Face as a Llama only: {error}") from None
    llama = {}
    for name, tensor in state.items():
        order = rotary_order(name, tensor.shape[0], config.head_dim)
        llama[llama_name(name) or name] = tensor if order is None else tensor[order].contiguous()
    if config.tie_embeddings:  # saved once, as save_pretrained does
        llama.pop("lm_head.weight", None)
    return llama, text
