"""Megatron indexed datasets: the format both ways, and every sample equal to megatron-core's GPTDataset and
BlendedDataset for the same seed, sequence length, split and blend."""

from __future__ import annotations

import numpy as np
import pytest
from indexed_helpers import megatron_train_split, write_dataset

from heteroflow.data.blend import BlendedSamples, train_split
from heteroflow.data.gpt_samples import GPTSamples, train_documents
from heteroflow.data.indexed import IndexedDataset


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexed")
    return {"a": write_dataset(root / "a", num_docs=50, seed=1),
            "b": write_dataset(root / "b", num_docs=30, seed=2, dtype="int32"),
            "c": write_dataset(root / "c", num_docs=12, seed=3)}


def ours(blend: list, *, split: str, seq_length: int, seed: int, num_samples: int):
    weighted = len(blend) % 2 == 0 and all(isinstance(w, float) for w in blend[0::2])
    paths = blend[1::2] if weighted else blend
    datasets = [IndexedDataset(p) for p in paths]
    return train_split(datasets, list(blend[0::2]) if weighted else None,
                       documents=[train_documents(split, len(d)) for d in datasets], seq_length=seq_length, seed=seed,
                       num_samples=num_samples)


CASES = {  # blend (names, weights as floats), split, seq_length, seed, requested samples
    "one prefix, one epoch": (["a"], "969,30,1", 16, 1234, 40),
    "one prefix, last epoch shuffled apart": (["a"], "100,0,0", 16, 5, 300),
    "one prefix, last epoch shuffled with the rest": (["a"], "80,20", 8, 3, 1000),
    "two weighted prefixes": ([0.3, "a", 0.7, "b"], "96,4,0", 16, 7, 200),
    "three prefixes weighted by size": (["a", "b", "c"], "100,0,0", 8, 9, 100),
    "one weighted prefix": ([1.0, "c"], "100", 8, 11, 300),
    "three weighted prefixes, many epochs": ([2.0, "a", 1.0, "b", 0.5, "c"], "90,10,0", 4, 13, 2000),
}


@pytest.mark.parametrize("case", CASES)
def test_every_sample_equals_megatron_cores(prefixes, case):
    names, split, seq_length, seed, num_samples = CASES[case]
    blend = [prefixes[x] if isinstance(x, str) else x for x in names]
    reference = megatron_train_split([str(x) for x in blend], split=split, seq_length=seq_length, seed=seed,
                                     num_samples=num_samples)
    mine = ours(blend, split=split, seq_length=seq_length, seed=seed, num_samples=num_samples)
    assert len(mine) == len(reference) >= num_samples
    inputs, labels = mine.batch(range(len(mine)))
    for i in range(len(reference)):
        sample = reference[i]
        assert inputs[i].tolist() == sample["tokens"].tolist(), f"sample {i}"
        assert labels[i].tolist() == sample["labels"].tolist(), f"sample {i}"


def test_the_cases_cover_both_final_epoch_shuffles(prefixes):
    """Megatron shuffles a last epoch used for under 80% on its own: both branches are compared above."""
    apart = ours([prefixes["a"]], split="100,0,0", seq_length=16, seed=5, num_samples=300)
    together = ours([prefixes["a"]], split="80,20", seq_length=8, seed=3, num_samples=1000)
    assert apart.num_epochs > 1 and apart.separate_final_epoch
    assert together.num_epochs > 1 and not together.separate_final_epoch
    documents = np.arange(50)
    assert sorted(apart.document_order[-50:]) == documents.tolist()  # the last epoch stays whole


def test_a_sample_is_s_plus_1_tokens_of_the_shuffled_document_stream(prefixes):
    """The definition, checked without megatron-core: sample i is stream tokens [j*S, j*S + S + 1), j = shuffle[i]."""
    dataset = IndexedDataset(prefixes["a"])
    samples = GPTSamples(dataset, train_documents("100", len(dataset)), seq_length=16, seed=1, num_samples=90)
    stream = np.concatenate([dataset.get(int(d)) for d in samples.document_order]).astype(np.int64)
    assert sorted(samples.shuffle.tolist()) == list(range(len(samples)))
    for i in (0, 1, len(samples) - 1):
        j = int(samples.shuffle[i])
        assert samples.sample(i).tolist() == stream[j * 16:j * 16 + 17].tolist()


def test_a_blend_follows_its_weights(prefixes):
    blend = ours([0.25, prefixes["a"], 0.75, prefixes["c"]], split="100", seq_length=8, seed=2, num_samples=400)
    assert isinstance(blend, BlendedSamples)
    sources = [blend.source(i)[0] for i in range(len(blend))]
    assert abs(sources.count(0) - 100) <= 1 and abs(sources.count(1) - 300) <= 1
    # Each dataset's samples are taken in its own order, none twice.
    for k in (0, 1):
        taken = [blend.source(i)[1] for i in range(len(blend)) if sources[i] == k]
        assert taken == list(range(len(taken)))


def test_megatron_core_reads_our_files_and_we_read_its_files(tmp_path, prefixes):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    theirs = MegatronIndexed(prefixes["b"])
    mine = IndexedDataset(prefixes["b"])
    assert theirs.index.dtype == np.int32 and mine.dtype == np.int32 and len(theirs) == len(mine) == 30
    assert all(np.array_equal(theirs[i], mine.get(i)) for i in range(30))
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for i in range(len(mine)):
        builder.add_document(torch.tensor(mine.get(i).astype(np.int64)), [int(mine.sequence_lengths[i])])
    builder.finalize(str(tmp_path / "m.idx"))
    again = IndexedDataset(tmp_path / "m")
    assert again.dtype == np.uint16 and all(np.array_equal(again.get(i), mine.get(i)) for i in range(30))
    # Our writer produces the same index bytes as megatron-core's builder.
    from heteroflow.data.indexed import IndexedWriter
    writer = IndexedWriter(tmp_path / "w", "uint16")
    for i in range(len(mine)):
        writer.add_document(mine.get(i))
    writer.close()
    assert (tmp_path / "w.idx").read_bytes() == (tmp_path / "m.idx").read_bytes()
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()
