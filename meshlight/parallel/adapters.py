"""Low-rank adapters (PEFT's LoRA) on a model's Linears, and the modules PEFT trains whole beside them, as
tensor parallelism and pipelining see them.

A LoRA layer holds the Linear it adapts (``base_layer``) beside ``lora_A`` and ``lora_B``, one Linear each per
adapter, and computes ``base(x) + B(A(dropout(x))) · scaling``. Tensor-parallel plans read a model's structure — its
Linears, their widths, who owns them — and an adapter's own Linears would read as a projection group of their own.
So plans are made on the model as it would be without its adapters (:func:`adapters_unwrapped`: each base Linear
where its adapter layer stands, under the same name), and the adapter layer takes the role its Linear got, split by
:class:`~meshlight.parallel.tensor_styles.LowRankColwise`, :class:`~meshlight.parallel.tensor_styles.LowRankRowwise`
or :class:`~meshlight.parallel.tensor_styles.LowRankFused`. A ``modules_to_save`` wrapper (a trainable copy of a
module beside the frozen original) reads as the copy it runs (:func:`saved_copy`), whose role splits both.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshlight.parallel.model_shape import linear_widths
from meshlight.parallel.parameter_adapters import adapts_parameter

__all__ = ["ADAPTED_ROLES", "adapted_linear", "adapter_configs", "adapter_layers", "adapters_unwrapped", "as_planned",
           "base_name", "check_splittable_adapter", "check_splittable_adapters", "initialize_adapters",
           "initialize_dora_magnitudes", "initialize_trained_tokens", "low_rank_update", "peft_base",
           "read_without_adapters", "rebuilt_peft_model", "saved_copy", "trained_tokens"]

F = TypeVar("F", bound=Callable[..., Any])


def adapted_linear(module: nn.Module) -> Optional[nn.Module]:
    """The Linear (``nn.Linear`` or Hugging Face's ``Conv1D``) that ``module`` adapts, where ``module`` is a LoRA
    layer holding one (PEFT's: ``base_layer`` beside the ``lora_A`` and ``lora_B`` of its adapters, adding
    ``B(A(x))`` to its output; not one adapting its weight in place, :func:`parameter_adapters`); else None."""
    base, down, up = (getattr(module, name, None) for name in ("base_layer", "lora_A", "lora_B"))
    if adapts_parameter(module):
        return None
    if isinstance(down, nn.ModuleDict) and isinstance(up, nn.ModuleDict) and len(down) and linear_widths(base):
        return base
    return None


def saved_copy(module: nn.Module) -> Optional[nn.Module]:
    """Where ``module`` is PEFT's ``modules_to_save`` wrapper (``ModulesToSaveWrapper``: a trainable copy of the
    module it wraps per adapter, in ``modules_to_save``, beside the frozen ``original_module``), the module its
    forward runs: the active adapter's copy, or the original where adapters are disabled; else None."""
    copies, original = module._modules.get("modules_to_save"), module._modules.get("original_module")
    if not isinstance(copies, nn.ModuleDict) or original is None:
        return None
    active = getattr(module, "active_adapters", None) or []
    return original if getattr(module, "disable_adapters", False) or not active or active[0] not in copies else (
        copies[active[0]])


def trained_tokens(module: nn.Module) -> Optional[nn.Module]:
    """Where ``module`` is PEFT's layer training some rows of a module (``TrainableTokensLayer``: the module as
    ``base_layer`` beside the rows trained, ``trainable_tokens_delta``; PEFT's trainable-tokens method, on the token
    embedding and an LM head tied to it), or the wrapper holding one (``token_adapter``: ``trainable_token_indices``
    beside LoRA), that layer; else None."""
    layer = module._modules.get("token_adapter", module)
    trained = layer._modules.get("trainable_tokens_delta")
    return layer if isinstance(trained, nn.ParameterDict) and "base_layer" in layer._modules else None


def adapter_layers(model: nn.Module) -> set[str]:
    """The names of ``model``'s LoRA layers (on Linears or on parameters), ``modules_to_save`` wrappers and layers
    training some rows of a module (:func:`trained_tokens`)."""
    return {name for name, module in model.named_modules()
            if as_planned(module) is not module or adapts_parameter(module)}


