"""Deterministic synthetic datasets generated in code (no download), for examples, tests and benchmarks.

Each sample is a pair ``(inputs, targets)`` of token-id tensors of equal length; targets are the inputs
shifted by one, with ``-100`` where no prediction is scored. The same ``seed`` gives the same data in every
process, so data-parallel ranks only need the sampler to tell them apart.
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["AdditionDataModule", "RandomTokensDataModule", "SequenceDataModule"]

IGNORE_INDEX = -100


class SequenceDataModule(pl.LightningDataModule):
    """Train / validation / test splits of generated sequences; subclasses implement :meth:`generate`."""

    vocab_size: int
    seq_len: int

    def __init__(self, *, batch_size: int, train_size: int, val_size: int, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.train_size, self.val_size, self.seed = batch_size, train_size, val_size, seed
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None
        self.test_set: Optional[TensorDataset] = None

    def generate(self, num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``num_samples`` (inputs, targets) rows, each ``[num_samples, seq_len]``."""
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            # Distinct seeds per split: the validation and test sets are not drawn from the training stream.
            self.train_set = TensorDataset(*self.generate(self.train_size, _generator(self.seed)))
            self.val_set = TensorDataset(*self.generate(self.val_size, _generator(self.seed + 1)))
            self.test_set = TensorDataset(*self.generate(self.val_size, _generator(self.seed + 2)))

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        assert self.test_set is not None
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


class AdditionDataModule(SequenceDataModule):
    """Multi-digit addition as characters: ``<s>123+456=9750`` — a task a small GPT visibly learns.

    Operands are zero-padded to ``digits``; the sum has ``digits + 1`` digits written least-significant
    first, the order in which a left-to-right model can carry. Only the sum's digits are scored, so exact
    match of the scored positions is the answer accuracy (and equals greedy decoding's accuracy: if every
    teacher-forced digit is right, decoding reproduces them).

    Sequence length is ``3·(digits + 1)``, or the next multiple of ``pad_to_multiple_of`` (sequence parallelism
    needs a length the tensor-parallel size divides): start symbols appended after the sum, never scored — a
    causal model computes every earlier position, and so the loss, exactly as without them. The vocabulary has
    13 symbols, padded to 16 (a power of two: even shards under every tp).
    """

    SYMBOLS = "0123456789+=^"  # ^ starts a sequence
    vocab_size = 16

    def __init__(
        self,
        digits: int = 3,
        *,
        batch_size: int = 32,
        train_size: int = 20_000,
        val_size: int = 512,
        seed: int = 0,
        pad_to_multiple_of: int = 1,
    ) -> None:
        if digits < 1:
            raise ValueError(f"digits={digits} must be >= 1.")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1.")
        super().__init__(batch_size=batch_size, train_size=train_size, val_size=val_size, seed=seed)
        self.digits = digits
        self.padding = -3 * (digits + 1) % pad_to_multiple_of
        self.seq_len = 3 * (digits + 1) + self.padding

    def generate(self, num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        d = self.digits
        a = torch.randint(0, 10**d, (num_samples,), generator=generator)
        b = torch.randint(0, 10**d, (num_samples,), generator=generator)
        plus, equals, start = (self.SYMBOLS.index(c) for c in "+=^")
        columns = [torch.full((num_samples,), start)]
        columns += _digits(a, d, most_significant_first=True) + [torch.full((num_samples,), plus)]
        columns += _digits(b, d, most_significant_first=True) + [torch.full((num_samples,), equals)]
        columns += _digits(a + b, d + 1, most_significant_first=False)
        columns += [torch.full((num_samples,), start)] * self.padding
        tokens = torch.stack(columns, dim=1)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        targets[:, : 2 * d + 2] = IGNORE_INDEX  # score only the sum's d + 1 digits
        targets[:, 3 * d + 3 :] = IGNORE_INDEX
        return inputs, targets

    def decode(self, inputs: Tensor, answer: Tensor) -> str:
        """Render ``123+456=579``: the prompt from ``inputs``, then ``answer`` — a whole row of targets or
        predictions, or just its ``digits + 1`` scored positions, least-significant first — written
        most-significant first."""
        d = self.digits
        digits = answer[2 * d + 2 : 3 * d + 3] if len(answer) == self.seq_len else answer
        prompt = "".join(self.SYMBOLS[int(t)] for t in inputs[1 : 2 * d + 3])
        return prompt + "".join(self.SYMBOLS[int(t)] for t in reversed(digits))


class CopyDataModule(SequenceDataModule):
    """Copy a random sequence: ``^ x1 … xn x1 … xn`` — the copy can be predicted only by attending ``n`` tokens
    back, the long-range dependency that context parallelism splits over ranks (a model learns it with an
    induction head: find the earlier occurrence of the current token, predict what followed it).

    ``seq_len`` (even) is the model's input length, ``n = seq_len / 2``. Only the copy after its first token is
    scored, so the answer accuracy is exact match of the copied tokens. The vocabulary has 63 random symbols and
    the start symbol ``^``: 64, even shards under every tp.
    """

    vocab_size = 64

    def __init__(
        self,
        seq_len: int = 1024,
        *,
        batch_size: int = 8,
        train_size: int = 4096,
        val_size: int = 64,
        seed: int = 0,
    ) -> None:
        if seq_len < 4 or seq_len % 2:
            raise ValueError(f"seq_len={seq_len}: give an even length of at least 4 (a sequence and its copy).")
        super().__init__(batch_size=batch_size, train_size=train_size, val_size=val_size, seed=seed)
        self.seq_len = seq_len

    def generate(self, num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        n = self.seq_len // 2
        start = torch.full((num_samples, 1), self.vocab_size - 1)
        sequence = torch.randint(0, self.vocab_size - 1, (num_samples, n), generator=generator)
        tokens = torch.cat([start, sequence, sequence], dim=1)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        targets[:, : n + 1] = IGNORE_INDEX  # the random half, and the copy's first token (nothing announces it)
        return inputs, targets


class RandomTokensDataModule(SequenceDataModule):
    """Uniformly random token sequences for next-token prediction: throughput and parity, not learning."""

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        *,
        batch_size: int = 8,
        train_size: int = 4096,
        val_size: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, train_size=train_size, val_size=val_size, seed=seed)
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def generate(self, num_samples: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(0, self.vocab_size, (num_samples, self.seq_len + 1), generator=generator)
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _digits(values: Tensor, count: int, *, most_significant_first: bool) -> list[Tensor]:
    columns = [(values // 10**i) % 10 for i in range(count)]  # least significant first
    return columns[::-1] if most_significant_first else columns
