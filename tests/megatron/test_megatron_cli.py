"""End-to-end: `heteroflow import-megatron` as a user runs it."""

from __future__ import annotations

import json

import yaml

from heteroflow.config import load_job, load_plan_file
from megatron_helpers import FIXTURE_MIXTRAL, SCRIPTS, heteroflow, launch_script

LLAMA3 = str(SCRIPTS / "train_llama3_8b_h100_fp8.sh")
GPT3 = str(SCRIPTS / "train_gpt3_175b_distributed.sh")
MIXTRAL = str(FIXTURE_MIXTRAL)
MIXTRAL_ARGS = ("ckpt", "/models/Mixtral-8x7B/tokenizer.model", "/data/x")


def test_job_to_a_file_report_to_stdout_and_the_job_validates(tmp_path):
    job, plan = tmp_path / "job.yaml", tmp_path / "plan.yaml"
    result = heteroflow("import-megatron", LLAMA3, "--device-type", "nvidia-h100-sxm", "-o", str(job),
                        "--plan-out", str(plan))
    assert result.returncode == 0, result.stderr
    assert "Every argument:" in result.stdout and f"wrote {job}" in result.stdout
    assert "--fp8-format hybrid" in result.stdout
    validated = heteroflow("validate", str(job))
    assert validated.returncode == 0, validated.stderr
    assert "2 stages" in validated.stdout
    # The plan file is what `heteroflow plan JOB --evaluate PLAN` reads.
    loaded = load_job(job)
    assert load_plan_file(plan, loaded).to_dict() == loaded.plan.to_dict()


def test_without_output_the_job_goes_to_stdout_and_the_report_to_stderr():
    result = heteroflow("import-megatron", GPT3, "ckpt", "tb", "vocab", "merges", "/data/pile_text_document",
                        "--device-type", "nvidia-a100-80g")
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    assert job["model"]["num_layers"] == 96 and len(job["plan"]["stages"]) == 16
    assert job["train"]["data"] == {"prefixes": ["/data/pile_text_document"], "split": "949,50,1"}
    assert "Every argument:" in result.stderr and "Every argument:" not in result.stdout


def test_placeholder_device_is_rejected_by_validate_until_it_is_set(tmp_path):
    job = tmp_path / "job.yaml"
    result = heteroflow("import-megatron", GPT3, "-o", str(job))
    assert result.returncode == 0, result.stderr
    assert "placeholder device type `<set-me>`" in result.stderr
    rejected = heteroflow("validate", str(job))
    assert rejected.returncode == 2 and "unknown device type '<set-me>'" in rejected.stderr
    job.write_text(job.read_text().replace("&device <set-me>", "&device ascend-910b2"))
    accepted = heteroflow("validate", str(job))
    assert accepted.returncode == 0, accepted.stderr


def test_mixtral_example_imports_with_its_experts_on_four_nodes(tmp_path):
    job = tmp_path / "job.yaml"
    result = heteroflow("import-megatron", MIXTRAL, *MIXTRAL_ARGS, "--env", "SLURM_NNODES=4", "--device-type",
                        "nvidia-h100-sxm", "-o", str(job))
    assert result.returncode == 0, result.stderr
    data = yaml.safe_load(job.read_text())
    assert data["model"]["moe"]["num_experts"] == 8 and data["model"]["moe"]["top_k"] == 2
    assert [(s["dp"], s["ep"]) for s in data["plan"]["stages"]] == [(8, 8)] * 4
    assert "(experts: ep 8, etp 1)" in job.read_text()


def test_mixtral_on_one_node_breaks_megatrons_expert_rule_exit_2():
    # The example's NNODES defaults to 1: 8 ranks cannot hold ep 8 x pp 4, and Megatron refuses to start.
    result = heteroflow("import-megatron", MIXTRAL, *MIXTRAL_ARGS, "--device-type", "nvidia-h100-sxm")
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert f"{MIXTRAL}: cannot import (1 problem)" in result.stderr
    assert ("world_size (8) is not divisible by expert_tensor_model_pipeline_parallel size (32)"
            in result.stderr)


def _jitter_script(tmp_path) -> str:
    script = tmp_path / "moe_jitter.sh"
    script.write_text(launch_script("--swiglu --num-experts 8 --moe-input-jitter-eps 0.01"))
    return str(script)


def test_moe_feature_refused_by_name_with_exit_2_and_the_report(tmp_path):
    script = _jitter_script(tmp_path)
    result = heteroflow("import-megatron", script, "--device-type", "cpu")
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert "NOT IMPORTED" in result.stderr
    assert (f"error: {script}: not imported: mixture-of-experts: router input jitter (--moe-input-jitter-eps "
            "0.01): heteroflow's router takes its input unchanged") in result.stderr


def test_json_is_one_document(tmp_path):
    result = heteroflow("import-megatron", LLAMA3, "--device-type", "nvidia-h100-sxm", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ready"] and data["job"]["plan"]["micro_batch_size"] == 2
    assert data["report"]["counts"]["mapped"] > 30
    blocked = heteroflow("import-megatron", _jitter_script(tmp_path), "--json")
    assert blocked.returncode == 2 and json.loads(blocked.stdout)["blocked"]


def test_rule_violation_exits_2_with_every_problem(tmp_path):
    script = tmp_path / "bad.sh"
    script.write_text("torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 30 --hidden-size 1000 "
                      "--num-attention-heads 7 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 "
                      "--train-iters 10 --lr 1e-4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
                      "--tokenizer-type GPT2BPETokenizer\n")
    result = heteroflow("import-megatron", str(script), "--device-type", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot import" in result.stderr
    assert "num_attention_heads (7) must be a multiple of tensor_model_parallel_size (2)" in result.stderr
    assert "Number of layers should be divisible by the pipeline-model-parallel size" in result.stderr


def test_user_errors_exit_2():
    missing = heteroflow("import-megatron", "no-such-script.sh")
    assert missing.returncode == 2 and "file not found" in missing.stderr
    bad_env = heteroflow("import-megatron", LLAMA3, "--env", "NOEQUALS")
    assert bad_env.returncode == 2 and "--env expects NAME=VALUE" in bad_env.stderr
    bad_chip = heteroflow("import-megatron", LLAMA3, "--device-type", "a100")
    assert bad_chip.returncode == 2 and "did you mean" in bad_chip.stderr


def test_env_and_cluster_options(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("cluster:\n  nodes:\n    - {name: dcu-0, device: hygon-bw1000, count: 8}\n")
    result = heteroflow("import-megatron", LLAMA3, "--cluster", str(cluster), "--env", "TP_SIZE=4", "--json")
    assert result.returncode == 0, result.stderr
    stages = json.loads(result.stdout)["job"]["plan"]["stages"]
    assert [(s["devices"], s["tp"], s["dp"]) for s in stages] == [(["dcu-0:0-3"], 4, 1), (["dcu-0:4-7"], 4, 1)]


def test_shell_syntax_errors_name_the_file_and_line(tmp_path):
    script = tmp_path / "broken.sh"
    script.write_text('ARGS=(\n  --num-layers 2\ntorchrun pretrain_gpt.py "${ARGS[@]}\n')
    result = heteroflow("import-megatron", str(script))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{script}: line 3: unterminated double quote" in result.stderr
