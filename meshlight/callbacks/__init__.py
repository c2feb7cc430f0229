"""Lightning callbacks."""

from meshlight.callbacks.activation_checkpointing import ActivationCheckpointing
from meshlight.callbacks.activation_compression import ActivationCompression
from meshlight.callbacks.checkpoint import DistributedCheckpoint
from meshlight.callbacks.compile import Compile
from meshlight.callbacks.expert_load import ExpertLoadMonitor, load_heatmap
from meshlight.callbacks.mixed_precision import MixedPrecision, MixedPrecisionError
from meshlight.callbacks.monitor import ProfileSteps, TrainingMonitor
from meshlight.callbacks.offload import Offload, OffloadError
from meshlight.callbacks.pretrained import PretrainedWeights

__all__ = ["ActivationCheckpointing", "ActivationCompression", "Compile", "DistributedCheckpoint", "ExpertLoadMonitor",
           "MixedPrecision", "MixedPrecisionError", "Offload", "OffloadError", "PretrainedWeights", "ProfileSteps",
           "TrainingMonitor", "load_heatmap"]
