"""Hugging Face weights in and out: a ``save_pretrained`` folder loaded by ``PretrainedWeights`` under ZeRO-3 (also into
a model built on the meta device), tp=2 (GPT-OSS, OLMo 2, DeepSeek-V3, Llama 4, Falcon and LLaVA too), pp=2 and
dp=2 × pp=2 × tp=2 (GPT-2 and meshlight's GPT) trains as one process trained from ``from_pretrained`` does, and the
checkpoint it leaves exports (``export_pretrained``) to a folder ``from_pretrained`` loads into that one-process run's
trained model; mismatches and damaged files are named."""

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import meshlight as ml  # noqa: E402
from meshlight.cli import main as cli  # noqa: E402
from meshlight.models.hf_layout import llama_config_json  # noqa: E402
from meshlight.parallel.pretrained import PretrainedWeightsError, export_pretrained, load_pretrained  # noqa: E402
from tests.launch import torchrun  # noqa: E402
from tests.strategies import parity  # noqa: E402
from tests.strategies.hf_models import hf_config, lit_causal_lm, with_lora, with_trained_tokens  # noqa: E402
from tests.strategies.hf_vlm import FAMILIES as VLM_FAMILIES  # noqa: E402
from tests.strategies.hf_vlm import lit_vlm, vlm_config  # noqa: E402
from tests.strategies.workers import pretrained_worker  # noqa: E402
from tests.strategies.workers.pretrained_worker import (  # noqa: E402
    GPT_LLAMA,
    LAYOUTS,
    PROBE,
    from_pretrained,
    logits_of,
    model_of,
)

WORKER = Path(pretrained_worker.__file__)
ALL_FAMILIES = sorted({family for layout in LAYOUTS for family in pretrained_worker.families(layout)})


def save_pretrained(folder: Path, family: str, dtype: torch.dtype = torch.float32) -> Path:
    """A ``save_pretrained`` folder of ``family``'s tiny model (``gpt``: the Llama equivalent of meshlight's GPT in
    GPT_LLAMA), from a seed of its own (not the parity models')."""
    torch.manual_seed(1234)
    if family in VLM_FAMILIES:
        model = transformers.AutoModelForImageTextToText.from_config(vlm_config(family))
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig.from_dict(json.loads(llama_config_json(GPT_LLAMA))) if family == "gpt"
            else hf_config(family))
    model.to(dtype).save_pretrained(folder / family)
    return folder / family


def litgpt_weights(family: str) -> dict[str, torch.Tensor]:
    """A litgpt model's state dict, from a seed of its own (not the parity models')."""
    torch.manual_seed(1234)
    return lit_causal_lm(family).model.state_dict()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pretrained")
    for family in {*ALL_FAMILIES, *(lora.partition("-lora")[0] for lora in pretrained_worker.LORA_FILES.values())}:
        save_pretrained(folder, family)
    for family in set(pretrained_worker.TORCH_FILES.values()):  # litgpt's own files
        (folder / family).mkdir()
        torch.save(litgpt_weights(family), folder / family / "lit_model.pth")
    return folder


@pytest.fixture(scope="module")
def controls(folders) -> dict[str, dict]:
    """One process trained from ``from_pretrained`` (meshlight's GPT: loaded in one process, which equals it, as
    test_a_gpt_loads_llama_weights_and_exports_as_a_llama_in_one_process shows): its losses and its trained model's
    logits on PROBE."""
    results = {}
    for family in ALL_FAMILIES:
        def model(family=family):
            module = model_of(family)
            if family != "gpt":
                module.model = from_pretrained(folders / family)
            return module

        loading = [ml.callbacks.PretrainedWeights(folders / family)] if family == "gpt" else []
        result = parity.train("adamw", model=model, callbacks=loading)
        result["logits"] = logits_of(result.pop("module").model)
        results[family] = result
    return results


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrained-runs")
    for world in (2, 8):
        layouts = [name for name, (_, devices, _) in LAYOUTS.items() if devices == world]
        torchrun(WORKER, world, str(out), str(folders), *layouts, *(pretrained_worker.EXTRAS if world == 2 else []),
                 timeout=1200)
    return out


