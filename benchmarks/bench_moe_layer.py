"""heteroflow's MoE layer vs transformers' Mixtral sparse-MoE block: forward + backward on the same weights.

    python benchmarks/bench_moe_layer.py                     # hidden 512, 8 experts of 1024, top 2, 4096 tokens
    python benchmarks/bench_moe_layer.py --tokens 1024 --experts 16 --top-k 4

One process, fp32 on CPU. Both modules hold the same weights (loaded through heteroflow's Hugging Face
names) and see the same tokens; their outputs are checked equal first. The two are timed alternately in one
loop, so both see the same machine load; the figure is the median of the samples. Ratio = transformers time /
heteroflow time (above 1: heteroflow is faster). heteroflow also computes the load-balancing loss (and its
gradient) in every step, which the transformers block leaves to the model's end.
"""

from __future__ import annotations

import argparse
import sys
import statistics
import time

import torch


QUICK = ["--hidden", "32", "--ffn", "64", "--experts", "4", "--tokens", "64", "--samples", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])

    import transformers

    from heteroflow.config.moe import MoESpec
    from heteroflow.models.moe import MoE

    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                        num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    theirs = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    ours = MoE(args.hidden, MoESpec(num_experts=args.experts, top_k=args.top_k, ffn_hidden_size=args.ffn,
                                    aux_loss_coeff=0.01))
    with torch.no_grad():
        ours.router.weight.normal_(0.0, 0.1)
        theirs.gate.weight.copy_(ours.router.weight)
        for j, expert in ours.experts.items():
            for p in expert.parameters():
                p.normal_(0.0, 0.02)
            # transformers 5 fuses the experts: gate_up_proj [E, 2f, h] (gate rows first), down_proj [E, h, f].
            theirs.experts.gate_up_proj[int(j)].copy_(torch.cat([expert.w1.weight, expert.w3.weight]))
            theirs.experts.down_proj[int(j)].copy_(expert.w2.weight)
    x = torch.randn(1, args.tokens, args.hidden)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)

    def step(module) -> float:
        inp = x.clone().requires_grad_()
        start = time.perf_counter()
        out = module(inp)
        out.float().pow(2).mean().backward()
        elapsed = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        return elapsed

    times: dict[str, list[float]] = {"heteroflow": [], "transformers": []}
    for _ in range(2):  # warm-up
        step(ours), step(theirs)
    for k in range(args.samples):
        for name, module in (("heteroflow", ours), ("transformers", theirs))[:: 1 if k % 2 else -1]:
            times[name].append(step(module))
    ours.aux_losses.clear()
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"MoE layer fwd+bwd, fp32 CPU, {torch.get_num_threads()} threads: hidden {args.hidden}, "
          f"{args.experts} experts of {args.ffn}, top {args.top_k}, {args.tokens} tokens, median of {args.samples}")
    for name, t in med.items():
        print(f"  {name:<13} {t * 1e3:9.1f} ms   {args.tokens / t:10.0f} tokens/s")
    print(f"  ratio (transformers / heteroflow time): {med['transformers'] / med['heteroflow']:.2f}x")


if __name__ == "__main__":
    main()
