"""Realistic launch scripts and YAML files in the style of Megatron-LM's and NeMo's own examples."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.config import PRESETS, load_job
from heteroflow.errors import UserError
from heteroflow.megatron import ImportOptions, MegatronRuleError, import_megatron
from heteroflow.megatron.versions import parse_version
from megatron_helpers import FIXTURE_MIXTRAL, SCRIPTS, entry

GPT3 = SCRIPTS / "train_gpt3_175b_distributed.sh"
LLAMA3 = SCRIPTS / "train_llama3_8b_h100_fp8.sh"
MIXTRAL = FIXTURE_MIXTRAL
YAML_CFG = SCRIPTS / "gpt_yaml_cfg.yaml"
NEMO = SCRIPTS / "megatron_gpt_nemo.yaml"


def _dispositions(result) -> set[str]:
    return {e.disposition for e in result.report.entries}


# -- GPT-3 175B ----------------------------------------------------------------------------------
def test_gpt3_175b_model_layout_and_plan():
    result = import_megatron(GPT3, ImportOptions(device_type="nvidia-a100-80g"))
    job = result.job
    assert job is not None and not result.blocked
    m = job.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == (96, 12288, 96, 96)
    assert (m.ffn_hidden_size, m.seq_length, m.activation, m.normalization) == (4 * 12288, 2048, "gelu", "layernorm")
    assert m.position_embedding == "learned" and m.tie_embeddings
    assert m.vocab_size == 51200  # GPT-2 BPE 50257 padded to a multiple of 128 x tp 8
    lay = result.layout
    assert (lay.parallel.tp, lay.pp, lay.parallel.cp, lay.parallel.dp, lay.world_size) == (8, 16, 1, 1, 128)
    assert len(job.plan.stages) == 16 and {s.layers for s in job.plan.stages} == {6}
    assert [s.devices for s in job.plan.stages[:2]] == [("node-0",), ("node-1",)]
    assert job.train.precision == "fp16" and job.train.global_batch_size == 1536
    assert job.train.steps == 146484375 // 1536 and job.train.warmup_steps == round(183105 / 1536)
    assert job.plan.micro_batch_size == 1


def test_gpt3_every_argument_has_an_entry_and_differences_are_named():
    result = import_megatron(GPT3, ImportOptions(device_type="nvidia-a100-80g"))
    script_keys = [e.key for e in result.report.entries if e.origin == "script"]
    flags = [line.split()[0] for line in GPT3.read_text().splitlines() if line.strip().startswith("--")]
    launcher = [e.key.split()[1] for e in result.report.entries if e.origin == "launcher"]
    assert sorted(script_keys + launcher) == sorted(flags)  # every flag in the script has its entry
    assert entry(result, "--rampup-batch-size").disposition == "approximated"
    assert "dropout" in entry(result, "--attention-dropout").detail
    assert entry(result, "--attention-dropout").origin == "default"
    assert entry(result, "--disable-bias-linear").disposition == "approximated"
    assert entry(result, "--attention-backend").disposition == "ignored"
    assert entry(result, "--lr-decay-samples").disposition == "approximated"
    assert "unknown" not in _dispositions(result) and "unsupported" not in _dispositions(result)


def test_gpt3_positional_parameters_feed_the_data_path():
    result = import_megatron(GPT3, ImportOptions(device_type="nvidia-a100-80g",
                                                 script_args=("ckpt", "tb", "vocab.json", "merges.txt",
                                                              "/data/pile_text_document")))
    data = result.job.train.data
    assert data.prefixes == ("/data/pile_text_document",) and data.weights is None and data.split == "949,50,1"
    assert data.dtype is None  # read from the .idx
    assert entry(result, "--split").disposition == "mapped"
    assert entry(result, "--save").value == "ckpt"
    assert not any("positional parameter" in n for n in result.report.script_notes)


def test_gpt3_without_positional_parameters_says_which_are_missing():
    result = import_megatron(GPT3, ImportOptions(device_type="nvidia-a100-80g"))
    assert result.job.train.data is None
    assert "$5" in entry(result, "--data-path").detail
    assert any("positional parameter $5" in n for n in result.report.script_notes)


def test_gpt3_without_a_device_type_writes_a_placeholder():
    result = import_megatron(GPT3)
    assert result.job is None and result.needs_device_type
    assert result.job_dict["cluster"]["nodes"][0]["device"] == "<set-me>"
    text = result.job_yaml()
    assert "ACTION NEEDED" in text and text.count("&device <set-me>") == 1 and text.count("*device") == 15


def test_gpt3_on_fewer_nodes_breaks_megatrons_world_size_rule():
    with pytest.raises(MegatronRuleError, match=r"world size \(64\) is not divisible by tp \* pp \* cp = 8 \* 16 \* 1"):
        import_megatron(GPT3, ImportOptions(device_type="nvidia-a100-80g", env={"NUM_NODES": "8"}))


# -- Llama-3 8B ----------------------------------------------------------------------------------
def test_llama3_arrays_conditionals_and_fp8():
    result = import_megatron(LLAMA3, ImportOptions(device_type="nvidia-h100-sxm"))
    job = result.job
    m = job.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_kv_heads, m.head_dim) == (32, 4096, 14336, 8, 128)
    assert (m.rope_theta, m.normalization, m.activation, m.tie_embeddings) == (500000.0, "rmsnorm", "swiglu", False)
    assert m.vocab_size == 128256  # NullTokenizer: exactly --vocab-size 128256 (current Megatron), a multiple of 128 x tp 2
    assert [(s.layout.tp, s.layout.dp, s.layout.sp, s.layout.zero, s.layers) for s in job.plan.stages] == [(2, 2, True, 1, 16)] * 2
    assert [s.devices for s in job.plan.stages] == [("node-0:0-3",), ("node-0:4-7",)]
    assert job.plan.micro_batch_size == 2 and job.train.precision == "bf16"
    fp8 = entry(result, "--fp8-format")
    assert fp8.disposition == "ignored" and "FP8" in fp8.detail and fp8.value == "hybrid"
    assert entry(result, "--mock-data").disposition == "mapped"
    assert any("undecided condition" in n and "-f" in n for n in result.report.script_notes)


@pytest.mark.parametrize("dtype, precision", [("bf16", "bf16"), ("fp16", "fp16")])
def test_llama3_dtype_branch_follows_the_environment(dtype, precision):
    result = import_megatron(LLAMA3, ImportOptions(device_type="nvidia-h100-sxm", env={"DTYPE": dtype}))
    assert result.job.train.precision == precision
    assert not [e for e in result.report.entries if e.key.startswith("--fp8")]


def test_llama3_real_data_branch_reads_the_tokenizer_and_data():
    result = import_megatron(LLAMA3, ImportOptions(device_type="nvidia-h100-sxm", script_args=(
        "ckpt", "tb", "meta-llama/Meta-Llama-3-8B", "/data/llama3_text_document")))
    assert result.job.model.vocab_size == 128256
    assert result.job.train.data.prefixes == ("/data/llama3_text_document",)
    assert result.job.train.data.split == "99,1,0"
    assert entry(result, "--tokenizer-type").value == "HuggingFaceTokenizer"


def test_llama3_tp_from_the_environment_changes_the_layout():
    result = import_megatron(LLAMA3, ImportOptions(device_type="nvidia-h100-sxm", env={"TP_SIZE": "4"}))
    assert [(s.layout.tp, s.layout.dp) for s in result.job.plan.stages] == [(4, 1), (4, 1)]
    assert result.job.model.vocab_size == 128512  # 128256 padded to a multiple of 128 x tp 4 = 512


def test_llama3_null_tokenizer_vocabulary_follows_the_megatron_version():
    older = ImportOptions(device_type="nvidia-h100-sxm", megatron_version=parse_version("0.17.1"))
    assert import_megatron(LLAMA3, older).job.model.vocab_size == 128512  # 128256 + EOD = 128257, padded to 256
    current = ImportOptions(device_type="nvidia-h100-sxm", megatron_version=parse_version("core_v0.18.0"))
    assert import_megatron(LLAMA3, current).job.model.vocab_size == 128256


# -- Mixtral 8x7B --------------------------------------------------------------------------------
def test_megatrons_mixtral_example_imports_as_mixtral_with_ep_on_every_stage():
    result = import_megatron(MIXTRAL, ImportOptions(device_type="nvidia-h100-sxm", env={"SLURM_NNODES": "4"},
                                                    script_args=("ckpt", "/models/Mixtral-8x7B/tokenizer.model",
                                                                 "/data/mix")))
    job = result.job
    assert job is not None and not result.blocked
    preset = PRESETS["mixtral-8x7b"]
    m = job.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_kv_heads, m.vocab_size,
            m.rope_theta) == (preset.num_layers, preset.hidden_size, preset.ffn_hidden_size,
                              preset.num_attention_heads, preset.num_kv_heads, preset.vocab_size, preset.rope_theta)
    # Megatron's --moe-aux-loss-coeff 1e-2 is Hugging Face's (and heteroflow's) 1e-2 / top_k.
    assert m.moe == replace(preset.moe, aux_loss_coeff=0.005)
    assert [(s.layers, s.layout.tp, s.layout.dp, s.layout.ep, s.layout.etp, s.layout.zero)
            for s in job.plan.stages] == [(8, 1, 8, 8, None, 1)] * 4
    assert [s.devices for s in job.plan.stages] == [("node-0",), ("node-1",), ("node-2",), ("node-3",)]
    assert entry(result, "--moe-grouped-gemm").disposition == "ignored"
    for key in ("--num-experts", "--moe-router-topk", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
                "--moe-token-dispatcher-type", "--expert-model-parallel-size"):
        assert entry(result, key).disposition == "mapped", key
    assert not [e for e in result.report.entries if e.disposition in ("unsupported", "unknown")]
    assert "experts: etp 1 x ep 8 x expert-dp 1 per pipeline stage" in result.report.format()


def test_mixtral_example_on_its_default_single_node_breaks_megatrons_expert_rule():
    with pytest.raises(MegatronRuleError, match=r"world_size \(8\) is not divisible by "
                                                r"expert_tensor_model_pipeline_parallel size \(32\)"):
        import_megatron(MIXTRAL, ImportOptions(device_type="nvidia-h100-sxm",
                                               script_args=("ckpt", "/models/Mixtral-8x7B/tokenizer.model", "/d")))


# -- YAML ----------------------------------------------------------------------------------------
def test_megatron_yaml_cfg():
    result = import_megatron(YAML_CFG, ImportOptions(nnodes=1, nproc_per_node=8, device_type="nvidia-a100-80g"))
    m, plan = result.job.model, result.job.plan
    assert (m.num_layers, m.hidden_size, m.activation, m.normalization) == (24, 2048, "swiglu", "rmsnorm")
    assert m.ffn_hidden_size == int(4 * 2048 * 2 / 3 / 64) * 64  # Megatron's SwiGLU default
    assert [(s.layout.tp, s.layout.dp, s.layout.sp, s.layout.zero, s.layout.recompute) for s in plan.stages] == [(2, 2, True, 1, "selective")] * 2
    assert entry(result, "swiglu").disposition == "ignored"  # language_model.activation_func decides
    assert entry(result, "language_model.layernorm_epsilon").disposition == "mapped"
    assert entry(result, "language_model.num_moe_experts").value == "null"
    assert "unknown" not in _dispositions(result)


def test_megatron_yaml_needs_the_world_size():
    with pytest.raises(UserError, match="--nnodes"):
        import_megatron(YAML_CFG, ImportOptions(device_type="nvidia-a100-80g"))


def test_megatron_yaml_on_a_given_cluster_uses_all_of_it(write_yaml):
    cluster = write_yaml("""
        cluster:
          nodes:
            - {name: gpu-0, device: nvidia-a100-80g, count: 8}
            - {name: npu-0, device: ascend-910b2, count: 8}
        """, "cluster.yaml")
    result = import_megatron(YAML_CFG, ImportOptions(cluster=cluster))
    assert result.layout.world_size == 16 and result.layout.parallel.dp == 4
    assert [s.devices for s in result.job.plan.stages] == [("gpu-0",), ("npu-0",)]
    assert [s.device_type for s in result.job.plan.stages] == ["nvidia-a100-80g", "ascend-910b2"]


def test_yaml_cfg_named_by_a_script_replaces_its_command_line(tmp_path):
    (tmp_path / "cfg.yaml").write_text(YAML_CFG.read_text())
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 8 --nnodes 1 pretrain_gpt.py --yaml-cfg cfg.yaml --num-layers 2\n")
    result = import_megatron(script, ImportOptions(device_type="nvidia-a100-80g"))
    assert result.job.model.num_layers == 24
    assert entry(result, "--num-layers").disposition == "ignored"
    assert "ignores the command line" in entry(result, "--num-layers").detail


def test_nemo_model_yaml():
    result = import_megatron(NEMO, ImportOptions(device_type="ascend-910b2"))
    job = result.job
    m = job.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.seq_length) == (32, 4096, 11008, 4096)
    assert (m.activation, m.normalization, m.tie_embeddings, m.vocab_size) == ("swiglu", "rmsnorm", False, 32256)
    assert result.layout.world_size == 16 and (result.layout.parallel.tp, result.layout.pp, result.layout.parallel.dp) == (4, 2, 2)
    assert [s.layout.recompute for s in job.plan.stages] == ["full", "full"]
    assert [s.layout.zero for s in job.plan.stages] == [1, 1]
    assert job.train.precision == "bf16" and job.train.steps == 300000 and job.train.warmup_steps == 2000
    assert (job.train.adam_beta2, job.train.min_lr) == (0.95, 3e-5)
    assert entry(result, "model.max_position_embeddings").value == "${.encoder_seq_length}"
    resolver = entry(result, "exp_manager.checkpoint_callback_params.model_parallel_size")
    assert "OmegaConf resolver" in resolver.detail
    assert entry(result, "model.data.data_prefix").disposition == "mapped"
    assert job.train.data.prefixes == ("/data/slimpajama/train_00_text_document",
                                       "/data/slimpajama/train_01_text_document")
    assert job.train.data.weights == (0.5, 0.5) and job.train.data.split == "990,8,2"


def test_the_imported_jobs_validate_when_written(tmp_path):
    for source, options in ((GPT3, ImportOptions(device_type="nvidia-h100")),
                            (LLAMA3, ImportOptions(device_type="hygon-bw1000")),
                            (NEMO, ImportOptions(device_type="ascend-910b2"))):
        result = import_megatron(source, options)
        path = tmp_path / f"{source.stem}.yaml"
        path.write_text(result.job_yaml())
        job = load_job(path)
        assert job.model == result.job.model and job.plan.to_dict() == result.job.plan.to_dict()


# -- other common styles -------------------------------------------------------------------------
def test_arguments_in_multiline_strings_ascend_style():
    result = import_megatron(SCRIPTS / "pretrain_llama2_70b_ascend.sh", ImportOptions(device_type="ascend-910b2"))
    job = result.job
    assert result.report.launcher.startswith("torch.distributed.launch pretrain_gpt.py")
    assert (job.model.num_layers, job.model.num_kv_heads, job.model.vocab_size) == (80, 8, 32000)
    assert [(s.devices, s.layout.tp, s.layout.sp, s.layers) for s in job.plan.stages] == [(("node-0",), 8, True, 40),
                                                                           (("node-1",), 8, True, 40)]
    assert job.train.warmup_steps == 50  # --lr-warmup-fraction 0.01 of 5000 steps
    assert entry(result, "--use-fused-rmsnorm").disposition == "ignored"
    assert any("$CKPT_LOAD_DIR" in n for n in result.report.script_notes)


def test_megatron_deepspeed_options_string_and_eval():
    result = import_megatron(SCRIPTS / "ds_pretrain_gpt_350m.sh", ImportOptions(device_type="nvidia-a100-80g"))
    job = result.job
    assert result.report.launcher.startswith("deepspeed pretrain_gpt.py (line 59)")  # the eval, not the echo
    assert [(s.layout.tp, s.layout.dp, s.layout.zero, s.layout.recompute) for s in job.plan.stages] == [(2, 2, 1, "full")] * 2
    assert job.model.vocab_size == 50432 and job.train.precision == "fp16"  # 50257 to a multiple of 128 x tp 2
    assert entry(result, "--zero-stage").detail == "plan.stages[*].zero = 1"
    assert entry(result, "--deepspeed_config").disposition == "ignored"
    assert entry(result, "--vocab-file").disposition == "approximated"
