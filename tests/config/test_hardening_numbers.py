"""Every number from a config file or a flag is finite and in its documented range (`heteroflow.config.limits`)."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, problems
from heteroflow.cli import main
from heteroflow.config import limits, parse_job
from heteroflow.errors import ConfigError

GOOD = {
    "cluster": {
        "inter_node_gb_per_s": 25,
        "device_types": {"my-dev": {"vendor": "cpu", "memory_gib": 16, "tflops_bf16": 1, "tflops_fp16": 1,
                                    "tflops_fp32": 1, "hbm_gb_per_s": 100, "intra_node_gb_per_s": 10,
                                    "host_link_gb_per_s": 10}},
        "nodes": [{"name": "a", "device": "my-dev", "count": 2}],
    },
    "model": {"preset": "micro-llama", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 172,
              "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 256, "seq_length": 32, "head_dim": 16,
              "rope_theta": 10000.0, "norm_eps": 1e-5},
    "train": {"global_batch_size": 4, "micro_batch_size": 2, "steps": 3, "seed": 1, "warmup_steps": 1, "lr": 1e-3,
              "min_lr": 1e-4, "weight_decay": 0.1, "grad_clip": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95,
              "adam_eps": 1e-8, "checkpoint": {"dir": "ckpt", "interval": 2, "keep": 2}},
    "plan": {"version": 1, "micro_batch_size": 2,
             "stages": [{"devices": ["a"], "layers": 4, "tp": 1, "dp": 2, "cp": 1, "zero": 0}]},
}

# (dotted path, may it be 0?)
FIELDS = [
    ("cluster.inter_node_gb_per_s", False),
    *[(f"cluster.device_types.my-dev.{f}", False) for f in ("memory_gib", "tflops_bf16", "tflops_fp16", "tflops_fp32",
                                                           "hbm_gb_per_s", "intra_node_gb_per_s",
                                                           "host_link_gb_per_s")],
    ("cluster.nodes.0.count", False),
    *[(f"model.{f}", False) for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                      "num_kv_heads", "vocab_size", "seq_length", "head_dim", "rope_theta",
                                      "norm_eps")],
    *[(f"train.{f}", False) for f in ("global_batch_size", "micro_batch_size", "steps", "lr", "adam_eps")],
    *[(f"train.{f}", True) for f in ("seed", "warmup_steps", "min_lr", "weight_decay", "grad_clip", "adam_beta1",
                                     "adam_beta2")],
    ("train.checkpoint.interval", False), ("train.checkpoint.keep", False),
    ("plan.version", False), ("plan.micro_batch_size", False),
    *[(f"plan.stages.0.{f}", False) for f in ("tp", "dp", "cp")], ("plan.stages.0.zero", True),
]
BAD = [math.nan, math.inf, -math.inf, 1e30, -1, 10**40]


def yaml_path(dotted: str) -> str:
    """`plan.stages.0.tp` -> `plan.stages[0].tp`, as problems name it."""
    out = ""
    for part in dotted.split("."):
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def with_value(dotted: str, value) -> dict:
    data = copy.deepcopy(GOOD)
    *parents, last = dotted.split(".")
    target = data
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[int(last) if last.isdigit() else last] = value
    return data


def test_the_base_job_is_valid():
    assert problems(GOOD) == []


@pytest.mark.parametrize("value", BAD + [0], ids=lambda v: repr(v)[:8])
@pytest.mark.parametrize("dotted,zero_ok", FIELDS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_number_is_refused_with_its_path_and_range(dotted, zero_ok, value):
    if value == 0 and zero_ok:
        assert not any(p.startswith(yaml_path(dotted) + ":") for p in problems(with_value(dotted, value)))
        return
    found = problems(with_value(dotted, value))
    mine = [p for p in found if p.startswith(yaml_path(dotted) + ": ")]
    assert len(mine) == 1, found
    message = mine[0].split(": ", 1)[1]
    assert message.startswith("must be ") and any(w in message for w in ("between", "at most", "below")), message
    if isinstance(value, float) and not math.isfinite(value):
        assert message.startswith("must be a finite number") and message.endswith(f"got {value:g}")


@pytest.mark.parametrize("dotted", ["cluster.nodes.0.count", "train.global_batch_size", "model.vocab_size",
                                    "model.seq_length", "train.seed", "plan.stages.0.tp"])
def test_fractional_counts_are_not_integers(dotted):
    found = problems(with_value(dotted, 2.5))
    assert f"{yaml_path(dotted)}: expected an integer, got a number 2.5" in found


def test_whole_floats_inside_the_range_still_count():
    job = parse_job(with_value("train.global_batch_size", 4.0))
    assert job.train.global_batch_size == 4 and isinstance(job.train.global_batch_size, int)


@pytest.mark.parametrize("dotted,limit", [
    ("cluster.nodes.0.count", limits.DEVICES_PER_NODE), ("train.seed", limits.SEED),
    ("train.global_batch_size", limits.GLOBAL_BATCH_SIZE), ("model.num_layers", limits.NUM_LAYERS),
])
def test_range_ends(dotted, limit):
    top = int(limit.maximum)
    assert not any(p.startswith(yaml_path(dotted) + ":") for p in problems(with_value(dotted, top)))
    assert (f"{yaml_path(dotted)}: must be between {int(limit.minimum)} and {top}, got {top + 1}"
            in problems(with_value(dotted, top + 1)))


def test_adam_beta_must_stay_below_one():
    assert "train.adam_beta2: must be at least 0 and below 1, got 1" in problems(with_value("train.adam_beta2", 1))


def test_messages_read_well():
    assert "train.lr: must be a finite number above 0 and at most 10, got nan" in problems(
        with_value("train.lr", math.nan))
    assert "cluster.nodes[0].count: must be between 1 and 1024, got 1e+30" in problems(
        with_value("cluster.nodes.0.count", 1e30))


def test_validate_cli_reports_nan_with_exit_2(write_yaml):
    job = write_yaml(yaml.safe_dump(with_value("train.lr", math.nan)))  # written as .nan
    result = subprocess.run([sys.executable, "-m", "heteroflow", "validate", str(job)], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "train.lr: must be a finite number above 0 and at most 10, got nan" in result.stderr


FLAG_CASES = [
    (["train", "JOB"], "--steps", ["0", "-1", "10000000000"]),
    (["train", "JOB"], "--timeout", ["nan", "inf", "-inf", "1e30", "0", "-1"]),
    (["train", "JOB"], "--join-timeout", ["nan", "inf", "0"]),
    (["train", "JOB"], "--rejoin-timeout", ["nan", "-inf", "0.5"]),
    (["train", "JOB"], "--max-restarts", ["-1", "1000000"]),
    (["import-megatron", "x.sh"], "--nproc-per-node", ["0", "-1", "100000"]),
    (["import-megatron", "x.sh"], "--nnodes", ["0", "-3", "1000000000"]),
    (["import-megatron", "x.sh"], "--vocab-size", ["0", "1000000000000"]),
    (["plan", "JOB"], "--max-micro-batch-size", ["0", "-1", "100000000"]),
]


@pytest.mark.parametrize("command,flag,value", [(c, f, v) for c, f, values in FLAG_CASES for v in values])
def test_bad_flag_values_exit_2_before_any_work(capsys, command, flag, value):
    assert main([*command, f"{flag}={value}"]) == 2  # the job file need not exist: flags are checked first
    err = capsys.readouterr().err
    assert err.startswith(f"{flag}: must be ") and "Traceback" not in err, err


def test_flag_check_names_every_bad_flag(capsys):
    assert main(["train", "JOB", "--steps", "0", "--timeout", "nan"]) == 2
    assert capsys.readouterr().err.splitlines() == ["--steps: must be between 1 and 1000000000, got 0",
                                                    "--timeout: must be a finite number between 1 and 2592000, got nan"]


@pytest.mark.parametrize("profile,path", [
    ({"link": {"gb_per_s": math.nan}}, "profile.link.gb_per_s: must be a finite number"),
    ({"disk": {"read_gb_per_s": math.inf}}, "profile.disk.read_gb_per_s: must be a finite number"),
    ({"host": {"cpu_cores": 1e30}}, "profile.host.cpu_cores: must be between 1 and"),
    ({"devices": [{"device_type": "x", "gemm_tflops": {"bf16": [[1024, math.inf]]}}]},
     "profile.devices[0].gemm_tflops.bf16: expected a non-empty list of [n, tflops] lists of finite positive"),
])
def test_profile_numbers_are_checked(tmp_path, profile, path):
    from heteroflow.stagemap.profile import load_profile
    file = tmp_path / "profile.yaml"
    file.write_text(yaml.safe_dump({"profile": profile}))
    with pytest.raises(ConfigError) as info:
        load_profile(file)
    assert any(str(p).startswith(path) for p in info.value.problems), info.value.problems


def test_import_megatron_refuses_zero_processes_from_the_script_or_the_api(tmp_path, capsys):
    from heteroflow.errors import UserError
    from heteroflow.megatron import ImportOptions, import_megatron
    script = tmp_path / "run.sh"
    script.write_text("torchrun --nproc_per_node 0 --nnodes 1 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
                      "--num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --global-batch-size 4 --bf16\n")
    assert main(["import-megatron", str(script), "--device-type", "cpu"]) == 2
    assert "the source's processes per node: must be between 1 and 1024, got 0" in capsys.readouterr().err
    with pytest.raises(UserError, match="--nnodes: must be between 1 and 100000, got 0"):
        import_megatron(script, ImportOptions(nnodes=0, nproc_per_node=2, device_type="cpu"))


def test_an_integer_without_a_range_of_its_own_is_still_exact():
    from heteroflow.config.reader import Problems, Section
    problems_ = Problems()
    sec = Section({"n": 1e30, "m": 2.0**40}, "x", problems_)
    assert sec.integer("n", minimum=0) is None and sec.integer("m", minimum=0) == 2**40
    assert [str(p) for p in problems_.items] == [f"x.n: must be between 0 and {limits.MAX_EXACT_INT}, got 1e+30"]
