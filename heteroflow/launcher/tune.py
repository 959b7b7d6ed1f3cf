"""`heteroflow tune`: run the best predicted plans briefly, calibrate from them, keep the best measured plan.

1. The planner's `top_k` best plans (`stagemap.search_top_plans`; emulated: the best `top_k` of a larger pool
   of the planner's plans, ranked by their emulated estimate, since an emulated rank is a CPU process
   whatever its label) each train `steps` steps through `train_job`, the path `heteroflow train` takes
   (emulated, one node, or this node's ranks of a multi-node run), in a work directory of their own:
   plan files, metrics files and logs there, no checkpoints, so the user's runs are never touched.
2. `calibrate` fits the cost model to their metrics files (warm-up steps excluded, `calibrate.runs`).
3. Planning again with the calibration (a real run: the planner searches with it; emulated: the pool is
   ranked again by the calibrated emulated estimate): a new best plan not measured yet trains too.
4. The plan with the least measured step time is written as `plan -o` writes a plan, with its calibrated
   `predicted` figures, its `measured` ones and the table of every trial as a comment.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from heteroflow.calibrate.fit import fit_calibration
from heteroflow.calibrate.runs import load_runs
from heteroflow.config import JobConfig, PlanSpec, load_plan_file
from heteroflow.config.yamlfile import dump_yaml
from heteroflow.errors import UserError
from heteroflow.launcher.launch import TrainingFailed
from heteroflow.launcher.prepare import TrainOptions, cache_dir
from heteroflow.launcher.signals import Stopped
from heteroflow.launcher.train import train_job
from heteroflow.measure.host import emulation_job
from heteroflow.runtime.stop import signal_name
from heteroflow.stagemap import RUNTIME_LAYOUTS, PlanEstimate, evaluate_plan, search_plan, search_top_plans
from heteroflow.stagemap.calibration import Calibration, save_calibration
from heteroflow.stagemap.planfile import plan_document, write_plan

MIN_STEPS = 3
"""A trial's first steps are its warm-up (`calibrate.runs.warm_step_times`); at least one must be left."""
EMULATED_POOL = 4
"""Emulated: plans the planner proposes per plan run (re-ranked by their emulated estimates)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneOptions:
    """Command-line choices of one `heteroflow tune`."""

    output: str
    top_k: int = 3
    steps: int = 10
    emulate: bool = False
    work_dir: str | None = None
    """Where trials keep plans, metrics, logs and the calibration; default: `OUTPUT.tune` next to `output`."""
    timeout_s: float = 600.0
    node: str | None = None
    rdzv: str | None = None
    join_timeout_s: float = 300.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    """One plan tune ran (or tried to run) and what it measured."""

    name: str
    """`trial-N`: its files in the work directory are `trial-N.yaml`, `trial-N.jsonl` and `logs-trial-N/`."""
    plan: PlanSpec
    reason: str
    """Why it ran: `top N` (the N-th predicted) or `calibrated best`."""
    predicted_s: float
    calibrated_s: float | None = None
    measured_s: float | None = None
    error: str = ""
    """Why it measured nothing (a failed or refused run), '' otherwise."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneResult:
    """Every trial, the calibration fitted from them and the best measured trial."""

    trials: tuple[Trial, ...]
    calibration: Calibration
    best: Trial
    tokens_per_step: int
    work_dir: str


def default_work_dir(output: str) -> str:
    """`PLAN.tune` next to the output plan file."""
    return str(Path(output).with_suffix("")) + ".tune"


def trial_job(job: JobConfig, steps: int) -> JobConfig:
    """The job a trial trains: no checkpoints (trials must not write into, or resume from, the user's
    `train.checkpoint.dir`), `steps` steps, the plan given by the trial's plan file."""
    return replace(job, train=replace(job.train, checkpoint=None, steps=steps), plan=None)


def candidates(job: JobConfig, options: TuneOptions) -> list[PlanEstimate]:
    """The plans to measure first, best predicted first, priced as they will run (emulated or not)."""
    if not options.emulate:
        found = search_top_plans(job, options.top_k, options=RUNTIME_LAYOUTS)
        return [e for e in found if e.feasible]
    pool = search_top_plans(job, options.top_k * EMULATED_POOL, options=RUNTIME_LAYOUTS)
    priced = [evaluate_plan(job, e.plan, emulate=True) for e in pool]
    return sorted((e for e in priced if e.feasible), key=lambda e: e.step_time_s)


