"""Host syncs per training step in steady state, counted on CPU as an accelerator would make them
(`heteroflow.testing.host_syncs`): reads of device tensors, device-to-host copies, blocking host-to-device copies
and `Device.synchronize`, on the real path with the strict stand-ins (which tag host and device tensors). Before
issue 27 the first and last stages copied each micro-batch's tokens and labels to the device blocking, the last
stage read its loss once per micro-batch, the worker read the norm, the loss and the aux loss apart and synchronized
the device after the optimizer for the step's metrics."""

from __future__ import annotations

from heteroflow.config import parse_job
from heteroflow.runtime.worker import WorkerArgs
from heteroflow.testing.host_syncs import count_rank
from heteroflow.testing.multiproc import run_ranks
from heteroflow.testing.strict import ENVIRONMENT, TIMEOUT_ENVIRONMENT

STEPS = 4


def _syncs(tmp_path, stages: list[dict], nodes: list[dict], model: dict | None = None) -> list[dict[int, list[str]]]:
    job = parse_job({"cluster": {"nodes": nodes}, "model": model or {"preset": "micro-llama"},
                     "train": {"global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32", "steps": STEPS,
                               "lr": 3e-3, "warmup_steps": 1},
                     "plan": {"schedule": "1f1b", "micro_batch_size": 2, "stages": stages}})
    args = WorkerArgs(job=job, plan=job.plan, emulate=False, steps=STEPS, data_dir=str(tmp_path / "data"),
                      show_progress=False, timeout_s=120)
    results = run_ranks(count_rank, job.plan.num_devices, args, timeout_s=240,
                        env={ENVIRONMENT: "1", TIMEOUT_ENVIRONMENT: "20"})
    return [syncs for _, syncs in results]


def _assert_at_most(per_rank: list[dict[int, list[str]]], most: int) -> None:
    over = []
    for rank, steps in enumerate(per_rank):
        assert sorted(steps) == list(range(STEPS))
        over += [f"rank {rank}, step {step}: {steps[step]}"
                 for step in range(1, STEPS - 1) if len(steps[step]) > most]  # steady state: not the first nor the last
    assert not over, "\n".join(over)


def test_a_pipeline_step_syncs_the_host_at_most_once(tmp_path):
    # Two NVIDIA stages on a direct link, 4 micro-batches: 1F1B's steady state, the last stage's losses.
    per_rank = _syncs(tmp_path, [{"devices": ["gpu-0"], "layers": 2}, {"devices": ["gpu-1"], "layers": 2}],
                      [{"name": f"gpu-{k}", "device": "nvidia-a100-80g", "count": 1} for k in range(2)])
    # The one: the read of the step's norm, loss and aux loss before the optimizer (the step before's timer events
    # are read then too).
    _assert_at_most(per_rank, 1)
