"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Emulated runs under test are priced from the defaults, never from a host profile measured into the real home
# (`heteroflow/measure/host.py`; tests/measure/test_host_profile.py turns it on with a temporary cache).
os.environ.setdefault("HETEROFLOW_HOST_PROFILE", "off")


def problems(data: dict) -> list[str]:
    """The `path: message` lines the strict loader reports for job `data`, or [] when it is valid."""
    from heteroflow.config import parse_job
    from heteroflow.errors import ConfigError

    try:
        parse_job(data)
    except ConfigError as error:
        return [str(p) for p in error.problems]
    return []


@pytest.fixture
def write_yaml(tmp_path):
    """Write dedented YAML text to a file in tmp_path and return its path."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


def save_tiny_mixtral(path: Path, *, num_experts: int):
    """A random tiny Mixtral (hidden 64, 4 layers, experts of 96, top 2) saved by transformers as safetensors, its
    routers drawn sharp (transformers' start near uniform); returns the model (fp32, eval)."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(11)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        num_local_experts=num_experts, num_experts_per_tok=2, tie_word_embeddings=False)
    hf = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    return hf.float().eval()


def run_heteroflow(*args: str, env: dict | None = None, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`python -m heteroflow ARGS` from the repository root, output captured."""
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env=env)


@pytest.fixture
def cache_env(tmp_path) -> dict:
    """The environment with heteroflow's cache in this test's directory."""
    return {**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")}
