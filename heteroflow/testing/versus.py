"""Benchmarks of heteroflow against another framework on the same model, data and machine: the scaffolding that
`benchmarks/bench_zero3.py` and `benchmarks/bench_offload_vs_deepspeed.py` share.

A benchmark script parses its arguments with `model_args` (model shape, step, rounds, the hidden `--worker`),
and re-executes itself once per side and run (`launch`): fresh processes, one per rank, each with its rank's
environment and a log file (never a pipe, which could stall a rank inside a collective); rank 0 prints one
`RESULT {json}` line (`report`). `alternate` runs the sides in alternating order round after round, so a
change in the machine's load hits both; `header` and `medians` print what every result file starts and ends
with (the load average: the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

MODEL_KEYS = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq", "micro_batches", "steps")
"""The arguments every worker gets again (`passthrough`)."""


QUICK = ("--layers", "1", "--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
         "--seq", "32", "--steps", "2", "--rounds", "1")
"""What `--quick` means: the tiny sizes a test runs so that a refactor cannot break a benchmark unnoticed."""


def model_args(description: str, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
               extra: Callable[[argparse.ArgumentParser], None] | None = None,
               passthrough: tuple[str, ...] = ()) -> Callable[[list[str]], argparse.Namespace]:
    """A parser of the model shape, step and rounds arguments (with these defaults) plus `extra`'s; the parsed
    namespace's `passthrough` lists what a worker needs again (`MODEL_KEYS` and the `passthrough` keys)."""

    def parse(argv: list[str]) -> argparse.Namespace:
        p = argparse.ArgumentParser(description=description)
        p.add_argument("--layers", type=int, default=layers)
        p.add_argument("--hidden", type=int, default=hidden)
        p.add_argument("--ffn", type=int, default=ffn)
        p.add_argument("--heads", type=int, default=heads)
        p.add_argument("--kv-heads", type=int, default=kv_heads)
        p.add_argument("--vocab", type=int, default=512)
        p.add_argument("--seq", type=int, default=256)
        p.add_argument("--micro-batches", type=int, default=2, help="micro-batches of one sequence per rank and step")
        p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
        p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
        p.add_argument("--dir", default=None, help="scratch directory (default: the system temp directory)")
        p.add_argument("--worker", help=argparse.SUPPRESS)
        p.add_argument("--quick", action="store_true", help="tiny model, 2 steps, one run per side (what the test "
                       "suite runs; later arguments still override it)")
        if extra is not None:
            extra(p)
        a = p.parse_args(argv)
        if a.quick:
            a = p.parse_args([*QUICK, *argv])
        a.passthrough = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in (*MODEL_KEYS, *passthrough)]
        return a

    return parse


def model_dict(a: argparse.Namespace) -> dict:
    """The job's `model:` section from the parsed arguments."""
    return {"num_layers": a.layers, "hidden_size": a.hidden, "ffn_hidden_size": a.ffn, "num_attention_heads": a.heads,
            "num_kv_heads": a.kv_heads, "vocab_size": a.vocab, "seq_length": a.seq}


def free_port() -> int:
    """A TCP port free right now on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(result: dict) -> None:
    """A worker's result, the line `launch` reads back (rank 0 only)."""
    print("RESULT " + json.dumps(result), flush=True)


def launch(script: str, kind: str, a: argparse.Namespace, work: Path, *, ranks: int, threads: int = 1,
           inspect: Callable[[Path, str], dict] | None = None) -> dict:
    """Run side `kind` of `script` on `ranks` fresh processes (`threads` torch threads each) in a scratch directory
    under `work` that sees `work/data`; returns rank 0's result, plus what `inspect(run_dir, rank 0's output)`
    adds before the directory goes."""
    run_dir = work / f"{kind}-{time.monotonic_ns()}"
    run_dir.mkdir()
    (run_dir / "data").symlink_to(work / "data", target_is_directory=True)
    cmd = [sys.executable, script, "--worker", kind, "--dir", str(run_dir)] + a.passthrough
    port = free_port()
    procs, logs = [], []
    for rank in range(ranks):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}
        logs.append(run_dir / f"rank{rank}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env))
    for proc in procs:
        proc.wait(timeout=3600)
    outputs = [log.read_text() for log in logs]
    lines = [line for line in outputs[0].splitlines() if line.startswith("RESULT ")]
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed or not lines:
        rank = failed[0] if failed else 0
        raise SystemExit(f"{kind} rank {rank} failed:\n{outputs[rank][-6000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if inspect is not None:
        result.update(inspect(run_dir, outputs[0]))
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def alternate(kinds: tuple[str, str], rounds: int, run: Callable[[str], dict],
              show: Callable[[int, str, dict], str]) -> dict[str, list[dict]]:
    """`run(kind)` for both sides, `rounds` times, in alternating order; prints `show(round, kind, result)` after
    each run. Returns every side's results in run order."""
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            result = run(kind)
            results[kind].append(result)
            print(show(r, kind, result), flush=True)
    return results


def header(script: str, argv: list[str]) -> None:
    """The first lines of a result file: time, load average, cores, the command."""
    load = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} load average: {load[0]:.2f}, {load[1]:.2f}, "
          f"{load[2]:.2f} ; {os.cpu_count()} cores, shared machine")
    print(f"$ python {script} {' '.join(argv)}".rstrip())


def medians(results: dict[str, list[dict]], key: str, *, skip_first: bool) -> dict[str, float]:
    """Per side, the median of `key` over every run's steps (without each run's first, warm-up, step)."""
    return {kind: statistics.median(v for r in runs for v in (r[key][1:] if skip_first else r[key]))
            for kind, runs in results.items()}


def footer(started: float) -> None:
    """The last line of a result file: total time and the load average at the end."""
    load = os.getloadavg()
    print(f"total time {time.time() - started:.0f} s; load average at the end: {load[0]:.2f}, {load[1]:.2f}, "
          f"{load[2]:.2f}")
