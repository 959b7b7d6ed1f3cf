"""Flat token files, sample boundaries, and a sample order that depends on the seed only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heteroflow.data import SampleOrder, TokenFile, micro_batch_indices, write_token_file
from heteroflow.errors import UserError


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_sample_i_is_tokens_i_s_to_i_s_plus_s_plus_1(tmp_path, dtype):
    tokens = np.arange(1000) * (70 if dtype == "uint32" else 1)
    path = write_token_file(tmp_path / "t.bin", tokens.tolist(), dtype)
    data = TokenFile(path, seq_length=10, dtype=dtype)
    assert data.num_samples == 99  # sample 99 would need token 1000
    assert data.sample(7).tolist() == tokens[70:81].tolist()
    inputs, labels = data.batch([3, 0])
    assert inputs.dtype == torch.int64 and inputs.shape == labels.shape == (2, 10)
    assert inputs[0].tolist() == tokens[30:40].tolist() and labels[0].tolist() == tokens[31:41].tolist()


def test_bad_files_are_user_errors(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(UserError, match="not a whole number of uint16 tokens"):
        TokenFile(tmp_path / "odd.bin", seq_length=4)
    with pytest.raises(UserError, match="not found"):
        TokenFile(tmp_path / "missing.bin", seq_length=4)
    write_token_file(tmp_path / "short.bin", [1, 2, 3])
    with pytest.raises(UserError, match="one sample of model.seq_length 4 needs 5"):
        TokenFile(tmp_path / "short.bin", seq_length=4)
    write_token_file(tmp_path / "big.bin", [1, 2, 300, 4, 5, 6])
    with pytest.raises(UserError, match="token id 300, but model.vocab_size is 256"):
        TokenFile(tmp_path / "big.bin", seq_length=4).check_vocab(256)
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "x.bin", [70000], "uint16")


def test_unshuffled_order_is_file_order_across_epochs():
    order = SampleOrder(num_samples=10, global_batch_size=4, seed=0, shuffle=False)
    assert [order.global_batch(t).tolist() for t in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_shuffled_order_is_a_permutation_per_epoch_fixed_by_the_seed():
    order = SampleOrder(num_samples=12, global_batch_size=4, seed=7)
    epoch0 = np.concatenate([order.global_batch(t) for t in range(3)])
    epoch1 = np.concatenate([order.global_batch(t) for t in range(3, 6)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and not np.array_equal(epoch0, epoch1)
    again = SampleOrder(num_samples=12, global_batch_size=4, seed=7)
    assert np.array_equal(again.global_batch(1), order.global_batch(1))
    assert not np.array_equal(SampleOrder(num_samples=12, global_batch_size=4, seed=8).global_batch(0),
                              order.global_batch(0))
    straddling = SampleOrder(num_samples=5, global_batch_size=4, seed=1).global_batch(1)  # positions 4..7
    assert straddling[0] == SampleOrder(num_samples=5, global_batch_size=5, seed=1).global_batch(0)[4]


@pytest.mark.parametrize("plan", [(8, 1), (4, 2), (2, 1), (8, 4), (2, 2)])
def test_every_plan_reads_the_same_tokens_per_step(tmp_path, plan):
    """The multiset of samples of step t is the global batch, whatever micro-batch size and dp."""
    micro_batch_size, dp = plan
    path = write_token_file(tmp_path / "t.bin", np.arange(2000) % 500)
    data = TokenFile(path, seq_length=16)
    order = SampleOrder(num_samples=data.num_samples, global_batch_size=8, seed=3)
    for step in (0, 5, 20):
        batch = order.global_batch(step)
        reads = [data.batch(micro_batch_indices(batch, micro_batch_size=micro_batch_size, micro_batch=m, dp=dp,
                                                dp_rank=d))[0]
                 for m in range(8 // micro_batch_size) for d in range(dp)]
        expected = data.batch(batch)[0]
        assert sorted(map(tuple, torch.cat(reads).tolist())) == sorted(map(tuple, expected.tolist()))
    # dp ranks take contiguous shares of a micro-batch, in rank order (the batch dim is sharded).
    assert micro_batch_indices(np.arange(8), micro_batch_size=4, micro_batch=1, dp=2, dp_rank=1).tolist() == [6, 7]
