"""Megatron's mixture-of-experts arguments: each flag's mapping to `model.moe` / ep / etp, Megatron's rules,
and the refusals by name of what heteroflow's MoE does not represent."""

from __future__ import annotations

import pytest

from heteroflow.errors import UserError
from heteroflow.megatron import MegatronRuleError
from heteroflow.megatron.moe_pattern import dense_first_and_freq, layer_freq_arg, parse_layer_freq
from megatron_helpers import entry, heteroflow, import_args, launch_script

MOE = "--swiglu --disable-bias-linear --num-experts 8"


def _moe(tmp_path, args: str = "", **options) -> dict:
    result = import_args(tmp_path, f"{MOE} {args}", **options)
    assert not result.blocked, result.report.blockers
    return result.job_dict["model"]["moe"]


def _blocked(tmp_path, args: str, **options) -> tuple[str, object]:
    result = import_args(tmp_path, f"{MOE} {args}", **options)
    assert result.blocked and result.job_dict is None
    assert len(result.report.blockers) == 1, result.report.blockers
    return result.report.blockers[0], result


def _rule_error(tmp_path, args: str, **options) -> str:
    with pytest.raises(MegatronRuleError) as info:
        import_args(tmp_path, f"{MOE} {args}", **options)
    return str(info.value)


# -- the model ------------------------------------------------------------------------------------
def test_megatron_defaults(tmp_path):
    result = import_args(tmp_path, MOE)
    moe = result.job_dict["model"]["moe"]
    ffn = result.job_dict["model"]["ffn_hidden_size"]
    assert moe == {"num_experts": 8, "top_k": 2, "ffn_hidden_size": ffn, "score_function": "softmax",
                   "normalize_top_k": True, "shared_expert_ffn_hidden_size": 0, "shared_expert_gate": False,
                   "first_dense_layers": 0, "layer_freq": 1, "aux_loss_coeff": 0.0, "aux_loss_type": "batch",
                   "z_loss_coeff": 0.0, "topk_scaling_factor": 1.0, "sinkhorn": False,
                   "capacity_factor": None}
    assert result.job.model.moe is not None  # the job validates with its experts
    assert entry(result, "--moe-ffn-hidden-size").origin == "default"
    assert entry(result, "--num-experts").disposition == "mapped"


def test_values(tmp_path):
    moe = _moe(tmp_path, "--moe-router-topk 4 --moe-ffn-hidden-size 256 --moe-shared-expert-intermediate-size 512 "
                         "--moe-shared-expert-gate --moe-aux-loss-coeff 1e-2 --moe-router-load-balancing-type aux_loss")
    assert (moe["top_k"], moe["ffn_hidden_size"], moe["shared_expert_ffn_hidden_size"], moe["shared_expert_gate"]) \
        == (4, 256, 512, True)
    assert moe["aux_loss_coeff"] == pytest.approx(0.0025)  # Megatron's 1e-2 over top_k 4


def test_shared_expert_gate_without_shared_expert_has_no_effect(tmp_path):
    result = import_args(tmp_path, f"{MOE} --moe-shared-expert-gate")
    assert result.job_dict["model"]["moe"]["shared_expert_gate"] is False
    assert entry(result, "--moe-shared-expert-gate").disposition == "ignored"


@pytest.mark.parametrize("args, score, normalize", [
    ("", "softmax", True), ("--moe-router-pre-softmax", "softmax", False),
    ("--moe-router-score-function sigmoid", "sigmoid", True),
    ("--moe-router-score-function sigmoid --moe-router-pre-softmax", "sigmoid", True),
    ("--moe-router-topk 1 --moe-router-pre-softmax", "softmax", False),
    ("--moe-router-topk-scaling-factor 1.0", "softmax", True),
])
def test_router(tmp_path, args, score, normalize):
    moe = _moe(tmp_path, args)
    assert (moe["score_function"], moe["normalize_top_k"]) == (score, normalize)


