"""MoE layer step under expert parallelism: heteroflow's all-to-all dispatch vs DeepSpeed-MoE, same layout and weights.

    python benchmarks/bench_moe_ep.py                       # ep 2 over 2 gloo ranks, 8 experts of 512, top 2
    python benchmarks/bench_moe_ep.py --tokens 1024 --rounds 6

Two CPU processes (gloo), one thread each, form one ep group of 2: each holds 4 of the 8 experts. Both layers get
the same router and expert weights (DeepSpeed's `deepspeed.moe.layer.MoE` with heteroflow's SwiGLU `FeedForward`
as its expert) and the same tokens on each rank, and run dropless top-2 routing with normalised top-2 weights
(DeepSpeed: `drop_tokens=False`, `use_rts=False`, `top2_2nd_expert_sampling=False`, so its routing is
deterministic); their outputs are checked equal first. A step is forward + backward of the layer on the rank's
tokens (loss = mean of squares), then the experts' gradients summed over the ep group's expert-dp peers (none
here: expert-dp is 1) and nothing else. The two are timed in alternating rounds in the same processes, so both see
the same machine load; a step's time is the slower rank's. Ratio = DeepSpeed time / heteroflow time = heteroflow's
tokens/s over DeepSpeed's (above 1: heteroflow is faster), as the median of the per-round ratios (steadiest under
load), of the median steps and of the fastest steps.
"""

from __future__ import annotations

import argparse
import sys
import os
import statistics
import time

import torch


QUICK = ["--hidden", "32", "--ffn", "64", "--experts", "4", "--tokens", "64", "--rounds", "1", "--steps", "1", "--warmup", "0"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def _rank(rank: int, world_size: int, args) -> dict:
    import torch.distributed as dist

    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from heteroflow.config.moe import MoESpec
    from heteroflow.layout.shards import local_experts
    from heteroflow.models.ffn import FeedForward
    from heteroflow.models.moe import MoE
    from heteroflow.models.moe_dispatch import AllToAllDispatcher

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)  # the same full weights on every rank
    spec = MoESpec(num_experts=args.experts, top_k=2, ffn_hidden_size=args.ffn)
    ours = MoE(args.hidden, spec)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(0.0, 0.05)
        ours.router.weight.normal_(0.0, 0.3)
    full = {name: p.detach().clone() for name, p in ours.named_parameters()}
    held = local_experts(args.experts, world_size, rank)
    for key in [k for k in ours.experts.keys() if int(k) not in held]:
        del ours.experts[key]
    ours.experts.dispatcher = AllToAllDispatcher(dist.group.WORLD, num_experts=args.experts)

    theirs = DeepSpeedMoE(args.hidden, FeedForward(args.hidden, args.ffn), num_experts=args.experts,
                          ep_size=world_size, k=2, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    theirs.set_deepspeed_parallelism()
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(full["router.weight"])
        for local, j in enumerate(held):
            for name, param in theirs.deepspeed_moe.experts.deepspeed_experts[local].named_parameters():
                param.copy_(full[f"experts.{j}.{name}"])
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
    torch.testing.assert_close(ours(x), theirs(x)[0], rtol=1e-4, atol=1e-5)

    def step(module, pick) -> float:
        inp = x.clone().requires_grad_()
        dist.barrier()
        start = time.perf_counter()
        pick(module(inp)).pow(2).mean().backward()
        elapsed = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        return elapsed

    times = {"heteroflow": [], "deepspeed": []}
    for _ in range(args.warmup):
        step(ours, lambda out: out)
        step(theirs, lambda out: out[0])
    for _ in range(args.rounds):
        for _ in range(args.steps):
            times["heteroflow"].append(step(ours, lambda out: out))
        for _ in range(args.steps):
            times["deepspeed"].append(step(theirs, lambda out: out[0]))
    counts = ours.experts.dispatcher.counts
    return {"times": times, "sent_rows": counts.sent_rows, "routed": counts.routed, "forwards": counts.forwards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=1, help="steps of each layer per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])

    from heteroflow.testing import run_ranks

    load = os.getloadavg()
    results = run_ranks(_rank, 2, args, timeout_s=1800, env={"DS_ACCELERATOR": "cpu"})
    # A step ends when the slower rank's does (the all-to-alls tie them): take the larger of the two per step.
    per_step = {k: [max(pair) for pair in zip(*(r["times"][k] for r in results))] for k in ("heteroflow", "deepspeed")}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    tokens = 2 * args.tokens
    print(f"MoE layer, ep 2 over 2 gloo ranks (1 thread each): hidden {args.hidden}, {args.experts} experts of "
          f"{args.ffn} (SwiGLU), top 2, dropless, {args.tokens} tokens per rank, fp32; "
          f"{args.rounds} alternating rounds x {args.steps} steps each")
    for k in ("heteroflow", "deepspeed"):
        print(f"  {k:10s}  median step {med[k] * 1e3:8.1f} ms  {tokens / med[k]:9.0f} tokens/s  "
              f"(min {min(per_step[k]) * 1e3:.1f} ms, max {max(per_step[k]) * 1e3:.1f} ms)")
    rounds = [statistics.median(per_step["deepspeed"][i * args.steps:(i + 1) * args.steps])
              / statistics.median(per_step["heteroflow"][i * args.steps:(i + 1) * args.steps])
              for i in range(args.rounds)]
    # Adjacent rounds share the machine's load, so the median of the per-round ratios is the steadiest figure on a
    # busy machine; the ratio of the medians and of the fastest steps are shown next to it.
    print(f"  ratio (deepspeed time / heteroflow time): median of per-round ratios {statistics.median(rounds):.2f}x, "
          f"of median steps {med['deepspeed'] / med['heteroflow']:.2f}x, "
          f"of fastest steps {min(per_step['deepspeed']) / min(per_step['heteroflow']):.2f}x")
    print("  per-round ratios: " + " ".join(f"{r:.2f}" for r in rounds))
    sent = [r["sent_rows"] / r["forwards"] for r in results]
    print(f"  heteroflow all-to-all rows sent per forward, by rank: {sent} (of {results[0]['routed'] // results[0]['forwards']} "
          "assignments each)")
    print(f"  load average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} (2 cores, shared machine)")


if __name__ == "__main__":
    main()
