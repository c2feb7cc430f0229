"""Parallel-ready layers."""

from meshlight.nn.experts import GroupedExperts, Router, grouped_matmul
from meshlight.nn.moe import ExpertLoad, MoE, MoEConfig, MoEUpdates, attach_moe_updates

__all__ = [
    "ExpertLoad", "GroupedExperts", "MoE", "MoEConfig", "MoEUpdates", "Router", "attach_moe_updates", "grouped_matmul",
]
