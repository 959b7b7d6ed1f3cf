"""Helpers for the Megatron dataset tests: small generated datasets, a Hugging Face tokenizer made from the
built-in one, and megatron-core's own train split as the reference."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np

from heteroflow.data.indexed import IndexedWriter
from heteroflow.data.tokenizer import _PRETOKEN, builtin_tokenizer


def write_dataset(prefix: Path, *, num_docs: int, seed: int, dtype: str = "uint16", vocab_size: int = 1000,
                  max_len: int = 60) -> str:
    """Random documents ending in token 0, some of them only that token, written with our writer."""
    rng = np.random.default_rng(seed)
    writer = IndexedWriter(prefix, dtype)
    for d in range(num_docs):
        n = int(rng.integers(0, max_len)) if d % 7 else 0
        writer.add_document(rng.integers(1, vocab_size, n).tolist() + [0])
    writer.close()
    return str(prefix)


def write_hf_tokenizer(directory: Path) -> Path:
    """The built-in BPE tokenizer as a Hugging Face tokenizer directory (same ids, `<eos>` as its eos)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    builtin = builtin_tokenizer()
    vocab = {token: i for i, token in enumerate(builtin.tokens)}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in builtin.merges], unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(_PRETOKEN.pattern), behavior="isolated")
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<bos>",
         "unk_token": "<unk>"}))
    return directory


class _Tokenizer:
    """What megatron-core's dataset code asks of a tokenizer (no pad token: nothing is masked)."""

    vocab_size, eod = 1 << 20, 0
    unique_identifiers = {"class": "TestTokenizer"}


def megatron_train_split(blend: list, *, split: str, seq_length: int, seed: int, num_samples: int):
    """megatron-core's train dataset for `--data-path blend --split split`, `num_samples` requested."""
    # megatron-core logs and warns at length; silence it for this call only, so other tests' log capture works
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="megatron")
            from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
            from megatron.core.datasets.utils import get_blend_from_list

            config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=get_blend_from_list(blend),
                                      split=split, tokenizer=_Tokenizer(), reset_position_ids=False,
                                      reset_attention_mask=False, eod_mask_loss=False)
            weighted = config.blend[1] is not None
            # Megatron-LM asks for valid and test samples too; with weights every split needs a size.
            sizes = [num_samples, 1, 1] if weighted else [num_samples, None, None]
            return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[0]
    finally:
        logging.disable(previous)