@pytest.mark.parametrize(("layout", "family"), [(layout, family) for layout in LAYOUTS
                                                 for family in pretrained_worker.families(layout)])
def test_pretrained_weights_train_and_export_under_every_layout_as_one_process(runs, controls, layout, family):
    """Losses within 1e-4 of one process trained from from_pretrained over 20 steps, and the exported folder's logits
    (from_pretrained of what export_pretrained wrote from the run's checkpoint) within 1e-4 of that run's trained
    model's. GPT-2 brings Conv1D, a fused q|k|v split for tp and a head its files do not hold (tied to the
    embedding; under pp=2 the last stage's copy is read from the embedding's key); meshlight's GPT loads a Llama
    folder and exports as a Llama."""
    result = torch.load(runs / f"{layout}-{family}.pt", weights_only=False)
    control = controls[family]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(control["losses"]), rtol=1e-4, atol=0)
    error = (result["logits"] - control["logits"]).norm() / control["logits"].norm()
    assert error <= 1e-4


@pytest.mark.parametrize(("layout", "family"), list(pretrained_worker.TORCH_FILES.items()))
def test_litgpt_files_load_under_every_layout_and_train_as_one_process(runs, folders, layout, family):
    """litgpt's ``lit_model.pth`` (memory-mapped, each rank copying the blocks it holds) loaded under tp=2 (the fused
    q|k|v split part by part), pp=2, ZeRO-3, and ep=2 (litgpt's MoE, each rank holding two experts of each list):
    its losses and final weights within 1e-4 of one process trained from the same file. The run's checkpoint,
    consolidated without the ``model.`` prefix, is a ``lit_model.pth`` litgpt's GPT loads strictly, into exactly the
    run's weights."""
    control = parity.train("adamw", model=lambda: lit_causal_lm(family),
                           callbacks=[ml.callbacks.PretrainedWeights(folders / family / "lit_model.pth")])
    module = control.pop("module")
    result = torch.load(runs / f"{layout}-{family}-pth.pt", weights_only=False)
    parity.assert_parity(result, control)
    module.model.load_state_dict(torch.load(runs / f"{layout}-{family}.pth", weights_only=True))
    assert all(torch.equal(weight, result["weights"][f"model.{name}"])
               for name, weight in module.model.state_dict().items())


@pytest.mark.parametrize(("layout", "family"), list(pretrained_worker.LORA_FILES.items()))
def test_a_lora_model_loads_its_base_models_files_under_every_layout_and_trains_as_one_process(runs, folders, layout,
                                                                                             family, tmp_path):
    """Llama with PEFT's LoRA, its embedding and head trained whole beside (modules_to_save), loading Llama's folder
    (each adapted Linear's weights from the Linear's keys, the embedding's and head's into original and copy, each
    rank its part) under tp=2 and, as DoRA, ZeRO-3 built on the meta device (its adapters initialized after allocation,
    each rank keeping its part of the same tensors, its magnitudes computed from the weights loaded); Qwen3-MoE with
    LoRA on its experts too (PEFT adapts them in place) under ep=2, each rank loading its experts; GPT-2 with rows of
    its embedding trained (trainable_token_indices) under pp=2, its head tied to the embedding on the other stage,
    each stage's rows starting from the rows it loaded: losses and weights within 1e-4 of one process loading the
    same folder into the same model (its adapters initialized so too) over 20 steps. The run's checkpoint exports
    merged (a folder from_pretrained loads) and as PEFT's adapter folder (which PeftModel.from_pretrained loads onto
    the base model's folder), each computing the run's trained model's logits."""
    import peft

    from meshlight.parallel.adapters import initialize_adapters

    def model() -> Any:
        module = lit_causal_lm(family)
        if layout.endswith("-meta"):
            initialize_adapters(module.model)
        return module

    base = folders / family.partition("-lora")[0]
    control = parity.train("adamw", model=model, callbacks=[ml.callbacks.PretrainedWeights(base)])
    control.pop("module")
    result = torch.load(runs / f"{layout}-{family}.pt", weights_only=False)
    parity.assert_parity(result, control)
    trained = lit_causal_lm(family)
    assert not trained.load_state_dict(result["weights"], strict=False).unexpected_keys
    checkpoint, out = runs / f"{layout}-{family}.ckpt", tmp_path
    assert sorted(export_pretrained(checkpoint, out / "merged")) == ["config.json", "model.safetensors"]
    assert cli(["export", str(checkpoint), str(out / "adapter"), "--to", "peft"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "adapter").iterdir()}
    adapted = peft.PeftModel.from_pretrained(from_pretrained(base), out / "adapter")
    with torch.no_grad():
        expected = trained.model(input_ids=PROBE).logits
        for exported in (from_pretrained(out / "merged"), adapted):
            torch.testing.assert_close(exported(input_ids=PROBE).logits, expected, rtol=1e-5, atol=1e-5)


