"""The committed corpus and tokenizer: reproducible, round-tripping, fitting the tiny models."""

from __future__ import annotations

import threading
from importlib import resources
from pathlib import Path

import yaml

from heteroflow.config import PRESETS, load_job, parse_job
from heteroflow.data import (TokenFile, build_corpus_bin, builtin_tokenizer, open_train_data, train_bpe,
                             write_token_file)
from heteroflow.data.corpus import builtin_corpus_text, make_corpus
from heteroflow.data.tokenizer import EOS, Tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_committed_files_are_what_the_generator_makes():
    text = make_corpus()
    assert builtin_corpus_text() == text and 200_000 < len(text) < 1_000_000
    committed = builtin_tokenizer()
    trained = train_bpe(text, vocab_size=512)
    assert (committed.alphabet, committed.merges) == (trained.alphabet, trained.merges)
    assert resources.files("heteroflow.data").joinpath("corpus.txt").is_file()  # shipped as package data


def test_tokenizer_round_trips_and_truncates_to_any_model_vocabulary():
    text = builtin_corpus_text()[:5000]
    for vocab in (PRESETS["tiny-llama"].vocab_size, PRESETS["micro-llama"].vocab_size, 100):
        tok = builtin_tokenizer(vocab)
        ids = tok.encode(text)
        assert tok.vocab_size <= vocab and max(ids) < vocab and tok.decode(ids) == text
    full = builtin_tokenizer(512)
    ids = full.encode("Mira lives in Valen.")
    assert full.decode(ids) == "Mira lives in Valen." and len(ids) <= 6  # merges learned whole words
    assert Tokenizer(["a"], []).encode("ab") == [3, 0]  # unknown characters become <unk>


def test_corpus_bin_fits_the_model_and_is_deterministic(tmp_path):
    a = build_corpus_bin(tmp_path / "a.bin", vocab_size=256)
    b = build_corpus_bin(tmp_path / "b.bin", vocab_size=256)
    assert a.read_bytes() == b.read_bytes()
    data = TokenFile(a, seq_length=32)
    data.check_vocab(256)
    assert data.num_samples > 1000 and EOS in data.tokens[:2000]


def test_ranks_that_build_the_corpus_file_at_once_all_succeed(tmp_path):
    # Ranks started directly (run_worker in tests and benchmarks) race to write the same file. With one
    # shared temporary name this failed in more than half of the attempts with 8 writers.
    for attempt in range(3):
        path = tmp_path / f"{attempt}" / "corpus.bin"
        errors: list[BaseException] = []

        def build(path=path, errors=errors):
            try:
                build_corpus_bin(path, vocab_size=256)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=build) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert [p.name for p in path.parent.iterdir()] == ["corpus.bin"]  # no temporary files left
        TokenFile(path, seq_length=32).check_vocab(256)


def test_job_without_train_data_uses_the_builtin_corpus(tmp_path):
    job = load_job(REPO / "configs/jobs/emulated-three-vendor.yaml")
    assert job.train.data is None
    data = open_train_data(job, work_dir=tmp_path)
    assert data.samples.seq_length == job.model.seq_length and data.num_samples > 500


def test_job_with_train_data_reads_that_file(tmp_path):
    write_token_file(tmp_path / "tokens.bin", list(range(500)) * 3, "uint32")
    jobs = REPO / "configs/jobs"
    raw = yaml.safe_load((jobs / "emulated-three-vendor.yaml").read_text())
    raw["train"]["data"] = {"path": str(tmp_path / "tokens.bin"), "dtype": "uint32", "shuffle": False}
    job = parse_job(raw, base_dir=str(jobs))
    data = open_train_data(job, work_dir=tmp_path)
    assert data.num_samples == 1499 // job.model.seq_length and data.samples.sample(1)[0] == job.model.seq_length
