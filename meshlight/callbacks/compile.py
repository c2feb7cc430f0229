"""Compile: ``torch.compile`` each transformer block, at its place in meshlight's transform order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn

from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.compile import CompilePolicy, apply_compile
from meshlight.parallel.transforms import PolicySource
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["Compile"]


class Compile(PolicySource, Callback):
    """Compile every repeated block of the model (the entries of its outermost ``ModuleList``) with
    ``torch.compile``, one block at a time, as torchtitan does: the blocks share their code, so one compilation
    serves them all and the rest of the step (embedding, head, loss, Lightning's loop) stays eager.

    Args:
        backend, mode, fullgraph, dynamic, options: ``torch.compile``'s arguments (``fullgraph=True`` turns a
            graph break inside a block into an error: a way to check a block compiles whole).
        module_types: instead of the repeated blocks, compile every module of these types.

    Under meshlight's strategies it is applied on every pipeline stage after tensor and expert parallelism and
    recomputation (``torch.utils.checkpoint`` is traced inside the compiled block), before data parallelism
    (DDP's and FSDP2's hooks run around the compiled ``forward``). Under ``MixedPrecision`` the modules kept
    fp32 (norms, routers) are FSDP units inside each block, which dynamo does not trace: the block compiles in
    pieces around them, recomputation then wraps the compiled pieces, and ``fullgraph=True`` is refused (use
    ``MixedPrecision(fp32_norms=False)``). Under other strategies it is applied to the
    LightningModule before training. Module and parameter names are unchanged, so checkpoints load with or
    without compilation. With dropout, the compiled code draws other random numbers than eager PyTorch does
    (set ``torch._inductor.config.fallback_random = True`` for the same ones).
    """

    def __init__(
        self,
        backend: Union[str, Any] = "inductor",
        mode: Optional[str] = None,
        fullgraph: bool = False,
        dynamic: Optional[bool] = None,
        options: Optional[dict[str, Any]] = None,
        module_types: Optional[Sequence[type[nn.Module]]] = None,
    ) -> None:
        arguments = dict(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic, options=options)
        self.policy = CompilePolicy(BlockSelection(1, tuple(module_types or ())), arguments)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, MeshStrategy):  # meshlight's collect the policy while parallelizing
            apply_compile(pl_module, self.policy)
