"""Deterministic synthetic data and a ready LightningModule for examples, tests and benchmarks."""

from meshlight.demos.data import AdditionDataModule, CopyDataModule, RandomTokensDataModule, SequenceDataModule
from meshlight.demos.lit_gpt import LitGPT

__all__ = ["AdditionDataModule", "CopyDataModule", "LitGPT", "RandomTokensDataModule", "SequenceDataModule"]
