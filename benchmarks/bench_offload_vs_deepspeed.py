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
    python benchmarks/bench_offload_vs_deepspeed.py --quick     # tiny sizes, one run per side (a test runs it)

DeepSpeed's NVMe offload needs libaio's headers (`apt install libaio-dev`); without them the benchmark runs
heteroflow's side, says what to install and exits 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from heteroflow.testing.versus import (alternate, footer, header, launch, medians, model_args, model_dict,  # noqa: E402
                                       report)


def job_dict(a: argparse.Namespace, swap_dir: str) -> dict:
    """The job both sides train (heteroflow reads it; DeepSpeed takes its model, data and optimizer from it)."""
    return {
        "cluster": {"nodes": [{"name": "host", "device": "cpu", "count": 1}]},
        "model": model_dict(a),
        "train": {"global_batch_size": a.micro_batches, "micro_batch_size": 1, "precision": "fp32",
                  "steps": a.steps, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, "weight_decay": 0.1,
                  "grad_clip": 1.0, "offload_dir": swap_dir},
        "plan": {"micro_batch_size": 1, "stages": [
            {"devices": ["host"], "layers": a.layers, "offload": {"optimizer": "ssd", "params": "ssd"}}]},
    }


def run_heteroflow(a: argparse.Namespace, work: Path) -> dict:
    """One heteroflow run in this process; returns step times, losses and which I/O / Adam paths ran."""
    import logging

    from heteroflow.config import parse_job
    from heteroflow.runtime.worker import WorkerArgs, run_worker

    from heteroflow.runtime.metrics import MetricsWriter, read_step_records

    logging.basicConfig(level=logging.INFO, format="%(message)s")
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
    # Partition the module ourselves, the precision read from this (fp32) config: `deepspeed.initialize` would
    # pass the module's dtype to `zero.Init`, whose `_set_dtype` (DeepSpeed 0.19) turns a given fp32 into bf16 on
    # the CPU accelerator, so the NVMe swap buffers held bf16 weights ("expected m1 and m2 to have the same dtype,
    # but got: float != c10::BFloat16" in zero/linear.py).
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
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


def deepspeed_aio_problem() -> str | None:
    """Why DeepSpeed's NVMe offload cannot run here (its async_io op needs libaio's headers to build), or None."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as error:
        return f"DeepSpeed is not installed ({error}): pip install deepspeed"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("DeepSpeed's async_io op (its NVMe offload) cannot build: libaio's headers are missing; install "
                "them (Debian/Ubuntu: apt install libaio-dev; RHEL/Fedora: dnf install libaio-devel), then re-run")
    return None


def worker_main(kind: str, a: argparse.Namespace) -> None:
    work = Path(a.dir)
    report(run_heteroflow(a, work) if kind == "heteroflow" else run_deepspeed(a, work))


def _inspect(run_dir: Path, output: str) -> dict:
    """Which offload paths the run logged, and heteroflow swap files it left behind (none expected)."""
    leftovers = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix == ".swp" and "ds-nvme" not in str(p)]
    return {"notes": sorted({line for line in output.splitlines() if line.startswith("offload ")}),
            "heteroflow_swap_left": len(leftovers)}


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch / OpenMP threads for both")


parse_args = model_args(__doc__.splitlines()[0], layers=8, hidden=1024, ffn=2816, heads=16, kv_heads=8, extra=_extra)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.worker:
        worker_main(a.worker, a)
        return 0
    from heteroflow.config import parse_job

    work = Path(tempfile.mkdtemp(prefix="bench-offload-ds-", dir=a.dir))
    (work / "data").mkdir()
    spec = parse_job(job_dict(a, str(work))).model
    n = spec.num_params()
    header("benchmarks/bench_offload_vs_deepspeed.py", argv)
    print(f"model: {spec.num_layers} Llama blocks, hidden {spec.hidden_size}, ffn {spec.ffn_hidden_size}, heads "
          f"{spec.num_attention_heads}/{spec.num_kv_heads} kv, vocab {spec.vocab_size}: {n / 1e6:.1f} M params "
          f"({4 * n / 2**30:.2f} GiB fp32 weights, {12 * n / 2**30:.2f} GiB fp32 master + moments on SSD)")
    print(f"step: {a.micro_batches} micro-batches x 1 x {spec.seq_length} tokens, fp32, {a.steps} steps per run "
          f"(first = warm-up), {a.rounds} alternating runs per side, {a.threads} threads, disk {work}")

    def show(r: int, kind: str, result: dict) -> str:
        extra = (f"paths {result['which']}, device peak {result['peak_device_bytes'] / 2**20:.1f} MiB, swap "
                 f"files left {result['heteroflow_swap_left']}" if kind == "heteroflow" else
                 f"{result['optimizer']}, params on NVMe {result['params_on_nvme']}")
        return (f"round {r + 1} {kind:10s} step s: {' '.join(f'{t:6.2f}' for t in result['step_time_s'])}  CPU s: "
                f"{' '.join(f'{t:6.2f}' for t in result['cpu_s'])}  ({extra})")

    started = time.time()
    problem = deepspeed_aio_problem()
    if problem is not None:  # heteroflow's side still runs (and is shown), then what to install for DeepSpeed's
        try:
            result = launch(__file__, "heteroflow", a, work, ranks=1, threads=a.threads, inspect=_inspect)
            print(show(0, "heteroflow", result))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"bench_offload_vs_deepspeed: no DeepSpeed side: {problem}", file=sys.stderr)
        return 2
    try:
        results = alternate(("heteroflow", "deepspeed"), a.rounds,
                            lambda kind: launch(__file__, kind, a, work, ranks=1, threads=a.threads, inspect=_inspect),
                            show)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = medians(results, "step_time_s", skip_first=True)
    med_cpu = medians(results, "cpu_s", skip_first=False)
    print(f"losses heteroflow: {' '.join(f'{x:.6f}' for x in results['heteroflow'][0]['losses'])}")
    print(f"losses deepspeed:  {' '.join(f'{x:.6f}' for x in results['deepspeed'][0]['losses'])}")
    print(f"median step time (warm-up steps excluded): heteroflow {med['heteroflow']:.2f} s, "
          f"DeepSpeed ZeRO-3 NVMe {med['deepspeed']:.2f} s")
    print(f"median CPU seconds per step (all threads; less sensitive to the machine's load): heteroflow "
          f"{med_cpu['heteroflow']:.2f}, DeepSpeed {med_cpu['deepspeed']:.2f} ({med_cpu['heteroflow'] / med_cpu['deepspeed']:.2f}x)")
    ratio = med["heteroflow"] / med["deepspeed"]
    print(f"ratio heteroflow / DeepSpeed: {ratio:.2f}x (goal <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'})")
    footer(started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
