"""Megatron-LM's functional-test configurations (`tests/functional_tests/test_cases/<area>/<case>/
model_config.yaml`): a `MODEL_ARGS:` mapping of flags to values, run by its test harness with the
node and GPU counts on the command line (`MODEL_ENV_VARS` may give GPUS_PER_NODE).

The harness writes `--flag: true` as the bare flag, leaves out `--flag: false`, and passes any other
value as the flag's words; `${VAR}` values come from the harness's environment (`--env` here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from heteroflow.errors import UserError
from heteroflow.megatron.shell import Field

_AREA_PROGRAMS = {
    "gpt": "pretrain_gpt.py", "gpt-nemo": "pretrain_gpt.py", "moe": "pretrain_gpt.py", "mixtral": "pretrain_gpt.py",
    "nemotron": "pretrain_gpt.py", "bert": "pretrain_bert.py", "t5": "pretrain_t5.py",
    "hybrid": "pretrain_hybrid.py", "multimodal-llava": "pretrain_vlm.py", "mimo": "examples/mimo/train.py",
}
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What a functional-test configuration launches."""

    program: str
    """The entry point its area runs (`gpt/` cases run pretrain_gpt.py)."""
    argv: tuple[Field, ...]
    nproc_per_node: int | None
    blockers: tuple[str, ...]
    """Why it is not a training run heteroflow imports (inference or RL mode)."""


def is_model_config(path: Path, data: object) -> bool:
    """Whether `data` is a functional-test configuration (a `MODEL_ARGS:` mapping of flags)."""
    if not isinstance(data, dict) or "MODEL_ARGS" not in data:
        return False
    return data["MODEL_ARGS"] is None or isinstance(data["MODEL_ARGS"], dict)


def _words(value: object, env: dict[str, str]) -> list[Field]:
    text = str(value)
    out = []
    for word in text.split():
        names = _VARIABLE.findall(word)
        if names and not all(n in env for n in names):
            out.append(Field.unknown(word))
        else:
            out.append(Field(_VARIABLE.sub(lambda m: env[m.group(1)], word)))
    return out


def _program(path: Path) -> str:
    parts = path.resolve().parts
    if "test_cases" in parts:
        k = parts.index("test_cases")
        if k + 1 < len(parts) - 1:
            return _AREA_PROGRAMS.get(parts[k + 1], "pretrain_gpt.py")
    return "pretrain_gpt.py"


def read_model_config(path: Path, data: dict, env: dict[str, str]) -> ModelConfig:
    """The launch a functional-test configuration describes."""
    if not data["MODEL_ARGS"]:
        raise UserError(f"{path}: MODEL_ARGS is empty: this test case runs its own script (a checkpoint converter, "
                        "a unit of the harness), not a Megatron training launch")
    other = [k for k in data["MODEL_ARGS"] if not (isinstance(k, str) and k.startswith("-"))]
    if other:
        raise UserError(f"{path}: MODEL_ARGS holds {other[0]!r}, not Megatron flags: the test case runs NeMo 2.0 "
                        "recipe overrides (trainer.*, model.config.*), not a Megatron-LM launch")
    argv: list[Field] = []
    for key, value in data["MODEL_ARGS"].items():
        if value is True:
            argv.append(Field(key))
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, dict)):
            raise UserError(f"{path}: MODEL_ARGS.{key}: expected a value or true/false, got a "
                            f"{'list' if isinstance(value, list) else 'mapping'}")
        else:
            argv.append(Field(key))
            argv.extend(_words(value, env))
    blockers = []
    mode = str(data.get("MODE", "pretraining")).strip().lower()
    if mode == "inference":
        blockers.append("inference: MODE: inference runs text generation, not a training run")
    elif mode == "rl":
        blockers.append("reinforcement learning (GRPO): MODE: rl trains with generated rollouts and rewards, "
                        "not language-model pretraining")
    nproc = None
    per_model = data.get("MODEL_ENV_VARS")
    if isinstance(per_model, dict) and isinstance(per_model.get("MODEL_ARGS"), dict):
        gpus = per_model["MODEL_ARGS"].get("GPUS_PER_NODE")
        nproc = gpus if isinstance(gpus, int) and gpus > 0 else None
    return ModelConfig(_program(path), tuple(argv), nproc, tuple(blockers))
