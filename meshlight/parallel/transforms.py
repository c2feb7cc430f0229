"""Typed options for :func:`~meshlight.parallel.parallelize`: how tensor parallelism splits the model, and the
transforms (recomputation, mixed precision, offload, compilation, activation compression) that callbacks ask for as
policy values.

A callback that wants a transform is a :class:`PolicySource`; a strategy collects the sources' policies once,
by type (:meth:`Transforms.collect`), so neither side imports or probes the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch.distributed.tensor.parallel import ParallelStyle

from meshlight.parallel.activation_compression import ActivationCompressionPolicy
from meshlight.parallel.compile import CompilePolicy
from meshlight.parallel.offload import OffloadPolicy
from meshlight.parallel.precision import PrecisionPolicy
from meshlight.parallel.recompute import RecomputePolicy

__all__ = ["PolicySource", "TensorParallelOptions", "Transforms"]

Policy = Union[RecomputePolicy, PrecisionPolicy, OffloadPolicy, CompilePolicy, ActivationCompressionPolicy]


@dataclass(frozen=True)
class TensorParallelOptions:
    """How tensor parallelism splits the model (see :mod:`meshlight.parallel.tensor`).

    ``plan``: module-name patterns → roles, replacing the automatic plan; ``sequence_parallel``: norms and dropout
    between blocks run on shares of the sequence; ``loss_parallel``: vocabulary-sharded logits for the loss;
    ``keep_gathered_inputs``: backward keeps the sequence-gathered inputs of the first projections whole.
    """

    plan: Optional[Mapping[str, Union[str, ParallelStyle]]] = None
    sequence_parallel: bool = True
    loss_parallel: bool = True
    keep_gathered_inputs: bool = False

    def replace(self, **changes: Any) -> TensorParallelOptions:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Transforms:
    """The transforms applied after tensor and expert parallelism, each None when not asked for."""

    recompute: Optional[RecomputePolicy] = None
    precision: Optional[PrecisionPolicy] = None
    offload: Optional[OffloadPolicy] = None
    compile: Optional[CompilePolicy] = None
    activation_compression: Optional[ActivationCompressionPolicy] = None

    @classmethod
    def collect(cls, candidates: Iterable[object]) -> Transforms:
        """The policies of the :class:`PolicySource` among ``candidates`` (a Trainer's callbacks), by type. Two
        sources asking for the same transform are refused, naming both."""
        fields: dict[str, Policy] = {}
        owners: dict[str, PolicySource] = {}
        for source in candidates:
            if not isinstance(source, PolicySource):
                continue
            policy = source.policy
            name = _FIELD_OF[type(policy)]
            if name in owners:
                raise ValueError(f"{type(owners[name]).__name__} and {type(source).__name__} both ask for {name}:"
                                 " keep one of them.")
            fields[name], owners[name] = policy, source
        return cls(**fields)

    def replace(self, **changes: Any) -> Transforms:
        return dataclasses.replace(self, **changes)


class PolicySource:
    """A callback that asks meshlight's strategies for a transform: its ``policy`` (a
    :class:`RecomputePolicy`, :class:`PrecisionPolicy`, :class:`OffloadPolicy` or :class:`CompilePolicy`) is
    applied at its place in the transform order on every pipeline stage."""

    policy: Policy


_FIELD_OF: dict[type, str] = {RecomputePolicy: "recompute", PrecisionPolicy: "precision", OffloadPolicy: "offload",
                              CompilePolicy: "compile", ActivationCompressionPolicy: "activation_compression"}
