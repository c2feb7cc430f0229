"""clip_grad_norm_ on plain tensors agrees with torch's (the sharded cases run in the ZeRO parity tests)."""

import torch

from meshlight.parallel import clip_grad_norm_


def _model_with_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    (model(torch.randn(3, 4)) * 10).sum().backward()
    return model


def test_clipping_matches_torch():
    ours, theirs = _model_with_grads(), _model_with_grads()
    norm = clip_grad_norm_(ours.parameters(), 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    assert torch.allclose(norm, expected) and norm > 1.0
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(p.grad, q.grad)


def test_no_gradients_give_norm_zero():
    assert clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0) == 0
