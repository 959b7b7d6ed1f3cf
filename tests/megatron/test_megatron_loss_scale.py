"""Megatron's loss-scaling flags become the job's `train.loss_scale` settings (Megatron's grad-scaler rules)."""

from __future__ import annotations

import pytest

from heteroflow.megatron import MegatronRuleError
from megatron_helpers import BASE_ARGS, entry, import_args

FP16 = BASE_ARGS.replace("--bf16", "--fp16")


def test_fp16_scales_dynamically_with_the_given_settings(tmp_path):
    result = import_args(tmp_path, "--initial-loss-scale 4096 --min-loss-scale 2 --loss-scale-window 500 "
                                   "--hysteresis 4", base=FP16)
    train = result.job.train
    assert train.precision == "fp16" and train.loss_scale is None  # None: dynamic, since the stages are fp16
    assert (train.initial_loss_scale, train.min_loss_scale, train.loss_scale_window, train.hysteresis) == \
        (4096.0, 2.0, 500, 4)
    for flag, detail in (("--initial-loss-scale", "train.initial_loss_scale = 4096"),
                         ("--min-loss-scale", "train.min_loss_scale = 2"),
                         ("--loss-scale-window", "train.loss_scale_window = 500"),
                         ("--hysteresis", "train.hysteresis = 4")):
        assert (entry(result, flag).disposition, entry(result, flag).detail) == ("mapped", detail)


def test_fp16_defaults_are_megatrons(tmp_path):
    train = import_args(tmp_path, "", base=FP16).job.train
    assert (train.initial_loss_scale, train.min_loss_scale, train.loss_scale_window, train.hysteresis) == \
        (2.0**32, 1.0, 1000, 2)


def test_loss_scale_is_static_and_makes_the_dynamic_flags_unused(tmp_path):
    result = import_args(tmp_path, "--loss-scale 128 --hysteresis 3", base=FP16)
    assert result.job.train.loss_scale == 128.0 and result.job.train.hysteresis == 2
    assert entry(result, "--loss-scale").disposition == "mapped"
    assert entry(result, "--hysteresis").disposition == "ignored"
    assert "static" in entry(result, "--hysteresis").detail


def test_bf16_takes_a_static_scale_and_ignores_the_dynamic_flags(tmp_path):
    result = import_args(tmp_path, "--loss-scale 8 --initial-loss-scale 1024")
    assert result.job.train.precision == "bf16" and result.job.train.loss_scale == 8.0
    result = import_args(tmp_path, "--initial-loss-scale 1024")
    assert result.job.train.loss_scale is None and result.job.train.initial_loss_scale == 2.0**32
    assert entry(result, "--initial-loss-scale").disposition == "ignored"
    assert "--fp16 only" in entry(result, "--initial-loss-scale").detail


@pytest.mark.parametrize("args, message", [
    ("--loss-scale -1", "--loss-scale -1 must be a finite positive number"),
    ("--hysteresis 0", "--hysteresis 0 must be a finite positive integer"),
    ("--loss-scale-window 2.5", "--loss-scale-window 2.5 must be a finite positive integer"),
])
def test_bad_values_are_errors(tmp_path, args, message):
    with pytest.raises(MegatronRuleError, match=message):
        import_args(tmp_path, args, base=FP16)


def test_export_uses_the_stages_precision_and_refuses_a_mix():
    from heteroflow.config import parse_job
    from heteroflow.errors import UserError
    from heteroflow.megatron import export_megatron

    def job(precisions):
        stages = [{"devices": [f"gpu-{k}"], "layers": 2, **({"precision": p} if p else {})}
                  for k, p in enumerate(precisions)]
        return parse_job({"cluster": {"nodes": [{"name": f"gpu-{k}", "device": "nvidia-a100-80g", "count": 1}
                                                for k in range(2)]},
                          "model": {"preset": "micro-llama"},
                          "train": {"global_batch_size": 8, "precision": "bf16", "hysteresis": 3},
                          "plan": {"micro_batch_size": 1, "stages": stages}})

    argv = export_megatron(job(["fp16", "fp16"])).argv()
    assert "--fp16" in argv and "--bf16" not in argv and argv[argv.index("--hysteresis") + 1] == "3"
    with pytest.raises(UserError, match="differ in precision"):
        export_megatron(job([None, "fp16"]))
