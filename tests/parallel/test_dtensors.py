"""A DTensor's local part and whether a module is split already, asked the same way by every mechanism."""

import torch
from torch import nn

from meshlight.parallel.dtensors import has_dtensor_parameters, local_tensor


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
