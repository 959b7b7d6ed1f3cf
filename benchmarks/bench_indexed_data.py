"""heteroflow's Megatron dataset samples vs megatron-core's own (GPTDataset / BlendedDataset, C++ helpers).

    python benchmarks/bench_indexed_data.py                  # 3 prefixes, 20k documents each, seq 1024
    python benchmarks/bench_indexed_data.py --docs 5000 --samples 20000

In the same run, on datasets generated here (random documents of 1..2000 tokens, uint16), it times:
- `build`: the train split for the requested samples, one prefix and a 3-prefix weighted blend (heteroflow:
  epochs, document index, stream offsets, shuffle, and for the blend the interleaving as far as read;
  megatron-core: the same through its C++ `build_sample_idx` / `build_blending_indices`, writing its index
  cache as a first run does);
- `read`: `--read` samples (seq + 1 tokens each) taken in training order (heteroflow: as (inputs, labels)
  tensors; megatron-core: its sample dicts), the median of `--repeats` alternated reads;
and checks that the samples read are equal. Ratio = megatron-core time / heteroflow time (> 1: heteroflow faster).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests/data"))


QUICK = ["--docs", "2000", "--seq-length", "64", "--samples", "2000", "--read", "50", "--repeats", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py); at least ~1000 documents, since the weighted blend
asks megatron-core for a test split of 1/1000 of them (with none it never finishes)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20_000, help="documents per prefix")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=200_000, help="samples requested (train_iters * batch)")
    parser.add_argument("--read", type=int, default=5_000, help="samples read and compared")
    parser.add_argument("--repeats", type=int, default=5, help="reads timed per side (median)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    from indexed_helpers import megatron_train_split
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401  (imported before timing)

    from heteroflow.data.blend import train_split
    from heteroflow.data.gpt_samples import train_documents
    from heteroflow.data.indexed import IndexedDataset, IndexedWriter

    with tempfile.TemporaryDirectory() as tmp:
        prefixes = []
        for k in range(3):
            rng = np.random.default_rng(k)
            writer = IndexedWriter(Path(tmp, f"p{k}"), "uint16")
            for length in rng.integers(1, 2000, args.docs):
                writer.add_document(rng.integers(0, 32000, length))
            writer.close()
            prefixes.append(str(Path(tmp, f"p{k}")))
        tokens = sum(IndexedDataset(p).num_tokens for p in prefixes)
        print(f"3 prefixes x {args.docs} documents, {tokens / 1e6:.1f} M tokens; seq_length {args.seq_length}, "
              f"{args.samples} samples requested, {args.read} read")
        print(f"{'case':<28} {'megatron-core s':>16} {'heteroflow s':>13} {'ratio':>7}")
        for name, blend in (("one prefix", [prefixes[0]]),
                            ("blend 0.5/0.3/0.2", ["0.5", prefixes[0], "0.3", prefixes[1], "0.2", prefixes[2]])):
            started = time.perf_counter()
            theirs = megatron_train_split(blend, split="969,30,1", seq_length=args.seq_length, seed=1234,
                                          num_samples=args.samples)
            their_build = time.perf_counter() - started
            started = time.perf_counter()
            weighted = len(blend) > 1
            paths = blend[1::2] if weighted else blend
            datasets = [IndexedDataset(p) for p in paths]
            ours = train_split(datasets, [float(w) for w in blend[0::2]] if weighted else None,
                               documents=[train_documents("969,30,1", len(d)) for d in datasets],
                               seq_length=args.seq_length, seed=1234, num_samples=args.samples)
            our_build = time.perf_counter() - started
            their_times, our_times = [], []
            for _ in range(args.repeats):  # alternated, so both see the same machine load and page cache
                started = time.perf_counter()
                their_rows = [theirs[i]["tokens"] for i in range(args.read)]
                their_times.append(time.perf_counter() - started)
                started = time.perf_counter()
                our_rows = ours.batch(range(args.read))[0]
                our_times.append(time.perf_counter() - started)
            their_read, our_read = statistics.median(their_times), statistics.median(our_times)
            assert all(our_rows[i].tolist() == their_rows[i].tolist() for i in range(args.read)), "samples differ"
            for what, a, b in (("build", their_build, our_build), ("read", their_read, our_read)):
                print(f"{name + ' ' + what:<28} {a:>16.3f} {b:>13.3f} {a / b:>7.2f}")
            if weighted:  # heteroflow interleaves lazily; megatron-core's build above already did all of it
                started = time.perf_counter()
                ours.source(len(ours) - 1)
                print(f"{name + ' interleave all':<28} {'(in build)':>16} {time.perf_counter() - started:>13.3f} "
                      f"{'':>7}  ({len(ours)} samples, Python loop)")
        print(f"samples equal: yes ({args.read} per case)")


if __name__ == "__main__":
    main()
