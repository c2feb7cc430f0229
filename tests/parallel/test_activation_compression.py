"""Compressed saved activations (meshlight/parallel/activation_compression.py): the bytes autograd keeps, the
gradients they give, and the callback under Lightning's own single-device strategy. Under tensor parallelism and
ZeRO-3 on 2 processes: tests/parallel/test_compression.py; on the demo task: benchmarks/compression.py."""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from meshlight.models import GPT, GPTConfig
from meshlight.parallel import BlockSelection
from meshlight.parallel.activation_compression import ActivationCompressionPolicy, apply_activation_compression
from meshlight.parallel.offload import apply_activation_offload


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, max_seq_len=32, n_layers=2, n_heads=4, dim=64, dropout=0.0, bias=False))


def saved_bytes(model: GPT, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct tensors autograd saves outside compressed blocks (inside, the compressor's hooks see
    them), parameters left out; and the loss."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[tuple, int] = {}

    def pack(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in params:
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
            seen[key] = tensor.numel() * tensor.element_size()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    return sum(seen.values()), loss


@pytest.fixture
def tokens():
    return torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1))


# Outside the blocks (embeddings, final norm, logits for the loss) stays uncompressed: 8% of the plain run's bytes
@pytest.mark.parametrize(("dtype", "most"), [("bf16", 0.55), ("fp8_e4m3", 0.33)])
def test_saved_activation_bytes_fall_to_the_compressed_dtypes_share(tokens, dtype, most):
    plain, _ = saved_bytes(gpt(), tokens)
    model = gpt()
    apply_activation_compression(model, ActivationCompressionPolicy(dtype))
    outside, _ = saved_bytes(model, tokens)
    compressor = model._meshlight_compressor
    inside = compressor.compressed_bytes
    assert compressor.compressed_bytes * 4 == compressor.original_bytes * compressor.dtype.itemsize  # all fp32
    assert (outside + inside) / plain <= most, (outside, inside, plain)


@pytest.mark.parametrize(("dtype", "tolerance"), [("bf16", 1e-2), ("fp8_e4m3", 1.5e-1)])
def test_gradients_from_compressed_activations_are_the_rounded_ones(tokens, dtype, tolerance):
    # bf16 keeps 8 significant bits (relative rounding 2^-9), fp8 e4m3 4 bits (2^-4): each gradient stays within
    # a few roundings of the fp32 one (measured: ~3e-3 and ~5e-2 of its norm)
    def gradients(compress: bool) -> dict[str, torch.Tensor]:
        model = gpt()
        if compress:
            apply_activation_compression(model, ActivationCompressionPolicy(dtype))
        _, loss = saved_bytes(model, tokens)
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    exact, compressed = gradients(False), gradients(True)
    errors = {name: float((compressed[name] - grad).norm() / grad.norm()) for name, grad in exact.items()}
    assert max(errors.values()) <= tolerance, errors
    # inside the blocks the gradients see rounded activations; the head and final norm (outside) see exact ones
    assert min(error for name, error in errors.items() if name.startswith("blocks.")) > 0
    assert errors["head.weight"] == 0


def test_a_tensor_saved_by_several_operations_is_compressed_once():
    # a block's normalized input is read by its query, key and value projections: autograd saves it three times
    x = torch.randn(8, 32, 64)
    block = gpt().blocks[0]
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saves: list[torch.Tensor] = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saves.append(tensor)
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x)
    distinct = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride()): t for t in saves}
    apply_activation_compression(block, ActivationCompressionPolicy("bf16", BlockSelection(module_types=[type(block)])))
    block(x)
    compressed = block._meshlight_compressor.original_bytes
    assert compressed == sum(t.numel() * t.element_size() for t in distinct.values())
    assert compressed < sum(t.numel() * t.element_size() for t in saves)


def test_fp8_leaves_a_tensor_holding_an_infinity_as_it_is_and_restores_the_others():
    from meshlight.parallel.activation_compression import ActivationCompressor, _unpack

    compressor = ActivationCompressor(torch.float8_e4m3fn)
    mask = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    assert compressor._pack(set(), {}, mask) is mask  # e4m3 has no infinity
    x = torch.randn(64, 64)
    restored = _unpack(compressor._pack(set(), {}, x))
    assert restored.dtype == torch.float32 and (restored - x).norm() / x.norm() < 0.05  # 4 significant bits


def test_an_unknown_dtype_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="ActivationCompression\\(dtype='int4'\\): choose one of 'bf16', 'fp8_e4m3'"):
        ActivationCompressionPolicy("int4")


def test_blocks_offloaded_and_compressed_at_once_are_refused():
    model = gpt()
    apply_activation_offload(model, BlockSelection(1))
    with pytest.raises(ValueError, match="ActivationCompression and Offload both chose Block blocks: one set of"
                                         " saved-tensor hooks"):
        apply_activation_compression(model, ActivationCompressionPolicy("bf16"))
    other = gpt()
    apply_activation_compression(other, ActivationCompressionPolicy("bf16", BlockSelection(2)))
    with pytest.raises(ValueError, match="Offload and ActivationCompression both chose"):
        apply_activation_offload(other, BlockSelection(1))


def test_the_callback_trains_on_one_device_under_lightnings_strategy(tmp_path):
    import lightning.pytorch as pl

    from meshlight.callbacks import ActivationCompression
    from meshlight.demos import AdditionDataModule, LitGPT

    data = AdditionDataModule(2, batch_size=8, train_size=32)
    model = LitGPT(GPTConfig.tiny(vocab_size=data.vocab_size, max_seq_len=data.seq_len))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0, default_root_dir=tmp_path,
                         callbacks=[ActivationCompression("bf16")])
    trainer.fit(model, data)
    assert model._meshlight_compressor.compressed_bytes > 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "litgpt"])
def test_models_we_did_not_write_keep_half_the_bytes_and_the_rounded_gradients(family):
    # Hugging Face's Llama (GQA, rotary, SDPA) and GPT-2 (Conv1D, fused q|k|v), litgpt's GPT: their blocks are found
    # and what they save is compressed as in meshlight's GPT
    from tests.strategies.hf_models import DEEP_LAYERS, hf_config, litgpt_model

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        if family == "litgpt":
            return litgpt_model(vocab=64, layers=DEEP_LAYERS)
        import transformers

        return transformers.AutoModelForCausalLM.from_config(hf_config(family, vocab=64, layers=DEEP_LAYERS),
                                                            attn_implementation="sdpa")

    def run(model: torch.nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[tuple, int] = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in params:
                seen[(tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())] = (
                    tensor.numel() * tensor.element_size())
            return tensor

        tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
        with saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model(tokens[:, :-1])
            logits = output if torch.is_tensor(output) else output.logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        compressor = getattr(model, "_meshlight_compressor", None)
        inside = compressor.compressed_bytes if compressor is not None else 0
        return sum(seen.values()) + inside, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, exact = run(build())
    model = build()
    assert len(apply_activation_compression(model, ActivationCompressionPolicy("bf16"))) == DEEP_LAYERS  # its blocks
    compressed, rounded = run(model)
    assert compressed / plain <= 0.55, (compressed, plain)
    errors = {name: float((rounded[name] - grad).norm() / grad.norm()) for name, grad in exact.items()
              if grad.norm() > 0}
    assert 0 < max(errors.values()) <= 1e-2, errors
