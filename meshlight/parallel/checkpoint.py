"""Sharded checkpoints that load under any layout: a folder of DCP shards plus the trainer's metadata.

Folder layout: DCP entries ``state_dict`` (the model, as in Lightning's ``ModelParallelStrategy``) and
``optimizer_0``, ``optimizer_1``, … (optimizer states and hyper-parameters keyed by parameter name, which
pipeline stages need), and ``meta.pt`` with everything else (loops, callbacks, LR schedulers,
hyper-parameters) written by one rank. Keys are fully qualified names, independent of how the model is
split, so DCP reshards on load: saved under ZeRO-3 on 4 processes, loaded under DDP on 2 or in one process.
"""

from __future__ import annotations

import pickle
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from meshlight.parallel.dtensors import from_blocks, has_dtensor_parameters, in_blocks
from meshlight.parallel.integrity import CHECKSUMS_FILENAME, checksummed_writer, damaged_files
from meshlight.parallel.random_state import from_weights_only_form, weights_only_form

__all__ = [
    "META_FILENAME",
    "OPTIMIZER_STATE",
    "AsyncCheckpointWriter",
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "check_complete",
    "check_intact",
    "checkpoint_keys",
    "consolidate",
    "is_complete",
    "load_checkpoint",
    "load_metadata",
    "load_model_weights",
    "read_model_weights",
    "load_rng_state",
    "save_checkpoint",
]

META_FILENAME = "meta.pt"
RNG_FILENAME = "rng-{rank}.pt"
INCOMPLETE_MARKER = ".incomplete"
MODEL_KEY = "state_dict"
# Optimizer state keyed by parameter name, hyper-parameters included ("param_groups.<name>.lr"): with the
# default positional groups, pipeline stages would save different "param_groups.0.params" under one key.
OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True)

PathLike = Union[str, Path]


class CheckpointError(RuntimeError):
    """The checkpoint is not whole: interrupted while being written, or a file of it is missing or unreadable."""


class CheckpointDamagedError(CheckpointError):
    """A file of the checkpoint differs from what its writer recorded (damaged, truncated or missing)."""


class CheckpointMismatchError(KeyError):
    """The checkpoint's names and the model's differ; the message lists both sides."""

    def __str__(self) -> str:  # KeyError would print the message quoted, with literal "\n"
        return str(self.args[0])


def save_checkpoint(
    path: PathLike,
    checkpoint: dict[str, Any],
    *,
    write_metadata: bool,
    rng_state: Optional[dict[str, Any]] = None,
    writer: Optional[AsyncCheckpointWriter] = None,
    checksums: bool = True,
) -> None:
    """Write a Lightning checkpoint dict: its ``state_dict`` and ``optimizer_states`` as DCP shards (every rank
    writes its own), the rest to ``meta.pt`` (only where ``write_metadata``), and ``rng_state`` (this rank's
    random generators) to ``rng-<rank>.pt``. Collective over the world.

    The folder is committed atomically: an ``.incomplete`` marker is written before anything else and removed
    only once every rank's shards and the metadata are written, so a checkpoint interrupted mid-save is never
    taken for a whole one (:func:`is_complete`, and loading it raises :class:`CheckpointError`). With a
    ``writer`` the shards are staged in memory and written in the background, and the folder is committed as soon
    as the write completes (:class:`AsyncCheckpointWriter`). ``checksums``: each rank records the checksums of the
    files it wrote, checked before a load reads them (:mod:`meshlight.parallel.integrity`).
    """
    checkpoint = dict(checkpoint)
    shards = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
    shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    shards = tree_map(in_blocks, shards)
    if writer is not None:
        writer.wait()  # one checkpoint in flight: staging memory stays bounded by one copy of the state
    fs, root = fsspec.core.url_to_fs(str(path))
    if write_metadata:
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(_join(root, INCOMPLETE_MARKER), b"")
        # Saving over an earlier checkpoint (Lightning's "last.ckpt"): drop its DCP metadata, shards and RNG states,
        # so none of them (those of a larger world among them) is read with the new ones.
        stale = [f for f in fs.ls(root, detail=False) if _is_earlier_save(f.rstrip("/").rsplit("/", 1)[-1])]
        if stale:
            fs.rm(stale)
    _barrier()  # no rank writes into the folder before it is marked incomplete
    if rng_state is not None:
        with fs.open(_join(root, RNG_FILENAME.format(rank=_rank())), "wb") as f:
            torch.save(weights_only_form(rng_state), f)  # loadable with weights_only=True: no code runs on resume
    if write_metadata:
        with fs.open(_join(root, META_FILENAME), "wb") as f:
            torch.save(checkpoint, f)

    def commit() -> None:
        if write_metadata:  # DCP's coordinator finishes only after every rank's shards are written
            fs.rm(_join(root, INCOMPLETE_MARKER))

    beside = ([RNG_FILENAME.format(rank=_rank())] if rng_state is not None else []) + (
        [META_FILENAME] if write_metadata else [])
    storage = checksummed_writer(str(path), beside) if checksums else _storage(path, write=True)
    if writer is None:
        dcp.save(shards, storage_writer=storage)
        commit()
        _barrier()
    else:
        writer.submit(shards, storage, commit)


