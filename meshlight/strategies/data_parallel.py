"""Data-parallel strategies: DDP ("ddp") and ZeRO stages 1–3 ("zero1", "zero2", "zero3" / "fsdp")."""

from __future__ import annotations

from typing import Any, Optional

from meshlight.strategies.mesh import MeshStrategy

__all__ = ["DDPStrategy", "ZeroStrategy"]


class DDPStrategy(MeshStrategy):
    """Every rank holds the whole model; gradients are all-reduced in buckets during backward (PyTorch DDP).

    Args:
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view: as in
            ``torch.nn.parallel.DistributedDataParallel``, except that gradients are views into DDP's
            communication buckets by default: otherwise DDP keeps a second copy of every gradient (20 bytes of
            model state per fp32 Adam parameter instead of 16).
        **kwargs: passed to :class:`MeshStrategy` (process group backend, timeout, devices …).
    """

    strategy_name = "ddp"

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: Optional[float] = None,
        gradient_as_bucket_view: bool = True,
        **kwargs: Any,
    ) -> None:
        ddp_kwargs: dict[str, Any] = dict(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(dp_replicate="auto", zero=0, ddp_kwargs=ddp_kwargs, **kwargs)


class ZeroStrategy(MeshStrategy):
    """ZeRO data parallelism on FSDP2: shard optimizer state (stage 1), also gradients (2), also parameters (3).

    Args:
        stage: 1, 2 or 3. Stages 1 and 2 move the same bytes per step as DDP (stage 2 with k micro-batches of
            gradient accumulation reduce-scatters each: (1 + k)/2 × DDP's); stage 3 adds one all-gather of the
            parameters in backward. See :mod:`meshlight.parallel.data_parallel` for the exact mapping.
        dp_replicate: hybrid sharding — shard within groups of ``world/dp_replicate`` ranks and replicate
            across those groups (HSDP), to keep sharding traffic on fast links.
        **kwargs: passed to :class:`MeshStrategy`.
    """

    strategy_name = "zero"

    def __init__(self, stage: int = 3, *, dp_replicate: int = 1, **kwargs: Any) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(
                f"ZeroStrategy(stage={stage!r}): choose stage 1 (optimizer state), 2 (+ gradients) or"
                " 3 (+ parameters); for no sharding use DDPStrategy."
            )
        super().__init__(dp_replicate=dp_replicate, dp_shard="auto", zero=stage, **kwargs)
        self.stage = stage
