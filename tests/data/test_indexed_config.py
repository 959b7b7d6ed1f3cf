"""`train.data` for Megatron datasets: the YAML is validated with paths, and opening names what is wrong."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import problems
from indexed_helpers import write_dataset

from heteroflow.config import parse_job
from heteroflow.data import open_train_data
from heteroflow.errors import UserError

JOB = {"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 2}]},
       "model": {"preset": "micro-llama", "vocab_size": 1000, "seq_length": 16},
       "train": {"global_batch_size": 4, "steps": 5}}


def job_with(data) -> dict:
    job = copy.deepcopy(JOB)
    job["train"]["data"] = data
    return job


@pytest.mark.parametrize("data,expected", [
    ({"prefixes": [0.3, "a", "b"]}, "train.data.prefixes[0]: expected a dataset prefix"),
    ({"prefixes": [0.3, "a", "b", "c"]}, "train.data.prefixes: mixes weights and prefixes"),
    ({"prefixes": [0, "a", 1, "b"]}, "train.data.prefixes[0]: a blend weight must be a finite number above 0"),
    ({"prefixes": ["-1", "a", "1", "b"]}, "train.data.prefixes[0]: a blend weight must be a finite number above 0"),
    ({"prefixes": [1, "a", 2, 3]}, "train.data.prefixes[3]: expected a dataset prefix"),
    ({"prefixes": []}, "train.data.prefixes: is empty"),
    ({"prefixes": "data/x.bin"}, "train.data.prefixes: a prefix names the files without their suffix: use 'data/x'"),
    ({"prefixes": "a", "split": "90;10"}, "train.data.split: expected train,valid,test shares"),
    ({"prefixes": "a", "split": "1,2,3,4"}, "train.data.split: expected train,valid,test shares"),
    ({"prefixes": "a", "split": "0,10,0"}, "train.data.split: the train share is 0"),
    ({"prefixes": "a", "split": "0,0"}, "train.data.split: the shares must add up to more than 0"),
    ({"prefixes": "a", "shuffle": False}, "train.data.shuffle: Megatron datasets are always shuffled"),
    ({"prefixes": "a", "path": "t.bin"}, "train.data.prefixes: set either path"),
    ({"path": "t.bin", "split": "1,0,0"}, "train.data.split: applies to Megatron datasets"),
    ({"prefixes": "a", "dtype": "int64"}, "train.data.dtype: must be one of uint16, uint32, int32"),
    ({}, "train.data: set path (a flat token file) or prefixes"),
])
def test_bad_data_sections_name_the_path(data, expected):
    found = problems(job_with(data))
    assert any(line.startswith(expected) for line in found), found


def test_good_data_sections_round_trip():
    for data in ({"prefixes": [0.3, "web", 0.7, "code"], "split": "98,2,0"}, {"prefixes": ["a", "b"]},
                 {"prefixes": ["1", "a"], "dtype": "int32"}, {"path": "t.bin", "dtype": "uint32", "shuffle": False}):
        job = parse_job(job_with(data))
        again = parse_job(job_with(job.train.to_dict()["data"]))
        assert again.train.data == job.train.data
    weighted = parse_job(job_with({"prefixes": ["0.3", "web", "0.7", "code"]})).train.data
    assert weighted.prefixes == ("web", "code") and weighted.weights == (0.3, 0.7) and weighted.split == "969,30,1"
    assert weighted.prefix_path(1) == "train.data.prefixes[3]"


def _job(tmp_path, data):
    return parse_job(job_with(data), base_dir=str(tmp_path))


def test_opening_reports_missing_files_dtype_mismatches_and_corruption(tmp_path):
    write_dataset(tmp_path / "a", num_docs=20, seed=1)
    write_dataset(tmp_path / "b", num_docs=20, seed=2, dtype="int32")
    with pytest.raises(UserError, match=r"train.data.prefixes\[3\]: .*missing.idx not found"):
        open_train_data(_job(tmp_path, {"prefixes": [1, "a", 1, "missing"]}), work_dir=tmp_path)
    with pytest.raises(UserError, match=r"train.data.prefixes\[1\]: b.idx stores int32 tokens, but train.data.dtype "
                                        r"is uint16"):
        open_train_data(_job(tmp_path, {"prefixes": ["a", "b"], "dtype": "uint16"}), work_dir=tmp_path)
    (tmp_path / "c.idx").write_bytes((tmp_path / "a.idx").read_bytes())
    (tmp_path / "c.bin").write_bytes(np.fromfile(tmp_path / "a.bin", np.uint16).astype(np.int32).tobytes())
    with pytest.raises(UserError, match="describes .* uint16 tokens .*it fits int32: the index's dtype is wrong"):
        open_train_data(_job(tmp_path, {"prefixes": "c"}), work_dir=tmp_path)
    (tmp_path / "c.idx").write_bytes((tmp_path / "a.idx").read_bytes()[:-8])
    with pytest.raises(UserError, match="the file is truncated or not an index"):
        open_train_data(_job(tmp_path, {"prefixes": "c"}), work_dir=tmp_path)
    (tmp_path / "c.idx").write_bytes(b"not an index at all, no header" * 2)
    with pytest.raises(UserError, match="not a Megatron index file"):
        open_train_data(_job(tmp_path, {"prefixes": "c"}), work_dir=tmp_path)


def test_opening_checks_the_vocabulary_and_the_split_size(tmp_path):
    write_dataset(tmp_path / "a", num_docs=20, seed=1, vocab_size=3000)
    job = _job(tmp_path, {"prefixes": "a"})
    with pytest.raises(UserError, match=r"train.data.prefixes: .*a.bin contains token id \d+, but model.vocab_size "
                                        "is 1000"):
        open_train_data(job, work_dir=tmp_path)
    write_dataset(tmp_path / "s", num_docs=3, seed=1, max_len=4)
    with pytest.raises(UserError, match=r"the train split \('969,30,1'\) of s holds 3 of its 3 documents, \d+ tokens; "
                                        "one sample of model.seq_length 16 needs 17"):
        open_train_data(_job(tmp_path, {"prefixes": "s"}), work_dir=tmp_path)


def test_a_short_run_reads_the_first_steps_of_the_full_run(tmp_path):
    """Samples are drawn for train.steps (Megatron's train_iters): `--steps 2` reads what the full run reads."""
    write_dataset(tmp_path / "a", num_docs=40, seed=4)
    job = _job(tmp_path, {"prefixes": [0.5, "a", 0.5, "a"]})
    full, short = open_train_data(job, work_dir=tmp_path), open_train_data(job, work_dir=tmp_path, steps=2)
    longer = open_train_data(job, work_dir=tmp_path, steps=50)
    assert full.num_samples >= 5 * 4 and longer.num_samples >= 50 * 4
    for step in (0, 1):
        assert full.batch(full.global_batch(step))[0].tolist() == short.batch(short.global_batch(step))[0].tolist()
    assert full.global_batch(1).tolist() == [4, 5, 6, 7]  # Megatron's dataset order is the training order
