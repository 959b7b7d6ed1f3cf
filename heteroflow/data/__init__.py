"""Training data: the built-in corpus and tokenizer, flat token files, Megatron indexed datasets (`indexed`,
`gpt_samples`, `blend`), and the plan-independent order in which samples are read (`tokens`)."""

from heteroflow.data.builtin import build_corpus_bin, open_train_data
from heteroflow.data.tokenizer import Tokenizer, builtin_tokenizer, train_bpe
from heteroflow.data.tokens import SampleOrder, TokenFile, TrainData, micro_batch_indices, write_token_file

__all__ = ["SampleOrder", "TokenFile", "Tokenizer", "TrainData", "build_corpus_bin", "builtin_tokenizer",
           "micro_batch_indices", "open_train_data", "train_bpe", "write_token_file"]
