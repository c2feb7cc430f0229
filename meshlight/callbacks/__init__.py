"""Lightning callbacks."""

from meshlight.callbacks.expert_load import ExpertLoadMonitor, load_heatmap

__all__ = ["ExpertLoadMonitor", "load_heatmap"]
