"""`JobConfig`: cluster + model + train (+ an explicit plan), loaded strictly from the job YAML."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from heteroflow.config.cluster import ClusterSpec, parse_cluster
from heteroflow.config.model import ModelSpec, parse_model
from heteroflow.config.plan import PlanSpec, parse_plan
from heteroflow.config.reader import Problems, Section
from heteroflow.config.train import TrainSpec, parse_train
from heteroflow.config.yamlfile import read_yaml
from heteroflow.errors import ConfigError, Problem, UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """A validated job. `plan` is None for `plan: auto` (the planner chooses)."""

    cluster: ClusterSpec
    model: ModelSpec
    train: TrainSpec
    plan: PlanSpec | None = None
    base_dir: str = "."
    """Directory of the job file; relative paths inside the job are resolved against it."""

    def resolve_path(self, path: str) -> str:
        """`path` as written in the job, made absolute against the job file's directory."""
        return str(Path(self.base_dir, os.path.expanduser(path)).resolve())

    def with_plan(self, plan: PlanSpec | None) -> "JobConfig":
        """The same job under another plan."""
        return replace(self, plan=plan)

    def to_dict(self) -> dict:
        """Plain data in the job YAML schema."""
        return {"cluster": self.cluster.to_dict(), "model": self.model.to_dict(), "train": self.train.to_dict(),
                "plan": self.plan.to_dict() if self.plan is not None else "auto"}


def _read_cluster_file(path: Path) -> object:
    """`cluster: FILE.yaml` in a job: the file holds a top-level `cluster:` mapping."""
    data = read_yaml(path)
    if not isinstance(data, dict) or set(data) != {"cluster"}:
        raise UserError(f"{path}: a cluster file must hold exactly one top-level key, `cluster:`")
    return data["cluster"]


def parse_job(data: object, *, base_dir: str = ".", source: str | None = None) -> JobConfig:
    """Build a `JobConfig` from parsed YAML; raises `ConfigError` listing every problem."""
    problems = Problems(source)
    sec = Section(data, "", problems)
    raw_cluster, raw_model, raw_train = sec.raw("cluster"), sec.raw("model"), sec.raw("train")
    if isinstance(raw_cluster, str):
        raw_cluster = _read_cluster_file(Path(base_dir, raw_cluster))
    cluster = None if raw_cluster is None else parse_cluster(raw_cluster, problems)
    model = None if raw_model is None else parse_model(raw_model, problems)
    train = None if raw_train is None else parse_train(raw_train, problems)
    raw_plan = sec.raw("plan", "auto")
    sec.finish()
    plan = None
    if raw_plan != "auto":
        if isinstance(raw_plan, str):
            problems.add("plan", f"expected 'auto' or a plan mapping, got {raw_plan!r}")
        elif None not in (cluster, model, train):
            plan = parse_plan(raw_plan, problems, cluster=cluster, model=model, train=train)
        else:
            problems.add("plan", "not checked: fix the problems in cluster, model and train first")
    problems.raise_if_any()
    assert cluster is not None and model is not None and train is not None
    return JobConfig(cluster=cluster, model=model, train=train, plan=plan, base_dir=base_dir)


def load_job(path: str | os.PathLike) -> JobConfig:
    """Read and validate a job YAML file."""
    path = Path(path)
    return parse_job(read_yaml(path), base_dir=str(path.resolve().parent), source=str(path))


def load_plan_file(path: str | os.PathLike, job: JobConfig) -> PlanSpec:
    """Read a plan file (one top-level `plan:` mapping) and check it against `job`."""
    data = read_yaml(path)
    problems = Problems(str(path))
    sec = Section(data, "", problems)
    raw = sec.raw("plan")
    sec.finish()
    plan = None
    if raw is not None:
        plan = parse_plan(raw, problems, cluster=job.cluster, model=job.model, train=job.train)
    problems.raise_if_any()
    assert plan is not None
    return plan


def format_config_error(error: ConfigError) -> str:
    """One `path: message` line per problem, under a heading naming the file."""
    head = f"{error.source}: {len(error.problems)} problem{'s' * (len(error.problems) != 1)}" if error.source else ""
    lines = [str(p) for p in error.problems]
    return "\n".join([head, *lines] if head else lines)


__all__ = ["JobConfig", "Problem", "load_job", "load_plan_file", "parse_job", "read_yaml", "format_config_error"]
