"""examples/finetune_hf.py fine-tunes a Hugging Face model wrapped in a plain LightningModule: a tiny random Llama
in two pipeline stages (its LM head beside the module holding the layers), a tiny Mixtral with its experts split
over two ranks, and a local save_pretrained folder
under ZeRO-3 (loaded by PretrainedWeights, exported back), and LoRA adapters on such a folder under tensor
parallelism (exported merged and as PEFT's adapter folder), each learning (the loss falls) and reporting its answer
accuracy."""

import os
import re
import subprocess
import sys

import pytest

from tests.launch import REPO

pytest.importorskip("transformers")


def run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "examples/finetune_hf.py", "--max-steps", "40", "--val-every", "20", *args]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def losses(result: subprocess.CompletedProcess) -> tuple[float, float]:
    pattern = r"Trained 40 steps in \d+ s: train/loss ([\d.]+), val/loss ([\d.]+), answer accuracy"
    match = re.search(pattern, result.stdout)
    assert match, result.stdout[-2000:]
    return float(match[1]), float(match[2])


def test_a_tiny_llama_fine_tunes_in_two_pipeline_stages(tmp_path):
    train_loss, val_loss = losses(run("--strategy", "pipeline", "--out", str(tmp_path)))
    assert train_loss < 2.0 and val_loss < 2.0  # from about ln(16) = 2.77 at the start
    assert (tmp_path / "lightning_logs" / "version_0").is_dir()


def test_a_tiny_mixtral_fine_tunes_with_its_experts_split_over_two_ranks(tmp_path):
    train_loss, val_loss = losses(run("--family", "mixtral", "--strategy", "moe", "--out", str(tmp_path)))
    assert train_loss < 2.0 and val_loss < 2.0


def test_a_local_save_pretrained_folder_fine_tunes_under_zero3_and_exports(tmp_path):
    """The folder's weights are loaded (the first logged loss is the saved model's, not a fresh draw's) and the
    trained model comes back as a folder from_pretrained loads."""
    import torch
    import transformers

    from examples.finetune_hf import tiny_model

    tiny_model("qwen3").save_pretrained(tmp_path / "model")
    result = run("--model-path", str(tmp_path / "model"), "--strategy", "zero3", "--out", str(tmp_path),
                 "--export", str(tmp_path / "tuned"))
    train_loss, val_loss = losses(result)
    assert train_loss < 2.0 and val_loss < 2.0
    assert "PretrainedWeights: loaded" in result.stdout + result.stderr
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tuned"))
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    assert tuned.config.model_type == "qwen3"
    assert not torch.equal(tuned.model.norm.weight, saved.model.norm.weight)  # trained


def test_lora_adapters_on_a_local_folder_fine_tune_under_tensor_parallelism_and_export_merged_and_alone(tmp_path):
    """--lora 8 --dora: PEFT's DoRA on every Linear but the head of the folder's model, loaded into its base model
    (the magnitudes computed from the weights loaded) and split with it over tp=2; the loss falls from ln(16) with
    the model's own weights frozen. The merged folder and the adapter folder on the saved model compute the same
    logits, which the adapters moved from the saved model's."""
    import peft
    import torch
    import transformers

    from examples.finetune_hf import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    result = run("--model-path", str(tmp_path / "model"), "--lora", "8", "--dora", "--strategy", "tp", "--out",
                 str(tmp_path), "--export", str(tmp_path / "merged"), "--export-adapter", str(tmp_path / "adapter"))
    train_loss, val_loss = losses(result)
    assert train_loss < 2.4 and val_loss < 2.4  # from about ln(16) = 2.77
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    probe = torch.arange(16).reshape(2, 8)
    with torch.no_grad():
        before, after = saved(input_ids=probe).logits, merged(input_ids=probe).logits
        adapted = peft.PeftModel.from_pretrained(saved, str(tmp_path / "adapter"))(input_ids=probe).logits
    torch.testing.assert_close(adapted, after, rtol=1e-5, atol=1e-5)
    assert (after - before).abs().max() > 1e-2