@pytest.mark.parametrize("freq, first, step", [
    ("2", 0, 2), ("1", 0, 1), ("([0]*3+[1]*5)", 3, 1), ("[0,1,1,1,1,1,1,1]", 1, 1),
    ("([1]*1+[0]*1)*4", 0, 2), ("([0]*2+([1]+[0])*3)", 1, 2), ("[0]*8", 8, 1),
])
def test_layer_freq_int_and_python_list_forms(tmp_path, freq, first, step):
    moe = _moe(tmp_path, f"--moe-layer-freq '{freq}'")
    assert (moe["first_dense_layers"], moe["layer_freq"]) == (first, step)


def test_layer_pattern_heteroflow_cannot_place_is_refused_by_name(tmp_path):
    blocker, result = _blocked(tmp_path, "--moe-layer-freq '([0]+[1])*4'")
    assert blocker.startswith("mixture-of-experts layer pattern (--moe-layer-freq ([0]+[1])*4 = 01010101)")
    assert entry(result, "--moe-layer-freq").disposition == "unsupported"


@pytest.mark.parametrize("freq, words", [
    ("([0]*3+[1]*29)", "Invalid length of moe_layer_pattern: 32, expected 8"),
    ("[__import__('os').system('true')]", "is not a list of 0s and 1s"),
    ("every-other", "invalid value 'every-other'"),
    ("[0,2,1,1,1,1,1,1]", "entries must be 0 (dense layer) or 1 (MoE layer)"),
    ("[0,1", "cannot read"),
    ("0", "must be at least 1"),
])
def test_layer_freq_errors_are_megatrons_and_nothing_is_evaluated(tmp_path, freq, words):
    assert words in _rule_error(tmp_path, f"--moe-layer-freq \"{freq}\"")


def test_pattern_helpers_round_trip():
    for layers, first, step in ((32, 3, 1), (12, 0, 3), (10, 3, 2), (6, 6, 1)):
        text = layer_freq_arg(layers, first, step)
        pattern = parse_layer_freq(text)
        pattern = pattern if isinstance(pattern, list) else [int(i % pattern == 0) for i in range(layers)]
        assert dense_first_and_freq(pattern) == (first, step), text


# -- load balancing -------------------------------------------------------------------------------
@pytest.mark.parametrize("args, coeff", [
    ("--moe-router-load-balancing-type none --moe-aux-loss-coeff 1e-2", 0.0),
    ("--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0", 0.0),
    ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2 0", 0.005),
    ("--moe-aux-loss-coeff 3e-2", 0.015),
])
def test_load_balancing_types_heteroflow_has(tmp_path, args, coeff):
    assert _moe(tmp_path, args)["aux_loss_coeff"] == pytest.approx(coeff)


@pytest.mark.parametrize("args, words", [
    ("--moe-router-load-balancing-type sinkhorn aux_loss --moe-aux-loss-coeff 0 1e-2",
     "Sinkhorn routing listed with other load-balancing types"),
    ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-3", "global-batch load-balancing"),
    ("--moe-router-load-balancing-type quantile_balancing", "quantile-balancing routing"),
])
def test_load_balancing_heteroflow_lacks_is_refused_by_name(tmp_path, args, words):
    blocker, result = _blocked(tmp_path, args)
    assert words in blocker and "--moe-router-load-balancing-type" in blocker
    assert entry(result, "--moe-router-load-balancing-type").disposition == "unsupported"


def test_aux_loss_coefficients_must_match_the_types(tmp_path):
    assert "must be a list of the same length" in _rule_error(
        tmp_path, "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2")


# -- capacity ---------------------------------------------------------------------------------------
def test_capacity_factor_with_position_drop_policy(tmp_path):
    result = import_args(tmp_path, f"{MOE} --moe-expert-capacity-factor 1.5 --moe-token-drop-policy position "
                                   "--moe-pad-expert-input-to-capacity")
    assert result.job_dict["model"]["moe"]["capacity_factor"] == 1.5
    assert entry(result, "--moe-expert-capacity-factor").disposition == "approximated"
    assert "need not be the earliest" in entry(result, "--moe-token-drop-policy").detail
    assert entry(result, "--moe-pad-expert-input-to-capacity").disposition == "approximated"


