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
