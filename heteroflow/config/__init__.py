"""Typed, immutable job configuration loaded strictly from YAML (no torch needed)."""

from heteroflow.config.cluster import ClusterSpec, DeviceRef, NodeSpec, parse_cluster
from heteroflow.config.device import PRECISIONS, VENDORS, DeviceSpec
from heteroflow.config.job import JobConfig, load_job, load_plan_file, parse_job, read_yaml
from heteroflow.config.model import PRESETS, ModelSpec, parse_model
from heteroflow.config.plan import PlanSpec, StageSpec, parse_plan
from heteroflow.config.train import CheckpointSpec, DataSpec, TrainSpec, parse_train

__all__ = [
    "CheckpointSpec", "ClusterSpec", "DataSpec", "DeviceRef", "DeviceSpec", "JobConfig", "ModelSpec", "NodeSpec",
    "PlanSpec", "PRECISIONS", "PRESETS", "StageSpec", "TrainSpec", "VENDORS", "load_job",
    "load_plan_file", "parse_cluster", "parse_job", "parse_model", "parse_plan", "parse_train", "read_yaml",
]
