"""Megatron's own validity rules, and the features heteroflow refuses, on small generated scripts."""

from __future__ import annotations

import pytest

from heteroflow.megatron import MegatronRuleError
from megatron_helpers import BASE_ARGS, entry, import_args


@pytest.mark.parametrize("args, message", [
    ("--tensor-model-parallel-size 3", r"world size \(8\) is not divisible by tp \* pp \* cp"),
    ("--tensor-model-parallel-size 8 --group-query-attention --num-query-groups 2",
     r"num_query_groups \(2\) must be a multiple of tensor_model_parallel_size \(8\)"),
    ("--global-batch-size 12", r"global batch size \(12\) is not divisible by micro batch size \(1\) times data "
                               r"parallel size \(8\)"),
    ("--fp16", "--fp16 and --bf16 cannot both be set"),
    ("--train-samples 1000", "--train-iters and --train-samples are exclusive"),
    ("--recompute-granularity full", "recompute_method must be \"block\" or \"uniform\""),
    ("--recompute-granularity selective --recompute-method uniform", "recompute method is not yet supported"),
    ("--context-parallel-size 4 --seq-length 1020 --max-position-embeddings 1020",
     "seq-length 1020 should be a multiple of 2 \\* context-parallel-size = 8"),
    ("--tp-comm-overlap", "--tp-comm-overlap needs sequence parallelism"),
    ("--overlap-param-gather --overlap-grad-reduce", "--overlap-param-gather only supported with distributed optimizer"),
    ("--max-position-embeddings 512", r"max_position_embeddings \(512\) must be greater than or equal to seq_length"),
    ("--min-lr 1e-3", "min-lr 0.001 must not exceed lr 0.0003"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 3",
     "uneven pipeline split does not add up"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
     r"number of layers per pipeline stage \(4\) must be divisible by --num-layers-per-virtual-pipeline-stage 3"),
    ("--num-layers-per-virtual-pipeline-stage 2", "the interleaved schedule needs pipeline-model-parallel size > 1"),
    ("--expert-model-parallel-size 2", "needs --num-experts"),
    ("--optimizer-cpu-offload", "must be used in conjunction with `--use-precision-aware-optimizer`"),
    ("--use-torch-fsdp2 --pipeline-model-parallel-size 2", "--use-torch-fsdp2 is not supported with pipeline"),
    ("--model-parallel-size 2", "--model-parallel-size is no longer valid"),
    ("--num-layers abc", "--num-layers: invalid int value 'abc'"),
    ("--normalization BatchNorm", "invalid choice 'BatchNorm'"),
    ("--bf16=yes", "--bf16 takes no value"),
    ("--seed", "--seed expects one value"),
    ("stray", "unrecognized argument 'stray'"),
])
def test_rule_violations_are_errors(tmp_path, args, message):
    with pytest.raises(MegatronRuleError, match=message):
        import_args(tmp_path, args)


def test_layers_must_divide_by_pp(tmp_path):
    with pytest.raises(MegatronRuleError, match="Number of layers should be divisible by the pipeline-model-parallel "
                                                "size: 8 layers over 3 stages"):
        import_args(tmp_path, "--pipeline-model-parallel-size 3", gpus=3)


def test_heads_must_divide_by_tp(tmp_path):
    base = BASE_ARGS.replace("--num-attention-heads 8", "--num-attention-heads 12").replace("512", "768")
    with pytest.raises(MegatronRuleError, match=r"num_attention_heads \(12\) must be a multiple of "
                                                r"tensor_model_parallel_size \(8\)"):
        import_args(tmp_path, "--tensor-model-parallel-size 8", base=base)


def test_every_problem_is_listed_at_once(tmp_path):
    with pytest.raises(MegatronRuleError) as info:
        import_args(tmp_path, "--fp16 --global-batch-size 12 --tensor-model-parallel-size 3")
    text = str(info.value)
    assert "cannot import (4 problems)" in text and "--fp16" in text and "tp * pp * cp" in text
    assert "ffn-hidden-size 2048 is not divisible by tensor_model_parallel_size 3" in text
    assert "num_attention_heads (8) must be a multiple of tensor_model_parallel_size (3)" in text