def test_loading_in_one_process_equals_from_pretrained_also_on_the_meta_device_and_casts_noting_it(tmp_path):
    folder = save_pretrained(tmp_path, "llama", dtype=torch.bfloat16)
    expected = from_pretrained(folder).float()
    for meta in (False, True):
        module = lit_causal_lm("llama")
        if meta:
            with torch.device("meta"):
                module.model = transformers.AutoModelForCausalLM.from_config(hf_config("llama"))
        report = load_pretrained(module, folder)
        assert report.cast == {("bfloat16", "float32")} and not report.missing and not report.unexpected
        with torch.no_grad():
            torch.testing.assert_close(module.model(input_ids=PROBE).logits, expected(input_ids=PROBE).logits)


def test_a_lora_model_loads_its_base_models_files_leaving_its_adapters_also_on_the_meta_device(tmp_path):
    """PEFT's LoRA on Llama, under the LightningModule's ``model.`` as any model: the base model's folder loads, each
    adapted Linear's weights (``q_proj.base_layer.weight``) from the Linear's key (``q_proj.weight``), and the
    adapters, which the files do not hold, stay as PEFT initialized them, lora_B zeros: the logits are the base
    model's. Built on the meta device, the adapters are initialized as PEFT does (lora_A Kaiming-uniform, within
    1/√fan_in; lora_B zeros). The embedding and head trained whole beside (``-saved``: PEFT's modules_to_save), the
    original and the trainable copy of each load the same key."""
    folder = save_pretrained(tmp_path, "llama")
    expected = from_pretrained(folder)
    for saved, meta in itertools.product(("", "-saved"), (False, True)):
        module = lit_causal_lm(f"llama-lora{saved}")
        if meta:
            with torch.device("meta"):
                module.model = with_lora(transformers.AutoModelForCausalLM.from_config(hf_config("llama")), "llama",
                                         saved=bool(saved))
        adapters = {name: p.detach().clone() for name, p in module.named_parameters() if ".lora_" in name}
        report = load_pretrained(module, folder)
        assert not report.missing and not report.unexpected
        assert sorted(f"model.base_model.model.{name}" for name in report.adapters) == sorted(adapters)
        assert len(adapters) == 28  # 7 projections × 2 layers × (lora_A, lora_B)
        assert len(report.loaded) == len(set(report.loaded)) == 2 * 9 + 3  # 2 layers' Linears and norms; 3 beside
        for wrapped in ("model.embed_tokens", "lm_head") if saved else ():
            original, copy = (module.model.get_parameter(f"base_model.model.{wrapped}.{held}.weight")
                              for held in ("original_module", "modules_to_save.default"))
            assert torch.equal(original, expected.get_parameter(f"{wrapped}.weight")) and torch.equal(copy, original)
        with torch.no_grad():
            torch.testing.assert_close(module.model(input_ids=PROBE).logits, expected(input_ids=PROBE).logits)
        for name, param in module.named_parameters():
            if ".lora_" in name and not meta:  # as PEFT made them
                assert torch.equal(param, adapters[name]), name
            elif ".lora_B." in name:  # initialized after allocation: zeros
                assert not param.any(), name
            elif ".lora_A." in name:  # Kaiming-uniform
                assert 0 < param.abs().max() <= 1 / param.shape[1] ** 0.5, name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["beside-lora", "alone"])
