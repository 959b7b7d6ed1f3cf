"""`train.init_from` through the distributed runtime gives the first-step loss computed directly."""

from __future__ import annotations

import pytest
import torch

from heteroflow.config import parse_job
from heteroflow.data.builtin import open_train_data
from heteroflow.data.tokens import SampleOrder
from heteroflow.models.hf_checkpoint import write_hf_checkpoint
from heteroflow.models.init import init_weights
from heteroflow.models.llama import build_stage_model
from heteroflow.runtime.worker import WorkerArgs, run_worker
from heteroflow.testing import run_ranks

MODEL = {"preset": "micro-llama"}
CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
                     {"name": "npu-0", "device": "ascend-910b2", "count": 2}]}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": 1, "seed": 1234}
PLAN = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [
    {"devices": ["gpu-0"], "layers": 3, "tp": 2, "dp": 1},
    {"devices": ["npu-0"], "layers": 1, "tp": 1, "dp": 2}]}


def _train_rank(rank: int, world_size: int, args: WorkerArgs):
    return run_worker(args)


@pytest.mark.slow
def test_init_from_first_step_loss_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": {**TRAIN, "init_from": str(tmp_path / "ckpt")},
                     "plan": PLAN})
    # A checkpoint with weights from another seed, so loading it (not the seed init) decides the loss.
    donor = build_stage_model(job.model, first_layer=0, last_layer=job.model.num_layers, is_first=True, is_last=True)
    init_weights(donor, seed=99)
    write_hf_checkpoint(donor.state_dict(), job.model, tmp_path / "ckpt", num_shards=2)

    data_dir = str(tmp_path / "data")
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=1, data_dir=data_dir, show_progress=False,
                      timeout_s=120)
    loss = run_ranks(_train_rank, job.plan.num_devices, args, timeout_s=300)[0].losses[0]

    data = open_train_data(job, work_dir=data_dir)
    order = SampleOrder(num_samples=data.num_samples, global_batch_size=8, seed=1234)
    tokens, labels = data.batch(order.global_batch(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits
    direct = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert loss == pytest.approx(direct, rel=1e-5)
    seeded = build_stage_model(job.model, first_layer=0, last_layer=job.model.num_layers, is_first=True, is_last=True)
    init_weights(seeded, seed=1234)
    with torch.no_grad():
        seed_init_loss = seeded(tokens, labels=labels).item() / labels.numel()
    assert abs(seed_init_loss - direct) > 1e-4  # the loaded weights, not the seed's, produced the loss
