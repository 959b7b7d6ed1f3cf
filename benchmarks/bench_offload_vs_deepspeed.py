"""Issue benchmark 2: step time of heteroflow's SSD tier vs DeepSpeed ZeRO-3 with NVMe offload, same model and machine.

Both train the same Llama block stack (heteroflow's `StageModel`, the same seed-only initial weights) on
the same micro-batches (heteroflow's data order over the built-in corpus), fp32, AdamW with decay on
matrices, global-norm clipping, the same learning-rate schedule, one rank, the same torch thread count:

- heteroflow: `heteroflow.runtime.worker.run_worker` on a one-stage plan with
  `offload: {optimizer: ssd, params: ssd}` (swap files under `--dir`);
- DeepSpeed: ZeRO-3 with `offload_param: {device: nvme, max_in_cpu: 0}` (without `max_in_cpu: 0` DeepSpeed
  keeps up to 1e9 parameter elements in CPU memory, i.e. this whole model) and
  `offload_optimizer: {device: nvme}`, `DS_ACCELERATOR=cpu`, gloo, DeepSpeedCPUAdam, its async_io op.

Each run is a fresh process; the runs alternate (heteroflow, DeepSpeed, heteroflow, ...) so a change in
the machine's load hits both. The first step of every run is warm-up and not counted. Printed: every
step time, each side's median, the ratio heteroflow / DeepSpeed (goal <= 1.0), and both loss curves
(they should agree: same model, data and optimizer).

On this CPU-only machine "device" memory is host memory for both. Differences that remain: heteroflow
keeps the embedding, final norm and head on the device (only the blocks go to SSD; here they are
< 1.5% of the parameters), DeepSpeed swaps every parameter of >= 1 MiB (its aio block size) to NVMe.

    python benchmarks/bench_offload_vs_deepspeed.py [--layers 8] [--hidden 1024] [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def job_dict(a: argparse.Namespace, swap_dir: str) -> dict:
    """The job both sides train (heteroflow reads it; DeepSpeed takes its model, data and optimizer from it)."""
    return {
        "cluster": {"nodes": [{"name": "host", "device": "cpu", "count": 1}]},
        "model": {"num_layers": a.layers, "hidden_size": a.hidden, "ffn_hidden_size": a.ffn,
                  "num_attention_heads": a.heads, "num_kv_heads": a.kv_heads, "vocab_size": a.vocab,
                  "seq_length": a.seq},
        "train": {"global_batch_size": a.micro_batches, "micro_batch_size": 1, "precision": "fp32",
                  "steps": a.steps, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, "weight_decay": 0.1,
                  "grad_clip": 1.0, "offload_dir": swap_dir},
        "plan": {"micro_batch_size": 1, "stages": [
            {"devices": ["host"], "layers": a.layers, "offload": {"optimizer": "ssd", "params": "ssd"}}]},
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank_world() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")


def run_heteroflow(a: argparse.Namespace, work: Path) -> dict:
    """One heteroflow run in this process; returns step times, losses and which I/O / Adam paths ran."""
    import logging

    from heteroflow.config import parse_job
    from heteroflow.runtime.worker import WorkerArgs, run_worker

    from heteroflow.runtime.metrics import MetricsWriter, read_step_records

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _one_rank_world()
    cpu_marks = []  # process CPU seconds (all threads) when each step's record is written

    def write_and_mark(self, record, write=MetricsWriter.write):
        cpu_marks.append(time.process_time())
        write(self, record)

    MetricsWriter.write = write_and_mark
    job = parse_job(job_dict(a, str(work / "swap")))
    metrics = work / "heteroflow-metrics.jsonl"
    args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=a.steps, data_dir=str(work / "data"),
                      metrics_path=str(metrics), show_progress=False, timeout_s=1800)
    result = run_worker(args)
    records = read_step_records(metrics)
    return {"step_time_s": [r["step_time_s"] for r in records], "losses": list(result.losses),
            "cpu_s": [b - a for a, b in zip(cpu_marks, cpu_marks[1:])],
            "which": result.offload["which"], "peak_device_bytes": result.offload["peak_bytes"]}


def run_deepspeed(a: argparse.Namespace, work: Path) -> dict:
    """One DeepSpeed ZeRO-3 NVMe run in this process, on heteroflow's model, data and schedule."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    _one_rank_world()
    import deepspeed
    import torch

    from heteroflow.config import parse_job
    from heteroflow.data.builtin import open_train_data
    from heteroflow.data.tokens import SampleOrder, micro_batch_indices
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.runtime.lr import learning_rate

    job = parse_job(job_dict(a, str(work / "swap")))
    spec, train = job.model, job.train
    torch.manual_seed(train.seed)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    init_weights(model, seed=train.seed)
    nvme = work / "ds-nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    largest = max(p.numel() for p in model.parameters())
    per_block = len(list(model.layers["0"].parameters()))
    block_numel = sum(p.numel() for p in model.layers["0"].parameters())
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": a.micro_batches,
        "gradient_clipping": train.grad_clip, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": train.lr, "betas": [train.adam_beta1, train.adam_beta2],
                                                  "eps": train.adam_eps, "weight_decay": train.weight_decay}},
        "zero_optimization": {
            "stage": 3,
            # DeepSpeed's defaults keep up to 1e9 parameter elements live (the whole model here), and each
            # live NVMe parameter holds one swap buffer: bound both like heteroflow, which holds the
            # block in use and prefetches the next.
            "stage3_max_live_parameters": 2 * block_numel, "stage3_max_reuse_distance": block_numel,
            "stage3_prefetch_bucket_size": block_numel,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False,
                              # Its default of 5 buffers fails ("Not enough buffers 0 for swapping 1"): one
                              # per live or prefetched parameter is needed, room for 4 blocks here.
                              "buffer_count": 4 * per_block, "buffer_size": largest, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
    }
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    data = open_train_data(job, work_dir=str(work / "data"))
    order = SampleOrder(num_samples=data.num_samples, global_batch_size=train.global_batch_size, seed=train.seed,
                        shuffle=True)
    global_tokens = train.global_batch_size * spec.seq_length
    times, losses, cpu = [], [], []
    for step in range(a.steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        for group in engine.optimizer.param_groups:
            group["lr"] = learning_rate(step, train)
        indices = order.global_batch(step)
        loss_sum = 0.0
        for m in range(a.micro_batches):
            tokens, labels = data.batch(micro_batch_indices(indices, micro_batch_size=1, micro_batch=m, dp=1,
                                                            dp_rank=0))
            loss = engine(tokens, labels=labels)
            engine.backward(loss / global_tokens, scale_wrt_gas=False)
            engine.step()
            loss_sum += float(loss.detach())
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
        losses.append(loss_sum / global_tokens)
    swapped = sum(1 for p in model.parameters() if str(getattr(p.ds_tensor, "final_location", "")).endswith("nvme"))
    return {"step_time_s": times, "losses": losses, "cpu_s": cpu[1:],
            "params_on_nvme": f"{swapped}/{len(list(model.parameters()))}",
            "optimizer": type(engine.optimizer.optimizer).__name__}


def worker_main(kind: str, a: argparse.Namespace) -> None:
    work = Path(a.dir)
    result = run_heteroflow(a, work) if kind == "heteroflow" else run_deepspeed(a, work)
    print("RESULT " + json.dumps(result), flush=True)


def launch(kind: str, a: argparse.Namespace, work: Path) -> dict:
    """Run one side in a fresh process; returns its result record."""
    run_dir = work / f"{kind}-{time.monotonic_ns()}"
    run_dir.mkdir()
    (run_dir / "data").symlink_to(work / "data", target_is_directory=True)
    cmd = [sys.executable, __file__, "--worker", kind, "--dir", str(run_dir)] + a.passthrough
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    notes = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("offload ")]
    result = json.loads(lines[-1][len("RESULT "):])
    result["notes"] = sorted(set(notes))
    leftovers = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix == ".swp" and "ds-nvme" not in str(p)]
    result["heteroflow_swap_left"] = len(leftovers)
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches of one sequence per step")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch / OpenMP threads for both")
    p.add_argument("--dir", default=None, help="swap / NVMe directory (default: the system temp directory)")
    p.add_argument("--worker", choices=("heteroflow", "deepspeed"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.passthrough = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                     ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq", "micro_batches", "steps")]
    return a


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    if a.worker:
        worker_main(a.worker, a)
        return
    from heteroflow.config import parse_job

    work = Path(tempfile.mkdtemp(prefix="bench-offload-ds-", dir=a.dir))
    (work / "data").mkdir()
    spec = parse_job(job_dict(a, str(work))).model
    n = spec.num_params()
    load = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} load average: {load[0]:.2f}, {load[1]:.2f}, "
          f"{load[2]:.2f} ; {os.cpu_count()} cores, shared machine")
    print(f"$ python benchmarks/bench_offload_vs_deepspeed.py {' '.join(argv)}".rstrip())
    print(f"model: {spec.num_layers} Llama blocks, hidden {spec.hidden_size}, ffn {spec.ffn_hidden_size}, heads "
          f"{spec.num_attention_heads}/{spec.num_kv_heads} kv, vocab {spec.vocab_size}: {n / 1e6:.1f} M params "
          f"({4 * n / 2**30:.2f} GiB fp32 weights, {12 * n / 2**30:.2f} GiB fp32 master + moments on SSD)")
    print(f"step: {a.micro_batches} micro-batches x 1 x {spec.seq_length} tokens, fp32, {a.steps} steps per run "
          f"(first = warm-up), {a.rounds} alternating runs per side, {a.threads} threads, disk {work}")
    times: dict[str, list[float]] = {"heteroflow": [], "deepspeed": []}
    cpu: dict[str, list[float]] = {"heteroflow": [], "deepspeed": []}
    losses: dict[str, list[float]] = {}
    started = time.time()
    try:
        for r in range(a.rounds):
            order = ("heteroflow", "deepspeed") if r % 2 == 0 else ("deepspeed", "heteroflow")
            for kind in order:
                result = launch(kind, a, work)
                steps = result["step_time_s"]
                times[kind] += steps[1:]
                cpu[kind] += result["cpu_s"]
                losses.setdefault(kind, result["losses"])
                extra = (f"paths {result['which']}, device peak {result['peak_device_bytes'] / 2**20:.1f} MiB, swap "
                         f"files left {result['heteroflow_swap_left']}" if kind == "heteroflow" else
                         f"{result['optimizer']}, params on NVMe {result['params_on_nvme']}")
                print(f"round {r + 1} {kind:10s} step s: {' '.join(f'{t:6.2f}' for t in steps)}  CPU s: "
                      f"{' '.join(f'{t:6.2f}' for t in result['cpu_s'])}  ({extra})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"losses heteroflow: {' '.join(f'{x:.6f}' for x in losses['heteroflow'])}")
    print(f"losses deepspeed:  {' '.join(f'{x:.6f}' for x in losses['deepspeed'])}")
    print(f"median step time (warm-up steps excluded): heteroflow {med['heteroflow']:.2f} s, "
          f"DeepSpeed ZeRO-3 NVMe {med['deepspeed']:.2f} s")
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"median CPU seconds per step (all threads; less sensitive to the machine's load): heteroflow "
          f"{med_cpu['heteroflow']:.2f}, DeepSpeed {med_cpu['deepspeed']:.2f} ({med_cpu['heteroflow'] / med_cpu['deepspeed']:.2f}x)")
    ratio = med["heteroflow"] / med["deepspeed"]
    print(f"ratio heteroflow / DeepSpeed: {ratio:.2f}x (goal <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'})")
    load = os.getloadavg()
    print(f"total time {time.time() - started:.0f} s; load average at the end: {load[0]:.2f}, {load[1]:.2f}, "
          f"{load[2]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
