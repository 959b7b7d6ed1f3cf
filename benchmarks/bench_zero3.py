"""Issue 15 benchmark: step time of heteroflow's ZeRO-3 (FSDP2 per block) vs DeepSpeed ZeRO-3, same model, data
and machine.

Both train the same Llama block stack (heteroflow's `StageModel`, the same seed-only initial weights) on the
same micro-batches (heteroflow's data order over the built-in corpus, each dp rank its share), fp32, AdamW with
decay on matrices, global-norm clipping, the same learning-rate schedule, `--dp` ranks over gloo on this CPU,
one torch thread per rank:

- heteroflow: `heteroflow.runtime.worker.run_worker` on a one-stage plan `{dp: N, zero: 3}`;
- DeepSpeed: ZeRO-3 (`DS_ACCELERATOR=cpu`, gloo), its prefetch bounded to a block like heteroflow's window,
  torch's AdamW handed to `deepspeed.initialize` (the update heteroflow runs too).

Each run is a set of fresh processes (one per rank); the runs alternate (heteroflow, DeepSpeed, DeepSpeed,
heteroflow, ...) so a change in the machine's load hits both. The first step of every run is warm-up and not
counted. Printed: every step time (rank 0), each side's median, the ratio heteroflow / DeepSpeed (goal <= 1.0),
and both loss curves (they should agree: same model, data and optimizer).

    python benchmarks/bench_zero3.py [--dp 2] [--layers 4] [--hidden 512] [--steps 4] [--rounds 2]
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
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def job_dict(a: argparse.Namespace) -> dict:
    """The job both sides train (heteroflow reads it; DeepSpeed takes its model, data and optimizer from it)."""
    return {
        "cluster": {"nodes": [{"name": "host", "device": "cpu", "count": a.dp}]},
        "model": {"num_layers": a.layers, "hidden_size": a.hidden, "ffn_hidden_size": a.ffn,
                  "num_attention_heads": a.heads, "num_kv_heads": a.kv_heads, "vocab_size": a.vocab,
                  "seq_length": a.seq},
        "train": {"global_batch_size": a.dp * a.micro_batches, "micro_batch_size": a.dp, "precision": "fp32",
                  "steps": a.steps, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, "weight_decay": 0.1,
                  "grad_clip": 1.0},
        "plan": {"micro_batch_size": a.dp, "stages": [{"devices": ["host"], "layers": a.layers, "dp": a.dp,
                                                       "zero": 3}]},
    }


def run_heteroflow(a: argparse.Namespace, work: Path) -> dict:
    """This rank's part of one heteroflow run; rank 0 returns step times and losses."""
    from heteroflow.config import parse_job
    from heteroflow.runtime.metrics import read_step_records
    from heteroflow.runtime.worker import WorkerArgs, run_worker

    job = parse_job(job_dict(a))
    metrics = work / "heteroflow-metrics.jsonl"
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=a.steps, data_dir=str(work / "data"),
                      metrics_path=str(metrics), show_progress=False, timeout_s=1800)
    result = run_worker(args)
    if int(os.environ["RANK"]) != 0:
        return {}
    records = read_step_records(metrics)
    return {"step_time_s": [r["step_time_s"] for r in records], "losses": list(result.losses)}


