"""What the swap-block checksums cost: the same SSD-tier work with and without them, in one run.

- store I/O: `TieredStore` chunks written by `add()`, read back by the fetch-ahead loop, then one
  read-modify-write pass (`host`, `write_back`, `release`) as the streamed optimizer does;
- step time: training steps of a residual block stack with parameters and AdamW state on SSD
  (`StageOffload`, as bench_offload_capacity), forward + backward + clipping + step; and, in the
  runs with checksums, the time the training thread spends inside the checksum code, as a share of
  the step (steadier than the difference of two noisy step times on a shared machine, but blind to
  the helper thread that computes the CRCs of large writes, which competes for the same cores).

Runs with and without checksums are interleaved (a busy moment of the shared machine hits both) and
each figure is the best of `--repeats`; the process's CPU time per step (every thread) is printed too,
being less disturbed than wall time by other users of a shared machine. Goal: step time with checksums <= 1.03 x without. Also prints
the raw speed of the candidate checksums on this machine (why CRC-32).

    python benchmarks/bench_swap_checksum.py [--dir DIR] [--mib 256] [--hidden 512] [--blocks 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from heteroflow.devices import Device  # noqa: E402
from heteroflow.offload import OffloadPolicy, StageOffload  # noqa: E402
from heteroflow.offload.measure import store_throughput  # noqa: E402
from heteroflow.offload.store import TieredStore  # noqa: E402
from heteroflow.offload.swap import SwapChecksums, SwapDir  # noqa: E402

_spent = [0.0]  # seconds the training thread spends inside SwapChecksums (the helper thread's work is not in it)


QUICK = ["--mib", "4", "--chunk-mib", "1", "--hidden", "64", "--blocks", "2", "--tokens", "32", "--steps", "1", "--repeats", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def _timing(method):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _spent[0] += time.perf_counter() - start
    return timed


SwapChecksums.record = _timing(SwapChecksums.record)
SwapChecksums.verify = _timing(SwapChecksums.verify)
SwapChecksums.settle = _timing(SwapChecksums.settle)  # waiting for the helper thread counts


@contextlib.contextmanager
def checksums(on: bool):
    """Make every `TieredStore` built inside (also by `StageOffload`) use checksums or not."""
    defaults = TieredStore.__init__.__kwdefaults__
    saved = defaults["checksums"]
    defaults["checksums"] = on
    try:
        yield
    finally:
        defaults["checksums"] = saved


def checksum_speeds(nbytes: int = 64 << 20) -> dict[str, float]:
    """GB/s of each candidate over one buffer (best of 3)."""
    data = memoryview(os.urandom(nbytes))
    candidates = {"zlib.crc32": lambda: zlib.crc32(data), "zlib.adler32": lambda: zlib.adler32(data),
                  "blake2b": lambda: hashlib.blake2b(data, digest_size=16).digest(),
                  "sha256": lambda: hashlib.sha256(data).digest()}
    out = {}
    for name, fn in candidates.items():
        best = min(_timed(fn) for _ in range(3))
        out[name] = nbytes / best / 1e9
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def store_io(swap: SwapDir, nbytes: int, chunk: int) -> tuple[float, float, float]:
    """(write GB/s, read GB/s, read-modify-write GB/s) through one store."""
    with TieredStore(device=Device.cpu(), swap=swap, max_in_flight=3) as store:
        return store_throughput(store, nbytes, chunk, read_modify_write=True)


def step_time(swap_root: str, blocks: int, hidden: int, tokens: int, steps: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the whole process, share of the wall time the training thread spends
    inside the checksum code) of the fastest training step after one warm-up step, with params and
    optimizer state on SSD."""
    from heteroflow.testing.blocks import make_blocks

    model = make_blocks(blocks, hidden)
    policy = OffloadPolicy(optimizer="ssd", params="ssd", activations="cpu", swap_root=swap_root, max_in_flight=3)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with StageOffload(policy, device=Device.cpu(), blocks=model, weight_decay=0.1) as offload:
        times = []
        for _ in range(steps + 1):
            _spent[0] = 0.0
            start, cpu = time.perf_counter(), time.process_time()
            with offload.activation_context():
                h = x
                for block in model:
                    h = checkpoint(block, h, use_reentrant=True)
                loss = (h ** 2).mean()
            loss.backward()
            offload.collect_grads()
            offload.clip_grad_norm_(1.0)
            offload.step(1e-4)
            offload.opt_store.wait_all()
            offload.param_store.wait_all()
            elapsed = time.perf_counter() - start
            times.append((elapsed, time.process_time() - cpu, _spent[0] / elapsed))
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.environ.get("HETEROFLOW_SWAP_DIR", tempfile.gettempdir()))
    parser.add_argument("--mib", type=int, default=256, help="bytes through the store per I/O run")
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    started = time.perf_counter()
    print("checksum speed on one core (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in checksum_speeds().items()))
    chunk, nbytes = args.chunk_mib << 20, (args.mib << 20) // (args.chunk_mib << 20) * (args.chunk_mib << 20)
    io = {True: [0.0, 0.0, 0.0], False: [0.0, 0.0, 0.0]}
    steps = {True: (float("inf"), 0.0, 0.0), False: (float("inf"), 0.0, 0.0)}
    cpu = {True: float("inf"), False: float("inf")}
    with SwapDir(args.dir) as swap:
        swap.check_free(2 * nbytes)
        for _ in range(args.repeats):
            for on in (False, True):
                with checksums(on):
                    io[on] = [max(a, b) for a, b in zip(io[on], store_io(swap, nbytes, chunk))]
                    result = step_time(args.dir, args.blocks, args.hidden, args.tokens, args.steps)
                    steps[on], cpu[on] = min(steps[on], result), min(cpu[on], result[1])
    params = args.blocks * (8 * args.hidden ** 2 + 7 * args.hidden)
    print(f"store I/O: {nbytes >> 20} MiB in {args.chunk_mib} MiB chunks, 3 in flight, best of {args.repeats}")
    print(f"{'':<22} {'write GB/s':>10} {'read GB/s':>10} {'r-m-w GB/s':>11}")
    for on in (False, True):
        w, r, m = io[on]
        print(f"{'with checksums' if on else 'without':<22} {w:>10.3f} {r:>10.3f} {m:>11.3f}")
    ratios = [a / b for a, b in zip(io[False], io[True])]
    print(f"{'time ratio (with/without)':<22} {ratios[0]:>10.3f} {ratios[1]:>10.3f} {ratios[2]:>11.3f}")
    print(f"step: {args.blocks} blocks x hidden {args.hidden} ({params / 1e6:.1f} M params, params + AdamW state on "
          f"SSD), {args.tokens} tokens, best of {args.repeats} x {args.steps} steps")
    (plain, _, _), (checked, _, share) = steps[False], steps[True]
    print(f"step time without checksums {plain:.3f} s, with {checked:.3f} s: ratio {checked / plain:.3f} "
          f"(goal <= 1.03)")
    print(f"CPU time per step (all threads) without checksums {cpu[False]:.3f} s, with {cpu[True]:.3f} s: ratio "
          f"{cpu[True] / cpu[False]:.3f}")
    print(f"time inside the checksum code: {share:.1%} of the step with checksums, so a ratio of "
          f"{1 / (1 - share):.3f} to the same step without them")
    print(f"total time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
