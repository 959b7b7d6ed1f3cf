"""`heteroflow prepare-data`: tokenize text or JSONL with a Hugging Face tokenizer into Megatron's indexed
format (`PREFIX.bin` + `PREFIX.idx`), as Megatron's `tools/preprocess_data.py` does.

Documents: each line of a `.jsonl`/`.json` file is a JSON object whose `json_key` field is one document;
in any other file, blocks separated by blank lines are documents. The tokenizer is loaded with
`transformers.AutoTokenizer` from a local directory (never downloaded) and encodes as Megatron's
`HuggingFaceTokenizer` does (its special tokens included); `append_eod` ends each document with its
`eos_token`. Token dtype: uint16 below 65500 ids, else int32 (Megatron's rule). Nothing is left behind
on an error: both files are written under temporary names and renamed at the end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from heteroflow.data.indexed import IndexedWriter, data_path, index_path, token_dtype
from heteroflow.errors import UserError

JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareReport:
    """What `prepare_data` wrote."""

    prefix: str
    dtype: str
    vocab_size: int
    num_documents: int
    num_tokens: int
    num_empty: int
    """Documents that tokenized to nothing and were left out (Megatron writes no sequence for them)."""


def load_tokenizer(directory: str | Path):
    """A Hugging Face tokenizer from a local directory, or a `UserError` naming the directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: tokenizer directory not found")
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model", "vocab.json")):
        raise UserError(f"{directory}: no Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise UserError("prepare-data needs transformers: pip install transformers") from error
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{directory}: cannot load the tokenizer: {error}") from error


def check_inputs(inputs: list[str]) -> list[Path]:
    """Every input exists and is a non-empty file."""
    if not inputs:
        raise UserError("prepare-data: give at least one input file")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path}: input file not found")
        if path.stat().st_size == 0:
            raise UserError(f"{path}: the file is empty (no documents)")
    return paths


def documents(path: Path, json_key: str) -> Iterator[tuple[str, int]]:
    """(document text, bytes read so far) of one input file."""
    with open(path, "rb") as f:
        if path.suffix.lower() in JSON_SUFFIXES:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield _json_text(raw, path, number, json_key), f.tell()
            return
        block: list[str] = []
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n"), f.tell()
                block = []
        if block:
            yield "".join(block).rstrip("\n"), f.tell()


def _json_text(raw: bytes, path: Path, number: int, key: str) -> str:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path}:{number}: not a JSON object ({error})") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}:{number}: expected a JSON object with a {key!r} field, got {type(record).__name__}")
    if key not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise UserError(f"{path}:{number}: no {key!r} field (fields: {keys}); choose the field with --json-key")
    text = record[key]
    if not isinstance(text, str):
        raise UserError(f"{path}:{number}: field {key!r} is {type(text).__name__}, expected a string")
    return text


def output_dtype(vocab_size: int, dtype: str | None) -> str:
    """Megatron's dtype for the vocabulary, or the requested one if the vocabulary fits it."""
    if dtype is None:
        return token_dtype(vocab_size)
    top = int(np.iinfo(np.dtype(dtype)).max)
    if vocab_size - 1 > top:
        raise UserError(f"--dtype {dtype}: the tokenizer has {vocab_size} ids but {dtype} holds ids up to {top}; "
                        f"use int32 (or leave --dtype out)")
    return dtype


def prepare_data(inputs: list[str], *, tokenizer_dir: str, prefix: str, json_key: str = "text",
                 append_eod: bool = False, dtype: str | None = None, progress: bool = True) -> PrepareReport:
    """Tokenize `inputs` into `prefix.bin` / `prefix.idx`; see the module docstring."""
    if prefix.endswith((".bin", ".idx")):
        raise UserError(f"-o {prefix}: give the prefix without .bin/.idx (Megatron's --data-path form)")
    paths = check_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab_size = len(tokenizer)
    eod = tokenizer.eos_token_id
    if append_eod and eod is None:
        raise UserError(f"{tokenizer_dir}: the tokenizer has no eos_token; --append-eod needs one "
                        "(set eos_token in tokenizer_config.json)")
    dtype = output_dtype(vocab_size, dtype)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    temporary = f"{prefix}.tmp-{os.getpid()}"
    writer = IndexedWriter(temporary, dtype)
    bar = _progress_bar(sum(p.stat().st_size for p in paths), enabled=progress)
    num_docs = num_tokens = num_empty = 0
    try:
        for path in paths:
            done = 0
            for text, read in documents(path, json_key):
                ids = tokenizer(text)["input_ids"]
                if ids and append_eod:
                    ids.append(eod)
                if ids:
                    writer.add_document(ids)
                    num_docs, num_tokens = num_docs + 1, num_tokens + len(ids)
                else:
                    num_empty += 1
                bar.update(read - done)
                done = read
        writer.close()
        if num_docs == 0:
            raise UserError(f"{', '.join(inputs)}: no document has any token")
        os.replace(data_path(temporary), data_path(prefix))
        os.replace(index_path(temporary), index_path(prefix))
    finally:
        bar.close()
        writer.abort()
        for path in (data_path(temporary), index_path(temporary)):
            path.unlink(missing_ok=True)
    return PrepareReport(prefix=prefix, dtype=dtype, vocab_size=vocab_size, num_documents=num_docs,
                         num_tokens=num_tokens, num_empty=num_empty)


def _progress_bar(total_bytes: int, *, enabled: bool):
    from tqdm import tqdm  # comes with transformers, which prepare-data needs anyway
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not enabled, leave=False)
