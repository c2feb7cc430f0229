"""Lightning strategies: thin presets of :class:`MeshStrategy` over the mechanisms in :mod:`meshlight.parallel`."""

from meshlight.strategies.context_parallel import ContextParallelStrategy
from meshlight.strategies.data_parallel import DDPStrategy, ZeroStrategy
from meshlight.strategies.expert_parallel import MoEStrategy
from meshlight.strategies.hybrid import Hybrid3DStrategy
from meshlight.strategies.mesh import MeshStrategy
from meshlight.strategies.pipeline import PipelineStrategy
from meshlight.strategies.registry import STRATEGY_NAMES, register_with_lightning, resolve_strategy
from meshlight.strategies.tensor_parallel import TensorParallelStrategy

__all__ = [
    "STRATEGY_NAMES",
    "ContextParallelStrategy",
    "DDPStrategy",
    "Hybrid3DStrategy",
    "MeshStrategy",
    "MoEStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "ZeroStrategy",
    "register_with_lightning",
    "resolve_strategy",
]
