"""Sharded checkpoints that load under any layout: a folder of DCP shards plus the trainer's metadata.

Folder layout: DCP entries ``state_dict`` (the model, as in Lightning's ``ModelParallelStrategy``) and
``optimizer_0``, ``optimizer_1``, … (optimizer states and hyper-parameters keyed by parameter name, which
pipeline stages need), and ``meta.pt`` with everything else (loops, callbacks, LR schedulers,
hyper-parameters) written by one rank. Keys are fully qualified names, independent of how the model is
split, so DCP reshards on load: saved under ZeRO-3 on 4 processes, loaded under DDP on 2 or in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = [
    "META_FILENAME",
    "OPTIMIZER_STATE",
    "CheckpointMismatchError",
    "checkpoint_keys",
    "load_checkpoint",
    "load_model_weights",
    "save_checkpoint",
]

META_FILENAME = "meta.pt"
MODEL_KEY = "state_dict"
# Optimizer state keyed by parameter name, hyper-parameters included ("param_groups.<name>.lr"): with the
# default positional groups, pipeline stages would save different "param_groups.0.params" under one key.
OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True)

PathLike = Union[str, Path]


class CheckpointMismatchError(KeyError):
    """The checkpoint's names and the model's differ; the message lists both sides."""

    def __str__(self) -> str:  # KeyError would print the message quoted, with literal "\n"
        return str(self.args[0])


def save_checkpoint(path: PathLike, checkpoint: dict[str, Any], *, write_metadata: bool) -> None:
    """Write a Lightning checkpoint dict: its ``state_dict`` and ``optimizer_states`` as DCP shards (every rank
    writes its own), the rest to ``meta.pt`` (only where ``write_metadata``). Collective over the world."""
    checkpoint = dict(checkpoint)
    shards = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
    shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(shards, storage_writer=_storage(path, write=True))
    if write_metadata:
        with fsspec.open(_join(path, META_FILENAME), "wb") as f:
            torch.save(checkpoint, f)


def load_checkpoint(
    path: PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: Optional[bool] = None,
    expected_names: Optional[set[str]] = None,
) -> dict[str, Any]:
    """Load model and optimizer states in place, resharding to the current layout; return the metadata.

    ``expected_names``: the whole model's state names, when this rank holds only part of them (a pipeline
    stage); the checkpoint is checked against those, and this rank loads the names it holds.

    Raises :class:`CheckpointMismatchError` listing missing and unexpected parameter names before any tensor
    is read, so every rank fails the same way and none waits in a collective.
    """
    keys = checkpoint_keys(path)
    model_state = get_model_state_dict(module)
    loadable = _check_names(expected_names or set(model_state), keys.get(MODEL_KEY, set()), strict, path)
    model_state = _select(model_state, loadable)
    dcp.load({MODEL_KEY: model_state}, storage_reader=_storage(path))
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=False))
    for i, optimizer in enumerate(optimizers):
        name = f"optimizer_{i}"
        if name not in keys:
            raise CheckpointMismatchError(
                f"The checkpoint {str(path)!r} holds no state for optimizer {i}: it was saved with fewer optimizers"
                " or weights only. Load it with `trainer.validate/test` or a fresh `fit` instead of resuming."
            )
        state = get_optimizer_state_dict(module, optimizer, options=OPTIMIZER_STATE)
        dcp.load({name: state}, storage_reader=_storage(path))
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=OPTIMIZER_STATE)
    with fsspec.open(_join(path, META_FILENAME), "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=bool(weights_only))


def load_model_weights(module: nn.Module, path: PathLike, *, strict: bool = True) -> None:
    """Load only the model weights of a checkpoint into ``module``, with or without a process group.

    ``module`` is the LightningModule (or whatever module was saved), plain or parallelized; the weights are
    resharded to it. Use it to evaluate or serve a model trained under any layout in a single process.
    """
    state = get_model_state_dict(module) if _is_distributed(module) else module.state_dict()
    state = _select(state, _check_names(set(state), checkpoint_keys(path).get(MODEL_KEY, set()), strict, path))
    dcp.load({MODEL_KEY: state}, storage_reader=_storage(path), no_dist=not dist.is_initialized())
    if _is_distributed(module):
        set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    else:
        module.load_state_dict(state, strict=False)


def checkpoint_keys(path: PathLike) -> dict[str, set[str]]:
    """The names stored in a checkpoint, by top-level entry: ``{"state_dict": {param names}, "optimizer_0": …}``."""
    metadata = _storage(path).read_metadata()
    keys: dict[str, set[str]] = {}
    for flat_key in metadata.state_dict_metadata:
        entry, _, rest = flat_key.partition(".")
        keys.setdefault(entry, set()).add(rest)
    return keys


def _check_names(expected: set[str], stored: set[str], strict: bool, path: PathLike) -> set[str]:
    """The names to load; raises if strict and the module's names and the checkpoint's differ."""
    missing, unexpected = sorted(expected - stored), sorted(stored - expected)
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"The checkpoint {str(path)!r} does not match the model's parameter names."
            f"\n  missing from the checkpoint ({len(missing)}): {_shorten(missing)}"
            f"\n  unexpected in the checkpoint ({len(unexpected)}): {_shorten(unexpected)}"
            "\nLoad it into the model it was saved from, or set `strict_loading = False` on the LightningModule"
            " to load only the names both have."
        )
    return expected & stored


def _select(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {name: value for name, value in state.items() if name in names}


def _shorten(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … and {len(names) - limit} more" if len(names) > limit else "") if names else "none"


def _is_distributed(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return dist.is_initialized() and any(isinstance(p, DTensor) for p in module.parameters())


def _is_url(path: PathLike) -> bool:
    return "://" in str(path)


def _join(path: PathLike, name: str) -> str:
    return f"{str(path).rstrip('/')}/{name}" if _is_url(path) else str(Path(path) / name)


def _storage(path: PathLike, write: bool = False) -> Any:
    """A DCP reader or writer: the local file system, or fsspec for URLs (``s3://``, ``memory://``, …)."""
    if _is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        return FsspecWriter(str(path)) if write else FsspecReader(str(path))
    return dcp.FileSystemWriter(str(path)) if write else dcp.FileSystemReader(str(path))
