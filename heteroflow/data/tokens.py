"""Flat binary token files, and which samples every rank reads at every step.

A token file is a flat array of uint16, uint32 or int32 token ids (no header). For sequence length S,
sample i is tokens `[i*S, i*S + S + 1)`: the first S are the inputs, the last S the labels (each
input's next token); consecutive samples share one boundary token.

Which samples make up optimizer step t depends only on (seed, number of samples, global batch
size, shuffle): `SampleOrder.global_batch(t)`. A plan only decides how that global batch is cut:
micro-batch m is the m-th run of `micro_batch_size` samples, and a stage's dp rank d takes the d-th
contiguous 1/dp of it (`micro_batch_indices`). So every plan trains on exactly the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from heteroflow.errors import UserError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}


def write_token_file(path: str | Path, tokens, dtype: str = "uint16") -> Path:
    """Write token ids as a flat binary file (numpy only; for tests and data preparation)."""
    array = np.asarray(tokens, dtype=np.int64)
    limit = np.iinfo(DTYPES[dtype]).max
    if array.size and (array.min() < 0 or array.max() > limit):
        raise ValueError(f"token ids must lie in [0, {limit}] for {dtype}")
    path = Path(path)
    array.astype(DTYPES[dtype]).tofile(path)
    return path


class TokenFile:
    """A memory-mapped token file read as samples of `seq_length` + 1 tokens."""

    def __init__(self, path: str | Path, *, seq_length: int, dtype: str = "uint16", where: str = "train.data.path"):
        self.path, self.seq_length = Path(path), seq_length
        if dtype not in DTYPES:
            raise UserError(f"train.data.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        if not self.path.is_file():
            raise UserError(f"{where}: {self.path} not found")
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        size = self.path.stat().st_size
        if size % itemsize:
            raise UserError(f"{where}: {self.path} has {size} bytes, not a whole number of {dtype} tokens; "
                            "check train.data.dtype")
        self.tokens = np.memmap(self.path, dtype=DTYPES[dtype], mode="r") if size else np.zeros(0, DTYPES[dtype])
        self.num_samples = max(0, (len(self.tokens) - 1) // seq_length)
        if self.num_samples == 0:
            raise UserError(f"{where}: {self.path} holds {len(self.tokens)} tokens; one sample of model.seq_length "
                            f"{seq_length} needs {seq_length + 1}")

    def sample(self, i: int) -> np.ndarray:
        """Tokens `[i*S, i*S + S + 1)`."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        return np.asarray(self.tokens[i * self.seq_length:(i + 1) * self.seq_length + 1], dtype=np.int64)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [len(indices), seq_length]."""
        rows = torch.as_tensor(np.stack([self.sample(int(i)) for i in indices]))  # as from_numpy; modes see it
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def check_vocab(self, vocab_size: int, *, chunk: int = 1 << 24) -> None:
        """Raise a `UserError` if any token id is negative or not below `vocab_size` (scans the whole file)."""
        top = max((int(self.tokens[a:a + chunk].max()) for a in range(0, len(self.tokens), chunk)), default=0)
        low = min((int(self.tokens[a:a + chunk].min()) for a in range(0, len(self.tokens), chunk)), default=0)
        if low < 0 or top >= vocab_size:
            top = low if low < 0 else top
            raise UserError(f"train.data.path: {self.path} contains token id {top}, but model.vocab_size is "
                            f"{vocab_size}; tokenize with a vocabulary that fits the model")


@lru_cache(maxsize=4)
def _permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleOrder:
    """The sample indices of each global batch: epochs of a seeded permutation, or file order."""

    num_samples: int
    global_batch_size: int
    seed: int
    shuffle: bool = True

    def global_batch(self, step: int) -> np.ndarray:
        """Sample indices of optimizer step `step` (0-based), `global_batch_size` of them.

        Positions run on across epochs (a batch may straddle two); epoch e visits every sample once,
        in the order of a permutation seeded by (seed, e), or in file order without shuffle.
        """
        positions = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size, dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_samples)
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = _permutation(self.num_samples, self.seed, int(epoch))[within[mask]]
        return out


class Samples(Protocol):
    """Numbered samples of S + 1 tokens: a `TokenFile`, or Megatron's `GPTSamples` / `BlendedSamples`."""

    num_samples: int

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [len(indices), S]."""


@dataclass(frozen=True, slots=True)
class TrainData:
    """The samples a job trains on and the order it reads them in."""

    samples: Samples
    order: SampleOrder

    @property
    def num_samples(self) -> int:
        return self.samples.num_samples

    def global_batch(self, step: int) -> np.ndarray:
        """Sample indices of optimizer step `step`."""
        return self.order.global_batch(step)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [len(indices), seq_length]."""
        return self.samples.batch(indices)


def micro_batch_indices(global_indices: np.ndarray, *, micro_batch_size: int, micro_batch: int, dp: int = 1,
                        dp_rank: int = 0) -> np.ndarray:
    """Samples of micro-batch `micro_batch` that dp rank `dp_rank` of a stage with `dp` ranks reads."""
    if micro_batch_size % dp:
        raise ValueError(f"dp {dp} does not divide micro_batch_size {micro_batch_size}")
    mb = global_indices[micro_batch * micro_batch_size:(micro_batch + 1) * micro_batch_size]
    assert len(mb) == micro_batch_size, f"micro-batch {micro_batch} is beyond the global batch"
    share = micro_batch_size // dp
    return mb[dp_rank * share:(dp_rank + 1) * share]
