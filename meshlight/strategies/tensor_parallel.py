"""Tensor parallelism with sequence parallelism ("tp"), data parallel over the rest of the world."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

from torch.distributed.tensor.parallel import ParallelStyle

from meshlight.parallel.layout import data_sizes
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(MeshStrategy):
    """Split every block's matmuls over ``tp`` ranks (DTensor), data parallel over the remaining ranks.

    Args:
        tp: tensor-parallel size; ``"auto"``: the processes of one node (tensor parallelism wants the
            fastest links). ``TensorParallelStrategy(tp=2)`` on 4 processes is dp=2 × tp=2.
        plan: module-name patterns → roles (``"colwise"``, ``"fused_colwise"`` — a fused q|k|v or gate|up whose
            parts sit one after another, split part by part —, ``"rowwise"``, ``"embedding"``, ``"head"``,
            ``"norm"``, ``"head_norm"``, ``"colwise_norm"`` — a norm over a colwise output's whole width, its
            statistics reduced over tp —, ``"latent"`` — a latent attention's down-projection or its norm —,
            ``"replicate"``) or PyTorch ``ParallelStyle`` objects, e.g.
            ``{"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise", …}``. Default: derived
            from the model's structure. If ``configure_model()`` parallelizes with ``self.device_mesh["tp"]``
            itself, no plan is applied.
        sequence_parallel: also split norms and dropout between blocks along the sequence.
        loss_parallel: in training, keep the LM head's logits sharded over the vocabulary; the cross-entropy
            runs on the shards (``F.cross_entropy`` works as usual). In eval mode logits are gathered.
        zero: ZeRO stage of the data-parallel dimension (0 = DDP).
        **kwargs: passed to :class:`MeshStrategy`.
    """

    strategy_name = "tp"

    def __init__(
        self,
        tp: Union[int, Literal["auto"]] = "auto",
        *,
        plan: Optional[Mapping[str, Union[str, ParallelStyle]]] = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        zero: int = 1,
        **kwargs: Any,
    ) -> None:
        sizes = data_sizes("auto", zero)  # by name: LightningCLI reads the keywords a subclass passes on
        super().__init__(dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard"],
                         tp=1 if tp == "auto" else tp, zero=zero, tp_plan=plan,
                         sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, **kwargs)
        self._auto_tp = tp == "auto"

    def set_world_ranks(self) -> None:
        if self._auto_tp:
            self._sizes["tp"] = self.num_processes
        super().set_world_ranks()