def tune_job(job: JobConfig, options: TuneOptions) -> TuneResult:
    """Run the trials, calibrate, run the calibrated best if new; see the module docstring."""
    if options.steps < MIN_STEPS:
        raise UserError(f"--steps: at least {MIN_STEPS}: a trial's first 2 steps are its warm-up, not measured")
    if options.emulate:  # priced from this host's cached quick profile when the job names none (measure/host.py)
        job = emulation_job(job, cache_dir())
    work = Path(options.work_dir or default_work_dir(options.output))
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise UserError(f"{work}: the tune work directory already holds files (an earlier tune?); remove it or "
                        "pass --work-dir EMPTY_DIR")
    work.mkdir(parents=True, exist_ok=True)
    pool = candidates(job, options)
    if not pool:
        raise UserError("the planner found no plan that fits this cluster; `heteroflow plan` explains why")
    trials = [_run_trial(job, e, f"trial-{k + 1}", f"top {k + 1}", options, work)
              for k, e in enumerate(pool[: options.top_k])]
    measured = [t for t in trials if t.measured_s is not None]
    if not measured:
        raise TrainingFailed("no trial measured a step time:\n" + "\n".join(f"{t.name}: {t.error}" for t in trials))
    calibration = _calibrate(job, measured, work)
    best_plan = _calibrated_best(job, options, calibration, pool)
    if best_plan is not None and all(t.plan.to_dict() != best_plan.plan.to_dict() for t in trials):
        # measured but not calibrated from: the table shows how well the calibration predicted it
        trials.append(_run_trial(job, best_plan, f"trial-{len(trials) + 1}", "calibrated best", options, work))
    trials = [replace(t, calibrated_s=_estimate(job, t.plan, options, calibration).step_time_s) for t in trials]
    best = min((t for t in trials if t.measured_s is not None), key=lambda t: t.measured_s)
    tokens = job.train.global_batch_size * job.model.seq_length
    return TuneResult(trials=tuple(trials), calibration=calibration, best=best, tokens_per_step=tokens,
                      work_dir=str(work))


def _estimate(job: JobConfig, plan: PlanSpec, options: TuneOptions, calibration: Calibration) -> PlanEstimate:
    return evaluate_plan(job, plan, emulate=options.emulate, calibration=calibration)


def _run_trial(job: JobConfig, estimate: PlanEstimate, name: str, reason: str, options: TuneOptions,
               work: Path) -> Trial:
    """Train one plan for `options.steps` steps in the work directory; its median warm step time."""
    plan_path, metrics = work / f"{name}.yaml", work / f"{name}.jsonl"
    write_plan(estimate, plan_path)
    trial = Trial(name=name, plan=estimate.plan, reason=reason, predicted_s=estimate.step_time_s)
    print(f"heteroflow tune: {name} ({reason}): {describe_plan(estimate.plan)}; predicted "
          f"{estimate.step_time_s:.4g} s per step", flush=True)
    train = TrainOptions(plan_path=str(plan_path), emulate=options.emulate, steps=options.steps,
                         metrics_path=str(metrics), log_dir=str(work / f"logs-{name}"), timeout_s=options.timeout_s,
                         node=options.node, rdzv=options.rdzv, join_timeout_s=options.join_timeout_s)
    try:
        results = train_job(trial_job(job, options.steps), train)
    except (TrainingFailed, UserError) as failure:
        first = str(failure).strip().splitlines()[:1]
        print(f"heteroflow tune: {name} failed; the next plan goes on (logs: {work / f'logs-{name}'})",
              file=sys.stderr, flush=True)
        return replace(trial, error=first[0] if first else type(failure).__name__)
    stopped_by = max((r.stopped_by for r in results.values()), default=0)
    if stopped_by:  # SIGTERM / Ctrl-C: the trial ended early and tuning ends with it
        raise Stopped(f"stopped by {signal_name(stopped_by)} during trial {name}: tuning abandoned; the trials so "
                      f"far are in {work}", stopped_by)
    if not metrics.is_file():
        # a node without rank 0 of a multi-node run: rank 0's node writes the metrics (a shared work dir sees them)
        return replace(trial, error=f"no metrics file {metrics} on this node (rank 0 writes it; give every node "
                                    "the same --work-dir on shared storage)")
    runs, _ = load_runs(job, [str(metrics)])
    return replace(trial, measured_s=runs[0].measured_step_time_s)


