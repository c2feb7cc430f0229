"""meshlight: train a LightningModule on one accelerator or thousands by changing ``Trainer(strategy=...)``."""

from meshlight import callbacks, demos, models, nn, parallel, strategies
from meshlight.parallel import GradientCompression, ParallelLayout
from meshlight.strategies import (
    ContextParallelStrategy,
    DDPStrategy,
    Hybrid3DStrategy,
    MeshStrategy,
    MoEStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroStrategy,
    register_with_lightning,
)
from meshlight.trainer import Trainer

register_with_lightning()

__version__ = "0.1.0"
__all__ = [
    "ContextParallelStrategy",
    "DDPStrategy",
    "GradientCompression",
    "Hybrid3DStrategy",
    "MeshStrategy",
    "MoEStrategy",
    "ParallelLayout",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "Trainer",
    "ZeroStrategy",
    "callbacks",
    "demos",
    "models",
    "nn",
    "parallel",
    "strategies",
]