def test_missing_required_arguments(tmp_path):
    base = "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024"
    with pytest.raises(MegatronRuleError) as info:
        import_args(tmp_path, "--tokenizer-type NullTokenizer --vocab-size 100", base=base)
    text = str(info.value)
    assert "--micro-batch-size is missing" in text


def test_a_value_the_script_leaves_unknown_names_the_variable(tmp_path):
    with pytest.raises(MegatronRuleError, match=r"--num-layers \$NUM_LAYERS: the value comes from \$NUM_LAYERS, "
                                                r"which the script does not set; pass it with --env"):
        import_args(tmp_path, "--num-layers $NUM_LAYERS")


def test_unknown_world_size_asks_for_it(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text(f"torchrun --nproc_per_node $GPUS --nnodes $SLURM_NNODES pretrain_gpt.py {BASE_ARGS}\n")
    from heteroflow.errors import UserError
    from heteroflow.megatron import ImportOptions, import_megatron
    with pytest.raises(UserError, match="the number of nodes and processes per node is not known"):
        import_megatron(path, ImportOptions(device_type="cpu"))
    result = import_megatron(path, ImportOptions(device_type="cpu", env={"GPUS": "4", "SLURM_NNODES": "2"}))
    assert result.layout.world_size == 8


def test_sequence_parallel_is_switched_off_at_tp_1(tmp_path):
    result = import_args(tmp_path, "--sequence-parallel")
    assert not result.job.plan.stages[0].layout.sp
    assert "disables sequence parallelism when tp = 1" in entry(result, "--sequence-parallel").detail


def test_uneven_first_and_last_stages(tmp_path):
    result = import_args(tmp_path, "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
                                   "--decoder-last-pipeline-num-layers 1")
    assert [s.layers for s in result.job.plan.stages] == [1, 3, 3, 1]


def test_embedding_and_loss_counted_in_the_split(tmp_path):
    base = BASE_ARGS.replace("--num-layers 8", "--num-layers 6")
    result = import_args(tmp_path, "--pipeline-model-parallel-size 4 --account-for-embedding-in-pipeline-split "
                                   "--account-for-loss-in-pipeline-split", base=base)
    assert [s.layers for s in result.job.plan.stages] == [1, 2, 2, 1]


def test_virtual_pipeline_is_approximated_by_plain_1f1b(tmp_path):
    result = import_args(tmp_path, "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1")
    assert [s.layers for s in result.job.plan.stages] == [2, 2, 2, 2]
    assert result.layout.virtual_stages == 2
    assert entry(result, "--num-layers-per-virtual-pipeline-stage").disposition == "approximated"


def test_pipeline_layout_string(tmp_path):
    result = import_args(tmp_path, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et|(tt|)*2,tttL'")
    assert [s.layers for s in result.job.plan.stages] == [3, 5]
    assert result.layout.virtual_stages == 2


def test_tp_pp_dp_rank_order_interleaves_each_stage(tmp_path):
    result = import_args(tmp_path, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                                   "--use-tp-pp-dp-mapping")
    assert [s.devices for s in result.job.plan.stages] == [("node-0:0-1", "node-0:4-5"), ("node-0:2-3", "node-0:6-7")]


def test_default_rank_order_keeps_stages_contiguous_across_nodes(tmp_path):
    result = import_args(tmp_path, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2", nodes=2,
                         gpus=4)
    assert [s.devices for s in result.job.plan.stages] == [("node-0",), ("node-1",)]


def test_zero_and_recompute_and_offload(tmp_path):
    result = import_args(tmp_path, "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads "
                                   "--recompute-granularity full --recompute-method block --recompute-num-layers 2 "
                                   "--optimizer-cpu-offload --use-precision-aware-optimizer --exp-avg-dtype bf16")
    stage = result.job.plan.stages[0]
    assert (stage.layout.zero, stage.layout.recompute, stage.layout.offload.optimizer) == (2, "full", "cpu")
    assert entry(result, "--recompute-num-layers").disposition == "approximated"
    assert entry(result, "--exp-avg-dtype").disposition == "approximated"


def test_learning_rate_schedules(tmp_path):
    constant = import_args(tmp_path, "--lr-decay-style constant --lr-warmup-iters 10")
    assert (constant.job.train.min_lr, constant.job.train.warmup_steps) == (3e-4, 10)
    linear = import_args(tmp_path, "--lr-warmup-fraction 0.1")
    assert entry(linear, "--lr-decay-style").disposition == "approximated"  # Megatron's default is linear
    assert entry(linear, "--lr-decay-style").origin == "default"
    assert linear.job.train.warmup_steps == 10
    assert linear.job.train.weight_decay == 0.01 and linear.job.train.adam_beta2 == 0.999  # Megatron defaults


def test_duplicate_flags_keep_the_last_value(tmp_path):
    result = import_args(tmp_path, "--num-layers 16")
    assert result.job.model.num_layers == 16
    first = [e for e in result.report.entries if e.key == "--num-layers"][0]
    assert first.disposition == "ignored" and "Megatron uses the last value" in first.detail


def test_unknown_flags_are_reported_not_dropped(tmp_path):
    result = import_args(tmp_path, "--use-fancy-kernel --my-fork-option 3 --moe-new-thing 2")
    unknown = entry(result, "--my-fork-option")
    assert unknown.disposition == "unknown" and unknown.value == "3"
    assert entry(result, "--moe-new-thing").disposition == "ignored"  # MoE prefix, MoE off
    assert result.job.model.num_layers == 8


@pytest.mark.parametrize("args, feature", [
    ("--swiglu --num-experts 8 --moe-router-enable-expert-bias --moe-router-score-function sigmoid",
     "mixture-of-experts: aux-loss-free routing with a learnt per-expert bias"),
    ("--multi-latent-attention --q-lora-rank 64", "multi-latent attention"),
    ("--squared-relu", "squared-ReLU MLP activation"),
    ("--position-embedding-type rope --rotary-percent 0.5", "partial rotary embeddings"),
    ("--position-embedding-type none", "position embedding type 'none'"),
    ("--mtp-num-layers 1", "multi-token prediction"),
    ("--window-size 256,0", "sliding-window attention"),
    ("--apply-residual-connection-post-layernorm", "post-LayerNorm residual ordering"),
])
def test_model_features_heteroflow_cannot_represent_block_the_import(tmp_path, args, feature):
    result = import_args(tmp_path, args)
    assert result.blocked and result.job is None
    assert any(feature in b for b in result.report.blockers), result.report.blockers


def test_other_entry_points_block_the_import(tmp_path):
    path = tmp_path / "bert.sh"
    path.write_text(f"torchrun --nproc_per_node 8 pretrain_bert.py {BASE_ARGS}\n")
    from heteroflow.megatron import ImportOptions, import_megatron
    result = import_megatron(path, ImportOptions(device_type="cpu"))
    assert result.blocked and "BERT" in result.report.blockers[0]


def test_num_experts_zero_is_no_moe(tmp_path):
    result = import_args(tmp_path, "--num-experts 0 --moe-router-topk 2")
    assert not result.blocked
    assert entry(result, "--moe-router-topk").disposition == "ignored"


def test_stage_across_device_types_is_refused(tmp_path, write_yaml):
    cluster = write_yaml("""
        cluster:
          nodes:
            - {name: a, device: nvidia-a100-80g, count: 4}
            - {name: b, device: ascend-910b2, count: 4}
        """, "cluster.yaml")
    from heteroflow.errors import UserError
    with pytest.raises(UserError, match="pipeline stage 0 .* would span device types"):
        import_args(tmp_path, "", cluster=cluster)
    result = import_args(tmp_path, "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 4", cluster=cluster)
    assert [s.device_type for s in result.job.plan.stages] == ["nvidia-a100-80g", "ascend-910b2"]
