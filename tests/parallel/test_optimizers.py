"""The Adafactor adapter computes exactly torch's update on plain tensors and keeps LR schedulers attached
(its exactness on sharded parameters is in the ZeRO parity tests)."""

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


def test_a_group_mixing_dtensors_and_plain_tensors_keeps_stepping_one_at_a_time_after_a_resume(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    plain = torch.nn.Parameter(torch.randn(4))
    opt = adapt_optimizer(torch.optim.AdamW([sharded, plain], lr=0.1))
    assert opt.param_groups[0]["foreach"] is False and opt.param_groups[0]["fused"] is False
    # a checkpoint from a layout where this group was not mixed, written with the fused kernel
    saved = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))],
                              fused=True).state_dict()
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["foreach"] is False and opt.param_groups[0]["fused"] is False
    sharded.grad, plain.grad = torch.ones_like(sharded), torch.ones_like(plain)
    opt.step()  # the fused kernel would refuse the mix ("got mixed torch.Tensor and DTensor")
