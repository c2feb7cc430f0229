"""meshlight: train a LightningModule on one accelerator or thousands by changing ``Trainer(strategy=...)``."""

from meshlight import demos, models, parallel, strategies
from meshlight.parallel import ParallelLayout
from meshlight.strategies import (
    DDPStrategy,
    MeshStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroStrategy,
    register_with_lightning,
)
from meshlight.trainer import Trainer

register_with_lightning()

__version__ = "0.1.0"
__all__ = [
    "DDPStrategy",
    "MeshStrategy",
    "ParallelLayout",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "Trainer",
    "ZeroStrategy",
    "demos",
    "models",
    "parallel",
    "strategies",
]
