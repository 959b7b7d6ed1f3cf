"""Remap a realistic activation between two stage layouts vs a plain gloo send of the same bytes.

    python benchmarks/bench_remap.py                      # [4, 1024, 4096] fp32, tp2 dp2 -> tp1 dp4
    python benchmarks/bench_remap.py --src tp1,dp4 --dst tp2,dp2 --dtype bf16

Local processes over gloo (one per rank, source stage first). In the same run, interleaved in a
shuffled order so all see the same machine load, it times:
- `plain`: the plan's (source, destination, bytes) messages as preallocated contiguous tensors,
  isend/irecv straight on gloo: no slicing, no packing, no fan-out, no staging;
- `remap/<transport>`: RemapExecutor.start(share).wait() through the given transports, with a new
  output tensor per call (the default API) or, with `:reuse`, into one preallocated `out=` tensor
  as a runtime with a buffer pool would (on CPU a fresh 16 MiB tensor costs ~20 ms of page faults
  when the previous one is still alive, which the plain send never pays).
  `bridge` sends CPU tensors in place (they are host memory already); `bridge+staging` forces the
  device-to-host and host-to-device copies through the staging banks, as an accelerator would.
When the destination stage holds replicas (tp without sp), `plain x replicas` also sends every
replica its whole share across the boundary, which is what a remap without fan-out would cost.
Each sample is the slowest rank's time (the remap is done when the last rank has its share); the
figure is the median. Ratio = plain time / remap time (= remap throughput / plain throughput).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from heteroflow.backends.transport import DirectTransport, HostBridge  # noqa: E402
from heteroflow.remap import TensorLayout, box_volume, plan_transfer  # noqa: E402
from heteroflow.remap.executor import RemapExecutor  # noqa: E402
from heteroflow.remap.local import shard  # noqa: E402
from heteroflow.testing import run_ranks  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


QUICK = ["--shape", "4,8,16", "--repeats", "1", "--warmup", "0"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def parse_degrees(text: str) -> dict:
    """`tp2,dp2,sp` -> {tp: 2, dp: 2, sp: True}."""
    out = {"tp": 1, "dp": 1, "sp": False}
    for part in text.split(","):
        if part == "sp":
            out["sp"] = True
        elif part[:2] in ("tp", "dp") and part[2:].isdigit():
            out[part[:2]] = int(part[2:])
        else:
            raise SystemExit(f"bad layout {text!r}: expected e.g. tp2,dp2[,sp]")
    return out


def layouts(args) -> tuple[TensorLayout, TensorLayout]:
    src, dst = parse_degrees(args.src), parse_degrees(args.dst)
    n_src = src["tp"] * src["dp"]
    return (TensorLayout.activation(args.shape, ranks=range(n_src), **src),
            TensorLayout.activation(args.shape, ranks=range(n_src, n_src + dst["tp"] * dst["dp"]), **dst))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def worker(rank: int, world_size: int, args) -> dict:
    src, dst = layouts(args)
    dtype = DTYPES[args.dtype]
    plan = plan_transfer(src, dst)
    groups = {}
    for _, holders in dst.blocks():  # fan-out groups (all ranks create them, in one order)
        if len(holders) > 1:
            groups[holders] = dist.new_group(list(holders))
    fanout = next((g for holders, g in groups.items() if rank in holders), None)
    transports = {"direct": DirectTransport(dist.group.WORLD),
                  "bridge": HostBridge(dist.group.WORLD, chunk_bytes=args.chunk_mb << 20),
                  "bridge+staging": HostBridge(dist.group.WORLD, chunk_bytes=args.chunk_mb << 20,
                                               stage_host_tensors=True)}
    executors = {variant: RemapExecutor(plan, rank=rank, transport=transports[variant.split(":")[0]], dtype=dtype,
                                        fanout_group=fanout) for variant in args.variants}
    outs = {v: torch.empty(dst.local_shape(rank), dtype=dtype) if rank in dst.ranks and v.endswith(":reuse")
            else None for v in args.variants}
    gen = torch.Generator().manual_seed(0)
    # Only this rank's share: building the full tensor on every rank would cost 8x the memory.
    local = torch.randn(src.local_shape(rank), generator=gen).to(dtype) if rank in src.ranks else None
    elem = torch.empty((), dtype=dtype).element_size()
    # (tag, src, dst, elements) of the plain sends: the plan's pieces, or each piece to every replica.
    messages = {"plain": [(i, p.src, p.dst, box_volume(p.box)) for i, p in enumerate(plan.pieces)]}
    if dst.num_replicas > 1:
        messages["plain x replicas"] = [(i * dst.num_replicas + j, p.src, r, box_volume(p.box))
                                        for i, p in enumerate(plan.pieces)
                                        for j, r in enumerate(dst.replica_set(p.dst))]
    buffers = {key: {m: torch.empty(m[3], dtype=dtype) for m in msgs if rank in m[1:3]}
               for key, msgs in messages.items()}

    def plain(key: str) -> None:
        works = [dist.isend(t, m[2], tag=m[0]) if m[1] == rank else dist.irecv(t, m[1], tag=m[0])
                 for m, t in buffers[key].items()]
        for w in works:
            w.wait()

    times: dict[str, list[float]] = {**{k: [] for k in messages}, **{f"remap/{n}": [] for n in executors}}
    runs = {key: (lambda key=key: plain(key)) for key in messages}
    runs.update({f"remap/{name}": (lambda ex=ex, out=outs[name]: ex.start(local, out=out).wait())
                 for name, ex in executors.items()})
    for repeat in range(args.warmup + args.repeats):
        # Interleaved, in a shuffled order (the same on every rank), so that every variant sees the same
        # machine load and none always runs first.
        order = list(runs)
        random.Random(repeat).shuffle(order)
        samples = {key: _timed(runs[key]) for key in order}
        if repeat >= args.warmup:
            for key, value in samples.items():
                times[key].append(value)
    return {"times": times, "boundary_bytes": plan.boundary_bytes(elem), "min_bytes": plan.min_boundary_bytes(elem),
            "naive_bytes": sum(box_volume(dst.box(r)) for r in dst.ranks) * elem, "summary": plan.summary()}


def check(rank: int, world_size: int, args) -> bool:
    """A small copy of the same remap, verified bit for bit on every transport."""
    small = argparse.Namespace(**{**vars(args), "shape": [args.shape[0], 8 * 4, 16]})
    src, dst = layouts(small)
    plan = plan_transfer(src, dst)
    x = torch.randn(small.shape, generator=torch.Generator().manual_seed(1)).to(DTYPES[args.dtype])
    groups = {h: dist.new_group(list(h)) for _, h in dst.blocks() if len(h) > 1}
    fanout = next((g for h, g in groups.items() if rank in h), None)
    for transport in (DirectTransport(dist.group.WORLD), HostBridge(dist.group.WORLD, stage_host_tensors=True)):
        ex = RemapExecutor(plan, rank=rank, transport=transport, dtype=x.dtype, fanout_group=fanout)
        got = ex.start(shard(x, src).get(rank)).wait()
        assert got is None or torch.equal(got, shard(x, dst)[rank])
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default="tp2,dp2")
    parser.add_argument("--dst", default="tp1,dp4")
    parser.add_argument("--shape", default="4,1024,4096", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk-mb", type=int, default=4)
    parser.add_argument("--variants", default="bridge,bridge:reuse,bridge+staging:reuse,direct:reuse",
                        type=lambda s: s.split(","), help="transport[:reuse], comma-separated")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    src, dst = layouts(args)
    world = len(src.ranks) + len(dst.ranks)
    run_ranks(check, world, args, timeout_s=300)
    results = run_ranks(worker, world, args, timeout_s=1200)
    r = results[0]
    numel = src.numel
    elem = r["min_bytes"] // numel
    print(f"remap {args.dtype} {list(args.shape)} ({r['min_bytes'] / 2**20:.1f} MiB): {r['summary']}")
    print(f"ranks: {world} local processes over gloo, 1 thread each; {args.repeats} repeats after {args.warmup} "
          f"warm-up, interleaved in shuffled order; median of the slowest rank; torch {torch.__version__}")
    print(f"bytes across the boundary: {r['boundary_bytes']} = {r['boundary_bytes'] / r['min_bytes']:.4f} x minimum "
          f"({numel} elements x {elem} B); sending every destination rank its whole share would move "
          f"{r['naive_bytes'] / r['min_bytes']:.2f} x")
    plain = statistics.median(r["times"]["plain"])
    print(f"{'variant':<28}{'median ms':>10}{'GB/s':>8}{'ratio vs plain':>16}")
    for key, samples in r["times"].items():
        med = statistics.median(samples)
        print(f"{key:<28}{med * 1e3:>10.1f}{r['min_bytes'] / med / 1e9:>8.2f}{plain / med:>16.3f}")


if __name__ == "__main__":
    main()