def run_deepspeed(a: argparse.Namespace, work: Path) -> dict:
    """This rank's part of one DeepSpeed ZeRO-3 run on heteroflow's model, data and schedule."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch
    import torch.distributed as dist

    from heteroflow.config import parse_job
    from heteroflow.data.builtin import open_train_data
    from heteroflow.data.tokens import SampleOrder, micro_batch_indices
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.runtime.lr import learning_rate

    job = parse_job(job_dict(a))
    spec, train = job.model, job.train
    torch.manual_seed(train.seed)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    init_weights(model, seed=train.seed)
    block_numel = sum(p.numel() for p in model.layers["0"].parameters())
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": a.micro_batches,
        "gradient_clipping": train.grad_clip, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": 3,
            # Like heteroflow's window: the block in use and the next one prefetched (DeepSpeed's defaults keep
            # up to 1e9 elements live, i.e. this whole model, which would not be ZeRO-3 any more).
            "stage3_max_live_parameters": 2 * block_numel, "stage3_max_reuse_distance": block_numel,
            "stage3_prefetch_bucket_size": block_numel, "stage3_param_persistence_threshold": 0,
        },
    }
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # torch's AdamW, handed over: DeepSpeed's own "AdamW" JIT-builds a fused kernel, and heteroflow runs torch's
    optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    data = open_train_data(job, work_dir=str(work / "data"))
    order = SampleOrder(num_samples=data.num_samples, global_batch_size=train.global_batch_size, seed=train.seed,
                        shuffle=True)
    global_tokens = train.global_batch_size * spec.seq_length
    times, losses = [], []
    for step in range(a.steps):
        started = time.perf_counter()
        for group in engine.optimizer.param_groups:
            group["lr"] = learning_rate(step, train)
        indices = order.global_batch(step)
        loss_sum = torch.zeros(())
        for m in range(a.micro_batches):
            tokens, labels = data.batch(micro_batch_indices(indices, micro_batch_size=a.dp, micro_batch=m,
                                                            dp=a.dp, dp_rank=rank))
            loss = engine(tokens, labels=labels)
            # DeepSpeed averages gradients over dp; heteroflow sums token losses over the global batch
            engine.backward(loss * a.dp / global_tokens, scale_wrt_gas=False)
            engine.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        times.append(time.perf_counter() - started)
        losses.append(float(loss_sum) / global_tokens)
    return {"step_time_s": times, "losses": losses} if rank == 0 else {}


def worker_main(kind: str, a: argparse.Namespace) -> None:
    work = Path(a.dir)
    result = run_heteroflow(a, work) if kind == "heteroflow" else run_deepspeed(a, work)
    if result:
        print("RESULT " + json.dumps(result), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind: str, a: argparse.Namespace, work: Path) -> dict:
    """Run one side on `a.dp` fresh processes; returns rank 0's result record."""
    run_dir = work / f"{kind}-{time.monotonic_ns()}"
    run_dir.mkdir()
    (run_dir / "data").symlink_to(work / "data", target_is_directory=True)
    cmd = [sys.executable, __file__, "--worker", kind, "--dir", str(run_dir)] + a.passthrough
    port = _free_port()
    procs, logs = [], []
    for rank in range(a.dp):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(a.dp), "LOCAL_WORLD_SIZE": str(a.dp)}
        logs.append(run_dir / f"rank{rank}.log")  # files, not pipes: a full pipe would stall a rank in a collective
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
    shutil.rmtree(run_dir, ignore_errors=True)
    return json.loads(lines[-1][len("RESULT "):])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="ranks (one ZeRO-3 stage over all of them)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches of one sequence per rank and step")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--dir", default=None, help="scratch directory (default: the system temp directory)")
    p.add_argument("--worker", choices=("heteroflow", "deepspeed"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.passthrough = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                     ("dp", "layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq", "micro_batches", "steps")]
    return a


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    if a.worker:
        worker_main(a.worker, a)
        return
    from heteroflow.config import parse_job

    work = Path(tempfile.mkdtemp(prefix="bench-zero3-", dir=a.dir))
    (work / "data").mkdir()
    spec = parse_job(job_dict(a)).model
    n = spec.num_params()
    load = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} load average: {load[0]:.2f}, {load[1]:.2f}, "
          f"{load[2]:.2f} ; {os.cpu_count()} cores, shared machine")
    print(f"$ python benchmarks/bench_zero3.py {' '.join(argv)}".rstrip())
    print(f"model: {spec.num_layers} Llama blocks, hidden {spec.hidden_size}, ffn {spec.ffn_hidden_size}, heads "
          f"{spec.num_attention_heads}/{spec.num_kv_heads} kv, vocab {spec.vocab_size}: {n / 1e6:.1f} M params, "
          f"ZeRO-3 over {a.dp} gloo ranks (1 thread each)")
    print(f"step: {a.micro_batches} micro-batches x 1 x {spec.seq_length} tokens per rank, fp32, {a.steps} steps per "
          f"run (first = warm-up), {a.rounds} alternating runs per side")
    times: dict[str, list[float]] = {"heteroflow": [], "deepspeed": []}
    losses: dict[str, list[float]] = {}
    started = time.time()
    try:
        for r in range(a.rounds):
            for kind in (("heteroflow", "deepspeed") if r % 2 == 0 else ("deepspeed", "heteroflow")):
                result = launch(kind, a, work)
                times[kind] += result["step_time_s"][1:]
                losses.setdefault(kind, result["losses"])
                print(f"round {r + 1} {kind:10s} step s: {' '.join(f'{t:6.2f}' for t in result['step_time_s'])}",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"losses heteroflow: {' '.join(f'{x:.6f}' for x in losses['heteroflow'])}")
    print(f"losses deepspeed:  {' '.join(f'{x:.6f}' for x in losses['deepspeed'])}")
    print(f"median step time (warm-up steps excluded): heteroflow {med['heteroflow']:.3f} s, "
          f"DeepSpeed ZeRO-3 {med['deepspeed']:.3f} s")
    ratio = med["heteroflow"] / med["deepspeed"]
    print(f"ratio heteroflow / DeepSpeed: {ratio:.2f}x (goal <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'})")
    load = os.getloadavg()
    print(f"total time {time.time() - started:.0f} s; load average at the end: {load[0]:.2f}, {load[1]:.2f}, "
          f"{load[2]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
