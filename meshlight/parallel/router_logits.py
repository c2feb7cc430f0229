"""A Hugging Face MoE model's own load-balancing loss (``config.output_router_logits=True``) where the engines split
what it is computed from — the router logits of every layer, for every token of the batch its forward is given — or
what it is added to: sequence and context parallelism hand each rank a share of the sequence
(:func:`gather_router_logits`), pipelining hands each stage some of the layers (:class:`CarriedRouterLogits`), loss
parallelism leaves the language-model loss a DTensor (:func:`plain_language_model_loss`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlight.nn.experts import scale_gradient
from meshlight.parallel.collectives import all_gather_along

__all__ = [
    "CarriedRouterLogits",
    "gather_router_logits",
    "plain_language_model_loss",
    "router_logits_collected",
    "routers",
]


def router_logits_collected(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) collects its routers' logits for a load-balancing loss of its own
    (Hugging Face's ``config.output_router_logits=True``)."""
    return any(getattr(getattr(m, "config", None), "output_router_logits", False) is True for m in module.modules())


def gather_router_logits(module: nn.Module, group: dist.ProcessGroup, *, replicated_loss: bool,
                         split: Callable[[], bool] = lambda: True) -> None:
    """Make the router logits a model's own MoE layers collect for its load-balancing loss (Hugging Face's
    ``output_router_logits``) cover the whole sequence where ``group``'s ranks each hold a share of it (sequence
    parallelism's tp ranks, the cp ranks): the loss is a product of means over the tokens, not a sum of shares. Each
    layer's logits are all-gathered along the sequence where the base model returns them, before the model computes
    the loss, so every rank of ``group`` computes the whole sequence's; the routing itself still runs on the share.
    Backward reduce-scatters their gradients: the sum of what every rank's copy of the loss gives its share, which is
    what the ranks' weighted losses need (cp: scaled by cp over the ranks, averaged with the data). Where every rank's
    loss is the same one (``replicated_loss``: the tp ranks'), that sum is divided by the group's size. ``split``:
    whether the sequence is split at this call (cp splits it inside its steps only)."""
    size = dist.get_world_size(group)
    scale = 1.0 / size if replicated_loss else 1.0

    def whole(output: Any, share: Tensor) -> Tensor:
        hidden = getattr(output, "last_hidden_state", None)
        batch = hidden.shape[0] if isinstance(hidden, Tensor) else 1
        tokens = share.reshape(batch, -1, share.shape[-1])  # the router's rows are [batch × share, experts]
        return all_gather_along(scale_gradient(tokens, scale), 1, group).reshape(-1, share.shape[-1])

    def hook(base: nn.Module, args: tuple, output: Any) -> None:
        logits = getattr(output, "router_logits", None)
        if logits and split():
            output.router_logits = tuple(whole(output, share) for share in logits)

    for model in _base_models(module):
        model.register_forward_hook(hook)


def plain_language_model_loss(module: nn.Module) -> None:
    """Under loss parallelism the cross-entropy of vocabulary-sharded logits is a replicated DTensor. Hugging Face's
    MoE models add their plain load-balancing loss to it inside their forward (given ``labels``, with
    ``output_router_logits``), which would hand that plain scalar a DTensor gradient their loss function's backward
    cannot take: their loss function returns the loss as a plain tensor instead. The logits stay sharded for it."""

    def plain(loss_function: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def whole(*args: Any, **kwargs: Any) -> Tensor:
            loss = loss_function(*args, **kwargs)
            # a copy: the model adds to it in place
            return loss.full_tensor().clone() if isinstance(loss, DTensor) else loss

        return whole

    for model in module.modules():
        if _can_return_router_logits(model) and hasattr(model, "loss_function"):
            model.loss_function = plain(model.loss_function)


def _base_models(module: nn.Module) -> list[nn.Module]:
    """The base models (each once) of the Hugging Face models in ``module`` that can return their routers' logits."""
    return list({id(m.base_model): m.base_model for m in module.modules() if _can_return_router_logits(m)}.values())


def _can_return_router_logits(module: nn.Module) -> bool:
    """A Hugging Face model whose base model can return its routers' logits."""
    config = getattr(module, "config", None)
    return hasattr(config, "output_router_logits") and isinstance(getattr(module, "base_model", None), nn.Module)


def routers(module: nn.Module) -> list[tuple[nn.Module, int]]:
    """The submodules whose outputs a Hugging Face model in ``module`` records as its router logits — those its base
    model's class names under ``_can_record_outputs["router_logits"]`` — each with the position of the logits in what
    it returns."""
    found: dict[int, tuple[nn.Module, int]] = {}
    for model in _base_models(module):
        specs = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
        for spec in specs if isinstance(specs, list) else [specs] if specs is not None else []:
            # as transformers reads them: a class or a class name's suffix, recorded at index 1 unless an
            # OutputRecorder says otherwise (with a layer name its module's dotted name must hold)
            target = getattr(spec, "target_class", spec if isinstance(spec, type) else None)
            suffix = getattr(spec, "class_name", spec if isinstance(spec, str) else None)
            layer, index = getattr(spec, "layer_name", None), getattr(spec, "index", 1)
            for name, sub in model.named_modules():
                dotted = f".{name}." if name else "."
                if ((target is not None and isinstance(sub, target) or suffix is not None and dotted[:-1].endswith(
                        suffix)) and (layer is None or f".{layer.strip('.')}." in dotted)):
                    found[id(sub)] = (sub, index)
    return list(found.values())


class CarriedRouterLogits:
    """Under pipelining, the router logits of the layers before a stage, carried down the pipeline beside the hidden
    state, so that the last stage's forward computes the load-balancing loss from every layer's, as one process does
    — for each microbatch, as each forward call is one. A stage before the last hands on what it received and what
    its own routers returned (:meth:`handed_on`); the last puts what it received before its own routers' logits where
    its base model returns them. Backward takes their gradients back to the stages that routed them.

    ``root``: the stage's view of the model root; ``blocks``: the names of its blocks there."""

    def __init__(self, root: nn.Module, blocks: Sequence[str]) -> None:
        self._received: tuple[Tensor, ...] = ()
        self._captured: Optional[list[Tensor]] = None  # a list while the stage runs
        mine = {id(m) for block in blocks for m in root.get_submodule(block).modules()}
        for router, index in routers(root):
            if id(router) in mine:
                router.register_forward_hook(functools.partial(self._capture, index))
        for base in _base_models(root):  # first: sequence parallelism's gather then covers what was received too
            base.register_forward_hook(self._prepend_received, prepend=True)

    @contextmanager
    def running(self, received: Sequence[Tensor]) -> Iterator[None]:
        """While the stage runs on its input, with the logits that came with it."""
        self._received, self._captured = tuple(received), []
        try:
            yield
        finally:
            self._received, self._captured = (), None

    def handed_on(self, hidden: Any) -> Any:
        """What a stage before the last returns: its hidden state, then the logits it received and its routers'
        (each a view: torch's stage returns tensors it made)."""
        carried = (*self._received, *(self._captured or ()))
        return (hidden, *(logits.view_as(logits) for logits in carried)) if carried else hidden

    def _capture(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if self._captured is not None:
            self._captured.append(output[index] if isinstance(output, tuple) else output)

    def _prepend_received(self, module: nn.Module, args: tuple, output: Any) -> None:
        logits = getattr(output, "router_logits", None)
        if self._received and logits is not None:
            output.router_logits = (*self._received, *logits)
