"""Pipeline schedules as plain data: the ordered actions each stage runs in one optimizer step.

The one definition of GPipe and 1F1B: the runtime executes these lists (runtime/pipeline.py) and the
planner's simulator times the same lists (stagemap/pipeline.py), so the planner prices the schedule that runs.

A stage's list says when it runs the forward (F) or backward (B) of micro-batch m; receives and sends
follow from the pipeline position (F on stage k > 0 first receives from k - 1, and so on). Stages with
different layouts use the same lists: the schedule only orders micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")
FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class Action:
    """Run the forward or backward of one micro-batch."""

    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def warmup_forwards(num_stages: int, stage: int, num_micro_batches: int) -> int:
    """1F1B: forwards `stage` runs before its first backward."""
    return min(num_stages - stage - 1, num_micro_batches)


def gpipe_actions(num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    """GPipe: every forward, then every backward (in reverse, so the last activation is freed first)."""
    assert 0 <= stage < num_stages and num_micro_batches >= 1
    return ([Action(FORWARD, m) for m in range(num_micro_batches)]
            + [Action(BACKWARD, m) for m in reversed(range(num_micro_batches))])


def one_f_one_b_actions(num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate, then drain the backwards.

    Stage k keeps at most `num_stages - k` micro-batches in flight, which bounds activation memory.
    """
    assert 0 <= stage < num_stages and num_micro_batches >= 1
    warmup = warmup_forwards(num_stages, stage, num_micro_batches)
    actions = [Action(FORWARD, m) for m in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < num_micro_batches:
        actions.append(Action(FORWARD, next_forward))
        next_forward += 1
        actions.append(Action(BACKWARD, next_backward))
        next_backward += 1
    actions += [Action(BACKWARD, m) for m in range(next_backward, num_micro_batches)]
    return actions


def stage_actions(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> list[Action]:
    """The actions of `stage` under `schedule` (`1f1b` or `gpipe`)."""
    if schedule == "1f1b":
        return one_f_one_b_actions(num_stages, stage, num_micro_batches)
    if schedule == "gpipe":
        return gpipe_actions(num_stages, stage, num_micro_batches)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once under `actions`."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def in_flight(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> int:
    """`max_in_flight` of the stage's actions in closed form (the planner's memory model calls it often):
    GPipe holds every micro-batch, 1F1B at most `num_stages - stage`."""
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_stages - stage, num_micro_batches)