def test_negative_capacity_factor_is_dropless(tmp_path):
    assert _moe(tmp_path, "--moe-expert-capacity-factor -1")["capacity_factor"] is None


def test_probs_drop_policy_is_refused_by_name(tmp_path):
    blocker, _ = _blocked(tmp_path, "--moe-expert-capacity-factor 1.0")
    assert "lowest-probability tokens" in blocker and "--moe-token-drop-policy position" in blocker


def test_pad_to_capacity_needs_a_capacity_factor(tmp_path):
    assert "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity" in _rule_error(
        tmp_path, "--moe-pad-expert-input-to-capacity")


# -- refusals by name -------------------------------------------------------------------------------
@pytest.mark.parametrize("args, flag, words", [
    ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias", "--moe-router-enable-expert-bias",
     "aux-loss-free routing with a learnt per-expert bias"),
    ("--moe-input-jitter-eps 0.01", "--moe-input-jitter-eps", "router input jitter"),
    ("--moe-router-num-groups 4 --moe-router-group-topk 2", "--moe-router-group-topk", "group-limited routing"),
    ("--moe-router-score-function sqrtsoftplus", "--moe-router-score-function", "sqrt-softplus"),
    ("--moe-router-score-function sigmoid --moe-router-topk 1", "--moe-router-score-function",
     "sigmoid routing with --moe-router-topk 1"),
    ("--moe-router-force-load-balancing", "--moe-router-force-load-balancing", "forced load balancing"),
    ("--moe-apply-probs-on-input", "--moe-apply-probs-on-input", "routing weights applied to the experts' input"),
    ("--moe-latent-size 256", "--moe-latent-size", "latent projections"),
])
def test_moe_features_heteroflow_lacks_are_refused_by_name(tmp_path, args, flag, words):
    blocker, result = _blocked(tmp_path, args)
    assert blocker.startswith("mixture-of-experts: ") and words in blocker and flag in blocker, blocker
    assert entry(result, flag).disposition == "unsupported"


def test_gelu_experts_import_with_the_models_activation(tmp_path):
    result = import_args(tmp_path, "--disable-bias-linear --num-experts 8 --moe-shared-expert-intermediate-size 64")
    assert not result.report.blockers
    assert result.job.model.activation == "gelu" and result.job.model.moe.shared_expert_ffn_hidden_size == 64


@pytest.mark.parametrize("args, fields", [
    ("--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3",
     {"aux_loss_type": "sequence", "aux_loss_coeff": 5e-4}),
    ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0 1e-3",
     {"aux_loss_type": "sequence", "aux_loss_coeff": 5e-4}),
    ("--moe-z-loss-coeff 1e-3", {"z_loss_coeff": 1e-3}),
    ("--moe-router-topk-scaling-factor 2.5", {"topk_scaling_factor": 2.5}),
])
def test_router_options_are_mapped(tmp_path, args, fields):
    result = import_args(tmp_path, f"{MOE} {args}")
    assert not result.report.blockers
    moe = result.job_dict["model"]["moe"]
    assert {key: moe[key] for key in fields} == fields


def test_sinkhorn_routing_is_mapped_with_megatrons_weights(tmp_path):
    result = import_args(tmp_path, f"{MOE} --moe-router-topk 1 --moe-router-load-balancing-type sinkhorn "
                                   "--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2")
    assert not result.report.blockers
    moe = result.job_dict["model"]["moe"]
    assert (moe["sinkhorn"], moe["score_function"], moe["normalize_top_k"], moe["topk_scaling_factor"],
            moe["aux_loss_coeff"]) == (True, "softmax", False, 1.0, 0.0)
    assert entry(result, "--moe-router-load-balancing-type").disposition == "approximated"
    assert entry(result, "--moe-router-topk-scaling-factor").disposition == "ignored"
    assert "Sinkhorn routing does not support aux loss" in _rule_error(
        tmp_path, "--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 1e-2")


