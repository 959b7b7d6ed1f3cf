"""`train.data.prefixes`: open Megatron indexed datasets and build the samples Megatron trains on."""

from __future__ import annotations

from heteroflow.data.blend import BlendedSamples, train_split
from heteroflow.data.gpt_samples import GPTSamples, train_documents
from heteroflow.data.indexed import IndexedDataset
from heteroflow.errors import UserError


def open_megatron_data(job, *, num_samples: int) -> GPTSamples | BlendedSamples:
    """The train split of `job.train.data` for `num_samples` requested samples (Megatron asks for
    `train_iters * global_batch_size`), each dataset checked against the model's vocabulary."""
    spec, model = job.train.data, job.model
    datasets, documents = [], []
    for k, prefix in enumerate(spec.prefixes):
        where = spec.prefix_path(k)
        dataset = IndexedDataset(job.resolve_path(prefix), where=where)
        if spec.dtype is not None and dataset.dtype.name != spec.dtype:
            raise UserError(f"{where}: {prefix}.idx stores {dataset.dtype.name} tokens, but train.data.dtype is "
                            f"{spec.dtype}; remove train.data.dtype or write the dataset with that dtype")
        docs = train_documents(spec.split, len(dataset))
        tokens = int(dataset.sequence_lengths[docs].sum()) if len(docs) else 0
        if tokens < model.seq_length + 1:
            raise UserError(f"{where}: the train split ({spec.split!r}) of {prefix} holds {len(docs)} of its "
                            f"{len(dataset)} documents, {tokens} tokens; one sample of model.seq_length "
                            f"{model.seq_length} needs {model.seq_length + 1}")
        dataset.check_tokens(model.vocab_size, where=where)
        datasets.append(dataset)
        documents.append(docs)
    return train_split(datasets, list(spec.weights) if spec.weights is not None else None, documents=documents,
                       seq_length=model.seq_length, seed=job.train.seed, num_samples=num_samples)
