"""Expert parallelism ("moe"): MoE experts split over ``ep`` ranks, everything data parallel."""

from __future__ import annotations

from typing import Any, Literal, Union

from meshlight.parallel.layout import data_sizes
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["MoEStrategy"]


class MoEStrategy(MeshStrategy):
    """Split the experts of every :class:`~meshlight.nn.MoE` layer (or a model's own stacked experts, as Hugging
    Face's Mixtral and Qwen3-MoE hold them: :func:`~meshlight.parallel.expert.stacked_experts`; or its list of experts,
    as litgpt's MoE holds them: :class:`~meshlight.parallel.expert.ListedExpertsParallel`) over ``ep`` ranks,
    exchanging tokens by all-to-all; dense weights are data parallel over all ranks, expert weights over the
    ``world / ep`` ranks holding the same experts.

    Args:
        ep: ranks the experts are split over; must divide ``num_experts`` and the data-parallel size.
            ``"auto"``: every process.
        zero: ZeRO stage for dense and expert weights alike (0 = DDP). Stage 3 works with experts
            (DeepSpeed refuses it; ColossalAI forces stage 1).
        **kwargs: passed to :class:`MeshStrategy`.
    """

    strategy_name = "moe"

    def __init__(self, ep: Union[int, Literal["auto"]] = "auto", *, zero: int = 1, **kwargs: Any) -> None:
        sizes = data_sizes("auto", zero)  # by name: LightningCLI reads the keywords a subclass passes on
        super().__init__(dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard"],
                         ep=1 if ep == "auto" else ep, zero=zero, **kwargs)
        self._auto_ep = ep == "auto"

    def set_world_ranks(self) -> None:
        if self._auto_ep:
            self._sizes["ep"] = self.num_nodes * self.num_processes
        super().set_world_ranks()