class AsyncCheckpointWriter:
    """Writes checkpoints in the background with DCP's ``async_save`` — one at a time, on a process group of
    its own so that its collectives never interleave with training's — and commits each as soon as it is
    written. Create it on every rank."""

    def __init__(self) -> None:
        self._group: Optional[dist.ProcessGroup] = None
        self._pending: Optional[tuple[Any, threading.Event]] = None

    def submit(self, shards: dict[str, Any], storage: Any, commit: Any) -> None:
        """Write ``shards`` with DCP's storage writer ``storage`` in the background, then ``commit``."""
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        response = dcp.async_save(shards, storage_writer=storage, process_group=self._group,
                                  no_dist=not dist.is_initialized())
        future = getattr(response, "upload_completion", response)  # newer torch: staging, then upload
        committed = threading.Event()

        def finish(done: Any) -> None:
            try:
                if done.exception() is None:
                    commit()  # DCP's coordinator finishes only after every rank's shards are written
            finally:
                committed.set()

        future.add_done_callback(finish)
        self._pending = (future, committed)

    def wait(self) -> None:
        """Block until the checkpoint in flight is written and committed (no-op when none is); re-raises a
        failed write."""
        if self._pending is None:
            return
        future, committed = self._pending
        self._pending = None
        future.result()
        committed.wait()


def is_complete(path: PathLike) -> bool:
    """Whether ``path`` holds a whole checkpoint: DCP's metadata and ``meta.pt`` written, and no ``.incomplete``
    marker left by an interrupted save."""
    return _incompleteness(path) is None


def is_interrupted(path: PathLike) -> bool:
    """Whether ``path`` is a folder whose save was interrupted (it still has the ``.incomplete`` marker)."""
    fs, root = fsspec.core.url_to_fs(str(path))
    return fs.exists(_join(root, INCOMPLETE_MARKER))


def numbered_entries(folder: str, name: re.Pattern[str]) -> dict[int, str]:
    """The entries of ``folder`` (a path or URL; none when it does not exist) whose names match ``name``, by the
    number its first group captures: ``{number: folder/entry}``."""
    fs, root = fsspec.core.url_to_fs(folder)
    if not fs.isdir(root):
        return {}
    found = {}
    for entry in fs.ls(root, detail=False):
        match = name.match(str(entry).rstrip("/").rsplit("/", 1)[-1])
        if match:
            found[int(match.group(1))] = f"{folder.rstrip('/')}/{match.group(0)}"
    return found


def check_complete(path: PathLike) -> None:
    """Raise :class:`CheckpointError` naming what is missing when ``path`` is not a whole checkpoint."""
    problem = _incompleteness(path)
    if problem is not None:
        raise CheckpointError(problem)


def check_intact(path: PathLike, *, collective: bool = True) -> None:
    """Raise :class:`CheckpointDamagedError` naming the checkpoint and every file of it that differs from what its
    writer recorded. ``collective`` (under ``torch.distributed``): the ranks each check a share of the files."""
    collective = collective and dist.is_initialized()
    share = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)
    problems = damaged_files(str(path), share)
    if collective:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems)
        problems = sorted(problem for part in gathered for problem in part)
    if problems:
        raise CheckpointDamagedError(
            f"The checkpoint {str(path)!r} is damaged: {'; '.join(problems)}. Nothing was read from it; resume from an"
            " earlier checkpoint (meshlight's Trainer.fit(ckpt_path=\"last\") falls back to the newest intact one)."
        )


def _incompleteness(path: PathLike) -> Optional[str]:
    """Why ``path`` is not a whole checkpoint, or None when it is."""
    fs, root = fsspec.core.url_to_fs(str(path))
    if not fs.exists(root):
        return f"No checkpoint at {str(path)!r}: the path does not exist."
    if is_interrupted(path):
        return (f"The checkpoint {str(path)!r} is incomplete: its save was interrupted ({INCOMPLETE_MARKER} is still"
                " there). Resume from an earlier checkpoint (`ckpt_path=\"last\"` skips incomplete ones).")
    for name in (".metadata", META_FILENAME):
        if not fs.exists(_join(root, name)):
            return (f"{_join(str(path), name)!r} is missing: {str(path)!r} is not a whole meshlight checkpoint"
                    " (DCP's .metadata and meta.pt are written by every complete save).")
    return None


