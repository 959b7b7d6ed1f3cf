"""Issue 15's mixed plan: ZeRO-3, context parallelism and tp-sharded parameter offload on three stages of three
emulated vendors train like one device (losses within 1e-5, weights), across boundaries between different
layouts (dp 2 -> cp 2 -> tp 2 with sp)."""

from __future__ import annotations

import pytest

from heteroflow.config import parse_job
from heteroflow.offload.optimizer import ADAM_ENV
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.testing.training import check_against_reference, run_training

STEPS = 3
CLUSTER = {"nodes": [{"name": "gpu", "device": "nvidia-a100-80g", "count": 2},
                     {"name": "npu", "device": "ascend-910b2", "count": 2},
                     {"name": "dcu", "device": "hygon-bw1000", "count": 2}]}
MODEL = {"preset": "micro-llama", "num_layers": 6}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "min_lr": 3e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 0.5}
STAGES = [
    {"devices": ["gpu"], "layers": 2, "dp": 2, "zero": 3},                                  # ZeRO-3, dp 2
    {"devices": ["npu"], "layers": 2, "cp": 2, "recompute": "full"},                        # cp 2
    {"devices": ["dcu"], "layers": 2, "tp": 2, "sp": True,                                  # tp 2 + sp, params
     "offload": {"params": "cpu", "optimizer": "cpu"}},                                     # offloaded per shard
]


@pytest.mark.slow
def test_zero3_cp_and_params_offload_with_tp_on_three_vendors_train_like_one_device(tmp_path):
    data_dir = str(tmp_path / "data")
    train = {**TRAIN, "offload_dir": str(tmp_path / "swap")}
    reference = parse_job({"cluster": CLUSTER, "model": MODEL, "train": train})
    ref_losses, ref_weights = train_reference(reference, steps=STEPS, data_dir=data_dir)
    job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": train,
                     "plan": {"schedule": "1f1b", "micro_batch_size": 4, "stages": STAGES}})
    assert [job.cluster.node(s.device_refs[0].node).device for s in job.plan.stages] == \
        ["nvidia-a100-80g", "ascend-910b2", "hygon-bw1000"]
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=STEPS, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=300)
    check_against_reference(run_training(args, timeout_s=600, env={ADAM_ENV: "torch"}), ref_losses, ref_weights)
