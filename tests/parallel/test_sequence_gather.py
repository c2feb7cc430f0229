"""Backward gathers a column-parallel group's sequence-parallel input again from this rank's share (Megatron-LM's
way) and computes exactly what keeping the gathered input computes: 2 processes, tp=2, a 2-block Llama-shaped
GPT whose attention reads its input with 3 projections and whose SwiGLU MLP with 2. And a sequence mixer kept
whole on every rank computes one process's gradients exactly."""

from pathlib import Path

import pytest
import torch

from tests.launch import torchrun
from tests.parallel.workers import sequence_gather_worker as worker

BLOCKS, GROUPS = worker.CONFIG.n_layers, 2  # column-parallel groups per block: attention, MLP
TOKENS, HIDDEN, TP = worker.BATCH * worker.CONFIG.max_seq_len, worker.CONFIG.dim, 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sequence_gather") / "results.pt"
    torchrun(Path(worker.__file__), TP, str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("mode", worker.MODES)
def test_gathering_again_gives_the_gradients_of_keeping_the_gathered_input_bit_for_bit(results, mode):
    kept, gathered_again = results[(True, mode)]["grads"], results[(False, mode)]["grads"]
    assert kept.keys() == gathered_again.keys()
    assert all(torch.equal(kept[name], gathered_again[name]) for name in kept)


@pytest.mark.parametrize("mode", worker.MODES)
def test_each_group_gathers_once_more_per_backward(results, mode):
    backwards = 2 if mode == "two backwards" else 1
    extra = results[(False, mode)]["backward_all_gathers"] - results[(True, mode)]["backward_all_gathers"]
    assert extra == BLOCKS * GROUPS * backwards


def test_outer_hooks_keep_each_groups_share_once_instead_of_every_projections_gathered_input(results):
    # kept gathered, the outer hooks keep the whole sequence once per projection reading it (3 + 2 per block);
    # gathered again, they keep this rank's share once per group
    kept, gathered_again = (results[(keep, "outer hooks")]["outer_values"] for keep in (True, False))
    assert kept - gathered_again == BLOCKS * (5 * TOKENS * HIDDEN - GROUPS * TOKENS * HIDDEN // TP)


def test_no_saved_tensor_hooks_outlive_a_forward(results):
    assert not any(r["hooks_left"] for key, r in results.items() if isinstance(key, tuple))
    assert results["clean after failure"]


def test_a_mixer_kept_whole_on_every_rank_gets_one_processs_gradients_bit_for_bit(results):
    """A sequence mixer kept whole on every rank (``WholeMixer``: a linear attention under sequence parallelism) runs
    its whole backward on each, from its output's gradient gathered over the ranks: a float32 part inside it (a
    running sum over the sequence, as linear attentions' kernels compute) rounds as in one process. Fed back only
    this rank's share of the output's gradient, each rank rounded its part apart (OLMo-Hybrid's Gated DeltaNet left
    one process in float64 by 1.2e-3 after 20 steps at tp=2, by 2e-7 under ddp)."""
    assert results["whole mixer"] == [{"input": True, "proj.weight": True, "proj.bias": True}] * TP


def test_an_input_given_again_as_another_argument_is_gathered_there_too(one_process_group):
    """CTRL's attention takes its input three times, as v, k and q: each is the one gathered tensor."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from meshlight.parallel.sequence_gather import register_sequence_gather

    class Attention(nn.Module):
        def forward(self, v, k, q, mask=None):
            self.seen = (v, k, q, mask)
            return v

    attention = Attention()
    register_sequence_gather(attention, init_device_mesh("cpu", (1,)), sequence_parallel=True)
    x, mask = torch.randn(2, 4, 8), torch.ones(4, 4)
    attention(x, x, q=x, mask=mask)
    v, k, q, seen_mask = attention.seen
    assert isinstance(v, DTensor) and v is k is q and seen_mask is mask
