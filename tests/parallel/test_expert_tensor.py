"""How a model's own stacked experts split over tensor-parallel ranks, read from their weights' shapes (and
transformers' ``is_transposed``/``is_concatenated`` marks where the class has them)."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshlight.parallel.expert import is_dense_experts, is_stacked_experts
from meshlight.parallel.expert_tensor import stacked_expert_width, stacked_split_placements

EXPERTS, HIDDEN, WIDTH = 4, 8, 6


class Experts(nn.Module):
    """Stacked experts with the weights ``shapes`` (each ``[EXPERTS, …]``) and attributes ``marks``."""

    def __init__(self, shapes: dict, **marks) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.zeros(EXPERTS, *shape)))
        self.__dict__.update(marks)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class DenseExperts(Experts):
    def forward(self, hidden_states):
        return hidden_states


FUSED = {"gate_up_proj": (2 * WIDTH, HIDDEN), "down_proj": (HIDDEN, WIDTH)}
TRANSPOSED = {"gate_up_proj": (HIDDEN, 2 * WIDTH), "down_proj": (WIDTH, HIDDEN)}
BIASES = {"gate_up_proj_bias": (2 * WIDTH,), "down_proj_bias": (HIDDEN,)}


@pytest.mark.parametrize(("experts", "placements"), [
    # Mixtral, Qwen-MoE, DeepSeek: the gate's rows then the up projection's, each split
    (Experts(FUSED), {"gate_up_proj": _StridedShard(1, split_factor=2), "down_proj": Shard(2)}),
    # Llama 4 (no marks) and Aria (marked transposed): stored [E, in, out], the gate's columns then the up's
    (DenseExperts(TRANSPOSED), {"gate_up_proj": _StridedShard(2, split_factor=2), "down_proj": Shard(1)}),
    (Experts(TRANSPOSED, is_transposed=True), {"gate_up_proj": _StridedShard(2, split_factor=2),
                                               "down_proj": Shard(1)}),
    # GPT-OSS: transposed, the gate's and up projection's columns interleaved, with biases
    (Experts({**TRANSPOSED, **BIASES}, is_transposed=True, is_concatenated=False),
     {"gate_up_proj": Shard(2), "gate_up_proj_bias": Shard(1), "down_proj": Shard(1), "down_proj_bias": Replicate()}),
])
def test_the_layouts_of_stacked_experts_are_read_from_their_shapes_and_marks(experts, placements):
    split = stacked_split_placements(experts)
    assert split is not None and {name: split(name) for name in placements} == placements
    assert stacked_expert_width(experts) == WIDTH


@pytest.mark.parametrize("experts", [
    Experts(TRANSPOSED, is_transposed=False),  # the class says one layout, the shapes another
    Experts(FUSED, has_post_expert_norm=True),  # each expert's output normalized: a partial sum is not one
    Experts({"up_proj": (WIDTH, HIDDEN), "down_proj": (HIDDEN, WIDTH)}),  # no gate
    Experts({"gate_up_proj": (2 * WIDTH + 1, HIDDEN), "down_proj": (HIDDEN, WIDTH)}),  # widths that do not fit
    Experts({**FUSED, "gate_up_proj_bias": (WIDTH,)}),  # a bias of another width
])
def test_stacked_experts_in_another_layout_are_not_split(experts):
    assert stacked_split_placements(experts) is None


def test_experts_taking_every_token_are_told_from_experts_taking_their_routed_tokens():
    assert is_stacked_experts(Experts(FUSED)) and not is_dense_experts(Experts(FUSED))
    assert is_dense_experts(DenseExperts(TRANSPOSED)) and not is_stacked_experts(DenseExperts(TRANSPOSED))
    assert not is_dense_experts(nn.Linear(4, 4))
