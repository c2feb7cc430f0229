"""Parallel-ready layers."""

from meshlight.nn.moe import ExpertLoad, GroupedExperts, MoE, MoEConfig, Router, grouped_matmul

__all__ = ["ExpertLoad", "GroupedExperts", "MoE", "MoEConfig", "Router", "grouped_matmul"]
