"""Hugging Face models users bring, unchanged, under meshlight's strategies: each dense family (Llama; Qwen2 with
q/k/v biases; Qwen3 with QK-norm and an explicit head_dim) matches one process's training within 1e-4 over 20
steps, under tensor (+ sequence) parallelism, data parallelism and pipeline parallelism (1F1B and interleaved,
the LM head beside the module holding the layers); so does GPT-2 (learned positions, its head tied to the token
embedding), except under tensor parallelism. Every run trains in one launch."""

from pathlib import Path

import pytest
import torch

from tests.launch import torchrun
from tests.strategies import parity
from tests.strategies.hf_models import FAMILIES, LitCausalLM, training_options
from tests.strategies.workers import hf_worker

WORKER = Path(hf_worker.__file__)


@pytest.fixture(scope="module")
def controls() -> dict[str, dict]:
    results = {}
    for family in FAMILIES:
        result = parity.train("adamw", model=lambda family=family: LitCausalLM(family, **training_options(family)))
        result.pop("module")
        results[family] = result
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    for world in (2, 8):
        layouts = [name for name, (_, devices, _, _) in hf_worker.LAYOUTS.items() if devices == world]
        torchrun(WORKER, world, str(out), *layouts, *(["reshard-tied"] if world == 2 else []), timeout=1200)
    return out


@pytest.mark.parametrize(("layout", "family"), [(layout, family) for layout, (*_, families) in
                                                hf_worker.LAYOUTS.items() for family in families])
def test_each_layout_matches_single_process_training(runs, controls, layout, family):
    """tp2: tensor parallelism with sequence parallelism on 2 processes; ddp and zero3: 2 data replicas; pp2-*: two
    pipeline stages (interleaved: two per rank); 3d: dp=2 × pp=2 × tp=2 (sequence parallel) on 8 processes."""
    result = torch.load(runs / f"{layout}-{family}.pt", weights_only=False)
    assert len(result["losses"]) == parity.STEPS
    parity.assert_parity(result, controls[family])


def test_a_head_tied_across_pipeline_stages_is_checkpointed_and_resharded_exactly(runs):
    """GPT-2's head is its token embedding's weight: under pp=2 the first and the last stage each hold a copy. A
    pp=2 checkpoint loads under ddp, and a ddp one under pp=2, into exactly the weights saved, both names of the
    weight included. Validation through the pipeline (of the ddp-trained weights) gives the loss ddp's validation gives
    (of the pp=2-trained weights, which match them within 1e-4)."""
    results = torch.load(runs / "reshard-tied.pt", weights_only=False)
    for saved, loaded, _ in results.values():
        assert saved.keys() == loaded.keys() >= {"model.transformer.wte.weight", "model.lm_head.weight"}
        assert all(torch.equal(saved[name], loaded[name]) for name in saved)
        torch.testing.assert_close(saved["model.lm_head.weight"], saved["model.transformer.wte.weight"], rtol=0,
                                   atol=0)
    assert results["pp2-1f1b->ddp"][2] == pytest.approx(results["ddp->pp2-1f1b"][2], rel=1e-4)
