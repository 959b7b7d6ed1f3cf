"""A MoE model (dense first layer, gated shared expert, aux loss) on a 2-stage plan with tp 2 on one stage
trains as the single-process reference does, and reports its aux loss next to the LM loss; a transformers
Mixtral loaded with `init_from` gives transformers' first-step loss on one device and on that plan."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_tiny_mixtral
from heteroflow.config import parse_job
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.testing import run_ranks
from heteroflow.testing.training import assemble_weights, assert_weights_close, train_rank

STEPS = 3
CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 2},
                     {"name": "npu-0", "device": "ascend-910b2", "count": 1}]}
MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "shared_expert_ffn_hidden_size": 48,
       "shared_expert_gate": True, "first_dense_layers": 1, "aux_loss_coeff": 0.05}
MODEL = {"preset": "micro-llama", "moe": MOE}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "warmup_steps": 1, "grad_clip": 1.0}
PLAN = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [
    {"devices": ["gpu-0"], "layers": 3, "tp": 2, "dp": 1, "recompute": "full"},
    {"devices": ["npu-0"], "layers": 1, "tp": 1, "dp": 1}]}




@pytest.mark.slow
def test_two_stage_tp_plan_matches_single_process(tmp_path):
    data_dir = str(tmp_path / "data")
    job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": TRAIN, "plan": PLAN})
    assert job.model.moe is not None and not job.model.is_moe_layer(0) and job.model.is_moe_layer(3)
    ref_losses, ref_weights = train_reference(job, steps=STEPS, data_dir=data_dir)
    metrics = tmp_path / "metrics.jsonl"
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=STEPS, data_dir=data_dir, return_state=True,
                      show_progress=False, timeout_s=120, metrics_path=str(metrics))
    results = run_ranks(train_rank, job.plan.num_devices, args, timeout_s=300)
    assert results[0].losses == pytest.approx(ref_losses, rel=1e-5)
    weights = assemble_weights(results)
    for name, want in ref_weights.items():  # the router and gates included: their tp gradients are right
        assert_weights_close(weights[name], want, tol=1e-5, name=name)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"step"' in line]
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    assert records[0]["aux_loss"] == pytest.approx(first_step_aux_loss(job, data_dir), rel=1e-5)
    assert all(r["aux_loss"] > 0 for r in records)


def first_step_aux_loss(job, data_dir: str) -> float:
    """Step 0's aux loss on one process: per layer, the token-weighted mean over the micro-batches, then
    the mean over MoE layers."""
    from heteroflow.data.builtin import open_train_data
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.models.moe import moe_layers, set_aux_loss_scale, take_aux_losses

    spec, train = job.model, job.train
    model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    init_weights(model, seed=train.seed)
    set_aux_loss_scale(model, step_tokens=train.global_batch_size * spec.seq_length)
    data = open_train_data(job, work_dir=data_dir, steps=1)
    indices = data.order.global_batch(0)
    for start in range(0, len(indices), train.micro_batch_size):
        tokens, labels = data.batch(indices[start:start + train.micro_batch_size])
        model(tokens, labels=labels).backward()
    return take_aux_losses(model).item() / len(moe_layers(model))


@pytest.mark.slow
def test_aux_loss_coefficient_changes_training_not_the_loss_figure(tmp_path):
    """The aux term moves the weights (router gradients), while step 0's `loss` stays the cross entropy."""
    data_dir = str(tmp_path / "data")
    runs = {}
    for coeff in (0.0, 1.0):
        job = parse_job({"cluster": CLUSTER, "model": {**MODEL, "moe": {**MOE, "aux_loss_coeff": coeff}},
                         "train": TRAIN})
        runs[coeff] = train_reference(job, steps=2, data_dir=data_dir)
    (loss0, w0), (loss1, w1) = runs[0.0], runs[1.0]
    assert loss0[0] == loss1[0]
    assert loss0[1] != loss1[1]
    assert not torch.equal(w0["layers.1.mlp.router.weight"], w1["layers.1.mlp.router.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("plan", [
    {"schedule": "1f1b", "micro_batch_size": 4, "stages": [{"devices": ["npu-0"], "layers": 4}]},
    PLAN,
])
def test_init_from_mixtral_first_step_loss_matches_transformers(tmp_path, plan):
    """A random tiny Mixtral saved by transformers, loaded with `train.init_from` (experts split over tp on
    the 2-stage plan), gives transformers' first-step loss on the same batch."""
    from heteroflow.data.builtin import open_train_data

    hf = save_tiny_mixtral(tmp_path / "mixtral", num_experts=4)
    model = {"preset": "micro-llama", "ffn_hidden_size": 96, "rope_theta": 1000000.0,
             "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 96, "aux_loss_coeff": 0.02}}
    job = parse_job({"cluster": CLUSTER, "model": model, "plan": plan,
                     "train": {**TRAIN, "steps": 1, "init_from": str(tmp_path / "mixtral")}})
    data_dir = str(tmp_path / "data")
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=1, data_dir=data_dir, show_progress=False,
                      timeout_s=120)
    loss = run_ranks(train_rank, job.plan.num_devices, args, timeout_s=300)[0].losses[0]
    data = open_train_data(job, work_dir=data_dir, steps=1)
    tokens, labels = data.batch(data.order.global_batch(0))
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item(),
                                 rel=1e-5)