def base_name(name: str, layers: Collection[str]) -> Optional[str]:
    """A parameter's ``name`` in a model whose LoRA layers and ``modules_to_save`` wrappers are ``layers``
    (:func:`adapter_layers`), as the model without its adapters names it: the Linear a layer adapts under the layer's
    name (``q_proj.base_layer.weight``: ``q_proj.weight``), the parameters nested LoRA layers adapt in place under
    the outermost's (``experts.base_layer.base_layer.down_proj``: ``experts.down_proj``), and the module a wrapper
    holds, its original and its trainable copies alike (``lm_head.original_module.weight``,
    ``lm_head.modules_to_save.default.weight``: ``lm_head.weight``), and the module whose rows train
    (``embed_tokens.token_adapter.base_layer.weight``: ``embed_tokens.weight``); None for an adapter's own weight
    (``q_proj.lora_A.default.weight``, ``embed_tokens.token_adapter.trainable_tokens_delta.default``)."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:end]) in layers:
            if parts[end].startswith(("lora_", "trainable_tokens_")):
                return None
            held = {"base_layer": 1, "original_module": 1, "modules_to_save": 2, "token_adapter": 1}.get(parts[end], 0)
            parts = [*parts[:end], *parts[end + held:]]
    return ".".join(parts)


def peft_base(module: nn.Module, prefix: str) -> tuple[Optional[nn.Module], str]:
    """Where ``prefix`` names a PEFT model in ``module`` (``get_peft_model``'s), that model and the prefix of the
    model it adapts (``base_model.model.`` below it); else None and ``prefix``."""
    inner = module.get_submodule(prefix.rstrip(".")) if prefix else module
    if hasattr(inner, "peft_config") and hasattr(inner, "get_base_model"):
        return inner, f"{prefix}base_model.model."
    return None, prefix


def adapter_configs(module: nn.Module) -> Optional[str]:
    """Where ``module`` is a PEFT model, its adapters' configs as JSON (``{adapter: config}``, as ``peft_config``
    holds them), for a checkpoint's metadata (:func:`rebuilt_peft_model` reads them back); else None."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, Mapping) or not hasattr(module, "get_base_model"):
        return None
    return json.dumps({name: config.to_dict() for name, config in configs.items()}, default=sorted)  # (sets: lists)