def load_rng_state(path: PathLike, *, weights_only: Optional[bool] = None) -> Optional[dict[str, Any]]:
    """This rank's random-generator states saved with the checkpoint, if it saved one for this rank.

    Read as tensors, numbers and tuples only (``weights_only``, unless it is ``False``): unpickling anything else can
    run code the file brings, so such a file is refused, naming it, unless the caller trusts it explicitly."""
    fs, root = fsspec.core.url_to_fs(str(path))
    name = _join(root, RNG_FILENAME.format(rank=_rank()))
    if not fs.exists(name):
        return None
    return from_weights_only_form(_load_data(name, weights_only))


def _load_data(name: str, weights_only: Optional[bool]) -> Any:
    """``torch.load`` of the file ``name`` (a path or URL) as data only unless ``weights_only`` is ``False``; a file
    whose unpickling would run code, or that is not a torch file at all, raises :class:`CheckpointError` naming it."""
    try:
        with fsspec.open(name, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=weights_only is not False)
    except pickle.UnpicklingError as error:
        if weights_only is not False and "Unsupported global" in str(error):
            raise CheckpointError(
                f"{name!r} holds objects that unpickling would have to run code for, and was not read"
                f" ({_first_line(error)}). meshlight writes checkpoints as tensors, numbers and strings only; a file"
                " written otherwise comes from elsewhere or from an older meshlight. If you trust it, resume with"
                " trainer.fit(..., weights_only=False), or allow its types with torch.serialization.add_safe_globals."
            ) from None
        raise CheckpointError(f"{name!r} cannot be read ({_first_line(error)}): the file is corrupted.") from error
    except (RuntimeError, EOFError) as error:
        raise CheckpointError(f"{name!r} cannot be read ({_first_line(error)}): the file is corrupted.") from error


def _first_line(error: BaseException) -> str:
    """The error's first line, without the terminal colours torch puts in some."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _read(state: dict[str, Any], path: PathLike, *, no_dist: bool = False) -> dict[str, Any]:
    """``dcp.load``: ``state`` as read (its tensors in place), a damaged shard reported as a :class:`CheckpointError`
    naming the checkpoint."""
    try:
        with warnings.catch_warnings():
            # DCP warns that it "assumes" one process even when told so (no_dist=True): here that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            readable = tree_map(in_blocks, state)
            dcp.load(readable, storage_reader=_storage(path), no_dist=no_dist)
            return tree_map(from_blocks, state, readable)
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        failures = getattr(error, "failures", None)  # rank -> the exception it raised
        rank, cause = next(iter(failures.items())) if failures else (_rank(), error)
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, its frames)
        short = _short_shards(path)
        which = ("; ".join(f"{name!r} is {problem}" for name, problem in short) if short
                 else "a shard file (*.distcp) is damaged")
        raise CheckpointError(
            f"The checkpoint {str(path)!r} cannot be read: {which}"
            f" (rank {rank}: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})."
            " Resume from another checkpoint; this one is left as it is."
        ) from error


def _short_shards(path: PathLike) -> list[tuple[str, str]]:
    """The shard files that are missing or shorter than DCP's metadata says they are: (file, what is wrong)."""
    try:
        stored = _storage(path).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - unreadable metadata: nothing more precise to say
        return []
    needed: dict[str, int] = {}
    for info in stored.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    fs, root = fsspec.core.url_to_fs(str(path))
    short = []
    for name, size in sorted(needed.items()):
        file = _join(root, name)
        if not fs.exists(file):
            short.append((_join(str(path), name), "missing"))
        elif (actual := fs.size(file)) < size:
            short.append((_join(str(path), name), f"truncated ({actual:,} of {size:,} bytes)"))
    return short


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _is_earlier_save(name: str) -> bool:
    return name.endswith((".distcp", ".metadata")) or any(
        name.startswith(prefix.split("{")[0]) and name.endswith(prefix.split("}")[1])
        for prefix in (RNG_FILENAME, CHECKSUMS_FILENAME))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
    check_complete(path)
    check_intact(path)
    keys = checkpoint_keys(path)
    model_state = get_model_state_dict(module)
    loadable = _check_names(expected_names or set(model_state), keys.get(MODEL_KEY, set()), strict, path)
    model_state = _select(model_state, loadable)
    model_state = _read({MODEL_KEY: model_state}, path)[MODEL_KEY]
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=False))
    for i, optimizer in enumerate(optimizers):
        name = f"optimizer_{i}"
        if name not in keys:
            raise CheckpointMismatchError(
                f"The checkpoint {str(path)!r} holds no state for optimizer {i}: it was saved with fewer optimizers"
                " or weights only. Load it with `trainer.validate/test` or a fresh `fit` instead of resuming."
            )
        with _without_empty_groups(optimizer):
            state = get_optimizer_state_dict(module, optimizer, options=OPTIMIZER_STATE)
            state = _read({name: state}, path)[name]
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=OPTIMIZER_STATE)
    return load_metadata(path, weights_only=weights_only)


