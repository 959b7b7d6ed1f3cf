"""`heteroflow prepare-data`: text and JSONL into Megatron's indexed format, read back by megatron-core."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from indexed_helpers import write_hf_tokenizer

from heteroflow.cli import main
from heteroflow.data.corpus import builtin_documents
from heteroflow.data.tokenizer import EOS, builtin_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_hf_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", "prepare-data", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_jsonl_and_text_become_a_dataset_megatron_core_reads(tmp_path, tokenizer_dir):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = builtin_documents()[:40]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs[:30])) + "\n")
    text = tmp_path / "more.txt"
    text.write_text("\n\n".join(docs[30:]) + "\n")
    result = run(str(jsonl), str(text), "--tokenizer", str(tokenizer_dir), "-o", str(tmp_path / "out/corpus"),
                 "--json-key", "body", "--append-eod")
    assert result.returncode == 0, result.stderr
    assert "40 documents" in result.stdout and "uint16, vocabulary 481" in result.stdout
    dataset = IndexedDataset(str(tmp_path / "out/corpus"))
    assert dataset.index.dtype == np.uint16 and len(dataset) == 40
    assert list(dataset.document_indices) == list(range(41))
    encoder = builtin_tokenizer()  # the same vocabulary and merges as the Hugging Face copy
    for i in (0, 29, 30, 39):
        assert dataset[i].tolist() == encoder.encode(docs[i]) + [EOS]
    assert not list((tmp_path / "out").glob("*tmp*"))


def _fails(capsys, *args: str) -> str:
    assert main(["prepare-data", *args]) == 2
    return capsys.readouterr().err


def test_bad_input_is_a_path_message_and_exit_2(tmp_path, tokenizer_dir, capsys):
    tok, out = str(tokenizer_dir), str(tmp_path / "x")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"{empty}: the file is empty" in _fails(capsys, str(empty), "--tokenizer", tok, "-o", out)
    assert f"{tmp_path / 'nope.txt'}: input file not found" in _fails(capsys, str(tmp_path / "nope.txt"),
                                                                     "--tokenizer", tok, "-o", out)
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "one"}\n{"content": "two"}\n')
    err = _fails(capsys, str(records), "--tokenizer", tok, "-o", out)
    assert f"{records}:2: no 'text' field (fields: 'content'); choose the field with --json-key" in err
    records.write_text('{"text": ["a"]}\n')
    assert f"{records}:1: field 'text' is list, expected a string" in _fails(capsys, str(records), "--tokenizer", tok,
                                                                            "-o", out)
    records.write_text('{"text": "a"\n')
    assert f"{records}:1: not a JSON object" in _fails(capsys, str(records), "--tokenizer", tok, "-o", out)
    records.write_text('{"text": "a"}\n')
    missing = tmp_path / "no-tokenizer"
    assert f"{missing}: tokenizer directory not found" in _fails(capsys, str(records), "--tokenizer", str(missing),
                                                                 "-o", out)
    assert "give the prefix without .bin/.idx" in _fails(capsys, str(records), "--tokenizer", tok, "-o", out + ".bin")
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n')
    assert "no document has any token" in _fails(capsys, str(blank), "--tokenizer", tok, "-o", out)
    assert not list(tmp_path.glob("x*"))  # nothing half-written


def test_dtype_follows_the_vocabulary_as_megatron_chooses(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    big = tmp_path / "big"
    big.mkdir()
    words = {f"w{i}": i for i in range(70_000)}
    hf = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(big / "tokenizer.json"))
    (big / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "w1"}))
    text = tmp_path / "t.txt"
    text.write_text("w5 w69999 w7\n\nw3\n")
    err = _fails(capsys, str(text), "--tokenizer", str(big), "-o", str(tmp_path / "u"), "--dtype", "uint16")
    assert "--dtype uint16: the tokenizer has 70000 ids but uint16 holds ids up to 65535" in err
    assert main(["prepare-data", str(text), "--tokenizer", str(big), "-o", str(tmp_path / "i"), "--append-eod"]) == 0
    assert "2 documents, 6 tokens (int32, vocabulary 70000)" in capsys.readouterr().out
    from heteroflow.data.indexed import IndexedDataset
    dataset = IndexedDataset(tmp_path / "i")
    assert dataset.dtype == np.int32
    assert dataset.get(0).tolist() == [5, 69999, 7, 1] and dataset.get(1).tolist() == [3, 1]
