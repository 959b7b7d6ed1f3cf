"""End-to-end: a Megatron dataset made by `prepare-data` trains under `heteroflow train --emulate`, on the samples
megatron-core's GPTDataset/BlendedDataset draw for the same seed, and multi-rank equals the one-device reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

from heteroflow.config import load_job
from heteroflow.data import open_train_data
from heteroflow.data.corpus import builtin_documents
from heteroflow.runtime.metrics import read_step_records
from heteroflow.runtime.reference import train_reference

STEPS, GLOBAL_BATCH = 3, 8


def heteroflow(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=env)


@pytest.mark.slow
def test_prepared_megatron_blend_trains_on_megatrons_samples(tmp_path):
    sys.path.insert(0, str(REPO / "tests/data"))
    from indexed_helpers import megatron_train_split, write_hf_tokenizer

    env = {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}
    tokenizer = write_hf_tokenizer(tmp_path / "tokenizer")
    docs = builtin_documents()
    for name, part in (("web", docs[:500]), ("code", docs[500:800])):
        source = tmp_path / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        made = heteroflow("prepare-data", str(source), "--tokenizer", str(tokenizer), "-o",
                          str(tmp_path / "data" / name), "--append-eod", env=env)
        assert made.returncode == 0, made.stderr
    job_path = tmp_path / "job.yaml"
    job_path.write_text(textwrap.dedent(f"""
        cluster: {{nodes: [{{name: a, device: cpu, count: 4}}]}}
        model: {{preset: micro-llama, vocab_size: 512}}
        train:
          global_batch_size: {GLOBAL_BATCH}
          micro_batch_size: 4
          steps: {STEPS}
          precision: fp32
          lr: 3.0e-3
          warmup_steps: 1
          seed: 77
          data: {{prefixes: [0.7, data/web, 0.3, data/code], split: "98,2,0"}}
        plan:
          micro_batch_size: 4
          stages:
            - {{devices: ["a:0-1"], layers: 2, dp: 2}}
            - {{devices: ["a:2-3"], layers: 2, tp: 2}}
        """))
    metrics = tmp_path / "metrics.jsonl"
    result = heteroflow("train", str(job_path), "--emulate", "--metrics", str(metrics), env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    losses = [r["loss"] for r in read_step_records(metrics)]
    job = load_job(job_path)
    # Two stages, dp 2 then tp 2, give the one-device reference's losses: every rank read its share of the
    # samples the reference reads.
    reference, _ = train_reference(job, steps=STEPS, data_dir=str(tmp_path / "ref"))
    assert losses == pytest.approx(reference, rel=1e-5)
    # And those samples are megatron-core's, step by step (Megatron asks for train_iters * global_batch_size).
    data = open_train_data(job, work_dir=tmp_path / "ref")
    megatron = megatron_train_split([0.7, str(tmp_path / "data/web"), 0.3, str(tmp_path / "data/code")],
                                    split="98,2,0", seq_length=job.model.seq_length, seed=77,
                                    num_samples=STEPS * GLOBAL_BATCH)
    for step in range(STEPS):
        inputs, labels = data.batch(data.global_batch(step))
        for row, i in enumerate(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)):
            assert inputs[row].tolist() == megatron[i]["tokens"].tolist()
            assert labels[row].tolist() == megatron[i]["labels"].tolist()
