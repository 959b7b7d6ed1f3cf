"""Helpers shared by the Megatron import tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from heteroflow.megatron import ImportOptions, import_megatron

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FIXTURE_MIXTRAL = (Path(__file__).resolve().parent / "fixtures" / "megatron-lm" / "examples" / "mixtral"
                   / "train_mixtral_8x7b_distributed.sh")
"""Megatron-LM's own Mixtral example, unchanged (fixtures/README.md)."""

# A small dense decoder that satisfies every Megatron rule at tp <= 8, pp <= 4.
BASE_ARGS = ("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
             "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 32 --train-iters 100 "
             "--lr 3e-4 --tokenizer-type NullTokenizer --vocab-size 32000 --bf16")


def launch_script(args: str, *, nodes: int = 1, gpus: int = 8, base: str = BASE_ARGS) -> str:
    """A launch script with Megatron arguments `args` after the base model arguments."""
    return textwrap.dedent(f"""\
        #!/bin/bash
        torchrun --nproc_per_node {gpus} --nnodes {nodes} pretrain_gpt.py \\
            {base} \\
            {args}
        """)


def import_args(tmp_path: Path, args: str, *, nodes: int = 1, gpus: int = 8, base: str = BASE_ARGS, **options):
    """Import a generated launch script; `options` are `ImportOptions` fields (device type defaults to cpu)."""
    path = tmp_path / "train.sh"
    path.write_text(launch_script(args, nodes=nodes, gpus=gpus, base=base))
    options.setdefault("device_type", "cpu")
    return import_megatron(path, ImportOptions(**options))


def entry(result, key: str):
    """The report entry for `key` (the last one when the key appears more than once)."""
    found = [e for e in result.report.entries if e.key == key]
    assert found, f"no report entry for {key}: {[e.key for e in result.report.entries]}"
    return found[-1]


def heteroflow(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
               timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess, as a user would (`env` adds variables to a clean environment)."""
    return subprocess.run([sys.executable, "-m", "heteroflow", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=cwd, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                           **(env or {})})
