"""Measured runs for `heteroflow calibrate`: heteroflow metrics files and measurements files, checked against
the job.

A metrics file holds, per header record, one run: the header's job and plan say what ran, and the median
`step_time_s` of its steps after the warm-up (the first `WARMUP_STEPS` steps or the first `WARMUP_FRACTION`,
whichever is more) is the measurement. A measurements file (from any framework) is YAML:

    measurements:
      - {plan: plans/a.yaml, tokens_per_s: 1234.5}     # a plan file (relative to this file) or a plan mapping
      - {plan: plans/b.yaml, step_time_s: 3.2, emulate: false}

Every problem is a `UserError` (or `ConfigError`) that names the file and where in it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from heteroflow.config import JobConfig, PlanSpec, load_plan_file, parse_job
from heteroflow.config.plan import parse_plan
from heteroflow.config.reader import Problems, Section
from heteroflow.config.yamlfile import read_yaml
from heteroflow.errors import ConfigError, UserError
from heteroflow.runtime.metrics import HEADER_VERSION, WARMUP_FRACTION, WARMUP_STEPS, read_metrics, warmup_count

MIN_MEASURED_STEPS = 1
"""Steps left after the warm-up for a run to count."""
FIT_PARTS = ("compute_s", "collective_s", "dp_s", "optimizer_s")
"""The per-stage parts of a metrics run `calibrate --stage-parts` also fits (`compute_s`: forward and backward)."""
MIN_PART_S = 1e-3
"""Parts shorter than this are left out: timer noise, and nothing a factor could be fitted to."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One measured configuration: the job as it ran (the calibrating job's cluster and model, the run's train
    settings), its plan and its measured step time."""

    source: str
    """Where it came from: `FILE`, `FILE (run 2)` or `FILE: measurements[3]`."""
    job: JobConfig
    plan: PlanSpec
    emulate: bool
    measured_step_time_s: float
    num_steps: int = 0
    """Steps the median was taken over (0 for a measurements file)."""
    measured_parts: tuple[tuple[int, str, float], ...] = ()
    """(stage, part of `FIT_PARTS`, median seconds after the warm-up) of a metrics run with per-stage figures."""


def load_runs(job: JobConfig, paths: list[str]) -> tuple[list[Run], list[str]]:
    """Every run in `paths` (metrics or measurements files), checked against `job`; also the notes about
    what was left out (a resumed segment too short to measure)."""
    runs: list[Run] = []
    notes: list[str] = []
    for path in paths:
        if not Path(path).is_file():
            raise UserError(f"{path}: file not found" if not Path(path).exists() else f"{path}: not a regular file")
        if _is_jsonl(path):
            found, skipped = metrics_runs(job, path)
            runs += found
            notes += skipped
        else:
            runs += measurement_runs(job, path)
    if not runs:
        raise UserError("no measured runs: " + "; ".join(notes) if notes else "no measured runs given")
    return runs, notes


def _is_jsonl(path: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def warm_step_times(times: list[float]) -> list[float]:
    """The step times after the warm-up."""
    return times[warmup_count(len(times)):]


def metrics_runs(job: JobConfig, path: str) -> tuple[list[Run], list[str]]:
    """The runs of one metrics file (one per header record)."""
    try:
        segments = read_metrics(path)
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: {error}") from None
    runs, notes = [], []
    for k, (header, steps) in enumerate(segments):
        where = path if len(segments) == 1 else f"{path} (run {k + 1})"
        if header is None:
            raise UserError(f"{path}: step records without a header record (written before heteroflow recorded "
                            "the job and plan); train again with --metrics, or write a measurements file")
        run_job, plan, emulate = _header_run(job, header, where)
        times = []
        for record in steps:
            value = record.get("step_time_s")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise UserError(f"{where}: step {record.get('step', '?')}: step_time_s must be a positive finite "
                                f"number, got {value!r}")
            times.append(float(value))
        warm = warm_step_times(times)
        if len(warm) < MIN_MEASURED_STEPS:
            notes.append(f"{where}: {len(times)} steps, none left after the warm-up ({WARMUP_STEPS} steps or "
                         f"{WARMUP_FRACTION:.0%}); run at least {WARMUP_STEPS + MIN_MEASURED_STEPS} steps")
            continue
        runs.append(Run(source=where, job=run_job, plan=plan, emulate=emulate,
                        measured_step_time_s=statistics.median(warm), num_steps=len(warm),
                        measured_parts=measured_parts(steps[len(steps) - len(warm):], len(plan.stages))))
    return runs, notes


def part_seconds(figures: dict, part: str) -> float:
    """One of `FIT_PARTS` from a stage's figures (`{"forward_s": ..., ...}`, measured or predicted)."""
    if part == "compute_s":
        return figures["forward_s"] + figures["backward_s"]
    return figures[part]


def measured_parts(steps: list[dict], num_stages: int) -> tuple[tuple[int, str, float], ...]:
    """The medians of each stage's `FIT_PARTS` over `steps` (records without well-formed `stages` give none)."""
    try:
        medians = [(k, part, statistics.median(float(part_seconds(r["stages"][k]["measured"], part)) for r in steps))
                   for k in range(num_stages) for part in FIT_PARTS]
    except (KeyError, TypeError, IndexError, ValueError, statistics.StatisticsError):
        return ()
    return tuple((k, part, value) for k, part, value in medians if math.isfinite(value) and value >= MIN_PART_S)