@contextmanager
def _without_empty_groups(optimizer: Optimizer) -> Iterator[None]:
    """The optimizer without its parameter groups that hold no parameter (a pipeline stage holding none of a
    group's), which keep their hyperparameters as they are. torch's flattened optimizer state names a group's
    hyperparameters after its first parameter, and loading one without any fails with a bare IndexError."""
    groups = optimizer.param_groups
    if all(group["params"] for group in groups):
        yield
        return
    optimizer.param_groups = [group for group in groups if group["params"]]
    try:
        yield
    finally:  # loading the state replaced the groups that hold parameters: keep the new ones, in their places
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [next(loaded) if group["params"] else group for group in groups]


def load_metadata(path: PathLike, *, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The checkpoint's ``meta.pt``: Lightning's checkpoint dict without the model and optimizer states (the
    loops, ``global_step``, LR schedulers, callbacks' states).

    Read as tensors, numbers, strings and containers only (``weights_only``, unless it is ``False``), as torch reads
    any checkpoint by default: unpickling other objects can run code the file brings, so a ``meta.pt`` that needs it
    is refused, naming the file and how to read it if it is trusted."""
    return _load_data(_join(str(path), META_FILENAME), weights_only)


def load_model_weights(module: nn.Module, path: PathLike, *, strict: bool = True) -> None:
    """Load only the model weights of a checkpoint into ``module``, with or without a process group.

    ``module`` is the LightningModule (or whatever module was saved), plain or parallelized; the weights are
    resharded to it. Use it to evaluate or serve a model trained under any layout in a single process.
    """
    state = get_model_state_dict(module) if _is_distributed(module) else module.state_dict()
    state = _select(state, _check_names(set(state), checkpoint_keys(path).get(MODEL_KEY, set()), strict, path))
    state = _read({MODEL_KEY: state}, path, no_dist=not dist.is_initialized())[MODEL_KEY]
    if _is_distributed(module):
        set_model_state_dict(module, state, options=StateDictOptions(strict=False))
    else:
        module.load_state_dict(state, strict=False)


def consolidate(path: PathLike, out: PathLike, *, strip_prefix: str = "") -> dict[str, torch.Tensor]:
    """Write the model weights of a sharded checkpoint as one full state dict, for inference or export, in one
    process (no process group): ``out`` ending in ``.safetensors`` as safetensors, anything else with
    ``torch.save``. ``strip_prefix`` is removed from names that start with it (``"model."`` turns a
    LightningModule's names into its inner model's). Returns the state dict. (Hugging Face's layout, with its
    config: :func:`meshlight.parallel.pretrained.export_pretrained`.)"""
    state = read_model_weights(path)
    state = {(k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k): v for k, v in state.items()}
    if str(out).endswith(".safetensors"):
        try:
            from safetensors.torch import save
        except ImportError as error:
            raise ImportError("Writing .safetensors needs the safetensors package: pip install safetensors") from error
        with fsspec.open(str(out), "wb") as f:
            f.write(save({k: v.contiguous() for k, v in state.items()}))
    else:
        with fsspec.open(str(out), "wb") as f:
            torch.save(state, f)
    return state


def read_model_weights(path: PathLike) -> dict[str, torch.Tensor]:
    """The model weights of a sharded checkpoint (any layout), whole, by the names the LightningModule has them
    under; read in one process, no process group."""
    check_complete(path)
    check_intact(path, collective=False)
    stored = _storage(path).read_metadata().state_dict_metadata
    state = {key.partition(".")[2]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in stored.items() if key.startswith(MODEL_KEY + ".") and hasattr(meta, "size")}
    return _read({MODEL_KEY: state}, path, no_dist=True)[MODEL_KEY]


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
    return dist.is_initialized() and has_dtensor_parameters(module)


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
