"""Issue benchmark 1: the largest block stack trainable under a device budget B, with the SSD tier vs without.

"Device" is emulated in CPU memory; its residency is the offload bookkeeping (`DeviceBudget`), which
charges every parameter, gradient and optimizer byte before it exists and raises past B. Each size
really trains `--steps` AdamW steps (forward, backward, clipping, step); a size that raises is over B.

- without offload: parameters, gradients and AdamW moments on the device (torch.optim.AdamW), all
  charged; blocks are added until the budget raises;
- SSD tier: parameters and fp32 master + moments on SSD, checkpointed activations on the CPU, only the
  blocks in use on the device; depth never hits B, so it grows to `--target` x B, and a width probe
  shows where B does bind (two blocks' parameters + one block's gradients).

Training state = parameters + gradients + fp32 master weights + Adam moments of the model, counted as
fp32 AdamW training needs it without offload (16 bytes per parameter: the master is the parameter).
The SSD run actually holds 20 bytes per parameter across tiers (a separate fp32 master on SSD, fp32
gradients in CPU memory); both are printed. Activations are outside the bookkeeping in both runs.

    python benchmarks/bench_offload_capacity.py [--budget-mib 256] [--hidden 512] [--target 9]

`--tp2` instead trains one tp 2 stage (two emulated ranks, the whole runtime: `run_worker`) three ways in
alternating rounds: parameters and optimizer on the device (the baseline), both on cpu, both on ssd. Printed
per variant: the device bytes of parameters + gradients per rank (measured: the offload bookkeeping's peak
per kind; for the baseline, every local shard and its gradient, which it keeps throughout) next to the
planner's figure (`stagemap.memory`), and the median step time after the first as a ratio to the baseline's.

    python benchmarks/bench_offload_capacity.py --tp2 [--rounds 2] [--tp2-steps 4]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from heteroflow.devices import Device  # noqa: E402
from heteroflow.offload import DeviceBudget, DeviceBudgetExceeded, OffloadPolicy, StageOffload  # noqa: E402
from heteroflow.testing.blocks import make_blocks  # noqa: E402

MIB = 2**20
LR = 1e-4  # small enough that a 72-block residual stack's loss falls step by step


QUICK = ["--budget-mib", "16", "--hidden", "64", "--tokens", "32", "--steps", "1", "--target", "2", "--rounds", "1", "--tp2-steps", "2"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def _params(blocks: nn.Module) -> int:
    return sum(p.numel() for p in blocks.parameters())


def _batch(step: int, hidden: int, tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(1, tokens, hidden, generator=g).requires_grad_()


def train_on_device(num: int, hidden: int, tokens: int, steps: int, budget: DeviceBudget) -> list[float]:
    """No offload: everything charged to the device budget; returns the losses (raises past B)."""
    blocks = make_blocks(num, hidden)
    param_bytes = 4 * _params(blocks)
    budget.charge(param_bytes, "params")
    budget.charge(param_bytes, "grads")
    budget.charge(2 * param_bytes, "optimizer")  # exp_avg, exp_avg_sq
    opt = torch.optim.AdamW(blocks.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(steps):
        h = _batch(0, hidden, tokens)  # one batch: the loss must fall step by step
        for block in blocks:
            h = block(h)
        loss = (h ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(blocks.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train_on_ssd(num: int, hidden: int, tokens: int, steps: int, budget: DeviceBudget,
                 swap_root: str) -> tuple[list[float], float, dict]:
    """Params and optimizer on SSD; returns (losses, seconds per step, which paths ran)."""
    blocks = make_blocks(num, hidden)
    policy = OffloadPolicy(optimizer="ssd", params="ssd", activations="cpu", swap_root=swap_root,
                           device_budget_bytes=budget.limit_bytes, max_in_flight=3)
    with StageOffload(policy, device=Device.cpu(), blocks=blocks, weight_decay=0.1, budget=budget) as offload:
        losses = []
        start = time.perf_counter()
        for step in range(steps):
            with offload.activation_context():
                h = _batch(0, hidden, tokens)  # one batch: the loss must fall step by step
                for block in blocks:
                    h = checkpoint(block, h, use_reentrant=True)
                loss = (h ** 2).mean()
            loss.backward()
            offload.collect_grads()
            offload.clip_grad_norm_(1.0)
            offload.step(LR)
            losses.append(loss.item())
        seconds = (time.perf_counter() - start) / steps
        return losses, seconds, offload.which


TP2_MODEL = {"num_layers": 8, "hidden_size": 512, "ffn_hidden_size": 1376, "num_attention_heads": 8,
             "num_kv_heads": 4, "vocab_size": 512, "seq_length": 256}
TP2_OFFLOAD = {"device": {}, "cpu": {"optimizer": "cpu", "params": "cpu"}, "ssd": {"optimizer": "ssd", "params": "ssd"}}


def _tp2_job(variant: str, steps: int, swap_root: str):
    from heteroflow.config import parse_job

    stage = {"devices": ["host:0-1"], "layers": TP2_MODEL["num_layers"], "tp": 2}
    if TP2_OFFLOAD[variant]:
        stage["offload"] = TP2_OFFLOAD[variant]
    return parse_job({"cluster": {"nodes": [{"name": "host", "device": "cpu", "count": 2}]}, "model": TP2_MODEL,
                      "train": {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32", "steps": steps,
                                "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, "offload_dir": swap_root},
                      "plan": {"micro_batch_size": 2, "stages": [stage]}})


def _tp2_rank(rank: int, world_size: int, args) -> tuple[int, dict | None, float]:
    """Train; (this rank's parameter elements, its offload report, its CPU seconds in the training loop)."""
    import heteroflow.runtime.worker as worker

    loop, spent = worker._train_steps, []

    def timed(*a, **k):
        started = time.process_time()
        try:
            return loop(*a, **k)
        finally:
            spent.append(time.process_time() - started)

    worker._train_steps = timed  # this rank's process only: a benchmark's probe, not a hook of the runtime
    result = worker.run_worker(args)
    return sum(local.numel() for local, _ in result.state.values()), result.offload, spent[0]


def tp2_params_offload(rounds: int, steps: int, swap_root: str, data_dir: str) -> None:
    """The `--tp2` comparison (see the module docstring)."""
    from heteroflow.runtime.metrics import read_step_records
    from heteroflow.runtime.worker import WorkerArgs
    from heteroflow.stagemap.memory import memory_model
    from heteroflow.testing import run_ranks

    times: dict[str, list[float]] = {v: [] for v in TP2_OFFLOAD}
    cpu_s: dict[str, list[float]] = {v: [] for v in TP2_OFFLOAD}
    measured: dict[str, int] = {}
    for r in range(rounds):
        for variant in TP2_OFFLOAD if r % 2 == 0 else reversed(TP2_OFFLOAD):
            job = _tp2_job(variant, steps, swap_root)
            metrics = Path(data_dir) / f"tp2-{variant}-{r}.jsonl"
            args = WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir,
                              show_progress=False, timeout_s=600, metrics_path=str(metrics), return_state=True)
            ranks = run_ranks(_tp2_rank, 2, args, timeout_s=1200)
            records = read_step_records(metrics)
            step_s = [rec["step_time_s"] for rec in records[1:]]
            times[variant] += step_s
            numel, report, _ = ranks[0]
            cpu_s[variant].append(sum(spent for _, _, spent in ranks) / steps)
            measured[variant] = (8 * numel if report is None  # fp32 shards and gradients, all resident
                                 else report["peak_by_kind"]["params"] + report["peak_by_kind"]["grads"])
            which = report["which"] if report is not None else "-"
            print(f"  round {r + 1} {variant:6s} step s: " + " ".join(f"{x:6.2f}" for x in step_s)
                  + f"  CPU s per step (both ranks) {cpu_s[variant][-1]:.2f}  losses {records[0]['loss']:.4f} -> "
                  f"{records[-1]['loss']:.4f}  [{which}]", flush=True)
    base_s, base_cpu = statistics.median(times["device"]), statistics.median(cpu_s["device"])
    print("variant  device bytes of params + grads per rank: measured / planner   median step s   vs device   "
          "median CPU s   vs device")
    for variant in TP2_OFFLOAD:
        job = _tp2_job(variant, steps, swap_root)
        stage = job.plan.stages[0]
        priced = memory_model(job.model, stage.layout, tokens=job.plan.micro_batch_size * job.model.seq_length,
                              precision="fp32", capacity_gib=80.0)
        planned = (priced.weights.at(stage.layers, 1, True, True) + priced.gradients.at(stage.layers, 1, True, True))
        med, cpu = statistics.median(times[variant]), statistics.median(cpu_s[variant])
        print(f"{variant:8s} {measured[variant] / MIB:8.2f} MiB ({measured[variant] / measured['device']:.2f}x) / "
              f"{planned / MIB:8.2f} MiB {'':14s} {med:8.2f}      {med / base_s:.2f}x   {cpu:12.2f}   "
              f"{cpu / base_cpu:.2f}x")


