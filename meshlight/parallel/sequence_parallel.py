"""Sequence parallelism's borders: where the sequence is cut to this rank's share and gathered whole again.

Inside the region sequence parallelism covers, each tensor-parallel rank holds its share of the sequence between
blocks. Where the region is the blocks only (:func:`~meshlight.parallel.tensor_plan.sequence_region`), the first
block's input is cut to the share (:func:`cut_to_share`) and the last block's output gathered
(:func:`gather_sequence`), and the blocks run on a random stream of each rank's own (:func:`stream_of_own`). A later
pipeline stage reads the whole sequence's length from its input (:func:`sequence_share_input`), and every block takes a
share handed to it as a DTensor as the plain share (:func:`unwrap_share`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshlight.parallel.tensor_plan import TensorParallelError

__all__ = [
    "check_sequence_divisible", "cut_to_share", "gather_sequence", "sequence_share_input", "stream_of_own",
    "unwrap_share",
]


def sequence_share_input(stage: nn.Module, mesh: DeviceMesh) -> None:
    """Let a pipeline stage after the first read the whole sequence's length from its input under sequence
    parallelism.

    Stages hand on what flows between blocks, this rank's share of the sequence (1/tp of the bytes). The
    pipelined module's own forward still runs on every stage and may read lengths from its input (a rotary
    table cut to ``x.shape[1]``): given the share, it would cut it 1/tp long. The share is made a DTensor
    sharded over the sequence (dimension 1) on the 1-D ``mesh``, whose shape is the whole sequence's, and the
    stage's blocks get it back as the plain share that sequence parallelism passes between them
    (:func:`~meshlight.parallel.tensor.apply_tensor_parallel` has them unwrap such inputs)."""

    def whole_shape(module: nn.Module, args: tuple) -> Optional[tuple]:
        if args and isinstance(args[0], Tensor) and not isinstance(args[0], DTensor):
            return (DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False), *args[1:])
        return None

    stage.register_forward_pre_hook(whole_shape)


def unwrap_share(module: nn.Module, args: tuple) -> Optional[tuple]:
    """A block's forward pre-hook: a DTensor sharded over the sequence (a norm's output before the blocks, a later
    pipeline stage's input) becomes the plain share that sequence parallelism passes between blocks."""
    if args and isinstance(args[0], DTensor) and tuple(args[0].placements) == (Shard(1),):
        return (args[0].to_local(), *args[1:])
    return None


def check_sequence_divisible(tp: int):  # noqa: ANN202 - a forward pre-hook
    def hook(module: nn.Module, args: tuple) -> None:
        tokens = args[0] if args and isinstance(args[0], Tensor) else None
        if tokens is not None and tokens.dim() >= 2 and tokens.shape[1] % tp:
            raise TensorParallelError(
                f"Sequence length {tokens.shape[1]} is not divisible by tp={tp}: sequence parallelism splits the"
                " sequence over the tensor-parallel ranks. Pad sequences to a multiple of tp or pass"
                " sequence_parallel=False."
            )

    return hook


def cut_to_share(mesh: DeviceMesh):  # noqa: ANN202 - a forward pre-hook
    """The first block's whole ``[batch, sequence, ...]`` input (the same on every tp rank) → this rank's share;
    in backward the shares' gradients are gathered (the region before the blocks runs on the whole sequence)."""
    check = check_sequence_divisible(mesh.size())

    def hook(module: nn.Module, args: tuple) -> Optional[tuple]:
        whole = args[0] if args else None
        if not isinstance(whole, Tensor) or isinstance(whole, DTensor) or whole.dim() < 2:
            raise TensorParallelError(
                f"Under sequence parallelism the first block ({type(module).__name__}) must receive the hidden"
                " state [batch, sequence, ...] as its first argument, to cut it to this rank's share of the"
                f" sequence; it received {type(whole).__name__ if args else 'no positional argument'}. Pass the hidden"
                " state first, positionally, or pass"
                " sequence_parallel=False."
            )
        check(module, args)
        share = DTensor.from_local(whole, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return (share.to_local(), *args[1:])

    return hook


def stream_of_own(tp_rank: int) -> tuple[Any, Any]:
    """Forward pre- and post-hooks that run a block on a random stream of this tp rank's own, when sequence
    parallelism covers the blocks only: outside them the tp ranks hold the same activations and share a stream
    (dropout there must agree), inside them they hold different tokens (their masks must not repeat share after
    share). Each call draws a seed from the shared stream — the same draw on every tp rank, so the shared stream
    stays in step, and a checkpoint's saved random state resumes it exactly — and runs the block seeded from it
    and the tp rank; recomputation replays the block from the state it saw. The shared stream's state is put
    back after the block."""
    saved: list[tuple[Tensor, Optional[list[Tensor]]]] = []

    def enter(module: nn.Module, args: tuple) -> None:
        seed = (int(torch.randint(2**62, (1,)).item()) * 65_537 + tp_rank) % 2**63
        devices = torch.cuda.is_initialized()
        saved.append((torch.get_rng_state(), torch.cuda.get_rng_state_all() if devices else None))
        # the generators in use, not torch.manual_seed: on a host without CUDA that also queues a lazy seed for each
        # accelerator kind torch knows, formatting the stack each time (224 µs a call here, 1.4 µs for the CPU's)
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed_all(seed)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if not saved:  # a pre-hook before ``enter`` raised
            return
        host, devices = saved.pop()
        torch.set_rng_state(host)
        if devices is not None:
            torch.cuda.set_rng_state_all(devices)

    return enter, leave


def gather_sequence(mesh: DeviceMesh):  # noqa: ANN202 - a forward hook
    """The last block's output, this rank's share → the whole sequence, as the modules after the blocks expect."""

    def gather(share: Tensor) -> Tensor:
        return DTensor.from_local(share, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, Tensor):
            return gather(output)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):  # (OpenAI GPT's: a list)
            return type(output)([gather(output[0]), *output[1:]])
        raise TensorParallelError(
            f"Under sequence parallelism the last block ({type(module).__name__}) must return the hidden state (or a"
            f" tuple or list that starts with it), to gather it over the sequence; it returned {type(output).__name__}."
        )

    return hook
