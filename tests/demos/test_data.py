"""The synthetic data modules are deterministic, and the addition task is correct arithmetic."""

import torch

from meshlight.demos import AdditionDataModule, RandomTokensDataModule


def test_addition_samples_are_correct_sums_scored_only_on_the_answer():
    data = AdditionDataModule(3, train_size=200, val_size=16)
    data.setup()
    inputs, targets = data.train_set.tensors
    assert inputs.shape == targets.shape == (200, 12)
    assert ((targets[:, :8] == -100).all() and (targets[:, 8:] >= 0).all())
    for x, y in zip(inputs, targets):
        a, rest = data.decode(x, y).split("+")
        b, total = rest.split("=")
        assert int(a) + int(b) == int(total)


def test_addition_pads_to_a_length_sequence_parallelism_can_split():
    data = AdditionDataModule(2, train_size=32, val_size=16, pad_to_multiple_of=4)
    data.setup()
    inputs, targets = data.train_set.tensors
    assert data.seq_len == 12 and inputs.shape == (32, 12)  # 9 → 12: three start symbols after the sum
    assert (inputs[:, 10:] == AdditionDataModule.SYMBOLS.index("^")).all()
    assert (targets[:, :6] == -100).all() and (targets[:, 6:9] >= 0).all() and (targets[:, 9:] == -100).all()
    unpadded = AdditionDataModule(2, train_size=32, val_size=16)
    unpadded.setup()
    assert torch.equal(inputs[:, :9], unpadded.train_set.tensors[0])
    assert torch.equal(targets[:, :9], unpadded.train_set.tensors[1])
    for x, y in zip(inputs, targets):
        a, rest = data.decode(x, y).split("+")
        b, total = rest.split("=")
        assert int(a) + int(b) == int(total)


def test_splits_are_deterministic_and_distinct():
    first, second = AdditionDataModule(3, train_size=64, val_size=64), AdditionDataModule(3, train_size=64, val_size=64)
    first.setup(), second.setup()
    assert torch.equal(first.train_set.tensors[0], second.train_set.tensors[0])
    assert not torch.equal(first.train_set.tensors[0], first.val_set.tensors[0])
    assert not torch.equal(first.val_set.tensors[0], first.test_set.tensors[0])


def test_random_tokens_targets_are_the_next_tokens():
    data = RandomTokensDataModule(vocab_size=50, seq_len=10, train_size=8, val_size=8)
    data.setup()
    inputs, targets = data.train_set.tensors
    assert inputs.shape == (8, 10) and int(inputs.max()) < 50
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
