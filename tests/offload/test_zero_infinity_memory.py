"""ZeRO-Infinity memory per rank as measured equals the planner's figures: on the device the gathered window of
two blocks (plus the shard when the parameters stay there) and no gradient shard after backward; in the
optimizer tier the fp32 master and moments of 1/dp of the stage; in the parameter tier 1/dp of the stage's
parameters in its precision."""

from __future__ import annotations

import pytest

from heteroflow.testing import run_ranks

MODEL = {"preset": "micro-llama", "num_layers": 6}
LAYERS = (1, 5)  # a middle stage: blocks only


def _measure(rank: int, world_size: int, dp: int, precision: str, offload: dict, swap_root: str) -> dict:
    import torch
    import torch.distributed as dist

    from heteroflow.config import parse_job
    from heteroflow.devices import Device
    from heteroflow.layout import OffloadSpec, ParallelLayout
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.models.parallelize import parallelize_stage
    from heteroflow.models.zero3 import gathered_bytes, shard_stage_zero3
    from heteroflow.offload.policy import OffloadPolicy
    from heteroflow.offload.zero3 import Zero3OffloadAdamW
    from heteroflow.stagemap.memory import memory_model, memory_parts, offloaded_optimizer_bytes

    job = parse_job({"cluster": {"nodes": [{"name": "n", "device": "nvidia-a100-80g", "count": 4}]},
                     "model": MODEL, "train": {"global_batch_size": 8, "precision": precision}})
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    dp_group = dist.new_group(list(range(dp)))
    layout = ParallelLayout(dp=dp, zero=3, offload=OffloadSpec(**offload))
    model = build_stage_model(job.model, first_layer=LAYERS[0], last_layer=LAYERS[1], is_first=False, is_last=False)
    parallelize_stage(model, layout=layout)
    init_weights(model, seed=1)
    model.to(dtype)
    stage_numel = sum(p.numel() for p in model.parameters())
    units = shard_stage_zero3(model, dp_group=dp_group, device_type="cpu", param_dtype=None,
                              shards_on_host=layout.offload.params != "device",
                              swapped=layout.offload.params == "ssd")
    policy = OffloadPolicy(optimizer=layout.offload.optimizer, params=layout.offload.params,
                           swap_root=swap_root if "ssd" in offload.values() else None)
    optimizer = Zero3OffloadAdamW(model, units=units, policy=policy, device=Device.cpu(), dp_group=dp_group,
                                  swap_label=f"r{rank}")
    try:
        peak = [0]
        for block in model.layers.values():  # after FSDP2's pre-forward hook: this block is gathered then
            block.register_forward_pre_hook(lambda m, a: peak.__setitem__(0, max(peak[0], gathered_bytes(model))))
        x = torch.randn(1, job.model.seq_length, job.model.hidden_size, dtype=dtype, requires_grad=True)
        model(x).float().sum().backward()
        grads_left = sum(p.grad is not None for p in model.parameters())
        optimizer.reduce_grads()
        optimizer.step(lr=1e-3)
        optimizer.zero_grad()
        layers = LAYERS[1] - LAYERS[0]
        predicted = memory_model(job.model, layout, tokens=job.model.seq_length, precision=precision,
                                 capacity_gib=80.0)
        parts = memory_parts(job.model, tp=1, sp=False, tokens=1.0, precision=precision, capacity_gib=0.0)
        return {"stage_numel": stage_numel, "element": torch.tensor([], dtype=dtype).element_size(),
                "shard": optimizer.shard_bytes(), "device": optimizer.memory_bytes(), "peak": peak[0],
                "at_rest": gathered_bytes(model), "grads_left": grads_left,
                "block": sum(p.numel() * p.element_size() for p in model.layers[str(LAYERS[0])].parameters()),
                "predicted_weights": predicted.weights.at(layers, 1, False, False),
                "predicted_grads_window": predicted.gradients.at(layers, 1, False, False),
                "predicted_optimizer": predicted.optimizer.at(layers, 1, False, False),
                "predicted_tier": offloaded_optimizer_bytes(parts, layout).at(layers, 1, False, False)}
    finally:
        optimizer.close()


@pytest.mark.slow
@pytest.mark.parametrize("precision,offload", [("fp32", {"optimizer": "cpu"}), ("bf16", {"optimizer": "cpu"}),
                                               ("bf16", {"optimizer": "ssd", "params": "ssd"}),
                                               ("fp32", {"optimizer": "cpu", "params": "cpu"})],
                         ids=["opt-cpu-fp32", "opt-cpu-bf16", "ssd-bf16", "cpu-fp32"])
def test_zero_infinity_rank_holds_what_the_planner_prices(tmp_path, precision, offload):
    dp = 2
    for r in run_ranks(_measure, dp, dp, precision, offload, str(tmp_path), timeout_s=180):
        element = r["element"]
        # the parameter tier: 1/dp of the stage in its precision (FSDP2 splits by rows: up to a row per parameter)
        assert r["shard"]["params"] == pytest.approx(r["stage_numel"] * element / dp, rel=0.02)
        # the optimizer tier: fp32 master and moments of the same share, as the planner prices it
        assert r["shard"]["optimizer"] == pytest.approx(12 * r["stage_numel"] / dp, rel=0.02)
        assert r["shard"]["optimizer"] == pytest.approx(r["predicted_tier"], rel=0.02)
        # the device: no optimizer state, no gradient shard, the shard only when the parameters stay there
        assert r["grads_left"] == 0 and r["device"]["grads"] == 0 and r["device"]["optimizer"] == 0
        assert r["predicted_optimizer"] == 0
        on_device = r["shard"]["params"] if offload.get("params", "device") == "device" else 0
        assert r["device"]["params"] == on_device
        assert r["at_rest"] == 0 and r["peak"] == pytest.approx(2 * r["block"], rel=0.02)  # two gathered blocks
        assert on_device + r["peak"] == pytest.approx(r["predicted_weights"], rel=0.02)
