"""Models users bring, unchanged, under meshlight's strategies: each dense family — Hugging Face's Llama, Mistral, Qwen2
(q/k/v biases), Qwen3 (QK-norm, an explicit head_dim) and GPT-2 (Conv1D, a fused q|k|v, learned positions, its head tied
to the token embedding), and litgpt's GPT (a fused q|k|v for grouped queries, its blocks in a ModuleDict namespace the
root's forward runs) — matches one process's training within 1e-4 over 20 steps, under tensor (+ sequence) parallelism,
data parallelism, pipeline parallelism (1F1B and interleaved, the LM head beside the module holding the layers) and
(GPT-2 and litgpt; Llama's structure as Qwen2.5-VL's decoder; Qwen3 under pipelining × tensor parallelism) all three;
and Mixtral, Qwen3-MoE and GPT-OSS (attention sinks, sliding-window layers, experts stored transposed with biases) under
expert parallelism, with and without pipelining, and under tensor parallelism (their attention split), Qwen3-MoE also
with dp and pp; Phi-3 (a fused q|k|v sliced by the config's head counts, a fused gate|up), Qwen2-MoE (a shared expert
beside the routed ones), OLMo 2 and OLMoE (q and k normalized over all heads at once; OLMo 2 at the tolerance
:data:`~tests.strategies.hf_models.PARITY_RTOL` says, and in float64, OLMoE in float64) under tensor parallelism; BLOOM,
MPT and Falcon-RW (ALiBi biases built for all heads by the model, each rank handed its heads') under tensor parallelism,
BLOOM, MPT and Falcon (blocks returning tuples) under pipelining, Falcon-RW under pipelining × tensor parallelism; OPT
(its final norm registered before its layers) under pipelining; litgpt's MoE (experts held as a list) under expert
parallelism, alone, folded over tp and in all four; Mixtral and Qwen3-MoE with their load-balancing loss under
pipelining (every layer's router logits carried down the stages), with expert parallelism and all three; Qwen3.5 (in
float64: its Gated DeltaNet layers kept whole on every rank) under tensor parallelism; the hybrids Jamba, Bamba,
Falcon-H1, Granite 4 (their Mamba mixers kept whole on every rank), LFM2 (its short convolutions), LFM2-MoE, MiniMax
(its lightning attention) and Kimi Linear (its KDA layers; in float64) under tensor parallelism, Falcon-H1 and Granite 4
under pipelining, Granite 4 also under expert parallelism and pipelining × tensor parallelism; Apertus (a learned
activation between its MLP's projections; with and without sequence parallelism) and AFMoE (an output gate registered
after its output projection, an MoE block holding its routing's bias itself; in float64) under tensor parallelism;
DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention: its key selector kept whole on every rank) under tensor parallelism;
Gemma 2 (soft-capped logits), Gemma 3 and Gemma 4 (keys that are also the values on its global layers) under tensor
parallelism, Gemma 3 and Gemma 4's MoE under pipelining, the MoE also under expert parallelism (and in float64 under
tensor parallelism); DeepSeek-V4 (in float64) and HY-V4 under pipelining and expert parallelism (hyper-connections'
streams between blocks, collapsed by a head run before the final norm; DeepSeek-V4's hash-routed experts reading the
token ids); the vision-language models Qwen2.5-VL, Qwen3-VL (in float64), Qwen3-VL-MoE, LLaVA and Gemma 3 under tensor
parallelism (their vision encoder whole on every rank), Qwen2.5-VL, LLaVA, LLaVA-NeXT (in float64: its image_newline the
first stage's), Idefics3 (in float64), ERNIE 4.5-VL and Qwen3-VL-MoE (its first stage holding the layer its encoder
feeds and the next) under pipelining (the encoder on the first stage), ERNIE 4.5-VL under tensor parallelism without
sequence parallelism (its MoE layer takes each token's type), Qwen2.5-VL under all three and Qwen3-VL (in float64) under
pipelining × tensor parallelism, Qwen3-VL under ZeRO-3, LLaVA under dp=2 × tp=2 with ZeRO-3, and Qwen3-VL-MoE under
expert parallelism, alone and folded over tp; Llama, GPT-2, Phi-3 and GPT-NeoX fine-tuned with PEFT's LoRA under tensor
parallelism (each adapted Linear split with its adapters, fused ones part by part; GPT-2 and Phi-3 as DoRA, its
magnitudes split with their rows; DoRA on Qwen2-MoE's shared expert's gate and Gemma 4's router, kept whole with the
Linear), Llama also under dp=2 × tp=2 with ZeRO-3, pipelining × tensor parallelism and the planned layout (there with
its embedding and head trained whole beside, modules_to_save), its frozen weights unchanged, its checkpoint resumed and
resharded, its dropout one mask over the tp ranks; Mixtral with LoRA on its attention under dp=2 × tp=2 × ep=2;
Qwen3-MoE with LoRA on its experts under tp=2 (each expert split) and dp=2 × tp=2 × ep=2 (split), and planned, GPT-OSS's
(target_parameters) under tp=2 and ep=2. One launch per process count."""

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from tests.launch import in_background, torchrun
from tests.strategies import parity
from tests.strategies.hf_models import MOE_FAMILIES, PARITY_RTOL, experts_in_another_layout, lit_causal_lm
from tests.strategies.workers import hf_worker

