"""Tiny, randomly initialized vision-language models from Hugging Face ``transformers`` wrapped in a plain
LightningModule, as users write them: each sample is an image (its pixels drawn from the sample's tokens) and the
sample's text after it; ``training_step`` calls ``F.cross_entropy`` on the text's logits. The model is built from a
config, never downloaded. Each holds a vision encoder (its own blocks, narrower than the decoder's) beside its
decoder, whose output joins the token embeddings before the decoder's first layer."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.strategies.hf_models import DEEP_LAYERS, DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, at_least_float32, in_float64

#: the vocabulary: the parity data's 16 tokens, then the special ones
VOCAB = 32
IMAGE, START, END = 30, 29, 28
#: image tokens per sample (the encoder's patches after merging or pooling); LLaVA-NeXT's: the base image's 4, then its
#: one high-resolution tile's 2 × 2, each row ended by ``image_newline``
IMAGE_TOKENS = 4
TOKENS_OF = {"llava_next": 10}
#: the encoder's width (narrower than the decoder's), heads and blocks
VISION_DIM, VISION_HEADS, VISION_LAYERS = 32, 4, 2
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "gemma3_vision", "idefics3", "ernie4_5_vl_moe",
            "llava_next")
#: families whose images come as patches flattened over the batch beside each image's grid (Qwen's layout)
FLATTENED = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "ernie4_5_vl_moe")


def vlm_config(family: str, layers: int = LAYERS) -> Any:
    """A tiny config of ``family``: a decoder as :func:`~tests.strategies.hf_models.hf_config`'s (8 query, 4
    key/value heads, 64 wide, ``layers`` layers) and a 2-block vision encoder 32 wide whose image makes 4 tokens
    (LLaVA-NeXT's: :data:`TOKENS_OF`)."""
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                tie_word_embeddings=False, use_cache=False, attention_dropout=0.0)
    vision = dict(hidden_size=VISION_DIM, intermediate_size=2 * VISION_DIM, num_attention_heads=VISION_HEADS,
                  num_hidden_layers=VISION_LAYERS)
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        # a 16×16 image in 4×4 patches, merged 2×2 into 4 tokens; rotary sections over (time, height, width)
        qwen_vision = dict(depth=VISION_LAYERS, hidden_size=VISION_DIM, intermediate_size=2 * VISION_DIM,
                           num_heads=VISION_HEADS, out_hidden_size=DIM, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3)
        tokens = dict(image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=START,
                      vision_end_token_id=END)
        if family == "qwen2_5_vl":
            text["rope_scaling"] = {"type": "mrope", "mrope_section": [1, 1, 2]}
            return transformers.Qwen2_5_VLConfig(
                text_config=text, tie_word_embeddings=False,
                vision_config={**qwen_vision, "window_size": 16, "fullatt_block_indexes": [1]}, **tokens)
        text.update(head_dim=DIM // HEADS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": [1, 1, 2], "mrope_interleaved": True})
        # deepstack: the first encoder block's features also join the decoder's first layer's output
        vision = {**qwen_vision, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
        if family == "qwen3_vl":
            return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                              **tokens)
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN // 2, decoder_sparse_step=1)
        return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                             **tokens)
    if family == "llava":
        # CLIP: an 8×8 image in 4×4 patches and a class token, which the "default" strategy drops
        return transformers.LlavaConfig(
            text_config={**text, "model_type": "llama"}, image_token_index=IMAGE, image_seq_length=IMAGE_TOKENS,
            vision_config={**vision, "model_type": "clip_vision_model", "image_size": 8, "patch_size": 4},
            vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False)
    if family == "llava_next":
        # LLaVA's, with one 8×8 tile beside the base image (the only resolution offered) and a parameter of the model's
        # own, image_newline, ending each row of the tile's features
        return transformers.LlavaNextConfig(
            text_config={**text, "model_type": "llama"}, image_token_index=IMAGE, image_grid_pinpoints=[[8, 8]],
            vision_config={**vision, "model_type": "clip_vision_model", "image_size": 8, "patch_size": 4},
            vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False)
    if family == "gemma3_vision":
        # SigLIP: an 8×8 image in 2×2 patches, pooled 2×2 into 4 tokens; attention bidirectional over an image's tokens
        text.update(head_dim=DIM // HEADS, sliding_window=8, query_pre_attn_scalar=DIM // HEADS,
                    layer_types=["sliding_attention", "full_attention"], model_type="gemma3_text")
        return transformers.Gemma3Config(
            text_config=text, mm_tokens_per_image=IMAGE_TOKENS, image_token_index=IMAGE, boi_token_index=START,
            eoi_token_index=END, tie_word_embeddings=False,
            vision_config={**vision, "model_type": "siglip_vision_model", "image_size": 8, "patch_size": 2})
    if family == "idefics3":
        # SigLIP: an 8×8 image in 2×2 patches, pixel-shuffled 2×2 into 4 tokens; the decoder is a Llama
        return transformers.Idefics3Config(
            text_config={**text, "model_type": "llama"}, image_token_id=IMAGE, scale_factor=2, use_cache=False,
            vision_config={**vision, "image_size": 8, "patch_size": 2}, tie_word_embeddings=False)
    if family == "ernie4_5_vl_moe":
        # registered after its decoder: the encoder, then the resampler merging 2×2 patches; experts for the text
        # tokens and for the image's (token types), after a dense first layer
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
                    moe_intermediate_size=[HIDDEN // 2, HIDDEN // 2], moe_k=2, moe_num_experts=4,
                    moe_num_shared_experts=1, mlp_layer_types=["dense", "sparse"], head_dim=DIM // HEADS)
        return transformers.Ernie4_5_VLMoeConfig(
            text_config=text, tie_word_embeddings=False,
            vision_config=dict(depth=VISION_LAYERS, hidden_size=VISION_DIM, intermediate_size=2 * VISION_DIM,
                               num_heads=VISION_HEADS, patch_size=4, spatial_merge_size=2, temporal_merge_size=2),
            image_token_id=IMAGE, video_token_id=IMAGE + 1, image_start_token_id=START, image_end_token_id=END,
            video_start_token_id=START, video_end_token_id=END)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def family_of(config: Any) -> str:
    """The family (:data:`FAMILIES`) of a vision-language model's ``config``."""
    return {"gemma3": "gemma3_vision"}.get(config.model_type, config.model_type)


def image_inputs(family: str, text: Tensor) -> dict[str, Tensor]:
    """The model's inputs for samples of an image and then ``text`` (``[batch, length]``): the token ids — the image's
    start, its tokens, its end — and each sample's pixels, drawn from its tokens (so that samples differ)."""
    batch = text.shape[0]
    image = [IMAGE] * TOKENS_OF.get(family, IMAGE_TOKENS)
    ids = torch.cat([torch.tensor([START, *image, END]).expand(batch, -1), text], dim=1)
    seed = 1 + text.float().sum(1) / 50
    if family in FLATTENED:  # 16 patches of 3 channels × 2 frames (Ernie's: 1) × 4 × 4 per image, their grid
        width = 48 if family == "ernie4_5_vl_moe" else 96
        pixels = torch.sin(torch.arange(16 * width).view(1, 16, width) * 0.01 * seed.view(batch, 1, 1))
        inputs = dict(input_ids=ids, pixel_values=pixels.flatten(0, 1),
                      image_grid_thw=torch.tensor([[1, 4, 4]] * batch), mm_token_type_ids=(ids == IMAGE).int())
        if family == "ernie4_5_vl_moe":  # the image's tokens, its start and end go to the image's experts
            inputs["moe_mm_token_type_ids"] = ((ids == IMAGE) | (ids == START) | (ids == END)).int()
        return inputs
    pixels = torch.sin(torch.arange(3 * 8 * 8).view(1, 3, 8, 8) * 0.05 * seed.view(batch, 1, 1, 1))
    if family == "gemma3_vision":
        return dict(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long())
    if family == "llava_next":  # the base image and its one tile, each 8×8, and the image's size
        return dict(input_ids=ids, pixel_values=torch.stack([pixels, pixels.flip(-1)], dim=1),
                    image_sizes=torch.tensor([[8, 8]] * batch))
    if family == "idefics3":  # one image per sample, every pixel real
        return dict(input_ids=ids, pixel_values=pixels[:, None],
                    pixel_attention_mask=torch.ones(batch, 1, 8, 8, dtype=torch.bool))
    return dict(input_ids=ids, pixel_values=pixels)


class LitVLM(pl.LightningModule):
    """Training of a Hugging Face ``AutoModelForImageTextToText`` on ``(text, targets)`` batches, each sample's image
    before its text (:func:`image_inputs`); the loss is the text's next-token loss."""

    def __init__(self, family: str, lr: float = 1e-2, optimizer: str = "adamw", layers: int = LAYERS) -> None:
        super().__init__()
        import transformers

        self.family, self.lr, self.optimizer = family, lr, optimizer
        torch.manual_seed(0)
        self.model = transformers.AutoModelForImageTextToText.from_config(vlm_config(family, layers),
                                                                          attn_implementation="sdpa")

    def forward(self, text: Tensor) -> Tensor:
        dtype = next(self.model.parameters()).dtype
        inputs = {key: value.to(dtype) if value.is_floating_point() else value
                  for key, value in image_inputs(self.family, text).items()}
        logits = self.model(**inputs).logits
        return logits[:, -text.shape[1]:]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        text, targets = batch
        loss = F.cross_entropy(at_least_float32(self(text)).flatten(0, -2), targets.flatten())
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def lit_vlm(name: str) -> LitVLM:
    """The parity model called ``name``: a family (``"llava"``), with :data:`~tests.strategies.hf_models.DEEP_LAYERS`
    decoder layers (``"qwen3_vl-deep"``), or its float64 twin (``"qwen3_vl-fp64"``, ``"qwen3_vl-deep-fp64"``). Those
    with key biases (Qwen2.5-VL's decoder, CLIP's and SigLIP's encoders) train with SGD at 0.3, as
    :func:`~tests.strategies.hf_models.training_options` says why; the MoE ones (Qwen3-VL's, ERNIE 4.5-VL's) with
    AdamW at 3e-3 (at 1e-2 their routing's near-ties drift past 1e-4 by rounding alone)."""
    family = name.removesuffix("-fp64").removesuffix("-deep")
    options = ({"optimizer": "sgd", "lr": 0.3} if family in ("qwen2_5_vl", "llava", "llava_next", "gemma3_vision",
                                                              "idefics3") else
               {"lr": 3e-3} if family in ("qwen3_vl_moe", "ernie4_5_vl_moe") else {})
    module = LitVLM(family, **options, layers=DEEP_LAYERS if "-deep" in name else LAYERS)
    return in_float64(module) if name.endswith("-fp64") else module
