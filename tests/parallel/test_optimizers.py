"""The Adafactor adapter computes exactly torch's update on plain tensors and keeps LR schedulers attached
(its exactness on sharded parameters is in the ZeRO parity tests)."""

import pytest
import torch

from meshlight.parallel import adapt_optimizer
from meshlight.parallel.optimizers import ShardedAdafactor


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]


def test_adapted_adafactor_equals_torch_bitwise_under_an_lr_scheduler():
    reference, adapted = _params(), _params()
    torch_opt = torch.optim.Adafactor(reference, lr=0.05, weight_decay=0.1)
    opt = torch.optim.Adafactor(adapted, lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    torch_scheduler = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: 1.0 / (step + 1))
    assert adapt_optimizer(opt) is opt and isinstance(opt, ShardedAdafactor)
    for _ in range(4):
        for p, q in zip(reference, adapted):
            q.grad = torch.randn_like(p)
            p.grad = q.grad.clone()
        torch_opt.step(), opt.step()
        torch_scheduler.step(), scheduler.step()
    for p, q in zip(reference, adapted):
        assert torch.equal(p, q)


def test_other_optimizers_are_left_alone():
    opt = torch.optim.AdamW(_params(), foreach=True)
    assert type(adapt_optimizer(opt)) is torch.optim.AdamW
    assert opt.param_groups[0]["foreach"] is True  # only groups mixing DTensors and plain tensors lose it


def _mixed(foreach=None, fused=None, kind=torch.optim.AdamW):
    """A group mixing a (replicated, one-rank) DTensor and a plain tensor, adapted; and the same values as two
    groups of one kind each, stepped by torch alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    values = [torch.randn(4, 4), torch.randn(4), torch.randn(3)]
    sharded = torch.nn.Parameter(distribute_tensor(values[0], mesh, [Replicate()]))
    plain = [torch.nn.Parameter(v.clone()) for v in values[1:]]
    flags = {"foreach": foreach} if kind is torch.optim.SGD else {"foreach": foreach, "fused": fused}
    opt = adapt_optimizer(kind([plain[0], sharded, plain[1]], lr=0.1, **flags))
    apart = [torch.nn.Parameter(distribute_tensor(values[0], mesh, [Replicate()]))] + [
        torch.nn.Parameter(v.clone()) for v in values[1:]]
    reference = kind([{"params": apart[:1]}, {"params": apart[1:]}], lr=0.1, **flags)
    return opt, [sharded, *plain], reference, apart


@pytest.mark.parametrize(("kind", "flags"), [
    (torch.optim.AdamW, {"foreach": True}), (torch.optim.AdamW, {"fused": True}), (torch.optim.AdamW, {}),
    (torch.optim.SGD, {"foreach": True}),
])
def test_a_group_mixing_dtensors_and_plain_tensors_steps_as_two_with_its_kernels(one_process_group, kind, flags):
    opt, params, reference, apart = _mixed(kind=kind, **flags)
    groups, seen = opt.param_groups, []
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference, lambda step: 1.0 / (step + 1))
    for step in range(3):
        for p, q in zip(params, apart):
            p.grad = torch.full_like(p, step + 1.0)
            q.grad = torch.full_like(q, step + 1.0)

        def closure(step=step):
            seen.append(opt.param_groups)
            return torch.tensor(float(step))

        assert float(opt.step(closure)) == step if step else opt.step() is None  # with a closure, and without
        reference.step()
        scheduler.step(), reference_scheduler.step()
    assert opt.param_groups is groups and all(s is groups for s in seen)  # the closure saw the groups as they are
    assert len(opt.state_dict()["param_groups"]) == 1 and opt.param_groups[0]["lr"] == reference.param_groups[0]["lr"]
    for p, q in zip(params, apart):
        assert torch.equal(p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach(),
                           q.detach().full_tensor() if hasattr(q, "full_tensor") else q.detach())


def test_a_split_left_by_an_update_that_raised_is_undone_before_the_state_is_read(one_process_group):
    opt, params, _, _ = _mixed(foreach=True)
    groups = opt.param_groups
    for p in params:
        p.grad = torch.ones_like(p)
    params[2].grad = torch.ones(3).to_sparse()  # Adam refuses a sparse gradient: the update raises, its groups split
    with pytest.raises(RuntimeError):
        opt.step()
    assert len(opt.param_groups) == 2  # left split by the update that raised
    assert len(opt.state_dict()["param_groups"]) == 1 and opt.param_groups is groups
    with pytest.raises(ValueError):  # a closure that raises leaves the groups whole
        opt.step(lambda: (_ for _ in ()).throw(ValueError("closure")))
    assert opt.param_groups is groups


def test_other_optimizers_step_a_mixed_group_one_at_a_time_also_after_a_resume(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    plain = torch.nn.Parameter(torch.randn(4))
    opt = adapt_optimizer(torch.optim.Adafactor([sharded, plain], lr=0.1, foreach=True))
    assert opt.param_groups[0]["foreach"] is False
    # a checkpoint from a layout where this group was not mixed, written with the multi-tensor kernels
    saved = torch.optim.Adafactor([torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))],
                                  foreach=True).state_dict()
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["foreach"] is False
    sharded.grad, plain.grad = torch.ones_like(sharded), torch.ones_like(plain)
    opt.step()


def test_a_mixed_group_whose_state_waits_on_disk_steps_as_two_chunk_by_chunk(one_process_group, tmp_path):
    from meshlight.parallel.nvme import OptimizerStateOnDisk

    opt, params, reference, apart = _mixed(foreach=True)
    groups = opt.param_groups
    on_disk = OptimizerStateOnDisk(opt, tmp_path / "state", chunk_bytes=64)  # a chunk per parameter
    assert len(on_disk.chunks) == 3
    for step in range(3):
        for p, q in zip(params, apart):
            p.grad, q.grad = torch.full_like(p, step + 1.0), torch.full_like(q, step + 1.0)
        opt.step(lambda: None)
        reference.step()
        assert opt.param_groups is groups and groups[0]["params"] == [params[1], params[0], params[2]]
    for p, q in zip(params, apart):
        assert torch.equal(*(t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach() for t in (p, q)))
    on_disk.close()
