"""Strategy names: ``meshlight.Trainer`` resolves all of them; Lightning's registry gets the ones it lacks.

``meshlight.Trainer(strategy="ddp")`` is meshlight's DDP; ``lightning.Trainer(strategy="ddp")`` stays
Lightning's, while ``lightning.Trainer(strategy="zero3")`` finds meshlight's once meshlight is imported.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from meshlight.strategies.context_parallel import ContextParallelStrategy
from meshlight.strategies.data_parallel import DDPStrategy, ZeroStrategy
from meshlight.strategies.expert_parallel import MoEStrategy
from meshlight.strategies.hybrid import Hybrid3DStrategy
from meshlight.strategies.pipeline import PipelineStrategy
from meshlight.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["STRATEGY_NAMES", "register_with_lightning", "resolve_strategy"]


class _Entry(NamedTuple):
    cls: type[Strategy]
    init: dict[str, Any]
    description: str


_ENTRIES: dict[str, _Entry] = {
    "ddp": _Entry(DDPStrategy, {}, "meshlight DDP: replicated model, bucketed gradient all-reduce"),
    "zero1": _Entry(ZeroStrategy, {"stage": 1}, "meshlight ZeRO-1: optimizer state sharded (FSDP2)"),
    "zero2": _Entry(ZeroStrategy, {"stage": 2}, "meshlight ZeRO-2: optimizer state and gradients sharded (FSDP2)"),
    "zero3": _Entry(ZeroStrategy, {"stage": 3}, "meshlight ZeRO-3: parameters, gradients, optimizer state sharded"),
    "fsdp": _Entry(ZeroStrategy, {"stage": 3}, "meshlight ZeRO-3 (FSDP2)"),
    "tp": _Entry(TensorParallelStrategy, {}, "meshlight tensor + sequence parallel within a node, ZeRO-1 across"),
    "pipeline": _Entry(PipelineStrategy, {}, "meshlight pipeline parallel over every process, 1F1B schedule"),
    "moe": _Entry(MoEStrategy, {}, "meshlight expert parallel: MoE experts split over every process, ZeRO-1"),
    "cp": _Entry(ContextParallelStrategy, {}, "meshlight context parallel: each sequence split over every process"),
    "3d": _Entry(Hybrid3DStrategy, {}, "meshlight pipeline × tensor × expert × data parallel on one mesh"),
}

STRATEGY_NAMES: tuple[str, ...] = tuple(_ENTRIES)


def resolve_strategy(strategy: Union[str, Strategy], **options: Any) -> Union[str, Strategy]:
    """A meshlight strategy instance for a meshlight name, with ``options`` for its class (``grad_compression=…``);
    anything else is returned for Lightning to resolve."""
    if isinstance(strategy, str) and strategy.lower() in _ENTRIES:
        entry = _ENTRIES[strategy.lower()]
        return entry.cls(**entry.init, **options)
    if options:
        raise ValueError(f"strategy={strategy!r} is not one of meshlight's ({', '.join(_ENTRIES)}): its options"
                         f" {sorted(options)} cannot be given by name; pass a strategy instance.")
    return strategy


def register_with_lightning() -> None:
    """Add the names Lightning does not define to its ``StrategyRegistry`` (idempotent)."""
    for name, entry in _ENTRIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, entry.cls, description=entry.description, **entry.init)
