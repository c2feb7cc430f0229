"""Optimizer state on disk (meshlight/parallel/nvme.py), on plain torch optimizers: the chunked step is the
optimizer's own, bit for bit; the state waits in files between steps; checkpoints hold the whole state; a disk that
cannot hold it is refused. Under the Offload callback and a Trainer: tests/callbacks/test_offload.py."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshlight.parallel.nvme import OptimizerStateOnDisk, check_disk, state_bytes_estimate


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def train(module: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 5, scheduler: bool = False) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step)) if scheduler else None
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=generator)

        def closure(x=x):
            optimizer.zero_grad()
            loss = module(x).square().mean()
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure)))
        if lr is not None:
            lr.step()
    return losses


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-2),
    lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
], ids=["adamw", "adamw-fused", "sgd-momentum"])
def test_the_chunked_step_is_the_optimizers_own_bit_for_bit(tmp_path, make):
    plain_model, disk_model = model(), model()
    plain, on_disk = make(plain_model.parameters()), make(disk_model.parameters())
    # chunks of ~2 kB: every Linear's state is a chunk of its own or shares one
    swapped = OptimizerStateOnDisk(on_disk, tmp_path / "state", chunk_bytes=2048)
    assert len(swapped.chunks) > 2
    assert train(plain_model, plain, scheduler=True) == train(disk_model, on_disk, scheduler=True)
    for a, b in zip(plain_model.parameters(), disk_model.parameters()):
        assert torch.equal(a, b)
    assert swapped.written_bytes > 0 and swapped.read_bytes > 0
    swapped.close()
    assert not (tmp_path / "state").exists()


def test_between_steps_the_state_waits_in_files_and_a_state_dict_holds_all_of_it(tmp_path):
    module = model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    swapped = OptimizerStateOnDisk(optimizer, tmp_path, chunk_bytes=4096)
    train(module, optimizer, steps=2)
    kept = sum(v.numel() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    assert kept == len(optimizer.state)  # only Adam's step counts
    swapped.wait()  # the last chunk is written behind the step, on the I/O thread
    files = sum(f.stat().st_size for f in tmp_path.glob("chunk-*.bin"))
    assert files >= state_bytes_estimate(optimizer)
    state = optimizer.state_dict()
    moments = {key: v for entry in state["state"].values() for key, v in entry.items() if key != "step"}
    assert all(v.numel() > 1 for v in moments.values())
    kept_after = sum(v.numel() for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v))
    assert kept_after == kept  # let go again once the state dict is made
    swapped.close()


def test_a_loaded_state_dict_continues_exactly(tmp_path):
    module = model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    train(module, optimizer, steps=3)
    saved_model, saved_state = copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict())
    expected = train(module, optimizer, steps=3)

    resumed = model()
    resumed.load_state_dict(saved_model)
    on_disk = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    swapped = OptimizerStateOnDisk(on_disk, tmp_path, chunk_bytes=2048)
    on_disk.load_state_dict(saved_state)
    assert all(v.numel() <= 1 for entry in on_disk.state.values() for v in entry.values())  # written to the files
    assert train(resumed, on_disk, steps=3) == expected
    swapped.close()


def test_a_disk_that_cannot_hold_the_state_is_refused_before_training(tmp_path):
    check_disk(tmp_path, needed=10)  # fine
    with pytest.raises(ValueError, match=r"0.50 GiB free, and the optimizer state needs 1.00 GiB on this disk; free"
                                         " space there or pass a path on a larger disk"):
        check_disk(tmp_path, needed=2**30, usage=lambda path: SimpleNamespace(free=2**29))
    with pytest.raises(ValueError, match="the folder does not exist; create it on a local disk"):
        check_disk(tmp_path / "missing", needed=0)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot write there \(Not a directory\); pass a folder this process may"):
        check_disk(not_a_folder, needed=0)
