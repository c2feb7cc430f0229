"""The parallel mechanisms, one per file, as plain functions on (module, mesh); no Lightning imports."""

from meshlight.parallel.blocks import BlockSelection, repeated_blocks
from meshlight.parallel.checkpoint import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointMismatchError,
    checkpoint_keys,
    consolidate,
    is_complete,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from meshlight.parallel.clip import clip_grad_norm_, total_grad_norm
from meshlight.parallel.compression import GradientCompression
from meshlight.parallel.context import ContextParallel, ContextParallelError
from meshlight.parallel.data_parallel import apply_data_parallel, gradient_accumulation
from meshlight.parallel.expert import apply_expert_parallel
from meshlight.parallel.layout import MESH_AXES, ParallelLayout, build_device_mesh
from meshlight.parallel.optimizers import adapt_optimizer
from meshlight.parallel.parallelize import parallelize
from meshlight.parallel.recompute import apply_recompute
from meshlight.parallel.traffic import CollectiveTraffic, bytes_sent_per_rank

__all__ = [
    "MESH_AXES",
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CollectiveTraffic",
    "ContextParallel",
    "ContextParallelError",
    "GradientCompression",
    "ParallelLayout",
    "BlockSelection",
    "adapt_optimizer",
    "apply_data_parallel",
    "apply_expert_parallel",
    "apply_recompute",
    "build_device_mesh",
    "bytes_sent_per_rank",
    "checkpoint_keys",
    "clip_grad_norm_",
    "consolidate",
    "gradient_accumulation",
    "is_complete",
    "load_checkpoint",
    "load_model_weights",
    "parallelize",
    "repeated_blocks",
    "save_checkpoint",
    "total_grad_norm",
]
