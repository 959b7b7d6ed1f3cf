"""Group setup of one rank against the world size: 64 to 4,096 simulated ranks (torch's fake process group).

    python benchmarks/bench_group_setup.py [--worlds 64,256,1024,4096] [--repeats 3]

The plan is `heteroflow.testing.group_setup.three_vendor_groups_job`: NVIDIA, AMD and Ascend stages, tp 8,
the rest dp. For the middle rank of each world it builds the rank's groups twice in the same run:
- `members`: `build_process_groups` as it runs now, `new_group` called for the rank's own groups only;
- `all`: `members_only=False`, `new_group` called for every group of the plan (torch's general rule, what
  every rank did before).
Per world: the plan's groups, the rank's own, the `new_group` calls, the time in them and in all of
`build_process_groups` (the rest is listing the plan's groups in pure Python); the best of `--repeats`,
and each figure's ratio to the 64-rank one. A fake group does no rendezvous: real backends add the
members' handshake to each own group, the same per own group at any world size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from heteroflow.backends import RankMap  # noqa: E402
from heteroflow.testing.group_setup import measure_group_setup, three_vendor_groups_job  # noqa: E402

QUICK = ["--worlds", "64,256", "--repeats", "1"]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="64,256,1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    rows = []
    for world_size in (int(w) for w in args.worlds.split(",")):
        config = three_vendor_groups_job(world_size)
        rank_map = RankMap.from_plan(config.plan, config.cluster)
        rank = world_size // 2 + 5
        for members_only in (True, False):
            runs = [measure_group_setup(rank_map, rank, members_only=members_only) for _ in range(args.repeats)]
            rows.append((min(runs, key=lambda m: m.new_group_s), min(m.total_s for m in runs)))
    print(f"{'world':>6} {'rank':>5} {'mode':>7} {'groups':>6} {'own':>4} {'calls':>6} "
          f"{'new_group ms':>12} {'x64':>6} {'total ms':>9} {'x64':>6}")
    first = {}
    for m, total_s in rows:
        mode = "members" if m.members_only else "all"
        base = first.setdefault(mode, (m.new_group_s, total_s))
        print(f"{m.world_size:>6} {m.rank:>5} {mode:>7} {m.num_groups:>6} {m.num_own:>4} {m.num_new_group_calls:>6} "
              f"{m.new_group_s * 1e3:>12.2f} {m.new_group_s / base[0]:>6.1f} {total_s * 1e3:>9.1f} "
              f"{total_s / base[1]:>6.1f}")


if __name__ == "__main__":
    main()
