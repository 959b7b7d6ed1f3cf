"""Training samples of one Megatron indexed dataset, drawn as megatron-core's `GPTDataset` draws them.

For a split's documents (a contiguous range of sequences), a seed, sequence length S and a requested
number of samples:
1. epochs: as many passes over the documents as the requested samples need (S tokens each, plus one);
2. document index: the documents repeated once per epoch, shuffled by `RandomState(seed)` (when the last
   epoch is used for less than 80% it is shuffled apart, after the others, so its documents stay whole);
3. the epochs' documents in that order form one token stream; sample j is its tokens `[j*S, j*S + S + 1)`
   (inputs and labels overlap by one token, a sample may span documents), for every whole sample;
4. shuffle index: the same RandomState permutes the sample numbers (the separated last epoch apart).
Sample i is then sample `shuffle[i]` of step 3. Same seed, S, split and request: same samples as Megatron.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from heteroflow.data.indexed import IndexedDataset

SEPARATE_FINAL_EPOCH_BELOW = 0.80
"""Megatron shuffles a last epoch apart when it supplies less than this share of an epoch's samples."""


def split_fractions(split: str) -> list[float]:
    """`"969,30,1"` -> the train, valid and test shares, normalized as Megatron does (missing ones are 0)."""
    values = [float(v) for v in split.replace("/", ",").replace(" ", ",").split(",") if v.strip()]
    values += [0.0] * (3 - len(values))
    total = np.sum(np.asarray(values, dtype=np.float64))
    return (np.asarray(values, dtype=np.float64) / total).tolist()


def train_documents(split: str, num_sequences: int) -> np.ndarray:
    """The sequences of the train split: `[round(0 * n), round(share * n))`, Megatron's bookends."""
    share = split_fractions(split)[0]
    end = int(round((0.0 + share) * float(num_sequences)))
    return np.arange(0, end, dtype=np.int32)


class GPTSamples:
    """Samples of `seq_length + 1` tokens from `documents` of `dataset`, at least `num_samples` of them
    (one epoch when None), in Megatron's shuffled order."""

    def __init__(self, dataset: IndexedDataset, documents: np.ndarray, *, seq_length: int, seed: int,
                 num_samples: int | None):
        assert seq_length > 1 and len(documents), "a GPT dataset needs documents and a sequence length above 1"
        self.dataset, self.seq_length = dataset, seq_length
        tokens_per_epoch = int(dataset.sequence_lengths[documents].sum(dtype=np.int64))
        assert tokens_per_epoch > 1, "the split holds fewer than two tokens"
        epochs = 1 if num_samples is None else max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))
        separate = False
        if epochs > 1:
            before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
            per_epoch = (tokens_per_epoch - 1) // seq_length
            separate = num_samples - before_last < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch)
        rng = np.random.RandomState(seed)
        if separate:
            order = np.concatenate([_shuffled_epochs(documents, epochs - 1, rng), _shuffled_epochs(documents, 1, rng)])
        else:
            order = _shuffled_epochs(documents, epochs, rng)
        self.document_order, self.separate_final_epoch, self.num_epochs = order, separate, epochs
        lengths = dataset.sequence_lengths[order].astype(np.int64)
        self.starts = np.zeros(len(order) + 1, dtype=np.int64)  # stream position where each entry begins
        np.cumsum(lengths, out=self.starts[1:])
        self.num_samples = (epochs * tokens_per_epoch - 1) // seq_length
        if separate:
            self.shuffle = np.concatenate([_permutation(0, before_last, self.num_samples, rng),
                                           _permutation(before_last, self.num_samples, self.num_samples, rng)])
        else:
            self.shuffle = _permutation(0, self.num_samples, self.num_samples, rng)

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> np.ndarray:
        """Tokens of sample `i`: `seq_length + 1` int64 ids."""
        position = int(self.shuffle[i]) * self.seq_length
        entry = int(np.searchsorted(self.starts, position, side="right")) - 1
        need, offset, parts = self.seq_length + 1, position - int(self.starts[entry]), []
        while need:
            part = self.dataset.get(int(self.document_order[entry]), offset)[:need]
            parts.append(part)
            need -= len(part)
            entry, offset = entry + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [len(indices), seq_length]."""
        return rows_to_batch([self.sample(int(i)) for i in indices])


def rows_to_batch(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of S + 1 tokens -> (inputs, labels) of S tokens each, labels shifted by one."""
    stacked = torch.as_tensor(np.stack(rows))  # shares the array, as from_numpy; torch function modes see it
    return stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()


def _shuffled_epochs(documents: np.ndarray, epochs: int, rng: np.random.RandomState) -> np.ndarray:
    order = np.tile(documents, epochs).astype(np.int32)
    rng.shuffle(order)
    return order


def _permutation(start: int, stop: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    numbers = np.arange(start, stop, dtype=dtype)
    rng.shuffle(numbers)
    return numbers
