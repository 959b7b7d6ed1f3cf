"""Shared pieces of the offload tests: the engine fixtures, the swap directory (blocks: heteroflow.testing.blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.offload.aio import ENGINE_ENV, deepspeed_aio_module
from heteroflow.offload.optimizer import ADAM_ENV, deepspeed_cpu_adam_module
from heteroflow.offload.swap import SwapDir
from heteroflow.testing.blocks import block_bytes, make_blocks  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[2]


def _use(kind: str, monkeypatch, *, env: str, load_deepspeed) -> str:
    """Set `env` to `kind`; `deepspeed` is skipped, with the reason, if `load_deepspeed` cannot load its op."""
    if kind == "deepspeed":
        module, reason = load_deepspeed()
        if module is None:
            pytest.skip(reason)
    monkeypatch.setenv(env, kind)
    return kind


def use_aio(kind: str, monkeypatch) -> str:
    """Make stores open engine `kind` (threads or deepspeed)."""
    return _use(kind, monkeypatch, env=ENGINE_ENV, load_deepspeed=deepspeed_aio_module)


def use_adam(kind: str, monkeypatch) -> str:
    """Make StreamedAdamW use `kind` (torch or deepspeed)."""
    return _use(kind, monkeypatch, env=ADAM_ENV, load_deepspeed=deepspeed_cpu_adam_module)


@pytest.fixture(params=["threads", "deepspeed"])
def aio_kind(request, monkeypatch):
    """Run the test with each SSD engine."""
    return use_aio(request.param, monkeypatch)


@pytest.fixture
def swap(tmp_path):
    """A swap directory under the test's tmp_path (a real disk here: O_DIRECT works)."""
    with SwapDir(tmp_path / "swap", headroom_bytes=0) as swap_dir:
        yield swap_dir