WORKER = Path(hf_worker.__file__)


def control_of(layout: str, model: str) -> tuple[str, int, int]:
    """The control a layout's run of ``model`` is matched against: with the load-balancing loss on, one process
    computes it per data-parallel rank's part (ep2: 2 replicas; tp2: 1, over the whole sequence's routing) and per
    pipeline microbatch of it."""
    if "-aux" not in model:
        return model, 1, 1
    return model, hf_worker.LAYOUTS[layout][2], hf_worker.MICROBATCHES.get(layout, 1)


@pytest.fixture(scope="module")
def controls() -> dict[tuple[str, int, int], dict]:
    """One process's runs, trained beside the launches on one thread as the ranks are: a second thread took no wall
    time off these tiny models' steps, and spun on the core the ranks need (measured: 0.34 CPU-seconds for Llama's
    20 steps in 0.18 s on two threads, 0.19 in 0.19 s on one)."""
    results, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, shards, pieces in {control_of(layout, name) for layout, (*_, models) in hf_worker.LAYOUTS.items()
                                     for name in models}:
            result = parity.train("adamw", model=lambda name=name, shards=shards, pieces=pieces: lit_causal_lm(
                name, data_shards=shards, microbatches=pieces))
            result.pop("module")
            results[name, shards, pieces] = result
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Future[Path]:
    out = tmp_path_factory.mktemp("hf")

    def launch() -> Path:
        for world in (2, 4, 8):
            layouts = [name for name, (_, devices, _, _) in hf_worker.LAYOUTS.items() if devices == world]
            extras = {2: ["reshard-tied", "resume-listed", "resume-lora", "lora-dropout"],
                      4: ["resume-split"]}.get(world, [])
            torchrun(WORKER, world, str(out), *layouts, *extras, timeout=1200)
        return out

    return in_background(launch)


@pytest.fixture(scope="module")
def runs(launches, controls) -> Path:
    """The folder the launches wrote, once they are over; the controls are trained while they run."""
    return launches.result()


@pytest.mark.parametrize(("layout", "model"), [(layout, model) for layout, (*_, models) in
                                               hf_worker.LAYOUTS.items() for model in models])
