"""A parameter no loss reaches under DDP (zero=0): refused on every rank after the first step's backward, naming it
and the ways to train it, before any optimizer step — DDP would leave its bucket unreduced and fail at the next
forward without naming it (also Hugging Face's DeepSeek-V3.2, whose sparse attention's key selector no loss reaches);
trained when DDP looks for unused parameters, and under ZeRO-1."""


import pytest

from tests.launch import results_of
from tests.strategies.workers import unused_worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return results_of(unused_worker, 2, tmp_path_factory.mktemp("unused"), timeout=300)


@pytest.mark.parametrize("run", ["ddp", "3d zero=0", "ddp accumulate"])
def test_ddp_refuses_a_parameter_without_a_gradient_naming_it_before_any_step(runs, run):
    result = runs[run]
    assert result["steps"] == 0
    assert result["error"].startswith("2 trainable parameter(s) got no gradient in the first step (probe.weight,"
                                      " probe.bias)")
    assert "DDPStrategy(find_unused_parameters=True)" in result["error"] and "zero=1" in result["error"]


def test_a_hugging_face_models_sparse_attention_key_selector_is_named(runs):
    result = runs["ddp deepseek_v32"]
    assert result["steps"] == 0
    assert result["error"].startswith("10 trainable parameter(s) got no gradient in the first step"
                                      " (model.model.layers.0.self_attn.indexer.wq_b.weight,")


@pytest.mark.parametrize("run", ["ddp find_unused", "3d zero=0 find_unused", "zero1"])
def test_it_trains_where_ddp_looks_for_unused_parameters_or_zero_reduces_what_there_is(runs, run):
    assert runs[run] == {"error": None, "steps": 3}
