"""Round trip: job -> Megatron arguments (`export_megatron`) -> launch script -> `import_megatron` -> the same job."""

from __future__ import annotations

import copy

import pytest
import yaml

from heteroflow.config import PRESETS, parse_job
from heteroflow.errors import UserError
from heteroflow.megatron import ImportOptions, export_megatron, import_megatron

TWO_NODES = {"inter_node_gb_per_s": 25.0, "nodes": [{"name": "gpu-0", "device": "nvidia-h100-sxm", "count": 8},
                                                     {"name": "gpu-1", "device": "nvidia-h100-sxm", "count": 8}]}
TRAIN = {"global_batch_size": 64, "micro_batch_size": 4, "precision": "bf16", "steps": 5000, "seed": 42,
         "lr": 3.0e-4, "min_lr": 3.0e-5, "warmup_steps": 200, "weight_decay": 0.1, "adam_beta1": 0.9,
         "adam_beta2": 0.95, "adam_eps": 1e-8, "grad_clip": 1.0}
SMALL_GPT = {"num_layers": 12, "hidden_size": 768, "ffn_hidden_size": 3072, "num_attention_heads": 12,
             "num_kv_heads": 12, "vocab_size": 50304, "seq_length": 1024, "activation": "gelu",
             "normalization": "layernorm", "position_embedding": "learned", "tie_embeddings": True}


def _stages(spec: list[tuple], **extra) -> list[dict]:
    return [dict({"devices": devices, "layers": layers, "tp": tp, "dp": dp}, **extra) for devices, layers, tp, dp in spec]


CASES = {
    "llama3-8b tp4 pp2 dp2 sp zero1": (
        PRESETS["llama3-8b"].to_dict(), TRAIN,
        {"micro_batch_size": 4, "stages": _stages([(["gpu-0"], 16, 4, 2), (["gpu-1"], 16, 4, 2)], sp=True, zero=1)}),
    "gpt learned positions, tied, gelu, layernorm, fp16": (
        SMALL_GPT, dict(TRAIN, precision="fp16", micro_batch_size=8, initial_loss_scale=4096.0, hysteresis=3),
        {"micro_batch_size": 8, "stages": _stages([(["gpu-0"], 6, 1, 8), (["gpu-1"], 6, 1, 8)])}),
    "qwen2.5-7b qkv bias, 4 kv heads, recompute full, static loss scale": (
        PRESETS["qwen2.5-7b"].to_dict(), dict(TRAIN, loss_scale=1024.0),
        {"micro_batch_size": 4, "stages": _stages([(["gpu-0"], 14, 4, 2), (["gpu-1"], 14, 4, 2)],
                                                  recompute="full")}),
    "qwen3-8b qk norm, explicit head_dim, selective recompute, zero 3": (
        dict(PRESETS["qwen3-8b"].to_dict(), seq_length=4096), TRAIN,
        {"micro_batch_size": 4, "stages": _stages([(["gpu-0"], 18, 2, 4), (["gpu-1"], 18, 2, 4)],
                                                  recompute="selective", zero=3)}),
    "uneven first and last stages, cp 2, optimizer offload": (
        dict(PRESETS["llama2-7b"].to_dict(), seq_length=4096),
        dict(TRAIN, data={"prefixes": [0.3, "data/web", 0.7, "data/code"], "split": "98,2,0"}),
        {"micro_batch_size": 2, "stages": _stages([(["gpu-0:0-3"], 7, 2, 1), (["gpu-0:4-7"], 9, 2, 1),
                                                   (["gpu-1:0-3"], 9, 2, 1), (["gpu-1:4-7"], 7, 2, 1)],
                                                  cp=2, zero=2, offload={"optimizer": "cpu"})}),
    "mixtral-8x7b tp1 pp2 dp8 ep8 zero1": (
        dict(PRESETS["mixtral-8x7b"].to_dict(), seq_length=4096), TRAIN,
        {"micro_batch_size": 8, "stages": _stages([(["gpu-0"], 16, 1, 8), (["gpu-1"], 16, 1, 8)], ep=8, zero=1)}),
    "qwen3-30b-a3b tp2 sp ep4 etp1, top 8 of 128": (
        dict(PRESETS["qwen3-30b-a3b"].to_dict(), seq_length=4096), TRAIN,
        {"micro_batch_size": 8, "stages": _stages([(["gpu-0"], 24, 2, 4), (["gpu-1"], 24, 2, 4)], ep=4, etp=1,
                                                  sp=True)}),
    "moe: dense first layers, every 2nd layer, gated shared expert, raw top-k": (
        dict(PRESETS["llama2-7b"].to_dict(), num_layers=16, moe={
            "num_experts": 16, "top_k": 3, "ffn_hidden_size": 1408, "normalize_top_k": False,
            "shared_expert_ffn_hidden_size": 5632, "shared_expert_gate": True, "first_dense_layers": 3,
            "layer_freq": 2, "aux_loss_coeff": 0.001}), TRAIN,
        {"micro_batch_size": 8, "stages": _stages([(["gpu-0"], 8, 1, 8), (["gpu-1"], 8, 1, 8)], ep=2)}),
    "moe: sigmoid scores, no aux loss": (
        dict(PRESETS["llama2-7b"].to_dict(), num_layers=8, moe={
            "num_experts": 8, "top_k": 2, "ffn_hidden_size": 2048, "score_function": "sigmoid"}), TRAIN,
        {"micro_batch_size": 8, "stages": _stages([(["gpu-0"], 4, 1, 8), (["gpu-1"], 4, 1, 8)], ep=8)}),
    "moe: GELU experts, sequence aux loss, z-loss, scaled top-k": (
        dict(PRESETS["llama2-7b"].to_dict(), num_layers=8, activation="gelu", moe={
            "num_experts": 8, "top_k": 2, "ffn_hidden_size": 2048, "aux_loss_coeff": 0.001,
            "aux_loss_type": "sequence", "z_loss_coeff": 0.001, "topk_scaling_factor": 2.5}), TRAIN,
        {"micro_batch_size": 8, "stages": _stages([(["gpu-0"], 4, 1, 8), (["gpu-1"], 4, 1, 8)], ep=4)}),
}