def test_each_layout_matches_single_process_training(runs, controls, layout, model):
    """tp2: tensor parallelism with sequence parallelism on 2 processes (the fused q|k|v of GPT-2 and litgpt split part
    by part; GPT-2 also with a vocabulary of 61, split 31 + 30; the MoE models' routers whole, each expert split over
    tp, its fused gate|up part by part; GPT-OSS's sinks split with its heads, its transposed experts' interleaved
    gate|up by columns, their output bias added once; Mixtral's load-balancing loss from the whole sequence's router
    logits, added by the step to the loss-parallel language-model loss, or by the model to its own from labels); ddp and
    zero3: 2 data replicas; pp2-*: two pipeline stages (interleaved: two per rank); 3d: dp=2 × pp=2 × tp=2 (sequence
    parallel) on 8 processes (Qwen2.5-VL's vision encoder on the first stage, whole on its tp ranks; 3d-moe: Qwen3-MoE,
    ep=1, each expert split over tp, with its load-balancing loss, per data rank's part and microbatch, from router
    logits gathered over tp and carried down the pipeline); pp2-tp2: pp=2 × tp=2 on 4 processes, the traits those two
    meet together (OLMo 2's norms over all heads, Qwen3's QK-norm, Falcon-RW's ALiBi, Qwen3-VL's deepstack, Llama with
    LoRA and its embedding and head trained whole; DeepSeek-V3, Llama 4 (in float64, as at tp2) and Granite 4, ep=1,
    each expert split over tp); dp2-tp2-ep4: dp=2 × tp=2 with ep=4 folded over
    the tp and data ranks (each rank one whole expert; litgpt's of its lists too), with sequence parallelism and
    (Mixtral, litgpt's MoE with its gradients clipped) without; 3d-ep2: litgpt's MoE under dp=2 × pp=2 × tp=2 with ep=2
    folded over tp (each rank two whole experts of each list); dp2-tp2-ep2-split*: each expert split over tp=2 and the
    experts over ep=2 data ranks (Mixtral also without sequence parallelism, under ZeRO-3); dp2-tp2-zero3: LLaVA, its
    vision encoder's parameters plain beside the decoder's tensor-parallel ones, sharded over the data ranks;
    tp2-loss-parallel: a vocabulary of 61, which tp=2 splits 31 + 30, the logits left split for the loss (in float64);
    ``-kv1`` / ``-kv2`` at tp2 and tp4: fewer key/value heads than ranks, each rank computing the one its query heads
    read (Llama's k and v, Phi-3's and litgpt's fused q|k|v, beside Qwen3's norm over each head); BLOOM, MPT and
    Falcon-RW at tp2, each attention handed its heads' ALiBi biases; BLOOM, MPT and Falcon at pp2-1f1b, their blocks
    returning tuples; Mixtral at pp2-1f1b adding its load-balancing loss to its own loss from labels, each microbatch's
    from every layer's router logits, which the earlier stage hands on beside the hidden state; 3d-planned:
    Hybrid3DStrategy() with no sizes, planned from each config; ep2 and dp2-pp2-ep2: Mixtral's and Qwen3-MoE's own MoE
    blocks, their experts split over 2 ranks (with their load-balancing loss, which each data-parallel rank computes
    over its part of the batch — under pipelining each microbatch's), and litgpt's experts held as a list, each rank
    keeping two of them (also with every step's gradients clipped, by a norm that sums the ranks' experts)."""
    result = torch.load(runs / f"{layout}-{model}.pt", weights_only=False)
    assert len(result["losses"]) == parity.STEPS
    control = controls[control_of(layout, model)]
    parity.assert_parity(result, control, rtol=PARITY_RTOL.get(model, 1e-4))
    if "-lora" in model:  # the model's own weights frozen, as in one process: only the adapters (and copies) trained
        frozen = [name for name in control["weights"]
                  if not any(trained in name for trained in (".lora_", ".modules_to_save.", ".trainable_tokens_"))]
        assert len(frozen) < len(control["weights"])
        assert all(torch.equal(result["weights"][name], control["weights"][name]) for name in frozen)
    # 4 experts: over 2 or 4 ranks, or whole
    stacked = (*MOE_FAMILIES, "qwen2_moe", "olmoe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "ernie4_5_moe",
               "llama4", "jamba", "granite4", "lfm2_moe", "minimax", "kimi_linear", "gemma4_moe", "qwen3_vl_moe",
               "ernie4_5_vl_moe", "afmoe", "deepseek_v4", "hy_v4")
    family = model.split("-")[0]
    if family in (*stacked, "litgpt_moe", "litgpt_moe_grouped") and layout != "3d-planned":
        ep = 4 if "ep4" in layout else 2 if "ep2" in layout else 1
        # each expert split over tp=2 (a list's kept whole)
        split = layout in ("tp2", "tp2-no-sp", "pp2-tp2", "3d-moe") or "split" in layout
        tp_parts = 2 if split and family in stacked else 1
        local = result["local_experts"]
        assert local and set(local) == {(4 // ep, tp_parts)}, local


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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_load_balancing_loss_is_in_the_loss_under_expert_parallelism(runs, family):
    """With the load-balancing loss on (matched above against one process computing it per data-parallel rank's
    part), the first logged loss is the same model's language-model loss plus 0.02 times it: about top_k = 2 for a
    router that starts near balance."""
    with_aux = torch.load(runs / f"ep2-{family}-aux.pt", weights_only=False)["losses"]
    without = torch.load(runs / f"ep2-{family}.pt", weights_only=False)["losses"]
    assert 1.5 < (with_aux[0] - without[0]) / 0.02 < 3.0


def test_experts_split_part_by_part_over_tp_resume_exactly_and_load_under_other_layouts(runs):
    """Mixtral under dp=2 × tp=2 × ep=2 with each expert split over tp — the fused gate|up part by part, which
    distributed checkpointing records only as plain blocks of the whole weight (weights and AdamW's moments):
    resumed from the checkpoint of step 10, the run ends on exactly the weights of the run not interrupted; resumed
    under dp=2 × tp=2 × ep=4 (experts folded), its last 10 losses and its weights are within 1e-4 of it; and its last
    checkpoint loads under ddp into exactly its weights."""
    results = torch.load(runs / "resume-split.pt", weights_only=False)
    whole = results["whole"]["weights"]
    assert any(name.endswith("experts.gate_up_proj") for name in whole)
    for other in ("resumed", "loaded"):
        assert results[other].keys() == whole.keys()
        assert all(torch.equal(results[other][name], whole[name]) for name in whole), other
    second_half = {"losses": results["whole"]["losses"][parity.STEPS // 2:], "weights": whole}
    parity.assert_parity(results["folded"], second_half)


@pytest.mark.parametrize(("family", "sample"), [("litgpt_moe", "model.transformer.h.1.mlp.experts.3.fc_1.weight"), (
    "llama-lora-saved", "model.base_model.model.model.layers.1.mlp.down_proj.lora_A.default.weight")])
def test_a_checkpoint_resumes_exactly_and_loads_under_other_layouts(runs, family, sample):
    """litgpt's MoE under ep2, each rank holding two experts of each list (under the names one process gives them),
    and Llama with LoRA adapters under tp2, each adapted Linear split with its adapters, its embedding and head
    trained whole beside (PEFT's modules_to_save, the frozen originals split with their copies): resumed from its
    checkpoint of step 10 each ends on exactly the weights of the run not interrupted, and its last checkpoint loads
    under ddp into exactly its weights; resumed under ddp, its last 10 losses and its weights are within 1e-4 of it,
    and ddp's last checkpoint loads under the first layout into exactly ddp's weights."""
    results = torch.load(runs / f"resume-{family}.pt", weights_only=False)
    whole, on_ddp = results["whole"]["weights"], results["on_ddp"]["weights"]
    assert sample in whole
    for weights, expected in ((results["resumed"], whole), (results["loaded"], whole),
                              (results["ddp_loaded"], on_ddp)):
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[name], expected[name]) for name in expected)
    second_half = {"losses": results["whole"]["losses"][parity.STEPS // 2:], "weights": whole}
    parity.assert_parity(results["on_ddp"], second_half)


def test_experts_held_as_a_list_are_refused_split_over_tensor_parallel_ranks():
    """Expert parallelism spreads a list of experts whole over ranks: data ranks, or under tp ranks spanning the tp
    ranks too (experts="fold", the default where ep is a multiple of tp). Split over the tp ranks, or over an ep that
    cannot fold, it is refused before any collective, naming the ways out, as an expert count ep does not divide
    is."""
    from meshlight.parallel.layout import ParallelLayout
    from meshlight.parallel.parallelize import parallelize

    with pytest.raises(NotImplementedError, match=r"tp=2 · ep=2: model.transformer.h.0.mlp holds its experts as a"
                                                  r" list \(litgpt's MoE\), which meshlight does not split over the tp"
                                                  r" ranks \(experts='split'\). Fold expert parallelism over them"
                                                  r" instead: experts='fold' with ep in \[2, 4\], or ep=1"):
        parallelize(lit_causal_lm("litgpt_moe"), ParallelLayout(dp_replicate=2, tp=2, ep=2, experts="split"),
                    mesh=None)
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by ep=3.*Choose ep in \[1, 2, 4\]"):
        parallelize(lit_causal_lm("litgpt_moe"), ParallelLayout(dp_replicate=3, ep=3), mesh=None)


def test_a_models_own_experts_under_tensor_parallelism_refuse_what_they_cannot_do():
    """Under tp a model's own experts are split over the tp ranks where their weights are in the layout meshlight
    knows, else kept whole (on every tp rank, or spread over them by expert parallelism folded over them): such
    experts with experts="split" and ep > 1 are refused, naming the way out."""
    from meshlight.parallel.layout import ParallelLayout
    from meshlight.parallel.parallelize import parallelize

    module = experts_in_another_layout(lit_causal_lm("mixtral"))
    with pytest.raises(NotImplementedError, match=r"layers.0.mlp.experts's weights are not in the layout meshlight"
                                                  r" splits over the tp ranks \(experts='split': a fused"
                                                  r" gate_up_proj .*\); fold expert parallelism over them instead:"
                                                  r" experts='fold' with ep in \[2, 4\], or ep=1"):
        parallelize(module, ParallelLayout(dp_replicate=2, tp=2, ep=2, experts="split"), mesh=None)


def test_experts_that_take_every_token_are_refused_by_expert_parallelism_naming_tp():
    """Llama 4's experts each run on every token (scaled by the router's score): nothing to dispatch."""
    from meshlight.parallel.layout import ParallelLayout
    from meshlight.parallel.parallelize import parallelize

    with pytest.raises(ValueError, match=r"ep=2, but the model has no experts to split.*\(Llama4TextExperts runs every"
                                         r" expert on every token, as Llama 4's MoE does.*Train it with ep=1; tp"
                                         r" splits each of its experts"):
        parallelize(lit_causal_lm("llama4"), ParallelLayout(dp_replicate=2, ep=2), mesh=None)


def test_lora_dropout_is_one_mask_over_the_tensor_parallel_ranks_and_recomputation_replays_it(runs):
    """Under sequence parallelism the tp ranks draw from streams of their own, while a column-parallel LoRA layer's
    input is whole on each (and a latent attention's projections', down and up): its dropout mask is drawn a part per
    rank and gathered, so every rank drops the same values (with separate masks each rank's columns of the adapter
    saw another input). A row-parallel layer's input is split by columns, each rank dropping its own. Recomputing
    every block ends on the same weights."""
    results = torch.load(runs / "lora-dropout.pt", weights_only=False)
    first, second = results["masks"]
    assert all(torch.equal(first[name], second[name]) for name in ("q_proj", "q_a_proj", "kv_b_proj"))
    assert not torch.equal(first["o_proj"], second["o_proj"])
    assert all(0.45 < mask.float().mean() < 0.55 for masks in (first, second) for mask in masks.values())
    assert results["recompute_replays"]


@pytest.mark.parametrize("method", ["beside-lora", "alone"])
def test_rows_peft_trains_are_planned_as_the_module_holding_them(method):
    """PEFT's trainable tokens (some rows of GPT-2's token embedding trained, and of its head tied to it; beside LoRA,
    ``trainable_token_indices``, or PEFT's trainable-tokens method alone): the tensor-parallel plan gives the layer
    training them the role of the module whose rows it trains (the embedding's, the head's), as without adapters,
    and the module's weight loads from that module's name; the trained rows are the adapter's own (tp=2 trains the
    first form: test_each_layout_matches_single_process_training)."""
    from meshlight.parallel.adapters import adapter_layers, base_name
    from meshlight.parallel.tensor_plan import model_plan
    from tests.strategies.hf_models import with_lora, with_trained_tokens

    module = lit_causal_lm("gpt2")
    expected = {n: r for n, r in model_plan(module).items() if r in ("embedding", "head")}
    module.model = (with_lora(module.model, "gpt2", tokens=True) if method == "beside-lora" else
                    with_trained_tokens(module.model, "gpt2"))
    planned = {n.replace("base_model.model.", ""): r for n, r in model_plan(module).items() if r in expected.values()}
    assert planned == expected == {"model.transformer.wte": "embedding", "model.lm_head": "head"}
    layers = adapter_layers(module)
    names = {n: base_name(n, layers) for n, _ in module.named_parameters() if ".wte." in n}
    assert sorted(names.values(), key=str) == [None, "model.base_model.model.transformer.wte.weight"], names


def test_lora_layers_tensor_parallelism_cannot_split_are_refused_naming_the_way_out():
    """A LoRA variant other than DoRA (aLoRA), DoRA on the token embedding, or rows trained
    (``trainable_token_indices``) of an embedding other than the token embedding (a position table): refused before
    anything is split (the check
    :func:`~meshlight.parallel.parallelize.parallelize` runs beside the plan's validation), naming the layer and the
    ways out; so is LoRA on an MoE layer's stacked experts (PEFT adapts them in place) stored in a layout meshlight
    does not split over tp, under tp (they would be kept whole on every tp rank), and LoRA on any other parameter
    under tp or ep."""
    import peft

    from meshlight.parallel.adapters import check_splittable_adapters
    from meshlight.parallel.layout import ParallelLayout
    from meshlight.parallel.parallelize import parallelize
    from meshlight.parallel.tensor_plan import model_plan

    activated = lit_causal_lm("llama")  # aLoRA: the adapter acts from its invocation tokens on
    activated.model = peft.get_peft_model(activated.model, peft.LoraConfig(
        r=4, target_modules=["q_proj"], alora_invocation_tokens=[1, 2], task_type="CAUSAL_LM"))
    with pytest.raises(NotImplementedError, match=r"layers.0.self_attn.q_proj is a LoRA layer \(Linear\), but its"
                                                  r" adapter 'default' is a LoRA variant \(ALoraLinearVariant\), which"
                                                  r" tensor parallelism does not split\. Leave that module out of the"
                                                  r" adapter's target_modules .* use plain LoRA or DoRA, or train it"
                                                  r" with tp=1"):
        check_splittable_adapters(activated, model_plan(activated))
    embedding = lit_causal_lm("llama")
    embedding.model = peft.get_peft_model(embedding.model, peft.LoraConfig(r=4, target_modules=["embed_tokens"],
                                                                           use_dora=True))
    with pytest.raises(NotImplementedError, match=r"embed_tokens is DoRA on an embedding \(PEFT's Embedding with"
                                                  r" use_dora=True\), which tensor parallelism does not split \(its"
                                                  r" role 'embedding'\): use plain LoRA on it"):
        check_splittable_adapters(embedding, model_plan(embedding))
    with pytest.raises(NotImplementedError, match=r"layers.0.mlp.experts is PEFT's LoRA on the parameters 'down_proj',"
                                                  r" 'gate_up_proj' of Qwen3MoeExperts, stacked experts in a layout"
                                                  r" meshlight does not split over the tp ranks .* fold expert"
                                                  r" parallelism over the tp ranks instead, each rank holding whole"
                                                  r" experts: experts='fold' with ep in \[2\], or tp=1"):
        parallelize(experts_in_another_layout(lit_causal_lm("qwen3_moe-lora")), ParallelLayout(tp=2), mesh=None)
    on_weight = lit_causal_lm("llama")
    on_weight.model = peft.get_peft_model(on_weight.model, peft.LoraConfig(
        r=4, target_modules=[], target_parameters=["layers.0.self_attn.q_proj.weight"]))
    with pytest.raises(NotImplementedError, match=r"q_proj is PEFT's LoRA on the parameters 'weight' of Linear"
                                                  r" \(target_parameters\), which tp or ep would split but not their"
                                                  r" adapters: leave them out of the adapter .* or train with tp=1 and"
                                                  r" ep=1"):
        parallelize(on_weight, ParallelLayout(tp=2), mesh=None)
    positions = lit_causal_lm("gpt2")
    positions.model = peft.get_peft_model(positions.model, peft.LoraConfig(
        r=4, target_modules=["c_attn"], trainable_token_indices={"wpe": [0, 1]}))
    with pytest.raises(NotImplementedError, match=r"model.base_model.model.transformer.wpe trains some of its rows"
                                                  r" \(PEFT's trainable_token_indices\), but tensor parallelism gives"
                                                  r" it the role 'replicate', .* target the token embedding, or train"
                                                  r" with tp=1"):
        check_splittable_adapters(positions, model_plan(positions))