def test_rows_peft_trains_start_from_the_loaded_rows_also_on_the_meta_device(tmp_path, family, method):
    """PEFT's trainable tokens (some rows of the token embedding trained, and of GPT-2's head tied to it; beside LoRA,
    ``trainable_token_indices``, or PEFT's trainable-tokens method alone): the base model's folder loaded after PEFT
    made them, the trained rows and the originals PEFT keeps beside are the loaded rows, as PEFT makes them on the
    loaded model (so the logits are the base model's), also built on the meta device, where they held nothing."""
    def adapted(model: Any) -> Any:
        return with_lora(model, family, tokens=True) if method == "beside-lora" else with_trained_tokens(model, family)

    folder = save_pretrained(tmp_path, family)
    expected = from_pretrained(folder)
    name, rows = next((name, tensor) for name, tensor in adapted(from_pretrained(folder)).state_dict().items()
                      if ".trainable_tokens_delta." in name)  # the embedding's (a tied head's are the same)
    for meta in (False, True):
        module = lit_causal_lm(family)
        with torch.device("meta" if meta else "cpu"):
            module.model = adapted(transformers.AutoModelForCausalLM.from_config(hf_config(family)) if meta
                                   else module.model)
        report = load_pretrained(module, folder)
        assert not report.missing and not report.unexpected
        assert name.removeprefix("base_model.model.") in report.adapters
        layer = module.model.get_submodule(name.partition(".trainable_tokens_delta.")[0])
        assert torch.equal(layer.trainable_tokens_delta["default"], rows)
        assert torch.equal(layer.trainable_tokens_original["default"], rows)  # (not in the state: a buffer of its own)
        with torch.no_grad():
            torch.testing.assert_close(module.model(input_ids=PROBE).logits, expected(input_ids=PROBE).logits)


