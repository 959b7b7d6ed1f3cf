"""Tensor parallelism on per-stage sub-meshes: DTensor `parallelize_module` vs heteroflow's functions.

Reproduces the measurement behind the choice documented in heteroflow/models/parallelize.py:
two stages of tp 2 on 4 gloo ranks (or one stage on 2), each tp group wrapped as a DeviceMesh with
`DeviceMesh.from_group`; tiny-llama's 8 blocks run forward + backward under both implementations in
the same processes, alternating, after a correctness check against the unsharded blocks.

    python benchmarks/tp_dtensor_vs_functions.py [--world 4] [--sp] [--seq 128] [--kv-heads 4]
"""

from __future__ import annotations

import argparse
import sys
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from heteroflow.config import PRESETS
from heteroflow.layout import ParallelLayout
from heteroflow.models import build_stage_model, init_weights, parallelize_stage


QUICK = ["--world", "2", "--seq", "16", "--iters", "3"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def dtensor_tp(model, mesh, sp: bool) -> None:
    """torchtitan's Llama plan, applied to each block of a heteroflow stage."""
    seq = Shard(1) if sp else Replicate()
    for block in model.layers.values():
        plan = {
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        parallelize_module(block, mesh, plan)


def _stage(spec):
    model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=False, is_last=False)
    init_weights(model, seed=0)
    return model


def run(rank: int, world: int, store: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    groups = [dist.new_group(list(range(r, r + 2))) for r in range(0, world, 2)]  # one tp=2 group per stage
    group, tp_rank = groups[rank // 2], rank % 2
    spec = replace(PRESETS["tiny-llama"], num_kv_heads=args.kv_heads)
    x = torch.randn(4, args.seq, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    local = (lambda t: t.chunk(2, dim=1)[tp_rank]) if args.sp else (lambda t: t)
    ref_x = x.clone().requires_grad_()
    ref_out = _stage(spec)(ref_x)
    ref_out.backward(grad)
    models = {"functions": parallelize_stage(_stage(spec), layout=ParallelLayout(tp=2, sp=args.sp), tp_group=group)}
    dt = _stage(spec)
    dtensor_tp(dt, DeviceMesh.from_group(group, "cpu"), args.sp)
    models["dtensor"] = dt
    times: dict[str, list[float]] = {k: [] for k in models}
    for name, model in list(models.items()):
        xl = local(x).clone().requires_grad_()
        try:
            out = model(xl)
            out.backward(local(grad))
        except Exception as exc:  # e.g. DTensor with tp > kv heads
            if rank == 0:
                print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            del models[name]
            continue
        if rank == 0:
            print(f"{name}: output err {(out - local(ref_out)).abs().max():.1e}, "
                  f"input-grad err {(xl.grad - local(ref_x.grad)).abs().max():.1e}", flush=True)
    xl = local(x).clone().requires_grad_()
    for _ in range(args.iters):
        for name, model in models.items():
            dist.barrier(group)
            start = time.perf_counter()
            model(xl).backward(local(grad))
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        print(f"world {world}, sp {args.sp}, seq {args.seq}, kv heads {args.kv_heads}: " + ", ".join(
            f"{k} median {statistics.median(v[2:]) * 1e3:.0f} ms" for k, v in times.items() if v), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, choices=(2, 4))
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    cli = parser.parse_args()
    if cli.quick:  # later arguments still override the quick sizes
        cli = parser.parse_args([*QUICK, *(sys.argv[1:])])
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(cli.world, f"{tmp}/store", cli), nprocs=cli.world)