def _fmt(losses: list[float]) -> str:
    return " -> ".join(f"{x:.4f}" for x in losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--target", type=float, default=9.0, help="grow the SSD run to this x B")
    parser.add_argument("--dir", default=os.environ.get("HETEROFLOW_SWAP_DIR", tempfile.gettempdir()))
    parser.add_argument("--tp2", action="store_true", help="compare params offload on a tp 2 stage instead")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tp2-steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    if args.tp2:
        print(f"one tp 2 stage, two emulated ranks: {TP2_MODEL}; 2 micro-batches x 2 x {TP2_MODEL['seq_length']} "
              f"tokens, fp32, {args.tp2_steps} steps per run (first = warm-up), {args.rounds} alternating rounds")
        with tempfile.TemporaryDirectory() as data_dir:
            tp2_params_offload(args.rounds, args.tp2_steps, args.dir, data_dir)
        return
    limit = args.budget_mib * MIB
    per_block = 8 * args.hidden**2 + 7 * args.hidden
    state = lambda n: 16 * n * per_block  # noqa: E731  (bytes of fp32 AdamW training state)
    print(f"device budget B = {args.budget_mib} MiB; block = {per_block / 1e6:.2f} M params "
          f"(hidden {args.hidden}), {args.tokens} tokens per step, {args.steps} steps per size")

    best_device = 0
    for num in range(1, 1000):
        budget = DeviceBudget(limit)
        try:
            losses = train_on_device(num, args.hidden, args.tokens, args.steps, budget)
        except DeviceBudgetExceeded:
            print(f"  no offload, {num:3d} blocks: over budget ({state(num) / MIB:.0f} MiB of state > B)")
            break
        best_device = num
        if num in (1, 2) or num % 2 == 0:
            print(f"  no offload, {num:3d} blocks: ok, losses {_fmt(losses)}, peak {budget.peak_bytes / MIB:.0f} MiB")

    best_ssd = 0
    sizes = sorted({max(1, int(math.ceil(args.target * limit / state(1)) * f)) for f in (0.25, 0.5, 1.0)})
    for num in sizes:
        budget = DeviceBudget(limit)
        losses, seconds, which = train_on_ssd(num, args.hidden, args.tokens, args.steps, budget, args.dir)
        best_ssd = num
        print(f"  SSD tier,   {num:3d} blocks: ok, losses {_fmt(losses)}, peak {budget.peak_bytes / MIB:.1f} MiB "
              f"(B {args.budget_mib}), {seconds:.1f} s/step, {state(num) / limit:.2f}x B  [{which}]")
        if num == sizes[0]:  # the same model without offload and without a budget: same losses?
            want = train_on_device(num, args.hidden, args.tokens, args.steps, DeviceBudget(None))
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
            print(f"    same {num} blocks without offload (no budget): losses {_fmt(want)}; max relative "
                  f"difference {rel:.1e}")

    # Width probe: with the SSD tier B binds on one block's size, not on depth.
    for hidden in (3 * args.hidden, 4 * args.hidden):
        budget = DeviceBudget(limit)
        try:
            train_on_ssd(2, hidden, 16, 1, budget, args.dir)
            print(f"  SSD tier, hidden {hidden}: ok (peak {budget.peak_bytes / MIB:.0f} MiB)")
        except DeviceBudgetExceeded as exc:
            print(f"  SSD tier, hidden {hidden}: over budget ({str(exc)[:90]}...)")

    print(f"largest without offload: {best_device} blocks = {state(best_device) / MIB:.0f} MiB training state "
          f"= {state(best_device) / limit:.2f}x B")
    print(f"largest with the SSD tier (tried): {best_ssd} blocks = {state(best_ssd) / MIB:.0f} MiB training state "
          f"= {state(best_ssd) / limit:.2f}x B (held across tiers: {20 * best_ssd * per_block / MIB:.0f} MiB)")
    print(f"ratio SSD / no offload: {best_ssd / max(best_device, 1):.1f}x; goal >= 8x B: "
          f"{'met' if state(best_ssd) >= 8 * limit else 'NOT met'}")


if __name__ == "__main__":
    main()