def _calibrate(job: JobConfig, measured: list[Trial], work: Path) -> Calibration:
    """Fit the calibration to the measured trials' metrics files; also written to `calibration.yaml`."""
    runs, _ = load_runs(job, [str(work / f"{t.name}.jsonl") for t in measured])
    calibration = fit_calibration(runs).calibration
    path = work / "calibration.yaml"
    save_calibration(calibration, path)
    return replace(calibration, source=str(path))


def _calibrated_best(job: JobConfig, options: TuneOptions, calibration: Calibration,
                     pool: list[PlanEstimate]) -> PlanEstimate | None:
    """The best plan under the calibration: the planner's, searching again (real runs), or the best of the pool
    priced again (emulated: the search prices the real devices, which an emulated calibration does not
    describe)."""
    if options.emulate:
        priced = [_estimate(job, e.plan, options, calibration) for e in pool]
        return min(priced, key=lambda e: e.step_time_s, default=None)
    report = search_plan(job, options=RUNTIME_LAYOUTS, calibration=calibration)
    if report.estimate is None or not report.estimate.feasible:
        return None
    return report.estimate


def describe_plan(plan: PlanSpec) -> str:
    """One line: schedule, micro-batch size and every stage's devices, layers and layout."""
    stages = " | ".join(f"{'+'.join(s.devices)} L{s.layers} {s.layout.describe()}" for s in plan.stages)
    return f"{plan.schedule} mb{plan.micro_batch_size}: {stages}"


def format_table(result: TuneResult) -> str:
    """Per trial: why it ran, predicted, calibrated prediction, measured step time and tokens/s, the plan."""
    head = (f"{'trial':<9} {'why':<16} {'predicted s':>11} {'calibrated s':>12} {'measured s':>10} "
            f"{'tokens/s':>10} {'meas/cal':>8}  plan")
    lines = [head]
    for t in result.trials:
        mark = "*" if t is result.best else " "
        if t.measured_s is None:
            measured = f"{'failed':>10} {'':>10} {'':>8}"
        else:
            ratio = f"{t.measured_s / t.calibrated_s:8.3f}" if t.calibrated_s else f"{'':>8}"
            measured = f"{t.measured_s:10.4g} {result.tokens_per_step / t.measured_s:10.4g} {ratio}"
        calibrated = f"{t.calibrated_s:12.4g}" if t.calibrated_s is not None else f"{'':>12}"
        lines.append(f"{t.name + mark:<9} {t.reason:<16} {t.predicted_s:11.4g} {calibrated} {measured}  "
                     f"{describe_plan(t.plan)}")
        if t.error:
            lines.append(f"{'':<9} {t.error}")
    lines.append(f"* best measured; calibrated from {result.calibration.num_runs} "
                 f"run{'s' * (result.calibration.num_runs != 1)} ({result.calibration.source})")
    return "\n".join(lines)


def write_tuned_plan(job: JobConfig, result: TuneResult, options: TuneOptions) -> None:
    """The best measured plan, as `plan -o` writes it (predictions calibrated), plus `measured` and the table."""
    best = result.best
    assert best.measured_s is not None
    doc = plan_document(_estimate(job, best.plan, options, result.calibration))
    doc["plan"]["measured"] = {"step_time_s": float(f"{best.measured_s:.6g}"),
                               "tokens_per_s": float(f"{result.tokens_per_step / best.measured_s:.6g}"),
                               "emulate": options.emulate, "steps": options.steps}
    table = "\n".join(f"#   {line}" for line in format_table(result).splitlines())
    text = dump_yaml(doc, sort_keys=False, default_flow_style=None, width=120)
    Path(options.output).write_text(f"# written by `heteroflow tune` (work directory {result.work_dir}):\n{table}\n"
                                    + text, encoding="utf-8")


def tune_command(job: JobConfig, options: TuneOptions) -> int:
    """Tune, print the table, write the plan; 0, or 1 when no trial measured anything (the failures shown)."""
    try:
        result = tune_job(job, options)
    except TrainingFailed as failure:
        print(f"heteroflow tune: {failure}", file=sys.stderr)
        return 1
    except Stopped as stopped:  # a signal (the first one, or a second that killed a trial's workers)
        print(f"heteroflow tune: {stopped}", file=sys.stderr)
        return stopped.exit_status
    print(format_table(result))
    write_tuned_plan(job, result, options)
    load_plan_file(options.output, job)  # what we wrote must read back as a plan of this job
    print(f"wrote {options.output} (trials, metrics and calibration in {result.work_dir}{os.sep})", file=sys.stderr)
    return 0
