"""Checksums of a checkpoint's files: recorded as each rank writes them, checked before anything is read.

Every rank records the CRC-32 (per block of 16 MiB) and size of the files it wrote — its DCP shards
(``__<rank>_<n>.distcp``), its random state (``rng-<rank>.pt``), on the first rank also ``meta.pt`` and DCP's
``.metadata`` — in ``checksums-<rank>.json``, before the folder is committed. DCP has no hook for this:
:func:`checksummed_writer` is DCP's own storage writer that, once this rank's shards are written, reads them back (from
the page cache) and records them. So the record is written inside DCP's save, before its coordinator finishes:
synchronous and background saves alike.

:func:`damaged_files` checks a share of the recorded files, so that the ranks of a resume split the reading. A
checkpoint without records (written by an older meshlight, or by DCP alone) is not checked."""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future

__all__ = ["CHECKSUMS_FILENAME", "checksummed_writer", "damaged_files", "record_checksums"]

CHECKSUMS_FILENAME = "checksums-{rank}.json"
_CHECKSUMS = re.compile(r"checksums-\d+\.json$")
_METADATA = ".metadata"
_BLOCK = 16 * 2**20


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def file_checksum(fs: Any, path: str) -> dict[str, Any]:
    """``{"crc32": [one per block of 16 MiB], "bytes": ...}`` of the file at ``path`` on ``fs``. The blocks are
    checksummed on as many threads as there are cores (zlib releases the GIL): a save's cost is its slowest file."""
    size = fs.size(path)

    def block_crc(start: int) -> int:
        with fs.open(path, "rb") as f:
            f.seek(start)
            return zlib.crc32(f.read(_BLOCK))

    starts = range(0, size, _BLOCK)
    if len(starts) <= 1:
        return {"crc32": [block_crc(0)] if size else [], "bytes": size}
    with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:
        return {"crc32": list(pool.map(block_crc, starts)), "bytes": size}


def record_checksums(path: str, names: Iterable[str], rank: int) -> None:
    """Add the checksums of the files ``names`` in checkpoint ``path`` to ``checksums-<rank>.json``."""
    fs, root = fsspec.core.url_to_fs(str(path))
    record = _join(root, CHECKSUMS_FILENAME.format(rank=rank))
    sums = json.loads(fs.cat_file(record)) if fs.exists(record) else {}
    sums.update({name: file_checksum(fs, _join(root, name)) for name in names if fs.exists(_join(root, name))})
    fs.pipe_file(record, json.dumps(sums, indent=0, sort_keys=True).encode())


def damaged_files(path: str, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Why files of checkpoint ``path`` differ from what their writers recorded, one line per file; ``share``
    ``(i, n)``: check only every ``n``-th recorded file from the ``i``-th (a rank's share of the reading)."""
    fs, root = fsspec.core.url_to_fs(str(path))
    recorded: dict[str, dict[str, int]] = {}
    for entry in fs.ls(root, detail=False):
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if _CHECKSUMS.match(name):
            try:
                recorded.update(json.loads(fs.cat_file(_join(root, name))))
            except (ValueError, OSError) as error:
                return [f"{_join(str(path), name)} (the checksums themselves) is unreadable: {error}"]
    index, count = share
    problems = []
    for name in sorted(recorded)[index::count]:
        file, expected = _join(root, name), recorded[name]
        if not fs.exists(file):
            problems.append(f"{_join(str(path), name)} is missing")
            continue
        found = file_checksum(fs, file)
        if found["bytes"] != expected["bytes"]:
            problems.append(f"{_join(str(path), name)} is truncated or grown ({found['bytes']:,} bytes, written with"
                            f" {expected['bytes']:,})")
        elif found["crc32"] != expected["crc32"]:
            problems.append(f"{_join(str(path), name)} is damaged (its CRC-32 differs from the one recorded when it"
                            " was written)")
    return problems


class _ChecksumRecording:
    """A DCP storage writer that records the checksums of what this rank wrote (see the module docstring)."""

    checkpoint: str
    written_beside: tuple[str, ...]  # files this rank wrote before DCP's (meta.pt, rng-<rank>.pt)

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()  # type: ignore[misc]
        names = {result.storage_data.relative_path for result in results}
        record_checksums(self.checkpoint, sorted(names) + list(self.written_beside), _global_rank())
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)  # type: ignore[misc]
        record_checksums(self.checkpoint, [_METADATA], _global_rank())


def checksummed_writer(path: str, written_beside: Iterable[str] = ()) -> Any:
    """DCP's storage writer for ``path`` (the local file system, or fsspec for URLs) recording checksums."""
    if "://" in str(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        base: type = FsspecWriter
    else:
        base = FileSystemWriter
    writer = _recording(base)(str(path))
    writer.checkpoint, writer.written_beside = str(path), tuple(written_beside)
    return writer


@functools.cache
def _recording(base: type) -> type:
    """``base`` (a DCP storage writer class) recording checksums."""
    return type(f"Checksummed{base.__name__}", (_ChecksumRecording, base), {})


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
