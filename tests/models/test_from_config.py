"""A model built from its config file alone: on the meta device, the same parameters as the model itself."""

import dataclasses

import pytest
import yaml

from meshlight.models import ModelConfigError, model_from_config


def test_a_hugging_face_config_builds_its_causal_lm_on_the_meta_device(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=256)
    config.save_pretrained(tmp_path)
    for path in (tmp_path, tmp_path / "config.json"):
        model = model_from_config(str(path))
        assert type(model).__name__ == "LlamaForCausalLM"
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert sum(p.numel() for p in model.parameters()) == sum(
            p.numel() for p in transformers.LlamaForCausalLM(config).parameters())


def test_a_litgpt_config_builds_its_gpt_on_the_meta_device(tmp_path):
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config.from_name("pythia-14m")
    (tmp_path / "model_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(config)))
    model = model_from_config(str(tmp_path))
    assert isinstance(model, litgpt.GPT) and {p.device.type for p in model.parameters()} == {"meta"}
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in litgpt.GPT(config).parameters())


def test_a_path_without_a_config_is_refused_naming_it(tmp_path):
    with pytest.raises(ModelConfigError, match="no such file or folder"):
        model_from_config(str(tmp_path / "missing"))
    with pytest.raises(ModelConfigError, match="no Hugging Face config there"):
        model_from_config(str(tmp_path))
    (tmp_path / "other.yaml").write_text("n_layers: 2\n")
    with pytest.raises(ModelConfigError, match="not a litgpt model config"):
        model_from_config(str(tmp_path / "other.yaml"))
