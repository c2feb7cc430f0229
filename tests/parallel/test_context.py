"""Context parallelism's pieces that need no second process: the load-balanced chunks, how a batch is cut (inputs,
labels, position ids; Hugging Face labels shifted first), and what is refused before training."""

import pytest
import torch

import meshlight as ml
from meshlight.parallel.context import (
    ContextParallelError,
    balanced_positions,
    check_attention_method,
    check_sequence_length,
    split_batch,
)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_position_is_held_once_and_every_rank_has_the_same_causal_work(cp):
    positions = [balanced_positions(32, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(32))
    work = [int((p + 1).sum()) for p in positions]  # keys each rank's queries attend to under a causal mask
    assert len(set(work)) == 1
    assert positions[0].tolist()[:32 // (2 * cp)] == list(range(32 // (2 * cp)))  # chunk 0 on rank 0 …
    assert positions[0].tolist()[-1] == 31  # … with the last chunk


def test_a_length_that_does_not_split_into_two_chunks_per_rank_is_refused_with_the_lengths_that_do():
    check_sequence_length(16, 4)
    with pytest.raises(ContextParallelError, match=r"sequence length 14 does not split into 2·cp = 8 equal chunks.*"
                                                   r"make the sequences 16 tokens long.*or choose cp in \[1, 7\]"):
        check_sequence_length(14, 4)


def test_a_tuple_batch_is_cut_along_the_sequence_and_its_targets_counted():
    inputs = torch.arange(16).repeat(2, 1)
    targets = torch.full((2, 16), -100)
    targets[:, -5:] = 1  # scored tokens only at the end, as in the addition demo
    lengths = torch.tensor([16, 16])  # not along the sequence: left whole
    shares = [split_batch((inputs, lengths, targets), 2, rank) for rank in range(2)]
    assert shares[0].batch[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shares[1].batch[0][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shares[0].batch[1] is lengths and shares[0].seq_len == 16
    assert [float(share.tokens) for share in shares] == [8.0, 2.0]  # 4 + 1 of the 5 scored per sequence


def test_hugging_face_labels_are_shifted_before_the_cut():
    labels = torch.arange(8)[None]
    batch = {"input_ids": torch.arange(8)[None], "labels": labels, "position_ids": torch.arange(8)[None]}
    share = split_batch(batch, 2, 0, shift_labels=True)
    assert share.labels_shifted
    assert share.batch["labels"].tolist() == [[1, 2, 7, -100]]  # positions 0, 1, 6, 7 scored against the next
    assert share.batch["position_ids"].tolist() == [[0, 1, 6, 7]]
    assert float(share.tokens) == 3.0
    assert not split_batch(batch, 2, 0).labels_shifted  # a model that does not shift (not Hugging Face's)


def test_a_padding_mask_that_masks_something_is_refused():
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 8)}
    split_batch(batch, 2, 0)
    batch["attention_mask"][0, -2:] = 0
    with pytest.raises(ContextParallelError, match="attention_mask masks some tokens.*Pack sequences"):
        split_batch(batch, 2, 0)


def test_ring_attention_is_refused_off_cuda_and_the_methods_are_named():
    check_attention_method("allgather", torch.device("cpu"))
    check_attention_method("ring", torch.device("cuda"))
    with pytest.raises(ContextParallelError, match="only CUDA's flash.*this run is on cpu.*cp_attention='allgather'"):
        check_attention_method("ring", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"cp_attention='flash': choose one of \['allgather', 'ring'\]"):
        ml.MeshStrategy(cp=2, cp_attention="flash")


def test_the_name_cp_is_context_parallelism_over_every_process():
    strategy = ml.Trainer(strategy="cp", devices=4, accelerator="cpu", logger=False).strategy
    assert isinstance(strategy, ml.ContextParallelStrategy)
    assert (strategy.layout.cp, strategy.layout.dp, strategy.layout.zero) == (4, 1, 1)
    strategy = ml.Trainer(strategy=ml.ContextParallelStrategy(cp=2), devices=4, accelerator="cpu",
                          logger=False).strategy
    assert (strategy.layout.cp, strategy.layout.dp_shard) == (2, 2)
    strategy = ml.Trainer(strategy=ml.Hybrid3DStrategy(dp=1, pp=1, tp=2, ep=1, zero=1, cp=2), devices=4,
                          accelerator="cpu", logger=False).strategy
    assert (strategy.layout.cp, strategy.layout.tp) == (2, 2)
