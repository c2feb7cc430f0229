"""Pipeline splitting, in one process: the pipelined module, balanced and explicit stage plans, loop and V
placement, the chain check, tied parameters and meta-device materialization (schedules run on processes in
tests/strategies)."""

import pytest
import torch

from meshlight.demos import LitGPT
from meshlight.models import GPT, GPTConfig
from meshlight.parallel.pipeline import (
    PassThrough,
    PipelineError,
    check_chain,
    find_pipelined_module,
    materialize,
    plan_stages,
    shared_parameters,
    split_stages,
    stages_of_rank,
    validate_schedule,
)
from tests.strategies.llama import LitLlama
from tests.strategies.nanogpt import LitNanoGPT


def gpt(**overrides) -> GPT:
    return GPT(GPTConfig.tiny(n_layers=8, **overrides))


def test_the_pipelined_module_is_the_owner_of_the_blocks():
    name, module, container = find_pipelined_module(LitGPT(GPTConfig.tiny()))
    assert (name, type(module).__name__, container) == ("model", "GPT", "blocks")
    assert find_pipelined_module(LitLlama())[0::2] == ("model", "layers")
    # nanoGPT's ModuleDict of different pieces is a namespace: the blocks are its list h
    assert find_pipelined_module(LitNanoGPT())[0::2] == ("model.transformer", "h")


def test_balancing_by_parameters_counts_embeddings_and_head():
    plan = plan_stages(gpt(), "blocks", 2)
    assert (plan.pre, plan.post) == (("embed",), ("norm", "head"))
    assert plan.blocks == (tuple("0123"), tuple("4567"))  # embed and head weigh the same here
    long_positions = gpt(max_seq_len=4096)  # a 4096 × 64 position table: stage 0 starts heavy
    assert len(plan_stages(long_positions, "blocks", 2).blocks[0]) < 4


def test_balancing_by_layers_and_explicit_split_points():
    assert plan_stages(gpt(), "blocks", 3, "layers").blocks == (("0", "1"), ("2", "3", "4"), ("5", "6", "7"))
    explicit = plan_stages(gpt(), "blocks", 3, ["model.blocks.2", "blocks.6"])
    assert explicit.blocks == (("0", "1"), ("2", "3", "4", "5"), ("6", "7"))
    with pytest.raises(PipelineError, match="must name 2 distinct blocks in increasing order"):
        plan_stages(gpt(), "blocks", 3, ["blocks.6", "blocks.2"])
    with pytest.raises(PipelineError, match="names no block"):
        plan_stages(gpt(), "blocks", 2, ["blocks.9"])


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(PipelineError, match="9 pipeline stages but only 8 blocks"):
        plan_stages(gpt(), "blocks", 9)


def test_loop_and_v_placement():
    assert [stages_of_rank(r, 4, 2, "interleaved1f1b") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of_rank(r, 4, 2, "zbvzerobubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_split_keeps_only_the_pieces_of_this_ranks_stages():
    model = gpt()
    plan = plan_stages(model, "blocks", 4, "layers")
    views = split_stages(model, plan, [1, 3])
    kept = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "")
            for n, _ in model.named_parameters()}
    assert kept == {"blocks.2", "blocks.3", "blocks.6", "blocks.7", "norm", "head"}
    assert isinstance(model.embed, PassThrough) and isinstance(views[0].head, PassThrough)
    assert views[1].head is model.head and views[0].blocks[2] is model.blocks[2]


def test_each_stage_runs_only_its_own_hooks():
    # the strategy hooks stages (FSDP's root, sequence-parallel inputs); a view sharing the module's hook dicts
    # would run them for the rank's other stages and for the step's call to the whole module
    model = gpt()
    views = split_stages(model, plan_stages(model, "blocks", 4, "layers"), [1, 3])
    calls, hidden = [], torch.zeros(2, 12, model.config.dim)
    views[0].register_forward_pre_hook(lambda module, args: calls.append(module))
    views[1](hidden)
    model(hidden)
    assert calls == []
    views[0](hidden)
    assert calls == [views[0]]


@pytest.mark.parametrize("module", [gpt(), gpt(positions="rotary", mlp="swiglu"), LitLlama().model])
def test_chain_check_accepts_chain_models(module):
    _, pipelined, container = find_pipelined_module(module)
    check_chain(pipelined, plan_stages(pipelined, container, 2), (torch.zeros(2, 12, dtype=torch.long),), {})


class ScaledEmbedding(GPT):
    def forward(self, idx):  # an operation between pieces: stage 1 would scale its input again
        x = self.embed(idx) * 2.0
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class SkipConnection(GPT):
    def forward(self, idx):  # the embedding reused after the blocks: not on the last stage
        h = x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x + h))


class MeanPooled(GPT):
    def forward(self, idx):  # pooled between the norm and the head: the probes pass token ids, which cannot be averaged
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


@pytest.mark.parametrize(("cls", "message"), [
    (ScaledEmbedding, "blocks.0 does not receive the previous piece's output"),
    (SkipConnection, "norm does not receive the previous piece's output"),
    (MeanPooled, r"not a chain of its pieces .*: run with every piece passing its input through, it failed after"
                 r" 'norm' with RuntimeError: mean\(\): .* An operation between pieces or after the last"),
])
def test_chain_check_rejects_other_forwards(cls, message):
    model = cls(GPTConfig.tiny(n_layers=4))
    with pytest.raises(PipelineError, match=message):
        check_chain(model, plan_stages(model, "blocks", 2), (torch.zeros(2, 12, dtype=torch.long),), {})


def test_tied_embedding_and_head_on_different_stages_are_found():
    model = gpt(tie_embeddings=True)
    assert shared_parameters(model, plan_stages(model, "blocks", 2)) == [("embed", "head")]
    assert shared_parameters(gpt(), plan_stages(gpt(), "blocks", 2)) == []


def test_materializing_a_meta_stage_gives_the_weights_of_an_unsplit_model():
    reference = gpt()
    with torch.device("meta"):
        model = gpt()
    plan = plan_stages(model, "blocks", 2)
    split_stages(model, plan, [1])
    materialize(model, torch.device("cpu"))
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_a_meta_stage_without_init_weights_is_reset_and_the_user_is_told():
    class Plain(torch.nn.Module):  # a user's model built in configure_model, no init_weights()
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    with torch.device("meta"):
        model = Plain()
    with pytest.warns(UserWarning, match=r"Plain was built on the meta device .* has no init_weights\(\): each"
                                         r" stage's modules are initialized with their own reset_parameters\(\)"):
        materialize(model, torch.device("cpu"))
    assert all(not p.is_meta and p.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize(("schedule", "virtual", "message"), [
    ("1f2b", 1, r"Unknown pipeline schedule '1f2b'; choose one of \['gpipe', '1f1b'"),
    ("1f1b", 2, "runs one stage per rank"),
    ("zbvzerobubble", 1, "places exactly 2 stages per rank"),
    ("interleaved1f1b", 1, "set virtual_stages >= 2"),
])
def test_invalid_schedules_are_refused_when_the_strategy_is_made(schedule, virtual, message):
    with pytest.raises(PipelineError, match=message):
        validate_schedule(schedule, 2, virtual, 4)
    import meshlight as ml

    with pytest.raises(PipelineError, match=message):
        ml.PipelineStrategy(pp=2, schedule=schedule, virtual_stages=virtual)
