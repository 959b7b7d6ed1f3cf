"""Issue 15 benchmark: step time of heteroflow's ZeRO-3 (FSDP2 per block) vs DeepSpeed ZeRO-3, same model, data
and machine; with `--offload optimizer-cpu`, ZeRO-3 with the optimizer state on the CPU on both sides
(heteroflow's ZeRO-Infinity path, `offload.zero3`, vs DeepSpeed's `offload_optimizer: {device: cpu}`).

Both train the same Llama block stack (heteroflow's `StageModel`, the same seed-only initial weights) on the
same micro-batches (heteroflow's data order over the built-in corpus, each dp rank its share), fp32, AdamW with
decay on matrices, global-norm clipping, the same learning-rate schedule, `--dp` ranks over gloo on this CPU,
one torch thread per rank:

- heteroflow: `heteroflow.runtime.worker.run_worker` on a one-stage plan `{dp: N, zero: 3}`;
- DeepSpeed: ZeRO-3 (`DS_ACCELERATOR=cpu`, gloo), its prefetch bounded to a block like heteroflow's window,
  torch's AdamW handed to `deepspeed.initialize` (the update heteroflow runs too); with the optimizer offloaded,
  DeepSpeed's own AdamW (DeepSpeedCPUAdam), the kernel heteroflow's CPU tier runs when it builds.

Device bytes per rank: the training state each side keeps in device memory between steps. On this CPU-only
machine both "devices" are host memory, so it is counted from each side's own placement: heteroflow's measured
figures (the step record's `memory`, `StageOptimizer.memory_bytes`: parameter shards, gradient shards,
optimizer state on the device), DeepSpeed's partitioned parameters (`ds_tensor`), and, unless offloaded, its
fp32 partitions, their gradients and the Adam moments. Peak RSS per rank (everything, both tiers) is printed too.

Each run is a set of fresh processes (one per rank); the runs alternate (heteroflow, DeepSpeed, DeepSpeed,
heteroflow, ...) so a change in the machine's load hits both. The first step of every run is warm-up and not
counted. Printed: every step time (rank 0), each side's median, the ratio heteroflow / DeepSpeed (goal <= 1.0),
and both loss curves (they should agree: same model, data and optimizer).

    python benchmarks/bench_zero3.py [--dp 2] [--offload none|optimizer-cpu] [--layers 4] [--hidden 512] [--steps 4]
                                     [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from heteroflow.testing.versus import (alternate, footer, header, launch, medians, model_args, model_dict,  # noqa: E402
                                       report)


def job_dict(a: argparse.Namespace) -> dict:
    """The job both sides train (heteroflow reads it; DeepSpeed takes its model, data and optimizer from it)."""
    stage = {"devices": ["host"], "layers": a.layers, "dp": a.dp, "zero": 3}
    if a.offload == "optimizer-cpu":
        stage["offload"] = {"optimizer": "cpu"}
    return {
        "cluster": {"nodes": [{"name": "host", "device": "cpu", "count": a.dp}]},
        "model": model_dict(a),
        "train": {"global_batch_size": a.dp * a.micro_batches, "micro_batch_size": a.dp, "precision": "fp32",
                  "steps": a.steps, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, "weight_decay": 0.1,
                  "grad_clip": 1.0},
        "plan": {"micro_batch_size": a.dp, "stages": [stage]},
    }


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_heteroflow(a: argparse.Namespace, work: Path) -> dict:
    """This rank's part of one heteroflow run; rank 0 returns step times, losses and device bytes."""
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
    measured = records[-1]["memory"]["ranks"][0]["measured"]
    return {"step_time_s": [r["step_time_s"] for r in records], "losses": list(result.losses),
            "device_bytes": measured["params"] + measured["grads"] + measured["optimizer"],
            "peak_rss_bytes": _peak_rss_bytes()}


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
    offloaded = a.offload == "optimizer-cpu"
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": a.micro_batches,
        "gradient_clipping": train.grad_clip, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": 3,
            # Like heteroflow's window: the block in use and the next one prefetched (DeepSpeed's defaults keep
            # up to 1e9 elements live, i.e. this whole model, which would not be ZeRO-3 any more).
            "stage3_max_live_parameters": 2 * block_numel, "stage3_max_reuse_distance": block_numel,
            "stage3_prefetch_bucket_size": block_numel, "stage3_param_persistence_threshold": 0,
            **({"offload_optimizer": {"device": "cpu", "pin_memory": False}} if offloaded else {}),
        },
    }
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if offloaded:  # DeepSpeed's CPU AdamW (DeepSpeedCPUAdam), as heteroflow's CPU tier runs
        adamw = {"lr": train.lr, "betas": [train.adam_beta1, train.adam_beta2], "eps": train.adam_eps,
                 "weight_decay": train.weight_decay}
        config["optimizer"] = {"type": "AdamW", "params": adamw}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    else:  # torch's AdamW, handed over: DeepSpeed's own "AdamW" JIT-builds a fused kernel, and heteroflow runs torch's
        optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                                      eps=train.adam_eps)
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
    return ({"step_time_s": times, "losses": losses, "device_bytes": _deepspeed_device_bytes(engine, model, offloaded),
             "peak_rss_bytes": _peak_rss_bytes()} if rank == 0 else {})