def test_dora_magnitudes_are_the_loaded_weights_norms_also_on_the_meta_device(tmp_path):
    """DoRA (a magnitude per output beside LoRA's update of the direction): the base model's folder loaded after PEFT
    made the adapters, each magnitude is the norm of its output's row of the loaded weight (the update starting at
    zero), as PEFT makes it on the loaded model (so the logits are the base model's), also built on the meta device,
    where it held nothing."""
    folder = save_pretrained(tmp_path, "llama")
    expected = from_pretrained(folder)
    magnitudes = {name: tensor for name, tensor in with_lora(from_pretrained(folder), "llama", dora=True)
                  .state_dict().items() if ".lora_magnitude_vector." in name}
    assert len(magnitudes) == 14  # 7 projections × 2 layers
    for meta in (False, True):
        module = lit_causal_lm("llama-lora-dora")
        if meta:
            with torch.device("meta"):
                module.model = with_lora(transformers.AutoModelForCausalLM.from_config(hf_config("llama")), "llama",
                                         dora=True)
        report = load_pretrained(module, folder)
        assert not report.missing and not report.unexpected
        state = module.model.state_dict()
        for name, magnitude in magnitudes.items():
            torch.testing.assert_close(state[name], magnitude, rtol=1e-6, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(module.model(input_ids=PROBE).logits, expected(input_ids=PROBE).logits)


def test_lora_on_an_moe_models_experts_loads_its_base_models_files_also_on_the_meta_device(tmp_path):
    """PEFT's LoRA on Qwen3-MoE's stacked experts (adapted in place, one nested wrapper per parameter): the experts
    load from the files' keys under the outermost wrapper's name, the adapters stay as PEFT made them (on the meta
    device initialized so: lora_A Kaiming-uniform, lora_B zeros), and the logits are the base model's."""
    folder = save_pretrained(tmp_path, "qwen3_moe")
    expected = from_pretrained(folder)
    for meta in (False, True):
        module = lit_causal_lm("qwen3_moe-lora")
        if meta:
            with torch.device("meta"):
                module.model = with_lora(transformers.AutoModelForCausalLM.from_config(hf_config("qwen3_moe")),
                                         "qwen3_moe")
        report = load_pretrained(module, folder)
        assert not report.missing and not report.unexpected
        assert any(".mlp.experts.base_layer.lora_A." in name for name in report.adapters)
        assert all(not p.any() for name, p in module.named_parameters() if ".lora_B." in name)
        # lora_A Kaiming-uniform (on the meta device: initialized after allocation, as PEFT initializes it)
        assert all(0 < p.abs().max() <= 1 / p.shape[1] ** 0.5 for name, p in module.named_parameters()
                   if ".lora_A." in name)
        with torch.no_grad():
            torch.testing.assert_close(module.model(input_ids=PROBE).logits, expected(input_ids=PROBE).logits)


def test_torch_save_files_load_memory_mapped_as_tensors_only(tmp_path):
    """litgpt's ``lit_model.pth`` (a flat state dict, or a training checkpoint's ``{"model": …}``; its MoE with
    experts held as a list too) and Hugging Face's older ``pytorch_model*.bin`` (sharded, Mixtral's experts stored one
    by one, read part by part into its stacked experts) load into exactly the weights saved. A file whose unpickling
    would run code is refused, naming it, and nothing runs."""
    for family, wrapped in (("litgpt", False), ("litgpt_moe", True)):
        weights = litgpt_weights(family)
        torch.save({"model": weights} if wrapped else weights, tmp_path / f"{family}.pth")
        module = lit_causal_lm(family)
        report = load_pretrained(module, tmp_path / f"{family}.pth")
        assert not report.missing and not report.unexpected
        assert all(torch.equal(module.model.state_dict()[k], v) for k, v in weights.items())
    from safetensors.torch import load_file

    for family in ("llama", "mixtral"):  # transformers 5 writes safetensors only: its shards saved again as .bin
        torch.manual_seed(1234)
        saved = transformers.AutoModelForCausalLM.from_config(hf_config(family))
        saved.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
        shards = sorted((tmp_path / "hf").glob("*.safetensors"))
        assert len(shards) > 1
        (tmp_path / family).mkdir()
        for i, shard in enumerate(shards, 1):
            torch.save(load_file(str(shard)), tmp_path / family / f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin")
            shard.unlink()
        module = lit_causal_lm(family)
        load_pretrained(module, tmp_path / family)
        assert all(torch.equal(module.model.state_dict()[k], v) for k, v in saved.state_dict().items())

    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"import pathlib; pathlib.Path({str(ran)!r}).touch()",))

    torch.save({"transformer.wte.weight": Payload()}, tmp_path / "lit_model.pth")
    with pytest.raises(PretrainedWeightsError, match=r"lit_model.pth' cannot be read as a state dict of tensors"):
        load_pretrained(lit_causal_lm("litgpt"), tmp_path)
    assert not ran.exists()


