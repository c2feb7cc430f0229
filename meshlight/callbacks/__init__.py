"""Lightning callbacks."""

from meshlight.callbacks.checkpoint import DistributedCheckpoint
from meshlight.callbacks.expert_load import ExpertLoadMonitor, load_heatmap

__all__ = ["DistributedCheckpoint", "ExpertLoadMonitor", "load_heatmap"]
