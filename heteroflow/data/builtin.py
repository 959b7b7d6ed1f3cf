"""The data a job trains on: `train.data` (a token file or Megatron datasets), or the built-in corpus tokenized
for the model."""

from __future__ import annotations

import uuid
from pathlib import Path

from heteroflow.data.corpus import builtin_documents
from heteroflow.data.tokenizer import EOS, builtin_tokenizer
from heteroflow.data.megatron_data import open_megatron_data
from heteroflow.data.tokens import SampleOrder, TokenFile, TrainData, write_token_file


def build_corpus_bin(path: str | Path, *, vocab_size: int) -> Path:
    """Tokenize the built-in corpus with the built-in tokenizer cut to `vocab_size` ids and write it as
    a uint16 token file (documents separated by `<eos>`); deterministic, so every rank writes the same
    bytes and an existing file of the same size is reused."""
    tokenizer = builtin_tokenizer(vocab_size)
    tokens: list[int] = []
    for doc in builtin_documents():
        tokens += tokenizer.encode(doc)
        tokens.append(EOS)
    path = Path(path)
    if path.is_file() and path.stat().st_size == 2 * len(tokens):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Each writer gets a temporary file of its own, then renames it into place (atomic): ranks that race
    # each replace the file with identical bytes. One shared temporary name let a rank rename away the
    # file another was about to rename.
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write_token_file(tmp, tokens, "uint16")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def open_train_data(job, *, work_dir: str | Path, steps: int | None = None) -> TrainData:
    """The job's `train.data` (a token file or Megatron datasets), or the built-in corpus (written under
    `work_dir`), checked against the model's vocabulary and sequence length, with its sample order.

    Megatron datasets are drawn for `max(train.steps, steps) * global_batch_size` samples, as Megatron draws
    `train_iters * global_batch_size`: a shorter `--steps` run reads the first steps of the full run."""
    model, data, train = job.model, job.train.data, job.train
    if data is not None and data.indexed:
        num_samples = max(train.steps, steps or 0) * train.global_batch_size
        samples = open_megatron_data(job, num_samples=num_samples)
        # Megatron's samples are already in training order: step t reads the t-th run of global batches.
        order = SampleOrder(num_samples=len(samples), global_batch_size=train.global_batch_size, seed=train.seed,
                            shuffle=False)
        return TrainData(samples=samples, order=order)
    if data is None:
        path = build_corpus_bin(Path(work_dir, f"builtin-corpus-v{model.vocab_size}.bin"), vocab_size=model.vocab_size)
        token_file = TokenFile(path, seq_length=model.seq_length, dtype="uint16")
    else:
        token_file = TokenFile(job.resolve_path(data.path), seq_length=model.seq_length, dtype=data.dtype)
    token_file.check_vocab(model.vocab_size)
    order = SampleOrder(num_samples=token_file.num_samples, global_batch_size=train.global_batch_size, seed=train.seed,
                        shuffle=data.shuffle if data is not None else True)
    return TrainData(samples=token_file, order=order)
