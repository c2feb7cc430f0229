"""Compile: every block compiled (one ``torch.compile`` per block), at its place in the transform order, under
every kind of layout — training equals eager training (parity within 1e-4 against single-process eager
training on 2 processes; inductor within 1e-5 of eager on one), names unchanged, misuse refused."""


import pytest
import torch
from torch._dynamo.utils import counters

from meshlight.callbacks import ActivationCheckpointing, Compile, MixedPrecision
from meshlight.models import GPT, GPTConfig
from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.compile import CompilePolicy, apply_compile
from meshlight.parallel.precision import is_norm
from tests.strategies.llama import LitLlama
from tests.strategies.parity import assert_parity, train

DENSE_RUNS = ["ddp", "zero3 recompute", "tp", "pipeline"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.callbacks.workers import compile_worker
    from tests.launch import results_of

    return results_of(compile_worker, 2, tmp_path_factory.mktemp("compile"))


@pytest.fixture(scope="module")
def control() -> dict:
    return train("adamw")


@pytest.mark.parametrize("run", DENSE_RUNS)
def test_compiled_blocks_train_as_single_process_eager_training(runs, control, run):
    result = runs[run]
    assert result["compiled"] and result["frames"] >= 1
    assert_parity(result, control)


def test_compiled_blocks_of_a_user_written_llama_train_as_single_process_eager_training_under_tp(runs):
    result = runs["tp llama"]
    assert result["compiled"] and result["frames"] >= 1
    assert_parity(result, train("adamw-3e-3", model=LitLlama))


def test_compiled_moe_blocks_train_as_eager_ones(runs):
    # Data-dependent token counts split an MoE block into several graphs; the result is the same.
    assert runs["moe"]["compiled"] and runs["moe"]["frames"] > 1
    assert_parity(runs["moe"], runs["moe eager"])


def test_inductor_matches_eager_with_recomputation_and_keeps_names():
    eager = train("adamw", "ddp", callbacks=[ActivationCheckpointing()])
    compiled = train("adamw", "ddp", callbacks=[ActivationCheckpointing(), Compile()])
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)
    assert compiled["weights"].keys() == eager["weights"].keys()
    blocks = compiled["module"].model.blocks
    assert all(hasattr(block.forward, "_torchdynamo_orig_callable") for block in blocks)


def test_mixed_precision_norms_compile_once_and_recomputed_blocks_stay_compiled():
    # Mixed precision keeps each norm fp32 as an FSDP unit of its own, whose hooks dynamo does not trace. Its
    # casts and computation compile with it, one compilation for every norm; and recomputation runs around the
    # block's compiled pieces: inside one compiled region, the break would have run every block eagerly.
    captured = {}
    for name, extra in (("eager", []), ("compiled", [Compile(backend="aot_eager")]),
                        ("recomputed", [ActivationCheckpointing(), Compile(backend="aot_eager")])):
        torch._dynamo.reset()
        counters.clear()
        captured[name] = train("adamw", "ddp", callbacks=[MixedPrecision("bf16"), *extra])
        captured[name]["stats"] = dict(counters["stats"])
    norms = [m for m in captured["compiled"]["module"].modules() if is_norm(m)]
    assert all(hasattr(norm.forward.func, "_torchdynamo_orig_callable") for norm in norms)
    assert captured["compiled"]["stats"]["unique_graphs"] < len(norms)  # not one compilation per norm
    assert captured["recomputed"]["stats"] == captured["compiled"]["stats"]  # the same operators compiled
    for name in ("compiled", "recomputed"):
        torch.testing.assert_close(torch.tensor(captured[name]["losses"]), torch.tensor(captured["eager"]["losses"]),
                                   rtol=1e-5, atol=0)


def test_a_whole_graph_under_fp32_norms_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"fp32_norms=False"):
        train("adamw", "ddp", callbacks=[MixedPrecision("bf16"), Compile(backend="aot_eager", fullgraph=True)])
    # the way out the message names compiles every block whole
    torch._dynamo.reset()
    counters.clear()
    train("adamw", "ddp", callbacks=[MixedPrecision("bf16", fp32_norms=False),
                                     Compile(backend="aot_eager", fullgraph=True)])
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


def test_under_other_strategies_the_lightning_module_is_compiled():
    eager = train("adamw")
    compiled = train("adamw", callbacks=[Compile(backend="aot_eager")])
    assert compiled["losses"] == eager["losses"]
    assert all(hasattr(block.forward, "_torchdynamo_orig_callable") for block in compiled["module"].model.blocks)


def test_apply_compile_selects_blocks_once_and_keeps_names():
    model = GPT(GPTConfig.tiny(n_layers=3))
    names = list(model.state_dict())
    policy = CompilePolicy(BlockSelection(every_n_blocks=2), {"backend": "eager"})
    chosen = apply_compile(model, policy)
    assert chosen == [model.blocks[1]]
    forward = model.blocks[1].forward
    apply_compile(model, policy)
    assert model.blocks[1].forward is forward  # not compiled twice
    assert list(model.state_dict()) == names


def test_an_unknown_compile_argument_names_the_choices():
    with pytest.raises(ValueError, match="choose among backend, mode, fullgraph"):
        CompilePolicy(arguments={"fullgrpah": True})
    assert Compile(mode="max-autotune").policy.arguments["mode"] == "max-autotune"


def test_the_callback_asks_meshlights_strategies_for_compilation_by_a_policy_value():
    from meshlight.parallel.transforms import Transforms

    callback = Compile(backend="eager", fullgraph=True)
    transforms = Transforms.collect([callback, ActivationCheckpointing()])
    assert transforms.compile == CompilePolicy(BlockSelection(), dict(backend="eager", mode=None, fullgraph=True,
                                                                      dynamic=None, options=None))
    assert transforms.recompute is not None and transforms.precision is None and transforms.offload is None
