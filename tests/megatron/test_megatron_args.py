"""Megatron's argument table and parser, the launch-line finder, and that no argument is dropped silently."""

from __future__ import annotations

import pytest

from heteroflow.errors import UserError
from heteroflow.megatron.args import parse_argv
from heteroflow.megatron.argtable import MAPPED, TABLE, by_dest, group_of_unknown
from heteroflow.megatron.context import NO_RULE
from heteroflow.megatron.launcher import find_launch
from heteroflow.megatron.shell import Field, run_script
from megatron_helpers import import_args


def fields(text: str) -> list[Field]:
    return [Field(t) for t in text.split()]


def test_table_has_megatrons_defaults():
    defaults = {d.dest: d.default for d in TABLE.values()}
    assert defaults["weight_decay"] == 0.01 and defaults["adam_beta2"] == 0.999 and defaults["lr_decay_style"] == "linear"
    assert defaults["attention_dropout"] == 0.1 and defaults["hidden_dropout"] == 0.1
    assert defaults["add_bias_linear"] is True and defaults["make_vocab_size_divisible_by"] == 128
    assert defaults["position_embedding_type"] == "learned_absolute" and defaults["normalization"] == "LayerNorm"
    assert defaults["num_query_groups"] == 1 and defaults["rotary_base"] == 10000 and defaults["seed"] == 1234
    assert by_dest()["norm_epsilon"].flag == "--norm-epsilon" and TABLE["--layernorm-epsilon"].dest == "norm_epsilon"
    assert len(TABLE) > 400


def test_parse_values_lists_and_equals_forms():
    args = parse_argv(fields("--num-layers=32 --lr 6e-5 --bf16 --data-path 0.3 a 0.7 b --disable-bias-linear "
                             "--rampup-batch-size 16 16 100"))
    assert args.problems == ()
    assert (args.get("num_layers"), args.get("lr"), args.get("bf16")) == (32, 6e-5, True)
    assert args.get("data_path") == ["0.3", "a", "0.7", "b"]
    assert args.get("add_bias_linear") is False and args.get("rampup_batch_size") == ["16", "16", "100"]
    assert args.get("tensor_model_parallel_size") == 1  # default


def test_negative_numbers_are_values_not_flags():
    args = parse_argv(fields("--lr-warmup-init -1e-5 --seed -3"))
    assert args.problems == () and args.get("lr_warmup_init") == -1e-5 and args.get("seed") == -3


def test_unknown_flags_take_the_following_values():
    args = parse_argv(fields("--my-flag a b --num-layers 2"))
    unknown = args.settings[0]
    assert (unknown.key, unknown.dest, unknown.raw) == ("--my-flag", None, ("a", "b"))
    assert args.get("num_layers") == 2
    assert group_of_unknown("--moe-anything") == "moe" and group_of_unknown("--foo") is None


def test_unknown_values_stay_unresolved():
    args = parse_argv([Field("--data-path"), Field.unknown("$DATA"), Field("--save"), Field.unknown("$1")])
    setting = args.setting("data_path")
    assert setting.value is None and setting.unresolved == ("$DATA",)


@pytest.mark.parametrize("flag, value", [(f, d) for f, d in TABLE.items() if d.group == MAPPED])
def test_every_mapped_argument_gets_a_decision(tmp_path, flag, value):
    """Given alone on a small valid model, every mapped flag is decided: a job entry or a Megatron error."""
    definition = value
    if definition.dest in {d.dest for f, d in TABLE.items() if f < flag and d.group == MAPPED}:
        pytest.skip("alias of an earlier flag")
    if definition.kind in ("true", "false"):
        arg = flag
    elif definition.choices:
        arg = f"{flag} {definition.choices[-1]}"
    else:
        arg = f"{flag} " + {"int": "2", "float": "0.5", "list": "1"}.get(definition.kind, "x")
    try:
        result = import_args(tmp_path, arg)
    except UserError:
        return  # Megatron would refuse it; the message is checked in test_megatron_rules
    entries = [e for e in result.report.entries if e.key == flag]
    assert entries and entries[-1].detail != NO_RULE, entries