def test_weights_of_another_architecture_are_refused_key_by_key_and_load_partly_when_not_strict(tmp_path):
    folder = save_pretrained(tmp_path, "gpt2")
    module = lit_causal_lm("llama")
    with pytest.raises(PretrainedWeightsError, match=r"do not fit the model: the files lack lm_head.weight,"
                                                     r" model.embed_tokens.weight, .* and \d+ more; no parameter"
                                                     r" takes lm_head.weight|transformer"):
        load_pretrained(module, folder)
    # a wrong shape is refused even when not strict, naming the key and both shapes
    narrower = save_pretrained(tmp_path / "narrow", "llama")
    state = {k: v for k, v in transformers.AutoModelForCausalLM.from_pretrained(str(narrower)).state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"][:-1]
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(narrower / "model.safetensors"))
    with pytest.raises(PretrainedWeightsError, match=r"shapes differ: model.norm.weight: the model's is \[64\], the"
                                                     r" file's \[63\]"):
        load_pretrained(lit_causal_lm("llama"), narrower, strict=False)
    # not strict: what matches loads, the rest is reported
    del state["model.norm.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(narrower / "model.safetensors"))
    report = load_pretrained(lit_causal_lm("llama"), narrower, strict=False)
    assert report.missing == ["model.norm.weight"] and len(report.loaded) == len(state)


def test_a_damaged_or_truncated_file_is_named(tmp_path):
    folder = save_pretrained(tmp_path, "llama")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(PretrainedWeightsError, match=r"model.safetensors. cannot be read as safetensors .*truncated"
                                                     ):
        load_pretrained(lit_causal_lm("llama"), folder)
    file.write_bytes(b"\xff" * 16 + data[16:])
    with pytest.raises(PretrainedWeightsError, match=r"model.safetensors' cannot be read as safetensors"):
        load_pretrained(lit_causal_lm("llama"), folder)
    with pytest.raises(PretrainedWeightsError, match=r"holds no weights files \(.safetensors; or lit_model.pth"):
        load_pretrained(lit_causal_lm("llama"), tmp_path / "empty")


def test_export_shards_above_the_threshold_writes_the_config_and_the_command_line_does_the_same(runs, tmp_path):
    checkpoint = runs / "tp2-llama.ckpt"  # the tp=2 run's checkpoint; its metadata holds the model's config
    files = export_pretrained(checkpoint, tmp_path / "sharded", max_shard_bytes=40_000)
    assert "model.safetensors.index.json" in files and "config.json" in files and len(files) > 3
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f for f in files if f.endswith(".safetensors")}
    whole = from_pretrained(runs / "tp2-llama-hf")
    sharded = from_pretrained(tmp_path / "sharded")
    with torch.no_grad():
        torch.testing.assert_close(sharded(input_ids=PROBE).logits, whole(input_ids=PROBE).logits, rtol=0, atol=0)
    assert cli(["export", str(checkpoint), str(tmp_path / "cli"), "--to", "hf"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["config.json", "model.safetensors"]
    assert cli(["export", str(checkpoint), str(tmp_path / "none"), "--prefix", "missing."]) == 2
    with pytest.raises(PretrainedWeightsError, match=r"holds no PEFT model under prefix 'model.' \(its metadata"
                                                     r" names no adapters\): --to peft writes a PEFT model's adapters;"
                                                     r" write this model with --to hf"):
        export_pretrained(checkpoint, tmp_path / "peft", to="peft")
    with pytest.raises(ValueError, match=r"to='onnx': export writes 'hf' .* or 'peft'"):
        export_pretrained(checkpoint, tmp_path / "onnx", to="onnx")


def test_a_resumed_run_keeps_its_checkpoints_weights(runs, folders):
    """fit(ckpt_path=…) with PretrainedWeights: the files are not read, and the run goes on from the checkpoint's
    weights (the ZeRO-3 run's after 20 steps, resharded to one process), not the files'."""
    callback = ml.callbacks.PretrainedWeights(folders / "llama")
    module = lit_causal_lm("llama")
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=20, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, parity.make_data(8), ckpt_path=runs / "zero3-llama.ckpt")
    assert callback.report is None
    with torch.no_grad():
        logits = module.model(input_ids=PROBE).logits
    exported = torch.load(runs / "zero3-llama.pt", weights_only=False)["logits"]
    torch.testing.assert_close(logits, exported, rtol=1e-5, atol=1e-6)


def test_a_gpt_loads_llama_weights_and_exports_as_a_llama_in_one_process(tmp_path):
    """meshlight's GPT in a Llama configuration computes the logits Hugging Face's Llama computes from the same
    files, and a checkpoint of it exports to a folder from_pretrained loads into those logits; a configuration with
    no Llama equivalent is refused naming the setting, both ways."""
    folder = save_pretrained(tmp_path, "gpt")
    module = model_of("gpt")
    assert not load_pretrained(module, folder).missing
    expected = logits_of(from_pretrained(folder))
    torch.testing.assert_close(logits_of(module.model), expected, rtol=1e-5, atol=1e-5)
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(module, parity.make_data(4))
    trainer.save_checkpoint(tmp_path / "ckpt")
    assert sorted(export_pretrained(tmp_path / "ckpt", tmp_path / "out")) == ["config.json", "model.safetensors"]
    torch.testing.assert_close(logits_of(from_pretrained(tmp_path / "out")), logits_of(module.model), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(PretrainedWeightsError, match=r"GPTConfig\(norm='layernorm'\) has no Hugging Face Llama"
                                                     r" equivalent, which needs norm='rmsnorm'"):
        load_pretrained(ml.demos.LitGPT(GPT_LLAMA.replace(norm="layernorm")), folder)
    gelu = ml.demos.LitGPT(GPT_LLAMA.replace(mlp="gelu"))
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(gelu, parity.make_data(4))
    trainer.save_checkpoint(tmp_path / "gelu")
    with pytest.raises(PretrainedWeightsError, match=r"as a Llama only: GPTConfig\(mlp='gelu'\) has no"):
        export_pretrained(tmp_path / "gelu", tmp_path / "gelu-out")


def test_a_peft_checkpoint_without_its_adapter_configs_is_refused_by_export(tmp_path, monkeypatch):
    """A PEFT model's checkpoint whose metadata lacks the adapters' configs (as checkpoints saved before meshlight
    kept them do) would export its PEFT names as a Hugging Face folder nothing loads: refused, naming the ways out."""
    import meshlight.parallel.pretrained as pretrained

    monkeypatch.setattr(pretrained, "adapter_configs", lambda module: None)
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(lit_causal_lm("gpt2-lora"), parity.make_data(4))
    trainer.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(PretrainedWeightsError, match=r"holds a PEFT model's weights under prefix 'model.', but its"
                                                     r" metadata names no adapter configs .*: resume it for one step"
                                                     r" and save again, or .* PEFT's save_pretrained or"
                                                     r" merge_and_unload"):
        export_pretrained(tmp_path / "ckpt", tmp_path / "out")


def test_an_untied_head_the_files_lack_is_missing_not_read_from_the_embedding(tmp_path):
    """Llama's class declares its head tied to the embedding; with tie_word_embeddings=False (hf_config's) the head
    is a weight of its own, and files without it are refused naming it."""
    from safetensors.torch import save_file

    folder = save_pretrained(tmp_path, "llama")
    state = from_pretrained(folder).state_dict()
    del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    with pytest.raises(PretrainedWeightsError, match=r"the files lack lm_head.weight"):
        load_pretrained(lit_causal_lm("llama"), folder)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava", "gemma3_vision"])
def test_a_vision_language_models_published_layout_loads_as_from_pretrained_does(tmp_path, family):
    """transformers 5 saves these models' weights under their published (older) names — LLaVA's and Gemma 3's
    ``language_model.model.*`` and ``vision_tower.*``, Qwen2.5-VL's ``model.layers.*`` and ``visual.*`` — and renames
    them on loading: load_pretrained reads each weight from the key that renaming maps to it, every weight exactly
    as from_pretrained loads it, none missing and no key left over."""
    from safetensors import safe_open

    folder = save_pretrained(tmp_path, family)
    module = lit_vlm(family)
    with safe_open(str(folder / "model.safetensors"), "pt") as files:
        assert not [key for key in files.keys() if key.startswith("model.language_model.")]  # not the model's names
    report = load_pretrained(module, folder)
    assert not report.missing and not report.unexpected
    expected = transformers.AutoModelForImageTextToText.from_pretrained(folder).state_dict()
    loaded = module.model.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], weight) for name, weight in expected.items())
