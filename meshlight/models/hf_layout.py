"""meshlight's :class:`~meshlight.models.GPT` in Hugging Face's Llama layout: the names, the order of the rotary
channels within each head, and the config, for loading Llama weights into a GPT and exporting a GPT as a Llama.

A GPT has a Llama equivalent when its configuration is Llama's: RMSNorm, SwiGLU, rotary positions, no biases and no
mixture of experts. The weights then map one to one, except that meshlight rotates adjacent channel pairs of each
head (``2i, 2i+1``) where Llama's ``rotate_half`` pairs ``i`` with ``i + head_dim/2``: the rows of q and k are
permuted within each head (:func:`rotary_order`), which leaves every attention score as it is.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

import torch

from meshlight.models.gpt import GPTConfig

__all__ = [
    "LlamaLayoutError", "check_llama_equivalent", "gpt_config_from_dict", "gpt_config_json", "llama_config_json",
    "llama_name", "rotary_order",
]

#: meshlight's name pieces → Llama's, per block and outside the blocks
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "attn.wq.weight": "self_attn.q_proj.weight",
          "attn.wk.weight": "self_attn.k_proj.weight", "attn.wv.weight": "self_attn.v_proj.weight",
          "attn.wo.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
          "mlp.w2.weight": "mlp.down_proj.weight"}
_OUTSIDE = {"embed.tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "head.weight": "lm_head.weight"}
_ROTATED = ("attn.wq.weight", "attn.wk.weight")


class LlamaLayoutError(ValueError):
    """A GPT configuration with no Llama equivalent; the message names the setting."""


def check_llama_equivalent(config: GPTConfig) -> None:
    """Raise :class:`LlamaLayoutError` naming the first setting of ``config`` that Llama does not have."""
    settings = (("norm", "rmsnorm"), ("mlp", "swiglu"), ("positions", "rotary"), ("bias", False), ("moe", None))
    for name, llama in settings:
        if getattr(config, name) != llama:
            raise LlamaLayoutError(
                f"GPTConfig({name}={getattr(config, name)!r}) has no Hugging Face Llama equivalent, which needs"
                f" {name}={llama!r} (Llama: RMSNorm, SwiGLU, rotary positions, no biases, no mixture of experts)."
            )


def llama_name(name: str) -> Optional[str]:
    """The Llama name of a GPT state name (``blocks.3.attn.wq.weight`` → ``model.layers.3.self_attn.q_proj.weight``);
    None for a name Llama has no place for."""
    if name in _OUTSIDE:
        return _OUTSIDE[name]
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if match and match.group(2) in _BLOCK:
        return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}"
    return None


def rotary_order(name: str, rows: int, head_dim: int) -> Optional[torch.Tensor]:
    """For q and k (``rows`` rows of heads ``head_dim`` wide): Llama's row ``j`` is meshlight's row ``order[j]``
    (within each head the even channels, then the odd ones); None for every other weight."""
    if not name.endswith(_ROTATED):
        return None
    within = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return (torch.arange(0, rows, head_dim)[:, None] + within[None, :]).reshape(-1)


def llama_config_json(config: GPTConfig) -> str:
    """``config.json`` of the Llama equivalent of ``config`` (Hugging Face's ``LlamaConfig``)."""
    import transformers

    check_llama_equivalent(config)
    llama = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings, hidden_act="silu", attention_bias=False, mlp_bias=False,
        architectures=["LlamaForCausalLM"],
    )
    return llama.to_json_string()


def gpt_config_json(config: GPTConfig) -> str:
    """``config`` as JSON, for a checkpoint's metadata (:func:`gpt_config_from_dict` reads it back)."""
    return json.dumps(dataclasses.asdict(config))


def gpt_config_from_dict(values: dict[str, Any]) -> GPTConfig:
    """The GPTConfig a checkpoint's metadata holds; a mixture of experts stays a dict (it has no Llama equivalent)."""
    return GPTConfig(**values)
