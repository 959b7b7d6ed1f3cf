"""ZeRO-3 memory as measured on each rank equals the planner's figure: 1/dp of the stage's fp32 parameters between
steps (`Zero3AdamW.shard_bytes`), plus a window of two gathered blocks while the stage runs (`gathered_bytes`)."""

from __future__ import annotations

import pytest

from heteroflow.testing import run_ranks

MODEL = {"preset": "micro-llama", "num_layers": 6}
LAYERS = (1, 5)  # a middle stage: blocks only


def _measure(rank: int, world_size: int, tp: int, dp: int) -> dict:
    import torch
    import torch.distributed as dist

    from heteroflow.config import parse_job
    from heteroflow.layout import ParallelLayout
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.models.parallelize import parallelize_stage
    from heteroflow.models.zero3 import Zero3AdamW, gathered_bytes, shard_stage_zero3
    from heteroflow.stagemap.memory import memory_model

    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "nvidia-a100-80g", "count": 4}]},
                     "model": MODEL, "train": {"global_batch_size": 8, "precision": "fp32"}})
    # rank = dp index * tp + tp index; every rank creates every group, in the same order
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    tp_group, dp_group = tp_groups[rank // tp], dp_groups[rank % tp]
    layout = ParallelLayout(tp=tp, dp=dp, zero=3)
    model = build_stage_model(job.model, first_layer=LAYERS[0], last_layer=LAYERS[1], is_first=False, is_last=False)
    parallelize_stage(model, layout=layout, tp_group=tp_group)
    init_weights(model, seed=1)
    stage_bytes = sum(p.numel() * 4 for p in model.parameters())  # this tp rank's share of the stage, fp32
    shard_stage_zero3(model, dp_group=dp_group, device_type="cpu", param_dtype=None)
    optimizer = Zero3AdamW(model, dp_group=dp_group, tp_group=tp_group)
    peak = [0]
    for block in model.layers.values():  # runs after FSDP2's pre-forward hook: this block is gathered then
        block.register_forward_pre_hook(lambda module, args: peak.__setitem__(0, max(peak[0], gathered_bytes(model))))
    x = torch.randn(1, job.model.seq_length, job.model.hidden_size, requires_grad=True)
    model(x).sum().backward()
    at_rest = gathered_bytes(model)
    predicted = memory_model(job.model, layout, tokens=job.model.seq_length, precision="fp32", capacity_gib=80.0)
    layers = LAYERS[1] - LAYERS[0]
    return {"stage": stage_bytes, "shard": optimizer.shard_bytes(), "peak": peak[0], "at_rest": at_rest,
            "block": sum(p.numel() * 4 for p in model.layers[str(LAYERS[0])].parameters()),  # DTensor: whole shape
            "predicted_weights": predicted.weights.at(layers, 1, False, False),
            "predicted_optimizer": predicted.optimizer.at(layers, 1, False, False)}


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2)])
def test_zero3_rank_holds_a_dp_share_plus_two_gathered_blocks(tp, dp):
    for result in run_ranks(_measure, tp * dp, tp, dp, timeout_s=120):
        shard, stage = result["shard"], result["stage"]
        # FSDP2 splits each parameter by rows: a rank's share is 1/dp up to one row per parameter.
        assert shard["params"] == pytest.approx(stage / dp, rel=0.02)
        assert shard["optimizer"] == pytest.approx(2 * shard["params"], rel=1e-9)  # fp32 moments, no master copy
        assert result["at_rest"] == 0  # nothing stays gathered after backward
        assert result["peak"] == pytest.approx(2 * result["block"], rel=0.02)  # the running and the prefetched block (padded)
        # The planner's ZeRO-3 weights (fp32 shard + gathered window) and optimizer state are what ran.
        assert shard["params"] + result["peak"] == pytest.approx(result["predicted_weights"], rel=0.02)
        assert shard["optimizer"] == pytest.approx(result["predicted_optimizer"], rel=0.02)
