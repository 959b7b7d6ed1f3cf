"""A GELU-expert MoE (Megatron's non-gated experts and shared expert) with the per-sequence load-balancing loss,
the router z-loss and a top-k scaling factor, or with Sinkhorn routing (its balancing pooled likewise), trains on
a 2-stage emulated plan with ep 2 on both stages (dp 2 on one, cp 2 on the other: the statistics pooled over dp
and over the cp chunks of each sequence) as the single-process reference does, over 3 steps."""

from __future__ import annotations

import pytest

from heteroflow.config import parse_job
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.testing.training import check_against_reference, run_training

STEPS = 3
CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
                     {"name": "npu-0", "device": "ascend-910b2", "count": 2}]}
MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "shared_expert_ffn_hidden_size": 48,
       "aux_loss_coeff": 0.05, "aux_loss_type": "sequence", "z_loss_coeff": 0.01, "topk_scaling_factor": 1.5}
MODEL = {"preset": "micro-llama", "activation": "gelu", "moe": MOE}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "warmup_steps": 1, "grad_clip": 1.0}
PLAN = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [
    {"devices": ["gpu-0"], "layers": 2, "tp": 1, "dp": 2, "ep": 2},
    {"devices": ["npu-0"], "layers": 2, "tp": 1, "cp": 2, "dp": 1, "ep": 2}]}


SINKHORN = {"num_experts": 4, "top_k": 1, "ffn_hidden_size": 32, "sinkhorn": True, "normalize_top_k": False,
            "z_loss_coeff": 0.01}


@pytest.mark.slow
@pytest.mark.parametrize("moe", [MOE, SINKHORN], ids=["sequence-aux-loss", "sinkhorn"])
def test_gelu_experts_with_megatron_routing_options_under_ep_match_single_process(tmp_path, moe):
    data_dir = str(tmp_path / "data")
    job = parse_job({"cluster": CLUSTER, "model": {**MODEL, "moe": moe}, "train": TRAIN, "plan": PLAN})
    assert job.model.activation == "gelu"
    ref_losses, ref_weights = train_reference(job, steps=STEPS, data_dir=data_dir)
    assert "layers.0.mlp.experts.0.w3.weight" not in ref_weights  # fc1 / fc2 only
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=STEPS, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=120)
    results = run_training(args, timeout_s=300)
    # the router's weights included: the sequence aux loss, z-loss and routing choices are the one-device ones
    check_against_reference(results, ref_losses, ref_weights)
