"""A DTensor's local part and whether a module is split already, asked the same way by every mechanism."""

import pytest
import torch
from torch import nn

from meshlight.parallel.dtensors import has_dtensor_parameters, local_tensor, modifiable_local


def test_a_dtensors_local_part_and_a_plain_tensor_itself(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    plain = torch.arange(6.0).view(2, 3)
    sharded = distribute_tensor(plain, init_device_mesh("cpu", (1,)), [Shard(0)])
    assert type(local_tensor(sharded)) is torch.Tensor and torch.equal(local_tensor(sharded), plain)
    assert local_tensor(plain) is plain


def test_a_module_with_one_dtensor_parameter_is_split_already(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert not has_dtensor_parameters(model)
    parallelize_module(model[1], init_device_mesh("cpu", (1,)), ColwiseParallel())
    assert has_dtensor_parameters(model) and not has_dtensor_parameters(model[0])


def test_a_modifiable_local_part_takes_an_in_place_add_and_sends_its_gradient_back(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = torch.arange(6.0).view(2, 3).requires_grad_()
    sharded = distribute_tensor(weight.detach(), init_device_mesh("cpu", (1,)), [Shard(0)]).requires_grad_()
    out = sharded * 2  # a module's output: a DTensor no one else reads
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        out.to_local().add_(1)
    local = modifiable_local(sharded * 2)
    local.add_(torch.ones(2, 3))  # as Llama 4 adds its routed experts' output into its shared expert's
    local.sum().backward()
    assert torch.equal(local.detach(), weight.detach() * 2 + 1)
    assert sharded.grad.placements == (Shard(0),) and torch.equal(sharded.grad.to_local(), torch.full((2, 3), 2.0))
