"""Checkpoint integrity (meshlight/parallel/integrity.py): every file a save writes is recorded with its checksum;
a damaged, truncated or missing file is named, with the checkpoint, before anything is read; ``ckpt_path="last"``
falls back to the newest intact checkpoint, warning which one was damaged."""

import json
from pathlib import Path

import pytest
import torch

from meshlight.parallel import CheckpointError, save_checkpoint
from meshlight.parallel.checkpoint import check_intact, load_metadata, read_model_weights
from meshlight.parallel.integrity import damaged_files


def _save(path: Path, *, checksums: bool = True) -> None:
    torch.manual_seed(0)
    state = {"model.weight": torch.randn(64, 32), "model.bias": torch.randn(64)}
    save_checkpoint(path, {"state_dict": state, "global_step": 3}, write_metadata=True,
                    rng_state={"torch": torch.get_rng_state()}, checksums=checksums)


def _flip_two_bytes(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    data[at + 1] ^= 0x0F
    file.write_bytes(bytes(data))


def test_every_file_a_save_writes_is_recorded(tmp_path):
    _save(tmp_path / "ckpt")
    recorded = json.loads((tmp_path / "ckpt" / "checksums-0.json").read_text())
    written = {p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith("checksums-")}
    assert set(recorded) == written == {"__0_0.distcp", ".metadata", "meta.pt", "rng-0.pt"}
    assert all(entry["bytes"] == (tmp_path / "ckpt" / name).stat().st_size for name, entry in recorded.items())
    assert damaged_files(str(tmp_path / "ckpt")) == []


@pytest.mark.parametrize("name", ["__0_0.distcp", "meta.pt", "rng-0.pt"])
def test_two_flipped_bytes_are_named_with_the_checkpoint_before_anything_is_read(tmp_path, name):
    _save(tmp_path / "ckpt")
    file = tmp_path / "ckpt" / name
    _flip_two_bytes(file, at=file.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=rf"The checkpoint '{tmp_path / 'ckpt'}' is damaged: {file} is damaged"
                                              r" \(its CRC-32 differs"):
        check_intact(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=f"{file} is damaged"):
        read_model_weights(tmp_path / "ckpt")


def test_a_truncated_or_missing_file_is_named(tmp_path):
    _save(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is truncated or grown \(100 bytes, written with"):
        check_intact(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "rng-0.pt").unlink()
    assert any("rng-0.pt is missing" in problem for problem in damaged_files(str(tmp_path / "ckpt")))


def test_ranks_check_disjoint_shares_that_cover_every_file(tmp_path):
    _save(tmp_path / "ckpt")
    for name in ("__0_0.distcp", "meta.pt", "rng-0.pt", ".metadata"):
        _flip_two_bytes(tmp_path / "ckpt" / name, at=8)
    shares = [damaged_files(str(tmp_path / "ckpt"), (rank, 3)) for rank in range(3)]
    assert sorted(p for share in shares for p in share) == sorted(damaged_files(str(tmp_path / "ckpt")))
    assert len(damaged_files(str(tmp_path / "ckpt"))) == 4


def test_a_checkpoint_without_records_is_not_checked(tmp_path):
    _save(tmp_path / "ckpt", checksums=False)
    assert not list((tmp_path / "ckpt").glob("checksums-*.json"))
    check_intact(tmp_path / "ckpt")
    assert load_metadata(tmp_path / "ckpt")["global_step"] == 3


# ---------------------------------------------------------------- resume under a Trainer


def _fit(tmp_path, max_steps, ckpt_path=None) -> list[int]:
    """The steps this fit trained (from the checkpoint it resumed from)."""
    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint
    from tests.callbacks.test_checkpoint import _data
    from tests.callbacks.workers.resume_worker import Losses, model

    checkpoint = DistributedCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, keep_last_k=3, async_save=False)
    losses = Losses()
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path, callbacks=[checkpoint, losses])
    trainer.fit(model(0), _data(), ckpt_path=ckpt_path)
    return sorted(losses.losses)


def test_resuming_from_last_skips_a_damaged_checkpoint_with_a_warning_and_an_explicit_path_fails(tmp_path):
    _fit(tmp_path, max_steps=6)
    newest = tmp_path / "ckpt" / "step=000000006"
    shard = sorted(newest.glob("*.distcp"))[0]
    _flip_two_bytes(shard, at=shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"The checkpoint '{newest}' is damaged: {shard} is damaged"):
        _fit(tmp_path, max_steps=8, ckpt_path=str(newest))
    with pytest.warns(UserWarning, match=rf"{shard} is damaged .* Resuming from {tmp_path / 'ckpt'}/step=000000004"
                                         " instead"):
        trained = _fit(tmp_path, max_steps=8, ckpt_path="last")
    assert trained == [5, 6, 7, 8]  # resumed from step 4: not from scratch, not from the damaged step 6


def test_a_background_save_records_its_files_too(tmp_path):
    from tests.callbacks.test_checkpoint import _fit as fit_with_checkpoints

    fit_with_checkpoints(tmp_path, tmp_path / "ckpt", max_steps=2, async_save=True)
    folder = tmp_path / "ckpt" / "step=000000002"
    recorded = json.loads((folder / "checksums-0.json").read_text())
    assert {".metadata", "meta.pt", "rng-0.pt"} < set(recorded) and any(n.endswith(".distcp") for n in recorded)
    assert damaged_files(str(folder)) == []
