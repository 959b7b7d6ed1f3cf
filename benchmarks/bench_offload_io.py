"""Issue benchmark 3: SSD read and write throughput of the offload store's engines vs `dd` with direct I/O.

Same disk, same file size, same run. For each path (DeepSpeed's async_io op when it loads, and the
O_DIRECT thread-pool fallback) it measures:

- engine: `max_in_flight` aligned staging buffers cycled over the file, as the store drives it;
- store:  `TieredStore` chunks written by `add()` and read back by the prefetch/get/release loop of
          the parameter hooks (includes the copies between staging buffers and tensors);

and `dd bs=<chunk> oflag=direct` / `iflag=direct` on the same size. Each figure is the best of
`--repeats` runs (the disk is shared: the best is the least disturbed). Goal: >= 70% of dd.

    python benchmarks/bench_offload_io.py [--dir DIR] [--gib 1] [--chunk-mib 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heteroflow.devices import Device  # noqa: E402
from heteroflow.offload.aio import deepspeed_aio_module, open_engine  # noqa: E402
from heteroflow.offload.measure import engine_throughput, store_throughput  # noqa: E402
from heteroflow.offload.store import TieredStore  # noqa: E402
from heteroflow.offload.swap import SwapDir  # noqa: E402


QUICK = ["--gib", "0.02", "--chunk-mib", "2", "--repeats", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def dd(path: Path, nbytes: int, chunk: int, *, write: bool) -> float:
    """GB/s that dd reports for a direct-I/O write or read of `nbytes` in `chunk`-sized blocks."""
    count = nbytes // chunk
    args = (["if=/dev/zero", f"of={path}", "oflag=direct"] if write else [f"if={path}", "of=/dev/null", "iflag=direct"])
    start = time.perf_counter()
    out = subprocess.run(["dd", *args, f"bs={chunk}", f"count={count}"], capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - start
    found = re.search(r"copied, ([\d.]+) s", out.stderr)
    seconds = float(found.group(1)) if found else elapsed
    return nbytes / seconds / 1e9


def engine_rate(directory: str, kind: str, nbytes: int, chunk: int, in_flight: int) -> tuple[float, float, str]:
    """(write GB/s, read GB/s, which) of the bare engine cycling `in_flight` buffers over one file."""
    engine = open_engine(directory, prefer=kind, max_in_flight=in_flight)
    try:
        buffers = [engine.alloc(chunk) for _ in range(in_flight)]
        for b in buffers:
            b.fill_(0x5A)
        write, read = engine_throughput(engine, os.path.join(directory, f"engine-{kind}.swp"), buffers, nbytes)
        return write, read, engine.which
    finally:
        engine.close()


def store_rate(swap: SwapDir, kind: str, nbytes: int, chunk: int, in_flight: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) through TieredStore: add() every chunk, then the fetch-ahead read loop."""
    os.environ["HETEROFLOW_AIO"] = kind
    with TieredStore(device=Device.cpu(), swap=swap, max_in_flight=in_flight) as store:
        write, read, _ = store_throughput(store, nbytes, chunk)
    return write, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.environ.get("HETEROFLOW_SWAP_DIR", tempfile.gettempdir()))
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    chunk = args.chunk_mib << 20
    nbytes = int(args.gib * 2**30) // chunk * chunk
    kinds = ["threads"]
    module, reason = deepspeed_aio_module()
    if module is not None:
        kinds.insert(0, "deepspeed")
    else:
        print(f"DeepSpeed async_io unavailable: {reason}")
    best: dict[str, list[float]] = {}
    started = time.perf_counter()
    with SwapDir(args.dir) as swap:
        swap.check_free(2 * nbytes)
        dd_file = swap.path / "dd.bin"
        print(f"disk: {swap.path} ({nbytes / 2**30:.2f} GiB per run, {args.chunk_mib} MiB requests, "
              f"{args.in_flight} in flight, best of {args.repeats})")
        for _ in range(args.repeats):  # interleaved, so a busy moment of the shared disk hits every path
            rates = {"dd": (dd(dd_file, nbytes, chunk, write=True), dd(dd_file, nbytes, chunk, write=False))}
            for kind in kinds:
                w, r, which = engine_rate(str(swap.path), kind, nbytes, chunk, args.in_flight)
                rates[f"engine {which}"] = (w, r)
                rates[f"store  {which}"] = store_rate(swap, kind, nbytes, chunk, args.in_flight)
            for key, (w, r) in rates.items():
                old = best.setdefault(key, [0.0, 0.0])
                best[key] = [max(old[0], w), max(old[1], r)]
        dd_file.unlink()
    dd_w, dd_r = best["dd"]
    print(f"{'path':<32} {'write GB/s':>10} {'read GB/s':>10} {'write/dd':>9} {'read/dd':>8}")
    for key, (w, r) in best.items():
        print(f"{key:<32} {w:>10.3f} {r:>10.3f} {w / dd_w:>8.0%} {r / dd_r:>8.0%}")
    print(f"total time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