def rebuilt_peft_model(model_config: str, adapters: str, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """The PEFT model a checkpoint holds, in one process: the Hugging Face model of ``model_config`` (its
    ``config.json``, built as its ``architectures`` names) adapted as ``adapters`` says (:func:`adapter_configs`),
    built on the meta device and given the tensors of ``state`` (its state dict, by the PEFT model's names) without
    a copy."""
    import peft
    import transformers

    settings = json.loads(model_config)
    config = transformers.AutoConfig.for_model(**settings)
    architecture = getattr(transformers, next(iter(settings.get("architectures") or ()), ""), None)
    with torch.device("meta"):
        model = (architecture._from_config(config) if architecture is not None else
                 transformers.AutoModelForCausalLM.from_config(config))
        (first, settings), *others = json.loads(adapters).items()
        peft_model = peft.get_peft_model(model, peft.PeftConfig.from_peft_type(**settings), adapter_name=first)
        for name, settings in others:
            peft_model.add_adapter(name, peft.PeftConfig.from_peft_type(**settings))
    peft_model.load_state_dict(state, assign=True)
    return peft_model


def initialize_adapters(peft_model: nn.Module) -> None:
    """Initialize every LoRA adapter of ``peft_model`` as PEFT does on creation (its config's ``init_lora_weights``:
    ``lora_A`` Kaiming-uniform or, ``"gaussian"``, normal with std 1/r; ``lora_B`` zeros): for a model allocated from
    the meta device, whose adapters hold nothing yet. Each rank draws the whole tensor from a generator seeded by the
    weight's name and keeps its part, so a weight split or replicated over ranks is one tensor. Initializations PEFT
    computes from the base weights (PiSSA, OLoRA, LoftQ …) are refused."""
    for layer_name, layer in peft_model.named_modules():
        if adapted_linear(layer) is None and not adapts_parameter(layer):
            continue
        for adapter, down in layer.lora_A.items():
            init = peft_model.peft_config[adapter].init_lora_weights
            if init not in (True, "gaussian"):
                raise ValueError(
                    f"{layer_name}'s adapter {adapter!r} has init_lora_weights={init!r}, which PEFT computes from the"
                    " base weights, but the model was built on the meta device: build it on a real device, or"
                    " initialize its adapters with init_lora_weights=True or 'gaussian'."
                )
            generator = torch.Generator().manual_seed(zlib.crc32(f"{layer_name}.lora_A.{adapter}".encode()))
            weight = down.weight
            if init is True:  # nn.Linear's own: Kaiming-uniform with a = √5, a bound of 1/√fan_in
                bound = 1 / math.sqrt(weight.shape[1])
                whole = torch.empty(weight.shape).uniform_(-bound, bound, generator=generator)
            else:
                whole = torch.empty(weight.shape).normal_(0, 1 / layer.r[adapter], generator=generator)
            _fill(weight, whole)
            for param in layer.lora_B[adapter].parameters():
                _fill(param, torch.zeros(param.shape))


def initialize_trained_tokens(peft_model: nn.Module, built_on_meta: bool) -> None:
    """Give each trainable-token layer of ``peft_model`` (:func:`trained_tokens`) the rows of its module's weight that
    its trained rows stand for, as PEFT copies them on creation (into ``trainable_tokens_delta`` and the originals
    kept beside): for a model whose weights were loaded after PEFT made its adapters, which copied the rows it held
    then. An adapter PEFT initializes at random (``init_weights=False``) keeps its rows, drawn again where the model
    was built on the meta device (normal, from a generator seeded by the adapter and its rows). A split weight is
    gathered once."""
    # (a head tied to the embedding shares its rows, and its weight: on a pipeline's last stage it stands for it)
    for layer in dict.fromkeys(layer for module in peft_model.modules()
                               if (layer := trained_tokens(module)) is not None):
        weight = layer.base_layer.weight
        whole = (weight.full_tensor() if isinstance(weight, DTensor) else weight).detach()
        for adapter, trained in layer.trainable_tokens_delta.items():
            rows = whole[torch.tensor(layer.token_indices[adapter], device=whole.device)]
            _fill(layer.trainable_tokens_original[adapter], rows)
            if getattr(peft_model.peft_config[adapter], "init_weights", True):
                _fill(trained, rows)
            elif built_on_meta:
                seed = f"trainable_tokens.{adapter}.{layer.token_indices[adapter]}"  # (a tied head's: its embedding's)
                generator = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
                _fill(trained, torch.empty(rows.shape).normal_(generator=generator).to(rows.dtype))


def initialize_dora_magnitudes(peft_model: nn.Module) -> None:
    """Give each DoRA adapter of ``peft_model`` the magnitude PEFT computes on creation (``lora_magnitude_vector``:
    the norm of each output's row of its Linear's weight with the adapter's update added), from the weights it holds
    now: for a model whose weights were loaded after PEFT made its adapters. Split weights are multiplied and normed
    as DTensors (each rank its part)."""
    for layer in peft_model.modules():
        if adapted_linear(layer) is None:
            continue
        for adapter, dora in getattr(layer, "lora_magnitude_vector", {}).items():
            with torch.no_grad():
                update = low_rank_update(layer.lora_A[adapter], layer.lora_B[adapter])
                norm = dora.get_weight_norm(layer.get_base_layer().weight, update, layer.scaling[adapter])
            _fill(dora.weight, norm.full_tensor() if isinstance(norm, DTensor) else norm)


def low_rank_update(lora_A: nn.Module, lora_B: nn.Module, adapter_name: Optional[str] = None) -> torch.Tensor:
    """DoRA's ``lora_B · lora_A`` as a product of the factors' weights, split or not (PEFT runs the factors on an
    identity matrix, which would be a plain tensor beside split ones): no collective where tensor parallelism
    splits them."""
    return lora_B.weight @ lora_A.weight


def _fill(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` into ``param``: this rank's part of it where ``param`` is a DTensor."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            part = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(part)
        else:
            param.copy_(whole)


@contextmanager
def adapters_unwrapped(model: nn.Module) -> Iterator[None]:
    """Within it, each LoRA layer of ``model`` is replaced by the Linear or the module it adapts, and each
    ``modules_to_save`` wrapper by the module it runs (:func:`saved_copy`), under the layer's name (and put back on
    leaving, whatever happened): the structure the tensor-parallel plan, the pipeline's split and the planner read.
    Nested use is a no-op inside."""
    swapped, within = [], ()
    for name, module in list(model.named_modules()):  # (parents first: a layer's own modules follow it)
        if name.startswith(within):  # inside a layer shown as what it adapts (nested layers: the outermost)
            continue
        if name and (base := as_planned(module)) is not module:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            parent._modules[attribute] = base  # (not setattr: its order among the parent's children is kept)
            swapped.append((parent, attribute, module))
            within = f"{name}."
    try:
        yield
    finally:
        for parent, attribute, module in reversed(swapped):
            parent._modules[attribute] = module


def as_planned(module: nn.Module) -> nn.Module:
    """What :func:`adapters_unwrapped` shows in ``module``'s place: the Linear a LoRA layer adapts, the module whose
    parameters LoRA layers adapt in place (stacked experts, mostly), the module a ``modules_to_save`` wrapper runs,
    the module some of whose rows PEFT trains (:func:`trained_tokens`); any other module itself."""
    if adapts_parameter(module):
        return module.get_base_layer()
    if (tokens := trained_tokens(module)) is not None:
        return tokens.base_layer
    base = adapted_linear(module)
    base = saved_copy(module) if base is None else base
    return module if base is None else base


def read_without_adapters(function: F) -> F:
    """``function(model, …)`` reading ``model`` as :func:`adapters_unwrapped` shows it."""

    @functools.wraps(function)
    def read(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with adapters_unwrapped(model):
            return function(model, *args, **kwargs)

    return read  # type: ignore[return-value]


#: the tensor-parallel roles of a Linear whose LoRA (or DoRA) adapters split with it, or stay whole beside it
#: (``replicate``, ``latent``: a Linear every rank holds whole, its adapters too, their gradients summed over tp alike)
ADAPTED_ROLES = ("colwise", "rowwise", "fused_colwise", "head", "replicate", "latent")


def check_splittable_adapters(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Refuse, before anything is split, each LoRA layer of ``model`` that tensor parallelism's ``plan`` (name → role
    or style) cannot split (:func:`check_splittable_adapter`), DoRA on an embedding, and rows trained (PEFT's
    ``trainable_token_indices``) of a module other than the token embedding and the LM head (roles ``embedding`` and
    ``head``)."""
    for name, module in model.named_modules():
        role = plan.get(name)
        role = role if role is None or isinstance(role, str) else type(role).__name__
        if role is not None and adapted_linear(module) is not None:
            check_splittable_adapter(name, module, role)
        embedded = plan.get(f"{name}.base_layer")  # (a LoRA embedding is planned as it is: its base_layer's role)
        if embedded is not None and getattr(module, "lora_embedding_A", None) and getattr(
                module, "lora_magnitude_vector", None):
            embedded = embedded if isinstance(embedded, str) else type(embedded).__name__
            raise NotImplementedError(
                f"{name} is DoRA on an embedding (PEFT's {type(module).__name__} with use_dora=True), which tensor"
                f" parallelism does not split (its role {embedded!r}): use plain LoRA on it (its adapters stay whole"
                " on every rank beside the split embedding), leave it out of the adapter's target_modules, or train"
                " with tp=1 (data, ZeRO or pipeline parallelism).")
        if role not in (None, "embedding", "head") and trained_tokens(module) is not None:
            raise NotImplementedError(
                f"{name} trains some of its rows (PEFT's trainable_token_indices), but tensor parallelism gives it the"
                f" role {role!r}, and puts trained rows into the token embedding and the LM head (roles 'embedding'"
                " and 'head') only: target the token embedding, or train with tp=1 (data, ZeRO or pipeline"
                " parallelism).")


def check_splittable_adapter(name: str, module: nn.Module, role: str) -> None:
    """Refuse, naming the way out, a LoRA layer tensor parallelism cannot split: one on a Linear whose role is not one
    of :data:`ADAPTED_ROLES` (``role`` names the style too where it is not that role's usual one: a latent
    attention's up-projection's), or one holding other weights beside its Linear's, its adapters' ``lora_A`` and
    ``lora_B`` and DoRA's magnitudes (``lora_magnitude_vector``), or running another adapter variant
    (``lora_variant``)."""
    extra = sorted({n.split(".")[0] for n, _ in module.named_parameters()} - {"base_layer", "lora_A", "lora_B"})
    variants = sorted(getattr(module, "lora_variant", None) or ())
    dora = extra == ["lora_magnitude_vector"] and all(
        type(module.lora_variant[v]).__name__ == "DoraLinearVariant" for v in variants)
    if role in ADAPTED_ROLES and (dora or not (extra or variants)):
        return
    why = (f"it holds {', '.join(extra)} beside its adapters' lora_A and lora_B, which tensor parallelism does not"
           " split" if extra and not dora else
           f"its adapter {variants[0]!r} is a LoRA variant ({type(module.lora_variant[variants[0]]).__name__}), which"
           " tensor parallelism does not split" if variants and not dora else
           f"tensor parallelism gives its Linear the role {role!r}, and splits the adapters of 'colwise', 'rowwise',"
           " 'fused_colwise' and 'head' Linears, or keeps them whole beside a 'replicate' or 'latent' one, only")
    raise NotImplementedError(
        f"{name} is a LoRA layer ({type(module).__name__}), but {why}. Leave that module out of the adapter's"
        " target_modules (the attention's and MLP's separate projections split), use plain LoRA or DoRA, or train it"
        " with tp=1 (data, ZeRO or pipeline parallelism)."
    )
