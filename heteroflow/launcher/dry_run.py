"""`heteroflow train JOB --dry-run [--rank R ...]`: one local process per chosen rank dry-runs it
(`heteroflow.runtime.dry_run`), one after the other; each prints its report as it finishes.

No device, data or cluster is needed: each process joins a fake world of the plan's size. By default the
first rank, a middle one and the last are run.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback

from heteroflow.config import JobConfig
from heteroflow.errors import UserError
from heteroflow.launcher.prepare import choose_plan
from heteroflow.runtime.dry_run import DryRunReport, dry_run_rank, format_report


def default_ranks(world_size: int) -> list[int]:
    """The first rank, the middle one and the last (fewer in a small world)."""
    return sorted({0, world_size // 2, world_size - 1})


def dry_run_job(job: JobConfig, *, plan_path: str | None, ranks: list[int] | None,
                print_report=print) -> list[tuple[DryRunReport, float]]:
    """Dry-run each of `ranks` (default: `default_ranks`) of the job's plan, each in a fresh process; returns each
    report with its wall time (process start included). A rank whose dry run fails raises `UserError`."""
    plan = choose_plan(job, plan_path)
    world_size = plan.num_devices
    chosen = default_ranks(world_size) if not ranks else ranks
    bad = [r for r in chosen if not 0 <= r < world_size]
    if bad:
        raise UserError(f"--rank: {', '.join(map(str, bad))} not in this plan's ranks 0..{world_size - 1}")
    print_report(f"heteroflow: dry run of ranks {', '.join(map(str, chosen))} of {world_size} "
                 f"({len(plan.stages)} stages, {plan.schedule}); fake world, no device, nothing computed")
    context = multiprocessing.get_context("spawn")  # a fresh torch per rank: one world per process
    out = []
    for rank in chosen:
        started = time.perf_counter()
        with context.Pool(1) as pool:
            ok, value = pool.apply(_run_one, (job, plan, rank))
        wall_s = time.perf_counter() - started
        if not ok:
            raise UserError(f"dry run of rank {rank} failed:\n{value}")
        print_report(format_report(value, wall_s=wall_s))
        out.append((value, wall_s))
    return out


def _run_one(job, plan, rank: int) -> tuple[bool, object]:
    """In the child process: the report, or the failure's traceback as text."""
    try:
        return True, dry_run_rank(job, plan, rank)
    except Exception:
        return False, traceback.format_exc()
