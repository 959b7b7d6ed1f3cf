"""Megatron's train split from `--data-path` prefixes, weighted blends and `--split`, built as
megatron-core's `BlendedMegatronDatasetBuilder` builds it for `train_iters * global_batch_size` samples.

- one prefix, no weight: its `GPTSamples`, nothing else;
- weights (normalized): dataset k is asked for `ceil(ceil(N * w_k) * 1.005)` samples (Megatron's default
  mid-level surplus) and the blend holds `sum_k ceil(N * w_k)`;
- several prefixes without weights: each gives one epoch, weighted by its number of samples, and the
  blend holds `min(N, all of them)`.
Blend sample s comes from the dataset whose share lags most behind its weight (`w_k * max(s, 1) - taken_k`,
the first such on ties), and is that dataset's next sample: Megatron's `build_blending_indices`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from heteroflow.config.data import MID_LEVEL_SURPLUS
from heteroflow.data.gpt_samples import GPTSamples, rows_to_batch

def normalized(weights) -> list[float]:
    """Weights divided by their sum in float64, as Megatron's `normalize`."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def blend_requests(weights: list[float], num_samples: int) -> tuple[list[int], list[int]]:
    """Per dataset: the samples the blend takes from it (target), and the samples it builds (with surplus)."""
    targets = [int(math.ceil(num_samples * w)) for w in weights]
    return targets, [int(math.ceil(t * (1 + MID_LEVEL_SURPLUS))) for t in targets]


class BlendedSamples:
    """Samples interleaved from several `GPTSamples` by weight; the interleaving is computed as far as read."""

    def __init__(self, parts: list[GPTSamples], weights: list[float], size: int):
        assert len(parts) == len(weights) and size > 0
        self.parts, self.weights, self.num_samples = parts, normalized(weights), size
        self.seq_length = parts[0].seq_length
        self._source = np.zeros(size, dtype=np.int16)
        self._within = np.zeros(size, dtype=np.int64)
        self._taken = [0] * len(parts)
        self._done = 0

    def __len__(self) -> int:
        return self.num_samples

    def source(self, i: int) -> tuple[int, int]:
        """(dataset, its sample number) of blend sample `i`."""
        if i >= self._done:
            self._extend(min(self.num_samples, max(i + 1, 2 * self._done)))
        return int(self._source[i]), int(self._within[i])

    def _extend(self, stop: int) -> None:
        # Sequential on purpose: each choice depends on every earlier one (and ties on float rounding).
        weights, taken = self.weights, self._taken
        for s in range(self._done, stop):
            x = float(max(s, 1))
            best, best_error = 0, weights[0] * x - taken[0]
            for k in range(1, len(weights)):
                error = weights[k] * x - taken[k]
                if error > best_error:
                    best, best_error = k, error
            self._source[s], self._within[s] = best, taken[best]
            taken[best] += 1
        self._done = stop

    def sample(self, i: int) -> np.ndarray:
        """Tokens of blend sample `i`: `seq_length + 1` int64 ids."""
        part, within = self.source(i)
        return self.parts[part].sample(within)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [len(indices), seq_length]."""
        return rows_to_batch([self.sample(int(i)) for i in indices])


def train_split(datasets, weights: list[float] | None, *, documents, seq_length: int, seed: int,
                num_samples: int) -> GPTSamples | BlendedSamples:
    """The train split of `datasets` (opened `IndexedDataset`s) with `documents[k]` the train documents of
    dataset k, for `num_samples` requested samples."""
    if len(datasets) == 1 and weights is None:
        return GPTSamples(datasets[0], documents[0], seq_length=seq_length, seed=seed, num_samples=num_samples)
    if weights is None:
        parts = [GPTSamples(d, docs, seq_length=seq_length, seed=seed, num_samples=None)
                 for d, docs in zip(datasets, documents)]
        sizes = [len(p) for p in parts]
        return BlendedSamples(parts, sizes, min(num_samples, sum(sizes)))
    weights = normalized(weights)
    targets, builds = blend_requests(weights, num_samples)
    parts = [GPTSamples(d, docs, seq_length=seq_length, seed=seed, num_samples=n)
             for d, docs, n in zip(datasets, documents, builds)]
    return BlendedSamples(parts, weights, sum(targets))