def _deepspeed_device_bytes(engine, model, offloaded: bool) -> int:
    """DeepSpeed's device-side training state between steps: the partitioned parameters and, unless the optimizer
    is offloaded, the fp32 partitions with their gradients and the Adam moments."""
    total = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    if not offloaded:
        zero = engine.optimizer
        for flat in zero.fp32_partitioned_groups_flat:
            total += flat.numel() * flat.element_size() * (2 if flat.grad is not None else 1)
        for state in zero.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "numel") and t.dim())
    return total


def worker_main(kind: str, a: argparse.Namespace) -> None:
    work = Path(a.dir)
    result = run_heteroflow(a, work) if kind == "heteroflow" else run_deepspeed(a, work)
    if result:
        report(result)


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=int, default=2, help="ranks (one ZeRO-3 stage over all of them)")
    p.add_argument("--offload", choices=("none", "optimizer-cpu"), default="none",
                   help="optimizer-cpu: the optimizer state on the CPU on both sides")


parse_args = model_args(__doc__.splitlines()[0], layers=4, hidden=512, ffn=1408, heads=8, kv_heads=4, extra=_extra,
                        passthrough=("dp", "offload"))


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
    header("benchmarks/bench_zero3.py", argv)
    offload = " with the optimizer state on the CPU" if a.offload == "optimizer-cpu" else ""
    print(f"model: {spec.num_layers} Llama blocks, hidden {spec.hidden_size}, ffn {spec.ffn_hidden_size}, heads "
          f"{spec.num_attention_heads}/{spec.num_kv_heads} kv, vocab {spec.vocab_size}: {n / 1e6:.1f} M params, "
          f"ZeRO-3{offload} over {a.dp} gloo ranks (1 thread each)")
    print(f"step: {a.micro_batches} micro-batches x 1 x {spec.seq_length} tokens per rank, fp32, {a.steps} steps per "
          f"run (first = warm-up), {a.rounds} alternating runs per side")
    started = time.time()
    try:
        results = alternate(("heteroflow", "deepspeed"), a.rounds,
                            lambda kind: launch(__file__, kind, a, work, ranks=a.dp),
                            lambda r, kind, res: f"round {r + 1} {kind:10s} step s: "
                                                 f"{' '.join(f'{t:6.2f}' for t in res['step_time_s'])}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = medians(results, "step_time_s", skip_first=True)
    device = {kind: runs[0]["device_bytes"] for kind, runs in results.items()}
    rss = medians({kind: [{"rss": [r["peak_rss_bytes"]]} for r in runs] for kind, runs in results.items()}, "rss",
                  skip_first=False)
    ds = "DeepSpeed ZeRO-3" + (" offload_optimizer cpu" if a.offload == "optimizer-cpu" else "")
    print(f"losses heteroflow: {' '.join(f'{x:.6f}' for x in results['heteroflow'][0]['losses'])}")
    print(f"losses deepspeed:  {' '.join(f'{x:.6f}' for x in results['deepspeed'][0]['losses'])}")
    print(f"median step time (warm-up steps excluded): heteroflow {med['heteroflow']:.3f} s, {ds} "
          f"{med['deepspeed']:.3f} s")
    ratio = med["heteroflow"] / med["deepspeed"]
    print(f"ratio heteroflow / DeepSpeed: {ratio:.2f}x (goal <= 1.0x: {'met' if ratio <= 1.0 else 'NOT met'})")
    print(f"device bytes per rank (training state between steps, rank 0): heteroflow "
          f"{device['heteroflow'] / 2**20:.2f} MiB, DeepSpeed {device['deepspeed'] / 2**20:.2f} MiB, ratio "
          f"{device['heteroflow'] / device['deepspeed']:.2f}x")
    print(f"peak RSS per rank (rank 0, both tiers): heteroflow {rss['heteroflow'] / 2**20:.0f} MiB, DeepSpeed "
          f"{rss['deepspeed'] / 2**20:.0f} MiB, ratio {rss['heteroflow'] / rss['deepspeed']:.2f}x")
    footer(started)


if __name__ == "__main__":
    main(sys.argv[1:])