def test_both_aux_losses_are_refused_by_name(tmp_path):
    blocker, _ = _blocked(tmp_path, f"{MOE} --moe-router-load-balancing-type aux_loss seq_aux_loss "
                                    "--moe-aux-loss-coeff 1e-2 1e-3")
    assert "both the micro-batch and the per-sequence load-balancing loss" in blocker, blocker


def test_refusal_exits_2_naming_the_source(tmp_path):
    script = tmp_path / "moe.sh"
    script.write_text(launch_script(f"{MOE} --moe-router-score-function sigmoid --moe-router-enable-expert-bias"))
    result = heteroflow("import-megatron", str(script), "--device-type", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: {script}: not imported: mixture-of-experts: aux-loss-free routing" in result.stderr


@pytest.mark.parametrize("args, words", [
    ("--moe-router-topk 1", "Please use --moe-router-pre-softmax when topk is 1."),
    ("--moe-router-topk 9", "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    ("--overlap-moe-expert-parallel-comm --expert-model-parallel-size 2",
     "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher"),
    ("--overlap-moe-expert-parallel-comm --moe-token-dispatcher-type alltoall",
     "overlap_moe_expert_parallel_comm is only supported with expert model parallelism"),
    ("--moe-shared-expert-intermediate-size 0", "moe_shared_expert_intermediate_size must be"),
    ("--moe-shared-expert-intermediate-size 256 --moe-shared-expert-overlap",
     "moe_shared_expert_overlap only works with alltoall or flex token dispatcher"),
])
def test_megatrons_moe_rules(tmp_path, args, words):
    assert words in _rule_error(tmp_path, args)


@pytest.mark.parametrize("args, words", [
    ("--moe-router-enable-expert-bias", "Expert bias for aux-loss-free routing only supports 'sigmoid'"),
    ("--moe-router-group-topk 2", "moe_router_num_groups must be specified"),
])
def test_megatrons_rules_on_refused_features_are_noted(tmp_path, args, words):
    _, result = _blocked(tmp_path, args)
    assert any(note.startswith("also: ") and words in note for note in result.report.script_notes)


# -- same model: kernels, communication, precision -------------------------------------------------
def test_performance_switches_are_ignored_with_a_reason(tmp_path):
    result = import_args(tmp_path, f"{MOE} --moe-grouped-gemm --moe-permute-fusion --moe-router-fusion "
                                   "--moe-per-layer-logging --moe-token-dispatcher-type alltoall "
                                   "--moe-shared-expert-intermediate-size 256 --moe-shared-expert-overlap")
    assert not result.blocked
    for key in ("--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion", "--moe-per-layer-logging",
                "--moe-shared-expert-overlap"):
        assert entry(result, key).disposition == "ignored", key


@pytest.mark.parametrize("args, disposition", [
    ("--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2", "mapped"),
    ("--moe-token-dispatcher-type flex --expert-model-parallel-size 2", "mapped"),
    ("--moe-token-dispatcher-type allgather --expert-model-parallel-size 2", "approximated"),
    ("--moe-token-dispatcher-type allgather", "mapped"),  # ep 1, etp 1: no tokens move
])
def test_token_dispatcher(tmp_path, args, disposition):
    result = import_args(tmp_path, f"{MOE} {args}")
    assert entry(result, "--moe-token-dispatcher-type").disposition == disposition


@pytest.mark.parametrize("precision, dtype, disposition", [
    ("--bf16", "fp32", "approximated"), ("", "fp32", "mapped"), ("", "fp64", "approximated")])
def test_router_dtype(tmp_path, precision, dtype, disposition):
    base = "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings " \
           "1024 --micro-batch-size 1 --global-batch-size 32 --train-iters 100 --lr 3e-4 --tokenizer-type " \
           f"NullTokenizer --vocab-size 32000 {precision}"
    result = import_args(tmp_path, f"{MOE} --moe-router-dtype {dtype}", base=base)
    assert entry(result, "--moe-router-dtype").disposition == disposition


def test_unknown_moe_flag_is_reported_unknown_and_the_job_is_made(tmp_path):
    result = import_args(tmp_path, f"{MOE} --moe-new-router-flag 1")
    assert result.job is not None
    assert entry(result, "--moe-new-router-flag").disposition == "unknown"


def test_moe_options_without_experts(tmp_path):
    result = import_args(tmp_path, "--swiglu --num-experts 0 --moe-router-topk 2 --moe-grouped-gemm")
    assert "moe" not in result.job_dict["model"]
    assert entry(result, "--moe-router-topk").disposition == "ignored"
    assert "moe_ffn_hidden_size is set but num_moe_experts is None" in str(
        pytest.raises(MegatronRuleError, import_args, tmp_path, "--swiglu --moe-ffn-hidden-size 256").value)


# -- expert parallelism ------------------------------------------------------------------------------
def test_ep_and_etp_go_to_every_stage(tmp_path):
    result = import_args(tmp_path, f"{MOE} --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 "
                                   "--pipeline-model-parallel-size 2", nodes=2)
    stages = result.job_dict["plan"]["stages"]
    assert [(s["tp"], s["dp"], s["ep"], s["etp"]) for s in stages] == [(2, 4, 4, 1)] * 2
    assert entry(result, "--expert-model-parallel-size").detail == "plan.stages[*].ep = 4"
    assert [(s.layout.ep, s.layout.expert_tp, s.layout.expert_dp) for s in result.job.plan.stages] == [(4, 1, 2)] * 2
    assert "experts: etp 1 x ep 4 x expert-dp 2 per pipeline stage" in result.report.format()


def test_etp_between_1_and_tp_is_refused_with_the_layout_rule(tmp_path):
    error = pytest.raises(UserError, import_args, tmp_path, f"{MOE} --expert-model-parallel-size 4 "
                          "--expert-tensor-parallel-size 2 --pipeline-model-parallel-size 2", nodes=2).value
    assert "plan.stages[0].etp: etp 2 is neither 1 nor tp 1" in str(error)


def test_etp_equal_to_tp_is_left_out_of_the_plan(tmp_path):
    result = import_args(tmp_path, f"{MOE} --expert-model-parallel-size 8 --expert-tensor-parallel-size 1")
    assert [("etp" in s, s["ep"]) for s in result.job_dict["plan"]["stages"]] == [(False, 8)]


@pytest.mark.parametrize("args, words", [
    ("--expert-model-parallel-size 3", "Number of experts should be a multiple of expert model parallel_size."),
    ("--expert-model-parallel-size 8 --pipeline-model-parallel-size 2",
     "world_size (8) is not divisible by expert_tensor_model_pipeline_parallel size (16)"),
    ("--expert-model-parallel-size 4 --expert-tensor-parallel-size 4",
     "world_size (8) is not divisible by expert_tensor_model_pipeline_parallel size (16)"),
    ("--tensor-model-parallel-size 2",
     "MoE and tensor parallelism are enabled without also enabling sequence parallelism"),
    ("--expert-model-parallel-size 0", "--expert-model-parallel-size must be at least 1"),
])
def test_megatrons_expert_parallel_rules(tmp_path, args, words):
    assert words in _rule_error(tmp_path, args)


def test_linear_biases_need_etp_1(tmp_path):
    with pytest.raises(MegatronRuleError, match="Bias in Moe is only supported when ETP==1"):
        import_args(tmp_path, "--swiglu --num-experts 8 --expert-tensor-parallel-size 2")


def test_ep_without_experts_is_megatrons_error(tmp_path):
    with pytest.raises(MegatronRuleError, match="num_experts must be non None to use expert model parallelism"):
        import_args(tmp_path, "--swiglu --expert-model-parallel-size 2")
