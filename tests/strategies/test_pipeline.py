"""Pipeline parallelism reproduces single-process training inside Lightning's own loop: every schedule torch 2.13
runs, pp = 2 and 4, microbatches 4 and 8 (at pp=4, 8 for DualPipeV and InterleavedZeroBubble), pp=2 × dp=2 (DDP,
ZeRO-1/2/3), accumulate_grad_batches=2 and gradient clipping by the norm over all stages — logged losses and final
weights of an 8-block GPT within 1e-4 over 20 steps."""

from pathlib import Path

import pytest
import torch

from tests.launch import torchrun
from tests.strategies.parity import assert_parity, train
from tests.strategies.workers import bad_pipeline_worker, pipeline_worker

WORKER = Path(pipeline_worker.__file__)
RUNS = [(world, run) for world in (2, 4) for run in pipeline_worker.runs(world)]
# torch refuses these (DualPipeV needs at least as many microbatches as stages: 8 at pp=4)
REFUSED = {(4, 1, 1, "dualpipev", 4, "adamw")}


@pytest.fixture(scope="module")
def controls() -> dict:
    return {variant: train(variant, model=pipeline_worker.gpt8) for variant in ("adamw", "accumulate", "clip")}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    results = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp("pipeline") / f"{world}.pt"
        torchrun(WORKER, world, str(out), str(world))
        results.update(torch.load(out, weights_only=False))
    return results


IDS = [f"pp{r[0]}-dp{r[1]}-zero{r[2]}-{r[3]}-m{r[4]}-{r[5]}" + "".join(f"-v{v}" for v in r[6:7])
       + "".join("-split" + "-".join(block.split(".")[1] for block in split) for split in r[7:]) for _, r in RUNS]


@pytest.mark.parametrize(("world", "run"), RUNS, ids=IDS)
def test_pipeline_matches_single_process_training(distributed, controls, world, run):
    result = distributed[run]
    if run in REFUSED:
        assert "requires at least as many microbatches as stages" in result["rejected"]
        assert "Use more microbatches" in result["rejected"]
        return
    assert "rejected" not in result, result.get("rejected")
    assert_parity(result, controls[run[5]])


def test_clipping_engages_in_the_clipped_control(controls):
    assert max(controls["clip"]["grad_norms"]) > 1.0


BAD_INPUT = {
    "few microbatches": "Schedule '1f1b' cannot run 1 microbatches over 2 stages",
    "indivisible batch": "A batch of 16 does not divide into 3 microbatches",
    "more stages than blocks": "2 pipeline stages but only 1 blocks",
    "not a chain": "norm does not receive the previous piece's output",
    "tied embedding and head on one rank": "Schedule 'zbvzerobubble' places the first and the last stage on one rank",
    "zero bubble with too few microbatches": "needs at least as many microbatches as stages: use microbatches >= 4",
}


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory) -> list[dict]:
    errors = []
    for world in (2, 4):
        out = tmp_path_factory.mktemp(f"bad{world}")
        torchrun(Path(bad_pipeline_worker.__file__), world, str(out), str(world), timeout=300)
        errors += [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return errors


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_fails_on_every_rank_before_training_without_hanging(bad_input, case):
    raised = [rank[case] for rank in bad_input if case in rank]
    assert len(raised) in (2, 4)
    assert all(BAD_INPUT[case] in message for message in raised), raised[0]


def test_images_as_patches_flattened_over_the_batch_are_refused_where_microbatches_would_cut_across_images():
    """Qwen-VL's images come as their patches flattened over the batch beside each image's grid: the schedule cuts
    every argument into equal microbatches along dimension 0, which keeps each image's patches with it only where
    every microbatch's images hold as many patches. Otherwise it is refused before anything is sent."""
    from meshlight.parallel.pipeline import PipelineError
    from meshlight.strategies.pipeline_steps import _check_patches

    grid = torch.tensor([[1, 4, 4], [1, 2, 2], [1, 4, 4], [1, 2, 2]])  # 16, 4, 16 and 4 patches
    _check_patches(torch.zeros(40, 8), grid, "pixel_values", 2)  # 20 and 20
    _check_patches(torch.zeros(40, 8, 1), grid, "pixel_values", 2)  # not flattened patches: not checked
    with pytest.raises(PipelineError, match=r"pixel_values holds the images' patches flattened over the batch \(40"
                                            r" patches of 4 images\).*2 equal microbatches along dimension 0: each"
                                            r" would get 20 patches, but their images hold \[32, 8\].*or train with"
                                            r" pp=1"):
        _check_patches(torch.zeros(40, 8), grid[[0, 2, 1, 3]], "pixel_values", 2)


@pytest.mark.parametrize("family", ["llama", "litgpt", "gpt2"])
def test_the_parameter_balance_counts_a_head_beside_the_blocks_module_toward_the_last_stage(family):
    """Hugging Face's and litgpt's LM head sits beside the module holding the blocks (``lm_head`` beside ``model``),
    where meshlight's GPT holds it after them: the last stage holds it either way, and the parameter balance counts
    it there (GPT-2's head, tied to the embedding, as the copy the last stage keeps). Counted only with the embedding,
    4 blocks over 2 stages went 1 and 3, the head beside the 3."""
    from meshlight.strategies.pipeline_steps import stage_plan
    from tests.strategies.hf_models import lit_causal_lm

    module = lit_causal_lm(f"{family}-vocab1024-deep")  # embedding and head each as large as 4 blocks or more
    place, root, plan = stage_plan(module, 2, "parameters", probe=False)
    head = sum(p.numel() for name in place.heads for p in root.get_submodule(name).parameters())
    assert place.heads and head >= 1024 * 64
    assert [len(blocks) for blocks in plan.blocks] == [2, 2]
    assert [len(blocks) for blocks in stage_plan(module, 3, "parameters", probe=False)[2].blocks] == [1, 2, 1]


def test_the_parameter_balance_counts_encoders_beside_the_decoder_toward_the_first_stage():
    """A multimodal model's vision tower sits beside its decoder, and the first stage runs it: the parameter balance
    counts it there, leaving that stage fewer blocks (Qwen2.5-VL's, here larger than a block: 1 of 4 blocks on the
    first of 2 stages, 2 counted without it)."""
    from meshlight.strategies.pipeline_steps import stage_plan
    from tests.strategies.hf_models import lit_causal_lm

    module = lit_causal_lm("qwen2_5_vl-deep")
    place, root, plan = stage_plan(module, 2, "parameters", probe=False)
    encoders = sum(p.numel() for name in place.encoders for p in root.get_submodule(name).parameters())
    block = sum(p.numel() for p in root.get_submodule(place.pipelined).get_submodule(place.container)[0].parameters())
    assert encoders > block
    assert [len(blocks) for blocks in plan.blocks] == [1, 3]