def _job(model: dict, train: dict, plan: dict):
    data = {"cluster": copy.deepcopy(TWO_NODES), "model": model, "train": dict(train), "plan": plan}
    data["train"]["micro_batch_size"] = plan["micro_batch_size"]
    return parse_job(data)


@pytest.mark.parametrize("case", list(CASES))
def test_job_to_megatron_arguments_and_back_is_the_same_job(tmp_path, case):
    job = _job(*CASES[case])
    command = export_megatron(job)
    assert not command.notes, command.notes
    script = tmp_path / "train.sh"
    script.write_text(command.to_script())
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"cluster": TWO_NODES}))
    result = import_megatron(script, ImportOptions(cluster=cluster))
    imported = result.job
    assert imported.model == job.model
    assert imported.train == job.train
    assert imported.plan.to_dict() == job.plan.to_dict()
    assert imported.cluster.to_dict() == job.cluster.to_dict()
    # Nothing Megatron was told is approximated, unknown or dropped on the way back (the data blend and split
    # included: heteroflow draws Megatron's samples from them).
    assert not [e for e in result.report.entries if e.disposition in ("approximated", "unknown", "unsupported")]


def test_exported_script_reads_like_megatrons_examples():
    job = _job(*CASES["llama3-8b tp4 pp2 dp2 sp zero1"])
    text = export_megatron(job).to_script()
    for line in ("GPUS_PER_NODE=8", "NUM_NODES=${NUM_NODES:-2}", "MODEL_ARGS=(", "    --num-query-groups 8",
                 "    --tensor-model-parallel-size 4", "    --use-distributed-optimizer",
                 "torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} "
                 "${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS[@]}"):
        assert line in text.splitlines(), line