def _header_run(job: JobConfig, header: object, where: str) -> tuple[JobConfig, PlanSpec, bool]:
    """The job (the calibrating job's cluster and model, the run's train settings), plan and emulate flag of
    a header record, after checking that the run used the job's model and device types."""
    if not isinstance(header, dict) or not {"job", "plan"} <= header.keys():
        raise UserError(f"{where}: header: expected a mapping with `job` and `plan`")
    version = header.get("version")
    if not isinstance(version, int) or version > HEADER_VERSION:
        raise UserError(f"{where}: header.version: {version!r} is not a header version this heteroflow reads "
                        f"(up to {HEADER_VERSION})")
    emulate = header.get("emulate", False)
    if not isinstance(emulate, bool):
        raise UserError(f"{where}: header.emulate: expected true or false, got {emulate!r}")
    try:
        ran = parse_job(header["job"], base_dir=job.base_dir, source=f"{where}: header.job")
    except ConfigError as error:
        raise UserError(f"{where}: header.job: " + "; ".join(str(p) for p in error.problems)) from None
    check_same_model_and_cluster(job, ran, where)
    run_job = replace(job, train=ran.train, plan=None)
    problems = Problems(where)
    plan = parse_plan(header["plan"], problems, cluster=job.cluster, model=job.model, train=ran.train,
                      path="header.plan")
    problems.raise_if_any()
    assert plan is not None
    return run_job, plan, emulate


def check_same_model_and_cluster(job: JobConfig, ran: JobConfig, where: str) -> None:
    """A run of another model, or on other device types, says nothing about this job's cost model."""
    if ran.model != job.model:
        mine, theirs = job.model.to_dict(), ran.model.to_dict()
        diff = [f"{k} {theirs.get(k)!r} (job: {mine.get(k)!r})" for k in sorted({*mine, *theirs})
                if mine.get(k) != theirs.get(k)]
        raise UserError(f"{where}: header.job.model: the run trained another model than the job: "
                        + ", ".join(diff[:5]))
    mine_types = {n.device: job.cluster.device_types[n.device] for n in job.cluster.nodes}
    their_types = {n.device: ran.cluster.device_types[n.device] for n in ran.cluster.nodes}
    if mine_types != their_types:
        names = sorted(their_types) if set(mine_types) != set(their_types) else \
            sorted(k for k in mine_types if mine_types[k] != their_types[k])
        raise UserError(f"{where}: header.job.cluster: the run's device types ({', '.join(sorted(their_types))}) "
                        f"are not the job's ({', '.join(sorted(mine_types))})"
                        + ("" if set(mine_types) != set(their_types) else f"; {', '.join(names)} differ"))


def measurement_runs(job: JobConfig, path: str) -> list[Run]:
    """The runs of one measurements file."""
    problems = Problems(path)
    sec = Section(read_yaml(path), "", problems)
    entries = sec.sequence("measurements")
    sec.finish()
    problems.raise_if_any()
    assert entries is not None
    if not entries:
        raise UserError(f"{path}: measurements: empty; list at least one {{plan: ..., step_time_s: ...}}")
    base = Path(path).resolve().parent
    tokens_per_step = job.train.global_batch_size * job.model.seq_length
    runs = []
    for i, raw in enumerate(entries):
        at = f"measurements[{i}]"
        entry = Section(raw, at, problems)
        raw_plan = entry.raw("plan")
        tokens = entry.number("tokens_per_s", None, positive=True)
        step = entry.number("step_time_s", None, positive=True)
        emulate = entry.boolean("emulate", False)
        given = [k for k in ("tokens_per_s", "step_time_s") if entry.has(k)]
        entry.finish()
        if len(given) != 1:
            problems.add(at, "give exactly one of tokens_per_s and step_time_s"
                         + (f" (both given)" if len(given) == 2 else ""))
        plan = _measured_plan(job, raw_plan, base, problems, f"{at}.plan", path)
        if plan is None or (tokens is None and step is None) or len(given) != 1:
            continue
        measured = step if step is not None else tokens_per_step / tokens
        runs.append(Run(source=f"{path}: {at}", job=replace(job, plan=None), plan=plan, emulate=bool(emulate),
                        measured_step_time_s=measured))
    problems.raise_if_any()
    return runs


def _measured_plan(job: JobConfig, raw: object, base: Path, problems: Problems, at: str,
                   path: str) -> PlanSpec | None:
    """A plan file (relative to the measurements file) or an inline plan mapping."""
    if isinstance(raw, str):
        plan_path = base / raw
        if not plan_path.is_file():
            problems.add(at, f"plan file {raw!r} not found (looked for {plan_path})")
            return None
        try:
            return load_plan_file(plan_path, job)
        except ConfigError as error:
            for p in error.problems:
                problems.add(f"{at} ({raw}): {p.path}" if p.path else at, p.message)
            return None
        except UserError as error:
            problems.add(at, str(error))
            return None
    if isinstance(raw, dict):
        return parse_plan(raw, problems, cluster=job.cluster, model=job.model, train=job.train, path=at)
    if raw is not None:
        problems.add(at, f"expected a plan file path or a plan mapping, got {type(raw).__name__}")
    return None
