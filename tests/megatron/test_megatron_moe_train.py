"""End-to-end: a Megatron MoE launch imported by `heteroflow import-megatron` trains under `heteroflow train
--emulate` on a 2-stage pipeline and gives the one-device reference's losses (the imported `model.moe`, aux loss
coefficient included, is a model the runtime runs)."""

from __future__ import annotations

import pytest

from heteroflow.config import load_job
from heteroflow.runtime.metrics import read_step_records
from heteroflow.runtime.reference import train_reference
from megatron_helpers import heteroflow

STEPS = 2
SCRIPT = f"""#!/bin/bash
torchrun --nproc_per_node 2 --nnodes 1 pretrain_gpt.py \\
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 64 \\
    --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --train-iters {STEPS} --lr 1e-3 \\
    --tokenizer-type NullTokenizer --vocab-size 512 --swiglu --disable-bias-linear --position-embedding-type rope \\
    --normalization RMSNorm --attention-dropout 0.0 --hidden-dropout 0.0 --mock-data \\
    --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-aux-loss-coeff 1e-2 \\
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm --pipeline-model-parallel-size 2
"""


@pytest.mark.slow
def test_imported_megatron_moe_job_trains_and_equals_the_one_device_run(tmp_path):
    script, job_path, metrics = tmp_path / "moe.sh", tmp_path / "job.yaml", tmp_path / "metrics.jsonl"
    script.write_text(SCRIPT)
    imported = heteroflow("import-megatron", str(script), "--device-type", "cpu", "-o", str(job_path))
    assert imported.returncode == 0, imported.stderr
    job = load_job(job_path)
    assert job.model.moe.num_experts == 4 and job.model.moe.aux_loss_coeff == pytest.approx(0.005)
    trained = heteroflow("train", str(job_path), "--emulate", "--metrics", str(metrics), cwd=tmp_path,
                         env={"HETEROFLOW_CACHE": str(tmp_path / "cache")}, timeout_s=600)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-4000:]
    records = read_step_records(metrics)
    assert all(r["aux_loss"] > 0 for r in records)  # the load-balancing loss is trained on and reported
    reference, _ = train_reference(job, steps=STEPS, data_dir=str(tmp_path / "ref"))
    assert [r["loss"] for r in records] == pytest.approx(reference, rel=1e-5)