def test_argv_is_the_launch_line():
    job = _job(*CASES["gpt learned positions, tied, gelu, layernorm, fp16"])
    argv = export_megatron(job).argv()
    assert argv[:6] == ["torchrun", "--nproc_per_node", "8", "--nnodes", "2", "pretrain_gpt.py"]
    assert "--fp16" in argv and "--position-embedding-type" in argv


def test_plans_megatron_cannot_express_are_refused():
    model, train, _ = CASES["llama3-8b tp4 pp2 dp2 sp zero1"]
    mixed = _job(model, train, {"micro_batch_size": 4, "stages": _stages([(["gpu-0"], 16, 4, 2),
                                                                          (["gpu-1"], 16, 2, 4)])})
    with pytest.raises(UserError, match="differ in tp"):
        export_megatron(mixed)
    with pytest.raises(UserError, match="plan: auto"):
        export_megatron(mixed.with_plan(None))
    uneven = _job(model, train, {"micro_batch_size": 4, "stages": _stages([(["gpu-0:0-3"], 8, 4, 1),
                                                                           (["gpu-0:4-7"], 12, 4, 1),
                                                                           (["gpu-1:0-3"], 4, 4, 1),
                                                                           (["gpu-1:4-7"], 8, 4, 1)])})
    with pytest.raises(UserError, match="evenly except for the first and last stage"):
        export_megatron(uneven)
    offload = _job(model, train, {"micro_batch_size": 4, "stages": _stages([(["gpu-0"], 16, 4, 2),
                                                                            (["gpu-1"], 16, 4, 2)],
                                                                           offload={"activations": "cpu"})})
    with pytest.raises(UserError, match="cannot express the plan's offload"):
        export_megatron(offload)


def test_differences_megatron_cannot_keep_become_notes():
    model, train, plan = CASES["gpt learned positions, tied, gelu, layernorm, fp16"]
    job = parse_job({"cluster": TWO_NODES, "model": dict(model, rope_theta=12345.5),
                     "train": dict(train, micro_batch_size=4), "plan": dict(plan, schedule="gpipe")})
    notes = " ".join(export_megatron(job).notes)
    assert "rounded" in notes and "gpipe" in notes and "train.micro_batch_size 4 differs" in notes


def test_moe_capacity_factor_round_trips_as_an_approximation(tmp_path):
    model, train, plan = CASES["mixtral-8x7b tp1 pp2 dp8 ep8 zero1"]
    moe = dict(model["moe"], capacity_factor=1.25)
    job = _job(dict(model, moe=moe), train, plan)
    script = tmp_path / "train.sh"
    script.write_text(export_megatron(job).to_script())
    assert "--moe-token-drop-policy position" in script.read_text()
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"cluster": TWO_NODES}))
    result = import_megatron(script, ImportOptions(cluster=cluster))
    assert result.job.model == job.model
    # Which tokens over capacity Megatron drops is not guaranteed to be the latest (see moe.py).
    assert {e.key for e in result.report.entries if e.disposition == "approximated"} == {
        "--moe-expert-capacity-factor", "--moe-token-drop-policy"}


def test_moe_sinkhorn_routing_round_trips_as_an_approximation(tmp_path):
    model, train, plan = CASES["moe: sigmoid scores, no aux loss"]
    moe = {"num_experts": 8, "top_k": 1, "ffn_hidden_size": 2048, "sinkhorn": True, "normalize_top_k": False}
    job = _job(dict(model, moe=moe), train, plan)
    script = tmp_path / "train.sh"
    script.write_text(export_megatron(job).to_script())
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"cluster": TWO_NODES}))
    result = import_megatron(script, ImportOptions(cluster=cluster))
    assert result.job.model == job.model
    # Megatron balances each rank's tokens, heteroflow the micro-batch's (see moe.py).
    assert {e.key for e in result.report.entries if e.disposition == "approximated"} == {
        "--moe-router-load-balancing-type"}