def test_launch_through_torchrun_with_equals_options():
    run = run_script("torchrun --nproc-per-node=4 --nnodes=2 --rdzv-endpoint=host:29500 pretrain_gpt.py --bf16\n")
    launch = find_launch(run.commands)
    assert (launch.launcher, launch.nproc_per_node, launch.nnodes) == ("torchrun", 4, 2)
    assert [f.text for f in launch.argv] == ["--bf16"]
    assert {e.disposition for e in launch.entries} == {"mapped", "ignored"}


@pytest.mark.parametrize("line, launcher, nproc, nnodes", [
    ("python -m torch.distributed.launch --nproc_per_node 8 --nnodes 2 pretrain_gpt.py", "torch.distributed.launch",
     8, 2),
    ("python3 -m torch.distributed.run --standalone --nproc_per_node 4 pretrain_gpt.py", "torch.distributed.run",
     4, 1),
    ("deepspeed --num_gpus 8 --num_nodes 4 pretrain_gpt.py", "deepspeed", 8, 4),
    ("srun -N 4 --ntasks-per-node 8 python pretrain_gpt.py", "srun", 8, 4),
    ("env CUDA_DEVICE_MAX_CONNECTIONS=1 nohup torchrun --nproc_per_node 2 /opt/Megatron-LM/pretrain_gpt.py",
     "torchrun", 2, 1),
    ("python pretrain_gpt.py", "python", 1, 1),
    ("torchrun pretrain_gpt.py", "torchrun", 1, 1),
])
def test_launchers(line, launcher, nproc, nnodes):
    launch = find_launch(run_script(line + " --num-layers 2\n").commands)
    assert (launch.launcher, launch.nproc_per_node, launch.nnodes) == (launcher, nproc, nnodes)
    assert launch.program == "pretrain_gpt.py" and [f.text for f in launch.argv] == ["--num-layers", "2"]


def test_the_first_training_launch_is_used_and_others_noted():
    script = ("python tools/preprocess_data.py --input x\n"
              "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2\n"
              "torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4\n")
    launch = find_launch(run_script(script).commands)
    assert launch.line == 2 and "another launch" in launch.notes[0]


def test_environment_prefixes_are_reported():
    launch = find_launch(run_script("NCCL_DEBUG=INFO torchrun --nproc_per_node 8 pretrain_gpt.py\n").commands)
    assert any(e.key == "NCCL_DEBUG=" and e.disposition == "ignored" for e in launch.entries)


def test_no_launch_is_a_clear_error():
    with pytest.raises(UserError, match="no training launch found"):
        find_launch(run_script("echo hello\n").commands)
    with pytest.raises(UserError, match="training script's path is not known"):
        find_launch(run_script("torchrun --nproc_per_node 8 $SCRIPT --num-layers 2\n").commands)


def test_srun_wrapping_torchrun_gives_the_node_count():
    script = 'srun -N 4 bash -c "torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 pretrain_gpt.py --bf16"\n'
    launch = find_launch(run_script(script).commands)
    assert (launch.launcher, launch.nnodes, launch.nproc_per_node) == ("torchrun", 4, 8)
    assert [f.text for f in launch.argv] == ["--bf16"]


def test_arguments_passed_through_with_dollar_at(tmp_path):
    from heteroflow.megatron import ImportOptions, import_megatron
    from megatron_helpers import BASE_ARGS
    script = tmp_path / "run.sh"
    script.write_text('torchrun --nproc_per_node 8 pretrain_gpt.py "$@"\n')
    result = import_megatron(script, ImportOptions(device_type="cpu", script_args=tuple(BASE_ARGS.split())))
    assert result.job.model.num_layers == 8 and result.layout.parallel.dp == 8
