"""Context parallelism reproduces single-process training over 20 steps (losses and final weights within 1e-4): cp=2
and cp=4, cp=2 × tp=2, cp=2 × pp=2, cp=2 × dp=2 with ZeRO-3, and ``strategy="cp"``, each on meshlight's GPT (learned
positions, looked up with ``arange``), a Llama-shaped model whose rotary tables are buffers sliced by its input's
length, and Hugging Face's Llama (positions given as ``position_ids``, attention through its config); at cp=2 also
GPT with rotary positions and grouped-query attention, Hugging Face's GPT-2, litgpt's GPT (its rotary cache sliced
by length), Hugging Face's Llama trained on its own loss from dict ``labels``, Mixtral with its load-balancing loss
(over the whole sequence's router logits, gathered over the cp ranks), GPT-OSS (eager attention with sinks,
sliding-window layers whose window crosses the chunks' edges; also at cp=2 × tp=2) and Llama 4 (without its chunked
attention and query temperature, which are refused); and the Llama with an MoE in every
block, its capacity and balancing loss counted over the whole sequence's ranks: cp=2 and cp=2 × ep=2 (experts borrowing
data ranks, ZeRO-1) with a capacity factor, cp=2 × ep=2 under DDP dropless, cp=2 × tp=2 with a capacity factor, each
expert split over tp and (ZeRO-1) whole, ep=2 folded over the tp ranks; Hugging Face's stacked experts (GPT-OSS under
cp=2 × ep=2 DDP, Mixtral folded under cp=2 × tp=2). The addition data scores only the
last tokens of each sequence, so the ranks' shares hold different numbers of scored tokens: the loss is weighted by
them. Validation logs the whole sequences' loss. What cp cannot split is refused before any optimizer step, naming
the module and the fix."""

import re
from pathlib import Path

import pytest
import torch

from meshlight.parallel.expert import expert_layers
from tests.launch import torchrun
from tests.strategies.parity import assert_parity, train
from tests.strategies.workers import context_worker

WORKER = Path(context_worker.__file__)
RUNS = [(world, run) for world in (2, 4) for run in context_worker.runs(world)]


@pytest.fixture(scope="module")
def controls() -> dict:
    models = {model for _, (_, model) in RUNS}
    return {model: train("adamw", model=context_worker.model_factory(model), pad_to_multiple_of=context_worker.SEQ)
            for model in models}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    results = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp("context") / f"{world}.pt"
        torchrun(WORKER, world, str(out), str(world))
        results[world] = torch.load(out, weights_only=False)
    return results


@pytest.mark.parametrize(("world", "run"), RUNS, ids=[f"{w}proc-{layout}-{model}" for w, (layout, model) in RUNS])
def test_context_parallelism_matches_single_process_training(distributed, controls, world, run):
    assert_parity(distributed[world][run], controls[run[1]], rtol=context_worker.RTOL.get(run[1], 1e-4))


def test_the_folded_runs_spread_whole_experts_over_the_tp_ranks_beside_context_parallelism(distributed):
    folded = {model: result["layout"] for (layout, model), result in distributed[4].items() if "fold" in layout}
    assert set(folded) == {"llama-moe-capacity", "hf-mixtral"}
    assert all(layout.folded and (layout.ep, layout.tp, layout.cp) == (2, 2, 2) for layout in folded.values())


def test_the_capacity_runs_drop_assignments(controls):
    # parity with a capacity factor means something only if the whole sequence's count dropped some
    layers = expert_layers(controls["llama-moe-capacity"]["module"])
    assert layers and all(layer.last_step.dropped_fraction > 0 for layer in layers)


def test_validation_logs_the_whole_sequences_loss(distributed):
    whole = context_worker.validation()
    assert abs(distributed[2]["validation"] - whole) <= 1e-5 * whole


@pytest.mark.parametrize(("case", "message"), [
    ("length", r"sequence length 14 does not split into 2·cp = 4 equal chunks.*make the sequences 16 tokens long"),
    ("mask", r"`model.layers.0.attention` calls scaled_dot_product_attention with a custom attn_mask.*is_causal=True"),
    ("manual-attention", r"Block `model.layers.0` \(TransformerBlock\) ran no scaled_dot_product_attention.*"
                         r"attn_implementation='sdpa'"),
    ("labels-made-in-step", r"LlamaForCausalLM is given labels that did not come in the batch.*under 'labels'"),
    ("chunked", r"Llama4ForCausalLM has 'chunked_attention' layers \(config.layer_types\), attending within chunks"
                r" of 4 tokens.*Train this model with cp=1, or without chunks \(attention_chunk_size=None"),
    ("query-temperature", r"Llama4ForCausalLM scales the queries of its layers without rotary positions.*"
                          r"attn_temperature_tuning=False"),
])
def test_what_context_parallelism_cannot_split_is_refused_naming_it(distributed, case, message):
    assert distributed[2]["refusals"][case].startswith("ContextParallelError: ")
    assert re.search(message, distributed[2]["refusals"][case], flags=re.DOTALL)
