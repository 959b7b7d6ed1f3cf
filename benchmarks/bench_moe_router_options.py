"""What Megatron's MoE variants cost in heteroflow's MoE layer: GELU experts, the sequence aux loss, the z-loss and
Sinkhorn routing, each against the SwiGLU / batch-aux-loss layer, forward + backward, in one run.

    python benchmarks/bench_moe_router_options.py               # hidden 512, 8 experts of 1024, top 2, 4096 tokens
    python benchmarks/bench_moe_router_options.py --tokens 1024 --samples 20

One process, fp32 on CPU. The variants are timed in turn inside each sample (the order rotating), so all see the
same machine load; the figure is the median. Ratio = variant time / baseline time (below 1: cheaper). For GELU
experts the planner's figure is printed next to it: its FFN GEMM seconds (`stagemap.compute.ffn_gemm_s`) at a
shape-independent rate, GELU over SwiGLU, which the measured ratio should approach when the GEMMs dominate.
"""

from __future__ import annotations

import argparse
import sys
import os
import statistics
import time
from dataclasses import replace

import torch


QUICK = ["--hidden", "32", "--ffn", "64", "--experts", "4", "--tokens", "64", "--sequences", "2", "--samples", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("hidden", 512), ("ffn", 1024), ("experts", 8), ("top-k", 2), ("tokens", 4096),
                          ("sequences", 4), ("samples", 10)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])

    from heteroflow.config import PRESETS
    from heteroflow.config.catalog import CATALOG
    from heteroflow.config.moe import MoESpec
    from heteroflow.models.moe import MoE
    from heteroflow.stagemap.compute import ffn_gemm_s
    from heteroflow.stagemap.hardware import device_model

    base = MoESpec(num_experts=args.experts, top_k=args.top_k, ffn_hidden_size=args.ffn, aux_loss_coeff=0.01)
    variants = {
        "swiglu, batch aux (baseline)": (base, True),
        "gelu experts": (base, False),
        "sequence aux loss": (replace(base, aux_loss_type="sequence"), True),
        "z-loss": (replace(base, z_loss_coeff=1e-3), True),
        "sinkhorn routing": (replace(base, sinkhorn=True, normalize_top_k=False, aux_loss_coeff=0.0), True),
    }
    torch.manual_seed(0)
    layers = {}
    for name, (spec, swiglu) in variants.items():
        layer = MoE(args.hidden, spec, swiglu=swiglu)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.05)
        layers[name] = layer
    x = torch.randn(args.sequences, args.tokens // args.sequences, args.hidden)

    def step(module) -> float:
        inp = x.clone().requires_grad_()
        start = time.perf_counter()
        module(inp).pow(2).mean().backward()
        elapsed = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        module.aux_losses.clear()
        return elapsed

    names = list(layers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        step(layers[name])
    for k in range(args.samples):
        for name in names[k % len(names):] + names[:k % len(names)]:
            times[name].append(step(layers[name]))
    med = {name: statistics.median(t) for name, t in times.items()}
    baseline = med[names[0]]

    flat = replace(device_model(CATALOG["nvidia-a100-80g"], "fp32"), eff_half_dim=0.0)
    shape = replace(PRESETS["micro-llama"], hidden_size=args.hidden, moe=base, ffn_hidden_size=args.ffn)
    priced = {act: ffn_gemm_s(replace(shape, activation=act), flat, tokens=args.tokens, tp=1, dtype_bytes=4)
              for act in ("swiglu", "gelu")}

    print(f"MoE layer fwd+bwd, fp32 CPU, {torch.get_num_threads()} threads, load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}: hidden {args.hidden}, {args.experts} experts of "
          f"{args.ffn}, top {args.top_k}, {args.sequences} x {args.tokens // args.sequences} tokens, median of "
          f"{args.samples}")
    for name in names:
        print(f"  {name:<30} {med[name] * 1e3:9.1f} ms   ratio to baseline {med[name] / baseline:5.2f}x")
    print(f"  planner's FFN GEMM figure, gelu / swiglu experts: {priced['gelu'] / priced['swiglu']:.2f}x")


if __name__ == "__main__":
    main()
