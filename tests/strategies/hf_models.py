"""Tiny, randomly initialized causal LMs from Hugging Face ``transformers`` and from litgpt wrapped in a plain
LightningModule, as users write them: the model is built from a config (never downloaded) and ``training_step``
calls ``F.cross_entropy`` on its logits."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 16, 64, 8, 4, 128, 2
#: layers of the ``-deep`` models: an interleaved pipeline of 2 ranks × 2 virtual stages needs a layer for each
DEEP_LAYERS = 4
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "litgpt")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")  # 4 experts, top-2, in every layer
#: families whose structure only tensor parallelism meets differently: their parity runs are tp2's (Qwen2-MoE and
#: OLMoE: 4 experts, top-2, in every layer, Qwen2-MoE's with a shared expert; DeepSeek-V3: after a dense first layer;
#: litgpt's in Mixtral's configuration: a list of experts; Llama 4: a dense layer, then 4 experts each taking every
#: token, top-1, beside a shared expert; Apertus: a learned activation between its MLP's projections; DeepSeek-V3.2 and
#: GLM-5: DeepSeek-V3's attention with a sparse attention's key selector inside it, kept whole on every rank; AFMoE: an
#: output gate registered after its output projection, both hidden → hidden wide, and an MoE block holding its
#: routing's bias itself beside the shared expert tp splits); OLMo 2 and DeepSeek-V3 also in float64, OLMoE, Llama 4
#: and AFMoE there alone (:data:`PARITY_RTOL`)
TP_FAMILIES = ("phi3", "glm4", "qwen2_moe", "olmo2", "olmo2-fp64", "olmoe-fp64", "deepseek_v3",
               "deepseek_v3-fp64", "ernie4_5_moe", "litgpt_moe", "llama4-fp64", "apertus", "deepseek_v32",
               "glm_moe_dsa", "afmoe-fp64")
#: parity tolerances other than 1e-4, and why; each with a float64 twin (``-fp64``: :func:`in_float64`) whose runs
#: match to about 1e-13, which shows the gap is rounding, not a different computation:
#:
#: - OLMo 2's q and k norms over all heads make its q and k projections' weights scale-free (the norm undoes their
#:   size), and Adam's step turns the rounding of the norms' float32 statistics — summed over 2 tensor-parallel
#:   ranks' halves of the heads, not over all at once — into steps of its own: 1.1e-4 relative in one projection
#:   after 20 steps at tp=2 (its losses match to 4e-6);
#: - Qwen2 trains with SGD at 0.3 (:func:`training_options`), a step large enough that 20 of them magnify any
#:   reduction order's rounding: on one 2-core host within 1e-4, on another (AMD EPYC) 1.2e-4 under ddp and 1.6e-4
#:   at tp=2 in one value projection (its losses within 6e-5);
#: - DeepSeek-V3's q up-projection reads a normed latent whose gradient, under tp, is the sum of the ranks' heads'
#:   parts: 8.5e-5 at tp=2 (1.1e-5 under ddp); 8.9e-14 in float64 (under ddp its float64 twin leaves one process by
#:   1.6e-7: its router computes in float32 whatever the model's dtype).
#:
#: - Fewer key/value heads than tp ranks (``-kv1``, ``-kv2``: each rank computes the one its query heads read, and
#:   the ranks sharing it sum their parts of its gradient): after 20 AdamW steps at 1e-2 in fp32 (losses within 1e-6)
#:   Llama with one key/value head leaves one process by 1.2e-3 at tp=2 (2.3e-4 under ddp), litgpt by 1.2e-3 (3.4e-4),
#:   Falcon-7B's multi-query layout by 1.9e-3 (7e-5), Qwen3 by 7.6e-5 at tp=2 and 2.7e-4 at tp=4, Phi-3 with two at
#:   tp=4 by 2.1e-4; StarCoder's (SGD at 0.3 for its key biases) by 1.1e-4 at tp=2 and 1.8e-4 at tp=4. In float64
#:   each matches to about 1e-12, so they run there;
#: - Persimmon (its q|k|v head by head, SGD at 0.3 for its biases) leaves one process by 4.6e-4 at tp=2 in fp32, by
#:   2.2e-4 under ddp (its losses by 1e-4 and 5e-5: its layer norms over each 8-wide head amplify rounding), and by
#:   1.7e-13 in float64;
#: - BLOOM (SGD at 0.3 for its q|k|v biases) leaves one process by 2.2e-4 at tp=2 in fp32 in a layer norm's bias, by
#:   9.3e-5 under ddp (its losses by 3e-5 and 1.2e-5), and by 7e-14 in float64.
#: - Qwen3.5's linear attention (a gated delta rule run in chunks, torch's reference kernels on CPU) leaves one process
#:   in fp32 under ddp alike: after 20 AdamW steps at 3e-3 by 4.6e-3 (7.8e-3 at tp=2; losses by 1e-6 and 1e-5), at 1e-2
#:   by 0.6; in float64 by 5e-15 under ddp, tp=2 and 3d, so it runs there (its MoE too).
#: - Jamba trains with AdamW at 3e-3 (:func:`training_options`): at 1e-2 its Mamba-1 mixer (Hugging Face's scan in
#:   torch, partly float32 whatever the model's dtype) makes 20 steps chaotic, leaving one process by 2e-2 under ddp
#:   alike (1.1e-1 at tp=2; 7.7e-5 in float64, its float32 parts kept); at 3e-3 by 3e-6 under ddp and 1.4e-5 at tp=2.
#: - Kimi Linear's KDA layers, 8 heads wide, left one process in fp32 by 2.9e-4 under ddp (5.4e-3 at tp=2, losses
#:   within 1.7e-4) and in float64 by 7.1e-6 under ddp and 6.2e-6 at tp=2 (its float32 parts: a gated norm, the
#:   forget gate). With 2 heads (the suite's: a quarter of the KDA's cost, 7.8 s to 2.8 s for one process's 20
#:   steps) it matches at tp=2 in float64 to 1.5e-13, so it runs there.
#: - Gemma 4's MoE leaves one process in fp32 by 1.3e-4 at tp=2 in its first layer's q projection (1.1e-4 under
#:   dp=2 × tp=2 × ep=4, 5.5e-6 under ddp; its losses within 9e-6), and by 6e-14 in float64, so it runs there under
#:   tp (in fp32 under ep and pp, within 1e-4).
#: - Qwen3-VL (tests.strategies.hf_vlm) leaves one process in fp32 by 1.5e-4 at tp=2 in a q projection (its losses
#:   within 4e-7), and in float64 by 5.7e-9 in its vision encoder's fused q|k|v bias, whose key part has an
#:   exactly-zero gradient that Adam turns from rounding noise into steps (its losses within 6e-15; the q projection
#:   within 1e-10), so it runs there.
#: - OLMoE (OLMo 2's q and k norms over all heads, beside its experts) leaves one process by 2.6e-4 at tp=2 in fp32 in
#:   its token embedding on an Intel Xeon host (within 1e-4 on the host before it; 4.9e-5 under ddp, its losses within
#:   2.3e-5), and by 1.5e-14 in float64, so it runs there under tp.
#: - Llama 4's experts each run on every token, scaled by the router's score: under tp each rank's half of every
#:   expert adds its part of the router's gradient, which leaves one process in a router weight on the same Intel host
#:   by 9.95e-5 at tp=2, 1.02e-4 without sequence parallelism and 9.5e-5 under dp=2 × pp=2 × tp=2 (1.3e-5 under ddp,
#:   its losses within 1e-6), and by 1.2e-13 or less in float64, so its tp runs are float64's (pp=2 stays fp32).
#: - AFMoE (4 experts, top-2 of sigmoid scores) leaves one process at tp=2 by 1.6e-3 in fp32 in a q projection after
#:   its MoE layer, its other weights by up to 8.8e-4 (4e-5 under ddp; its losses within 1e-5), with every token
#:   routed alike at every step (not a routing flip): one AdamW step already leaves it by 5e-5 in an MLP weight (ddp
#:   1.2e-6). In float64 it matches to 5.5e-12 — rounding, which AdamW's steps magnify — so that run is float64's.
#: - Llama with a vocabulary of 61 under loss parallelism (its cross-entropy computed from the logits split 31 + 30)
#:   leaves one process at tp=2 by 7.7e-5 in an MLP weight in fp32, and by 8.7e-14 in float64, so that run is
#:   float64's.
#: - LLaVA-NeXT (SGD at 0.3 for CLIP's key biases) leaves one process at pp=2 by 3.4e-5 in its losses in fp32 (1.4e-4
#:   at tp=2), and by 0 in its losses and below 1e-12 in its weights in float64, so that run is float64's.
#: - Idefics3 (SGD at 0.3 for SigLIP's key biases) leaves one process at pp=2 by 2.6e-4 in its losses in fp32 (its
#:   first six alike to five digits), and by 2e-13 (losses and weights) in float64, so that run is float64's.
#: - DeepSeek-V4 and HY-V4 train with AdamW at 3e-3 (:func:`training_options`): at 1e-2, 20 steps of their tiny
#:   configs leave one process under ddp alike (by 1.8e-3 and 1.7e-3). At 3e-3 in fp32 DeepSeek-V4 leaves it at pp=2
#:   by 5.2e-5 (ddp 5.8e-5) and in float64 by 5.9e-7 (ddp 1.4e-6: its hyper-connections compute in float32 whatever
#:   the model's dtype), so that run is float64's; HY-V4 by 1.3e-5 (ddp 7.2e-6).
PARITY_RTOL = {"olmo2": 3e-4, "qwen2": 3e-4, "deepseek_v3": 2e-4, "olmo2-fp64": 1e-10, "qwen2-fp64": 1e-10,
               **dict.fromkeys(
                   ("qwen3-kv1-fp64", "llama-kv1-fp64", "litgpt-kv1-fp64", "falcon-fp64", "falcon_grouped-fp64",
                    "gpt_bigcode-fp64", "phi3-kv2-fp64", "persimmon-fp64", "bloom-fp64", "qwen3_5-fp64",
                    "qwen3_5_moe-fp64", "gemma4_moe-fp64", "olmoe-fp64", "llama4-fp64",
                    "llama-vocab61-fp64", "deepseek_v3-fp64", "afmoe-fp64", "kimi_linear-fp64"), 1e-10),
               # (a fused q|k|v bias, whose key part's gradient is exactly zero: Adam's steps on its rounding noise)
               "qwen3_vl-fp64": 1e-7, "qwen3_vl-deep-fp64": 1e-7, "idefics3-fp64": 1e-10,
               "llava_next-fp64": 1e-10}


def hf_config(family: str, vocab: int = VOCAB, layers: int = LAYERS, kv_heads: int = KV_HEADS) -> Any:
    """A tiny config of ``family``: ``layers`` layers, no dropout; GQA (8 query, ``kv_heads`` key/value heads) and an
    untied head, except GPT-2 (8 heads, its head tied to the token embedding)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":  # Llama's structure under its own classes, sliding-window attention off
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":  # q, k, v biases
        return transformers.Qwen2Config(**common)
    if family == "qwen3":  # QK-norm, an explicit head_dim
        return transformers.Qwen3Config(**common, head_dim=DIM // HEADS)
    if family == "gpt2":  # Conv1D, a fused q|k|v, learned positions, the head tied to the token embedding
        return transformers.GPT2Config(vocab_size=vocab, n_embd=DIM, n_layer=layers, n_head=HEADS, n_inner=HIDDEN,
                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       use_cache=False)
    if family == "gpt_neox":  # a fused q|k|v held head by head, which its published tensor-parallel plan says
        return transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=layers,
                                          num_attention_heads=HEADS, intermediate_size=HIDDEN, use_cache=False,
                                          max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0)
    # hybrids of Mamba mixers (kept whole on every tp rank) and attention layers, each mixer before an attention layer;
    # no mamba kernels on CPU: Hugging Face's reference scan in torch
    mamba2 = dict(mamba_n_heads=8, mamba_d_head=2 * DIM // 8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)
    if family == "jamba":  # Mamba-1 mixers, 4 experts (top-2) in every other layer
        return transformers.JambaConfig(**{**common, "num_hidden_layers": max(layers, 2)}, num_experts=4,
                                        num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                        attn_layer_period=2, attn_layer_offset=1,
                                        mamba_d_state=8, mamba_dt_rank=8, pad_token_id=None, bos_token_id=0,
                                        eos_token_id=1)
    if family == "bamba":  # Mamba-2 mixers
        return transformers.BambaConfig(**{**common, "num_hidden_layers": max(layers, 2)}, **mamba2,
                                        attn_layer_indices=[1], pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "falcon_h1":  # a Mamba-2 mixer beside attention in every layer, each scaled by muP multipliers
        return transformers.FalconH1Config(**common, **mamba2, mamba_d_ssm=2 * DIM, mlp_multipliers=[0.8, 0.6],
                                           ssm_multipliers=[0.5, 0.7, 0.9, 1.1, 1.3], key_multiplier=0.7,
                                           attention_in_multiplier=0.9, attention_out_multiplier=0.8,
                                           ssm_in_multiplier=1.2, ssm_out_multiplier=0.6, embedding_multiplier=2.0,
                                           lm_head_multiplier=0.5, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "granite4":  # Granite 4's hybrid: Mamba-2 mixers, 4 experts (top-2) in every layer beside a shared
        # expert whose gate|up is fused (cut by chunk(2)), Granite's multipliers
        return transformers.GraniteMoeHybridConfig(
            **{**common, "num_hidden_layers": max(layers, 2), "intermediate_size": HIDDEN // 2}, **mamba2,
            layer_types=["mamba", "attention"] * (max(layers, 2) // 2), num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=HIDDEN, embedding_multiplier=12.0, logits_scaling=4.0, residual_multiplier=0.22,
            attention_multiplier=1 / 8, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family.startswith("lfm2"):  # LFM2's short convolution over the sequence (gated, depthwise) before an attention
        # layer with QK-norm; "lfm2_moe": a dense first layer, then 4 experts (top-2, sigmoid routing)
        lfm2 = dict(**{**common, "num_hidden_layers": max(layers, 2)}, layer_types=["conv", "full_attention"],
                    pad_token_id=None, bos_token_id=0, eos_token_id=1)
        if family == "lfm2_moe":
            return transformers.Lfm2MoeConfig(**lfm2, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=HIDDEN // 2)
        return transformers.Lfm2Config(**lfm2)
    if family == "minimax":  # MiniMax-Text-01's lightning attention (linear, decaying per head) before a softmax
        # attention layer, 4 experts (top-2) in every layer
        return transformers.MiniMaxConfig(**{**common, "num_hidden_layers": max(layers, 2)}, head_dim=DIM // HEADS,
                                          layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                                          num_experts_per_tok=2, block_size=8, router_jitter_noise=0.0,
                                          pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "kimi_linear":  # Kimi Linear: a KDA linear attention layer (short convolutions over the sequence;
        # 2 heads) before a latent attention layer; a dense first layer, then 4 experts (top-2) beside a shared one
        return transformers.KimiLinearConfig(
            **{**common, "num_hidden_layers": max(layers, 2), "num_key_value_heads": HEADS},
            layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
            linear_head_dim=DIM // HEADS, linear_num_heads=2, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=HIDDEN // 2, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "falcon_rw":  # Falcon-RW's ALiBi, also folded into the attention mask per head; q|k|v head by head
        return transformers.FalconConfig(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=layers,
                                         num_attention_heads=HEADS, alibi=True, multi_query=False, bias=True,
                                         new_decoder_architecture=False, parallel_attn=False, attention_dropout=0.0,
                                         hidden_dropout=0.0, use_cache=False, pad_token_id=None, bos_token_id=0,
                                         eos_token_id=1)
    if family.startswith("falcon"):  # a fused q|k|v: one query head group's q, k and v together ("falcon_grouped":
        # its newer layout) or (Falcon-7B's multi-query) all q, then one key and one value head; attention and MLP
        # in parallel from one norm
        grouped = family == "falcon_grouped"
        return transformers.FalconConfig(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=layers,
                                         num_attention_heads=HEADS, num_kv_heads=kv_heads if grouped else None,
                                         new_decoder_architecture=grouped, multi_query=not grouped, bias=False,
                                         alibi=False, attention_dropout=0.0, hidden_dropout=0.0, use_cache=False,
                                         max_position_embeddings=64, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "bloom":  # ALiBi biases per head built by the model, a fused q|k|v head by head, q|k|v biases
        return transformers.BloomConfig(vocab_size=vocab, hidden_size=DIM, n_layer=layers, n_head=HEADS,
                                        hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)
    if family == "mpt":  # ALiBi biases per head, its fused q|k|v one after another, no biases
        return transformers.MptConfig(vocab_size=vocab, d_model=DIM, n_layers=layers, n_heads=HEADS, expansion_ratio=2,
                                      max_seq_len=64, use_cache=False)
    block_mlp = dict(max_position_embeddings=64, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                     use_cache=False)
    if family.startswith("opt"):  # its MLP's Linears on the block beside its norms, run on the flattened tokens; tied
        # head; its final norm registered before its layers ("opt_narrow": OPT-350m's embeddings half as wide as the
        # blocks, project_in and project_out between them, registered before the layers too)
        return transformers.OPTConfig(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=layers, ffn_dim=HIDDEN,
                                      num_attention_heads=HEADS, dropout=0.0, **block_mlp,
                                      word_embed_proj_dim=DIM // 2 if family == "opt_narrow" else DIM)
    if family == "xglm":  # its MLP's Linears on the block beside its norms; sinusoidal positions
        return transformers.XGLMConfig(vocab_size=vocab, d_model=DIM, num_layers=layers, attention_heads=HEADS,
                                       ffn_dim=HIDDEN, dropout=0.0, **block_mlp)
    if family == "biogpt":  # its MLP's Linears on the block beside its norms; learned positions read from the mask
        return transformers.BioGptConfig(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=layers,
                                         num_attention_heads=HEADS, intermediate_size=HIDDEN, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **block_mlp)
    if family.startswith("qwen3_5"):  # a Gated DeltaNet layer (linear attention: kept whole on every tp rank), then
        # a gated attention layer (q and its output gate head by head, q and k norms over each head); Qwen3.5's 3:1
        # pattern adds nothing tp meets, and its two more DeltaNet layers doubled one process's 20 steps in float64
        # (2.2 s, 1.1 s with one); "qwen3_5_moe": 4 experts, top-2, beside a shared expert, in every layer
        hybrid = dict(vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=max(layers, 2),
                      layer_types=["linear_attention", "full_attention"] * (max(layers, 2) // 2),
                      num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=DIM // HEADS,
                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
                      max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
        if family == "qwen3_5_moe":
            return transformers.Qwen3_5MoeTextConfig(**hybrid, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=HIDDEN // 4,
                                                     shared_expert_intermediate_size=HIDDEN // 4)
        return transformers.Qwen3_5TextConfig(**hybrid)
    if family == "gpt_bigcode":  # StarCoder's: multi-query, a fused q|k|v of all q, then one key and one value head
        return transformers.GPTBigCodeConfig(vocab_size=vocab, n_embd=DIM, n_layer=layers, n_head=HEADS, n_inner=HIDDEN,
                                             n_positions=64, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                             attn_pdrop=0.0, use_cache=False)
    if family == "persimmon":  # a fused q|k|v held head by head (Fuyu's language model), layer norms over each head
        return transformers.PersimmonConfig(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=layers,
                                            num_attention_heads=HEADS, intermediate_size=HIDDEN, qk_layernorm=True,
                                            max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                                            use_cache=False, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "openai_gpt":  # GPT-1: Conv1D, a q|k|v one after another, norms after attention and the MLP
        return transformers.OpenAIGPTConfig(vocab_size=vocab, n_embd=DIM, n_layer=layers, n_head=HEADS,
                                            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "phi3":  # a fused q|k|v sliced by the config's head counts, a fused gate|up cut by chunk(2)
        return transformers.Phi3Config(**common, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "glm4":  # a fused gate|up cut by chunk(2), partial rotary, norms after attention and the MLP too
        return transformers.Glm4Config(**common, head_dim=DIM // HEADS, pad_token_id=None, bos_token_id=0,
                                       eos_token_id=1)
    if family == "afmoe":  # an output gate (sigmoid(gate_proj(x)) times the attention's output) registered after
        # o_proj, both hidden → hidden wide; QK-norm, norms before and after the MLP; a dense first layer, then 4
        # sigmoid-routed experts beside a shared one, the MoE block holding the routing's bias itself
        return transformers.AfmoeConfig(**common, head_dim=DIM // HEADS, num_dense_layers=1, sliding_window=4,
                                        num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                                        moe_intermediate_size=HIDDEN // 4, output_router_logits=False)
    if family == "apertus":  # a learned activation (xIELU: two scalars) between up_proj and down_proj, no gate;
        # QK-norm
        return transformers.ApertusConfig(**common, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    # Gemma's: the token embedding scaled by sqrt(hidden), tied to the head; a sliding-window layer, then a global one;
    # norms before and after attention and the MLP (Gemma 2 and 3: scaling by 1 + w)
    gemma = dict(**{**common, "num_hidden_layers": max(layers, 2), "tie_word_embeddings": True},
                 head_dim=DIM // HEADS, sliding_window=4, pad_token_id=None, bos_token_id=0, eos_token_id=1,
                 layer_types=["sliding_attention", "full_attention"] * (max(layers, 2) // 2))
    if family == "gemma2":  # the attention's logits and the final ones soft-capped (tanh); queries scaled by
        # query_pre_attn_scalar
        return transformers.Gemma2Config(**gemma, query_pre_attn_scalar=16)
    if family == "gemma3":  # QK-norm, no soft-capping, a rotary base per layer type
        return transformers.Gemma3TextConfig(**gemma, query_pre_attn_scalar=16)
    if family.startswith("gemma4"):  # Gemma 3's with a wider head on the global layer, where the keys are also the
        # values (k = v) and key/value heads are fewer, its rotary partial ("proportional"); a value norm without scale;
        # a scalar per layer. "gemma4_moe": 4 experts (top-2) beside the MLP in every layer, its router normalizing its
        # input; "gemma4_edge": E2B's per-layer embeddings, its last 2 of 4 layers reusing earlier layers' keys and
        # values (refused by tensor and pipeline parallelism)
        if family == "gemma4_edge":
            edge = {**gemma, "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}
            return transformers.Gemma4TextConfig(**edge, global_head_dim=16, hidden_size_per_layer_input=8,
                                                 vocab_size_per_layer_input=vocab, num_kv_shared_layers=2)
        experts = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=HIDDEN // 2)
        return transformers.Gemma4TextConfig(**gemma, global_head_dim=16, num_global_key_value_heads=2,
                                             attention_k_eq_v=True, hidden_size_per_layer_input=0,
                                             **(experts if family == "gemma4_moe" else {}))
    if family == "olmo2":  # q and k norms over all heads at once, norms after attention and the MLP
        return transformers.Olmo2Config(**common, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    moe = dict(num_experts_per_tok=2, output_router_logits=False)
    if family == "deepseek_v3":  # latent attention (q and k|v through normed low-rank latents, a rotary part of k
        # shared by all heads), a dense first layer, then 4 routed experts and a shared one
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": HEADS}, **moe, n_routed_experts=4, n_shared_experts=1,
            moe_intermediate_size=HIDDEN // 2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=None, bos_token_id=0,
            eos_token_id=1)
    if family in ("deepseek_v32", "glm_moe_dsa"):  # DeepSeek-V3's latent attention and MoE, with DeepSeek Sparse
        # Attention: a lightning indexer (4 heads of its own, no gradients) picks the 6 keys each query attends to
        config = transformers.DeepseekV32Config if family == "deepseek_v32" else transformers.GlmMoeDsaConfig
        layers_of = {} if family == "deepseek_v32" else {"mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1)}
        return config(**{**common, "num_key_value_heads": HEADS}, **moe, **layers_of, n_routed_experts=4,
                      n_shared_experts=1, moe_intermediate_size=HIDDEN // 2, n_group=1, topk_group=1,
                      first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=4,
                      qk_nope_head_dim=8, v_head_dim=8, index_n_heads=4, index_head_dim=8, index_topk=6,
                      pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family.startswith("llama4"):  # a dense layer, then a MoE one: 4 experts stored transposed, each run on every
        # token scaled by its sigmoid router score (zero where not chosen: top-1), added in place into a shared
        # expert's output; chunked attention (chunks of 4 tokens) with rotary and an L2 QK-norm, then a layer without
        # rotary whose queries are scaled by a temperature that grows with the position. "-unchunked": no chunks;
        # "-unchunked-untempered": nor the temperature (what context parallelism splits)
        return transformers.Llama4TextConfig(
            **{**common, **moe, "intermediate_size": HIDDEN // 2, "num_experts_per_tok": 1},
            intermediate_size_mlp=HIDDEN, num_local_experts=4, interleave_moe_layer_step=2, no_rope_layers=[1, 0],
            attention_chunk_size=None if "-unchunked" in family else 4, floor_scale=4,
            attn_temperature_tuning="-untempered" not in family, head_dim=DIM // HEADS, pad_token_id=None,
            bos_token_id=0, eos_token_id=1)
    if family == "ernie4_5_moe":  # a dense first layer; the router holds its score correction in a module of its own
        return transformers.Ernie4_5_MoeConfig(**{**common, **moe}, moe_num_experts=4, moe_k=2,
                                               moe_intermediate_size=HIDDEN // 2, moe_layer_start_index=1,
                                               pad_token_id=None, bos_token_id=0, eos_token_id=1)
    if family == "olmoe":  # OLMo's q and k norms over all heads, experts as wide as the MLP they replace
        return transformers.OlmoeConfig(**common, **moe, num_experts=4, pad_token_id=None, bos_token_id=0,
                                        eos_token_id=1)
    if family == "qwen2_moe":  # a shared expert (and its sigmoid gate) beside the routed ones, on the flattened tokens
        return transformers.Qwen2MoeConfig(**common, **moe, num_experts=4, moe_intermediate_size=HIDDEN // 2,
                                           shared_expert_intermediate_size=HIDDEN)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, **moe, num_local_experts=4, router_jitter_noise=0.0)
    if family == "qwen3_moe":  # top-k weights renormalized (norm_topk_prob), experts narrower than the hidden size
        return transformers.Qwen3MoeConfig(**common, **moe, num_experts=4, moe_intermediate_size=HIDDEN // 2,
                                           norm_topk_prob=True, head_dim=DIM // HEADS)
    if family == "gpt_oss":  # attention sinks, sliding-window and full layers alternating, YaRN rotary, q/k/v/o and
        # router biases; its stacked experts transposed ([E, H, 2·I], gate and up interleaved), with biases
        yarn = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=16,
                    beta_fast=32.0, beta_slow=1.0, truncate=False)
        return transformers.GptOssConfig(**common, **moe, head_dim=DIM // HEADS, num_local_experts=4,
                                         sliding_window=4, rope_parameters=yarn,
                                         layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    # hyper-connections: between blocks the hidden state is hc_mult streams of it, widened from the embedding's output
    # by the forward and collapsed after the blocks by a head registered after the final norm, run before it
    if family == "deepseek_v4":  # a hash-routed MoE layer (its experts picked by the token ids the forward hands it)
        # after a learned-router one; one key/value head; compressed attention beside sliding windows
        return transformers.DeepseekV4Config(
            vocab_size=vocab, hidden_size=DIM, moe_intermediate_size=HIDDEN // 2, num_hidden_layers=layers,
            num_attention_heads=HEADS, num_key_value_heads=1, head_dim=DIM // 4, q_lora_rank=DIM // 2,
            n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64, hc_mult=2, hc_sinkhorn_iters=3,
            sliding_window=4, o_groups=2, o_lora_rank=DIM // 4, index_n_heads=2, index_head_dim=8, index_topk=4,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * (layers // 2),
            mlp_layer_types=["moe", "hash_moe"] * (layers // 2), use_cache=False, tie_word_embeddings=False,
            pad_token_id=None)
    if family == "hy_v4":  # latent attention with DeepSeek's sparse attention's key selector, each block handing its
        # selection to the next beside the hidden state (a "full" layer computes its own), experts beside a shared one
        return transformers.HYV4Config(
            vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN, moe_intermediate_size=HIDDEN // 2,
            num_hidden_layers=layers, num_attention_heads=HEADS, n_routed_experts=4, num_experts_per_tok=2,
            q_lora_rank=DIM // 2, kv_lora_rank=DIM // 4, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            index_topk=4, index_head_dim=8, index_n_heads=2, hc_mult=2, max_position_embeddings=64,
            mlp_layer_types=["dense", "sparse"] * (layers // 2), use_cache=False, tie_word_embeddings=False,
            pad_token_id=None, bos_token_id=0, eos_token_id=1)
    raise ValueError(f"family={family!r}: choose one of {FAMILIES + MOE_FAMILIES + TP_FAMILIES}")


def attention_implementation(family: str) -> str:
    """The attention a parity model of ``family`` (a config's ``model_type``) runs: sdpa, but eager for GPT-OSS, whose
    attention sinks no sdpa kernel takes, Gemma 2, whose soft-capped logits none does, and OpenAI GPT, BLOOM, MPT and
    XGLM, DeepSeek-V4 and HY-V4, which have no other."""
    return ("eager" if family in ("gpt_oss", "gemma2", "openai_gpt", "bloom", "mpt", "xglm", "deepseek_v4", "hy_v4")
            else "sdpa")


def litgpt_model(vocab: int = VOCAB, layers: int = LAYERS, moe: bool = False, kv_heads: int = KV_HEADS,
                 grouped: bool = False) -> Any:
    """litgpt's GPT in a Llama configuration: a fused q|k|v for grouped queries, RMSNorm, SwiGLU, rotary; ``moe``: in
    Mixtral's (4 experts, top-2, a list of SwiGLU MLPs each); ``grouped``: in DeepSeek-V3's (a dense first layer,
    then 4 experts in 2 groups — the best group's top 2 of sigmoid scores, normalized and scaled by 2.5 — beside a
    shared expert; litgpt leaves that router's weight uninitialized, drawn here as its Linears are)."""
    from litgpt.config import Config
    from litgpt.model import GPT

    mlp = (dict(mlp_class_name="LLaMAMoE", moe_intermediate_size=HIDDEN // 2, n_expert=4, n_expert_per_token=2)
           if moe or grouped else dict(mlp_class_name="LLaMAMLP"))
    if grouped:
        mlp.update(n_shared_expert=1, n_expert_groups=2, n_topk_groups=1, n_topk_scores_per_group=2,
                   norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1)
    model = GPT(Config(n_layer=layers, n_head=HEADS, n_query_groups=kv_heads, n_embd=DIM, vocab_size=vocab,
                       padded_vocab_size=vocab, block_size=64, bias=False, norm_class_name="RMSNorm",
                       intermediate_size=HIDDEN, rotary_percentage=1.0, parallel_residual=False, **mlp))
    for module in model.modules():
        if type(module).__name__ == "GroupedTopkRouter":
            torch.nn.init.normal_(module.weight, std=0.02)
    return model


def training_options(family: str) -> dict[str, Any]:
    """The optimizer a parity run trains ``family`` with: AdamW, except SGD for Qwen2, GPT-2, GPT-NeoX, GLM-4,
    StarCoder (GPT-BigCode), Persimmon, OpenAI GPT, BLOOM, Falcon-RW, OPT, XGLM and BioGPT, whose key biases have an
    exactly-zero gradient (softmax ignores a per-query constant) that Adam would turn from float noise into full-size
    steps that no two layouts take alike; and AdamW at 3e-3 for Jamba, DeepSeek-V4 and HY-V4 (:data:`PARITY_RTOL`
    says why)."""
    biased = ("qwen2", "gpt2", "gpt_neox", "glm4", "gpt_bigcode", "persimmon", "openai_gpt", "bloom", "falcon_rw",
              "opt", "opt_narrow", "xglm", "biogpt")
    if family in ("jamba", "deepseek_v4", "hy_v4"):
        return {"lr": 3e-3}
    return {"optimizer": "sgd", "lr": 0.3} if family in biased else {}


class LitCausalLM(pl.LightningModule):
    """Next-token training of a Hugging Face ``AutoModelForCausalLM`` (or litgpt's GPT) on ``(inputs, targets)``
    batches. ``aux_loss``: an MoE model's load-balancing loss joins the training loss with this coefficient, as the
    model computes it for the batch it is given; ``data_shards``: the step runs the model on that many equal parts of
    its batch and averages (one process computing what ``data_shards`` data-parallel ranks do: the load-balancing
    loss is not linear in the batch). The parts are those ``data_shards`` ranks read: every ``data_shards``-th
    sample. ``microbatches``: each part is cut again into that many (contiguous) pieces, as a pipeline's schedule
    cuts a rank's batch. ``clip``: the gradients are clipped to this norm before each step (by the strategy's norm
    over every rank's part), where it is not 0."""

    def __init__(self, family: str, lr: float = 1e-2, optimizer: str = "adamw", vocab: int = VOCAB,
                 aux_loss: float = 0.0, data_shards: int = 1, layers: int = LAYERS, own_loss: bool = False,
                 kv_heads: int = KV_HEADS, clip: float = 0.0, microbatches: int = 1) -> None:
        super().__init__()
        import transformers

        self.family, self.lr, self.optimizer = family, lr, optimizer
        self.aux_loss, self.data_shards, self.own_loss, self.clip = aux_loss, data_shards, own_loss, clip
        self.microbatches = microbatches
        torch.manual_seed(0)
        if family in ("litgpt", "litgpt_moe", "litgpt_moe_grouped"):
            self.model = litgpt_model(vocab, layers, moe=family == "litgpt_moe", kv_heads=kv_heads,
                                      grouped=family == "litgpt_moe_grouped")
        else:
            config = hf_config(family, vocab, layers, kv_heads)
            if aux_loss:
                config.output_router_logits, config.router_aux_loss_coef = True, aux_loss
            self.model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=attention_implementation(family))
            if family == "deepseek_v4":  # its hash-routed layers' token → experts table, as a checkpoint holds one
                # (a new model's is zeros: every token to expert 0 twice, at a constant weight of one half)
                tokens = torch.arange(vocab)
                for router in self.model.modules():
                    if hasattr(router, "tid2eid"):
                        router.tid2eid.copy_(torch.stack([tokens % 4, (tokens + 1) % 4], dim=-1))

    def forward(self, inputs: Tensor) -> Tensor:
        if self.family.startswith("litgpt"):
            return self.model(inputs)
        return self.model(input_ids=inputs).logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if self.clip:
            self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        else:  # the Trainer's gradient_clip_val, if any
            super().configure_gradient_clipping(optimizer, *args, **kwargs)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        if not (self.aux_loss or self.own_loss):
            inputs, targets = batch
            return F.cross_entropy(at_least_float32(self(inputs).flatten(0, -2)), targets.flatten())
        losses = []
        # rank r of a DistributedSampler reads every data_shards-th sample of the batch one process reads
        shards = [[part[r::self.data_shards].tensor_split(self.microbatches)[m] for part in batch]
                  for r in range(self.data_shards) for m in range(self.microbatches)]
        for inputs, targets in shards:
            if self.own_loss:  # the model's, from labels it shifts itself (the load-balancing loss added in it)
                losses.append(self.model(input_ids=inputs, labels=unshifted(targets)).loss)
                continue
            output = self.model(input_ids=inputs)
            loss = F.cross_entropy(at_least_float32(output.logits.flatten(0, -2)), targets.flatten())
            if isinstance(loss, DTensor):  # under loss parallelism (tp), before meeting the plain load-balancing loss
                loss = loss.full_tensor()
            losses.append(loss + self.aux_loss * output.aux_loss)
        return torch.stack(losses).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def at_least_float32(logits: Tensor) -> Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def unshifted(targets: Tensor) -> Tensor:
    """Labels the model shifts by one into ``targets`` (the token after each position)."""
    return torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], dim=1)


def lit_causal_lm(name: str, data_shards: int = 1, microbatches: int = 1) -> LitCausalLM:
    """The parity model called ``name``: a family (``"llama"``), a family with a vocabulary of its own
    (``"llama-vocab61"``), an MoE family with its load-balancing loss on (``"mixtral-aux"``: coefficient 0.02; the
    model adding it to its own loss from labels: ``"mixtral-aux-labels"``), or a family with :data:`DEEP_LAYERS` layers
    (``"llama-deep"``), or with key/value heads of its own (``"llama-kv1"``), or its gradients clipped to a norm of
    0.05 before each step (``"litgpt_moe-clip"``: every step clipped, its norm 0.8–2.1 before), or fine-tuned with
    LoRA (``"llama-lora"``: :func:`with_lora`; ``"llama-lora-saved"``: its embedding and head trained whole beside;
    ``"llama-lora-drop"``: the adapters' inputs dropped with probability 0.5; ``"gpt_oss-lora-experts"``: on the
    attention and, by ``target_parameters``, the stacked experts' weights, as GPT-OSS fine-tunes do;
    ``"gpt2-vocab61-lora-tokens"``: some rows of the token embedding trained beside, :func:`tokens_to_train`;
    ``"llama-lora-head"``: on the LM head too; ``"llama-lora-dora"``: DoRA; ``"gpt2-lora-dora-p0"``: its dropouts
    of probability 0, modules that change nothing, on which DoRA multiplies the input by the weight again),
    with the family's :func:`training_options`; ``data_shards``, ``microbatches``: see :class:`LitCausalLM`. A
    vision-language family (:data:`~tests.strategies.hf_vlm.FAMILIES`): :func:`~tests.strategies.hf_vlm.lit_vlm`'s
    model."""
    from tests.strategies import hf_vlm

    if name.removesuffix("-fp64").removesuffix("-deep") in hf_vlm.FAMILIES:
        return hf_vlm.lit_vlm(name)
    clip = name.endswith("-clip")
    name = name.removesuffix("-clip")
    own_loss = name.endswith("-labels")
    deep = name.endswith("-deep")
    fp64 = name.endswith("-fp64")
    name = name.removesuffix("-labels").removesuffix("-deep").removesuffix("-fp64")
    name, adapted, variant = name.partition("-lora")
    name, _, vocab = name.partition("-vocab")
    name, _, kv_heads = name.partition("-kv")
    family, aux, _ = name.partition("-aux")
    # with the load-balancing loss, AdamW at 1e-2 leaves float noise at 1.1e-4 in some weights; at 3e-3 it stays below
    options = {"lr": 3e-3} if aux else training_options(family)
    module = LitCausalLM(family, **options, vocab=int(vocab or VOCAB), aux_loss=0.02 if aux else 0.0,
                         data_shards=data_shards, microbatches=microbatches, layers=DEEP_LAYERS if deep else LAYERS,
                         own_loss=own_loss,
                         kv_heads=int(kv_heads or KV_HEADS), clip=0.05 if clip else 0.0)
    if adapted:
        module.model = with_lora(module.model, family, saved="-saved" in variant,
                                 dropout=0.5 if "-drop" in variant else 0.0, experts="-experts" in variant,
                                 tokens="-tokens" in variant, head="-head" in variant, dora="-dora" in variant,
                                 zero_dropout="-p0" in variant)
    return in_float64(module) if fp64 else module


#: the Linears :func:`with_lora` adapts: the attention's and the MLP's projections, fused ones too (GPT-2's q|k|v,
#: PEFT's default target for it, Phi-3's q|k|v and gate|up)
LORA_TARGETS = {"gpt2": ["c_attn", "c_fc", "c_proj"], "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                **dict.fromkeys(("falcon", "bloom", "gpt_neox"),
                                ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
                # the Linears tensor parallelism keeps whole beside the split ones: Qwen2-MoE's shared expert's gate
                # (on the MoE block's flattened tokens), Gemma 4's router's projection (on the sequence's share)
                "qwen2_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                              "shared_expert_gate"],
                "gemma4_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                               "router.proj"],
                # a latent attention's down-projections (whole on every rank) and up-projections (split by heads)
                "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}


def with_lora(model: torch.nn.Module, family: str, saved: bool = False, dropout: float = 0.0,
              experts: bool = False, tokens: bool = False, head: bool = False, dora: bool = False,
              zero_dropout: bool = False) -> torch.nn.Module:
    """``model`` fine-tuned with PEFT's LoRA (rank 4, on :data:`LORA_TARGETS`, initialized as PEFT does: ``lora_B``
    zeros, the adapters starting as no change), its own weights frozen; ``saved``: its token embedding and LM head
    trained whole too (PEFT's ``modules_to_save``: a trainable copy of each beside the frozen original, as a
    fine-tune adding tokens trains them); ``dropout``: PEFT's ``lora_dropout``; ``experts``: on the attention's
    projections and the stacked experts' ``gate_up_proj`` and ``down_proj`` (``target_parameters``); ``tokens``: rows
    of the token embedding trained beside (PEFT's ``trainable_token_indices``, as a fine-tune adding a few tokens
    trains them; the same rows of an LM head tied to it too), :func:`tokens_to_train`; ``head``: on the LM head too;
    ``dora``: DoRA (a magnitude per output beside the low-rank update of its direction); ``zero_dropout``: each
    adapter's dropout a ``Dropout`` of probability 0 where PEFT puts an ``Identity`` (the same values, but PEFT's DoRA
    then runs its dropout branch: the input, dropped, multiplied by the Linear's weight again)."""
    import peft

    targets = LORA_TARGETS.get(family, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    targets = [*(targets[:4] if experts else targets), *(["lm_head"] if head else [])]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts
                             else None, fan_in_fan_out=family == "gpt2",
                             modules_to_save=["embed_tokens", "lm_head"] if saved else None, lora_dropout=dropout,
                             trainable_token_indices=tokens_to_train(model) if tokens else None, use_dora=dora)
    model = peft.get_peft_model(model, config)
    for layer in model.modules() if zero_dropout else ():
        for adapter in list(getattr(layer, "lora_dropout", {})):
            layer.lora_dropout[adapter] = torch.nn.Dropout(0.0)
    return model


def with_trained_tokens(model: torch.nn.Module, family: str) -> torch.nn.Module:
    """``model`` with the rows :func:`tokens_to_train` of its token embedding trained (and of its head, tied to it),
    by PEFT's trainable-tokens method alone (no LoRA), its own weights frozen."""
    import peft

    embedding = "wte" if family == "gpt2" else "embed_tokens"
    config = peft.TrainableTokensConfig(target_modules=[embedding], token_indices=tokens_to_train(model))
    return peft.get_peft_model(model, config)


def tokens_to_train(model: torch.nn.Module) -> list[int]:
    """The rows of ``model``'s token embedding :func:`with_lora` trains with ``tokens``: the first and the last, and
    the last and the first of the two halves tp=2 splits them into (``ceil(vocabulary / 2)``: torch.chunk's)."""
    rows = model.get_input_embeddings().num_embeddings
    return [0, -(-rows // 2) - 1, -(-rows // 2), rows - 1]


def in_float64(module: LitCausalLM) -> LitCausalLM:
    """``module`` in float64, its norms computing their statistics in it: Hugging Face's RMSNorms compute theirs in
    float32 whatever the input's dtype, so each is replaced by torch's ``nn.RMSNorm`` with the same vectors and epsilon
    (the same function, bar that cast); an MoE model's experts run one by one (its grouped matmuls refuse float64)."""
    config = getattr(module.model, "config", None)
    if getattr(config, "_experts_implementation", None) is not None:  # grouped matmuls take float32 and narrower
        config._experts_implementation = "eager"
    for parent in list(module.modules()):
        for name, norm in parent.named_children():
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
            if (type(norm).__name__.endswith(("RMSNorm", "L2Norm")) and isinstance(eps, float)
                    and not type(norm).__name__.endswith("UnweightedRMSNorm")):
                # (Llama 4's L2 norm of each head has none, nor Gemma 4's of the values and of its router's input;
                # DeepSeek-V4's and HY-V4's unweighted ones, HY-V4's returning the inverse RMS alone, are kept, as
                # the float32 their hyper-connections compute in)
                weight = getattr(norm, "weight", None)
                width = getattr(parent, "head_dim", getattr(parent, "hidden_size", None))
                torch_norm = torch.nn.RMSNorm(weight.shape if weight is not None else width, eps=eps,
                                              elementwise_affine=weight is not None)
                if weight is not None:
                    torch_norm.weight = weight
                setattr(parent, name, torch_norm)
    return module.double()


def experts_in_another_layout(module: LitCausalLM) -> LitCausalLM:
    """``module`` with its stacked experts' weights stored transposed (``gate_up_proj`` ``[E, H, 2·I]``, the gate and
    up projection one after another, without GPT-OSS's biases and marks): a layout meshlight does not split over tp.
    For refusals and the planner only: it does not run."""
    from meshlight.parallel.expert import stacked_experts

    for experts in stacked_experts(module):
        for name, param in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, torch.nn.Parameter(param.detach().transpose(1, 2).contiguous()))
    return module
