"""Expert parallelism in the runtime: a transformers Mixtral loaded with `init_from` trains on a 3-stage plan over
three emulated vendors with ep 4, 2 and 1 (etp 1 under tp 2, ZeRO-1 over dp 4) exactly as on one device; etp = tp
under sp with dp; the aux loss record stays the one-device figure."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_tiny_mixtral
from heteroflow.config import parse_job
from heteroflow.runtime.reference import train_reference
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.testing.training import assemble_weights, run_training

STEPS = 3
CLUSTER = {"nodes": [{"name": "gpu-0", "device": "nvidia-a100-80g", "count": 4},
                     {"name": "npu-0", "device": "ascend-910b2", "count": 2},
                     {"name": "dcu-0", "device": "hygon-k100", "count": 1}]}
MOE = {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 96, "aux_loss_coeff": 0.02}
MODEL = {"preset": "micro-llama", "ffn_hidden_size": 96, "rope_theta": 1000000.0, "moe": MOE}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 4, "precision": "fp32", "steps": STEPS, "lr": 3e-3,
         "warmup_steps": 1, "grad_clip": 1.0}
THREE_VENDORS = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [
    {"devices": ["gpu-0"], "layers": 1, "tp": 1, "dp": 4, "ep": 4, "zero": 1},
    {"devices": ["npu-0"], "layers": 2, "tp": 2, "dp": 1, "ep": 2, "etp": 1, "recompute": "full"},
    {"devices": ["dcu-0"], "layers": 1, "tp": 1, "dp": 1}]}
ONE_DEVICE = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [{"devices": ["dcu-0"], "layers": 4}]}


def assert_weights_close(weights: dict, want: dict) -> None:
    """Same weights after a few AdamW steps. Adam divides each update by the gradient's own scale, so an entry
    with a tiny gradient (a router column few tokens choose) moves by lr-sized steps whose rounding follows the
    summation order of dp, ep and tp: 1e-4 absolute on routers (entries ~1.6), 5e-5 on matrices (entries ~0.08;
    a wrong gradient moves whole rows by ~lr = 3e-3 per step)."""
    assert set(weights) == set(want)  # every expert of every layer, under its global name
    for name, value in want.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-4 if "router" in name else 5e-5,
                                   msg=lambda m: f"{name}: {m}")


def train(job, plan, tmp_path, name: str, **kwargs):
    """Run `plan` emulated; returns (rank 0's losses, assembled weights, the metrics' step records)."""
    metrics = tmp_path / f"{name}.jsonl"
    args = WorkerArgs(job=job, plan=plan, emulate=True, steps=kwargs.pop("steps", STEPS), data_dir=str(tmp_path / "data"),
                      return_state=True, show_progress=False, timeout_s=240, metrics_path=str(metrics), **kwargs)
    results = run_training(args, timeout_s=600)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"step"' in line]
    return list(results[0].losses), assemble_weights(results), records


@pytest.mark.slow
def test_three_vendor_ep_plan_matches_transformers_and_one_device(tmp_path):
    hf = save_tiny_mixtral(tmp_path / "mixtral", num_experts=8)
    job = parse_job({"cluster": CLUSTER, "model": MODEL, "plan": THREE_VENDORS,
                     "train": {**TRAIN, "init_from": str(tmp_path / "mixtral")}})
    one = parse_job({"cluster": CLUSTER, "model": MODEL, "plan": ONE_DEVICE,
                     "train": {**TRAIN, "init_from": str(tmp_path / "mixtral")}})
    losses, weights, records = train(job, job.plan, tmp_path, "ep")
    want_losses, want_weights, want_records = train(one, one.plan, tmp_path, "one")
    # Step 0 against transformers' own forward on the same batch.
    from heteroflow.data.builtin import open_train_data
    data = open_train_data(job, work_dir=str(tmp_path / "data"), steps=1)
    tokens, labels = data.batch(data.order.global_batch(0))
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits
    assert losses[0] == pytest.approx(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item(),
                                      rel=1e-5)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert [r["aux_loss"] for r in records] == pytest.approx([r["aux_loss"] for r in want_records], rel=1e-5)
    # each expert slice counted once in the clipping norm
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in want_records], rel=1e-5)
    assert_weights_close(weights, want_weights)
    ref_losses, _ = train_reference(one, steps=STEPS, data_dir=str(tmp_path / "data"),
                                    init_from=str(tmp_path / "mixtral"))
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [
    # experts split over tp, ep across dp, sequence parallel: routing on each rank's sequence chunk
    {"devices": ["gpu-0"], "layers": 3, "tp": 2, "dp": 2, "ep": 2, "sp": True, "zero": 1},
    # context parallel: routing on each cp rank's two chunks, ep across cp, whole experts under tp 1
    {"devices": ["gpu-0"], "layers": 3, "cp": 2, "dp": 2, "ep": 4},
    # cp with tp and no expert layout of its own: experts reduced with the rest (cp sum, then dp)
    {"devices": ["gpu-0"], "layers": 3, "cp": 2, "tp": 2},
])
def test_sequence_split_stages_with_ep_match_one_device(tmp_path, stage):
    """sp or cp with ep: the aux statistics are pooled over the ranks holding parts of a micro-batch, so losses,
    aux records and weights are the one device's. A dense first layer and a gated shared expert (its sp region
    on token rows) are in the model too."""
    moe = {**MOE, "shared_expert_ffn_hidden_size": 48, "shared_expert_gate": True, "first_dense_layers": 1,
           "num_experts": 4}
    plan = {"schedule": "1f1b", "micro_batch_size": 4, "stages": [stage, {"devices": ["npu-0:0-0"], "layers": 1}]}
    job = parse_job({"cluster": CLUSTER, "model": {**MODEL, "moe": moe}, "plan": plan, "train": TRAIN})
    one = parse_job({"cluster": CLUSTER, "model": {**MODEL, "moe": moe}, "plan": ONE_DEVICE, "train": TRAIN})
    losses, weights, records = train(job, job.plan, tmp_path, "split")
    want_losses, want_weights, want_records = train(one, one.plan, tmp_path, "one")
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert [r["aux_loss"] for r in records] == pytest.approx([r["aux_loss"] for r in want_records], rel=1e-5)
    # each expert slice counted once in the clipping norm
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in want_records], rel=1e-5)
    assert_weights_close(weights, want_weights)


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [
    # ep 2 over dp 4 (expert-dp 2, ZeRO-1 over it) -> one device, ep 1
    ([{"devices": ["gpu-0"], "layers": 2, "dp": 4, "ep": 2, "zero": 1}, {"devices": ["npu-0:0-0"], "layers": 2}],
     [{"devices": ["dcu-0"], "layers": 4}]),
    # ep 4 -> ep 2 with whole experts under tp 2 (etp 1)
    ([{"devices": ["gpu-0"], "layers": 4, "dp": 4, "ep": 4}],
     [{"devices": ["npu-0"], "layers": 4, "tp": 2, "ep": 2, "etp": 1}]),
])
def test_checkpoint_under_one_ep_resumes_under_another(tmp_path, first, then):
    """Experts are saved under their global names in the layout-free format: the run goes on under another ep as if
    it had not stopped."""
    ckpt = {"dir": str(tmp_path / "ckpt"), "interval": 2, "keep": 1}
    job = parse_job({"cluster": CLUSTER, "model": MODEL, "train": {**TRAIN, "checkpoint": ckpt},
                     "plan": {"schedule": "1f1b", "micro_batch_size": 4, "stages": first}})
    later = parse_job({"cluster": CLUSTER, "model": MODEL, "train": {**TRAIN, "checkpoint": ckpt},
                       "plan": {"schedule": "1f1b", "micro_batch_size": 4, "stages": then}})
    want_losses, want_weights = train_reference(job, steps=STEPS, data_dir=str(tmp_path / "data"))
    losses, _, _ = train(job, job.plan, tmp_path, "first", steps=2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000002"]
    resumed, weights, _ = train(later, later.plan, tmp_path, "then", resume=True)
    assert losses + resumed == pytest.approx(want_losses, rel=1e-5)
    assert_weights_close(weights, want_weights)
